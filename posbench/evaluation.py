"""Evaluation at one length: the metrics over fresh sequences, the evaluation speed and peak memory."""
from __future__ import annotations

import time

import torch
from omegaconf import DictConfig

from posbench.build import Built, autocast, sync
from posbench.memory import PeakMemory, return_large_blocks
from posbench.metrics import ROW_METRICS
from posbench.rundir import StopSignals
from posbench.validate import eval_chunk

UNMEASURED = {**dict.fromkeys(ROW_METRICS), "eval_tokens_per_s": None, "peak_mem_mb": None,
              "mem_kind": None}  # a length that was not evaluated


@torch.no_grad()
def evaluate(built: Built, length: int, cfg_eval: DictConfig, device: torch.device, precision: str = "fp32",
             stop: StopSignals | None = None) -> dict:
    """Metrics over cfg_eval.samples fresh sequences at one length, and tokens/s past the first batch."""
    model, task = built.model, built.task
    model.eval()
    model.set_eval_chunk(eval_chunk(cfg_eval.chunk))
    built.encoding.set_eval_length(task.sequence_length(built.train_length), task.sequence_length(length))
    return_large_blocks()
    memory = PeakMemory(device)
    memory.start()
    gen = torch.Generator(device).manual_seed(int(cfg_eval.seed) + length)
    totals: dict[str, float] = {}
    timed_tokens, timed_seconds, first, held = 0, 0.0, None, None
    batches = task.eval_batches(length, int(cfg_eval.samples), int(cfg_eval.batch_size), gen)
    while True:
        if stop is not None:
            stop.check()
        sync(device)
        start = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            break
        with autocast(device, precision):
            if batch.memory_length:  # segment recurrence (wikitext task.memory)
                logits, held = model.forward_recurrent(batch.inputs, None if batch.new_stream else held,
                                                       batch.memory_length)  # [B, T, V]
            else:
                logits = model(batch.inputs, built.positions.for_batch(batch, gen))  # [B, T, V]
        sums = task.batch_sums(logits.float(), batch)
        sync(device)
        if first is None:  # the first batch is warm-up; kept only if it is the only one
            first = (batch.inputs.numel(), time.perf_counter() - start)
        else:
            timed_tokens += batch.inputs.numel()
            timed_seconds += time.perf_counter() - start
        for key, value in sums.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    if first is None:
        raise ValueError(f"{task.name}: no evaluation batches at length {length}")
    if not timed_seconds:
        timed_tokens, timed_seconds = first
    return {**task.finalize(totals), "eval_tokens_per_s": timed_tokens / timed_seconds,
            "peak_mem_mb": memory.peak(), "mem_kind": memory.kind}
