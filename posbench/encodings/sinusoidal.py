"""Sinusoidal absolute encoding (Vaswani et al. 2017), added to the token embedding."""
from __future__ import annotations

import torch

from posbench.checks import Choice, Real
from posbench.encodings.base import Encoding, ModelDims

LAYOUTS = ("interleaved", "concat")


def sinusoidal_table(pos: torch.Tensor, dim: int, base: float = 10000.0, layout: str = "interleaved") -> torch.Tensor:
    """p[k, 2m] = sin(k / base^(2m/dim)), p[k, 2m+1] = cos(...); 'concat' puts all sines first.

    pos: [...] -> [..., dim], in pos's float dtype (float32 for integer positions).
    """
    dtype = pos.dtype if pos.is_floating_point() else torch.float32
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim)  # [dim/2]
    angles = pos.to(torch.float64)[..., None] * inv_freq  # [..., dim/2]
    if layout == "interleaved":
        table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # [..., dim]
    else:
        table = torch.cat((angles.sin(), angles.cos()), dim=-1)  # [..., dim]
    return table.to(dtype)


class Sinusoidal(Encoding):
    name = "sinusoidal"
    hooks = frozenset({"embed"})

    def __init__(self, dims: ModelDims, layout: str = "interleaved", base: float = 10000.0):
        super().__init__(dims)
        Choice(LAYOUTS)("encoding.layout", layout, "sinusoidal")
        if dims.d_model % 2:
            raise ValueError(f"sinusoidal needs an even model size, got model.d_model={dims.d_model}; "
                             "set model.d_model to an even number")
        self.layout, self.base = layout, Real(above=0)("encoding.base", base, self.name)

    def params(self) -> dict:
        return {"layout": self.layout, "base": self.base}

    def embed(self, x: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x + sinusoidal_table(pos, x.shape[-1], self.base, self.layout).to(x.dtype)  # [B, L, D]
