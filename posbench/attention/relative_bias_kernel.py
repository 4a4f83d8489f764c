"""A relative bias's attention in one Triton kernel (forward) and one (backward), flash style: the bias of every pair
is looked up in rows of the bias per offset i - j, never formed as [B', H, L, L]. The formula is the bias hook's, for
an encoding whose bias depends on i - j alone (Encoding.bias_relative: kerple, t5, sandwich):

    out_h = softmax_j(q_i . k_j * scale + rows_h[pos_i - pos_j - first]) v_h

rows [H, n] holds the bias of the offsets first .. first + n - 1, which the positions span; a learned bias (kerple's
r1 and r2, t5's table) gets its gradient through them. Forward, per block of queries: the key blocks up to the
diagonal, online softmax as flash attention; it keeps each query's log-sum-exp. Backward, per block of keys: the
query blocks from the diagonal, dk and dv summed in the program, dq added atomically, and each pair's dS added to its
offset's row (one row set per sequence, summed after: the sequences do not contend).
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
    """tiles() on a GPU: no register spills on sm_90 up to 32 features under Triton 3.6 (torch 2.11's) and 3.9, in
    float32 and bfloat16, nor at 64 in bfloat16 (scripts/kernel_resources.py)."""
    if head_dim <= 16:
        return 64, 32, 8
    return (32, 32, 8) if head_dim <= 32 else (32, 16, 8)


if triton is not None:
    @triton.jit
    def _bias(rows_ptr, qpos_ptr, kpos_ptr, head, pos_at, n_rows, first, offs_m, offs_n, in_m, in_n,
              CAUSAL: tl.constexpr):
        """The bias of one tile, 0 where query i does not see key j, with where it does and each pair's row
        index: [BM, BN] each."""
        seen = in_m[:, None] & in_n[None, :]
        if CAUSAL:
            seen = seen & (offs_n[None, :] <= offs_m[:, None])
        q_pos = tl.load(qpos_ptr + pos_at + offs_m, mask=in_m, other=0)  # [BM]
        k_pos = tl.load(kpos_ptr + pos_at + offs_n, mask=in_n, other=0)  # [BN]
        index = q_pos[:, None] - k_pos[None, :] - first  # [BM, BN]
        in_rows = seen & (index >= 0) & (index < n_rows)  # all of seen but past the rows' bound: no stray read
        bias = tl.load(rows_ptr + head * n_rows + index, mask=in_rows, other=0.0)  # [BM, BN]
        return bias, seen, index, in_rows

    @triton.jit
    def _forward(q_ptr, k_ptr, v_ptr, rows_ptr, qpos_ptr, kpos_ptr, out_ptr, lse_ptr, length, heads, n_rows, first,
                 pos_stride, scale, CAUSAL: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):
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
            bias, seen, _, _ = _bias(rows_ptr, qpos_ptr, kpos_ptr, head, pos_at, n_rows, first, offs_m, offs_n,
                                     in_m, in_n, CAUSAL)
            running_max, norm, acc = softmax_block(q, k, v, bias, seen, running_max, norm, acc, scale, IEEE)
        store_rows(out_ptr, lse_ptr, rows_m, base + offs_m, in_m, inside_m, running_max, norm, acc)

    @triton.jit
    def _backward(q_ptr, k_ptr, v_ptr, rows_ptr, qpos_ptr, kpos_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr,
                  dv_ptr, drows_ptr, length, heads, n_rows, first, pos_stride, scale, CAUSAL: tl.constexpr,
                  IEEE: tl.constexpr, ROWS_GRAD: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr):
        col_block, batch_head = tl.program_id(0), tl.program_id(1)
        head, pos_at = batch_head % heads, (batch_head // heads) * pos_stride
        offs_n = col_block * BN + tl.arange(0, BN)
        offs_d = tl.arange(0, DP)
        in_n, in_d = offs_n < length, offs_d < D
        base = batch_head.to(tl.int64) * length
        rows_n, inside_n, k, v = head_rows(k_ptr, v_ptr, base, offs_n, in_n, offs_d, in_d, D)  # [BN, DP] each
        drows_at = drows_ptr + batch_head.to(tl.int64) * n_rows  # this sequence's and head's rows
        dk = tl.zeros([BN, DP], tl.float32)
        dv = tl.zeros([BN, DP], tl.float32)
        bottom = (col_block * BN // BM) * BM if CAUSAL else 0  # the first query block that sees these keys
        for start in range(bottom, length, BM):
            offs_m = start + tl.arange(0, BM)
            in_m = offs_m < length
            rows_m, inside_m, q, dout = head_rows(q_ptr, dout_ptr, base, offs_m, in_m, offs_d, in_d, D)  # [BM, DP]
            lse = tl.load(lse_ptr + base + offs_m, mask=in_m, other=0.0)
            delta = tl.load(delta_ptr + base + offs_m, mask=in_m, other=0.0)  # D = dO . O
            bias, seen, index, in_rows = _bias(rows_ptr, qpos_ptr, kpos_ptr, head, pos_at, n_rows, first, offs_m,
                                               offs_n, in_m, in_n, CAUSAL)
            ds, dk, dv = softmax_block_grads(q, k, v, dout, lse, delta, bias, seen, dk, dv, dq_ptr, rows_m, inside_m,
                                             scale, IEEE)  # ds: d logit [BM, BN]
            if ROWS_GRAD:
                tl.atomic_add(drows_at + index, ds, mask=in_rows)
        store_key_grads(dk_ptr, dv_ptr, rows_n, inside_n, dk, dv, scale)


class _RelativeBiasAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rows, q_pos, k_pos, first: int, scale: float, causal: bool):
        # q, k, v: [B, H, L, d]; rows: [H, n] (float32); q_pos, k_pos: [B', L] int32, B' = 1 or B
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        batch, heads, length, _ = q.shape
        flat_rows = rows.float().contiguous()
        out = torch.empty_like(q)
        lse = q.new_empty(batch, heads, length, dtype=torch.float32)
        launch = {**head_launch(q, tiles), "IEEE": q.dtype == torch.float32}
        pos_stride = 0 if q_pos.shape[0] == 1 else length
        _forward[(triton.cdiv(length, launch["BM"]), batch * heads)](
            q, k, v, flat_rows, q_pos, k_pos, out, lse, length, heads, rows.shape[1], first, pos_stride, scale,
            CAUSAL=causal, **launch)
        ctx.save_for_backward(q, k, v, flat_rows, q_pos, k_pos, out, lse)
        ctx.first, ctx.scale, ctx.causal, ctx.rows_dtype = first, scale, causal, rows.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, rows, q_pos, k_pos, out, lse = ctx.saved_tensors
        batch, heads, length, _ = q.shape
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # D = dO . O: [B, H, L]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        rows_grad = ctx.needs_input_grad[3]
        drows = torch.zeros(batch, *rows.shape, device=q.device) if rows_grad else rows  # [B, H, n]
        launch = {**head_launch(q, tiles), "IEEE": q.dtype == torch.float32}
        _backward[(triton.cdiv(length, launch["BN"]), batch * heads)](
            q, k, v, rows, q_pos, k_pos, dout, lse, delta, dq, dk, dv, drows, length, heads, rows.shape[1],
            ctx.first, 0 if q_pos.shape[0] == 1 else length, ctx.scale, CAUSAL=ctx.causal, ROWS_GRAD=rows_grad,
            **launch)
        drows = drows.sum(0).to(ctx.rows_dtype) if rows_grad else None  # [H, n]
        return dq.to(q.dtype), dk, dv, drows, None, None, None, None, None


def relative_bias_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                            q_pos: torch.Tensor, k_pos: torch.Tensor, first: int, scale: float,
                            causal: bool) -> torch.Tensor:
    """softmax(q . k * scale + rows[pos_i - pos_j - first]) v in Triton: q, k, v [B, H, L, d] (queries are the
    keys), rows [H, n] covering every offset of the positions q_pos, k_pos [B', L] (B' = 1 or B) -> [B, H, L, d]."""
    if triton is None:
        raise ValueError("the relative bias kernel needs Triton (it comes with CUDA builds of torch)")
    if q_pos.shape != k_pos.shape:  # one stride reads both
        raise ValueError(f"the relative bias kernel takes the queries' and keys' positions alike, [B', L]; got "
                         f"{list(q_pos.shape)} and {list(k_pos.shape)}")
    q_pos, k_pos = (p.to(torch.int32).contiguous() for p in (q_pos, k_pos))
    return _RelativeBiasAttention.apply(q, k, v, rows, q_pos, k_pos, first, scale, causal)
