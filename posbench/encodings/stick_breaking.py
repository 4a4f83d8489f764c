"""Stick-breaking attention (Tan et al. ICLR 2025, "Scaling Stick-Breaking Attention: An Efficient
Implementation and In-depth Study", arXiv 2410.17980): softmax replaced by breaking a stick from the
nearest key backwards; no positional encoding otherwise (the order comes from the breaking).

    beta_ij = sigmoid(s_ij),   A_ij = beta_ij prod_{j < t < i} (1 - beta_it)        for keys j < i
    log A_ij = logsigmoid(s_ij) + sum_{t=j+1}^{i-1} logsigmoid(-s_it)
    o_i = sum_j A_ij v_j + r_i u,   r_i = 1 - sum_j A_ij = prod_{t < i} (1 - beta_it)

s_ij = q_i . k_j / sqrt(d) (the official kernel's inv_temp). The current token is excluded by
default (`attend_current: true` lets key i take a share and break the stick too: t <= i above), as
the official sb_attn_varlen. The sums run as a reverse cumulative sum along keys (flip, cumsum, flip)
in float32 at least, never the [L, L] x [L, L] product of the reference sb_ref.py; r_i is taken as
the product itself (exp of the summed logs), which equals 1 - sum_j A_ij without its cancellation.

remainder: what the unclaimed share r_i carries.
  value    u = v_i, the token's own value (default): the official repository's reference tests add
           rem * v to the kernel's output, and the weights on keys j <= i then sum to 1, as softmax's,
           so it replaces softmax in posbench's model unchanged.
  learned  u = a learned vector per head (zero at start), the released 3B model's head_bias; that model
           also puts a GroupNorm over heads after attention, which posbench's model does not have.
  none     no term: o_i = sum_j A_ij v_j.

Bidirectional models: every key other than i (all keys with attend_current) breaks the stick, from
the last key backwards. A query's own key is its key index (the call's q_start onwards), never its
position id; the mask (causal, a sliding window) decides which keys take part.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posbench.checks import Flag
from posbench.encodings.base import Encoding, ModelDims, check_choice

REMAINDERS = ("value", "learned", "none")


class StickBreaking(Encoding):
    name = "stick_breaking"
    hooks = frozenset({"normalize"})
    relative = True  # reads no positions at all

    def __init__(self, dims: ModelDims, remainder: str = "value", attend_current: bool = False):
        super().__init__(dims)
        check_choice(self.name, "encoding.remainder", remainder, REMAINDERS)
        self.remainder = remainder
        self.attend_current = Flag()("encoding.attend_current", attend_current, self.name)
        if remainder == "learned":
            self.head_bias = nn.Parameter(torch.zeros(dims.n_heads, dims.head_dim))  # u: [H, d]

    def params(self) -> dict:
        return {"remainder": self.remainder, "attend_current": self.attend_current}

    def normalize(self, logits, v, call):
        lq, lk = logits.shape[-2:]
        rows = call.q_start + torch.arange(lq, device=logits.device)  # the queries' own key indices: [Lq]
        own = rows[:, None] == torch.arange(lk, device=logits.device)  # [Lq, Lk]
        takes = torch.ones_like(own) if self.attend_current else ~own  # keys that take a share and break
        visible = call.visible()  # [Lq, Lk] or None
        if visible is not None:
            takes = takes & visible
        compute = torch.promote_types(logits.dtype, torch.float32)
        s = torch.where(takes, logits.to(compute), 0.0)  # finite everywhere (masked logits arrive as -inf)
        breaks = torch.where(takes, F.logsigmoid(-s), 0.0)  # log(1 - beta_it): [B, H, Lq, Lk]
        after = breaks.flip(-1).cumsum(-1).flip(-1)  # sum over t >= j: [B, H, Lq, Lk]
        after = F.pad(after[..., 1:], (0, 1))  # sum over t > j
        weights = torch.where(takes, torch.exp(F.logsigmoid(s) + after), 0.0)  # A: [B, H, Lq, Lk]
        if self.remainder == "none":
            return weights.to(v.dtype), None
        rest = breaks.sum(-1, keepdim=True).exp()  # r_i = prod_t (1 - beta_it): [B, H, Lq, 1]
        if self.remainder == "value":
            u = v[..., call.q_start:call.q_start + lq, :]  # v_i: [B, H, Lq, d]
        else:
            u = self.head_bias[:, None, :]  # [H, 1, d]
        return weights.to(v.dtype), (rest * u).to(v.dtype)  # [B, H, Lq, Lk], [B, H, Lq, d]
