"""One attention layer that applies the encoding's hooks in the fixed order, and its backends.

    qk -> logits = q.k^T * scale + bias + key_term -> causal mask -> softmax -> prob
    -> p.V + value_term

`eager` materialises the logits and runs every hook (the reference). `sdpa` calls
PyTorch's scaled_dot_product_attention with the bias folded into a 4-D float mask (the
layout that keeps the fused CPU kernel) and `is_causal` when there is no bias; it
refuses encodings with hooks it cannot express. `auto` picks sdpa when it can, else eager.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from posbench.encodings.base import Encoding


class Backend:
    name = ""
    supported_hooks: frozenset[str] = frozenset()

    def check(self, encoding: Encoding) -> None:
        missing = set(encoding.hooks) - {"embed"} - self.supported_hooks
        if missing:
            valid = [b for b, cls in BACKENDS.items() if not set(encoding.hooks) - {"embed"} - cls.supported_hooks]
            raise ValueError(f"backend={self.name} cannot run the {sorted(missing)} hook(s) that encoding "
                             f"{encoding.name} needs; use backend={valid[0]} (backends that can: {valid})")

    def attend(self, q, k, v, encoding: Encoding, q_pos, k_pos, layer: int, causal: bool) -> torch.Tensor:
        raise NotImplementedError


def causal_mask(lq: int, lk: int, device) -> torch.Tensor:
    """True where key j may be seen by query i (j <= i, queries aligned to the last keys): [Lq, Lk]."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(diagonal=lk - lq)


class EagerBackend(Backend):
    name = "eager"
    supported_hooks = frozenset({"qk", "bias", "key_term", "value_term", "prob"})

    def attend(self, q, k, v, encoding, q_pos, k_pos, layer, causal):
        logits = (q @ k.transpose(-2, -1)) * encoding.logit_scale(q.shape[-1])  # [B, H, Lq, Lk]
        bias = encoding.bias(q_pos, k_pos, layer)
        if bias is not None:
            logits = logits + bias.to(logits.dtype)  # [B', H, Lq, Lk] broadcast
        term = encoding.key_term(q, k, q_pos, k_pos, layer)
        if term is not None:
            logits = logits + term
        if causal:
            logits = logits.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
        p = encoding.prob(logits.softmax(dim=-1), q_pos, k_pos, layer)  # [B, H, Lq, Lk]
        out = p @ v  # [B, H, Lq, d]
        value = encoding.value_term(p, q_pos, k_pos, layer)
        return out if value is None else out + value


class SdpaBackend(Backend):
    name = "sdpa"
    supported_hooks = frozenset({"qk", "bias"})

    def attend(self, q, k, v, encoding, q_pos, k_pos, layer, causal):
        scale = encoding.logit_scale(q.shape[-1])
        bias = encoding.bias(q_pos, k_pos, layer)
        if bias is None and (not causal or q.shape[-2] == k.shape[-2]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)  # [B, H, L, d]
        if bias is None:  # queries after a memory: is_causal would align them to the first keys
            bias = torch.zeros(1, 1, q.shape[-2], k.shape[-2], dtype=q.dtype, device=q.device)  # [1, 1, Lq, Lk]
        mask = bias.to(q.dtype)  # [B', H, Lq, Lk]: 4-D keeps the fused kernel
        if causal:
            mask = mask.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, H, L, d]


BACKENDS: dict[str, type[Backend]] = {cls.name: cls for cls in (EagerBackend, SdpaBackend)}


def get_backend(name: str, encoding: Encoding | None = None) -> Backend:
    """A backend by name; `auto` takes the fastest one that runs every hook the encoding needs."""
    if name == "auto":
        if encoding is None:
            raise ValueError("backend=auto needs the encoding to choose for")
        needed = set(encoding.hooks) - {"embed"}
        name = "sdpa" if needed <= SdpaBackend.supported_hooks else "eager"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {['auto', *sorted(BACKENDS)]}")
    return BACKENDS[name]()


class Attention(nn.Module):
    """Multi-head self-attention that receives its positional encoding and backend."""

    def __init__(self, d_model: int, n_heads: int, layer: int, encoding: Encoding, backend: Backend,
                 causal: bool):
        super().__init__()
        self.n_heads, self.layer, self.causal = n_heads, layer, causal
        self.backend = backend
        self.encoding = [encoding]  # a list: shared with the model, registered there once
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, context: torch.Tensor | None = None,
                context_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, L, D] at pos [B', L]. Keys and values come from x, or from `context` [B, Lk, D]
        at context_pos [B', Lk] when given (a memory followed by x, queries aligned to its end)."""
        b, length, d_model = x.shape
        encoding = self.encoding[0]
        if context is None:
            q, k, v = self.qkv(x).view(b, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)  # 3 x [B, H, L, d]
            context_pos = pos
        else:
            w_q, w_kv = self.qkv.weight.split([d_model, 2 * d_model])
            q = F.linear(x, w_q).view(b, length, self.n_heads, -1).transpose(1, 2)  # [B, H, L, d]
            k, v = F.linear(context, w_kv).view(b, context.shape[1], 2, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        if "qk" in encoding.hooks:
            q, k = encoding.qk(q, k, pos, context_pos, self.layer)
        y = self.backend.attend(q, k, v, encoding, pos, context_pos, self.layer, self.causal)  # [B, H, L, d]
        return self.out(y.transpose(1, 2).reshape(b, length, d_model))  # [B, L, D]
