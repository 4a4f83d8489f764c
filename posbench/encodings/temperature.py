"""Attention temperature tuning (Llama 4's NoPE layers, after SSMax): q scaled by

    t(n) = attn_scale * log(floor(n / floor_scale) + 1) + 1,    n = i + 1, the keys query i sees

1 for the first floor_scale - 1 positions, then growing with log n in steps, so that a NoPE layer's
attention stays sharp at lengths far past training. Llama 4 uses floor_scale 8192 and attn_scale
0.1 (HF transformers' Llama4TextAttention, `attn_temperature_tuning`, there on the cache position +
1, the same n for a sequence read from its start). No parameters are learned and no position id is
read: a `query_scale`, for the NoPE layers of a schedule (experiment=irope).
"""
from __future__ import annotations

import torch

from posbench.checks import Integer, Real
from posbench.encodings.base import Encoding, ModelDims


class Temperature(Encoding):
    name = "temperature"
    hooks = frozenset({"query_scale"})
    relative = True  # n counts keys, never reads a position id

    def __init__(self, dims: ModelDims, floor_scale: int = 8192, attn_scale: float = 0.1):
        super().__init__(dims)
        self.floor_scale = Integer(1)("encoding.floor_scale", floor_scale, self.name)
        self.attn_scale = Real(least=0)("encoding.attn_scale", attn_scale, self.name)

    def params(self) -> dict:
        return {"floor_scale": self.floor_scale, "attn_scale": self.attn_scale}

    def query_scale(self, call):
        n = call.keys_seen()  # [Lq]
        steps = torch.div(n, self.floor_scale, rounding_mode="floor").to(torch.float64)  # floor(n / floor_scale)
        dtype = torch.float32 if call.x is None else call.x.dtype
        factor = (self.attn_scale * torch.log1p(steps) + 1).to(dtype)  # [Lq]
        return factor[None, None, :, None]  # [1, 1, Lq, 1]
