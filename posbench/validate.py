"""Every setting of a run checked before the first training step.

`check_config` reads the resolved config alone (types and ranges, each error naming the
key and the valid values); `check_built` runs once the task, encoding and model exist
(the evaluation data at the longest length is built here, so nothing fails only after
training). Encoding and task parameters are checked by their own constructors.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import fields

import torch
from omegaconf import DictConfig, OmegaConf

from posbench import published
from posbench.checks import Choice, Flag, Integer, Items, Real, refuse, shown
from posbench.model import ACTIVATIONS, NORM_POSITIONS, NORMS, ModelConfig, check_window
from posbench.positions import SCHEMES

TRAIN_LENGTH_MODES = ("uniform", "fixed")
SCHEDULES = ("cosine", "linear")  # the decay after warm-up (posbench.runner.learning_rate)
PRECISION_NAMES = ("fp32", "bf16")
DEVICE_FORMS = ("auto", "cpu", "cuda", "cuda:<index>")
ABSENT = object()


def check_choice_value(key: str, value, choices) -> None:
    Choice(tuple(choices))(key, value)


def eval_chunk(setting) -> int | str | None:
    """eval.chunk: auto, a number of queries, or null (every query at once)."""
    if setting is None or setting == "auto":
        return setting
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"eval.chunk={setting!r} is not valid; use auto, a number of queries >= 1, or null")
    return setting


def check_device(key: str, value) -> None:
    name = value if isinstance(value, str) else ""
    index = name.removeprefix("cuda:")
    if name not in DEVICE_FORMS[:3] and not (name.startswith("cuda:") and index.isdigit()):
        raise ValueError(f"{key}={shown(value)} is not valid; choose one of {list(DEVICE_FORMS)}")


def check_resume(key: str, value) -> None:
    if value != "auto" and not isinstance(value, bool):
        refuse(key, value, "auto, true or false")


# Every setting of config.yaml, train/, eval/ and model/ with its rule; a key the config
# lacks (one being added elsewhere) is skipped. Warm-up may exceed train.steps: the rate
# then only ramps up, which a short smoke or evaluation-only (steps=0) run relies on.
SETTINGS = {
    "seed": Integer(0),
    "threads": Integer(1, os.cpu_count() or 1, null="torch's default"),
    "device": check_device,
    "train.length": Integer(1),  # N; task.default_length unless set
    "train.lengths": Choice(TRAIN_LENGTH_MODES),
    "train.steps": Integer(0),  # 0: evaluate only (with train.init_from)
    "train.batch_size": Integer(1),
    "train.lr": Real(above=0),
    "train.warmup_steps": Integer(0),
    "train.min_lr_ratio": Real(least=0, most=1),
    "train.schedule": Choice(SCHEDULES),
    "train.weight_decay": Real(least=0),
    "train.grad_clip": Real(above=0),
    "train.precision": Choice(PRECISION_NAMES),
    "train.compile": Flag(),
    "train.log_every": Integer(1),
    "train.save_checkpoint": Flag(),
    "train.checkpoint_every": Integer(0, null="never"),  # 0 also means never
    "train.resume": check_resume,
    "train.positions": Choice(SCHEMES),
    "train.max_position": Integer(1, null="the longest evaluated sequence"),
    "eval.ratios": Items(Real(above=0)),
    "eval.lengths": Items(Integer(1), null="use eval.ratios"),
    "eval.samples": Integer(1),
    "eval.batch_size": Integer(1),
    "eval.seed": Integer(0),
    "eval.chunk": lambda key, value: eval_chunk(value),
    "model.d_model": Integer(1),
    "model.n_layers": Integer(1),
    "model.n_heads": Integer(1),  # d_model % n_heads: ModelConfig names both
    "model.mlp_ratio": Integer(1),
    "model.causal": Flag(),
    "model.dropout": Real(least=0, below=1),
    "model.activation": Choice(tuple(ACTIVATIONS)),
    "model.norm": Choice(NORMS),
    "model.bias": Flag(),
    "model.norm_position": Choice(NORM_POSITIONS),
    "model.embed_scale": Flag(),
    "model.window": check_window,
}


def check_parameter_names(cfg: DictConfig) -> None:
    """Every key of encoding, task and model is a parameter of what it builds: a key left over
    from another choice (a rope setting with encoding=t5) is named, not a TypeError."""
    from hydra.utils import get_object

    for section in ("encoding", "task"):
        node = cfg.get(section)
        if node is None or "_target_" not in node:
            continue
        signature = inspect.signature(get_object(node._target_))
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
            continue
        valid = sorted(set(signature.parameters) - {"dims"})
        unknown = [key for key in node if not str(key).startswith("_") and key not in valid]
        if unknown:
            raise ValueError(f"{section}.{unknown[0]} is not a parameter of {node._target_}; "
                             f"its parameters: {valid}")
    valid = sorted(f.name for f in fields(ModelConfig) if f.name != "vocab_size")
    unknown = [key for key in cfg.get("model") or {} if key not in valid]
    if unknown:
        raise ValueError(f"model.{unknown[0]} is not a model setting; the settings: {valid}")


def check_config(cfg: DictConfig) -> None:
    """The settings that can be judged from the config alone."""
    check_parameter_names(cfg)
    for key, rule in SETTINGS.items():
        value = OmegaConf.select(cfg, key, default=ABSENT)
        if value is not ABSENT:
            rule(key, value)
    published.parse(cfg.get(published.KEY))
    if cfg.eval.lengths is None:  # the runner takes max(1, round(r * N)): a ratio must not round below 1
        length = cfg.train.length
        short = [r for r in cfg.eval.ratios if round(r * length) < 1]
        if short:
            raise ValueError(f"eval.ratios={shown(cfg.eval.ratios)}: {short} x train.length={length} rounds to "
                             f"length 0; each ratio must give a length >= 1 (ratio >= {0.5 / length:g} here)")


def check_built(built, cfg: DictConfig) -> None:
    """The data a run needs, drawn once before training: one training sequence at N (when it trains)
    and one evaluation sequence at the longest length, so that a missing split, a corpus shorter
    than a window or a length the task cannot draw fails here. One sequence each keeps it cheap;
    own generators leave the run's draws unchanged."""
    task = built.task
    generator = torch.Generator(next(built.model.parameters()).device).manual_seed(int(cfg.eval.seed))
    if cfg.train.steps:
        task.train_sample(1, built.train_length, built.train_length, generator)
    longest = built.lengths[-1]
    batch = next(task.eval_batches(longest, 1, 1, generator), None)
    if batch is None or not batch.inputs.numel():
        raise ValueError(f"{task.name}: no evaluation data at length {longest}; check the task's settings")
