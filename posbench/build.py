"""Building a run from its config: the device, the evaluation lengths, the task, encoding and model
(validated before any training step), the weights of train.init_from, and the precision the forward
runs in. What posbench.training trains, posbench.evaluation evaluates and the scripts benchmark."""
from __future__ import annotations

import inspect
import os
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from posbench import gpu_slots
from posbench.attention import crossover
from posbench.attention.select import BACKENDS, measured_backend
from posbench.capture import capture_refusal
from posbench.checks import Choice
from posbench.encodings import REGISTRY
from posbench.encodings.base import Encoding, ModelDims
from posbench.guard import GuardResult, check_run, check_training, translate_oom
from posbench.model import ModelConfig, Transformer
from posbench.positions import PositionScheme, position_scheme
from posbench.rundir import CHECKPOINT_FILE, load_checkpoint
from posbench.runinfo import with_added_settings
from posbench.validate import check_built, check_config
from tasks.base import Task


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if str(name).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name} but CUDA is not available here; use device=auto or device=cpu")
    if name == "cuda":  # a job of hydra/launcher=gpus: its slot's GPU
        return gpu_slots.sweep_gpu() or torch.device("cuda")
    return torch.device(name)


def eval_lengths(cfg_eval: DictConfig, train_length: int) -> list[int]:
    if cfg_eval.lengths:
        lengths = sorted({int(n) for n in cfg_eval.lengths})
    else:
        lengths = sorted({max(1, round(float(r) * train_length)) for r in cfg_eval.ratios})
    if not lengths or lengths[0] < 1:
        raise ValueError(f"evaluation lengths must be >= 1, got {lengths}; check eval.lengths / eval.ratios")
    return lengths


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
    guard: GuardResult | None = None  # evaluation batch sizes the memory guard allows (posbench.guard)
    eval_backends: dict[int, str] = field(default_factory=dict)  # length -> auto's choice there, where measured
    backend_table: str | None = None  # the crossover tables auto chose by (device folders, +), None: its rule

    def backend_at(self, length: int) -> str:
        """The backend that evaluates `length` (the training backend unless a crossover table chose)."""
        return self.eval_backends.get(length, self.backend)


def build(cfg: DictConfig, device: torch.device) -> Built:
    """Everything a run needs, validated before any training step."""
    check_config(cfg)
    return build_checked(cfg, device)


def build_checked(cfg: DictConfig, device: torch.device) -> Built:
    """As build, for a config check_config has passed. The memory guard judges the run from its plan (the
    model on the meta device: sizes, no memory) before any table or batch is allocated."""
    plan = plan_run(cfg, device)
    check_training(cfg, plan, device)
    guard = check_run(cfg, plan, device)  # before check_built draws data at the longest length
    torch.manual_seed(cfg.seed)
    encoding = instantiate(cfg.encoding)(dims=plan.encoding.dims)
    torch.manual_seed(cfg.seed + 1)  # the model's initialisation must not depend on the encoding's table size
    model = Transformer(plan.model.cfg, encoding, BACKENDS[plan.backend]()).to(device)
    init_from = str(checkpoint_path(cfg.train.init_from)) if cfg.train.get("init_from") else None
    init_steps, init_config = load_initial_weights(model, init_from, cfg, device) if init_from else (0, None)
    built = replace(plan, encoding=encoding, model=model, init_from=init_from, init_steps=init_steps,
                    init_config=init_config, untrained=int(cfg.train.steps) == 0 and init_from is None, guard=guard)
    with translate_oom(built.lengths[-1], 1, "drawing the evaluation data"):
        check_built(built, cfg)
    return built


def plan_run(cfg: DictConfig, device: torch.device) -> Built:
    """The run as build_checked makes it, its encoding and model on the meta device: every setting checked
    and every tensor's size known, nothing allocated (what posbench.guard estimates from)."""
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
    encoding = planned_encoding(cfg, dims)
    trains = int(cfg.train.steps) > 0
    windowed = model_cfg.window is not None
    backend = measured_backend(cfg.backend.name, encoding, device, task.sequence_length(train_length),
                               cfg.train.compile, trains, windowed)
    eval_backends = {}  # auto by a crossover table, or on CUDA by length: each evaluation length its own
    table = crossover.device_table(device) if cfg.backend.name == "auto" else None
    if cfg.backend.name == "auto" and (table is not None or device.type == "cuda"):
        eval_backends = {length: measured_backend("auto", encoding, device, task.sequence_length(length),
                                                  training=False, windowed=windowed).name for length in lengths}
    if cfg.train.compile == "capture" and trains and (refusal := capture_refusal(train_length, cfg.train.lengths)):
        raise ValueError(refusal)
    if (cfg.train.compile not in (False, "capture") and trains and device.type == "cpu"
            and os.environ.get("ATEN_CPU_CAPABILITY")):
        raise ValueError(f"train.compile={str(cfg.train.compile).lower()} on the CPU under ATEN_CPU_CAPABILITY="
                         f"{os.environ['ATEN_CPU_CAPABILITY']}: torch's inductor fails there (default: its C++ does not "
                         "compile; avx2 on an AVX-512 CPU: NaN at the first step); unset ATEN_CPU_CAPABILITY or set "
                         "train.compile=false")
    with torch.device("meta"):
        model = Transformer(model_cfg, encoding, backend)
    if task.memory:  # evaluation with segment recurrence: refuse before training
        model.check_recurrent()
    backend_table = table.source if table is not None and crossover.has_rows(table.paths, encoding.name) else None
    return Built(task, encoding, model, positions, backend.name, train_length, lengths, eval_backends=eval_backends,
                 backend_table=backend_table)


def planned_encoding(cfg: DictConfig, dims: ModelDims) -> Encoding:
    """The encoding on the meta device, so a table sized by length allocates nothing. A constructor that
    reads tensor values (rope's scalings and cuts compare frequencies) cannot run there: it is built on the
    CPU, where only the small tables of such encodings are made."""
    try:
        with torch.device("meta"):
            return instantiate(cfg.encoding)(dims=dims)
    except (NotImplementedError, RuntimeError) as err:
        if "meta" not in str(err).lower():
            raise
    with torch.device("cpu"):
        return instantiate(cfg.encoding)(dims=dims)


def checkpoint_path(init_from: str) -> Path:
    path = Path(str(init_from)).expanduser()
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"train.init_from={init_from}: no checkpoint there (give a {CHECKPOINT_FILE} "
                                "or the run directory holding one; runs save it unless train.save_checkpoint=false)")
    return path


def encoding_settings(target: str, values: dict) -> dict:
    """Every constructor parameter of the encoding class `target` at its value in `values`, else its default."""
    parameters = inspect.signature(get_class(target)).parameters.values()
    return {p.name: values.get(p.name, p.default) for p in parameters
            if p.name != "dims" and p.kind is not inspect.Parameter.VAR_KEYWORD}


def check_checkpoint_encoding(path: str, saved_encoding: dict, cfg: DictConfig) -> None:
    """The checkpoint holds this run's encoding, or one whose checkpoints it loads (loads_checkpoints_of: drope,
    string and self_extend a rope run's); then the settings both classes take must agree (string's base and
    layout are the rope run's rotation)."""
    target, saved_target = cfg.encoding._target_, saved_encoding.get("_target_")
    if saved_target == target:
        return
    if saved_target not in get_class(target).loads_checkpoints_of:
        loaders = sorted(name for name, cls in REGISTRY.items() if saved_target in cls.loads_checkpoints_of)
        also = f" (or one that loads its checkpoints: {loaders})" if loaders else ""
        raise ValueError(f"train.init_from={path} holds a model with encoding {saved_target}, not {target}: "
                         f"choose the encoding it was trained with{also}")
    ours = encoding_settings(target, OmegaConf.to_container(cfg.encoding, resolve=True))
    theirs = encoding_settings(saved_target, saved_encoding)
    differ = [f"encoding.{key}={value} (checkpoint: {theirs[key]})" for key, value in ours.items()
              if key in theirs and value != theirs[key]]
    if differ:
        raise ValueError(f"train.init_from={path} holds a {saved_target} model; the settings {target} shares with "
                         f"it must be the checkpoint's (its weights were trained with them): {', '.join(differ)}")


def load_initial_weights(model: Transformer, path: str, cfg: DictConfig, device: torch.device) -> tuple[int, dict]:
    """Loads a checkpoint (train.init_from) into the model; returns the training steps it had and its config.

    The checkpoint must hold the same encoding (or one whose checkpoints this one loads) and architecture.
    With train.steps=0 the run only evaluates, so it must keep the checkpoint's N: scalings and ratios
    refer to it."""
    checkpoint = load_checkpoint(Path(path), device, setting="train.init_from")
    saved = checkpoint["config"]
    if not all(isinstance(saved.get(key), dict) for key in ("encoding", "model", "train", "task")):
        raise ValueError(f"train.init_from={path}: its config lacks the encoding, model, train or task section; "
                         "it was not written by a posbench run")
    check_checkpoint_encoding(path, with_added_settings(saved)["encoding"], cfg)
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


def autocast(device: torch.device, precision: str):
    """The context the forward runs in: bf16 autocast, or fp32 as it is."""
    Choice(tuple(PRECISIONS))("train.precision", precision)
    dtype = PRECISIONS[precision]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
