"""CoPE's attention in one Triton kernel (forward) and one (backward), flash style: no [B, H, L, L] tensor is
formed. The formula is posbench.encodings.cope's (CoPE alone, whose gates read the scaled logits s):

    g_ij = sigmoid(s_ij), 0 where key j is hidden          s = q . k * scale
    p_ij = min(sum_{t >= j} g_it, rows - 1),  f = floor p,  w = p - f
    logit_ij = s_ij + z_i[f] + w (z_i[f + 1] - z_i[f])    z = q . e^T, e already times the scale

Forward, per block of queries: the key blocks from the last to the first, so that p is the running sum of the
gates of the later blocks (`later`) plus the block's reversed cumulative sum; online softmax as flash attention.
It keeps per query the log-sum-exp and the sum of all its gates G.
Backward, per block of queries: the key blocks from the first, p = G - the gates before j. The gradient of
the logits ds = P (dO . v - D) flows to s directly, to z (scattered into dz at f and f + 1) and through p to the
gates: dg_t = sum_{j <= t} dp_j, a running prefix sum, dp = ds (z[f + 1] - z[f]), 0 where w = 0 (as the eager
backward). dk and dv are added across the query blocks atomically, and dz too: a row's pairs share positions.
z and dz, [B, H, L, rows + 1] in float32, are formed outside (matrix products with e).
"""
from __future__ import annotations

import torch

from posbench.attention.triton_products import (INTERPRETED_BLOCKS, dot, head_launch, head_rows, interpreted,
                                               softmax_start, store_rows, tl, triton)


def tiles(head_dim: int) -> tuple[int, int, int]:
    """Queries and keys per tile and warps for heads of `head_dim` features (padded to a power of 2): the GPU's,
    or smaller ones where Triton's interpreter runs the kernel."""
    if interpreted():
        return (*INTERPRETED_BLOCKS, 4)
    return launch_tiles(head_dim)


def launch_tiles(head_dim: int) -> tuple[int, int, int]:
    """tiles() on a GPU: no register spills on sm_90 up to 32 features, few at 64 (scripts/kernel_resources.py)."""
    return (32 if head_dim <= 32 else 16), 16, 4


if triton is not None:
    @triton.jit
    def _forward(q_ptr, k_ptr, v_ptr, z_ptr, out_ptr, lse_ptr, total_ptr, length, rows, scale,
                 CAUSAL: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, ZW: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):
        row_block, head = tl.program_id(0), tl.program_id(1)  # head: batch x heads, flattened
        offs_m = row_block * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, DP)
        in_m, in_d = offs_m < length, offs_d < D
        base = head.to(tl.int64) * length
        rows_m, inside_m = (base + offs_m[:, None]) * D + offs_d[None, :], in_m[:, None] & in_d[None, :]
        q = tl.load(q_ptr + rows_m, mask=inside_m, other=0.0)  # [BM, DP]
        z_rows = z_ptr + (base + offs_m[:, None]) * ZW  # each query's z: [BM, 1] pointers
        top = tl.minimum((row_block + 1) * BM, length) if CAUSAL else length
        blocks = tl.cdiv(top, BN)
        running_max, norm, acc = softmax_start(BM, DP)
        later = tl.zeros([BM], tl.float32)  # the gates of the key blocks already done (after this one)
        for step in range(0, blocks):
            start = (blocks - 1 - step) * BN
            offs_n = start + tl.arange(0, BN)
            in_n = offs_n < length
            _, _, k, v = head_rows(k_ptr, v_ptr, base, offs_n, in_n, offs_d, in_d, D)  # [BN, DP] each
            s = dot(q, tl.trans(k), IEEE) * scale  # [BM, BN]
            seen = in_m[:, None] & in_n[None, :]
            if CAUSAL:
                seen = seen & (offs_n[None, :] <= offs_m[:, None])
            gates = tl.where(seen, tl.sigmoid(s), 0.0)
            p = later[:, None] + tl.cumsum(gates, axis=1, reverse=True)  # sum_{t >= j} g_t
            later += tl.sum(gates, axis=1)
            p = tl.minimum(p, rows - 1.0)
            floor = p.to(tl.int32)  # p >= 0
            weight = p - floor.to(tl.float32)
            below = tl.load(z_rows + floor, mask=seen, other=0.0)  # z[f]
            above = tl.load(z_rows + floor + 1, mask=seen, other=0.0)  # z[f + 1]
            logits = tl.where(seen, s + below + weight * (above - below), float("-inf"))
            new_max = tl.maximum(running_max, tl.max(logits, axis=1))
            new_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing seen yet
            shrink = tl.exp(running_max - new_max)
            probs = tl.exp(logits - new_max[:, None])  # [BM, BN]
            norm = norm * shrink + tl.sum(probs, axis=1)
            acc = acc * shrink[:, None] + dot(probs, v, IEEE)
            running_max = new_max
        store_rows(out_ptr, lse_ptr, rows_m, base + offs_m, in_m, inside_m, running_max, norm, acc)
        tl.store(total_ptr + base + offs_m, later, mask=in_m)

    @triton.jit
    def _backward(q_ptr, k_ptr, v_ptr, z_ptr, dout_ptr, lse_ptr, total_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr,
                  dz_ptr, length, rows, scale, CAUSAL: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr,
                  DP: tl.constexpr, ZW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        row_block, head = tl.program_id(0), tl.program_id(1)
        offs_m = row_block * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, DP)
        in_m, in_d = offs_m < length, offs_d < D
        base = head.to(tl.int64) * length
        rows_m, inside_m, q, dout = head_rows(q_ptr, dout_ptr, base, offs_m, in_m, offs_d, in_d, D)  # [BM, DP]
        lse = tl.load(lse_ptr + base + offs_m, mask=in_m, other=0.0)
        total = tl.load(total_ptr + base + offs_m, mask=in_m, other=0.0)  # G: every gate of the row
        delta = tl.load(delta_ptr + base + offs_m, mask=in_m, other=0.0)  # D = dO . O
        z_rows = z_ptr + (base + offs_m[:, None]) * ZW
        dz_rows = dz_ptr + (base + offs_m[:, None]) * ZW
        top = tl.minimum((row_block + 1) * BM, length) if CAUSAL else length
        earlier = tl.zeros([BM], tl.float32)  # the gates of the key blocks before this one
        dp_earlier = tl.zeros([BM], tl.float32)  # and their dp
        dq = tl.zeros([BM, DP], tl.float32)
        for start in range(0, top, BN):
            offs_n = start + tl.arange(0, BN)
            in_n = offs_n < length
            rows_n, inside_n, k, v = head_rows(k_ptr, v_ptr, base, offs_n, in_n, offs_d, in_d, D)  # [BN, DP] each
            s = dot(q, tl.trans(k), IEEE) * scale  # [BM, BN]
            dpv = dot(dout, tl.trans(v), IEEE)  # dO . v: [BM, BN]
            seen = in_m[:, None] & in_n[None, :]
            if CAUSAL:
                seen = seen & (offs_n[None, :] <= offs_m[:, None])
            gates = tl.where(seen, tl.sigmoid(s), 0.0)
            p = total[:, None] - (earlier[:, None] + tl.cumsum(gates, axis=1) - gates)  # G - sum_{t < j} g_t
            earlier += tl.sum(gates, axis=1)
            p = tl.minimum(tl.maximum(p, 0.0), rows - 1.0)
            floor = p.to(tl.int32)
            weight = p - floor.to(tl.float32)
            below = tl.load(z_rows + floor, mask=seen, other=0.0)
            above = tl.load(z_rows + floor + 1, mask=seen, other=0.0)
            slope = above - below
            probs = tl.where(seen, tl.exp(s + below + weight * slope - lse[:, None]), 0.0)  # P: [BM, BN]
            ds = probs * (dpv - delta[:, None])  # d logit
            tl.atomic_add(dz_rows + floor, ds * (1.0 - weight), mask=seen)
            tl.atomic_add(dz_rows + floor + 1, ds * weight, mask=seen)
            dp = tl.where(weight > 0.0, ds * slope, 0.0)
            dgates = dp_earlier[:, None] + tl.cumsum(dp, axis=1)  # sum_{j <= t} dp_j
            dp_earlier += tl.sum(dp, axis=1)
            dscore = (ds + dgates * gates * (1.0 - gates)) * scale  # d(q . k)
            dq += dot(dscore, k, IEEE)
            dk = dot(tl.trans(dscore), q, IEEE)  # [BN, DP]
            dv = dot(tl.trans(probs), dout, IEEE)
            tl.atomic_add(dk_ptr + rows_n, dk, mask=inside_n)
            tl.atomic_add(dv_ptr + rows_n, dv, mask=inside_n)
        tl.store(dq_ptr + rows_m, dq, mask=inside_m)


class _CoPEAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, e, scale: float, causal: bool):
        # q, k, v: [B, H, L, d]; e: [rows + 1, d] float32, times the scale, its last row zero
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        batch, heads, length, _ = q.shape
        rows = e.shape[0] - 1
        z = (q.to(e.dtype) @ e.T).contiguous()  # [B, H, L, rows + 1]
        out = torch.empty_like(q)
        lse, total = (q.new_empty(batch, heads, length, dtype=torch.float32) for _ in range(2))
        launch = head_launch(q, tiles)
        grid = (triton.cdiv(length, launch["BM"]), batch * heads)
        _forward[grid](q, k, v, z, out, lse, total, length, rows, scale, CAUSAL=causal, IEEE=q.dtype == torch.float32,
                       ZW=rows + 1, **launch)
        ctx.save_for_backward(q, k, v, e, z, out, lse, total)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, e, z, out, lse, total = ctx.saved_tensors
        batch, heads, length, _ = q.shape
        rows = e.shape[0] - 1
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # D = dO . O: [B, H, L]
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = (torch.zeros(q.shape, dtype=torch.float32, device=q.device) for _ in range(2))
        dz = torch.zeros_like(z)  # [B, H, L, rows + 1]
        launch = head_launch(q, tiles)
        grid = (triton.cdiv(length, launch["BM"]), batch * heads)
        _backward[grid](q, k, v, z, dout, lse, total, delta, dq, dk, dv, dz, length, rows, ctx.scale,
                        CAUSAL=ctx.causal, IEEE=q.dtype == torch.float32, ZW=rows + 1, **launch)
        dq += dz @ e  # through z = q . e^T
        de = dz.flatten(0, -2).T @ q.flatten(0, -2).to(e.dtype)  # [rows + 1, d]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), de, None, None


def cope_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor, scale: float,
                   causal: bool) -> torch.Tensor:
    """softmax(s + r) v with CoPE's r, in Triton: q, k, v [B, H, L, d] (queries are the keys), e [rows + 1, d]
    (float32, times the scale, a zero last row) -> [B, H, L, d]."""
    if triton is None:
        raise ValueError("CoPE's kernel needs Triton (it comes with CUDA builds of torch)")
    return _CoPEAttention.apply(q, k, v, e, scale, causal)
