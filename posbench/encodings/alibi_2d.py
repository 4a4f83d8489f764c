"""2-D ALiBi: a fixed penalty -m_h * distance between the query and key cells, with ALiBi's slopes
(posbench.encodings.alibi.alibi_slopes). distance: euclidean sqrt(dy^2 + dx^2) (default) or
manhattan |dy| + |dx|. Relative in (dy, dx); not learned."""
from __future__ import annotations

from posbench.encodings.alibi import alibi_slopes
from posbench.checks import Choice
from posbench.encodings.base import Encoding, ModelDims, grid_offsets, require_grid

DISTANCES = ("euclidean", "manhattan")


class ALiBi2D(Encoding):
    name = "alibi_2d"
    hooks = frozenset({"bias"})
    relative = True
    bias_layers_shared = True
    position_dims = 2

    def __init__(self, dims: ModelDims, distance: str = "euclidean"):
        super().__init__(dims)
        require_grid(self.name, dims)
        Choice(DISTANCES)("encoding.distance", distance, self.name)
        self.distance = distance
        self.register_buffer("slopes", alibi_slopes(dims.n_heads).float(), persistent=False)  # [H]

    def params(self) -> dict:
        return {"distance": self.distance}

    def bias(self, q_pos, k_pos, layer):
        offsets = grid_offsets(q_pos, k_pos).to(self.slopes.dtype)  # [B', Lq, Lk, 2]
        if self.distance == "euclidean":
            distance = offsets.square().sum(-1).sqrt()  # [B', Lq, Lk]
        else:
            distance = offsets.abs().sum(-1)  # [B', Lq, Lk]
        return -self.slopes[:, None, None] * distance[:, None]  # [B', H, Lq, Lk]
