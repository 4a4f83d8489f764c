"""Rotary position embedding (Su et al. 2021, RoFormer).

Feature pairs are rotated by k * theta_m, theta_m = base^(-2m/d). Two named layouts:
`interleaved` pairs (x_2m, x_2m+1) as in the paper; `half` pairs (x_m, x_m+d/2) as in
GPT-NeoX / LLaMA. They give the same logits up to a fixed permutation of features.
"""
from __future__ import annotations

import torch

from posbench.encodings.base import Encoding, ModelDims, check_choice

LAYOUTS = ("half", "interleaved")


def rope_inv_freq(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """theta_m = base^(-2m/d) for m = 0..d/2-1, float64: [d/2]."""
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, layout: str) -> torch.Tensor:
    """x: [B, H, L, d], pos: [B', L], inv_freq: [d/2] -> [B, H, L, d]."""
    compute = torch.promote_types(x.dtype, torch.float32)
    angles = pos.to(compute)[:, None, :, None] * inv_freq.to(compute)  # [B', 1, L, d/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if layout == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]  # [B, H, L, d/2] each
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)  # [B, H, L, d]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [B, H, L, d/2] each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # [B, H, L, d]


class RoPE(Encoding):
    name = "rope"
    hooks = frozenset({"qk"})
    relative = True

    def __init__(self, dims: ModelDims, base: float = 10000.0, layout: str = "half"):
        super().__init__(dims)
        check_choice("rope", "layout", layout, LAYOUTS)
        if dims.head_dim % 2:
            raise ValueError(f"rope rotates feature pairs and needs an even head size, got "
                             f"model.d_model / model.n_heads = {dims.d_model}/{dims.n_heads} = {dims.head_dim}; "
                             "change model.d_model or model.n_heads")
        self.base, self.layout = float(base), layout
        self.register_buffer("inv_freq", rope_inv_freq(dims.head_dim, self.base), persistent=False)

    def params(self) -> dict:
        return {"base": self.base, "layout": self.layout}

    def qk(self, q, k, q_pos, k_pos, layer):
        return rotate(q, q_pos, self.inv_freq, self.layout), rotate(k, k_pos, self.inv_freq, self.layout)
