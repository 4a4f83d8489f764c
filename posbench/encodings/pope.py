"""PoPE, polar coordinate position embedding (Gopalakrishnan, Csordas, Schmidhuber, Mozer; arXiv 2509.10534).

Each of the d features of q and k (features, not pairs) becomes a complex number whose magnitude is
the content and whose phase is the position: mu_c = softplus(x_c), phase t theta_c with
theta_c = base^(-(c-1)/d), c = 1..d (d frequencies over rope's range), and keys' phases also shifted
by a learned delta_c per layer and head, kept in [-2 pi, 0]: clamped in the forward pass, and projected
back into the range before every training step (a delta an update pushed out would otherwise sit at
the bound with no gradient, and stop learning). A delta at a bound learns (the zero initialisation
starts every delta there): the clamp's gradient is 1 inside the range and at its bounds, 0 beyond
(`clamp_learning_at_bounds`; torch 2.14's clamp gives 0 at a bound). A logit is
Re sum_c conj(q~_tc) k~_sc = sum_c mu^q_c mu^k_c cos((s - t) theta_c + delta_c): relative, and
bidirectional as it is. In real arithmetic qk returns q' = [mu^q cos(t theta), mu^q sin(t theta)] and
k' = [mu^k cos(s theta + delta), mu^k sin(s theta + delta)], both 2d wide (v keeps d), and the logit
scale stays 1/sqrt(d) of the head's d, not of the 2d the logits are computed over.

delta_init: zero (the paper's language-model runs: it matters for length generalisation) or
uniform, U(-2 pi, 0) (its synthetic, music and genome runs).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from posbench.checks import Choice, Real
from posbench.encodings.base import Encoding, LayerShape, ModelDims

DELTA_INITS = ("zero", "uniform")


def pope_inv_freq(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """theta_c = base^(-c/d) for c = 0..d-1 (the paper's c - 1), float64: [d]."""
    return base ** (-torch.arange(head_dim, dtype=torch.float64) / head_dim)


def polar(x: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
    """softplus(x) at the phases, as [mu cos, mu sin]: x [B, H, L, d], phases [B'|1, H|1, L, d] -> [B, H, L, 2d]."""
    compute = phases.dtype
    mu = F.softplus(x.to(compute))  # [B, H, L, d]
    return torch.cat((mu * phases.cos(), mu * phases.sin()), dim=-1).to(x.dtype)  # [B, H, L, 2d]


def clamp_learning_at_bounds(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """x clamped to [low, high], its gradient passed inside the range and at its bounds, none beyond. Plain
    clamp passed it at a bound up to torch 2.13; from 2.14 it passes none there (0.5 with tensor bounds)."""
    return torch.where((x >= low) & (x <= high), x, x.detach().clamp(low, high))


class PoPE(Encoding):
    name = "pope"
    hooks = frozenset({"qk"})
    relative = True
    widens_query_key = True  # q and k 2d wide

    def __init__(self, dims: ModelDims, base: float = 10000.0, delta_init: str = "zero"):
        super().__init__(dims)
        self.base = Real(above=1)("encoding.base", base, self.name)  # theta_c must fall with c
        Choice(DELTA_INITS)("encoding.delta_init", delta_init, self.name)
        self.delta_init = delta_init
        self.register_buffer("inv_freq", pope_inv_freq(dims.head_dim, self.base), persistent=False)
        self.delta = nn.Parameter(torch.zeros(dims.n_layers, dims.n_heads, dims.head_dim))  # [layers, H, d]
        if delta_init == "uniform":
            nn.init.uniform_(self.delta, -2 * math.pi, 0.0)

    def params(self) -> dict:
        return {"base": self.base, "delta_init": self.delta_init}

    def set_train_step(self, step: int, total: int) -> None:
        with torch.no_grad():
            self.delta.clamp_(-2 * math.pi, 0.0)  # the previous step's update projected back: it keeps learning

    def logit_scale(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(self.dims.head_dim)  # the head's d, whatever width q and k reach the logits with

    def phases(self, pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """t theta_c modulo 2 pi, computed in float64 so that large positions keep their phase: [B', L] -> [B', 1, L, d]."""
        angles = pos.to(torch.float64)[:, None, :, None] * self.inv_freq  # [B', 1, L, d]
        return torch.remainder(angles, 2 * math.pi).to(dtype)

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # q and k twice as wide leave the fused CPU kernel (one head size): sdpa's math path holds every query's
        # logits and weights [B, H, Lq, Lk] at once, and training keeps them for the backward
        return shape.full_bytes(2.0 if shape.training else 2.5)

    def qk(self, q, k, q_pos, k_pos, layer):
        compute = torch.promote_types(q.dtype, torch.float32)
        delta = clamp_learning_at_bounds(self.delta[layer], -2 * math.pi, 0.0).to(compute)  # [H, d]
        q = polar(q, self.phases(q_pos, compute))  # [B, H, Lq, 2d]
        k = polar(k, self.phases(k_pos, compute) + delta[:, None, :])  # [B, H, Lk, 2d]
        return q, k
