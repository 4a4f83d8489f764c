"""KERPLE (Chi et al. NeurIPS 2022, "KERPLE: Kernelized Relative Positional Embedding for Length
Extrapolation"): a learned conditionally positive definite kernel of |i - j| added to the logits.

    log:    b_h(i, j) = -r1_h * log(1 + r2_h * |i - j|)      r1, r2 > 0
    power:  b_h(i, j) = -r1_h * |i - j|^r2_h                 r1 > 0, 0 < r2 <= 2

One (r1, r2) pair per head, shared by all layers: the authors' GPT-NeoX code builds one
kernel module and hands the same instance to every layer.

Constraints. The authors' code keeps the raw values in range by clamping them in place
before each use (r >= 0.01, and r2 <= 2 for power: a projected gradient step). Here the
constraints come from a reparametrisation instead, so that no parameter is modified inside
forward (an in-place clamp of a tensor the earlier layers already used would break autograd):
r1 = softplus(u1), r2 = softplus(u2) (log) or 2 * sigmoid(u2) (power).

Initialisation follows the authors' code (uniform draws, floored at their clamp value 0.01):
log r1 ~ U(0, 2), r2 ~ U(0, 1); power r1 ~ U(0, 1), r2 ~ U(0, 2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posbench.checks import Choice
from posbench.encodings.base import Encoding, LayerShape, ModelDims, relative_distance, score_positions

VARIANTS = ("log", "power")
# initial (r1, r2) ranges: the authors' U(0, 2) / U(0, 1) draws, kept 0.01 (their clamp floor) inside
# the open ranges the reparametrisation can reach (2 * sigmoid never equals 2)
INIT_RANGES = {"log": ((0.01, 2.0), (0.01, 1.0)), "power": ((0.01, 1.0), (0.01, 1.99))}


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))  # log(exp(y) - 1), stable for large y


class Kerple(Encoding):
    name = "kerple"
    hooks = frozenset({"bias"})
    relative = True
    bias_layers_shared = True
    flex_trains_slowly = ("FlexAttention's backward adds every score's gradient into the head's r1 and r2 at once: "
                          "on an H100, 0.013-0.14x nope's training tokens/s from 33 to 4,097 tokens")

    def __init__(self, dims: ModelDims, variant: str = "log"):
        super().__init__(dims)
        Choice(VARIANTS)("encoding.variant", variant, "kerple")
        self.variant = variant
        range1, range2 = INIT_RANGES[variant]
        r1, r2 = torch.empty(dims.n_heads).uniform_(*range1), torch.empty(dims.n_heads).uniform_(*range2)  # [H]
        self.raw_r1 = nn.Parameter(inverse_softplus(r1))
        self.raw_r2 = nn.Parameter(inverse_softplus(r2) if variant == "log" else torch.logit(r2 / 2))

    def params(self) -> dict:
        return {"variant": self.variant}

    def kernel_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(r1, r2) per head, inside their ranges: [H], [H]."""
        r2 = F.softplus(self.raw_r2) if self.variant == "log" else 2 * torch.sigmoid(self.raw_r2)
        return F.softplus(self.raw_r1), r2

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # training: the bias's autograd record, the distances and their powers or logarithms, and its
        # gradient, beside the bias the guard counts
        if not shape.training or (self.bias_layers_shared and layer):
            return 0.0
        return shape.bias_bytes(4.5)

    def bias(self, q_pos, k_pos, layer):
        r1, r2 = (r[:, None, None] for r in self.kernel_params())  # [H, 1, 1] each
        distance = relative_distance(q_pos, k_pos).abs()[:, None].to(r1.dtype)  # [B', 1, Lq, Lk]
        if self.variant == "log":
            return -r1 * torch.log1p(r2 * distance)  # [B', H, Lq, Lk]
        return -r1 * distance.pow(r2)  # [B', H, Lq, Lk]; 0^r2 = 0 on the diagonal

    def score_mod(self, q_pos, k_pos, layer):
        (r1, r2), positions, log = self.kernel_params(), score_positions(q_pos, k_pos), self.variant == "log"

        def kerple(score, b, h, q_idx, kv_idx):
            i, j = positions(b, q_idx, kv_idx)
            distance = (i - j).abs().to(r1.dtype)
            return score - r1[h] * (torch.log1p(r2[h] * distance) if log else distance.pow(r2[h]))

        return kerple
