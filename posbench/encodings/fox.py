"""Forgetting Transformer, FoX (Lin et al. ICLR 2025, arXiv 2503.02130): a data-dependent forget gate
per head and token, f_t = sigmoid(w_f . x_t + b_f), from the layer's input x. With
c_i = sum_{l <= i} log f_l (in float64 here; float32 in the paper), the logits get

    D_ij = c_i - c_j = sum_{l = j+1..i} log f_l      (D_ii = 0, j <= i)

a `decay`: rank one in causal layout, so sdpa runs it through the mask-free causal kernel. No
positional encoding otherwise (the paper's `use_rope=False`); `rope=true` rotates q and k as
well (GPT-NeoX layout, base `rope_base`), `qk_norm=true` adds the Pro block's QK-norm: an RMSNorm
per head with a learned weight per layer, head and feature, before the rotation. The gate is
Linear(d_model -> H) per layer, weights N(0, 0.02), bias 0 (f = 0.5 at start), as in the
official layer. The Pro block's output side (the `output` hook, before the output projection):
`output_norm=true` is an RMSNorm of each head's output with a learned weight per layer, head and
feature (ones at start), `output_gate=true` multiplies by sigmoid(W_o x), W_o Linear(d_model ->
d_model) without bias, N(0, 0.02); with both, the norm comes first, as in the official layer.
The Pro block's token shifts (the `kv` hook, on the projected keys and values, before QK-norm and
rotation): `k_shift=true` makes each head's key k_t <- a_t k_{t-1} + (1 - a_t) k_t, a_t =
sigmoid(w . x_t) per head (Linear(d_model -> H) without bias, N(0, 0.02); k_{-1} = 0, at the first
key of the sequence or of a memory before it), `v_shift=true` the same for values with weights of
its own, as the official ShiftLinear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posbench.checks import Flag, Real
from posbench.encodings.base import Encoding, ModelDims
from posbench.encodings.rope import rope_inv_freq, rotate

NORM_EPS = 1e-6  # the official layer's norm_eps (QK-norm and the output norm)


class FoX(Encoding):
    name = "fox"
    hooks = frozenset({"decay"})  # + qk with rope or qk_norm, + output with output_norm or output_gate, + kv
    relative = True  # the gates read content, never a position id: a shift of every position changes nothing

    def __init__(self, dims: ModelDims, rope: bool = False, rope_base: float = 500000.0, qk_norm: bool = False,
                 output_norm: bool = False, output_gate: bool = False, k_shift: bool = False, v_shift: bool = False):
        super().__init__(dims)
        self.rope = Flag()("encoding.rope", rope, self.name)
        self.rope_base = Real(above=1)("encoding.rope_base", rope_base, self.name)
        self.qk_norm = Flag()("encoding.qk_norm", qk_norm, self.name)
        self.output_norm = Flag()("encoding.output_norm", output_norm, self.name)
        self.output_gate = Flag()("encoding.output_gate", output_gate, self.name)
        self.k_shift = Flag()("encoding.k_shift", k_shift, self.name)
        self.v_shift = Flag()("encoding.v_shift", v_shift, self.name)
        if self.rope and dims.head_dim % 2:
            raise ValueError(f"fox: encoding.rope=true rotates feature pairs and needs an even head size, got "
                             f"model.d_model / model.n_heads = {dims.head_dim}")
        self.hooks = frozenset({"decay"} | ({"qk"} if self.rope or self.qk_norm else set())
                               | ({"output"} if self.output_norm or self.output_gate else set())
                               | ({"kv"} if self.k_shift or self.v_shift else set()))
        self.gates = nn.ModuleList(nn.Linear(dims.d_model, dims.n_heads) for _ in range(dims.n_layers))
        for gate in self.gates:
            nn.init.normal_(gate.weight, std=0.02)
            nn.init.zeros_(gate.bias)
        if self.qk_norm:  # [layers, 2 (q, k), H, 1, d]
            self.norm_weight = nn.Parameter(torch.ones(dims.n_layers, 2, dims.n_heads, 1, dims.head_dim))
        if self.output_norm:  # [layers, H, 1, d]
            self.output_norm_weight = nn.Parameter(torch.ones(dims.n_layers, dims.n_heads, 1, dims.head_dim))
        if self.output_gate:
            self.output_gates = nn.ModuleList(nn.Linear(dims.d_model, dims.d_model, bias=False)
                                              for _ in range(dims.n_layers))
            for gate in self.output_gates:
                nn.init.normal_(gate.weight, std=0.02)
        for name, on in (("k_shifts", self.k_shift), ("v_shifts", self.v_shift)):
            if on:  # a_t per head from the layer's input: Linear(d_model -> H) per layer
                shifts = nn.ModuleList(nn.Linear(dims.d_model, dims.n_heads, bias=False) for _ in range(dims.n_layers))
                for shift in shifts:
                    nn.init.normal_(shift.weight, std=0.02)
                setattr(self, name, shifts)
        self.register_buffer("inv_freq", rope_inv_freq(dims.head_dim, self.rope_base), persistent=False)

    def params(self) -> dict:
        return {"rope": self.rope, "rope_base": self.rope_base, "qk_norm": self.qk_norm,
                "output_norm": self.output_norm, "output_gate": self.output_gate, "k_shift": self.k_shift,
                "v_shift": self.v_shift}

    def log_forget(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """log f_t per head: x [B, L, D] -> [B, H, L] in float32 at least."""
        logit = self.gates[layer](x).transpose(1, 2)  # [B, H, L]
        return F.logsigmoid(logit.to(torch.promote_types(logit.dtype, torch.float32)))

    def decay(self, call):
        return self.log_forget(call.x, call.layer).double().cumsum(-1)  # c: [B, H, Lk]

    def kv(self, k, v, call):
        if self.k_shift:
            k = token_shift(k, self.k_shifts[call.layer](call.x))
        if self.v_shift:
            v = token_shift(v, self.v_shifts[call.layer](call.x))
        return k, v

    def qk(self, q, k, q_pos, k_pos, layer):
        if self.qk_norm:
            w_q, w_k = self.norm_weight[layer]  # [H, 1, d] each
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w_q  # [B, H, Lq, d]
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w_k  # [B, H, Lk, d]
        if self.rope:
            q, k = rotate(q, q_pos, self.inv_freq, "half"), rotate(k, k_pos, self.inv_freq, "half")
        return q, k

    def output(self, y, x, layer):
        if self.output_norm:
            scale = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + NORM_EPS)  # [B, H, L, 1]
            y = y * scale * self.output_norm_weight[layer]  # [B, H, L, d]
        if self.output_gate:
            b, heads, length, head_dim = y.shape
            gate = self.output_gates[layer](x).view(b, length, heads, head_dim).transpose(1, 2)  # [B, H, L, d]
            y = y * torch.sigmoid(gate)
        return y


def token_shift(x: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    """a_t x_{t-1} + (1 - a_t) x_t per head, a = sigmoid(logit) in float32 at least, x_{-1} = 0.
    x: [B, H, L, d], logit: [B, L, H] -> [B, H, L, d]."""
    a = torch.sigmoid(logit.to(torch.promote_types(logit.dtype, torch.float32)))  # [B, L, H]
    a = a.transpose(1, 2)[..., None]  # [B, H, L, 1]
    previous = F.pad(x, (0, 0, 1, 0))[..., :-1, :]  # x_{t-1}: [B, H, L, d]
    return (a * previous + (1 - a) * x).to(x.dtype)
