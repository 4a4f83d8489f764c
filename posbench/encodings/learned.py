"""Learned absolute table (BERT, GPT-2), with an explicit policy for rows never trained."""
from __future__ import annotations

import torch
from torch import nn

from posbench.checks import Choice, Real
from posbench.encodings.base import Encoding, ModelDims, position_range
from posbench.encodings.hierarchical import check_hierarchical, hierarchical_rows

# error: refuse before training; clamp: reuse the last trained row; random: the untrained
# (randomly initialised) rows, the standard protocol; hierarchical: Su's decomposition of the
# trained rows (posbench.encodings.hierarchical), n trained rows covering n^2 positions.
POLICIES = ("random", "clamp", "error", "hierarchical")


class Learned(Encoding):
    name = "learned"
    hooks = frozenset({"embed"})

    def __init__(self, dims: ModelDims, policy: str = "random", init_std: float = 0.02, alpha: float = 0.4):
        super().__init__(dims)
        Choice(POLICIES)("encoding.policy", policy, "learned")
        init_std = Real(least=0)("encoding.init_std", init_std, self.name)
        self.alpha = Real()("encoding.alpha", alpha, self.name)
        if policy == "hierarchical":
            check_hierarchical("learned (policy=hierarchical)", self.alpha, dims.train_positions, dims.max_positions)
        if policy == "error" and dims.max_positions > dims.train_positions:
            raise ValueError(
                f"learned encoding with policy=error: evaluation needs positions up to {dims.max_positions - 1} "
                f"but training only reaches {dims.train_positions - 1}; set encoding.policy=random or clamp, "
                "or evaluate shorter lengths (eval.ratios / eval.lengths)")
        self.policy = policy
        self.table = nn.Parameter(torch.randn(dims.max_positions, dims.d_model) * init_std)  # [P, D]

    def params(self) -> dict:
        return {"policy": self.policy, "rows": self.table.shape[0], "trained_rows": self.dims.train_positions,
                **({"alpha": self.alpha} if self.policy == "hierarchical" else {})}

    def embed(self, x: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pos = pos.long()
        span = position_range(pos)
        if span is not None and span[1] >= self.table.shape[0]:
            raise IndexError(f"learned table has {self.table.shape[0]} rows but position {span[1]} was asked for; "
                             "the run sized it from eval lengths, so this input is longer than planned")
        if self.policy == "clamp":
            pos = pos.clamp(max=self.dims.train_positions - 1)
        if self.policy == "hierarchical":
            trained = self.table[:self.dims.train_positions]  # [n, D]
            return x + hierarchical_rows(trained, pos, self.alpha).to(x.dtype)  # [B, L, D]
        return x + self.table[pos].to(x.dtype)  # [B, L, D]
