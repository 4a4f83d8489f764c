"""2-D sinusoidal encoding (article 000; MAE and ViT-style sin-cos grids), added to the token embedding.

The first D/2 channels encode the column, the last D/2 the row, each with the 1-D formula of
`sinusoidal_table` at size D/2: p[c, 2i] = sin(c / base^(2i/(D/2))), p[c, 2i+1] = cos(...), the
same for the row r in the second half (the article's code puts the width first, as here).
"""
from __future__ import annotations

import torch

from posbench.checks import Choice, Real
from posbench.encodings.base import Encoding, ModelDims, require_grid
from posbench.encodings.sinusoidal import LAYOUTS, sinusoidal_table


def sinusoidal_2d_table(pos: torch.Tensor, dim: int, base: float = 10000.0,
                        layout: str = "interleaved") -> torch.Tensor:
    """pos: [..., 2] (row, column) -> [..., dim]: the column's table, then the row's, dim/2 each."""
    rows, cols = pos.unbind(-1)  # [...] each
    half = dim // 2
    return torch.cat((sinusoidal_table(cols, half, base, layout), sinusoidal_table(rows, half, base, layout)), -1)


class Sinusoidal2D(Encoding):
    name = "sinusoidal_2d"
    hooks = frozenset({"embed"})
    position_dims = 2

    def __init__(self, dims: ModelDims, layout: str = "interleaved", base: float = 10000.0):
        super().__init__(dims)
        require_grid(self.name, dims)
        Choice(LAYOUTS)("encoding.layout", layout, self.name)
        if dims.d_model % 4:
            raise ValueError(f"sinusoidal_2d gives half the channels to the row and half to the column, each in "
                             f"sin/cos pairs, so it needs model.d_model % 4 == 0; got model.d_model={dims.d_model}")
        self.layout, self.base = layout, Real(above=0)("encoding.base", base, self.name)

    def params(self) -> dict:
        return {"layout": self.layout, "base": self.base}

    def embed(self, x: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return x + sinusoidal_2d_table(pos, x.shape[-1], self.base, self.layout).to(x.dtype)  # [B, L, D]
