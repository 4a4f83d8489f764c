"""CABLE, Context-aware Biases for Length Extrapolation (Veisi, Amirzadeh, Mansourian, arXiv 2503.08067):
a bias per head and token from the layer's input x (after the pre-norm),

    b_t = -sum_{s <= t} softplus(w_h . x_s + c_h),   logit_ij += b_i - b_j = -sum_{s = j+1..i} softplus(...)

a `decay` with levels b (float64 here), as FoX's with log f_s = -softplus(z_s) = log sigmoid(-z_s): the same
family, the gate's sign flipped. No positional encoding otherwise (GPT-2 without its position table). The
gate is Linear(d_model -> H) per layer with bias, weights N(0, 0.02), bias 0 (ln 2 per token at start), as
the released code (axiomlab/Cable, v1). `logit_scale`: `none` (default) is the released code's q.k with no
1/sqrt(d) (it divides q and k by sqrt(C / n_embd) = 1); `sqrt_d` the usual q.k / sqrt(d), with which cable
is fox reparameterised (w, c -> -w, -c). Causal only: the bias sums over the tokens between key and query.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from posbench.checks import Choice
from posbench.encodings.base import Encoding, ModelDims

LOGIT_SCALES = ("none", "sqrt_d")


class CABLE(Encoding):
    name = "cable"
    hooks = frozenset({"decay"})
    relative = True  # the biases read content, never a position id
    causal_only = True

    def __init__(self, dims: ModelDims, logit_scale: str = "none"):
        super().__init__(dims)
        Choice(LOGIT_SCALES)("encoding.logit_scale", logit_scale, self.name)
        if not dims.causal:
            raise ValueError("cable: its bias sums softplus gates over the tokens from the key to the query, a "
                             "causal sum; set model.causal=true (its paper and code are causal only)")
        self.scale = logit_scale
        self.gates = nn.ModuleList(nn.Linear(dims.d_model, dims.n_heads) for _ in range(dims.n_layers))
        for gate in self.gates:
            nn.init.normal_(gate.weight, std=0.02)
            nn.init.zeros_(gate.bias)

    def params(self) -> dict:
        return {"logit_scale": self.scale}

    def logit_scale(self, head_dim: int) -> float:
        return 1.0 if self.scale == "none" else 1.0 / math.sqrt(head_dim)

    def decay(self, call):
        z = self.gates[call.layer](call.x).transpose(1, 2)  # [B, H, Lk]
        # -softplus(z) as logsigmoid(-z): softplus's backward fails a view under torch.compile (torch 2.13)
        return F.logsigmoid(-z.to(torch.promote_types(z.dtype, torch.float32))).double().cumsum(-1)  # b: [B, H, Lk]
