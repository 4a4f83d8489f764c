"""Evaluation at one length: the metrics over fresh sequences, the evaluation speed and peak memory."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from omegaconf import DictConfig

from posbench import distributed, draws
from posbench.attention import BACKENDS
from posbench.build import Built, autocast, sync
from posbench.memory import PeakMemory, return_large_blocks
from posbench.metrics import ROW_METRICS
from posbench.rundir import StopSignals
from posbench.validate import eval_chunk

UNMEASURED = {**dict.fromkeys(ROW_METRICS), "eval_tokens_per_s": None, "peak_mem_mb": None,
              "mem_kind": None, "data_fingerprint": None, "eval_backend": None}  # a length that was not evaluated


@torch.no_grad()
def evaluate(built: Built, length: int, cfg_eval: DictConfig, device: torch.device, precision: str = "fp32",
             stop: StopSignals | None = None, train_digest: str | None = "", draw_batch: int | None = None) -> dict:
    """Metrics over cfg_eval.samples fresh sequences at one length, and tokens/s past the first batch;
    data_fingerprint joins `train_digest` (what the model trained on) with the sequences evaluated here.
    Batches are drawn `draw_batch` sequences at a time (eval.batch_size, but where the guard found its data
    too large) and evaluated cfg_eval.batch_size at a time (the memory guard's, maybe fewer), so a smaller
    evaluation batch alone never changes which sequences are drawn.
    Data-parallel: every rank draws every batch and evaluates its own rows of it; the sums, tokens and
    seconds of the ranks are combined, so the metrics are the one-process metrics."""
    model, task = built.model, built.task
    if built.eval_backends:  # auto by a crossover table: this length's fastest
        model.use_backend(BACKENDS[built.backend_at(length)]())
    model.eval()
    model.set_eval_chunk(eval_chunk(cfg_eval.chunk))
    built.encoding.set_eval_length(task.sequence_length(built.train_length), task.sequence_length(length))
    return_large_blocks()
    memory = PeakMemory(device)
    memory.start()
    gen = draws.generator(int(cfg_eval.seed) + length)
    fingerprint = draws.DataFingerprint()
    totals: dict[str, float] = {}
    timed_tokens, timed_seconds, first, held, drawn = 0, 0.0, None, None, False
    forward_rows = int(cfg_eval.batch_size)
    draw_rows = max(forward_rows, int(draw_batch or forward_rows))
    batches = task.eval_batches(length, int(cfg_eval.samples), draw_rows, gen)
    vote = distributed.StopVote(stop)
    while True:
        vote.check()
        sync(device)
        start = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            break
        drawn = True
        # drawn for the whole batch, on every rank alike; segment recurrence draws none
        positions = None if batch.memory_length else built.positions.for_batch(batch, gen)  # [1, T] or [1, T, 2]
        fingerprint.add(batch, positions)
        batch = distributed.shard(draws.to_device(batch, device))
        positions = None if positions is None else draws.move(positions, device)
        if not batch.inputs.shape[0]:  # fewer rows than ranks: this rank has none of them
            continue
        for block in draws.row_blocks(batch, forward_rows):
            with autocast(device, precision):
                if block.memory_length:  # segment recurrence (wikitext task.memory)
                    logits, held = model.forward_recurrent(block.inputs, None if block.new_stream else held,
                                                           block.memory_length)  # [B, T, V]
                else:
                    logits = model(block.inputs, positions)  # [B, T, V]
            for key, value in task.batch_sums(logits.float(), block).items():
                totals[key] = totals.get(key, 0.0) + float(value)
        sync(device)
        if first is None:  # the first batch is warm-up; kept only if it is the only one
            first = (batch.inputs.numel(), time.perf_counter() - start)
        else:
            timed_tokens += batch.inputs.numel()
            timed_seconds += time.perf_counter() - start
    vote.finish()
    if not drawn:
        raise ValueError(f"{task.name}: no evaluation batches at length {length}")
    if not timed_seconds and first is not None:
        timed_tokens, timed_seconds = first
    ranks = distributed.gather((totals, timed_tokens, timed_seconds, memory.peak()))
    totals = sum_by_key([part[0] for part in ranks])
    timed_tokens = sum(part[1] for part in ranks)
    timed_seconds = max(part[2] for part in ranks)  # the ranks ran side by side
    peaks = [part[3] for part in ranks if part[3] is not None]
    return {**task.finalize(totals), "eval_tokens_per_s": timed_tokens / timed_seconds,
            "peak_mem_mb": max(peaks) if peaks else None, "mem_kind": memory.kind,
            "data_fingerprint": draws.combined(train_digest, fingerprint.digest),
            "eval_backend": built.backend_at(length)}


def sum_by_key(parts: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' metric sums added key by key (a rank that evaluated no recurrent segment lacks their keys)."""
    totals = dict(parts[0])
    for part in parts[1:]:
        for key, value in part.items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


@contextmanager
def evaluation_peaks():
    """The PeakMemory of each stretch `evaluate` measures while open, in the order started: a length's row
    holds its peak (`peak_mem_mb`), the PeakMemory its starting level (`base`), so the two give what the
    length allocated (the memory guard's checks compare it with the estimate)."""
    global PeakMemory
    started: list[PeakMemory] = []
    measuring = PeakMemory

    class Recorded(measuring):
        def start(self) -> None:
            super().start()
            started.append(self)

    PeakMemory = Recorded
    try:
        yield started
    finally:
        PeakMemory = measuring
