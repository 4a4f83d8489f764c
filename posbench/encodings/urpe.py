"""URPE, universal relative positional encoding (Luo et al. NeurIPS 2022, "Your Transformer
May Not be as Powerful as You Expect"): the attention probabilities are multiplied entrywise
by a learned Toeplitz matrix, z_i = sum_j alpha_ij * c(i - j) * v_j, on top of a relative
bias encoding (T5 by default) that produces alpha.

c has one entry per signed offset i - j in [-max_distance, max_distance] (offsets beyond
share the edge entries), per head, per layer unless `shared_layers`. It starts at 1, so
an untrained URPE model is its base model. Rows of alpha * c no longer sum to one: intended
(that is what restores universal approximation with relative positions).
"""
from __future__ import annotations

import torch
from torch import nn

from posbench.checks import Flag, Integer
from posbench.encodings.base import LayerShape, ModelDims, relative_distance
from posbench.encodings.composite import Composite

NON_BASES = ("composite", "urpe")


class URPE(Composite):
    name = "urpe"
    hooks = frozenset({"bias", "prob"})  # those with the default base t5
    relative = True

    def __init__(self, dims: ModelDims, base: str = "t5", base_params=None, max_distance: int = 128,
                 shared_layers: bool = False):
        if base in NON_BASES:
            raise ValueError(f"urpe: base={base!r} cannot carry URPE; use a single registered encoding "
                             "(t5 by default, nope for URPE alone)")
        max_distance = Integer(1)("encoding.max_distance", max_distance, self.name)
        shared_layers = Flag()("encoding.shared_layers", shared_layers, self.name)
        super().__init__(dims, parts=[base], part_params={base: base_params})
        self.base_name, self.max_distance, self.shared_layers = base, max_distance, shared_layers
        layers = 1 if self.shared_layers else dims.n_layers
        self.toeplitz = nn.Parameter(torch.ones(layers, 2 * self.max_distance + 1, dims.n_heads))  # [layers, 2D+1, H]
        self.hooks = self.hooks | {"prob"}

    def params(self) -> dict:
        return {"base": self.base_name, "max_distance": self.max_distance, "shared_layers": self.shared_layers,
                self.base_name: self.parts[0].params()}

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # training: the base's, and the modulation c(i - j) [B', H, Lq, Lk] with its offsets (int64) and the
        # modulated probabilities, kept for the backward
        return super().extra_memory(layer, shape) + (shape.pair_bytes(3.25) if shape.training else 0.0)

    def modulation(self, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: int) -> torch.Tensor:
        """c(i - j) for every query/key pair: [B', H, Lq, Lk]."""
        offset = relative_distance(q_pos, k_pos).clamp(-self.max_distance, self.max_distance)  # [B', Lq, Lk]
        table = self.toeplitz[0 if self.shared_layers else layer]  # [2D+1, H]
        return table[offset + self.max_distance].permute(0, 3, 1, 2)  # [B', H, Lq, Lk]

    def prob(self, p, q_pos, k_pos, layer):
        p = super().prob(p, q_pos, k_pos, layer)  # the base's own modulation, if any
        return p * self.modulation(q_pos, k_pos, layer)  # [B, H, Lq, Lk]
