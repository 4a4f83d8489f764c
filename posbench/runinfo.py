"""One description of a run: what every result row carries, the dashboard's flat config and
the group the report pools seeds over.

The group is the whole resolved configuration minus the seed and minus what cannot change
a result (NOT_RESULT_KEYS: paths, logger, run name, threads, checkpointing); rows carry
its short hash (`config_hash`), so the report never pools runs that differ in anything else.
A setting added after results were committed (ADDED_SETTINGS, from posbench.settings) is left out while it holds the
value that reproduces the earlier behaviour, so runs made before it existed keep their hash.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import json
from dataclasses import asdict, dataclass, fields

from hydra.utils import get_class

from posbench.settings import added_settings

# Dotted keys of the resolved config that cannot change a result.
NOT_RESULT_KEYS = ("seed", "run_name", "logger", "threads", "eval.memory_limit", "task.data_dir", "task.cache_dir",
                   "train.init_from", "train.resume", "train.checkpoint_every", "train.save_checkpoint", "published")


# Dotted keys added after results were committed -> the value every earlier run had: the settings
# declared with a `before` value and the encoding and task parameters added later (posbench.settings).
ADDED_SETTINGS = added_settings()


def parent_of(config: dict, key: str) -> tuple[dict | None, str]:
    """The dict holding a dotted key (None when the path is missing) and the key's last part."""
    *parents, leaf = key.split(".")
    node = config
    for parent in parents:
        node = node.get(parent) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def with_added_settings(config: dict) -> dict:
    """A copy of the config with every ADDED_SETTINGS key it lacks at its earlier value (a config
    written before the key existed describes a run that had it); an encoding or task parameter only
    where its class takes it (alibi never had rope's frequency_fraction)."""
    full = copy.deepcopy(config)
    for key, earlier in ADDED_SETTINGS.items():
        node, leaf = parent_of(full, key)
        if node is not None and (key.split(".")[0] not in ("encoding", "task") or takes(node.get("_target_"), leaf)):
            node.setdefault(leaf, earlier)
    return full


@functools.cache
def takes(target: str | None, parameter: str) -> bool:
    """Whether the class a config's `_target_` names has this constructor parameter (False if none is named
    or it does not import)."""
    try:
        return target is not None and parameter in inspect.signature(get_class(target)).parameters
    except (ImportError, ValueError):
        return False


def group_config(config: dict, init_from: dict | None = None) -> dict:
    """The resolved config minus NOT_RESULT_KEYS and minus the ADDED_SETTINGS at their earlier
    values. A run started from a checkpoint (train.init_from) is grouped by that checkpoint's
    group and steps, not by its path."""
    kept = copy.deepcopy(config)
    for key in NOT_RESULT_KEYS:
        node, leaf = parent_of(kept, key)
        if node is not None:
            node.pop(leaf, None)
    for key, earlier in ADDED_SETTINGS.items():
        node, leaf = parent_of(kept, key)
        if node is not None and leaf in node and node[leaf] == earlier:
            del node[leaf]
    if "device" in kept:  # where a run ran is not what it measured (its data are drawn on the CPU: posbench.draws);
        kept["device"] = "auto"  # hashed as auto, the value of every run from before this
    if init_from:
        kept["init_from"] = init_from
    return kept


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def flatten(config: dict, prefix: str = "") -> dict:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; lists stay values."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@dataclass
class RunInfo:
    """The run-level keys of every result row, in row order."""
    run_id: str
    run_name: str
    config_hash: str  # of `config`: the report's group
    encoding: str
    encoding_params: dict
    task: str
    task_params: dict
    model: dict
    n_params: int
    backend: str  # the one used (backend=auto resolved)
    backend_table: str | None  # the crossover tables auto followed (results/gpu/ folders, +), None: its rule
    seed: int
    train_length: int
    train_sequence_length: int
    train_lengths: str
    positions: str
    max_position: int | None
    device: str
    world_size: int  # processes that trained and evaluated it (torchrun's; 1 for one process), not in the group
    torch: str
    git_commit: str
    init_from: str | None
    init_steps: int
    untrained: bool  # train.steps=0 without train.init_from: a freshly initialised model evaluated
    config: dict  # group_config of the resolved config
    train_steps: int | None = None  # filled in once training has ended
    train_seconds: float | None = None
    train_tokens_per_s: float | None = None

    def row(self) -> dict:
        return asdict(self)

    def flat_config(self, resolved: dict) -> dict:
        """Flat keys for dashboards (the wandb runs table) plus the whole resolved config."""
        scalars = {f.name: getattr(self, f.name) for f in fields(self)
                   if not isinstance(getattr(self, f.name), dict)}
        return {**scalars, **{f"model.{k}": v for k, v in self.model.items()},
                **{f"encoding.{k}": v for k, v in self.encoding_params.items()},
                **{f"task.{k}": v for k, v in self.task_params.items()}, "config": resolved}


RUN_KEYS = tuple(f.name for f in fields(RunInfo))
