"""Hierarchical decomposition of a learned table (Su 2020, "layered decomposition"; article 000 §1(6)).

A learned table p_1..p_n (n = the positions seen in training) is extended to n^2 positions:

    q_{(a-1)n + b} = alpha * u_a + (1 - alpha) * u_b,   u_a = (p_a - alpha * p_1) / (1 - alpha)

for a, b in 1..n (1-indexed). With a = 1: u_1 = p_1 and q_b = alpha p_1 + p_b - alpha p_1 = p_b,
so the first n positions are the learned rows. alpha != 0.5 tells (a, b) from (b, a).

Position ids here are 0-indexed: id k is the 1-indexed position k + 1 = (a-1)n + b with
b in 1..n, i.e. a - 1 = k // n and b - 1 = k % n. With 0-indexed rows p[0..n-1] and
u[i] = (p[i] - alpha p[0]) / (1 - alpha):

    q[k] = alpha * u[k // n] + (1 - alpha) * u[k % n],   0 <= k < n^2

and for k < n, k // n = 0, k % n = k, so q[k] = p[k]. Ids k < n read the table itself
(exactly, without the rounding of the formula); ids n..n^2-1 use the formula, which stays
differentiable, so the same code trains (ids < n) and extrapolates (ids >= n).
"""
from __future__ import annotations

import torch
from torch import nn

from posbench.checks import Real
from posbench.encodings.base import Encoding, ModelDims, position_range


def hierarchical_rows(table: torch.Tensor, pos: torch.Tensor, alpha: float) -> torch.Tensor:
    """Rows q[k] of the decomposition of table [n, D] for integer ids pos [...] -> [..., D]."""
    n = table.shape[0]
    base = (table - alpha * table[0]) / (1 - alpha)  # [n, D]: u
    extended = alpha * base[pos // n] + (1 - alpha) * base[pos % n]  # [..., D]
    return torch.where((pos < n)[..., None], table[pos.clamp(max=n - 1)], extended)  # [..., D]


def check_hierarchical(owner: str, alpha: float, trained: int, max_positions: int) -> float:
    alpha = Real()("encoding.alpha", alpha, owner)
    if not 0 < alpha < 1 or alpha == 0.5:
        raise ValueError(f"{owner}: encoding.alpha={alpha} is not valid; choose 0 < alpha < 1 and alpha != 0.5 "
                         "(0.5 makes positions (a, b) and (b, a) equal; Su uses 0.4)")
    if max_positions > trained * trained:
        raise ValueError(f"{owner}: the hierarchical extension of {trained} trained rows covers {trained * trained} "
                         f"positions, but the run needs positions up to {max_positions - 1}; lower eval.ratios / "
                         "eval.lengths or train on longer sequences")
    return alpha


class Hierarchical(Encoding):
    name = "hierarchical"
    hooks = frozenset({"embed"})

    def __init__(self, dims: ModelDims, alpha: float = 0.4, init_std: float = 0.02):
        super().__init__(dims)
        n = dims.train_positions
        self.alpha = check_hierarchical("hierarchical", alpha, n, dims.max_positions)
        self.init_std = Real(least=0)("encoding.init_std", init_std, self.name)
        self.table = nn.Parameter(torch.randn(n, dims.d_model) * self.init_std)  # [n, D]

    def params(self) -> dict:
        return {"alpha": self.alpha, "init_std": self.init_std, "trained_rows": self.table.shape[0]}

    def embed(self, x: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pos = pos.long()
        n = self.table.shape[0]
        span = position_range(pos)
        if span is not None and (span[0] < 0 or span[1] >= n * n):
            raise IndexError(f"hierarchical encoding covers positions 0..{n * n - 1} ({n} trained rows squared) "
                             f"but got positions {span[0]}..{span[1]}")
        return x + hierarchical_rows(self.table, pos, self.alpha).to(x.dtype)  # [B, L, D]
