"""Build (task, encoding, model) from a config, train at N, evaluate length by length.

Each evaluated length becomes one result row, written to the run directory at once; the
run's status.json says where it stands, and the same command pointed at the same directory
resumes an unfinished run (posbench.rundir: the lock, status, atomic files, checkpoints, signals).
"""
from __future__ import annotations

import math
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from posbench.attention import get_backend
from posbench.encodings.base import Encoding, ModelDims
from posbench.loggers import build_logger
from posbench.memory import PeakMemory, return_large_blocks
from posbench.model import ModelConfig, Transformer
from posbench.positions import PositionScheme, position_scheme
from posbench.results import ROW_FILE, RowWriter, plot_run
from posbench.rundir import (
    CHECKPOINT_FILE,
    FINAL_STATES,
    RunLock,
    Status,
    StopRequest,
    StopSignals,
    atomic_write,
    describe,
    load_checkpoint,
    read_status,
    save_torch,
)
from posbench.runinfo import RunInfo, config_hash, group_config, with_added_settings
from posbench.validate import check_built, check_choice_value, check_config, eval_chunk
from tasks.base import Task

TIMING_WARMUP_STEPS = 10
HYDRA_SUBDIR = ".hydra"  # where the runner writes Hydra's record of an accepted command
UNMEASURED = {"exact_match": None, "token_acc": None, "loss": None, "eval_tokens_per_s": None,
              "peak_mem_mb": None, "mem_kind": None}  # a length that was not evaluated


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(name).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name} but CUDA is not available here; use device=auto or device=cpu")
    return torch.device(name)


def eval_lengths(cfg_eval: DictConfig, train_length: int) -> list[int]:
    if cfg_eval.lengths:
        lengths = sorted({int(n) for n in cfg_eval.lengths})
    else:
        lengths = sorted({max(1, round(float(r) * train_length)) for r in cfg_eval.ratios})
    if not lengths or lengths[0] < 1:
        raise ValueError(f"evaluation lengths must be >= 1, got {lengths}; check eval.lengths / eval.ratios")
    return lengths


def learning_rate(step: int, cfg_train: DictConfig) -> float:
    """Linear warm-up, then decay from lr to lr * min_lr_ratio at train.steps: cosine, or linear
    (train.schedule; HF Trainer's "linear", its "polynomial" at power 1)."""
    if step < cfg_train.warmup_steps:
        return cfg_train.lr * (step + 1) / cfg_train.warmup_steps
    progress = min(1.0, (step - cfg_train.warmup_steps) / max(1, cfg_train.steps - cfg_train.warmup_steps))
    left = 1 - progress if cfg_train.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg_train.lr * (cfg_train.min_lr_ratio + (1 - cfg_train.min_lr_ratio) * left)


def git_commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
        if sha.returncode:
            return "unknown"
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Built:
    task: Task
    encoding: Encoding
    model: Transformer
    positions: PositionScheme
    backend: str  # the backend actually used (backend=auto resolved)
    train_length: int
    lengths: list[int]
    init_from: str | None = None  # the checkpoint loaded before training (train.init_from)
    init_steps: int = 0  # its training steps
    init_config: dict | None = None  # its resolved config (the run is grouped by it, not by the path)
    untrained: bool = False  # train.steps=0 without train.init_from: the fresh initialisation is evaluated


def build(cfg: DictConfig, device: torch.device) -> Built:
    """Everything a run needs, validated before any training step."""
    check_config(cfg)
    task: Task = instantiate(cfg.task, _partial_=True)()  # a bad task.<param>: its own ValueError, unwrapped
    train_length = int(cfg.train.length)
    lengths = eval_lengths(cfg.eval, train_length)
    positions = position_scheme(task, cfg.train.positions, cfg.train.max_position, [train_length, *lengths])
    model_cfg = ModelConfig(vocab_size=task.vocab_size, **OmegaConf.to_container(cfg.model))
    if task.causal != model_cfg.causal:  # a decoder layout read bidirectionally would see its answers
        raise ValueError(f"task.causal={task.causal} but model.causal={model_cfg.causal}: the task's layout must "
                         "match the model; set model.causal only (the task follows it by default)")
    dims = ModelDims(d_model=model_cfg.d_model, n_heads=model_cfg.n_heads, n_layers=model_cfg.n_layers,
                     **positions.model_extents(task, train_length), causal=model_cfg.causal,
                     vocab_size=task.vocab_size)
    torch.manual_seed(cfg.seed)
    encoding = instantiate(cfg.encoding)(dims=dims)
    torch.manual_seed(cfg.seed + 1)  # the model's initialisation must not depend on the encoding's table size
    backend = get_backend(cfg.backend.name, encoding, device)
    if backend.name == "flex" and device.type == "cpu" and int(cfg.train.steps) > 0:
        raise ValueError("backend=flex trains on CUDA only; on CPU it evaluates (train.steps=0 with "
                         "train.init_from); use backend=sdpa or auto for training")
    model = Transformer(model_cfg, encoding, backend).to(device)
    if task.memory:  # evaluation with segment recurrence: refuse before training
        model.check_recurrent()
    init_from = str(checkpoint_path(cfg.train.init_from)) if cfg.train.get("init_from") else None
    init_steps, init_config = load_initial_weights(model, init_from, cfg, device) if init_from else (0, None)
    built = Built(task, encoding, model, positions, backend.name, train_length, lengths, init_from, init_steps,
                  init_config, untrained=int(cfg.train.steps) == 0 and init_from is None)
    check_built(built, cfg)
    return built


def checkpoint_path(init_from: str) -> Path:
    path = Path(str(init_from)).expanduser()
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"train.init_from={init_from}: no checkpoint there (give a {CHECKPOINT_FILE} "
                                "or the run directory holding one; runs save it unless train.save_checkpoint=false)")
    return path


def load_initial_weights(model: Transformer, path: str, cfg: DictConfig, device: torch.device) -> tuple[int, dict]:
    """Loads a checkpoint (train.init_from) into the model; returns the training steps it had and its config.

    The checkpoint must hold the same encoding and architecture. With train.steps=0 the
    run only evaluates, so it must keep the checkpoint's N: scalings and ratios refer to it."""
    checkpoint = load_checkpoint(Path(path), device)
    saved = checkpoint["config"]
    if not all(isinstance(saved.get(key), dict) for key in ("encoding", "model", "train", "task")):
        raise ValueError(f"train.init_from={path}: its config lacks the encoding, model, train or task section; "
                         "it was not written by a posbench run")
    if saved["encoding"].get("_target_") != cfg.encoding._target_:
        raise ValueError(f"train.init_from={path} holds a model with encoding {saved['encoding']['_target_']}, "
                         f"not {cfg.encoding._target_}: choose the encoding it was trained with")
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    differ = [f"model.{key}={model_cfg.get(key)} (checkpoint: {value})"
              for key, value in with_added_settings(saved)["model"].items() if model_cfg.get(key) != value]
    if differ:
        raise ValueError(f"train.init_from={path} was trained with another model: {', '.join(differ)}")
    if cfg.train.steps == 0 and int(saved["train"]["length"]) != int(cfg.train.length):
        raise ValueError(f"train.length={cfg.train.length} but {path} was trained at N={saved['train']['length']}; "
                         "an evaluation-only run (train.steps=0) must keep the checkpoint's N")
    try:
        model.load_state_dict(checkpoint["model"])
    except RuntimeError as err:  # names the missing, unexpected and mis-shaped tensors
        raise ValueError(f"train.init_from={path} does not fit this model (the task's vocabulary and the "
                         f"encoding's parameters must match the checkpoint's, task {saved['task']['_target_']}): "
                         f"{err}") from err
    return int(checkpoint.get("steps", saved["train"]["steps"])), saved


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def make_optimizer(model: torch.nn.Module, cfg_train: DictConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases, norms and the encoding's own parameters."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("encoding")]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n.startswith("encoding")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg_train.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg_train.lr, betas=(0.9, 0.98))


def autocast(device: torch.device, precision: str):
    """The context the forward runs in: bf16 autocast, or fp32 as it is."""
    check_choice_value("train.precision", precision, PRECISIONS)
    dtype = PRECISIONS[precision]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def train_step(model, forward, task: Task, batch, positions: torch.Tensor, optimizer, cfg_train: DictConfig,
               device: torch.device) -> tuple[torch.Tensor, dict]:
    """One optimisation step (forward, loss, backward, clip, AdamW) -> (loss, the batch's metric sums).
    `forward` is the model or its compiled form; the runner and the benchmark both step with this."""
    with autocast(device, cfg_train.precision):
        logits = forward(batch.inputs, positions)  # [B, T, V]
    sums = task.batch_sums(logits.float(), batch)
    loss = sums["loss_sum"] / sums["tokens"]
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg_train.grad_clip)
    optimizer.step()
    return loss, sums


def compiled(model: torch.nn.Module, enabled: bool):
    """The model's forward, through torch.compile when asked (dynamic shapes: lengths vary)."""
    return torch.compile(model, dynamic=True) if enabled else model


@dataclass
class TrainProgress:
    """Where training stands; saved in every checkpoint so a resumed run continues the same sums."""
    step: int = 0  # steps completed
    loss: float = float("nan")  # the last logged loss
    status: str = "ok"  # ok | diverged
    seconds: float = 0.0  # wall time in training, over every segment of a resumed run
    timed_tokens: int = 0  # tokens and seconds after each segment's warm-up steps
    timed_seconds: float = 0.0

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
    model, task, cfg_train = built.model, built.task, cfg.train
    model.train()
    optimizer = make_optimizer(model, cfg_train)
    forward = compiled(model, cfg_train.compile)
    generators = {"data": torch.Generator(device).manual_seed(cfg.seed),
                  "length": torch.Generator().manual_seed(cfg.seed)}
    progress = TrainProgress()
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        set_rng_state(resume["rng"], generators)
        progress = TrainProgress(**resume["progress"])
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

    bar = tqdm(range(progress.step, cfg_train.steps), initial=progress.step, total=cfg_train.steps,
               desc=f"train {built.encoding.name}/{task.name} N={built.train_length}", dynamic_ncols=True,
               mininterval=bar_interval())
    try:
        for step in bar:
            stop.check()
            if step == timer_step:
                sync(device)
                timer_start = time.perf_counter()
            length = built.train_length
            if cfg_train.lengths == "uniform":
                length = int(torch.randint(1, built.train_length + 1, (1,), generator=generators["length"]))
            batch = task.train_sample(cfg_train.batch_size, length, built.train_length, generators["data"])
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, cfg_train)
            positions = built.positions.for_batch(batch, generators["data"])  # [1, T] or [1, T, 2]
            loss, sums = train_step(model, forward, task, batch, positions, optimizer, cfg_train, device)
            if timer_start is not None:
                progress.timed_tokens += batch.inputs.numel()
            progress.step = step + 1
            if step % cfg_train.log_every == 0 or step == cfg_train.steps - 1:
                progress.loss = loss.item()
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
    stop_timer()
    progress.seconds += time.perf_counter() - segment_start
    return progress


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


def error_text(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


def run_identity(resolved: dict) -> str:
    """The hash that tells this run from another in the same directory: its group, seed and init_from."""
    return config_hash({**group_config(resolved), "seed": resolved.get("seed"),
                        "init_from": resolved.get("train", {}).get("init_from")})


def claim(run_dir: Path, identity: str, resume_setting) -> dict | None:
    """One run per directory. -> the status record of this run to continue, or None to start afresh.
    Refuses a directory that holds another run's rows or checkpoint."""
    status = read_status(run_dir)
    holds = [name for name in (ROW_FILE, CHECKPOINT_FILE) if (run_dir / name).exists()]
    if status is not None and status.get("identity") == identity:
        if resume_setting is False:
            raise ValueError(f"{run_dir} holds this run already ({describe(status)}); train.resume=false refuses "
                             "to continue it: choose another hydra.run.dir, or train.resume=auto to continue it")
        return status
    if holds:
        owner = f"run {status.get('run_name')} (identity {status.get('identity')})" if status else "another run"
        raise ValueError(f"{run_dir} holds {', '.join(holds)} of {owner}, not of this configuration (identity "
                         f"{identity}); one directory holds one run: choose another hydra.run.dir, or repeat that "
                         "run's own settings to resume it")
    if resume_setting is True:
        raise ValueError(f"train.resume=true but {run_dir} holds no run to resume; give the run directory of the "
                         "run to continue (hydra.run.dir=...) with its settings, or train.resume=auto")
    return None


def run(cfg: DictConfig, run_dir: str | Path) -> list[dict]:
    """Train and evaluate one configuration; returns its rows, also in run_dir/results.jsonl.

    One process at a time per run directory (rundir.RunLock). The same command pointed at the
    same run directory continues an unfinished run: training from its last checkpoint,
    evaluation at the first length without a row. A command refused before it starts (the
    directory busy or holding another run, or a setting refused while resuming) leaves the
    directory's files as they were; any later error is recorded as `failed` with the error."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    identity = run_identity(resolved)
    with RunLock(run_dir) as lock:
        if lock.stale:
            print(f"taking over {lock.path} from process {lock.stale.get('pid')} on {lock.stale.get('host')} "
                  f"(started {lock.stale.get('started')}): that process is gone")
        previous = claim(run_dir, identity, cfg.train.get("resume", "auto"))
        if previous is not None:
            if previous.get("state") in FINAL_STATES:
                print(f"{run_dir} holds this run, finished ({previous['state']}): nothing to do")
                return RowWriter(run_dir).rows
            print(f"resuming the run in {run_dir}: {describe(previous)}")
        run_id = previous["run_id"] if previous else uuid.uuid4().hex[:12]
        status = Status(run_dir, run_id=run_id, identity=identity,
                        resumed=previous.get("resumed", 0) + 1 if previous else 0)
        try:
            device, built = prepare(cfg)
        except Exception as err:
            if previous is None:  # a fresh directory: the refusal is its record (the report lists it)
                status.fail(error_text(err))
            raise
        if built.untrained:
            print("warning: train.steps=0 without train.init_from evaluates a freshly initialised model; its rows "
                  "carry untrained=true", file=sys.stderr)
        stop = StopSignals()
        with stop.active():
            try:
                rows = run_built(cfg, built, device, run_dir, resolved, status, stop)
            except StopRequest as request:
                status.update(state="killed", signal=request.args[0])
                print(f"\nstopped: {describe(status.record)}; the same command resumes it")
            except Exception as err:  # a full disk, a figure, the logger: failed, with the error
                status.fail(error_text(err))
                raise
    if stop.signum is not None:  # stopped, or complete when it came after the last safe point: the signal
        stop.forward(stop.signum)  # is handed on with the lock released (submitit may requeue the job at once)
    return rows


def prepare(cfg: DictConfig) -> tuple[torch.device, Built]:
    """The process set up (threads, denormals) and the run built; writes nothing."""
    check_config(cfg)  # threads and device are applied before build: refuse bad ones first
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    # CPU: probabilities below 1e-38 (logits ~90 under the row's top, as alibi's far keys) read as 0;
    # kept denormal, they slowed the fused attention backward 2x (alibi, fox) and weighed nothing
    torch.set_flush_denormal(True)
    device = resolve_device(cfg.device)
    return device, build(cfg, device)


def write_hydra_record(cfg: DictConfig, run_dir: Path) -> None:
    """Hydra's record of the command (.hydra/config.yaml, hydra.yaml, overrides.yaml), in a Hydra job
    whose output directory this is. Hydra writes none itself (hydra.output_subdir: null): it would
    write them before the command is checked, so a refused command would rewrite an existing run's."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.instance().cfg  # {"hydra": ...}
    output_dir = OmegaConf.select(hydra_cfg, "hydra.runtime.output_dir", default=None)
    if output_dir is None or Path(output_dir).resolve() != run_dir.resolve():
        return
    folder = run_dir / HYDRA_SUBDIR
    folder.mkdir(exist_ok=True)
    atomic_write(folder / "config.yaml", OmegaConf.to_yaml(cfg))
    atomic_write(folder / "hydra.yaml", OmegaConf.to_yaml(hydra_cfg))
    atomic_write(folder / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))


def write_failed_rows(writer: RowWriter, rows: list[dict]) -> None:
    """Rows that say where the run failed; the status records the failure even where a full disk refuses them."""
    try:
        for row in rows:
            writer.write(row)
    except OSError as err:
        print(f"warning: could not write the failed rows to {writer.path}: {error_text(err)}", file=sys.stderr)


def run_built(cfg: DictConfig, built: Built, device: torch.device, run_dir: Path, resolved: dict, status: Status,
              stop: StopSignals) -> list[dict]:
    info = run_info(cfg, built, device, status.record["run_id"], resolved)
    writer = RowWriter(run_dir, keep=lambda row: row["run_id"] == info.run_id and row["status"] == "ok")
    status.update(config_hash=info.config_hash, run_name=info.run_name, steps=int(cfg.train.steps),
                  lengths=built.lengths, lengths_done=[r["eval_length"] for r in writer.rows])
    write_hydra_record(cfg, run_dir)
    atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    checkpointer = Checkpointer(run_dir, resolved, built.init_steps)
    saved = load_checkpoint(checkpointer.path, device) if checkpointer.path.exists() else None
    if saved is not None and run_identity(saved["config"]) != status.record["identity"]:
        raise ValueError(f"{checkpointer.path} belongs to another run; remove it or choose another hydra.run.dir")
    logger = build_logger(cfg.logger, info.flat_config(resolved), info.run_name, run_dir, info.run_id)
    print(f"{info.run_name}: {info.n_params:,} parameters on {device}; evaluating lengths {built.lengths}; "
          f"writing {run_dir}")
    try:
        if saved is not None and "optimizer" not in saved:  # training had ended: evaluate what is missing
            built.model.load_state_dict(saved["model"])
            trained = TrainProgress(**saved["progress"])
        else:
            trained = train(built, cfg, device, logger, checkpointer, stop, status, saved)
            if trained.status == "ok" and trained.step:
                checkpointer.save(built.model, trained)  # the trained model, kept for the evaluation to resume
    except Exception as err:
        info.train_steps = status.record.get("step", 0)
        write_failed_rows(writer, [length_row(info, built, cfg, length) | failed_fields(err)
                                   for length in built.lengths])
        raise
    info.train_steps, info.train_seconds = trained.step, round(trained.seconds, 2)
    info.train_tokens_per_s = trained.tokens_per_s()
    done = {row["eval_length"]: row for row in writer.rows}
    rows = []
    for length in tqdm(built.lengths, desc="evaluate", dynamic_ncols=True, mininterval=bar_interval()):
        if length in done:
            rows.append(done[length])
            continue
        status.update(phase="evaluate", length=length)
        row = length_row(info, built, cfg, length)
        if trained.status == "diverged":
            row |= {"status": "diverged", **UNMEASURED}
        else:
            try:
                row |= {"status": "ok", **evaluate(built, length, cfg.eval, device, cfg.train.precision, stop)}
            except Exception as err:
                write_failed_rows(writer, [row | failed_fields(err)])
                raise
        writer.write(row)
        logger.log_eval(row)
        rows.append(row)
        status.update(lengths_done=[r["eval_length"] for r in rows])
    if not cfg.train.save_checkpoint:
        checkpointer.path.unlink(missing_ok=True)
    status.update(phase="figures", length=None)
    curve = run_dir / "curve.png"
    plot_run(rows, curve)
    built.task.write_figures(rows, run_dir)
    logger.finish(rows, curve, trained.status)
    status.update(state=trained.status, phase="done")
    print(closing_table(info, run_dir, rows, trained), flush=True)
    return rows


def failed_fields(err: Exception) -> dict:
    return {"status": f"failed: {error_text(err)}"[:500], **UNMEASURED}


def run_info(cfg: DictConfig, built: Built, device: torch.device, run_id: str, resolved: dict) -> RunInfo:
    init = None
    if built.init_config is not None:  # grouped by what the checkpoint is, not where it lies
        init = {"config_hash": config_hash(group_config(built.init_config)), "seed": built.init_config.get("seed"),
                "steps": built.init_steps}
    config = group_config(resolved, init)
    return RunInfo(
        run_id=run_id, config_hash=config_hash(config),
        run_name=cfg.run_name or f"{built.encoding.name}-{built.task.name}-N{built.train_length}-s{cfg.seed}",
        encoding=built.encoding.name, encoding_params=built.encoding.params(), task=built.task.name,
        task_params=built.task.params(), model=OmegaConf.to_container(cfg.model),
        n_params=sum(p.numel() for p in built.model.parameters()), backend=built.backend, seed=int(cfg.seed),
        train_length=built.train_length, train_sequence_length=built.task.sequence_length(built.train_length),
        train_lengths=cfg.train.lengths, positions=built.positions.scheme, max_position=built.positions.max_position,
        device=str(device), torch=torch.__version__, git_commit=git_commit(), init_from=built.init_from,
        init_steps=built.init_steps, untrained=built.untrained, config=config)


def length_row(info: RunInfo, built: Built, cfg: DictConfig, length: int) -> dict:
    return {**info.row(), "eval_length": length, "eval_sequence_length": built.task.sequence_length(length),
            "ratio": length / built.train_length, "samples": int(cfg.eval.samples),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


TABLE_METRICS = ("exact_match", "token_acc", "loss", "perplexity", "sliding_perplexity", "recurrent_perplexity",
                 "bits_per_byte")


def closing_table(info: RunInfo, run_dir: Path, rows: list[dict], trained: TrainProgress) -> str:
    """The run's closing summary, headed by its name and directory: printed in one write, so the tables
    of parallel jobs (a joblib sweep) neither interleave nor lose their run."""
    speed = trained.tokens_per_s()
    lines = [f"\n{info.run_name} ({run_dir}): status {trained.status}"
             + (" (untrained: train.steps=0 without train.init_from)" if info.untrained else "")
             + f"; {trained.step} training steps in {trained.seconds:.0f} s"
             + (f"; train {speed:,.0f} tokens/s" if speed else "")]
    measured = [r for r in rows if r["status"] == "ok"]
    metrics = [m for m in TABLE_METRICS if measured and measured[0].get(m) is not None]
    header = f"{'length':>7} {'ratio':>6} " + " ".join(f"{m:>11}" for m in metrics) + f" {'eval tok/s':>11}"
    lines += [header, "-" * len(header)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['eval_length']:>7} {r['ratio']:>6.2f} {r['status']}")
            continue
        values = " ".join(f"{r[m]:>11.4f}" for m in metrics)
        lines.append(f"{r['eval_length']:>7} {r['ratio']:>6.2f} {values} {r['eval_tokens_per_s']:>11,.0f}")
    return "\n".join(lines)
