"""TAPE (Zhu et al. ICML 2025, arXiv 2501.00712, *Rethinking Addressing in Language Models via Contextualized
Equivariant Positional Encoding*): a position state z per token and head, d/2 complex numbers, that starts
as RoPE's e^{i t w_m} (w_m = base^(-2m/d)) and is carried from layer to layer:

1. attention turns q's and k's feature pair m (half layout) by z_m, a rotation and, once z has moved, a
   scaling; it averages the states with its own weights, z <- z + c_h (A z), c_h the row sum of an H x H
   matrix per layer (the official post_attention_linear, a per-head scalar), zero at start;
2. after the block's feed-forward, with u its output: z <- z + W_down[silu(W_x u) * W_up z], W_up: H -> P
   mixing the heads, W_x: D -> P, W_down: P -> H (P = position_size), the same for every pair m and for
   the real and imaginary parts; W_up zero at start, W_x and W_down N(0, 0.02), no biases.

At start TAPE is RoPE. Every update is real-linear in z, so a common phase (a shift of every position)
passes through and the logits depend on i - j alone. The official code draws a random global offset
in training; under that invariance it changes only rounding, and posbench starts at the positions it is
given. The states ride as extra value columns, v [B, H, L, d + d]: one attention call on any backend that
takes a v wider than q and k (eager, sdpa; flex where torch allows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posbench.checks import Real
from posbench.encodings.base import Encoding, LayerShape, ModelDims
from posbench.encodings.rope import rope_inv_freq


class TAPE(Encoding):
    name = "tape"
    hooks = frozenset({"state_init", "qkv", "state_update", "state_mlp"})
    relative = True  # the updates are real-linear in z: a shift of every position is a common phase

    def __init__(self, dims: ModelDims, base: float = 10000.0, position_size: int = 48):
        super().__init__(dims)
        self.base = Real(above=1)("encoding.base", base, self.name)
        if isinstance(position_size, bool) or not isinstance(position_size, int) or position_size < 1:
            raise ValueError(f"tape: encoding.position_size={position_size!r} is not valid; give a positive integer "
                             "(the width of the state's feed-forward, 48 in the paper)")
        if dims.head_dim % 2:
            raise ValueError(f"tape: the state turns feature pairs and needs an even head size, got model.d_model / "
                             f"model.n_heads = {dims.head_dim}")
        self.position_size = position_size
        heads, layers = dims.n_heads, dims.n_layers
        self.mix_attended = nn.Parameter(torch.zeros(layers, heads, heads))  # c_h = row sums: [layers, H, H]
        self.w_up = nn.Parameter(torch.zeros(layers, position_size, heads))  # [layers, P, H]
        self.w_down = nn.Parameter(torch.randn(layers, heads, position_size) * 0.02)  # [layers, H, P]
        self.w_x = nn.ModuleList(nn.Linear(dims.d_model, position_size, bias=False) for _ in range(layers))
        for linear in self.w_x:
            nn.init.normal_(linear.weight, std=0.02)
        self.register_buffer("inv_freq", rope_inv_freq(dims.head_dim, self.base), persistent=False)

    def params(self) -> dict:
        return {"base": self.base, "position_size": self.position_size}

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # v widened with the state's columns leaves the fused CPU kernel (one head size): sdpa's math path holds
        # every query's logits and weights [B, H, Lq, Lk] at once, and training keeps them for the backward
        return shape.full_bytes(2.0 if shape.training else 2.5)

    def state_init(self, pos, x):
        compute = torch.promote_types(x.dtype, torch.float32)
        angles = pos.to(compute)[:, None, :, None] * self.inv_freq.to(compute)  # [B', 1, L, d/2]
        return torch.cat([angles.cos(), angles.sin()], dim=-1)  # z = (real | imaginary): [B', 1, L, d]

    def qkv(self, q, k, v, call):
        z = call.state  # [B'|B, 1|H, L, d]
        state = z.to(v.dtype).expand(v.shape[0], v.shape[1], -1, -1)  # [B, H, L, d]
        return turn(q, z), turn(k, z), torch.cat([v, state], dim=-1)  # v: [B, H, L, 2d]

    def state_update(self, y, call):
        d = self.dims.head_dim
        c = self.mix_attended[call.layer].sum(-1)  # [H]
        z = call.state + c[:, None, None] * y[..., d:].to(call.state.dtype)  # [B, H, L, d]
        return y[..., :d], z  # [B, H, L, d]

    def state_mlp(self, state, u, layer):
        gate = F.silu(self.w_x[layer](u)).transpose(1, 2)[..., None].to(state.dtype)  # [B, P, L, 1]
        up = torch.einsum("bhld,ph->bpld", state, self.w_up[layer].to(state.dtype))  # [B, P, L, d]
        return state + torch.einsum("bpld,hp->bhld", gate * up, self.w_down[layer].to(state.dtype))  # [B, H, L, d]


def turn(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Feature pair m of x (half layout: m and m + d/2) times the complex z_m. x [B, H, L, d], z [B'|B, 1|H, L, d]
    (real parts | imaginary parts) -> [B, H, L, d]."""
    real, imaginary = z.to(x.dtype).chunk(2, dim=-1)  # [.., L, d/2] each
    x1, x2 = x.chunk(2, dim=-1)  # [B, H, L, d/2] each
    return torch.cat([x1 * real - x2 * imaginary, x2 * real + x1 * imaginary], dim=-1)
