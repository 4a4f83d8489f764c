"""Gated attention (Qiu et al., NeurIPS 2025, arXiv 2505.06708), the paper's G1: each head's attention output
times a sigmoid gate from the layer's input x (after the pre-norm), before the heads are joined and projected,

    Y'_h = Y_h * sigmoid(x W_h)

`form=elementwise` (default, the paper's recommendation): W is Linear(d_model -> H d), a gate per head, token
and feature; `form=headwise`: Linear(d_model -> H), one scalar per head and token. No bias, weights N(0, 0.02),
as the paper's code, which widens q_proj (no bias, normal at initializer_range 0.02). Not a positional encoding:
by itself it is NoPE with a gate; `rope=true` rotates q and k with posbench's RoPE (GPT-NeoX layout, base
`rope_base`), the paper's rope + gate. RoPE's scalings (the paper's YaRN) beside the gate:
`encoding=composite encoding.parts=[rope,gated]`. The paper's Qwen3 also has QK-norm; not here.
"""
from __future__ import annotations

import torch
from torch import nn

from posbench.checks import Choice, Flag, Real
from posbench.encodings.base import Encoding, ModelDims
from posbench.encodings.rope import RoPE

FORMS = ("elementwise", "headwise")


class Gated(Encoding):
    name = "gated"
    hooks = frozenset({"output"})  # + qk with rope
    relative = True  # the gate reads content, never a position id; rope is relative

    def __init__(self, dims: ModelDims, form: str = "elementwise", rope: bool = False, rope_base: float = 10000.0):
        super().__init__(dims)
        Choice(FORMS)("encoding.form", form, self.name)
        self.form = form
        self.rope = Flag()("encoding.rope", rope, self.name)
        self.rope_base = Real(above=1)("encoding.rope_base", rope_base, self.name)
        if self.rope and dims.head_dim % 2:
            raise ValueError(f"gated: encoding.rope=true rotates feature pairs and needs an even head size, got "
                             f"model.d_model / model.n_heads = {dims.head_dim}")
        self.hooks = frozenset({"output"} | ({"qk"} if self.rope else set()))
        width = dims.n_heads * (dims.head_dim if form == "elementwise" else 1)
        self.gates = nn.ModuleList(nn.Linear(dims.d_model, width, bias=False) for _ in range(dims.n_layers))
        for gate in self.gates:
            nn.init.normal_(gate.weight, std=0.02)
        if self.rope:
            self.rotary = RoPE(dims, base=self.rope_base)

    def params(self) -> dict:
        return {"form": self.form, "rope": self.rope, "rope_base": self.rope_base}

    def qk(self, q, k, q_pos, k_pos, layer):
        return self.rotary.qk(q, k, q_pos, k_pos, layer) if self.rope else (q, k)

    def output(self, y, x, layer):
        b, heads, length, _ = y.shape
        gate = self.gates[layer](x).view(b, length, heads, -1).transpose(1, 2)  # [B, H, L, d or 1]
        return y * torch.sigmoid(gate)  # [B, H, L, d]
