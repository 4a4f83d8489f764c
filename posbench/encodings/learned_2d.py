"""Learned 2-D table (ViT, DeiT): one trainable vector per (row, column) of the trained grid.

The table is [S, S, D], S the largest side seen in training (N, or train.max_position with
randomized/offset positions). A grid that reaches past it on an axis meets positions never
trained, and `policy` says what the run does:
  interpolate  the table resampled to the grid's extent on every axis that exceeds it (bicubic,
               align_corners=False, as ViT/DeiT resample theirs for a new resolution); an axis
               within the table reads it as trained (resampling to the same size is the identity)
  clamp        rows and columns past the table reuse its last row / column
  error        refuse before training
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posbench.checks import Choice, Real
from posbench.encodings.base import Encoding, ModelDims, host_reads_allowed, require_grid

POLICIES = ("interpolate", "clamp", "error")


def resample_table(table: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Bicubic resampling of a [R, C, D] table to [rows, cols, D] (align_corners=False)."""
    image = table.permute(2, 0, 1)[None]  # [1, D, R, C]
    resized = F.interpolate(image, size=(rows, cols), mode="bicubic", align_corners=False)  # [1, D, rows, cols]
    return resized[0].permute(1, 2, 0)  # [rows, cols, D]


class Learned2D(Encoding):
    name = "learned_2d"
    hooks = frozenset({"embed"})
    position_dims = 2

    def __init__(self, dims: ModelDims, policy: str = "interpolate", init_std: float = 0.02):
        super().__init__(dims)
        require_grid(self.name, dims)
        Choice(POLICIES)("encoding.policy", policy, self.name)
        init_std = Real(least=0)("encoding.init_std", init_std, self.name)
        if policy == "error" and dims.max_side > dims.train_side:
            raise ValueError(
                f"learned_2d with policy=error: evaluation reaches grids of side {dims.max_side} but the table "
                f"covers the {dims.train_side} x {dims.train_side} trained grid; set encoding.policy=interpolate "
                "or clamp, or evaluate smaller grids (eval.ratios / eval.lengths)")
        self.policy = policy
        side = dims.train_side
        self.table = nn.Parameter(torch.randn(side, side, dims.d_model) * init_std)  # [S, S, D]

    def params(self) -> dict:
        return {"policy": self.policy, "trained_side": self.table.shape[0]}

    def embed(self, x: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows, cols = pos.long().unbind(-1)  # [B', L] each
        side = self.table.shape[0]
        table = self.table
        if self.policy == "clamp":
            rows, cols = rows.clamp(max=side - 1), cols.clamp(max=side - 1)
        elif host_reads_allowed():  # else a compiled or recorded training step, whose grid the table covers
            extent = int(rows.max()) + 1, int(cols.max()) + 1
            if max(extent) > side and self.policy == "error":
                raise IndexError(f"learned_2d (policy=error): the table covers {side} x {side} cells but the "
                                 f"grid reaches {extent[0]} x {extent[1]}")
            if max(extent) > side:
                table = resample_table(self.table, max(extent[0], side), max(extent[1], side))  # [R', C', D]
        return x + table[rows, cols].to(x.dtype)  # [B, L, D]
