"""Relative position representations (Shaw et al. NAACL 2018, "RPR").

    e_ij = q_i . (k_j + a^K_c(j-i)) / sqrt(d),   z_i = sum_j alpha_ij (v_j + a^V_c(j-i)),
    c(x) = clip(x, -K, K)

a^K and a^V are learned [2K + 1, d] tables, one pair per layer, shared by the heads of
that layer (as in the paper). Neither term forms the [L, L, d] table a_c(j-i): the key
term takes q . a^K for the 2K + 1 offsets and gathers; the value term sums the
probabilities that fall on each offset and mixes a^V with those sums.
"""
from __future__ import annotations

import torch
from torch import nn

from posbench.checks import Integer
from posbench.encodings.base import Encoding, LayerShape, ModelDims, relative_distance

INIT_STD = 0.02  # the model's own initialisation scale


class Shaw(Encoding):
    name = "shaw"
    hooks = frozenset({"key_term", "value_term"})
    relative = True

    def __init__(self, dims: ModelDims, max_relative_position: int = 16):
        super().__init__(dims)
        # K: offsets are clipped to [-K, K]
        self.max_relative_position = Integer(1)("encoding.max_relative_position", max_relative_position, self.name)
        shape = (dims.n_layers, 2 * self.max_relative_position + 1, dims.head_dim)
        self.key_table = nn.Parameter(torch.randn(shape) * INIT_STD)  # a^K: [layers, 2K+1, d]
        self.value_table = nn.Parameter(torch.randn(shape) * INIT_STD)  # a^V: [layers, 2K+1, d]

    def params(self) -> dict:
        return {"max_relative_position": self.max_relative_position}

    def offset_rows(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Row of c(j - i) in the tables, c(j - i) + K: [B', Lq, Lk] long."""
        clip = self.max_relative_position
        return (-relative_distance(q_pos, k_pos)).clamp(-clip, clip).long() + clip

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # [B, H, Lq, Lk]: the offset rows expanded (int64) for the gather and the value term's scatter
        return shape.pair_bytes(1.5 if shape.training else 0.5)

    def key_term(self, q, k, q_pos, k_pos, layer):
        b, h, lq, d = q.shape
        rows = self.offset_rows(q_pos, k_pos)[:, None].expand(b, h, lq, k.shape[-2])  # [B, H, Lq, Lk]
        per_offset = q @ self.key_table[layer].transpose(0, 1)  # q_i . a^K_r: [B, H, Lq, 2K+1]
        return per_offset.gather(-1, rows) * self.logit_scale(d)  # [B, H, Lq, Lk]

    def value_term(self, p, q_pos, k_pos, layer):
        b, h, lq, lk = p.shape
        rows = self.offset_rows(q_pos, k_pos)[:, None].expand(b, h, lq, lk)  # [B, H, Lq, Lk]
        mass = p.new_zeros(b, h, lq, self.key_table.shape[1]).scatter_add(-1, rows, p)  # [B, H, Lq, 2K+1]
        return mass @ self.value_table[layer]  # sum_j alpha_ij a^V_c(j-i): [B, H, Lq, d]
