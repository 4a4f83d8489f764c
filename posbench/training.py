"""Training at N: the learning-rate schedule, the optimizer, one training step, the loop that
trains to train.steps with checkpoints (its progress, the RNG states) and stops at a signal."""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from posbench import distributed, draws
from posbench.build import Built, autocast, sync
from posbench.capture import CapturedSteps
from posbench.rundir import CHECKPOINT_FILE, Status, StopRequest, StopSignals, save_torch
from tasks.base import Task

TIMING_WARMUP_STEPS = 10
STATIC_SHAPES = 64  # train.compile=static: graphs kept per model (a uniform length draw at N <= 64 uses N)


class TrainSettings(dict):
    """train.* as plain values, read once per run: a DictConfig's attribute costs microseconds, and the training
    loop reads a dozen a step (the learning rate's alone took 44 us a step, 3 us from these)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def learning_rate(step: int, cfg_train: DictConfig) -> float:
    """Linear warm-up, then decay from lr to lr * min_lr_ratio at train.steps: cosine, or linear
    (train.schedule; HF Trainer's "linear", its "polynomial" at power 1)."""
    if step < cfg_train.warmup_steps:
        return cfg_train.lr * (step + 1) / cfg_train.warmup_steps
    progress = min(1.0, (step - cfg_train.warmup_steps) / max(1, cfg_train.steps - cfg_train.warmup_steps))
    left = 1 - progress if cfg_train.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg_train.lr * (cfg_train.min_lr_ratio + (1 - cfg_train.min_lr_ratio) * left)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate; a tensor one (a capturable AdamW's: posbench.capture) is filled in place,
    where the recorded graphs read it."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def make_optimizer(model: torch.nn.Module, cfg_train: DictConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases, norms and the encoding's own parameters. Under train.compile=capture on
    CUDA it is `capturable` (its step counts on the device, its learning rate a tensor: posbench.capture)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("encoding")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n.startswith("encoding")]
    capturable = cfg_train.get("compile") == "capture" and next(model.parameters()).is_cuda
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg_train.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg_train.lr, betas=(0.9, 0.98),
                             capturable=capturable)


def train_step(model, forward, task: Task, batch, positions: torch.Tensor, optimizer, cfg_train: DictConfig,
               device: torch.device, static_gradients: bool = False) -> tuple[torch.Tensor, dict]:
    """One optimisation step (forward, loss, backward, clip, AdamW) -> (loss, the batch's metric sums).
    `forward` is the model or its compiled form; the runner and the benchmark both step with this.
    Data-parallel: `batch` is this rank's rows, `forward` the DDP model, and the loss this rank's share
    of the global batch's mean (posbench.distributed.global_mean). `static_gradients`: the gradients are
    zeroed in place, not freed (a captured step reads and writes the same tensors: posbench.capture)."""
    with autocast(device, cfg_train.precision):
        logits = forward(batch.inputs, positions)  # [B, T, V]
    sums = task.batch_sums(logits.float(), batch)
    loss = distributed.global_mean(sums["loss_sum"], sums["tokens"])
    optimizer.zero_grad(set_to_none=not static_gradients)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg_train.grad_clip)
    optimizer.step()
    return loss, sums


def compiled(model: torch.nn.Module, mode, device: torch.device, flex: bool = False):
    """The model's forward for train.compile=mode: as it is (false), one graph with dynamic shapes (true),
    a graph per shape (static: each training length compiles once, and FlexAttention's masks see
    fixed sizes), or graphs: each shape recorded once as a CUDA graph and replayed (on CUDA: the launches
    of a small model's hundreds of kernels become one), from one dynamic graph, or a graph per shape when
    the model attends with `flex`; on the CPU the graph alone."""
    if mode is False or mode == "capture":  # capture records the uncompiled step (posbench.capture)
        return model
    static = mode == "static" or mode == "graphs" and flex
    if static:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, STATIC_SHAPES)
    graphs = mode == "graphs" and device.type == "cuda"
    return torch.compile(model, dynamic=not static, mode="reduce-overhead" if graphs else None)


def begin_step(mode, device: torch.device) -> None:
    """Marks a new training step for the CUDA graphs of train.compile=graphs: the last step's outputs
    (read before this) may be overwritten by the next replay."""
    if mode == "graphs" and device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()


@dataclass
class TrainProgress:
    """Where training stands; saved in every checkpoint so a resumed run continues the same sums."""
    step: int = 0  # steps completed
    loss: float = float("nan")  # the last logged loss
    status: str = "ok"  # ok | diverged
    seconds: float = 0.0  # wall time in training, over every segment of a resumed run
    timed_tokens: int = 0  # tokens and seconds after each segment's warm-up steps
    timed_seconds: float = 0.0
    data_digest: str | None = ""  # the batches trained on so far (draws.DataFingerprint); None: unknown

    def tokens_per_s(self) -> float | None:
        return self.timed_tokens / self.timed_seconds if self.timed_seconds else None


def rng_state(generators: dict[str, torch.Generator]) -> dict:
    state = {"torch": torch.get_rng_state(), **{name: gen.get_state() for name, gen in generators.items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, generators: dict[str, torch.Generator]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    for name, gen in generators.items():
        gen.set_state(state[name].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


class Checkpointer:
    """<run dir>/checkpoint.pt: the model, the resolved config and the steps trained (what
    train.init_from reads), plus in mid-training the optimizer, every RNG state and the progress."""

    def __init__(self, run_dir: Path, resolved: dict, init_steps: int):
        self.path = Path(run_dir) / CHECKPOINT_FILE
        self.resolved, self.init_steps = resolved, init_steps

    def save(self, model, progress: TrainProgress, optimizer=None, generators=None) -> None:
        if not distributed.is_main():  # data-parallel: every rank holds the same state; rank 0 writes it
            return
        state = {"model": model.state_dict(), "config": self.resolved, "steps": self.init_steps + progress.step,
                 "progress": asdict(progress)}
        if optimizer is not None:
            state |= {"optimizer": optimizer.state_dict(), "rng": rng_state(generators)}
        save_torch(state, self.path)


def bar_interval() -> float:
    """Seconds between progress-bar updates: every second on a terminal, every half minute into a
    log file (a sweep's jobs, a batch scheduler), which would otherwise grow a line a second."""
    return 1.0 if sys.stderr.isatty() else 30.0


def train(built: Built, cfg: DictConfig, device: torch.device, logger, checkpointer: Checkpointer,
          stop: StopSignals, status: Status, resume: dict | None = None) -> TrainProgress:
    """Trains to train.steps (from `resume`, a mid-training checkpoint, when given), saving a
    checkpoint every train.checkpoint_every steps and when a stop signal comes."""
    model, task, cfg_train = built.model, built.task, TrainSettings(OmegaConf.to_container(cfg.train, resolve=True))
    model.train()
    optimizer = make_optimizer(model, cfg_train)
    forward = compiled(distributed.wrap(model, device), cfg_train.compile, device, flex=built.backend == "flex")
    generators = {"data": draws.generator(cfg.seed), "length": draws.generator(cfg.seed)}
    progress = TrainProgress()
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        set_rng_state(resume["rng"], generators)
        progress = TrainProgress(**{"data_digest": None, **resume["progress"]})  # older checkpoints: unknown
    captured = None
    if cfg_train.compile == "capture":
        captured = CapturedSteps(model, optimizer, lambda batch, positions: train_step(
            model, forward, task, batch, positions, optimizer, cfg_train, device, static_gradients=True), device)
    fingerprint = draws.DataFingerprint(progress.data_digest) if progress.data_digest is not None else None
    checkpoint_every = int(cfg_train.get("checkpoint_every") or 0)
    segment_start = time.perf_counter()
    timer_step, timer_start = progress.step + TIMING_WARMUP_STEPS, None  # each segment warms up again

    def stop_timer() -> bool:
        nonlocal timer_start
        running = timer_start is not None
        if running:
            sync(device)
            progress.timed_seconds += time.perf_counter() - timer_start
            timer_start = None
        return running

    def save_here() -> None:
        nonlocal timer_start
        running = stop_timer()  # saving is not training time
        elapsed = time.perf_counter() - segment_start
        checkpointer.save(model, replace(progress, seconds=progress.seconds + elapsed), optimizer, generators)
        status.update(phase="train", step=progress.step, checkpoint_step=progress.step)
        if running:
            timer_start = time.perf_counter()

    vote = distributed.StopVote(stop)
    bar = tqdm(range(progress.step, cfg_train.steps), initial=progress.step, total=cfg_train.steps,
               desc=f"train {built.encoding.name}/{task.name} N={built.train_length}", dynamic_ncols=True,
               mininterval=bar_interval(), disable=not distributed.is_main())
    try:
        for step in bar:
            vote.check()
            distributed.seed_rank_stream(cfg.seed, step)
            if step == timer_step:
                sync(device)
                timer_start = time.perf_counter()
            length = built.train_length
            if cfg_train.lengths == "uniform":
                length = int(torch.randint(1, built.train_length + 1, (1,), generator=generators["length"]))
            batch = task.train_sample(cfg_train.batch_size, length, built.train_length, generators["data"])
            set_learning_rate(optimizer, learning_rate(step, cfg_train))
            built.encoding.set_train_step(step, cfg_train.steps)
            positions = built.positions.for_batch(batch, generators["data"])  # [1, T] or [1, T, 2]
            if fingerprint is not None:
                fingerprint.add(batch, positions)
                progress.data_digest = fingerprint.digest
            batch, positions = draws.to_device(batch, device), draws.move(positions, device)
            begin_step(cfg_train.compile, device)
            if captured is not None:
                _, sums = captured(batch, positions, built.encoding.train_phase())
            else:
                _, sums = train_step(model, forward, task, distributed.shard(batch), positions, optimizer, cfg_train,
                                     device)
            if timer_start is not None:
                progress.timed_tokens += batch.inputs.numel()  # the global batch: the tokens/s of every rank
            progress.step = step + 1
            if step % cfg_train.log_every == 0 or step == cfg_train.steps - 1:
                sums = distributed.all_sum(sums)  # the global batch's: every rank judges divergence alike
                progress.loss = (sums["loss_sum"] / sums["tokens"]).item()
                if not math.isfinite(progress.loss):
                    progress.status = "diverged"
                    print(f"\ntraining diverged at step {step} (loss {progress.loss}); stopping and recording it")
                    break
                token_acc = (sums["correct"] / sums["tokens"]).item()
                bar.set_postfix(loss=f"{progress.loss:.3f}", acc=f"{token_acc:.3f}", n=length, refresh=False)
                logger.log_train(step, {"loss": progress.loss, "token_acc": token_acc, "length": length,
                                        "lr": optimizer.param_groups[0]["lr"]})
                status.update(phase="train", step=progress.step)
            if checkpoint_every and progress.step % checkpoint_every == 0 and progress.step < cfg_train.steps:
                save_here()
    except StopRequest:
        save_here()
        raise
    finally:
        bar.close()
    vote.finish()
    stop_timer()
    progress.seconds += time.perf_counter() - segment_start
    return progress
