"""FIRE's attention in one Triton kernel (forward) and one (backward), flash style: each pair's bias is FIRE's MLP of
its normalised distance, computed in the tile, never formed as [B', H, L, L]. The formula is posbench.encodings.fire's:

    x_ij = g[|pos_i - pos_j|] * s_i,   g[d] = log(1 + c d),   s_i = 1 / (log(1 + c max(pos_i, L)) + eps)
    out_h = softmax_j(q_i . k_j * scale + b2_h + sum_u w2_hu relu(w1_u x_ij + b1_u)) v_h

g (per distance, [n]) and s (per query, [B', L]) come in as tensors, so c and L learn through them outside the
kernel: the backward adds each pair's d x * s_i to its distance's row (one row set per sequence and head, summed after)
and d x * g to its query's sum. The MLP's weights learn from two sums per head and hidden unit, A_hu = sum dS [unit
on] and X_hu = sum dS x [unit on], and sum dS (b2's): w2_hu's gradient is w1_u X_hu + b1_u A_hu, w1_u's
sum_h w2_hu X_hu, b1_u's sum_h w2_hu A_hu. Forward per block of queries (online softmax, each query's log-sum-exp
kept), backward per block of keys (dk and dv summed in the program, dq added atomically), as the relative bias
kernel (posbench.attention.relative_bias_kernel).
"""
from __future__ import annotations

import torch

from posbench.attention.triton_products import (INTERPRETED_BLOCKS, head_launch, head_rows, interpreted,
                                               softmax_block, softmax_block_grads, softmax_start, store_key_grads,
                                               store_rows, tl, triton)


def tiles(head_dim: int) -> tuple[int, int, int]:
    """Queries and keys per tile and warps for heads of `head_dim` features (padded to a power of 2): the GPU's,
    or smaller ones where Triton's interpreter runs the kernel."""
    if interpreted():
        return (*INTERPRETED_BLOCKS, 4)
    return launch_tiles(head_dim)


def launch_tiles(head_dim: int) -> tuple[int, int, int]:
    """tiles() on a GPU: the backward's unit loop keeps several [queries, keys] tiles alive, so 16 queries a tile.
    No register spills on sm_90 under Triton 3.6 (torch 2.11's) and 3.9 at heads of 16 features in float32 and
    bfloat16, nor at 32 (but 4 bytes in 3.6's float32 forward); at 64, 172-252 bytes in the float32 backward
    (scripts/kernel_resources.py). 64 queries by 32 keys spilled up to 1 KB a thread in the float32 backward."""
    return (16, 32, 4) if head_dim <= 16 else (16, 16, 4)


if triton is not None:
    @triton.jit
    def _normalised(g_ptr, s_ptr, qpos_ptr, kpos_ptr, pos_at, n_rows, offs_m, offs_n, in_m, in_n,
                    CAUSAL: tl.constexpr):
        """x of one tile (0 where query i does not see key j), where it does, each pair's distance and whether its
        row is read, g at the pairs and s at the queries: [BM, BN] each but s, [BM]."""
        seen = in_m[:, None] & in_n[None, :]
        if CAUSAL:
            seen = seen & (offs_n[None, :] <= offs_m[:, None])
        q_pos = tl.load(qpos_ptr + pos_at + offs_m, mask=in_m, other=0)  # [BM]
        k_pos = tl.load(kpos_ptr + pos_at + offs_n, mask=in_n, other=0)  # [BN]
        distance = tl.abs(q_pos[:, None] - k_pos[None, :])  # [BM, BN]
        in_rows = seen & (distance < n_rows)  # all of seen but past the rows' bound: no stray read
        g = tl.load(g_ptr + distance, mask=in_rows, other=0.0)  # [BM, BN]
        s = tl.load(s_ptr + pos_at + offs_m, mask=in_m, other=0.0)  # [BM]
        return g * s[:, None], seen, distance, in_rows, g, s

    @triton.jit
    def _mlp(x, w1_ptr, b1_ptr, w2_ptr, b2_ptr, head, WIDTH: tl.constexpr):
        """b2_h + sum_u w2_hu relu(w1_u x + b1_u), one hidden unit at a time: [BM, BN]."""
        bias = tl.zeros_like(x) + tl.load(b2_ptr + head)
        for unit in range(WIDTH):
            hidden = tl.maximum(tl.load(w1_ptr + unit) * x + tl.load(b1_ptr + unit), 0.0)
            bias += tl.load(w2_ptr + head * WIDTH + unit) * hidden
        return bias

    @triton.jit
    def _forward(q_ptr, k_ptr, v_ptr, g_ptr, s_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, qpos_ptr, kpos_ptr, out_ptr,
                 lse_ptr, length, heads, n_rows, pos_stride, scale, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                 WIDTH: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        row_block, batch_head = tl.program_id(0), tl.program_id(1)
        head, pos_at = batch_head % heads, (batch_head // heads) * pos_stride
        offs_m = row_block * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, DP)
        in_m, in_d = offs_m < length, offs_d < D
        base = batch_head.to(tl.int64) * length
        rows_m, inside_m = (base + offs_m[:, None]) * D + offs_d[None, :], in_m[:, None] & in_d[None, :]
        q = tl.load(q_ptr + rows_m, mask=inside_m, other=0.0)  # [BM, DP]
        top = tl.minimum((row_block + 1) * BM, length) if CAUSAL else length
        running_max, norm, acc = softmax_start(BM, DP)
        for start in range(0, top, BN):
            offs_n = start + tl.arange(0, BN)
            in_n = offs_n < length
            _, _, k, v = head_rows(k_ptr, v_ptr, base, offs_n, in_n, offs_d, in_d, D)  # [BN, DP] each
            x, seen, _, _, _, _ = _normalised(g_ptr, s_ptr, qpos_ptr, kpos_ptr, pos_at, n_rows, offs_m, offs_n,
                                              in_m, in_n, CAUSAL)
            bias = _mlp(x, w1_ptr, b1_ptr, w2_ptr, b2_ptr, head, WIDTH)
            running_max, norm, acc = softmax_block(q, k, v, bias, seen, running_max, norm, acc, scale, IEEE)
        store_rows(out_ptr, lse_ptr, rows_m, base + offs_m, in_m, inside_m, running_max, norm, acc)

    @triton.jit
    def _backward(q_ptr, k_ptr, v_ptr, g_ptr, s_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, qpos_ptr, kpos_ptr, dout_ptr,
                  lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, dg_ptr, dnorm_ptr, sums_ptr, length, heads, n_rows,
                  pos_stride, scale, CAUSAL: tl.constexpr, IEEE: tl.constexpr, PARAMS_GRAD: tl.constexpr,
                  WIDTH: tl.constexpr, WP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr):
        col_block, batch_head = tl.program_id(0), tl.program_id(1)
        head, pos_at = batch_head % heads, (batch_head // heads) * pos_stride
        offs_n = col_block * BN + tl.arange(0, BN)
        offs_d, offs_w = tl.arange(0, DP), tl.arange(0, WP)
        in_n, in_d = offs_n < length, offs_d < D
        base = batch_head.to(tl.int64) * length
        rows_n, inside_n, k, v = head_rows(k_ptr, v_ptr, base, offs_n, in_n, offs_d, in_d, D)  # [BN, DP] each
        dg_at = dg_ptr + batch_head.to(tl.int64) * n_rows  # this sequence's and head's rows
        dk = tl.zeros([BN, DP], tl.float32)
        dv = tl.zeros([BN, DP], tl.float32)
        on_sums = tl.zeros([WP], tl.float32)  # A_hu per unit, sum dS (b2's) at WIDTH
        x_sums = tl.zeros([WP], tl.float32)  # X_hu
        bottom = (col_block * BN // BM) * BM if CAUSAL else 0  # the first query block that sees these keys
        for start in range(bottom, length, BM):
            offs_m = start + tl.arange(0, BM)
            in_m = offs_m < length
            rows_m, inside_m, q, dout = head_rows(q_ptr, dout_ptr, base, offs_m, in_m, offs_d, in_d, D)  # [BM, DP]
            lse = tl.load(lse_ptr + base + offs_m, mask=in_m, other=0.0)
            delta = tl.load(delta_ptr + base + offs_m, mask=in_m, other=0.0)  # D = dO . O
            x, seen, distance, in_rows, g, s = _normalised(g_ptr, s_ptr, qpos_ptr, kpos_ptr, pos_at, n_rows, offs_m,
                                                           offs_n, in_m, in_n, CAUSAL)
            bias = _mlp(x, w1_ptr, b1_ptr, w2_ptr, b2_ptr, head, WIDTH)
            ds, dk, dv = softmax_block_grads(q, k, v, dout, lse, delta, bias, seen, dk, dv, dq_ptr, rows_m, inside_m,
                                             scale, IEEE)  # ds: d logit [BM, BN]
            if PARAMS_GRAD:
                ds_x = ds * x
                slope = tl.zeros_like(x)  # d bias / d x
                for unit in range(WIDTH):
                    w1 = tl.load(w1_ptr + unit)
                    on = w1 * x + tl.load(b1_ptr + unit) > 0  # [BM, BN]
                    at_unit = offs_w == unit
                    on_sums += tl.where(at_unit, tl.sum(tl.sum(tl.where(on, ds, 0.0), axis=1), axis=0), 0.0)
                    x_sums += tl.where(at_unit, tl.sum(tl.sum(tl.where(on, ds_x, 0.0), axis=1), axis=0), 0.0)
                    slope += tl.where(on, tl.load(w2_ptr + head * WIDTH + unit) * w1, 0.0)
                on_sums += tl.where(offs_w == WIDTH, tl.sum(tl.sum(ds, axis=1), axis=0), 0.0)
                dx = ds * slope  # [BM, BN]
                tl.atomic_add(dg_at + distance, dx * s[:, None], mask=in_rows)
                tl.atomic_add(dnorm_ptr + base + offs_m, tl.sum(dx * g, axis=1), mask=in_m)
        store_key_grads(dk_ptr, dv_ptr, rows_n, inside_n, dk, dv, scale)
        if PARAMS_GRAD:
            tl.atomic_add(sums_ptr + head * 2 * WP + offs_w, on_sums, mask=offs_w <= WIDTH)
            tl.atomic_add(sums_ptr + head * 2 * WP + WP + offs_w, x_sums, mask=offs_w < WIDTH)


class _FireAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, s, w1, b1, w2, b2, q_pos, k_pos, scale: float, causal: bool):
        # q, k, v: [B, H, L, d]; g: [n]; s: [B', L]; w1, b1: [W]; w2: [H, W]; b2: [H]; q_pos, k_pos: [B', L] int32
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        batch, heads, length, _ = q.shape
        tables = [t.float().contiguous() for t in (g, s, w1, b1, w2, b2)]
        out = torch.empty_like(q)
        lse = q.new_empty(batch, heads, length, dtype=torch.float32)
        launch = {**head_launch(q, tiles), "IEEE": q.dtype == torch.float32}
        pos_stride = 0 if q_pos.shape[0] == 1 else length
        _forward[(triton.cdiv(length, launch["BM"]), batch * heads)](
            q, k, v, *tables, q_pos, k_pos, out, lse, length, heads, g.shape[0], pos_stride, scale, CAUSAL=causal,
            WIDTH=w1.shape[0], **launch)
        ctx.save_for_backward(q, k, v, *tables, q_pos, k_pos, out, lse)
        ctx.scale, ctx.causal = scale, causal
        ctx.dtypes = [t.dtype for t in (g, s, w1, b1, w2, b2)]
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, g, s, w1, b1, w2, b2, q_pos, k_pos, out, lse = ctx.saved_tensors
        batch, heads, length, _ = q.shape
        width = w1.shape[0]
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # D = dO . O: [B, H, L]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        params_grad = any(ctx.needs_input_grad[3:9])
        wp = triton.next_power_of_2(width + 1)  # the units and b2's sum
        dg = torch.zeros(batch * heads, g.shape[0], device=q.device) if params_grad else g  # [B H, n]
        dnorm = torch.zeros(batch, heads, length, device=q.device) if params_grad else s  # [B, H, L]
        sums = torch.zeros(heads, 2, wp, device=q.device) if params_grad else g  # [H, (A | X), WP]
        launch = {**head_launch(q, tiles), "IEEE": q.dtype == torch.float32}
        _backward[(triton.cdiv(length, launch["BN"]), batch * heads)](
            q, k, v, g, s, w1, b1, w2, b2, q_pos, k_pos, dout, lse, delta, dq, dk, dv, dg, dnorm, sums, length, heads,
            g.shape[0], 0 if q_pos.shape[0] == 1 else length, ctx.scale, CAUSAL=ctx.causal, PARAMS_GRAD=params_grad,
            WIDTH=width, WP=wp, **launch)
        if not params_grad:
            return dq.to(q.dtype), dk, dv, *[None] * 10
        on, on_x, total = sums[:, 0, :width], sums[:, 1, :width], sums[:, 0, width]  # [H, W], [H, W], [H]
        dnorm = dnorm.sum(1)  # [B, L]
        grads = (dg.sum(0), dnorm.sum(0, keepdim=True) if s.shape[0] == 1 else dnorm, (w2 * on_x).sum(0),
                 (w2 * on).sum(0), w1 * on_x + b1 * on, total)
        grads = [grad.to(dtype) if needed else None
                 for grad, dtype, needed in zip(grads, ctx.dtypes, ctx.needs_input_grad[3:9])]
        return dq.to(q.dtype), dk, dv, *grads, None, None, None, None


def fire_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, distances: torch.Tensor,
                   normalisers: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                   q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """softmax(q . k * scale + FIRE's bias) v in Triton: q, k, v [B, H, L, d] (queries are the keys); distances
    [n], log(1 + c d) at every distance d the positions span; normalisers [B', L], each query's 1 / psi(max(pos_i, L));
    the MLP's w1 and b1 [W] (its first layer's single input), w2 [H, W] and b2 [H]; positions q_pos, k_pos [B', L]
    (B' = 1 or B) -> [B, H, L, d]."""
    if triton is None:
        raise ValueError("FIRE's kernel needs Triton (it comes with CUDA builds of torch)")
    if q_pos.shape != k_pos.shape or normalisers.shape != q_pos.shape:  # one stride reads them all
        raise ValueError(f"FIRE's kernel takes the queries' and keys' positions and the normalisers alike, [B', L]; "
                         f"got {list(q_pos.shape)}, {list(k_pos.shape)} and {list(normalisers.shape)}")
    q_pos, k_pos = (p.to(torch.int32).contiguous() for p in (q_pos, k_pos))
    return _FireAttention.apply(q, k, v, distances, normalisers, w1, b1, w2, b2, q_pos, k_pos, scale, causal)
