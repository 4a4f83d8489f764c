"""DAPE, data-adaptive positional encoding (Zheng et al. NeurIPS 2024, arXiv 2405.14722; v2 "DAPE V2:
Process Attention Score as Feature Map", arXiv 2410.04798): a small network that reads every head's
logits together with a base relative bias and corrects them.

    v1:  A = S + B + f([S; B])     f = Linear(2H, D) -> LeakyReLU -> Linear(D, H) at every (i, j)
    v2:  A = S + B + g(tril([S; B]))   g = Conv2d(2H, D, (1, k)) -> LeakyReLU -> Conv2d(D, H, (1, k)),
                                       1 x k kernels along the key axis, padded by k // 2
    base rope or nope (no bias): A = S + f(S), f (or g) reading the H heads alone

S: the scaled logits q.k / sqrt(d) [B, H, Lq, Lk], finite and before the mask (as the official code,
chuanyang-Zheng/DAPE megatron/model/positional_embeddings.py, applies it to the scores already times
1 / sqrt(d)); B: the base's relative bias [H, Lq, Lk] (alibi's -m|i - j| from its linear_bias(), kerple's
and fire's bias()): the network is nonlinear, so it must see the bias itself, never a per-key rewrite
such as alibi's causal decay levels (they differ from it by a per-query constant the network does not
ignore).
The base is built here with the same model dimensions (its learned parameters belong to dape) and is
never applied by attention on its own: dape declares no decay or bias hook and adds B itself; with
base rope, dape owns the qk hook (the base's rotation). D = mlp_width; f and g keep nn's default
initialisation, as the official code.

v2's tril: entries of keys a query may not see are zeroed before the convolution, so nothing of the
future reaches it. Each query row is then its visible inputs with zeros on both sides, and both
convolutions run on that row as if it went on with zeros: the key axis is extended by k // 2 zero
columns at each end before the first convolution, so the hidden layer next to the row's ends is
computed from those zeros. A row then reads the same values whatever keys the call covers (a block
of queries against its key prefix, a sliding window's keys, a memory): chunked evaluation and query
blocks equal one pass. The official pass instead zero-pads the hidden layer at both ends of its key
axis: its first k // 2 keys of every row, and the last k // 2 keys of its last k // 2 queries, differ
from the rows above (the latter is why decoding one query at a time did not reproduce its last row).

The official release's v2 for rope / nope declares 2H input channels but receives H; here it reads H.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from posbench.checks import Choice, Integer
from posbench.encodings.alibi import ALiBi
from posbench.encodings.base import FLOAT_BYTES, Encoding, LayerShape, ModelDims
from posbench.encodings.fire import FIRE
from posbench.encodings.kerple import Kerple
from posbench.encodings.rope import RoPE

BASES: dict[str, type[Encoding] | None] = {"alibi": ALiBi, "kerple": Kerple, "fire": FIRE, "rope": RoPE,
                                           "nope": None}
BIASED = ("alibi", "kerple", "fire")  # bases whose bias the network reads beside the logits


class DAPE(Encoding):
    name = "dape"
    hooks = frozenset({"logit_transform"})  # the default base kerple's; base rope adds qk
    fla_kernel = "dape"  # backend=fla: posbench's Triton kernel for v1 (posbench.attention.dape_kernel); v2 has none
    relative = True  # as its base: fire is not relative

    def __init__(self, dims: ModelDims, version: int = 1, base: str = "kerple", mlp_width: int = 32,
                 kernel: int = 3, base_params: dict | None = None):
        super().__init__(dims)
        self.version = Integer(1, 2)("encoding.version", version, self.name)
        Choice(BASES)("encoding.base", base, self.name)
        self.mlp_width = Integer(1)("encoding.mlp_width", mlp_width, self.name)
        self.kernel = Integer(1)("encoding.kernel", kernel, self.name)
        if self.kernel % 2 == 0:
            raise ValueError(f"dape: encoding.kernel={kernel}: must be odd (a 1 x k convolution padded by k // 2 "
                             "on each side keeps the key axis), e.g. 1, 3 or 5")
        self.base_name = base
        self.base = build_base(base, dims, dict(base_params or {}))
        self.hooks = frozenset({"logit_transform", *(("qk",) if base == "rope" else ())})
        self.fla_kernel = "dape" if self.version == 1 else ""
        self.relative = self.base is None or self.base.relative
        heads, width = dims.n_heads, self.mlp_width
        features = 2 * heads if base in BIASED else heads
        if self.version == 1:
            self.net = nn.Sequential(nn.Linear(features, width), nn.LeakyReLU(), nn.Linear(width, heads))
        else:
            reach = (0, self.kernel // 2)
            self.net = nn.Sequential(nn.Conv2d(features, width, (1, self.kernel), padding=reach), nn.LeakyReLU(),
                                     nn.Conv2d(width, heads, (1, self.kernel), padding=reach))

    def params(self) -> dict:
        return {"version": self.version, "base": self.base_name, "mlp_width": self.mlp_width,
                "kernel": self.kernel if self.version == 2 else None,
                "base_params": self.base.params() if self.base is not None else {}}

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        if self.base is not None:
            self.base.set_eval_length(train_positions, eval_positions)
            self.relative = self.base.relative  # the base's may change with the length

    def train(self, mode: bool = True):
        super().train(mode)  # the base may return to its training length
        self.relative = self.base is None or self.base.relative
        return self

    def qk(self, q, k, q_pos, k_pos, layer):
        if self.base is None:
            return q, k
        return self.base.qk(q, k, q_pos, k_pos, layer)  # declared with base rope (the others leave q, k)

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # training: the base bias and the MLP's input and output over every pair, kept for the backward; in
        # evaluation they go tile by tile
        return shape.pair_bytes(4.5) if shape.training else 0.0

    def kernel_memory(self, layer: int, shape: LayerShape) -> float:
        # the base's bias [1, H, Lq, Lk], formed once per call (training: with its gradient and what autograd keeps
        # to differentiate it); the kernel forms nothing of the batch's pairs
        if self.base_name not in BIASED:
            return 0.0
        return (3.0 if shape.training else 1.0) * FLOAT_BYTES * shape.heads * shape.tokens * shape.keys

    def logit_transform(self, logits, q, k, call):
        bias = self.base_bias(call).to(logits.dtype) if self.base_name in BIASED else None  # [B', H, Lq, Lk]
        if self.version == 1 and logits.device.type != "cpu":
            return pair_mlp_blocks(logits, bias, self.net)  # [B, H, Lq, Lk]
        if self.version == 1:  # A = S + B + f([S; B]) (A = S + f(S) without a bias)
            first, act, last = self.net
            return PairMLP.apply(logits, bias, first.weight, first.bias, last.weight, last.bias,
                                 act.negative_slope)  # [B, H, Lq, Lk]
        if bias is None:
            return logits + self.correction(logits, call)  # A = S + g(S)
        bias = bias.expand_as(logits)  # [B, H, Lq, Lk]
        features = torch.cat([logits, bias], dim=1)  # [S; B]: [B, 2H, Lq, Lk]
        return logits + bias + self.correction(features, call)  # A = S + B + g([S; B])

    def base_bias(self, call) -> torch.Tensor:
        """B at the call's positions: [B', H, Lq, Lk]."""
        if isinstance(self.base, ALiBi):  # -m |i - j| in either layout (a causal alibi's bias() is None: its decay)
            return self.base.linear_bias(call.q_pos, call.k_pos)
        return self.base.bias(call.q_pos, call.k_pos, call.layer)

    def correction(self, features: torch.Tensor, call) -> torch.Tensor:
        """g (v2) of the features [B, C, Lq, Lk] -> [B, H, Lq, Lk]."""
        visible = call.visible()  # [Lq, Lk] or None
        if visible is not None:
            features = features.masked_fill(~visible, 0.0)  # tril: the future never reaches the convolution
        keys, reach = features.shape[-1], self.kernel // 2
        extended = F.pad(features, (reach, reach))  # the row goes on with zeros: [B, C, Lq, Lk + 2 reach]
        return self.net(extended)[..., reach:reach + keys]  # [B, H, Lq, Lk]


def build_base(name: str, dims: ModelDims, params: dict) -> Encoding | None:
    """The base encoding with its parameters (checked against its constructor), or None for nope."""
    cls = BASES[name]
    accepted = [] if cls is None else [key for key in inspect.signature(cls.__init__).parameters
                                        if key not in ("self", "dims")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"dape: encoding.base_params has {unknown}, which base {name} does not take; "
                         f"its parameters: {accepted}")
    return None if cls is None else cls(dims, **params)


BLOCK_ELEMENTS = 2**27  # hidden-layer elements of one query block of pair_mlp_blocks (512 MiB in float32)


def pair_mlp_blocks(logits: torch.Tensor, bias: torch.Tensor | None, net: nn.Sequential) -> torch.Tensor:
    """v1 off the CPU, where PairMLP's small tiles would each launch kernels of their own: the network
    over every pair of a block of queries in a few batched products. Each block is recomputed in
    backward (a checkpoint), so that memory holds one block's hidden layer. logits [B, H, Lq, Lk], bias
    [B', H, Lq, Lk] or None -> [B, H, Lq, Lk]."""
    batch, _, queries, keys = logits.shape
    rows = max(1, BLOCK_ELEMENTS // (batch * net[0].out_features * keys))
    blocks = [checkpoint(pair_mlp, logits[:, :, start:start + rows],
                         None if bias is None else bias[:, :, start:start + rows], net, use_reentrant=False)
              for start in range(0, queries, rows)]
    return torch.cat(blocks, dim=2)  # [B, H, Lq, Lk]


def pair_mlp(logits: torch.Tensor, bias: torch.Tensor | None, net: nn.Sequential) -> torch.Tensor:
    """S + B + f([S; B]) (S + f(S) without a bias), f = net at every pair: [B, H, Lq, Lk]."""
    features = logits if bias is None else torch.cat([logits, bias.expand_as(logits)], dim=1)  # [B, C, Lq, Lk]
    correction = net(features.movedim(1, -1)).movedim(-1, 1)  # f([S; B]): [B, H, Lq, Lk]
    return logits + correction if bias is None else logits + bias + correction


class PairMLP(torch.autograd.Function):
    """v1's A = S + B + f([S; B]), f = Linear(C, D) -> LeakyReLU -> Linear(D, H) at every pair (i, j),
    computed a tile of TILE_ELEMENTS of one sequence's hidden layer at a time along the pairs: the hidden
    layer [B, D, pairs] is never stored whole (backward computes each tile's again), so it stays in cache
    and its memory never grows with the length. S: [B, H, Lq, Lk]; B: [B', H, Lq, Lk] (B' = 1 or B) or
    None (C = H); the weights as nn.Linear's. A tile's inputs [S; B; 1] sit in one buffer, so that the
    first layer, b1 included, is one matrix product, and its weights' gradient another; a bias shared by
    the batch (B' = 1) is copied there, and gets its gradient, once per tile."""

    @staticmethod
    def forward(ctx, logits, bias, w1, b1, w2, b2, slope: float):
        s, b = pairs(logits), None if bias is None else pairs(bias)  # [B, H, P], [B', H, P]
        w1_full = torch.cat([w1, b1[:, None]], dim=1)  # [W1 b1]: [D, C + 1]
        out = s.clone() if b is None else s + b  # S + B: [B, H, P]
        out += b2[:, None]
        for t, inputs in tiles(s, b, w1.shape[0]):
            for seq in range(s.shape[0]):
                fill(inputs, s, b, seq, t)
                hidden = F.leaky_relu_(w1_full @ inputs, slope)  # [D, tile]
                out[seq, :, t].addmm_(w2, hidden)  # += W2 hidden: [H, tile]
        ctx.save_for_backward(logits, bias, w1, b1, w2)
        ctx.slope = slope
        return out.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        logits, bias, w1, b1, w2 = ctx.saved_tensors
        s, b, g = pairs(logits), None if bias is None else pairs(bias), pairs(grad)  # [B, H, P], [B', H, P], [B, H, P]
        heads, w1_full = s.shape[1], torch.cat([w1, b1[:, None]], dim=1)  # [W1 b1]: [D, C + 1]
        w1_s, w1_b = w1[:, :heads], w1[:, heads:]  # [D, H], [D, C - H]
        ds = g.clone()  # the S in A: [B, H, P]
        db = None if b is None else sum_to_batch(g, b.shape[0]).clone()  # [B', H, P]
        dw1_full, dw2 = torch.zeros_like(w1_full), torch.zeros_like(w2)  # [D, C + 1]: dW1 and db1
        shared = b is not None and b.shape[0] == 1
        for t, inputs in tiles(s, b, w1.shape[0]):
            dpre_sum = None  # dpre summed over the sequences, for a shared bias: [D, tile]
            for seq in range(s.shape[0]):
                fill(inputs, s, b, seq, t)
                g_t = g[seq, :, t]  # [H, tile]
                pre = w1_full @ inputs  # [D, tile]
                dw2.addmm_(g_t, F.leaky_relu(pre, ctx.slope).T)
                dpre = torch.ops.aten.leaky_relu_backward(w2.T @ g_t, pre, ctx.slope, False)  # [D, tile]
                dw1_full.addmm_(dpre, inputs.T)
                ds[seq, :, t].addmm_(w1_s.T, dpre)
                if shared:
                    dpre_sum = dpre if dpre_sum is None else dpre_sum.add_(dpre)
                elif b is not None:
                    db[seq, :, t].addmm_(w1_b.T, dpre)
            if shared:
                db[0, :, t].addmm_(w1_b.T, dpre_sum)
        return (ds.view_as(logits), None if db is None else db.view_as(bias), dw1_full[:, :-1], dw1_full[:, -1],
                dw2, g.sum((0, 2)), None)


TILE_ELEMENTS = 2**18  # elements of one sequence's hidden layer per tile of PairMLP (1 MiB in float32: within L2)


def pairs(t: torch.Tensor) -> torch.Tensor:
    """[B, C, Lq, Lk] -> [B, C, Lq Lk]."""
    return t.reshape(*t.shape[:2], -1)


def tiles(s: torch.Tensor, b: torch.Tensor | None, width: int):
    """Slices along the pairs of s [B, H, P], each of TILE_ELEMENTS of a [width, tile] hidden layer, with
    a buffer for the tile's inputs [S; B; 1] [C + 1, tile], its ones and a shared bias (B' = 1) filled in."""
    size, n_pairs = max(1, TILE_ELEMENTS // width), s.shape[-1]
    channels = s.shape[1] + (0 if b is None else b.shape[1])
    buffer = s.new_ones(channels + 1, min(size, n_pairs))  # [C + 1, tile]
    for start in range(0, n_pairs, size):
        stop = min(start + size, n_pairs)
        t, inputs = slice(start, stop), buffer[:, :stop - start]
        if b is not None and b.shape[0] == 1:
            inputs[s.shape[1]:-1] = b[0, :, t]
        yield t, inputs


def fill(inputs: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None, seq: int, t: slice) -> None:
    """A tile's inputs [S; B; 1] for sequence seq: its logits, and its own bias when not shared."""
    heads = s.shape[1]
    inputs[:heads] = s[seq, :, t]
    if b is not None and b.shape[0] > 1:
        inputs[heads:-1] = b[seq, :, t]


def sum_to_batch(t: torch.Tensor, batch: int) -> torch.Tensor:
    """t [B, C, P] summed over the batch when the tensor it goes to is shared by it ([1, C, P])."""
    return t.sum(0, keepdim=True) if batch == 1 and t.shape[0] != 1 else t
