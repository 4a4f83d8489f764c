"""PyTorch's fused CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) with a bias: its own
forward and backward, the causal flag skipping the upper triangle, the bias as its mask. A bias
that needs a gradient (t5, kerple, fire) gets a blockwise backward; a chunk of queries against
its key prefix runs as two fused calls merged by their log-sum-exps."""
from __future__ import annotations

import torch

GRAD_BLOCK = 128  # queries per block in the bias-gradient backward
FUSED_CPU_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FUSED_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def sum_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a gradient over the dimensions its input was broadcast along."""
    dims = [i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1]
    return grad.sum(dims, keepdim=True) if dims else grad


class FusedBiasAttention(torch.autograd.Function):
    """softmax(q k^T * scale + bias [+ causal]) v on CPU with the fused flash kernel.

    Forward and, for a bias without gradient, backward are the fused kernel's own, with the
    causal flag (upper triangle skipped) and the bias as its mask. A bias that needs a
    gradient (t5, kerple, fire) gets a blockwise backward: per block of queries, against its
    key prefix when causal, P = exp(S - logsumexp) is rebuilt and dS = P (dP - rowsum(dO O))
    gives dq, dk, dv and the bias gradient."""

    @staticmethod
    def forward(ctx, q, k, v, bias, causal: bool, scale: float):
        mask = bias.to(torch.promote_types(q.dtype, torch.float32))  # a bf16 mask would round large biases
        out, lse = FUSED_CPU_FORWARD(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)  # [B, H, L, d], [B, H, L]
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.causal, ctx.scale, ctx.bias_shape, ctx.bias_dtype = causal, scale, bias.shape, bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if not ctx.needs_input_grad[3]:
            dq, dk, dv = FUSED_CPU_BACKWARD(grad_out, q, k, v, out, lse, 0.0, ctx.causal, attn_mask=mask,
                                            scale=ctx.scale)
            return dq, dk, dv, None, None, None
        dq, dk, dv, dbias = blockwise_backward(q, k, v, mask, out, lse, grad_out, ctx.causal, ctx.scale)
        return dq, dk, dv, sum_to(dbias, ctx.bias_shape).to(ctx.bias_dtype), None, None


def blockwise_backward(q, k, v, bias, out, lse, grad_out, causal: bool, scale: float):
    """Gradients of attention with a bias, one block of GRAD_BLOCK queries at a time, in float32
    at least. q, k, v, out, grad_out: [B, H, L, d]; bias: [B', H', L, L]; lse: [B, H, L]."""
    dtype = q.dtype
    compute = torch.promote_types(dtype, torch.float32)
    q, k, v, out, grad_out = (t.to(compute) for t in (q, k, v, out, grad_out))
    length = q.shape[-2]
    q = q * scale
    rowdot = (grad_out * out).sum(-1, keepdim=True)  # rowsum(dO * O): [B, H, L, 1]
    # one more column each, so that the matmuls give S - logsumexp and dP - rowdot directly
    q_lse = torch.cat([q, -lse[..., None].to(compute)], dim=-1)  # [B, H, L, d + 1]
    k_one = torch.cat([k, torch.ones_like(k[..., :1])], dim=-1)  # [B, H, L, d + 1]
    g_dot = torch.cat([grad_out, -rowdot], dim=-1)  # [B, H, L, d + 1]
    v_one = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # [B, H, L, d + 1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    shared = bias.shape[0] == 1  # then summed over the batch as it goes
    dbias = q.new_zeros(1 if shared else q.shape[0], q.shape[1], length, length)  # [B', H, L, L]
    above = torch.ones(GRAD_BLOCK, GRAD_BLOCK, dtype=torch.bool, device=q.device).triu(1)
    for start in range(0, length, GRAD_BLOCK):
        stop = min(length, start + GRAD_BLOCK)
        end = stop if causal else length
        p = torch.matmul(q_lse[:, :, start:stop], k_one[:, :, :end].transpose(-1, -2))  # S - lse: [B, H, b, end]
        p.add_(bias[:, :, start:stop, :end]).exp_()  # P
        if causal:
            p[..., start:stop].masked_fill_(above[: stop - start, : stop - start], 0.0)
        ds = torch.matmul(g_dot[:, :, start:stop], v_one[:, :, :end].transpose(-1, -2))  # dP - rowdot
        ds.mul_(p)  # dS = P (dP - rowdot): [B, H, b, end]
        dbias[:, :, start:stop, :end] += ds.sum(0, keepdim=True) if shared else ds
        dq[:, :, start:stop] = torch.matmul(ds, k[:, :, :end]).mul_(scale)
        dk[:, :, :end] += torch.matmul(ds.transpose(-1, -2), q[:, :, start:stop])  # q holds the scale
        dv[:, :, :end] += torch.matmul(p.transpose(-1, -2), grad_out[:, :, start:stop])
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), dbias


def fused_causal_block(q, k, v, bias, scale: float) -> torch.Tensor:
    """Queries that are the last Lq of Lk keys (a chunk against its prefix), forward only: the keys
    before the chunk, all visible, and the chunk's own square with the causal flag, as two fused
    calls merged by their log-sum-exps, so no -inf mask is written and no upper triangle computed.
    q: [B, H, Lq, d], k, v: [B, H, Lk, d], bias: [B', H, Lq, Lk] or None -> [B, H, Lq, d]."""
    split = k.shape[-2] - q.shape[-2]
    mask = None if bias is None else bias.to(torch.promote_types(q.dtype, torch.float32))

    def part(keys: slice):
        return None if mask is None else mask[..., keys]

    out, lse = FUSED_CPU_FORWARD(q, k[:, :, split:], v[:, :, split:], 0.0, True, attn_mask=part(slice(split, None)),
                                 scale=scale)  # [B, H, Lq, d], [B, H, Lq]
    if split == 0:
        return out
    before, lse_before = FUSED_CPU_FORWARD(q, k[:, :, :split], v[:, :, :split], 0.0, False,
                                           attn_mask=part(slice(None, split)), scale=scale)
    top = torch.maximum(lse, lse_before)
    weight, weight_before = (lse - top).exp()[..., None], (lse_before - top).exp()[..., None]  # [B, H, Lq, 1]
    return ((out * weight + before * weight_before) / (weight + weight_before)).to(q.dtype)


def fused_cpu_ok(q: torch.Tensor, bias: torch.Tensor | None = None, v: torch.Tensor | None = None) -> bool:
    """The fused CPU flash kernel takes this call: CPU tensors, a 4-D bias or none, v (when given) as wide as q
    and k (its one head size: q and k may be wider, pope), this torch has the kernel."""
    return (FUSED_CPU_FORWARD is not None and FUSED_CPU_BACKWARD is not None and q.device.type == "cpu"
            and (bias is None or bias.dim() == 4) and q.dtype in (torch.float32, torch.float64, torch.bfloat16)
            and (v is None or v.shape[-1] == q.shape[-1]))
