"""The Encoding base class: every positional encoding fills some of these hooks.

Order inside one attention layer (declared in `posbench.hooks`, applied by `posbench.attention`):

    embed, state_init (model input) -> kv -> qkv -> qk -> query_scale -> layer_pass (once, every query)
    -> [per block of queries:] logits = q.k^T * scale + decay + bias + key_term -> logit_transform -> mask
    -> normalize (softmax by default) -> prob -> p.V + value_term -> state_update -> output -> [the block's
    feed-forward] -> state_mlp

The position-only hooks (embed, qk, bias, key_term, prob, value_term) take positions and the
layer; the hooks that see content (kv, query_scale, decay, logit_transform, normalize) take the call
(`posbench.attention.context.AttentionCall`: the layer's input x, the positions, the mask), and
output takes the heads' output and the layer's input at the queries. Every hook sees one block of
queries at a time (docs/adding-an-encoding.md, "The hooks"), except layer_pass: it runs once per layer
over every query, and what it returns reaches every block's hooks as call.layer_state. A position
state (state_init, once per forward) passes from layer to layer: call.state in the layer's hooks.

Positions are always passed in explicitly, shaped [B', L] with B' either 1 (shared
by the batch) or B (one row per sequence), so that randomized positions, offsets
and interpolation need no change here. Grid tasks pass [B', L, 2] (row, column):
a 2-D encoding (position_dims = 2) reads them as they are, a 1-D one reads the raster
index r * W + c, converted once per forward by `read_positions` (the one adapter).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from posbench.hooks import HOOKS
from posbench.positions import raster

FLOAT_BYTES = 4  # extra_memory's unit: float32


@dataclass(frozen=True)
class LayerShape:
    """One layer's attention as posbench.guard sizes it, for Encoding.extra_memory."""

    batch: int
    heads: int
    tokens: int  # the layer's queries
    keys: int
    block: int | None  # queries per block (evaluation: per chunk; None: one call over all)
    pairs: float  # query-key pairs whose logits are alive at once: one chunk's, or every training block's
    # (kept for the backward); 0 on a fused kernel
    training: bool

    def pair_bytes(self, copies: float = 1.0) -> float:
        """`copies` float32 [B, H, pairs] tensors: the unit of most declarations."""
        return copies * FLOAT_BYTES * self.batch * self.heads * self.pairs

    def bias_bytes(self, copies: float = 1.0) -> float:
        """`copies` float32 [1, H, pairs] tensors: a bias shared by the batch."""
        return copies * FLOAT_BYTES * self.heads * self.pairs

    def full_bytes(self, copies: float = 1.0) -> float:
        """`copies` float32 [B, H, tokens, keys] tensors: every query against every key at once."""
        return copies * FLOAT_BYTES * self.batch * self.heads * self.tokens * self.keys


@dataclass(frozen=True)
class ModelDims:
    """What an encoding may need to know about the model it sits in."""

    d_model: int
    n_heads: int
    n_layers: int
    max_positions: int  # largest position id + 1 the run will ever feed (train and eval)
    train_positions: int  # largest position id + 1 seen in training
    causal: bool = True
    vocab_size: int = 0  # for encodings that build word-dependent positions (complex_order)
    # grid tasks only (0 otherwise): largest row/column position + 1 ever fed, and seen in training;
    # max_positions and train_positions then count raster ids (side^2), which 1-D encodings read
    max_side: int = 0
    train_side: int = 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Encoding(nn.Module):
    """Base class. Subclasses set `name` and the traits, and override the hooks they declare.

    Every hook defaults to "no change". The traits are read from the built instance: `hooks`
    (the hooks it overrides, so backends can refuse what they cannot run), `relative` and
    `replaces_token_embedding`. A class declares them for its instances; one whose traits depend
    on its parameters (a composite, from its parts) sets them in __init__.
    """

    name: str = ""
    hooks: frozenset[str] = frozenset()
    relative: bool = False  # logits depend on i - j only (shift invariance); on grids, on (dy, dx) only
    replaces_token_embedding: bool = False  # embed builds the input from the ids and ignores x
    bias_layers_shared: bool = False  # bias(q_pos, k_pos, layer) is the same for every layer: built once
    position_dims: int = 1  # 1: reads ids [B', L]; 2: reads (row, column) [B', L, 2] (needs a grid task)
    causal_only: bool = False  # refuses a bidirectional model (model.causal=false)
    reads_query_key: bool = False  # a hook reads q or k themselves, not only their logits (key_term always does)
    widens_query_key: bool = False  # qk returns q and k wider than d (pope: 2d)
    loads_checkpoints_of: tuple[str, ...] = ()  # train.init_from: the encodings (_target_) whose checkpoints it loads
    # backend=flex differentiates its score_mod on CUDA. False where torch's FlexAttention cannot (torch 2.11,
    # H200: a learned table looked up by bucket, an unrolled MLP, gate levels indexed per query and key);
    # auto then trains on sdpa. tests/test_cuda.py checks every encoding left True on a GPU.
    flex_trains: bool = True
    # why backend=flex trains it slowly on CUDA, where it does; auto then trains on sdpa (and evaluates on flex)
    flex_trains_slowly: str = ""
    # the fla-core kernel whose attention its logit hook is (stick_breaking: normalize; path: logit_transform), which
    # backend=fla runs whole (posbench.attention.fla)
    fla_kernel: str = ""
    # posbench's kernel that computes its bias in the tiles where backend=fla runs it ("fire":
    # posbench.attention.fire_kernel); a bias of i - j alone (bias_relative) takes the relative bias kernel instead
    bias_kernel: str = ""

    def __init__(self, dims: ModelDims):
        super().__init__()
        unknown = set(self.hooks) - set(HOOKS)
        if unknown:
            raise TypeError(f"{type(self).__name__} declares unknown hooks {sorted(unknown)}; valid: {list(HOOKS)}")
        self.dims = dims

    @property
    def bias_relative(self) -> bool:
        """The bias alone depends on i - j only, so per-offset rows can serve every block."""
        return self.relative

    def params(self) -> dict:
        """The encoding's settings as recorded in every result row."""
        return {}

    def read_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """The positions this encoding's hooks read, from those the task hands the model ([B', L] or
        [B', L, 2]): a 1-D encoding on a grid gets the raster index. Called once per forward."""
        if pos.dim() == 3 and self.position_dims == 1:
            return raster(pos)  # [B', L]
        if pos.dim() == 2 and self.position_dims == 2:
            raise ValueError(f"encoding {self.name} reads (row, column) positions [B', L, 2] but got 1-D "
                             f"positions {tuple(pos.shape)}; run it on a grid task")
        return pos

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        """Called by the runner before evaluating sequences of eval_positions tokens after
        training on up to train_positions: the one place for evaluation-time switches
        (RoPE scalings, table extensions). Default: nothing changes."""

    def set_train_step(self, step: int, total: int) -> None:
        """Called by the training loop before training step `step` (0-based) of `total` (train.steps): the one
        place for training-phase switches (drope drops its rotation). A switch is a Python attribute, which a
        compiled forward guards on (one recompile). Default: nothing changes."""

    def train_phase(self) -> tuple:
        """The training-phase switches set_train_step has set, as a value: train.compile=capture records a graph
        per phase (a switch is Python, which a recorded graph does not read). Default: none."""
        return ()

    def logit_scale(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim)

    def at(self, layer: int) -> Encoding:
        """The encoding that runs in `layer`: itself (a schedule's is one of its entries)."""
        return self

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        """Bytes this encoding's hooks hold at once in `layer` beyond what posbench.guard counts for their kinds
        (the backend's logits, mask and softmax; a bias; q, k and v): its own [B, H, Lq, Lk] tensors and tables
        per token, at `shape` (a training step, where autograd keeps what the backward needs, or an evaluation
        forward). A hook run once per forward (embed) counts at layer 0. float32's bytes, the guard's bound.
        Default: none."""
        return 0.0

    def kernel_memory(self, layer: int, shape: LayerShape) -> float:
        """Bytes the kernel of `fla_kernel` holds beyond its output and per-row buffers, where backend=fla runs this
        encoding's attention (extra_memory is then not allocated). Default: none."""
        return 0.0

    def embed(self, x: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [B, L, D] token embeddings, pos: [B', L] ([B', L, 2] if position_dims = 2), ids: [B, L] -> [B, L, D]."""
        return x

    def state_init(self, pos: torch.Tensor, x: torch.Tensor):
        """The position state at the model input: pos [B', L], x [B, L, D] the input embedding (batch, dtype) ->
        any state, read by the first layer as call.state."""
        return None

    def qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call):
        """After kv, before qk, every query at once: q, k, v [B, H, L, d], the call (its x, the layer's input, and
        call.state, the position state the layer receives) -> q and k transformed, and v, possibly widened with
        state columns that attention averages with the same weights as v (the layer hands the wide output to
        state_update)."""
        return q, k, v

    def state_update(self, y: torch.Tensor, call):
        """y [B, H, L, width of qkv's v], attention's output -> (y back to d columns, the state the rest of
        the layer and the next one receive)."""
        return y, call.state

    def state_mlp(self, state, u: torch.Tensor, layer: int):
        """After the block's feed-forward: its output u [B, L, D] (before the residual add) -> the new state."""
        return state

    def kv(self, k: torch.Tensor, v: torch.Tensor, call) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, H, Lk, d] as projected, call.x the layer's input at the keys [B, Lk, D] -> the same shapes."""
        return k, v

    def qk(self, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [B, H, Lq, d], k: [B, H, Lk, d] at q_pos [B', Lq(, 2)], k_pos [B', Lk(, 2)] -> the same, q and k may be wider (pope)."""
        return q, k

    def query_scale(self, call) -> torch.Tensor | None:
        """-> [B|1, H|1, Lq, 1], multiplying q after qk (call.keys_seen(): the keys each query attends)."""
        return None

    def layer_pass(self, q: torch.Tensor, k: torch.Tensor, call):
        """Once per layer, before the blocks: q [B, H, Lq, d] (every query of the layer) and k [B, H, Lk, d]
        after qk and query_scale; call.block_starts the queries (indices among them) where the blocks the
        layer will attend begin -> any state, handed to every block's hooks as call.layer_state (each block's
        call.query_offset says which block it is)."""
        return None

    def decay(self, call) -> torch.Tensor | None:
        """-> levels c at the keys [B|1, H, Lk] (queries: the last Lq); the logits get c_i - c_j. call.x:
        the layer's input at the keys [B, Lk, D]. Levels may be float64 (a long cumulative sum)."""
        return None

    def logit_transform(self, logits: torch.Tensor, q: torch.Tensor, k: torch.Tensor, call) -> torch.Tensor:
        """logits [B, H, Lq, Lk] (scaled, with decay, bias and key_term; finite, before the mask; call
        .visible() is the mask), q [B, H, Lq, d] and k [B, H, Lk, d] as the logits saw them -> [B, H, Lq, Lk]."""
        return logits

    def normalize(self, logits: torch.Tensor, v: torch.Tensor, call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replaces softmax: masked logits [B, H, Lq, Lk] (-inf where unseen), v [B, H, Lk, d] -> weights
        [B, H, Lq, Lk] and a term [B, H, Lq, d] added to weights.V (or None)."""
        return logits.softmax(dim=-1), None

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int) -> torch.Tensor | None:
        """-> [B', H, Lq, Lk], added to the scaled logits."""
        return None

    def score_mod(self, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int):
        """The bias as a FlexAttention score_mod: (score, b, h, q_idx, kv_idx) -> score plus the bias of
        head h between query q_idx and key kv_idx of sequence b (positions [B', Lq], [B', Lk]), computed
        one score at a time; None when the bias cannot be written so (backend=flex then refuses it)."""
        return None

    def key_term(self, q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 layer: int) -> torch.Tensor | None:
        """Content-dependent logit term -> [B, H, Lq, Lk], added after scaling."""
        return None

    def prob(self, p: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int) -> torch.Tensor:
        """p: [B, H, Lq, Lk] softmax probabilities -> the same shape."""
        return p

    def value_term(self, p: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   layer: int) -> torch.Tensor | None:
        """-> [B, H, Lq, d], added to p.V."""
        return None

    def output(self, y: torch.Tensor, x: torch.Tensor, layer: int) -> torch.Tensor:
        """y [B, H, Lq, d], the heads' attention output, and x [B, Lq, D], the layer's input at the queries
        -> y's shape, before the heads are joined and projected."""
        return y

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params().items())


_graph_safe_steps = 0  # graph_safe() contexts entered and not yet left


@contextlib.contextmanager
def graph_safe():
    """The training steps of train.compile=capture, on every device (posbench.capture): the hooks take their
    paths that read nothing back to the host, which a CUDA graph cannot record."""
    global _graph_safe_steps
    _graph_safe_steps += 1
    try:
        yield
    finally:
        _graph_safe_steps -= 1


def host_reads_allowed() -> bool:
    """Whether a hook may read a tensor's value on the host: not inside a compiled graph (train.compile), where
    the read would break the graph, nor in a step recorded as a CUDA graph (graph_safe)."""
    return not (_graph_safe_steps or torch.compiler.is_compiling())


def position_range(pos: torch.Tensor) -> tuple[int, int] | None:
    """(smallest, largest) position id, read on the host for a bounds check; None where no host read is
    allowed (host_reads_allowed: a compiled or recorded training step): training positions lie within the
    tables by construction, and evaluation, where lengths grow, runs uncompiled."""
    if not host_reads_allowed():
        return None
    return int(pos.min()), int(pos.max())


def relative_distance(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """i - j for every query/key pair: [B', Lq], [B', Lk] -> [B', Lq, Lk]."""
    return q_pos[:, :, None] - k_pos[:, None, :]


def score_positions(q_pos: torch.Tensor, k_pos: torch.Tensor):
    """Inside a score_mod: (b, q_idx, kv_idx) -> (i, j), the positions of query q_idx and key kv_idx of
    sequence b; q_pos [B', Lq], k_pos [B', Lk], B' = 1 (shared by the batch) or B."""
    q_row = (lambda b: q_pos[0]) if q_pos.shape[0] == 1 else (lambda b: q_pos[b])
    k_row = (lambda b: k_pos[0]) if k_pos.shape[0] == 1 else (lambda b: k_pos[b])
    return lambda b, q_idx, kv_idx: (q_row(b)[q_idx], k_row(b)[kv_idx])


def bias_by_offset(encoding: Encoding, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   layer: int) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """For a bias of i - j alone (a relative encoding): the encoding's own bias() of every offset the positions
    [B', Lq], [B', Lk] span, [H, n] from the first offset (None where the layer has no bias: a schedule's), and
    that offset as a tensor (a score_mod's: an int would compile in as a constant) and as an int. Where no host
    read is allowed (a compiled or recorded training step), every offset of the training positions instead
    (ModelDims.train_positions), which bound them by construction."""
    if host_reads_allowed():
        first, top = q_pos.min() - k_pos.max(), q_pos.max()
        low, high = torch.stack([first, top - k_pos.min()]).tolist()  # one read on the host
    else:
        high = encoding.dims.train_positions - 1
        low = -high
        first, top = (torch.full((), value, dtype=q_pos.dtype, device=q_pos.device)  # a fill: no copy from the host
                      for value in (low, high))
    offsets = torch.arange(low, high + 1, device=q_pos.device)  # i - j: [n]
    rows = encoding.bias(top.view(1, 1), (top - offsets)[None], layer)  # keys at top - offset: [1, H, 1, n]
    return (None if rows is None else rows[0, :, 0]), first, low


def offset_score_mod(encoding: Encoding, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int):
    """A score_mod for a bias of i - j alone (a relative encoding): its bias_by_offset rows, looked up per score."""
    rows, first, _ = bias_by_offset(encoding, q_pos, k_pos, layer)  # [H, n]
    positions = score_positions(q_pos, k_pos)

    def lookup(score, b, h, q_idx, kv_idx):
        i, j = positions(b, q_idx, kv_idx)
        return score + rows[h, i - j - first]

    return lookup


def require_grid(name: str, dims: ModelDims) -> None:
    """2-D encodings refuse, before training, a task that hands the model 1-D positions."""
    if not dims.max_side:
        raise ValueError(f"encoding {name} reads (row, column) positions and needs a grid task (tasks with "
                         "position_dims = 2: task=life, grid_flip, grid_row_count, grid_nearest); 1-D tasks "
                         "take the 1-D encodings, which also run on grids over raster positions")


def grid_offsets(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(dy, dx) = query - key for every pair: [B', Lq, 2], [B', Lk, 2] -> [B', Lq, Lk, 2]."""
    return q_pos[:, :, None, :] - k_pos[:, None, :, :]
