"""FIRE (Li et al. ICLR 2024, "Functional Interpolation for Relative Positions Improves Long
Context Transformers"): a small MLP of the progressively normalised distance.

    b(i, j) = f(psi(|i - j|) / psi(max(L, i))),   psi(x) = log(c * x + 1)

f: Linear(1, width) -> ReLU -> Linear(width, H), one output per head. c and L are learned.
Details from the paper's PyTorch listing: c starts at 0.1 and enters as |c|; L is a fixed
initial value times a learned multiplier (starting at 1), used as |multiplier * L|, so that
it moves in relative steps; 1e-6 is added to the normaliser; the distance enters as |i - j|
(keys after the query, used by bidirectional models, mirror the ones before it); the MLP
keeps nn.Linear's default initialisation. Each layer has its own FIRE (the paper calls the
variant shared across layers FIRE-S: `share_layers`).

Not shift invariant (`relative = False`): the normaliser psi(max(L, i)) depends on the query
position i itself, so shifting every position changes the bias once i exceeds L. Below L
the normaliser is the constant psi(L) and the bias depends on i - j only. i and j are the
position ids passed in, so shifted or randomized positions change the normaliser too.

The paper initialises L to 512 for 2048-token training, a quarter of the training length;
`init_threshold: null` keeps that ratio to this run's training positions.
"""
from __future__ import annotations

import torch
from torch import nn

from posbench.checks import Flag, Integer, Real
from posbench.encodings.base import (Encoding, LayerShape, ModelDims, host_reads_allowed, relative_distance,
                                     score_positions)

NORMALISER_EPS = 1e-6


def piecewise_linear_mlp(mlp: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """Linear(1, width) -> ReLU -> Linear(width, H) of a scalar input, evaluated as what it is: a
    piecewise-linear function with a breakpoint where each hidden unit turns on or off. Per segment
    between breakpoints one slope and one intercept per head; each input finds its segment by a
    search and reads them, so no [..., width] hidden layer is formed (4-8x less work than the MLP
    on [L, L] inputs). The same function, and gradients for every weight (a hidden unit counts as
    on or off by its value at the segment's middle, as ReLU's derivative does between breakpoints).
    Heads first, so that a bias [1, H, Lq, Lk] comes out contiguous (a [Lq, Lk, H] one permuted cost its
    attention a transposing copy). x: [...] -> [H, ...]."""
    hidden, out = mlp[0], mlp[2]
    w, b = hidden.weight[:, 0], hidden.bias  # [width], [width]
    flat = w == 0  # a unit with w = 0 has no breakpoint: on or off everywhere
    breaks = torch.where(flat, torch.full_like(b, float("inf")), -b / torch.where(flat, torch.ones_like(w), w))
    breaks = breaks.detach().sort().values  # [width], the flat units' infinities last
    # a flat unit's breakpoint moves to one past the last finite one (0 when none is): an empty segment there,
    # never searched into, and sizes that do not depend on the weights (no host read in a compiled graph)
    finite = breaks.isfinite()
    past = torch.where(finite.any(), breaks.masked_fill(~finite, float("-inf")).max() + 1, 0.0)
    breaks = torch.where(finite, breaks, past)  # [width]
    edges = torch.cat([breaks[:1] - 1, breaks, breaks[-1:] + 1])  # [width + 2]
    middles = (edges[:-1] + edges[1:]) / 2  # one point inside each of the width + 1 segments: [S]
    on = (middles[:, None] * w + b > 0).to(w.dtype)  # [S, width]
    slope = out.weight @ (on * w).T  # [H, S]
    intercept = out.weight @ (on * b).T + out.bias[:, None]  # [H, S]
    segment = torch.searchsorted(breaks.contiguous(), x.detach().contiguous(), right=True).reshape(-1)  # [N]
    lookup = torch.addcmul(segment_rows(intercept, segment), segment_rows(slope, segment), x.reshape(1, -1))
    return lookup.view(-1, *x.shape)  # [H, ...]


def segment_rows(table: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """table [H, S] read at each input's segment [N] -> [H, N]. By gather, whose backward scatter-adds: indexing's
    summed each segment's repeats one by one on CUDA (an H100 trained fire at 0.03x nope's tokens/s at 1,025
    tokens); on the CPU gather is faster too. scripts/attention_costs.py times another backward against it."""
    return table.gather(1, segment[None].expand(table.shape[0], -1))  # [H, N]


class FIRE(Encoding):
    name = "fire"
    hooks = frozenset({"bias"})
    flex_trains = False  # its MLP unrolled in the score_mod indexes each weight once per unit
    relative = False  # the normaliser depends on the query position i (see the module docstring)
    bias_kernel = "fire"  # backend=fla computes its bias in the tiles (posbench.attention.fire_kernel)

    def __init__(self, dims: ModelDims, mlp_width: int = 32, init_c: float = 0.1,
                 init_threshold: float | None = None, share_layers: bool = False):
        super().__init__(dims)
        self.mlp_width = Integer(1)("encoding.mlp_width", mlp_width, self.name)
        self.init_c = Real(above=0)("encoding.init_c", init_c, self.name)
        init_threshold = Real(above=0, null="training positions / 4")("encoding.init_threshold", init_threshold,
                                                                       self.name)
        self.init_threshold = max(1.0, dims.train_positions / 4) if init_threshold is None else init_threshold
        self.share_layers = Flag()("encoding.share_layers", share_layers, self.name)
        self.bias_layers_shared = self.share_layers
        copies = 1 if self.share_layers else dims.n_layers
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(1, self.mlp_width), nn.ReLU(), nn.Linear(self.mlp_width, dims.n_heads))
            for _ in range(copies))
        self.c = nn.Parameter(torch.full((copies,), self.init_c))  # [copies]
        self.threshold_scale = nn.Parameter(torch.ones(copies))  # [copies]; L = |scale * init_threshold|

    def params(self) -> dict:
        return {"mlp_width": self.mlp_width, "init_c": self.init_c, "init_threshold": self.init_threshold,
                "share_layers": self.share_layers}

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # training: the bias's autograd record, the distances, their normalisation and the MLP's segment lookups, and its gradient, beside the bias the guard counts
        if not shape.training or (self.bias_layers_shared and layer):
            return 0.0
        return shape.bias_bytes(3.25)

    def kernel_memory(self, layer: int, shape: LayerShape) -> float:
        # training: the kernel's gradient rows per sequence and head, by distance and by query (float32)
        return 4.0 * shape.batch * shape.heads * (shape.keys + shape.tokens) if shape.training else 0.0

    def kernel_inputs(self, q_pos, k_pos, layer):
        """What FIRE's kernel reads (posbench.attention.fire_kernel): log(1 + c d) at every distance d the positions
        [B', Lq], [B', Lk] span ([n]; where no host read is allowed, every distance of the training positions), each
        query's 1 / psi(max(i, L)) [B', Lq], and the MLP's weights: w1, b1 [W], w2 [H, W], b2 [H]."""
        copy = 0 if self.share_layers else layer
        c = self.c[copy].abs()
        threshold = (self.threshold_scale[copy] * self.init_threshold).abs()
        if host_reads_allowed():
            spans = torch.stack([q_pos.max() - k_pos.min(), k_pos.max() - q_pos.min()])
            farthest = max(spans.tolist())  # one read on the host
        else:
            farthest = self.dims.train_positions - 1
        distances = torch.log1p(c * torch.arange(max(farthest, 0) + 1, device=q_pos.device, dtype=c.dtype))  # [n]
        normalisers = 1 / (torch.log1p(c * torch.maximum(q_pos.to(c.dtype), threshold)) + NORMALISER_EPS)  # [B', Lq]
        hidden, out = self.mlps[copy][0], self.mlps[copy][2]
        return distances, normalisers, hidden.weight[:, 0], hidden.bias, out.weight, out.bias

    def bias(self, q_pos, k_pos, layer):
        copy = 0 if self.share_layers else layer
        c = self.c[copy].abs()
        threshold = (self.threshold_scale[copy] * self.init_threshold).abs()
        distance = relative_distance(q_pos, k_pos).abs().to(c.dtype)  # [B', Lq, Lk]
        normaliser = torch.log1p(c * torch.maximum(q_pos.to(c.dtype), threshold)) + NORMALISER_EPS  # [B', Lq]
        normalised = torch.log1p(c * distance) / normaliser[:, :, None]  # [B', Lq, Lk]
        return piecewise_linear_mlp(self.mlps[copy], normalised).transpose(0, 1)  # [B', H, Lq, Lk]

    def score_mod(self, q_pos, k_pos, layer):
        copy = 0 if self.share_layers else layer
        c = self.c[copy].abs()
        threshold = (self.threshold_scale[copy] * self.init_threshold).abs()
        hidden, out = self.mlps[copy][0], self.mlps[copy][2]
        w1, b1, w2, b2 = hidden.weight[:, 0], hidden.bias, out.weight, out.bias  # [width], [width], [H, width], [H]
        positions, width = score_positions(q_pos, k_pos), self.mlp_width

        def fire(score, b, h, q_idx, kv_idx):
            i, j = positions(b, q_idx, kv_idx)
            normaliser = torch.log1p(c * torch.maximum(i.to(c.dtype), threshold)) + NORMALISER_EPS
            x = torch.log1p(c * (i - j).abs().to(c.dtype)) / normaliser
            bias = b2[h]
            for unit in range(width):  # the MLP unrolled: a score_mod works on one score at a time
                bias = bias + w2[h, unit] * torch.relu(w1[unit] * x + b1[unit])
            return score + bias

        return fire
