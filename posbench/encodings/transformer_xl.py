"""Sinusoidal relative terms with global biases: Transformer-XL (Dai et al. ACL 2019) and
TENER (Yan et al. 2019).

Transformer-XL, head h, all four terms scaled by 1/sqrt(d):

    A_ij = q_i.k_j + q_i.W_R,h R(i-j) + u_h.k_j + v_h.W_R,h R(i-j)

R(t) = [sin(t w_m) ..., cos(t w_m) ...] (sines first, as in the released code; any fixed
layout is absorbed by W_R), w_m = base^(-2m/D), of size D = d_model; W_R is a per-layer
D -> D projection split into heads, u and v are learned per head and shared by the
layers. The distance is signed, so one formula serves causal (i - j >= 0 where it is
not masked) and bidirectional models. Segment-level recurrence (a memory of the previous
segments' hidden states) is the model's `forward_recurrent`, used by the WikiText task's
recurrent evaluation (`task.memory`); it works with every relative encoding.

TENER, head h, unscaled logits:

    A_tj = q_t.k_j + q_t.R(t-j) + u.k_j + v.R(t-j)

R(t) of size d (the head size) and not projected: sin(t w_m) changes sign with the
direction of t - j, cos(t w_m) does not, which is what makes the term direction-aware.
u, v are learned per head and per layer (the paper does not say; its released code
gives every layer its own). TENER also drops the key projection (K = H split into
heads); here keys come from the model's shared projection, like every encoding's.

No [L, L, D] table of R(i - j) is formed, and no table of one entry per distinct
distance either (randomized positions make those up to L^2): by the angle-addition
formulas, x_i.R(p_i - p_j) is the dot product of a per-query and a per-key vector of
size 2M, so the position term costs one [B, H, Lq, 2M] x [B', 2M, Lk] product.
"""
from __future__ import annotations

import torch
from torch import nn

from posbench.checks import Real
from posbench.encodings.base import Encoding, LayerShape, ModelDims

INIT_STD = 0.02  # the model's own initialisation scale


def sinusoid_frequencies(dim: int, base: float, device=None) -> torch.Tensor:
    """w_m = base^(-2m/dim), m = 0..dim/2-1, float64: [dim/2]."""
    return base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)


def relative_sinusoid_term(x: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                           inv_freq: torch.Tensor) -> torch.Tensor:
    """x_i . R(p_i - p_j) for every query i and key j, R(t) = [sin(t w), cos(t w)] (sines first).

    x: [B, H, Lq, 2M], q_pos: [B', Lq], k_pos: [B', Lk], inv_freq: [M] -> [B, H, Lq, Lk].
    With s, c the sine and cosine halves of x_i, a = p_i w, b = p_j w:
    s sin(a - b) + c cos(a - b) = cos b (s sin a + c cos a) + sin b (c sin a - s cos a).
    """
    q_angle = q_pos.to(torch.float64)[:, None, :, None] * inv_freq  # [B', 1, Lq, M]
    k_angle = k_pos.to(torch.float64)[:, None, :, None] * inv_freq  # [B', 1, Lk, M]
    sin_q, cos_q = q_angle.sin().to(x.dtype), q_angle.cos().to(x.dtype)
    s, c = x.chunk(2, dim=-1)  # [B, H, Lq, M] each
    query_side = torch.cat((s * sin_q + c * cos_q, c * sin_q - s * cos_q), dim=-1)  # [B, H, Lq, 2M]
    key_side = torch.cat((k_angle.cos(), k_angle.sin()), dim=-1).to(x.dtype)  # [B', 1, Lk, 2M]
    return query_side @ key_side.transpose(-1, -2)  # [B, H, Lq, Lk]


def check_even(owner: str, what: str, size: int, fix: str) -> None:
    if size % 2:
        raise ValueError(f"{owner} builds sin/cos pairs and needs an even {what}, got {size}; {fix}")


class TransformerXL(Encoding):
    name = "transformer_xl"
    hooks = frozenset({"key_term"})
    relative = True

    def __init__(self, dims: ModelDims, base: float = 10000.0):
        super().__init__(dims)
        check_even("transformer_xl", "model size", dims.d_model, "set model.d_model to an even number")
        self.base = Real(above=0)("encoding.base", base, self.name)
        self.content_bias = nn.Parameter(torch.randn(dims.n_heads, dims.head_dim) * INIT_STD)  # u: [H, d]
        self.position_bias = nn.Parameter(torch.randn(dims.n_heads, dims.head_dim) * INIT_STD)  # v: [H, d]
        self.position_proj = nn.ModuleList(nn.Linear(dims.d_model, dims.d_model, bias=False)
                                           for _ in range(dims.n_layers))  # W_R, one per layer
        for proj in self.position_proj:
            nn.init.normal_(proj.weight, std=INIT_STD)

    def params(self) -> dict:
        return {"base": self.base}

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # [B, H, Lq, Lk]: the position term and the content term added to it
        return shape.pair_bytes(0.75 if shape.training else 0.5)

    def key_term(self, q, k, q_pos, k_pos, layer):
        b, h, lq, d = q.shape
        w_r = self.position_proj[layer].weight.view(h, d, self.dims.d_model)  # W_R,h: [H, d, D]
        coeff = torch.einsum("bhld,hdm->bhlm", q + self.position_bias[:, None], w_r)  # (q+v) W_R,h: [B, H, Lq, D]
        inv_freq = sinusoid_frequencies(self.dims.d_model, self.base, q.device)
        position = relative_sinusoid_term(coeff, q_pos, k_pos, inv_freq)  # [B, H, Lq, Lk]
        content = (k @ self.content_bias[:, :, None]).transpose(-1, -2)  # u.k_j: [B, H, 1, Lk]
        return (position + content) * self.logit_scale(d)  # [B, H, Lq, Lk]


class TENER(Encoding):
    name = "tener"
    hooks = frozenset({"key_term"})
    relative = True

    def __init__(self, dims: ModelDims, base: float = 10000.0):
        super().__init__(dims)
        check_even("tener", "head size", dims.head_dim,
                   f"model.d_model / model.n_heads = {dims.d_model}/{dims.n_heads}; change either")
        self.base = Real(above=0)("encoding.base", base, self.name)
        shape = (dims.n_layers, dims.n_heads, dims.head_dim)
        self.content_bias = nn.Parameter(torch.randn(shape) * INIT_STD)  # u: [layers, H, d]
        self.position_bias = nn.Parameter(torch.randn(shape) * INIT_STD)  # v: [layers, H, d]

    def params(self) -> dict:
        return {"base": self.base}

    def logit_scale(self, head_dim: int) -> float:
        return 1.0  # TENER leaves the logits unscaled: sharper attention helped NER

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # [B, H, Lq, Lk]: the position term and the content term added to it
        return shape.pair_bytes(0.5)

    def key_term(self, q, k, q_pos, k_pos, layer):
        inv_freq = sinusoid_frequencies(q.shape[-1], self.base, q.device)
        query = q + self.position_bias[layer, :, None]  # q_t + v: [B, H, Lq, d]
        position = relative_sinusoid_term(query, q_pos, k_pos, inv_freq)  # [B, H, Lq, Lk]
        content = (k @ self.content_bias[layer, :, :, None]).transpose(-1, -2)  # u.k_j: [B, H, 1, Lk]
        return position + content  # [B, H, Lq, Lk]
