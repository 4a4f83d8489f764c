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
The logs are the stable log-sigmoid, as the official reference's: log(1 - beta) = logsigmoid(-s) =
-softplus(s), finite for any finite s, where log(sigmoid(-s)) underflows to -inf past s ~ 88.7 in
float32 (bfloat16 and float16 included, which run in float32) and zeroes the row.

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

import math

import torch
from torch import nn

from posbench.checks import Choice, Flag
from posbench.encodings.base import Encoding, LayerShape, ModelDims

REMAINDERS = ("value", "learned", "none")
LOG2_E = 1 / math.log(2)


class StickBreaking(Encoding):
    name = "stick_breaking"
    hooks = frozenset({"normalize"})
    relative = True  # reads no positions at all
    fla_kernel = "stick_breaking"  # fla-core's parallel_stickbreaking_attn: the same weights and remainder

    def __init__(self, dims: ModelDims, remainder: str = "value", attend_current: bool = False):
        super().__init__(dims)
        Choice(REMAINDERS)("encoding.remainder", remainder, self.name)
        self.remainder = remainder
        self.attend_current = Flag()("encoding.attend_current", attend_current, self.name)
        if remainder == "learned":
            self.head_bias = nn.Parameter(torch.zeros(dims.n_heads, dims.head_dim))  # u: [H, d]

    def params(self) -> dict:
        return {"remainder": self.remainder, "attend_current": self.attend_current}

    def extra_memory(self, layer: int, shape: LayerShape) -> float:
        # [B, H, Lq, Lk]: the scores in float32, log(1 - beta) and its reversed cumulative sum, the weights
        return shape.pair_bytes(1.25 if shape.training else 1.75)

    def normalize(self, logits, v, call):
        lq, lk = logits.shape[-2:]
        rows = call.q_start + torch.arange(lq, device=logits.device)  # the queries' own key indices: [Lq]
        own = rows[:, None] == torch.arange(lk, device=logits.device)  # [Lq, Lk]
        takes = torch.ones_like(own) if self.attend_current else ~own  # keys that take a share and break
        visible = call.visible()  # [Lq, Lk] or None
        if visible is not None:
            takes = takes & visible
        compute = torch.promote_types(logits.dtype, torch.float32)
        weights, log_rest = BrokenStick.apply(logits.to(compute), takes)  # A: [B, H, Lq, Lk], log r: [B, H, Lq, 1]
        return weights.to(v.dtype), self.remainder_term(log_rest.exp(), v, call)  # [B, H, Lq, Lk], [B, H, Lq, d]

    def remainder_term(self, rest: torch.Tensor, v: torch.Tensor, call) -> torch.Tensor | None:
        """r_i u from the unclaimed shares r [B, H, Lq, 1] (None for remainder: none): [B, H, Lq, d]."""
        if self.remainder == "none":
            return None
        if self.remainder == "value":
            u = v[..., call.q_start:call.q_start + rest.shape[-2], :]  # v_i: [B, H, Lq, d]
        else:
            u = self.head_bias[:, None, :]  # [H, 1, d]
        return (rest * u).to(v.dtype)


class BrokenStick(torch.autograd.Function):
    """The weights A and log r from the scores s [B, H, Lq, Lk] and the keys that take part
    [Lq, Lk], with a backward of its own: few full-size passes, two tensors kept (s, A).

    log A_ij = logsigmoid(s_ij) + sum_{t > j} log(1 - beta_it)
    log r_i = sum_t log(1 - beta_it)
    With G_ij = dA_ij A_ij (the gradient at log A), s_it reaches log A_it through logsigmoid(s_it)
    (derivative 1 - beta_it), and log A_ij for every j < t and log r_i through log(1 - beta_it)
    (derivative -beta_it):
    ds_it = G_it - beta_it (sum_{j <= t} G_ij + d log r_i)
    Keys that take no part hold s = -inf: no break (log(1 - 0) = 0), no share (A = 0), no gradient.
    Stable for any finite s: log(1 - beta) = -softplus(s) and log beta = s - softplus(s), never the log
    of a sigmoid (it underflows to log 0 = -inf past s ~ 88.7 in float32 and zeroes the row), and the
    share is added to the sum over t > j, not s_ij to the sum over t >= j (which cancels for large
    s); the backward reads beta = sigmoid(s), stable as it is. exp runs as exp2: CPU exp takes a slow
    path for every result that underflows, and most do."""

    @staticmethod
    def forward(ctx, logits, takes):
        s = logits.masked_fill(~takes, float("-inf"))  # [B, H, Lq, Lk]
        reversed_s = s.flip(-1)  # keys last to first (a copy): [B, H, Lq, Lk]
        # softplus is linear past 50, where log(1 + e^-s) < 2e-22 is below even float64's precision
        soft = nn.functional.softplus(reversed_s, threshold=50)  # -log(1 - beta): [B, H, Lq, Lk]
        log_a = reversed_s.sub_(soft)  # log beta: [B, H, Lq, Lk]
        after = soft.neg_().cumsum_(-1)  # sum over t >= j of log(1 - beta_it): [B, H, Lq, Lk]
        log_rest = after[..., -1:].clone()  # [B, H, Lq, 1]
        log_a[..., 1:].add_(after[..., :-1])  # + the sum over t > j: log A
        weights = log_a.mul_(LOG2_E).exp2_().flip(-1)  # A: [B, H, Lq, Lk]
        ctx.save_for_backward(s, weights)
        return weights, log_rest

    @staticmethod
    def backward(ctx, grad_weights, grad_log_rest):
        s, weights = ctx.saved_tensors
        g = grad_weights * weights  # G: [B, H, Lq, Lk]
        through_breaks = g.cumsum(-1).add_(grad_log_rest)  # sum_{j <= t} G_ij + d log r_i: [B, H, Lq, Lk]
        return g.sub_(through_breaks.mul_(torch.sigmoid(s))), None
