"""PaTH attention (Yang et al. 2025, arXiv 2505.16381): positions as a data-dependent product of
Householder-like transforms between query and key,

    logit_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(d)      (the identity when j = i),
    H_t = I - beta_t w_t w_t^T,   beta_t = 2 sigmoid(w_beta . x_t + b) in (0, 2),
    w_t = L2norm(SiLU(ShortConv_3(W_2 W_1 x_t)))  per head (W_1: d_model -> 32, W_2: 32 -> H d),

x the layer's input, the convolution causal and depthwise over time with no bias, as fla's PaTHAttention
(fla/layers/path_attn.py). The products come from one triangular solve per head (`path_products`), no
loop over keys: O(L^2 d + L^3) time and O(L^2) memory, on the eager backend (`logit_transform`), fit for
training lengths and evaluation to a few thousand tokens, not for 32k. Causal only.
`encoding=composite encoding.parts=[path,fox]` gives PaTH-FoX, with FoX's own scale of the gate (fla
multiplies the gate term by 1/sqrt(d) there).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posbench.encodings.base import FLOAT_BYTES, Encoding, LayerShape, ModelDims

W_RANK = 32  # fla's low-rank projection of w (heads not shared)
CONV_WIDTH = 3


class PaTH(Encoding):
    name = "path"
    hooks = frozenset({"logit_transform"})
    relative = True  # reads no position id: the transforms come from content
    causal_only = True
    reads_query_key = True  # beside a rotation it reads rotated q and k: no longer relative
    fla_kernel = "path"  # fla-core's parallel_path_attn: the same products, from this encoding's w and beta

    def __init__(self, dims: ModelDims):
        super().__init__(dims)
        if not dims.causal:
            raise ValueError("path: PaTH's transforms run from each key to its query, a causal product; set "
                             "model.causal=true (its paper and code are causal only)")
        width = dims.n_heads * dims.head_dim
        self.w_down = nn.ModuleList(nn.Linear(dims.d_model, W_RANK, bias=False) for _ in range(dims.n_layers))
        self.w_up = nn.ModuleList(nn.Linear(W_RANK, width, bias=False) for _ in range(dims.n_layers))
        self.w_conv = nn.ModuleList(nn.Conv1d(width, width, CONV_WIDTH, groups=width, bias=False)
                                    for _ in range(dims.n_layers))
        self.beta = nn.ModuleList(nn.Linear(dims.d_model, dims.n_heads) for _ in range(dims.n_layers))
        for linear in (*self.w_down, *self.w_up, *self.beta):
            nn.init.normal_(linear.weight, std=0.02)
        for linear in self.beta:
            nn.init.zeros_(linear.bias)  # beta = 1 at the start: H_t a reflection

    def householder(self, x: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, D] -> w [B, H, L, d] (unit norm per head) and beta [B, H, L]."""
        b, length, _ = x.shape
        w = self.w_up[layer](self.w_down[layer](x)).transpose(1, 2)  # [B, H d, L]
        w = F.silu(self.w_conv[layer](F.pad(w, (CONV_WIDTH - 1, 0))))  # causal: [B, H d, L]
        w = w.view(b, self.dims.n_heads, self.dims.head_dim, length).transpose(-1, -2)  # [B, H, L, d]
        w = F.normalize(w.to(torch.promote_types(w.dtype, torch.float32)), dim=-1).to(x.dtype)  # float32 at least, as fla
        beta = 2 * torch.sigmoid(self.beta[layer](x)).transpose(1, 2)  # [B, H, L]
        return w, beta

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # each block's W W^T, its triangular system and W K^T are [B, H, Lk, Lk] over the block's whole key
        # prefix (training keeps every block's: sum over blocks of Lk^2), beside [B, H, Lq, Lk] products
        if not shape.training:
            return shape.full_bytes(3.25) * shape.keys / shape.tokens
        block = shape.block or shape.tokens
        squares = sum(min(shape.keys, start + block + shape.keys - shape.tokens) ** 2
                      for start in range(0, shape.tokens, block))
        return 3.75 * FLOAT_BYTES * shape.batch * shape.heads * squares + shape.pair_bytes(2.5)

    def logit_transform(self, logits, q, k, call):
        w, beta = self.householder(call.x, call.layer)  # from the first input: [B, H, first_key + Lk, d]
        w, beta = w[..., call.first_key:, :], beta[..., call.first_key:]  # the call's keys: [B, H, Lk, d], [B, H, Lk]
        scale = self.logit_scale(q.shape[-1])
        plain = q @ k.transpose(-1, -2)  # [B, H, Lq, Lk]
        return logits + (path_products(q, k, w, beta, call.q_start) - plain) * scale


def path_products(q, k, w, beta, q_start: int) -> torch.Tensor:
    """q_i^T H_i ... H_{j+1} k_j for the queries at key indices q_start.. and every key j <= i (zero for j > i),
    without a loop over keys. Carrying q_i back through H_i, H_{i-1}, .. sheds c_it w_t at step t, where c_i
    solves the unit upper-triangular system (I + diag(beta) strict_upper(W W^T)) c_i = [t <= i] beta_t w_t . q_i
    (the product's UT form, as in the paper); then the logit is q_i . k_j - sum_{t > j} c_it w_t . k_j.
    q: [B, H, Lq, d], k, w: [B, H, Lk, d], beta: [B, H, Lk] -> [B, H, Lq, Lk]."""
    lq, lk = q.shape[-2], k.shape[-2]
    seen = torch.arange(lk, device=q.device) <= torch.arange(q_start, q_start + lq, device=q.device)[:, None]  # [Lq, Lk]
    rhs = (q @ w.transpose(-1, -2)) * beta[..., None, :] * seen  # beta_t w_t . q_i for t <= i: [B, H, Lq, Lk]
    system = (beta[..., :, None] * (w @ w.transpose(-1, -2))).triu(1)  # beta_t w_t . w_s, s > t: [B, H, Lk, Lk]
    system = system + torch.eye(lk, dtype=system.dtype, device=system.device)
    shed = torch.linalg.solve_triangular(system.transpose(-1, -2), rhs, upper=False, left=False,
                                         unitriangular=True)  # rows c_i: [B, H, Lq, Lk]
    later = (w @ k.transpose(-1, -2)).tril(-1)  # w_t . k_j for t > j: [B, H, Lk, Lk]
    return (q @ k.transpose(-1, -2) - shed @ later) * seen  # [B, H, Lq, Lk]
