"""ALiBi (Press et al. ICLR 2022): a fixed linear penalty -m_h * |i - j| on the logits."""
from __future__ import annotations

import math

import torch

from posbench.encodings.base import Encoding, ModelDims, relative_distance, score_positions


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """m_h = 2^(-8h/H) for H a power of two; otherwise the P = 2^floor(log2 H) slopes, then
    the first H - P odd-indexed (h = 1, 3, ...) slopes of the 2P-head sequence. -> [H] float64."""
    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    p = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(p) + geometric(2 * p)[0::2][: n_heads - p]
    return torch.tensor(slopes, dtype=torch.float64)


class ALiBi(Encoding):
    name = "alibi"
    hooks = frozenset({"bias"})
    relative = True
    bias_layers_shared = True

    def __init__(self, dims: ModelDims):
        super().__init__(dims)
        self.register_buffer("slopes", alibi_slopes(dims.n_heads).float(), persistent=False)

    def bias(self, q_pos, k_pos, layer):
        distance = relative_distance(q_pos, k_pos).abs()  # [B', Lq, Lk]; causal masks j > i anyway
        return -self.slopes[:, None, None] * distance[:, None].to(self.slopes.dtype)  # [B', H, Lq, Lk]

    def score_mod(self, q_pos, k_pos, layer):
        slopes, positions = self.slopes, score_positions(q_pos, k_pos)

        def alibi(score, b, h, q_idx, kv_idx):
            i, j = positions(b, q_idx, kv_idx)
            return score - slopes[h] * (i - j).abs().to(slopes.dtype)

        return alibi
