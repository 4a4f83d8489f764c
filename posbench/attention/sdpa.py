"""The sdpa backend: PyTorch's scaled_dot_product_attention. Runs `qk`, `query_scale`, `decay` and `bias`.

- No bias: the fused kernel with `is_causal`, no mask.
- A decay (c_i - c_j, rank one in causal layout): one more column on q (ones), k ((c_ref - c_j) / scale)
  and v (zeros, dropped from the output), so it rides the same mask-free kernel; c_ref, the level of
  the call's first query, keeps the column small, and softmax ignores the per-query constant it adds.
  A layer evaluated in blocks makes the room once (`decay_room`) and each block writes its keys' column.
  On CUDA zero columns follow it up to a multiple of 8 (`decay_columns`): the fused CUDA kernels take head
  sizes divisible by 4 in float32 (8 in half precision), and a head of 17 fell to the math kernel, which
  forms [B, H, Lq, Lk].
- A sliding window: its band as -inf in the mask (with the bias, if any).
- A bias on CPU: the fused flash kernel with the causal flag and the bias as its mask (posbench.attention
  .fused_cpu); elsewhere a 4-D float mask (a 3-D one would leave the fused kernels).
- q and k wider than v (pope's 2d): torch's kernels that take two head sizes; the fused CPU one, which takes
  one, is left for the mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from posbench.attention.backend import Backend, call_bias
from posbench.attention.context import AttentionCall, causal_mask
from posbench.attention.fused_cpu import FusedBiasAttention, fused_causal_block, fused_cpu_ok
from posbench.hooks import SDPA, backend_hooks


CUDA_HEAD_MULTIPLE = 8  # the fused CUDA kernels' head-size alignment: 4 in float32 on sm80+, 8 in half precision


def decay_columns(q: torch.Tensor) -> int:
    """The columns the decay adds to q, k and v: its own, then on CUDA zeros up to a multiple of 8."""
    return 1 + (-(q.shape[-1] + 1) % CUDA_HEAD_MULTIPLE if q.is_cuda else 0)


def with_decay_column(q, k, v, call: AttentionCall, scale: float, columns: int = 1):
    """q, k, v [B, H, L, d] -> [B, H, L, d + columns] whose scaled q.k carries c_ref - c_j: softmax as with
    c_i - c_j."""
    ref = call.q_levels[..., :1]  # [B|1, H, 1]: the level of the first query
    column = ((ref - call.k_levels) / scale).to(k.dtype)[..., None]  # [B|1, H, Lk, 1]
    return with_columns(q, k, v, column.expand(k.shape[0], -1, -1, -1), columns)


def with_columns(q, k, v, key_column: torch.Tensor, columns: int):
    """q, k, v [B, H, L, d] -> [B, H, L, d + columns]: the decay's column first (q: ones, k: key_column
    [B, H, Lk, 1], v: zeros), zeros after it."""
    q = torch.cat([q, torch.ones_like(q[..., :1]), q.new_zeros(*q.shape[:-1], columns - 1)], dim=-1)
    k = torch.cat([k, key_column.to(k.dtype), k.new_zeros(*k.shape[:-1], columns - 1)], dim=-1)
    v = torch.cat([v, v.new_zeros(*v.shape[:-1], columns)], dim=-1)
    return q, k, v


def write_decay_column(k, call: AttentionCall, scale: float) -> None:
    """Into the decay's column of k [B, H, Lk, d + columns] (a block's keys in a layer's decay_room): (c_ref - c_j)
    / scale."""
    k[..., -call.decay_room] = ((call.q_levels[..., :1] - call.k_levels) / scale).to(k.dtype)  # [B|1, H, Lk]


class SdpaBackend(Backend):
    name = SDPA
    supported_hooks = backend_hooks(name)

    def bakes_mask(self, q):
        return not fused_cpu_ok(q)  # the fused CPU kernel masks with its causal flag

    def decay_room(self, q, k, v):
        """q, k, v [B, H, L, d] -> [B, H, L, d + columns] once per layer (decay_columns): q's decay column ones,
        v's zeros, k's written by each block (its levels' reference is the block's first query), so blocks copy
        no keys; the padding columns zeros."""
        return with_columns(q, k, v, torch.zeros_like(k[..., :1]), decay_columns(q))  # [B, H, L, d + columns] each

    def attend(self, q, k, v, call):
        width = v.shape[-1] - call.decay_room  # the output's: q and k may be wider (pope)
        scale = call.encoding.logit_scale(q.shape[-1] - call.decay_room)
        if call.decay_room:
            write_decay_column(k, call, scale)
        elif call.k_levels is not None:
            q, k, v = with_decay_column(q, k, v, call, scale, decay_columns(q))
        bias, causal = call_bias(call), call.causal and not call.mask_in_bias
        if call.window is not None:  # the band as -inf in a 4-D mask
            visible = call.visible()  # [Lq, Lk]
            zeros = torch.zeros(1, 1, *visible.shape, dtype=q.dtype, device=q.device)  # [1, 1, Lq, Lk]
            bias, causal = (zeros if bias is None else bias).masked_fill(~visible, float("-inf")), False
        out = self.attend_columns(q, k, v, bias, causal, scale)
        return out[..., :width]  # [B, H, Lq, d]

    @staticmethod
    def attend_columns(q, k, v, bias, causal: bool, scale: float) -> torch.Tensor:
        square = q.shape[-2] == k.shape[-2]
        if bias is None and (not causal or square):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)  # [B, H, L, d]
        if bias is not None and (square or not causal) and fused_cpu_ok(q, bias, v):
            return FusedBiasAttention.apply(q, k, v, bias, causal, scale)  # [B, H, L, d]
        if causal and not torch.is_grad_enabled() and fused_cpu_ok(q, bias, v):
            return fused_causal_block(q, k, v, bias, scale)  # [B, H, Lq, d]
        if bias is None:  # queries after a memory: is_causal would align them to the first keys
            bias = torch.zeros(1, 1, q.shape[-2], k.shape[-2], dtype=q.dtype, device=q.device)  # [1, 1, Lq, Lk]
        mask = bias.to(q.dtype)  # [B', H, Lq, Lk]: 4-D keeps the fused kernel
        if causal:
            mask = mask.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [B, H, L, d]
