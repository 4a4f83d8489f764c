"""The resource guard: what evaluation will allocate at each length, checked before training.

`estimate` gives, for one evaluation length and batch size, an upper-ish bound of the memory one
evaluation batch allocates on top of what the process holds once the model is built (calibrated
against the peak resident set measured by posbench.memory: tests/test_guard.py). Its parts:

    tokens T = task.sequence_length(length) (a grid: side^2 cells; + task.memory for the keys K),
    B = min(eval.batch_size, eval.samples), D = d_model, r = mlp_ratio, V = vocab, H = heads, row = B x T x D x 4 bytes
    data         B x T x task.data_bytes_per_token (96 unless a task declares more) + T x (D x 4 + 32)
                 the batch, its generation's temporaries, position ids and a per-forward position table
    forward      the largest of three phases (no_grad: one layer's tensors live at once):
                 attention     ATTENTION_ROWS (10) rows + the attention of one chunk (below)
                 feed-forward  (2 r + MLP_EXTRA_ROWS (4)) rows
                 head          2 rows + B x T x (V x 4 x HEAD_COPIES (3) + 32)
    attention    one chunk of queries of one layer, as posbench.attention.layer runs it:
                 - eager: logits [B, H, c, K] x EAGER_COPIES (3) (+ the bias block twice); no chunking (c = T)
                   when the encoding needs neither logits, nor a decay, nor a window;
                 - sdpa with a bias: the bias block [1, H, c, K] x SDPA_BIAS_COPIES (2), plus BIAS_BUILD_BYTES (32)
                   + 4 H bytes per query-key pair where the bias is built per block (not relative, or positions
                   not contiguous: randomized, 2-D);
                 - a window: its -inf mask [1, 1, c, K] and offsets; a decay alone (DECAY_CHUNK queries): k and v
                   one column wider, 2 x [B, H, K, D/H + 1];
                 - fused kernels (sdpa without a bias, flex): 4 x [B, H, T] floats;
                 - what the encoding's hooks allocate beyond these (Encoding.extra_memory: its own [B, H, c, K]
                   tensors, per-token tables), declared for the layer's shape (posbench.encodings.base.LayerShape);
                 c: eval.chunk (auto: max(MIN_AUTO_CHUNK, AUTO_CHUNK_ELEMENTS // ((B if eager else 1) x H x K));
                 null: T), K: the keys a chunk sees (T; c + window - 1 with a causal window); when no layer
                 chunks, each distinct layer's bias [1, H, T, K] is held for the forward
    model        parameters x 4 bytes (the gradients training leaves behind); for a plan (posbench.build
                 .plan_run: the model on the meta device, not yet allocated) its parameters and buffers too
    + OVERHEAD   8 MiB: the allocator, thread workspaces

`memory_limit` is eval.memory_limit in MiB, or the memory available less a margin, and on the CPU never
more than the process's own limits (RLIMIT_AS less VmSize, RLIMIT_DATA less VmData) less a margin; it
names which was smallest. The runner's build calls, before the model and data exist, `check_training`
(the parameters with AdamW's state, the activations at train.batch_size x train.length, a torchrun rank's
share of them, the head's logits, the batch: refused naming the setting at fault; the ranks of one CPU host
share its memory) and `check_run`, which compares every length with
the limit, lowers eval.batch_size where a smaller batch fits, and refuses with a ValueError naming
eval.lengths, the length, the estimate and the limit where not even one sequence at a time fits.
`translate_oom` turns an allocation error that still happens into a message naming the length and the
settings to change.
"""
from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from posbench import distributed, settings
from posbench.attention.layer import Attention
from posbench.attention.select import BACKENDS
from posbench.encodings.base import LayerShape
from posbench.hooks import needs_logits
from posbench.memory import rss_kb
from posbench.validate import eval_chunk

MIB = 2**20
FLOAT = 4  # bytes of a float32 (bf16 autocast allocates less; the bound stays fp32's)
DRAW_BYTES_PER_SYMBOL = 24  # an alphabet draw (Task.alphabet_setting): float32 draws, argsort values, int64 indices
ATTENTION_ROWS = 10  # [B, T, D] tensors live around attention: x, norm, q k v, rotated q k, output blocks, copies
MLP_EXTRA_ROWS = 4  # beside the [B, T, mlp_ratio D] pair: x, its norm, the output, the sum
HEAD_COPIES = 3  # [B, T, V]: the logits, log-softmax, the loss's temporaries (+ 32 bytes a token: argmax, masks)
EAGER_COPIES = 3  # [B, H, c, K] tensors an eager call holds at once (logits, masked, softmax; the hooks' own:
# Encoding.extra_memory)
SDPA_BIAS_COPIES = 2  # [1, H, c, K]: the block's bias and a contiguous slice or float copy of it
BIAS_BUILD_BYTES = 32  # per query-key pair: relative offsets, buckets (int64) of a bias built for the block
OVERHEAD = 8 * MIB
MARGIN_FRACTION, MARGIN_LEAST = 0.10, 512 * MIB  # kept free of the memory available: the larger of the two
SETTING = "eval.memory_limit"


def gib(n_bytes: float) -> str:
    """Bytes in the unit that reads best: 512.0 MiB, 3.4 GiB, 61.2 TiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30)):
        if n_bytes >= size:
            return f"{n_bytes / size:.1f} {unit}"
    return f"{n_bytes / MIB:.1f} MiB"


@dataclass
class Estimate:
    """What one evaluation batch at `length` allocates, in bytes, by part."""
    length: int
    tokens: int  # the sequence the model reads (a grid: side^2 cells)
    batch: int
    parts: dict[str, float]
    chunk: int | None = None  # queries per attention chunk of the largest layer (None: no chunking)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {gib(value)}" for name, value in
                          sorted(self.parts.items(), key=lambda item: -item[1]) if value >= MIB)
        return f"about {gib(self.total)} ({parts})"


def _contiguous_positions(built) -> bool:
    """A relative bias is taken from per-offset rows (posbench.attention.context.offset_rows) only over
    contiguous positions shared by the batch: sequential or offset ids, 1-D or a grid's raster index."""
    scheme = getattr(built.positions, "scheme", "sequential")
    if scheme == "randomized":
        return False
    return built.task.position_dims == 1 or getattr(built.encoding, "position_dims", 1) == 1


def query_block(built, backend, window: int | None, batch: int, queries: int, keys: int, training: bool,
                chunk_setting=None) -> int | None:
    """Queries per block of a layer with this window and backend, or None for one call over all of them: the
    layer's own rule (posbench.attention.layer.Attention.query_block), asked of a stand-in for the layer."""
    layer = SimpleNamespace(training=training, eval_chunk=chunk_setting, backend=backend, window=window,
                            n_heads=built.model.cfg.n_heads, causal=built.model.cfg.causal)
    return Attention.query_block(layer, built.encoding, batch, queries, keys)


def attention_bytes(built, cfg, length: int, batch: int, tokens: int, keys: int, layer: int,
                    chunk_setting) -> tuple[float, int | None]:
    """One layer's attention in evaluation: bytes at its largest chunk with what the encoding declares for it
    (Encoding.extra_memory), and the chunk (None: one call)."""
    mcfg = built.model.cfg
    window = mcfg.layer_window(layer)
    heads, head_dim = mcfg.n_heads, mcfg.d_model // mcfg.n_heads
    encoding = built.encoding
    hooks = set(encoding.hooks)
    backend = BACKENDS[built.backend_at(length)]()
    rows_fused = 4.0 * batch * heads * tokens * FLOAT  # out, lse and the kernel's per-row buffers
    logits = needs_logits(hooks) or window is not None
    decay = "decay" in hooks
    per_sequence = backend.per_sequence_logits

    def declared(block: int | None, pairs: float) -> float:
        shape = LayerShape(batch, heads, tokens, keys, block, pairs, training=False)
        if backend.runs_kernel_of(encoding):
            return encoding.kernel_memory(layer, shape)
        return encoding.extra_memory(layer, shape)

    if not backend.takes_bias:  # flex: block masks, its own bounded memory
        return rows_fused + declared(None, 0.0), None
    if not (logits or decay):
        if per_sequence:  # eager without chunking: every query's logits at once
            pairs = float(tokens) * keys
            return EAGER_COPIES * batch * heads * pairs * FLOAT + declared(None, pairs), None
        return rows_fused + declared(None, 0.0), None
    block = query_block(built, backend, window, batch, tokens, keys, training=False, chunk_setting=chunk_setting)
    chunk = block or tokens
    seen = keys
    if window is not None and mcfg.causal:
        seen = min(keys, chunk + window - 1)
    pairs = float(chunk) * seen
    has_bias = "bias" in hooks
    relative_rows = has_bias and encoding.bias_relative and _contiguous_positions(built)
    build = 0.0 if not has_bias or relative_rows else pairs * (BIAS_BUILD_BYTES + heads * FLOAT)
    bias_block = heads * pairs * FLOAT if has_bias else 0.0
    if per_sequence:
        total = EAGER_COPIES * batch * heads * pairs * FLOAT + 2 * bias_block + build
        if window is not None or mcfg.causal:
            total += pairs * 9  # the visible mask: offsets (int64) and booleans
    elif logits:
        total = SDPA_BIAS_COPIES * bias_block + build
        if window is not None:
            total += pairs * (3 * FLOAT + 8 + 2)  # zeros, the -inf mask, offsets and booleans
    else:  # a decay alone: q, k, v one column wider, each chunk against its whole key prefix
        total = (2.0 * keys + chunk) * batch * heads * (head_dim + 1) * FLOAT
        pairs = 0.0
    return total + rows_fused + declared(block, pairs), block


def data_bytes_per_token(task) -> float:
    return float(task.data_bytes_per_token)


def alphabet_draw_bytes(task) -> float:
    """Per sequence drawn: a permutation of the task's alphabet (Task.alphabet_setting), whatever the length."""
    setting = task.alphabet_setting
    return float(DRAW_BYTES_PER_SYMBOL * getattr(task, setting)) if setting else 0.0


def estimate(cfg: DictConfig, built, length: int, batch: int | None = None, chunk_setting="unset",
             whole_draw: bool = True) -> Estimate:
    """What evaluating one batch of `batch` sequences (default: eval.batch_size, at most eval.samples) at
    task length `length` allocates beyond the built model, in bytes by part (see the module's docstring).
    The forward's peak is the largest of three phases, not their sum: attention (the layer's [B, T, D]
    tensors and its chunk), the feed-forward, the head with the metrics. `whole_draw`: the data are drawn
    eval.batch_size sequences at a time however few are evaluated at once (posbench.evaluation)."""
    mcfg = built.model.cfg
    task = built.task
    if batch is None:
        batch = min(int(cfg.eval.batch_size), int(cfg.eval.samples))
    if chunk_setting == "unset":
        chunk_setting = eval_chunk(cfg.eval.chunk)
    tokens = int(task.sequence_length(length))
    keys = tokens + int(getattr(task, "memory", 0) or 0)
    d_model, vocab = mcfg.d_model, task.vocab_size
    position_bytes = 8.0 * keys * task.position_dims * 4  # ids, a grid's rows and columns, the raster index
    if getattr(built.positions, "scheme", "sequential") == "randomized":
        position_bytes += 24.0 * built.positions.max_position  # randperm over max_position, sorted
    position_bytes += keys * d_model * FLOAT  # a position table or rotation the encoding builds per forward
    drawn = batch
    if whole_draw and not getattr(task, "memory", 0):
        drawn = max(batch, min(int(cfg.eval.batch_size), int(cfg.eval.samples)))
    data = drawn * (tokens * data_bytes_per_token(task) + alphabet_draw_bytes(task)) + position_bytes
    row = float(batch) * tokens * d_model * FLOAT  # one [B, T, D] tensor
    attention, chunk = 0.0, None
    for layer in range(mcfg.n_layers):
        size, layer_chunk = attention_bytes(built, cfg, length, batch, tokens, keys, layer, chunk_setting)
        if size > attention:
            attention, chunk = size, layer_chunk
    if "bias" in built.encoding.hooks and chunk is None and BACKENDS[built.backend_at(length)].takes_bias:
        distinct = 1 if built.encoding.bias_layers_shared else mcfg.n_layers  # held by the forward's PositionContext
        attention += distinct * mcfg.n_heads * float(tokens) * keys * FLOAT
    phases = {
        "attention": {"attention": attention, "activations": ATTENTION_ROWS * row},
        "feed-forward": {"activations": (2 * mcfg.mlp_ratio + MLP_EXTRA_ROWS) * row},
        "head": {"activations": 2 * row + float(batch) * tokens * (vocab * FLOAT * HEAD_COPIES + 32)},
    }
    peak = max(phases.values(), key=lambda parts: sum(parts.values()))
    return Estimate(length, tokens, batch, {**peak, "data": data, "model": model_bytes(built.model),
                                            "overhead": float(OVERHEAD)}, chunk)


def model_bytes(model) -> float:
    """What the model holds in evaluation beyond what the limit already counts: its gradients, which training
    leaves behind, and, for a plan (posbench.build.plan_run: on the meta device), its parameters and buffers."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    planned = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if t.is_meta)
    return float(params + planned)


# --- the limit ------------------------------------------------------------------------------------

def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # optional: macOS and the like
        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - not installed, or no answer: unknown
        return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_available() -> int | None:
    """What the process's cgroup still allows (v2 memory.max - memory.current; v1 limit - usage)."""
    own = Path("/sys/fs/cgroup")
    try:  # v2: the process's own group, as /proc/self/cgroup names it ("0::/path")
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                candidate = own / line[3:].lstrip("/")
                if (candidate / "memory.max").exists():
                    own = candidate
    except OSError:
        pass
    for limit_file, usage_file in ((own / "memory.max", own / "memory.current"),
                                   (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                                    Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"))):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and limit < 2**60:  # v1 writes a huge number for "no limit"
            return max(0, limit - (usage or 0))
    return None


def _rlimits_available() -> list[tuple[float, str]]:
    """What the process's soft resource limits still allow: RLIMIT_AS (ulimit -v) less the address space in
    use (VmSize), RLIMIT_DATA (ulimit -d) less the data segment and private mappings it counts (VmData).
    None where `resource` is missing (Windows) or no limit is set."""
    try:
        import resource
    except ImportError:
        return []
    found = []
    for name, used_field in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft == resource.RLIM_INFINITY:
            continue
        try:
            used = rss_kb(used_field) * 1024
        except (OSError, RuntimeError):  # no /proc (macOS): the limit as a whole
            used = 0
        flag = "-v" if name == "RLIMIT_AS" else "-d"
        found.append((float(max(0, soft - used)), f"{name} (ulimit {flag}) {gib(soft)} less {gib(used)} in use "
                                                  f"({used_field})"))
    return found


RAISE_SETTING = f"raise {SETTING} (MiB) if more memory is there"


@dataclass
class Limit:
    bytes: float | None  # None: unknown, nothing is checked
    source: str  # how it was set, for messages
    remedy: str = RAISE_SETTING  # how to allow more, for refusals

    def __str__(self) -> str:
        return f"{gib(self.bytes)} ({self.source})" if self.bytes is not None else self.source


def with_margin(available: float, where: str, remedy: str = RAISE_SETTING) -> Limit:
    margin = max(MARGIN_LEAST, MARGIN_FRACTION * available)
    setting = f"; {SETTING}=<MiB> sets it" if remedy == RAISE_SETTING else ""
    return Limit(max(0.0, available - margin), f"{where}: {gib(available)} less a {gib(margin)} margin{setting}",
                 remedy)


def memory_limit(cfg: DictConfig, device: torch.device | str = "cpu", sharing: int = 1) -> Limit:
    """The smallest of what may be allocated: eval.memory_limit (MiB) when set, else what the device has
    available less a margin (the larger of MARGIN_FRACTION and MARGIN_LEAST): on CUDA the device's free
    memory, on CPU /proc/meminfo's MemAvailable (psutil where there is no /proc) and the cgroup's remaining
    allowance; on CPU also the process's own limits (RLIMIT_AS, RLIMIT_DATA), less a margin, which no
    setting lifts. The limit's source names which one it was. `sharing`: the processes that share the CPU
    host's memory (a torchrun's ranks on it, posbench.guard.host_ranks), each taking its share of what the
    host has; a GPU, a process limit and eval.memory_limit are one process's."""
    setting = cfg.eval.get("memory_limit") if "eval" in cfg else None
    device = torch.device(device)
    process = [with_margin(value, where, "raise the process's limit (ulimit) if more memory is there")
               for value, where in _rlimits_available()] if device.type != "cuda" else []
    if setting is not None:
        if isinstance(setting, bool) or not isinstance(setting, (int, float)) or setting <= 0:
            raise ValueError(f"{SETTING}={setting!r} is not valid; give the MiB evaluation may allocate (a number "
                             "> 0), or null for the memory available less a margin")
        machine = [Limit(float(setting) * MIB, f"{SETTING}={setting} MiB")]
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        machine = [with_margin(float(free), f"free on {device}")]
    else:
        shared = f", shared by this host's {sharing} ranks" if sharing > 1 else ""
        machine = [with_margin(value / sharing, where + shared)
                   for value, where in ((_meminfo_available(), "MemAvailable"),
                                        (_cgroup_available(), "the cgroup's memory.max")) if value is not None]
    found = machine + process
    if not found:
        return Limit(None, f"memory available unknown here; set {SETTING} (MiB) to check lengths")
    return min(found, key=lambda limit: limit.bytes)


# --- the check -------------------------------------------------------------------------------------

@dataclass
class GuardResult:
    """The evaluation batch size for each length (eval.batch_size, or less where that would not fit), the
    messages to print, the estimates and the limit they were compared with."""
    batch_sizes: dict[int, int]
    messages: list[str] = field(default_factory=list)
    draw_sizes: dict[int, int] = field(default_factory=dict)  # lengths whose data cannot be drawn whole
    estimates: dict[int, Estimate] = field(default_factory=dict)
    limit: Limit | None = None

    @property
    def batch_size(self) -> int:
        """The smallest batch of any length (one number, for a caller that takes one)."""
        return min(self.batch_sizes.values())

    def eval_config(self, cfg_eval: DictConfig, length: int) -> DictConfig:
        """cfg.eval for one length with the guard's batch size: what posbench.evaluation.evaluate reads.
        The run's own config (its hash, its rows) is unchanged."""
        batch = self.batch_sizes.get(length)
        if batch is None or batch == int(cfg_eval.batch_size):
            return cfg_eval
        copy = OmegaConf.create(OmegaConf.to_container(cfg_eval, resolve=True))
        with open_dict(copy):
            copy.batch_size = batch
        return copy

    def draw_batch(self, cfg_eval: DictConfig, length: int) -> int:
        """The sequences drawn at a time at this length: eval.batch_size, unless its data would not fit."""
        return self.draw_sizes.get(length, int(cfg_eval.batch_size))


def largest_batch(cfg: DictConfig, built, length: int, limit: float, most: int,
                  whole_draw: bool = True) -> tuple[int, Estimate]:
    """The largest batch in 1..most whose estimate fits `limit` (0 when not even one sequence does), with
    its estimate (at batch 1 when none fits). The estimate grows with the batch: bisect."""
    low_est = estimate(cfg, built, length, 1, whole_draw=whole_draw)
    if low_est.total > limit:
        return 0, low_est
    low, high, best = 1, most, low_est
    while low < high:
        middle = (low + high + 1) // 2
        trial = estimate(cfg, built, length, middle, whole_draw=whole_draw)
        if trial.total <= limit:
            low, best = middle, trial
        else:
            high = middle - 1
    return low, best


def shape(task, length: int, tokens: int) -> str:
    if task.position_dims == 2:
        return f"grids of side {length}: {tokens:,} cells"
    return f"{tokens:,} tokens"


def lengths_setting(cfg: DictConfig, built) -> tuple[str, str]:
    """The key the evaluation lengths come from, and that key as the run sets it."""
    if cfg.eval.get("lengths"):
        return "eval.lengths", f"eval.lengths={[int(n) for n in cfg.eval.lengths]}"
    return "eval.ratios", (f"eval.ratios={[float(r) for r in cfg.eval.ratios]} (lengths {built.lengths} at "
                           f"train.length={built.train_length})")


def check_run(cfg: DictConfig, built, device: torch.device | str = "cpu") -> GuardResult:
    """The build's call on the plan (or on a built run), before the evaluation data is drawn and before
    training: every evaluation length against the limit, the batch size each gets and the messages to
    print, or a ValueError naming every length that cannot fit even one sequence at a time."""
    limit = memory_limit(cfg, device)
    batch = min(int(cfg.eval.batch_size), int(cfg.eval.samples))
    result = GuardResult({length: batch for length in built.lengths}, limit=limit)
    refused = []
    for length in built.lengths:
        full = estimate(cfg, built, length, batch)
        result.estimates[length] = full
        if limit.bytes is None or full.total <= limit.bytes:
            continue
        fitting, est = largest_batch(cfg, built, length, limit.bytes, batch)
        whole = bool(fitting) and not getattr(built.task, "memory", 0)  # segment recurrence: a stream per row
        if not fitting:  # not even the data of eval.batch_size sequences: drawn as few at a time as evaluated
            fitting, est = largest_batch(cfg, built, length, limit.bytes, batch, whole_draw=False)
        if fitting and not whole:
            result.draw_sizes[length] = fitting
        if fitting:
            result.batch_sizes[length], result.estimates[length] = fitting, est
            drawn = (f"from batches drawn {cfg.eval.batch_size} at a time as configured: the same sequences" if whole
                     else f"drawn {fitting} at a time: other sequences than eval.batch_size={cfg.eval.batch_size} "
                          "draws, so the run's config_hash records it (eval.drawn_batch_size)")
            result.messages.append(
                f"length {length} ({shape(built.task, length, est.tokens)}): eval.batch_size={cfg.eval.batch_size} "
                f"would need {full.describe()}, over the limit {limit}; evaluating it {fitting} sequence"
                f"{'s' if fitting > 1 else ''} at a time instead (about {gib(est.total)}), {drawn}")
            continue
        hint = ""
        chunk = eval_chunk(cfg.eval.chunk)
        if chunk != "auto":
            auto = estimate(cfg, built, length, 1, "auto", whole_draw=False)
            if auto.total <= limit.bytes:
                hint = f"; eval.chunk=auto would fit it ({gib(auto.total)} at eval.batch_size=1)"
        refused.append((length, est, hint))
    if refused:
        key, named = lengths_setting(cfg, built)
        lines = [f"  length {length} ({shape(built.task, length, est.tokens)}):"
                 f" {est.describe()} at eval.batch_size=1{hint}" for length, est, hint in refused]
        several = len(refused) > 1
        raise ValueError(
            f"{named}: {len(refused)} length{'s' if several else ''} cannot be evaluated within the memory limit "
            f"{limit}, even one sequence at a time:\n" + "\n".join(lines)
            + f"\nleave {'them' if several else 'it'} out of {key}, or {limit.remedy} (refused before training: "
              "nothing ran)")
    return result


# --- training, from the plan ---------------------------------------------------------------------------

# these estimates against the measured peaks of a build, its optimizer and two training steps: every encoding at
# 4,095 tokens in results/reference/guard_memory.csv (scripts/memory_guard_check.py), and
# tests/test_guard.py's test_the_training_estimate_bounds_the_measured_peak
OPTIMIZER_COPIES = 5  # per parameter beyond itself: its initialisation's temporary, gradient, AdamW's two moments
# and the step's temporaries
TRAIN_EXTRA_ROWS = 6  # [B, T, D] tensors of the backward beside those a layer keeps (ATTENTION_ROWS, the MLP's)
TRAIN_HEAD_COPIES = 4  # [B, T, V]: the logits, log-softmax, their gradients
TRAIN_BIAS_COPIES = 1  # [1, H, T, K] of a layer's bias on sdpa, kept for the backward (how it is built and its
# gradient: Encoding.extra_memory)
TRAIN_EAGER_COPIES = 2  # [B, H, T, K] tensors an eager layer keeps for the backward (the hooks' own: extra_memory)
DEFAULT_LONGEST_RATIO = 4  # eval.ratios' largest by default: a position table of 4 N rows is the usual size


@dataclass
class Cause:
    """A setting a part of the estimate grows with, and how many times its default it is."""
    setting: str  # key=value as the run sets it
    growth: float
    detail: str = ""  # what it amounts to here (tokens, positions)

    def __str__(self) -> str:
        return f"{self.setting} ({self.detail})" if self.detail else self.setting


@dataclass
class Part:
    name: str
    bytes: float
    causes: list[Cause]


def setting_default(key: str):
    return next(s.default for s in settings.SETTINGS if s.key == key)


def task_cause(task, key: str, value: int) -> Cause:
    """task.<key>=value against its constructor's default."""
    default = inspect.signature(type(task).__init__).parameters[key].default
    return Cause(f"task.{key}={value}", value / max(1, default))


def vocabulary_causes(cfg: DictConfig, task) -> list[Cause]:
    """The task settings its vocabulary is made of: the integers of at least half of it (task.symbols,
    task.keys) that its constructor takes with an integer default; the task itself where none is."""
    defaults = inspect.signature(type(task).__init__).parameters
    causes = [task_cause(task, key, value) for key, value in cfg.task.items()
              if isinstance(value, int) and not isinstance(value, bool) and key in defaults
              and isinstance(defaults[key].default, int) and task.vocab_size / 2 <= value <= task.vocab_size]
    return causes or [Cause(f"task={task.name}", 1.0, f"{task.vocab_size:,} tokens")]


def training_attention_bytes(built, batch: int, tokens: int) -> float:
    """What the layers' attention keeps for the backward at once, over all layers."""
    mcfg, encoding = built.model.cfg, built.encoding
    backend = BACKENDS[built.backend]()
    heads = mcfg.n_heads
    rows_fused = 4.0 * batch * heads * tokens * FLOAT
    total = 0.0
    for layer in range(mcfg.n_layers):
        window = mcfg.layer_window(layer)
        logits = needs_logits(encoding.hooks) or window is not None
        if not backend.takes_bias or not (logits or backend.per_sequence_logits):
            # fused kernels keep their output and log-sum-exps
            shape = LayerShape(batch, heads, tokens, tokens, None, 0.0, training=True)
            total += rows_fused + (encoding.kernel_memory(layer, shape) if backend.runs_kernel_of(encoding)
                                   else encoding.extra_memory(layer, shape))
            continue
        block = query_block(built, backend, window, batch, tokens, tokens, training=True)
        # each block of queries keeps its logits against its key prefix
        pairs = float(tokens) * tokens if block is None else float(tokens) * (tokens + block) / 2
        if backend.per_sequence_logits:
            total += TRAIN_EAGER_COPIES * batch * heads * pairs * FLOAT
        elif "bias" in encoding.hooks and (layer == 0 or not encoding.bias_layers_shared):
            total += TRAIN_BIAS_COPIES * heads * pairs * FLOAT
        total += rows_fused + encoding.extra_memory(layer, LayerShape(batch, heads, tokens, tokens, block, pairs,
                                                                      training=True))
    return total


def training_parts(cfg: DictConfig, built) -> list[Part]:
    """What a training step allocates, by part, from the plan (posbench.build.plan_run): the parameters with
    their gradients and AdamW's state, the activations kept for the backward, the head's logits, the batch.
    Data-parallel, a rank steps on its share of the global batch (posbench.distributed.shard) but draws the
    whole batch, as every rank does."""
    mcfg, task = built.model.cfg, built.task
    batch, tokens = int(cfg.train.batch_size), int(task.sequence_length(built.train_length))
    rows = -(-batch // distributed.size())  # this rank's rows: the first ranks take one more where they do not divide
    tables = {"tok.": 0.0, "head.": 0.0, "encoding.": 0.0, "": 0.0}  # by name prefix; "": the layers
    for name, tensor in (*built.model.named_parameters(), *built.model.named_buffers()):
        copies = 1 + OPTIMIZER_COPIES if isinstance(tensor, torch.nn.Parameter) else 1
        prefix = next(prefix for prefix in tables if name.startswith(prefix))
        tables[prefix] += copies * tensor.numel() * tensor.element_size()
    vocabulary = vocabulary_causes(cfg, task)
    width = Cause(f"model.d_model={mcfg.d_model}", mcfg.d_model / setting_default("model.d_model"))
    depth = Cause(f"model.n_layers={mcfg.n_layers}", mcfg.n_layers / setting_default("model.n_layers"))
    default_length = int(getattr(task, "default_length", built.train_length))
    step = [Cause(f"train.batch_size={batch}", batch / setting_default("train.batch_size")),
            Cause(f"train.length={built.train_length}", built.train_length / default_length, f"{tokens:,} tokens")]
    dims = built.encoding.dims
    if cfg.train.get("max_position"):
        positions_setting = f"train.max_position={cfg.train.max_position}"
    else:
        positions_setting = lengths_setting(cfg, built)[1]
    positions = Cause(positions_setting, dims.max_positions / (DEFAULT_LONGEST_RATIO * dims.train_positions),
                      f"{dims.max_positions:,} positions")
    row = float(rows) * tokens * mcfg.d_model * FLOAT
    alphabet = task.alphabet_setting
    draw_causes = [task_cause(task, alphabet, getattr(task, alphabet))] if alphabet else []
    return [
        Part("the token embedding and head [V, D] with gradients and AdamW's state",
             tables["tok."] + tables["head."], [*vocabulary, width]),
        Part(f"encoding={built.encoding.name}'s tables with gradients and AdamW's state", tables["encoding."],
             [positions, width]),
        Part("the layers' weights with gradients and AdamW's state", tables[""], [width, depth]),
        Part("the activations kept for the backward",
             mcfg.n_layers * (ATTENTION_ROWS + MLP_EXTRA_ROWS + TRAIN_EXTRA_ROWS + 2 * mcfg.mlp_ratio) * row
             + training_attention_bytes(built, rows, tokens), [*step, width, depth]),
        Part("the head's logits [B, T, V] and the loss's",
             rows * tokens * (task.vocab_size * FLOAT * TRAIN_HEAD_COPIES + 32.0), [*step, *vocabulary]),
        Part("the training batch", batch * (tokens * data_bytes_per_token(task) + alphabet_draw_bytes(task)),
             [*step, *draw_causes]),
        Part("overhead", float(OVERHEAD), []),
    ]


def host_ranks() -> int:
    """The processes torchrun started on this host (LOCAL_WORLD_SIZE): 1 outside a data-parallel run."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if distributed.size() > 1 else 1


def check_training(cfg: DictConfig, built, device: torch.device | str = "cpu") -> list[Part]:
    """Before anything is allocated: the training step's estimate against the limit (memory_limit). Over it,
    a ValueError naming the setting at fault (of the largest part, the one furthest above its default),
    the estimate by part and the limit. Returns the parts (none where the run does not train)."""
    if not int(cfg.train.steps):
        return []
    parts = training_parts(cfg, built)
    limit = memory_limit(cfg, device, host_ranks())
    total = sum(part.bytes for part in parts)
    if limit.bytes is None or total <= limit.bytes:
        return parts
    parts.sort(key=lambda part: -part.bytes)
    largest = next(part for part in parts if part.causes)  # not the fixed overhead
    fault = max(largest.causes, key=lambda cause: cause.growth)
    lines = [f"  {gib(part.bytes)}: {part.name}" + (f" ({', '.join(map(str, part.causes))})" if part.causes else "")
             for part in parts if part.bytes >= MIB]
    raise ValueError(f"{fault.setting}: training would need about {gib(total)}, over the memory limit {limit}:\n"
                     + "\n".join(lines) + f"\nlower {fault.setting} or the other settings of the largest part, or "
                     f"{limit.remedy} (refused before the model and data were built: nothing was allocated)")


# --- allocation errors -----------------------------------------------------------------------------

OOM_MARKERS = ("can't allocate memory", "cannot allocate memory", "out of memory", "not enough memory",
               "defaultcpuallocator: can't allocate", "failed to allocate")


def is_oom(err: BaseException) -> bool:
    """An allocation failure: torch.OutOfMemoryError (CUDA), MemoryError, or the CPU allocator's RuntimeError."""
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if isinstance(err, MemoryError) or (oom_type is not None and isinstance(err, oom_type)):
        return True
    return isinstance(err, RuntimeError) and any(marker in str(err).lower() for marker in OOM_MARKERS)


class OutOfMemory(RuntimeError):
    """An allocation that failed, told in the run's terms; `original` keeps torch's error."""

    def __init__(self, message: str, original: BaseException):
        super().__init__(message)
        self.original = original


def oom_message(err: BaseException, length: int | None = None, batch: int | None = None,
                what: str = "evaluation", settings: str | None = None) -> str:
    raw = " ".join(str(err).split())[:200]
    where = f"{what} at length {length}" if length is not None else what
    if batch is not None:
        where += f" ({batch} sequence{'s' if batch != 1 else ''} per batch)"
    settings = settings or (f"leave length {length} out of eval.lengths, lower eval.batch_size, or set "
                            f"{SETTING} (MiB) to what this machine can give so that the guard checks against it"
                            if length is not None else f"lower eval.batch_size or eval.lengths, or set {SETTING}")
    return f"out of memory in {where}: {settings} (torch: {type(err).__name__}: {raw})"


@contextlib.contextmanager
def translate_oom(length: int | None = None, batch: int | None = None, what: str = "evaluation",
                  settings: str | None = None):
    """Re-raises an allocation failure inside the block as OutOfMemory with a message naming the length
    and the settings to change (torch's own text at its end); any other error passes unchanged."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - only allocation failures are translated
        if not is_oom(err):
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        raise OutOfMemory(oom_message(err, length, batch, what, settings), err) from None
