"""DroPE (Gelberg, Eguchi, Akiba, Cetin; arXiv 2512.12167, ICLR 2026): train with RoPE, then drop it.

At the drop every layer's rotation becomes the identity (the official code feeds cos = 1, sin = 0), every
weight is kept, and training goes on at the original length ("recalibration"); evaluation runs without
rotation at every length. `drop_at` f in [0, 1] places the drop at training step round(f * train.steps):
  0 < f < 1  from scratch: steps before it rotate q and k as rope (half layout, theta_m = base^(-2m/d)), the
             rest do not (the paper drops for the last 2k of 16k steps: f = 0.875);
  0          no step rotates: recalibrating a rope checkpoint, whose state dict loads into drope (the same
             names; the norm weights, absent there, start at 1);
  1          every step rotates and the drop comes at evaluation only (no recalibration).
`qk_norm` (the official `qk_norm_nope`): after the drop, an RMSNorm of each token's projected q, and of
its k, over all heads jointly (width H d, unlike fox's per-head norm), a weight per layer and feature,
initialised to 1 (as the paper's new weights), eps the model's RMSNorm eps. The weights exist from step 0,
so the optimizer holds them; before the drop they get a zero gradient and stay at 1.
The switch: the training loop calls set_train_step before every step, evaluation's set_eval_length drops.
`dropped` is a Python flag read outside any tensor: a compiled forward guards on it and recompiles once.
Not here: the paper's softmax temperature at long lengths (its formula unverified) and `softmax_scale`.
"""
from __future__ import annotations

import torch
from torch import nn

from posbench.checks import Flag, Real
from posbench.encodings.base import Encoding, ModelDims
from posbench.encodings.rope import rope_inv_freq, rotate

NORM_EPS = 1e-6  # the model's RMSNorm eps (posbench.model.RMSNORM_EPS); the official code takes rms_norm_eps


class DroPE(Encoding):
    name = "drope"
    hooks = frozenset({"qk"})
    relative = True  # rope before the drop, no position at all after it (the norm is per token)
    causal_only = True  # after the drop the causal mask is the only position signal
    loads_checkpoints_of = ("posbench.encodings.rope.RoPE",)  # drop_at=0: recalibrating a rope run

    def __init__(self, dims: ModelDims, base: float = 10000.0, drop_at: float = 0.875, qk_norm: bool = False):
        super().__init__(dims)
        self.base = Real(above=1)("encoding.base", base, self.name)
        self.drop_at = Real(least=0, most=1)("encoding.drop_at", drop_at, self.name)
        self.qk_norm = Flag()("encoding.qk_norm", qk_norm, self.name)
        if not dims.causal:
            raise ValueError("drope: after the drop the model is NoPE, whose only position signal is the causal "
                             "mask; set model.causal=true (the paper's models are decoders)")
        if dims.head_dim % 2:
            raise ValueError(f"drope rotates feature pairs before the drop and needs an even head size, got "
                             f"model.d_model / model.n_heads = {dims.d_model}/{dims.n_heads} = {dims.head_dim}; "
                             "change model.d_model or model.n_heads")
        self.register_buffer("inv_freq", rope_inv_freq(dims.head_dim, self.base), persistent=False)
        if self.qk_norm:  # [layers, 2 (q, k), H d]
            self.norm_weight = nn.Parameter(torch.ones(dims.n_layers, 2, dims.n_heads * dims.head_dim))
        self.dropped = self.drop_at == 0

    def params(self) -> dict:
        return {"base": self.base, "drop_at": self.drop_at, "qk_norm": self.qk_norm}

    def drop_step(self, total: int) -> int:
        """The first training step without rotation, of `total` steps."""
        return round(self.drop_at * total)

    def set_train_step(self, step: int, total: int) -> None:
        self.dropped = step >= self.drop_step(total)

    def train_phase(self) -> tuple:
        return (self.dropped,)

    def set_eval_length(self, train_positions: int, eval_positions: int) -> None:
        self.dropped = True

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self.qk_norm:  # a rope checkpoint has no norm weights: they start at 1, as the paper's new ones
            state_dict.setdefault(prefix + "norm_weight", torch.ones_like(self.norm_weight))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def joint_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each token's heads joined. x: [B, H, L, d], weight: [H d] -> [B, H, L, d]."""
        b, heads, length, head_dim = x.shape
        joined = x.transpose(1, 2).reshape(b, length, heads * head_dim)  # [B, L, H d]
        compute = joined.to(torch.promote_types(x.dtype, torch.float32))
        normed = compute * torch.rsqrt(compute.pow(2).mean(-1, keepdim=True) + NORM_EPS)  # [B, L, H d]
        return (normed * weight).to(x.dtype).view(b, length, heads, head_dim).transpose(1, 2)  # [B, H, L, d]

    def qk(self, q, k, q_pos, k_pos, layer):
        if not self.dropped:
            q, k = rotate(q, q_pos, self.inv_freq, "half"), rotate(k, k_pos, self.inv_freq, "half")
            if self.qk_norm:  # the weights in the graph at every step (zero gradient): DDP's static graph
                q = q + 0 * self.norm_weight[layer].sum()  # [B, H, Lq, d]
            return q, k
        if self.qk_norm:
            w_q, w_k = self.norm_weight[layer]  # [H d] each
            q, k = self.joint_norm(q, w_q), self.joint_norm(k, w_k)
        return q, k
