"""The eager backend: the logits materialised, every hook in the table's order. The reference."""
from __future__ import annotations

import torch

from posbench.attention.backend import Backend, call_bias
from posbench.hooks import EAGER, backend_hooks

EAGER_TRAIN_BLOCK = 128  # queries per block of a causal eager layer in training


class EagerBackend(Backend):
    name = EAGER
    supported_hooks = backend_hooks(name)
    per_sequence_logits = True

    @property
    def train_block(self) -> int:
        return EAGER_TRAIN_BLOCK

    def attend(self, q, k, v, call):
        enc, hooks = call.encoding, call.encoding.hooks
        # q.k times the scale within the product: no pass over the logits for it, forward or backward
        logits = torch.baddbmm(q.new_zeros(()), q.flatten(0, -3), k.flatten(0, -3).transpose(-2, -1), beta=0,
                               alpha=enc.logit_scale(q.shape[-1])).view(*q.shape[:-1], k.shape[-2])  # [B, H, Lq, Lk]
        if call.k_levels is not None:  # c_i - c_j
            logits = logits + (call.q_levels[..., :, None] - call.k_levels[..., None, :]).to(logits.dtype)
        bias = call_bias(call)
        if bias is not None:
            logits = logits + bias.to(logits.dtype)  # [B', H, Lq, Lk] broadcast
        term = enc.key_term(q, k, call.q_pos, call.k_pos, call.layer)
        if term is not None:
            logits = logits + term
        if "logit_transform" in hooks:
            logits = enc.logit_transform(logits, q, k, call)  # [B, H, Lq, Lk]
        visible = call.visible()
        extra = None
        if "normalize" in hooks:
            if visible is not None:
                logits = logits.masked_fill(~visible, float("-inf"))
            p, extra = enc.normalize(logits, v, call)  # [B, H, Lq, Lk], [B, H, Lq, d] or None
        elif visible is not None:
            p = MaskedSoftmax.apply(logits, visible)  # [B, H, Lq, Lk]
        else:
            p = logits.softmax(dim=-1)  # [B, H, Lq, Lk]
        p = enc.prob(p, call.q_pos, call.k_pos, call.layer)
        out = p @ v  # [B, H, Lq, d]
        for term in (enc.value_term(p, call.q_pos, call.k_pos, call.layer), extra):
            if term is not None:
                out = out + term
        return out


class MaskedSoftmax(torch.autograd.Function):
    """softmax over the keys, the hidden ones at -inf: one pass over [B, H, Lq, Lk] forward and two backward
    fewer than masked_fill under autograd, whose backward zeroes what the softmax's already gives 0 (p = 0)."""

    @staticmethod
    def forward(ctx, logits, visible):
        p = torch.where(visible, logits, float("-inf")).softmax(dim=-1)  # [B, H, Lq, Lk]
        ctx.save_for_backward(p)
        ctx.dtype = logits.dtype
        return p

    @staticmethod
    def backward(ctx, grad):
        p, = ctx.saved_tensors
        return torch._softmax_backward_data(grad.to(p.dtype), p, -1, p.dtype).to(ctx.dtype), None
