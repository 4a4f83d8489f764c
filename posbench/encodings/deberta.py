"""Disentangled attention (He et al. ICLR 2021, DeBERTa), head h:

    A_ij = (Qc_i.Kc_j + Qc_i.Kr_delta(i,j) + Kc_j.Qr_delta(j,i)) / sqrt(3d),
    delta(i, j) = clip(i - j, -k, k)

content-to-content, content-to-position and position-to-content. Kr = P W_k,r and
Qr = P W_q,r, with P a learned [2k + 1, D] relative table shared by the layers and
W_k,r, W_q,r per-layer D -> D projections (no bias, as in the paper's formula), split
into heads. Each relative term takes the dot products with the 2k + 1 rows and gathers.

Differences from the paper, on purpose: the paper's delta runs over 2k rows,
clip(i - j, -k, k - 1); here the clip is symmetric, 2k + 1 rows, as the catalogue
writes it, so delta(j, i) is the mirror of delta(i, j). The released code (and
transformers) reads Qr at delta(i, j) in the position-to-content term, not the paper's
delta(j, i): `p2c_delta` picks one (default: the paper). DeBERTa's attention span
(only the rows up to the sequence length are used) saves work, not results, and is
left out. v2's log buckets and the enhanced mask decoder (absolute positions before
the output) are not part of this encoding.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from posbench.checks import Choice, Integer
from posbench.encodings.base import Encoding, LayerShape, ModelDims, position_range, relative_distance

INIT_STD = 0.02  # the model's own initialisation scale
# which row of Qr the position-to-content term of (i, j) reads: the paper's delta(j, i), or
# delta(i, j), what microsoft/DeBERTa and transformers compute (their gather runs on K Qr^T
# and is transposed after, which turns the -(i - j) they index with back into i - j)
P2C_DELTAS = ("paper", "code")


class DeBERTa(Encoding):
    name = "deberta"
    hooks = frozenset({"key_term"})
    relative = True

    def __init__(self, dims: ModelDims, max_relative_positions: int | None = None, p2c_delta: str = "paper"):
        super().__init__(dims)
        Choice(P2C_DELTAS)("encoding.p2c_delta", p2c_delta, "deberta")
        self.p2c_delta = p2c_delta
        # default k: the largest distance seen in training, so every trained distance has its own
        # row and longer ones share the trained edge row (DeBERTa v1: k = its 512-token context)
        k = Integer(1, null="the longest training distance")("encoding.max_relative_positions",
                                                             max_relative_positions, self.name)
        self.max_relative_positions = max(1, dims.train_positions - 1) if k is None else k  # i - j in [-k, k]
        self.rel_table = nn.Parameter(torch.randn(2 * self.max_relative_positions + 1, dims.d_model)
                                      * INIT_STD)  # P: [2k+1, D]
        self.query_proj = nn.ModuleList(nn.Linear(dims.d_model, dims.d_model, bias=False)
                                        for _ in range(dims.n_layers))  # W_q,r, one per layer
        self.key_proj = nn.ModuleList(nn.Linear(dims.d_model, dims.d_model, bias=False)
                                      for _ in range(dims.n_layers))  # W_k,r, one per layer
        for proj in (*self.query_proj, *self.key_proj):
            nn.init.normal_(proj.weight, std=INIT_STD)

    def params(self) -> dict:
        return {"max_relative_positions": self.max_relative_positions, "p2c_delta": self.p2c_delta}

    def logit_scale(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(3 * head_dim)  # three terms of similar size

    def relative_rows(self, proj: nn.Linear, rows: torch.Tensor, h: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The projected table rows that `rows` use, and `rows` renumbered into them: only the window
        of offsets a block of queries meets is projected and dotted (a block sees ~Lq + Lk of 2k + 1); inside a
        compiled graph, where that window would be read on the host, every row (position_range)."""
        span = position_range(rows)
        first, last = span if span is not None else (0, self.rel_table.shape[0] - 1)
        projected = proj(self.rel_table[first:last + 1]).view(-1, h, d).transpose(0, 1)  # [H, window, d]
        return projected, rows - first

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # [B, H, Lq, Lk]: two gathers (c2p, p2c) with their expanded int64 rows, p2c's transpose, the sum; the
        # backward of each gather scatters into [B, H, Lq, window] and keeps its rows
        return shape.pair_bytes(27.0 if shape.training else 6.0)

    def key_term(self, q, k, q_pos, k_pos, layer):
        b, h, lq, d = q.shape
        lk, span = k.shape[-2], self.max_relative_positions
        rows = relative_distance(q_pos, k_pos).clamp(-span, span).long() + span  # row of delta(i, j): [B', Lq, Lk]
        key_rel, c2p_rows = self.relative_rows(self.key_proj[layer], rows, h, d)  # Kr: [H, window, d]
        c2p = (q @ key_rel.transpose(-1, -2)).gather(-1, c2p_rows[:, None].expand(b, h, lq, lk))  # [B, H, Lq, Lk]
        # the paper's delta(j, i) sits in row 2k - row of delta(i, j); indexed [j, i] to gather along Kc_j's rows
        p2c_rows = (2 * span - rows if self.p2c_delta == "paper" else rows).transpose(-1, -2)  # [B', Lk, Lq]
        query_rel, p2c_rows = self.relative_rows(self.query_proj[layer], p2c_rows, h, d)  # Qr: [H, window, d]
        p2c = (k @ query_rel.transpose(-1, -2)).gather(-1, p2c_rows[:, None].expand(b, h, lk, lq))  # [B, H, Lk, Lq]
        p2c = p2c.transpose(-1, -2)  # Kc_j . Qr_delta: [B, H, Lq, Lk]
        return (c2p + p2c) * self.logit_scale(d)  # [B, H, Lq, Lk]
