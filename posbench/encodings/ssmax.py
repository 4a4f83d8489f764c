"""Scalable-Softmax, SSMax (Nakanishi 2025, arXiv 2501.19399): softmax_j(s_h log(n) z_ij), n the number of
keys query i attends (i + 1 under a causal mask), s_h learned per layer and head. Exact as a scale of
q after the other hooks (a `query_scale`), so it keeps every fused kernel; beside another encoding
it goes in a composite: `encoding=composite encoding.parts=[rope,ssmax]`. Alone it reads no
positions (NoPE with SSMax).

`init` is s at the start: 0.43 is the value of the paper's Figure 1 (the unofficial PyPI port starts
there too; OLMo-core starts at 1). `bias=true` is the paper's variant s_h log(n) + b_h (b from 0),
which it reports trains faster but generalises worse in length.
"""
from __future__ import annotations

import torch
from torch import nn

from posbench.checks import Flag, Real
from posbench.encodings.base import Encoding, ModelDims


class SSMax(Encoding):
    name = "ssmax"
    hooks = frozenset({"query_scale"})
    relative = True  # n counts keys, never reads a position id

    def __init__(self, dims: ModelDims, init: float = 0.43, bias: bool = False):
        super().__init__(dims)
        self.init = Real(above=0)("encoding.init", init, self.name)
        self.with_bias = Flag()("encoding.bias", bias, self.name)
        self.scale = nn.Parameter(torch.full((dims.n_layers, dims.n_heads), float(self.init)))  # s: [layers, H]
        self.shift = nn.Parameter(torch.zeros(dims.n_layers, dims.n_heads)) if self.with_bias else None  # b

    def params(self) -> dict:
        return {"init": self.init, "bias": self.with_bias}

    def query_scale(self, call):
        log_n = call.keys_seen().to(self.scale.dtype).log()  # [Lq]
        factor = self.scale[call.layer][:, None] * log_n  # [H, Lq]
        if self.shift is not None:
            factor = factor + self.shift[call.layer][:, None]
        return factor[None, :, :, None]  # [1, H, Lq, 1]
