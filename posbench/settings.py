"""The settings of a run, declared once.

Each `Setting` gives a dotted key, its rule (the type and what is valid: posbench.checks), its
default (as the YAMLs under configs/ write it for the default job), one line of meaning and, for a
setting added after results were committed, the value every earlier run had (`before`). From this
table come:

- validation: `posbench.validate.check_config` runs every rule, and refuses a key that is not
  declared here (a typo added with `+`, e.g. `+train.stepz=5`), naming the nearest valid keys;
- `posbench.model.ModelConfig`: its fields, their types and defaults are the model.* settings
  (tests/test_schema.py holds the two equal);
- `posbench.runinfo.ADDED_SETTINGS`: the settings with a `before` value (so runs made before a
  setting existed keep their config hash), plus ADDED_PARAMETERS, the encoding and task parameters
  added later (those parameters are declared by their constructors, which check them);
- the settings part of `python -m posbench --help` (the resolver `${posbench.help:...}` in
  configs/hydra/help/posbench.yaml).

tests/test_schema.py checks that the YAMLs and this table name the same settings with the same defaults.
Encoding and task parameters are not here: `encoding.*` and `task.*` are the constructor parameters
of the chosen class (posbench.validate.check_parameter_names), which check their own values.
"""
from __future__ import annotations

import difflib
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

from omegaconf import ListConfig, OmegaConf

from posbench import published
from posbench.checks import Choice, Flag, Integer, Items, Real, Text, refuse, refuse_choice, shown
from posbench.hooks import BACKEND_NAMES

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
NEW = object()  # `before` of a setting that existed from the start

# The choices of the settings. A name registry kept elsewhere, which tests/test_schema.py holds equal:
# posbench.positions.SCHEMES (this module imports no torch: the report reads it).
BACKEND_CHOICES = ("auto", *sorted(BACKEND_NAMES))
POSITION_SCHEMES = ("sequential", "randomized", "offset")
TRAIN_LENGTH_MODES = ("uniform", "fixed")
SCHEDULES = ("cosine", "linear")  # the decay after warm-up (posbench.training.learning_rate)
PRECISION_NAMES = ("fp32", "bf16")
ACTIVATION_NAMES = ("gelu", "relu")  # posbench.model.ACTIVATIONS
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
DEVICE_FORMS = ("auto", "cpu", "cuda", "cuda:<index>")
LOGGERS = ("none", "wandb")
WANDB_MODES = ("online", "offline", "disabled")


# --- the rules that are not one of posbench.checks' shapes ------------------------------------------

class Device:
    type = str

    def text(self) -> str:
        return " | ".join(DEVICE_FORMS)

    def __call__(self, key: str, value):
        name = value if isinstance(value, str) else ""
        index = name.removeprefix("cuda:")
        if name not in DEVICE_FORMS[:3] and not (name.startswith("cuda:") and index.isdigit()):
            refuse_choice(key, value, str(list(DEVICE_FORMS)))
        return value


class Resume:
    type = object

    def text(self) -> str:
        return "auto | true | false"

    def __call__(self, key: str, value):
        if value != "auto" and not isinstance(value, bool):
            refuse(key, value, "auto, true or false")
        return value


COMPILE_MODES = (False, True, "static", "graphs", "capture")


class Compile:
    """train.compile: false, true (one graph with dynamic shapes), static (one graph per shape), graphs, capture."""
    type = object

    def text(self) -> str:
        return ("false | true (one graph, dynamic shapes) | static (a graph per shape; flex may train) | graphs "
                "(each shape replayed as a CUDA graph; compiled only on the CPU) | capture (the whole step, AdamW "
                "included, recorded per shape as a CUDA graph without compiling; as it is on the CPU)")

    def __call__(self, key: str, value):
        if not isinstance(value, bool) and not (isinstance(value, str) and value in COMPILE_MODES):
            refuse_choice(key, value, "false, true, static, graphs, capture")
        return value


class Chunk:
    type = object

    def text(self) -> str:
        return "auto, an integer >= 1, or null (every query at once)"

    def __call__(self, key: str, value):
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} is not valid; use auto, a number of queries >= 1, or null")
        return value


class Window:
    type = int | list[int | None] | None

    def text(self) -> str:
        return "null (every layer global), an integer >= 1, or a list of them and nulls repeated over the layers"

    def __call__(self, key: str, value):
        """null (every layer global), a window >= 1 for every layer, or a non-empty list of windows and
        nulls (global layers) repeated over the layers, e.g. [512, 512, 512, null]."""
        if value is None:
            return None
        if isinstance(value, (list, tuple, ListConfig)):
            return Items(Integer(1, null="a global layer"))(key, list(value))
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={shown(value)}: must be null (every layer global), a window >= 1, or a list of "
                             "windows and nulls repeated over the layers, e.g. [512,512,512,null]")
        return value


class Published:
    type = object

    def text(self) -> str:
        return "null, or a block of source, metric, lengths, results (posbench/published.py)"

    def __call__(self, key: str, value):
        published.parse(value)
        return value


# --- the table --------------------------------------------------------------------------------------

class Tag:
    """A wandb tag: a string of 1 to 64 characters, as wandb takes them. A number is refused, not taken as
    its text: the tags reach wandb as the config holds them."""
    plural = "strings"
    type = str

    def text(self) -> str:
        return "a string of 1 to 64 characters"

    def __call__(self, key: str, value):
        if not isinstance(value, str):
            refuse(key, value, f"{self.text()} (quote a number: '1')")
        if not 1 <= len(value) <= 64:
            refuse(key, value, f"{self.text()} (wandb's limit); this one has {len(value)}")
        return value


@dataclass(frozen=True)
class Setting:
    key: str  # dotted: seed, train.steps, model.window, ...
    rule: object  # rule(key, value) -> the value, or a ValueError naming key, value and what is valid
    default: object  # the default job's value, as configs/ writes it
    help: str  # what it means, one line
    before: object = NEW  # added later: the value every run had before the setting existed
    option: str | None = None  # a setting of one option of its group only (logger.project: logger=wandb)

    @property
    def section(self) -> str | None:
        return self.key.split(".")[0] if "." in self.key else None

    @property
    def name(self) -> str:
        return self.key.split(".")[-1]

    @property
    def added(self) -> bool:
        return self.before is not NEW

    @property
    def type(self):
        return self.rule.type

    def check(self, value):
        return self.rule(self.key, value)

    def text(self) -> str:
        return self.rule.text()


S = Setting
SETTINGS: tuple[Setting, ...] = (
    S("seed", Integer(0), 0, "the training seed (data, initialisation)"),
    S("device", Device(), "auto", "auto: cuda when available, else cpu"),
    S("threads", Integer(1, os.cpu_count() or 1, null="torch's default"), 1,
      "torch CPU threads (on a busy machine more threads can run slower)"),
    S("run_name", Text(null="<encoding>-<task>-N<train.length>-s<seed>"), None, "the run's name in rows and loggers"),
    S("published", Published(), None, "a paper's numbers for the report to show beside the runs' (experiments set it)"),
    # training (configs/train/default.yaml)
    S("train.length", Integer(1), "${task.default_length}", "N, the largest training length (the task's default)"),
    S("train.lengths", Choice(TRAIN_LENGTH_MODES), "uniform", "uniform: each step draws its length from [1, N]; "
      "fixed: always N"),
    S("train.steps", Integer(0), 10000, "optimisation steps; 0: evaluate only (with train.init_from)"),
    S("train.batch_size", Integer(1), 64, "sequences per training step"),
    S("train.lr", Real(above=0), 1e-3, "the peak learning rate (AdamW)"),
    S("train.warmup_steps", Integer(0), 100, "linear warm-up steps (may exceed train.steps)"),
    S("train.min_lr_ratio", Real(least=0, most=1), 0.1, "the decay ends at lr x this"),
    S("train.schedule", Choice(SCHEDULES), "cosine", "the decay after warm-up", before="cosine"),
    S("train.weight_decay", Real(least=0), 0.01, "AdamW's, on the weight matrices"),
    S("train.grad_clip", Real(above=0), 1.0, "the gradient norm clipped to"),
    S("train.precision", Choice(PRECISION_NAMES), "fp32", "bf16: autocast in training and evaluation (GPUs)"),
    S("train.compile", Compile(), False, "torch.compile the model for training: true (dynamic shapes), static "
      "(a graph per shape), graphs (CUDA graphs on CUDA)"),
    S("train.log_every", Integer(1), 25, "steps between logged training metrics"),
    S("train.save_checkpoint", Flag(), True, "keep <run dir>/checkpoint.pt after the run"),
    S("train.init_from", Text(null="a fresh model"), None, "a checkpoint.pt (or its run dir) to start from"),
    S("train.positions", Choice(POSITION_SCHEMES), "sequential", "the position ids: randomized (Ruoss et al. 2023) or "
      "offset draw them from [0, train.max_position)"),
    S("train.max_position", Integer(1, null="the longest evaluated sequence"), None,
      "the range randomized and offset positions draw from"),
    S("train.checkpoint_every", Integer(0, null="never"), 1000, "steps between resumable checkpoints; 0: only "
      "at the end and on a stop signal"),
    S("train.resume", Resume(), "auto", "auto: continue this run in its directory; true: must; false: refuse to"),
    # evaluation (configs/eval/default.yaml)
    S("eval.ratios", Items(Real(above=0)), [0.5, 1, 1.5, 2, 3, 4], "evaluation lengths as multiples of N"),
    S("eval.lengths", Items(Integer(1), null="use eval.ratios"), None, "explicit evaluation lengths; override "
      "eval.ratios"),
    S("eval.samples", Integer(1), 512, "sequences per evaluation length"),
    S("eval.batch_size", Integer(1), 256, "sequences per evaluation batch"),
    S("eval.seed", Integer(0), 1234, "the evaluation data's seed: the same sequences for every run"),
    S("eval.chunk", Chunk(), "auto", "queries attended at a time by layers that form logits"),
    S("eval.memory_limit", Integer(1, null="the memory available less a margin"), None,
      "MiB evaluation may allocate at one length: above it the guard lowers eval.batch_size, or refuses the "
      "length (posbench.guard); not part of the config hash (posbench.runinfo.NOT_RESULT_KEYS)"),
    # the model (configs/model/small.yaml; ModelConfig)
    S("model.d_model", Integer(1), 64, "the residual width"),
    S("model.n_layers", Integer(1), 3, "transformer layers"),
    S("model.n_heads", Integer(1), 4, "attention heads (d_model % n_heads == 0)"),
    S("model.mlp_ratio", Integer(1), 4, "the feed-forward width / d_model"),
    S("model.causal", Flag(), True, "true: a decoder; false: an encoder (the task's layout follows)"),
    S("model.dropout", Real(least=0, below=1), 0.0, "dropout on the residual branches"),
    S("model.activation", Choice(ACTIVATION_NAMES), "gelu", "the feed-forward activation", before="gelu"),
    S("model.norm", Choice(NORMS), "layernorm", "rmsnorm: T5's", before="layernorm"),
    S("model.bias", Flag(), True, "false: no biases in the feed-forward and the norms", before=True),
    S("model.norm_position", Choice(NORM_POSITIONS), "pre", "pre: x + f(norm(x)), a final norm; "
      "post: norm(x + f(x))", before="pre"),
    S("model.embed_scale", Flag(), False, "token embeddings times sqrt(d_model)", before=False),
    S("model.window", Window(), None, "sliding-window attention: a window, or a per-layer list", before=None),
    # the backend (configs/backend/)
    S("backend.name", Choice(BACKEND_CHOICES), "auto", "the attention backend; auto: the fastest "
      "that runs the encoding's hooks"),
    # the logger (configs/logger/)
    S("logger.name", Choice(LOGGERS), "none", "logger=wandb mirrors the rows to Weights & Biases"),
    S("logger.project", Text(), "posbench", "the wandb project", option="wandb"),
    S("logger.entity", Text(null="wandb's default"), None, "the wandb entity", option="wandb"),
    S("logger.mode", Choice(WANDB_MODES, null="WANDB_MODE, else online with an API key, else offline"), None,
      "wandb's mode", option="wandb"),
    S("logger.group", Text(null="the sweep, else <encoding>-<task>"), None, "the wandb group", option="wandb"),
    S("logger.tags", Items(Tag(), empty=True), [], "tags added to the automatic ones", option="wandb"),
    S("logger.dir", Text(null="the run directory"), None, "where wandb writes", option="wandb"),
)
BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}
SECTIONS = ("train", "eval", "model", "backend", "logger")  # groups whose every key is a setting declared here
PARAMETER_SECTIONS = ("encoding", "task")  # groups whose keys are the chosen class's constructor parameters

# Encoding and task parameters added after results were committed -> the value every earlier run had
# (the parameters themselves are declared by the constructors; only their history lives here).
ADDED_PARAMETERS = {
    "encoding.rotary_fraction": 1.0,  # rope's (and self_extend's, which came later)
    "encoding.frequency_fraction": 1.0, "encoding.frequency_cut": "none",  # rope's (p-RoPE, HoPE)
    "encoding.short_factors": None, "encoding.long_factors": None,  # rope's (longrope)
    "encoding.start_positions": 0,  # rope's (longrope's start tokens)
    "encoding.resonance": False,  # rope's (Resonance RoPE)
    "encoding.scale_base": None,  # self_extend's query log-scale (xpos's own scale_base is never null)
    "encoding.k_shift": False, "encoding.v_shift": False,  # fox's token shifts (the Pro block)
    "task.eos": False,  # copy's, reverse's and sort's
}


def section(name: str) -> tuple[Setting, ...]:
    """The settings of one section (model, train, ...), in declaration order."""
    return tuple(s for s in SETTINGS if s.section == name)


def check_present(cfg) -> None:
    """Every setting and group a run reads is in its config: a deletion override (`~train.steps`, `~eval`)
    is refused naming what it removed and how to give it back, not met later as a missing key."""
    for group in (*SECTIONS, *PARAMETER_SECTIONS):
        if group not in cfg:
            choices = options(group)
            raise ValueError(f"{group} is missing from the configuration (a ~{group} override deletes the group); "
                             f"a run needs it: choose one of its options instead, {group}=<one of {choices}>")
    missing = [s for s in SETTINGS if s.option is None and not has_key(cfg, s.key)]
    if not missing:
        return
    first = missing[0]
    together = [s.key for s in missing if first.section and s.section == first.section]
    if len(together) > 1:  # a group's option deleted (~eval, ~model): the settings its YAML gave
        raise ValueError(f"{together} are missing from the configuration (a ~{first.section} override deletes the "
                         f"option that sets them); a run needs them: choose one of its options instead, "
                         f"{first.section}=<one of {options(first.section)}>, or set each, e.g. "
                         f"{first.key}={hydra_value(first.default)}")
    raise ValueError(f"{first.key} is missing from the configuration (a ~{first.key} override deletes it); a run "
                     f"needs it: set it instead, e.g. {first.key}={hydra_value(first.default)} (the default; valid: "
                     f"{first.text()})")


def has_key(cfg, key: str) -> bool:
    """Whether a dotted key is in the config, without resolving its value (it may interpolate a deleted one)."""
    section, _, name = key.rpartition(".")
    node = cfg.get(section) if section else cfg
    return hasattr(node, "keys") and name in node.keys()


def added_settings() -> dict:
    """Dotted key -> the value it had before it existed: what posbench.runinfo.ADDED_SETTINGS holds."""
    return {s.key: s.before for s in SETTINGS if s.added} | ADDED_PARAMETERS


def nearest(key: str, candidates) -> list[str]:
    """The valid keys closest to a mistyped one (train.stepz -> train.steps), best first: up to three,
    none much further than the best."""
    scored = sorted(((difflib.SequenceMatcher(None, key, c).ratio(), c) for c in candidates), reverse=True)
    best = scored[0][0] if scored else 0
    return [c for ratio, c in scored[:3] if ratio >= max(0.6, best - 0.1)]


# --- --help ----------------------------------------------------------------------------------------

def hydra_value(value) -> str:
    """A value as it is written on the command line: null, true, [0.5,1,2]."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def settings_help(width: int = 34, columns: int = 110) -> str:
    """Every setting, by section: key=default, what it means, what is valid (wrapped under its key)."""
    lines = []
    titles = {None: "run", "train": "training", "eval": "evaluation", "model": "the model (model=small's values)",
              "backend": "attention backend", "logger": "logger"}
    for part, title in titles.items():
        lines.append(f"{title}:")
        for s in (s for s in SETTINGS if s.section == part):
            assigned = s.key + "=" + hydra_value(s.default).replace("${task.default_length}", "<task's N>")
            where = f" (logger={s.option})" if s.option else ""
            text = f"{s.help}{where}. Valid: {s.text()}"
            for glued in (">= ", "<= ", "> ", "< ", "an integer", "a number", "or null"):  # kept on one line
                text = text.replace(glued, glued.replace(" ", "\0"))
            lines += [line.replace("\0", " ") for line in
                      textwrap.wrap(text, columns, initial_indent=f"  {assigned:<{width}} ",
                                    subsequent_indent=" " * (width + 3), break_on_hyphens=False)]
    return "\n".join(lines).replace("$", "$$")  # the help template is a string.Template


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def summary(path: Path, limit: int = 96) -> str:
    """An experiment's first comment paragraph (its YAML's header), cut to `limit` characters at a word."""
    words = []
    for line in path.read_text().splitlines():
        if line.startswith("# @package"):
            continue
        if not line.startswith("#") or line.startswith("#  ") or not line[1:].strip():
            break
        words.append(line[1:].strip())
    text = " ".join(words)
    return text if len(text) <= limit else text[:limit - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def experiments_help() -> str:
    names = options("experiment")
    width = max(map(len, names), default=0)
    return "\n".join(f"  experiment={name:<{width}}  {summary(CONFIGS / 'experiment' / f'{name}.yaml')}"
                     for name in names).replace("$", "$$")


def groups_help() -> str:
    """The options of the groups a user picks from."""
    lines = []
    for group in ("encoding", "task", "model", "backend", "logger", "debug"):
        lines += textwrap.wrap(", ".join(options(group)), 110, initial_indent=f"  {group + ':':<10}",
                               subsequent_indent=" " * 12)
    return "\n".join(lines)


HELP_PARTS = {"settings": settings_help, "experiments": experiments_help, "groups": groups_help}


def help_part(name: str) -> str:
    return HELP_PARTS[Choice(tuple(HELP_PARTS))("posbench.help", name)]()


# configs/hydra/help/posbench.yaml reads ${posbench.help:settings} etc.; registered on import, which
# `python -m posbench` does before Hydra reads its help (posbench.validate imports this module).
OmegaConf.register_new_resolver("posbench.help", help_part, replace=True)
