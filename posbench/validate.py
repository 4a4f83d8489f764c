"""Every setting of a run checked before the first training step.

`check_config` reads the resolved config alone (types and ranges, each error naming the
key and the valid values); `check_built` runs once the task, encoding and model exist
(the evaluation data at the longest length is built here, so nothing fails only after
training). The settings and their rules are declared once, in posbench.settings; encoding and
task parameters are checked by their own constructors.
"""
from __future__ import annotations

import inspect

from omegaconf import DictConfig, OmegaConf

from posbench import draws, settings
from posbench.checks import shown
from posbench.settings import DEVICE_FORMS, PRECISION_NAMES, SCHEDULES, TRAIN_LENGTH_MODES  # noqa: F401 (re-exported)
from posbench.settings import PARAMETER_SECTIONS, SECTIONS, SETTINGS

ABSENT = object()
# Every setting with its rule, derived from posbench.settings (the one declaration): dotted key -> rule(key, value).
# A key the config lacks (one being added elsewhere, logger.project with logger=none) is skipped. Warm-up may
# exceed train.steps: the rate then only ramps up, which a short smoke or evaluation-only (steps=0) run relies on.
RULES = {s.key: s.rule for s in SETTINGS}


def eval_chunk(setting) -> int | str | None:
    """eval.chunk: auto, a number of queries, or null (every query at once)."""
    return settings.BY_KEY["eval.chunk"].check(setting)


def check_device(key: str, value) -> None:
    settings.Device()(key, value)


def check_resume(key: str, value) -> None:
    settings.Resume()(key, value)


def check_parameter_names(cfg: DictConfig) -> None:
    """Every key of encoding and task is a parameter of what it builds: a key left over from another
    choice (a rope setting with encoding=t5) is named, not a TypeError."""
    from hydra.utils import get_object

    for section in PARAMETER_SECTIONS:
        node = cfg.get(section)
        if node is None or "_target_" not in node:
            continue
        signature = inspect.signature(get_object(node._target_))
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
            continue
        valid = sorted(set(signature.parameters) - {"dims"})
        unknown = [key for key in node if not str(key).startswith("_") and key not in valid]
        if unknown:
            near = settings.nearest(f"{section}.{unknown[0]}", [f"{section}.{name}" for name in valid])
            raise ValueError(f"{section}.{unknown[0]} is not a parameter of {node._target_}; its parameters: "
                             f"{valid}" + (f"; did you mean {' or '.join(near)}?" if near else ""))


def check_setting_names(cfg: DictConfig) -> None:
    """Every key of the config is declared (posbench.settings) or a parameter of the encoding or task:
    a key added with `+` (`+train.stepz=5`) is refused like any other, naming the nearest valid keys."""
    declared = {s.key for s in SETTINGS}
    groups = (*SECTIONS, *PARAMETER_SECTIONS)
    for key in cfg:
        if key == "hydra" or key in declared:
            continue
        if key not in groups:
            refuse_unknown(key, "is not a setting", sorted(k for k in declared if "." not in k) + list(groups))
        elif key in SECTIONS:
            node = cfg.get(key)
            if not isinstance(node, DictConfig):
                raise ValueError(f"{key}={shown(node)}: must be a group of settings; choose an option with "
                                 f"{key}=<name> and set one with {key}.<setting>=<value>")
            names = [s.name for s in settings.section(key)]
            for leaf in node:
                if leaf not in names:
                    article = "an" if key[0] in "aeiou" else "a"
                    refuse_unknown(f"{key}.{leaf}", f"is not {article} {key} setting", names, prefix=f"{key}.")


def check_options(cfg: DictConfig) -> None:
    """A setting of one option of its group only is refused with another: logger.project is wandb's, and
    with logger=none it would do nothing."""
    for s in SETTINGS:
        chosen = OmegaConf.select(cfg, f"{s.section}.name", default=None) if s.option else s.option
        if s.option != chosen and OmegaConf.select(cfg, s.key, default=ABSENT) is not ABSENT:
            raise ValueError(f"{s.key} is a setting of {s.section}={s.option}, not of {s.section}={chosen}; "
                             f"choose {s.section}={s.option} to use it")


def refuse_unknown(key: str, what: str, names: list[str], prefix: str = "") -> None:
    near = settings.nearest(key, [prefix + name for name in names])
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    raise ValueError(f"{key} {what}; the settings: {sorted(names)}{hint}")


def check_config(cfg: DictConfig) -> None:
    """The settings that can be judged from the config alone."""
    check_parameter_names(cfg)
    check_setting_names(cfg)
    for key, rule in RULES.items():
        value = OmegaConf.select(cfg, key, default=ABSENT)
        if value is not ABSENT:
            rule(key, value)
    check_options(cfg)
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
    generator = draws.generator(int(cfg.eval.seed))
    if cfg.train.steps:
        task.train_sample(1, built.train_length, built.train_length, generator)
    longest = built.lengths[-1]
    batch = next(task.eval_batches(longest, 1, 1, generator), None)
    if batch is None or not batch.inputs.numel():
        raise ValueError(f"{task.name}: no evaluation data at length {longest}; check the task's settings")
