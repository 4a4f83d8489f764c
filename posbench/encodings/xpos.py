"""xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer"): rope with a decay per pair.

Pair m of q at position i is rotated as in rope and scaled by zeta_m^(i/B); pair m of k at
position j by zeta_m^(-j/B), zeta_m = (2m/d + gamma) / (1 + gamma), so a logit carries
zeta_m^((i-j)/B): relative, and decaying with distance for i > j (causal attention, the
paper's setting; with bidirectional attention the same formula grows for keys after the query).

Keeping it finite: zeta_0^(-k/B) overflows float32 for k beyond about 36,000 (gamma = 0.4,
B = 512). Every row of positions is centred on c = (min + max + 1) // 2 of its query and key
positions before the exponent (as the reference implementations centre on L // 2): the logit
only sees (i - c) - (j - c) = i - j, and the exponents stay within half the row's spread of
positions, finite in float32 for spreads up to about 72,000 positions (9,000 in float16).
"""
from __future__ import annotations

import torch

from posbench.checks import Choice, Real
from posbench.encodings.base import Encoding, ModelDims
from posbench.encodings.rope import LAYOUTS, rope_inv_freq, rotate


def xpos_zeta(head_dim: int, gamma: float = 0.4) -> torch.Tensor:
    """zeta_m = (2m/d + gamma) / (1 + gamma) for m = 0..d/2-1, float64: [d/2]."""
    return (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim + gamma) / (1 + gamma)


def centre(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """One integer centre per row shared by queries and keys: [B', Lq], [B', Lk] -> [B', 1]."""
    low = torch.minimum(q_pos.amin(-1, keepdim=True), k_pos.amin(-1, keepdim=True))  # [B', 1]
    high = torch.maximum(q_pos.amax(-1, keepdim=True), k_pos.amax(-1, keepdim=True))  # [B', 1]
    return (low + high + 1) // 2


class XPos(Encoding):
    name = "xpos"
    hooks = frozenset({"qk"})
    relative = True

    def __init__(self, dims: ModelDims, base: float = 10000.0, layout: str = "half", gamma: float = 0.4,
                 scale_base: float = 512.0):
        super().__init__(dims)
        Choice(LAYOUTS)("encoding.layout", layout, "xpos")
        if dims.head_dim % 2:
            raise ValueError(f"xpos rotates feature pairs and needs an even head size, got "
                             f"model.d_model / model.n_heads = {dims.d_model}/{dims.n_heads} = {dims.head_dim}; "
                             "change model.d_model or model.n_heads")
        self.base = Real(above=1)("encoding.base", base, self.name)  # theta_m = base^(-2m/d) must fall with m
        self.gamma = Real(above=0)("encoding.gamma", gamma, self.name)  # zeta_0 = gamma / (1 + gamma) gets negative powers
        self.scale_base = Real(above=0)("encoding.scale_base", scale_base, self.name)
        self.layout = layout
        self.register_buffer("inv_freq", rope_inv_freq(dims.head_dim, self.base), persistent=False)
        self.register_buffer("log_zeta", xpos_zeta(dims.head_dim, self.gamma).log(), persistent=False)

    def params(self) -> dict:
        return {"base": self.base, "layout": self.layout, "gamma": self.gamma, "scale_base": self.scale_base}

    def scaling(self, pos: torch.Tensor, centre_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """zeta_m^((k - c)/B) laid out like the features: [B', L], [B', 1] -> [B', 1, L, d]."""
        compute = torch.promote_types(dtype, torch.float32)
        power = (pos - centre_pos).to(compute) / self.scale_base  # [B', L]
        scale = (power[:, None, :, None] * self.log_zeta.to(compute)).exp()  # [B', 1, L, d/2]
        if self.layout == "interleaved":
            return scale.repeat_interleave(2, dim=-1).to(dtype)  # [B', 1, L, d]
        return torch.cat((scale, scale), dim=-1).to(dtype)  # [B', 1, L, d]

    def qk(self, q, k, q_pos, k_pos, layer):
        centre_pos = centre(q_pos, k_pos)  # [B', 1]
        q = rotate(q, q_pos, self.inv_freq, self.layout) * self.scaling(q_pos, centre_pos, q.dtype)
        k = rotate(k, k_pos, self.inv_freq, self.layout) / self.scaling(k_pos, centre_pos, k.dtype)
        return q, k
