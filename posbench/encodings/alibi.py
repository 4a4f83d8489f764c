"""ALiBi (Press et al. ICLR 2022): a fixed linear penalty -m_h * |i - j| on the logits.

In a causal model the penalty is -m_h (i - j) = c_i - c_j with levels c = -m_h * position: a
`decay`, which sdpa runs as one more q/k column through the mask-free causal kernel. A
bidirectional model takes it as a `bias`."""
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
    hooks = frozenset({"decay"})  # causal; {"bias"} in a bidirectional model
    relative = True
    bias_layers_shared = True

    def __init__(self, dims: ModelDims):
        super().__init__(dims)
        self.hooks = frozenset({"decay"} if dims.causal else {"bias"})
        self.register_buffer("slopes", alibi_slopes(dims.n_heads).float(), persistent=False)

    def decay(self, call):
        slopes = alibi_slopes(self.dims.n_heads).to(call.k_pos.device)  # [H] float64: exact levels at any length
        return -slopes[:, None] * call.k_pos[:, None].to(slopes.dtype)  # [B', H, Lk]

    def linear_bias(self, q_pos, k_pos) -> torch.Tensor:
        """-m_h |i - j|: [B', H, Lq, Lk], in either layout."""
        distance = relative_distance(q_pos, k_pos).abs()  # [B', Lq, Lk]
        return -self.slopes[:, None, None] * distance[:, None].to(self.slopes.dtype)  # [B', H, Lq, Lk]

    def bias(self, q_pos, k_pos, layer):
        return self.linear_bias(q_pos, k_pos) if "bias" in self.hooks else None  # causal: the decay carries it

    def score_mod(self, q_pos, k_pos, layer):
        if "bias" not in self.hooks:
            return None
        slopes, positions = self.slopes, score_positions(q_pos, k_pos)

        def alibi(score, b, h, q_idx, kv_idx):
            i, j = positions(b, q_idx, kv_idx)
            return score - slopes[h] * (i - j).abs().to(slopes.dtype)

        return alibi
