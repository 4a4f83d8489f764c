"""DAPE v1's attention in one Triton kernel (forward) and one (backward), flash style: no [B, H, L, L] tensor of
the batch is formed. The formula is posbench.encodings.dape's, causal:

    A_h = S_h + B_h + f([S; B])_h,   f = W2 LeakyReLU(W1 [S; B] + b1) + b2 at every pair (i, j)
    out_h = softmax_j(A_h) v_h        S = q . k * scale, B the base's bias (none for rope and nope: f reads S)

f mixes the heads, so one program holds every head of a block of queries ([H, BM, BN] tiles) and walks its key
blocks; the network runs one hidden unit at a time (a [BM, BN] tile each), so the hidden layer is never stored.
Backward computes f again to get the probabilities, then once more for the gradients: dA = P (dO . v - D) goes to
S and B directly and through the network; the weights' gradients are summed per program and added atomically at
its end, as are dk, dv and the bias's gradient (a bias shared by the batch gets every sequence's).
"""
from __future__ import annotations

import torch

from posbench.attention.triton_products import INTERPRETED_BLOCKS, dot, interpreted, tl, triton

TILE_ELEMENTS = 1024  # of the largest [heads, keys, features] tile a program holds: no register spills on sm_90
                      # at 4 heads of 16 features under Triton 3.6 and 3.9 (2048 spilled under 3.6)


def tiles(heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """Queries and keys per tile, and the forward's and backward's warps, for `heads` heads of `head_dim` features
    (both padded to the kernels' powers of 2): the GPU's, or smaller ones where Triton's interpreter runs the
    kernel."""
    if interpreted():
        return (*INTERPRETED_BLOCKS, 4, 4)
    return launch_tiles(heads, head_dim)


def launch_tiles(heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """tiles() on a GPU: the key tiles [heads, keys, features] within TILE_ELEMENTS, at least 16 keys (the
    products' least), more warps where they are larger (scripts/kernel_resources.py)."""
    keys = max(16, min(32, TILE_ELEMENTS // (heads * head_dim)))
    warps = 4 if heads * keys * head_dim <= TILE_ELEMENTS else 8
    return 16, keys, warps, 8  # the backward, twice the forward's tiles: 8 warps (16 cap a thread at 128 registers)


if triton is not None:
    @triton.jit
    def _scores(q, k_ptr, bias_ptr, offs_h, in_h, heads_at, bias_at, offs_m, offs_n, in_m, length,
                scale, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        """S [HP, BM, BN], B (zeros without a bias) and where query i sees key j [BM, BN], for one key block."""
        offs_d = tl.arange(0, DP)
        in_n = offs_n < length
        k = tl.load(k_ptr + (heads_at[:, None, None] + offs_n[None, :, None]) * D + offs_d[None, None, :],
                    mask=in_h[:, None, None] & in_n[None, :, None] & (offs_d < D)[None, None, :], other=0.0)
        s = dot(q, tl.permute(k, (0, 2, 1)), IEEE) * scale  # [HP, BM, BN]
        seen = in_m[:, None] & in_n[None, :] & (offs_n[None, :] <= offs_m[:, None])  # [BM, BN]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + bias_at[:, None, None] + offs_m[None, :, None] * length + offs_n[None, None, :],
                           mask=in_h[:, None, None] & seen[None, :, :], other=0.0).to(tl.float32)
        else:
            bias = tl.zeros_like(s)
        return s, bias, seen

    @triton.jit
    def _hidden(s, bias, w1_ptr, b1_ptr, unit, offs_h, in_h, H: tl.constexpr, C: tl.constexpr,
                HAS_BIAS: tl.constexpr):
        """One hidden unit's pre-activation W1[unit] . [S; B] + b1[unit]: [BM, BN]. One sum over the heads (each
        head's tile sits in its own warp: the sum crosses them)."""
        weighed = tl.load(w1_ptr + unit * C + offs_h, mask=in_h, other=0.0)[:, None, None] * s  # [HP, BM, BN]
        if HAS_BIAS:
            weighed += tl.load(w1_ptr + unit * C + H + offs_h, mask=in_h, other=0.0)[:, None, None] * bias
        return tl.sum(weighed, axis=0) + tl.load(b1_ptr + unit)

    @triton.jit
    def _logits(s, bias, w1_ptr, b1_ptr, w2_ptr, b2, slope, offs_h, in_h, seen, H: tl.constexpr, C: tl.constexpr,
                WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr):
        """A = S + B + f([S; B]), -inf where hidden: [HP, BM, BN]."""
        logits = s + bias + b2[:, None, None]
        for unit in range(WIDTH):
            pre = _hidden(s, bias, w1_ptr, b1_ptr, unit, offs_h, in_h, H, C, HAS_BIAS)
            w_out = tl.load(w2_ptr + offs_h * WIDTH + unit, mask=in_h, other=0.0)  # W2[:, unit]: [HP]
            logits += w_out[:, None, None] * tl.where(pre > 0, pre, pre * slope)[None, :, :]
        return tl.where(seen[None, :, :] & in_h[:, None, None], logits, float("-inf"))

    @triton.jit
    def _forward(q_ptr, k_ptr, v_ptr, bias_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr, lse_ptr, length,
                 bias_batch_stride, slope, scale, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr,
                 DP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, C: tl.constexpr, WIDTH: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr):
        row_block, batch = tl.program_id(0), tl.program_id(1)
        offs_h, offs_d = tl.arange(0, HP), tl.arange(0, DP)
        offs_m = row_block * BM + tl.arange(0, BM)
        in_h, in_m, in_d = offs_h < H, offs_m < length, offs_d < D
        heads_at = (batch * H + offs_h).to(tl.int64) * length  # each head's first row: [HP]
        bias_at = batch.to(tl.int64) * bias_batch_stride + offs_h.to(tl.int64) * length * length
        rows = (heads_at[:, None, None] + offs_m[None, :, None]) * D + offs_d[None, None, :]
        inside = in_h[:, None, None] & in_m[None, :, None] & in_d[None, None, :]
        q = tl.load(q_ptr + rows, mask=inside, other=0.0)  # [HP, BM, DP]
        b2 = tl.load(b2_ptr + offs_h, mask=in_h, other=0.0)
        running_max = tl.full([HP, BM], float("-inf"), tl.float32)
        norm = tl.zeros([HP, BM], tl.float32)
        acc = tl.zeros([HP, BM, DP], tl.float32)
        for start in range(0, tl.minimum((row_block + 1) * BM, length), BN):
            offs_n = start + tl.arange(0, BN)
            s, bias, seen = _scores(q, k_ptr, bias_ptr, offs_h, in_h, heads_at, bias_at, offs_m, offs_n,
                                    in_m, length, scale, IEEE, HAS_BIAS, D, DP)
            logits = _logits(s, bias, w1_ptr, b1_ptr, w2_ptr, b2, slope, offs_h, in_h, seen, H, C, WIDTH, HAS_BIAS)
            new_max = tl.maximum(running_max, tl.max(logits, axis=2))
            new_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet (or a padding head)
            probs = tl.exp(logits - new_max[:, :, None])  # [HP, BM, BN]
            shrink = tl.exp(running_max - new_max)
            norm = norm * shrink + tl.sum(probs, axis=2)
            v = tl.load(v_ptr + (heads_at[:, None, None] + offs_n[None, :, None]) * D + offs_d[None, None, :],
                        mask=in_h[:, None, None] & (offs_n < length)[None, :, None] & in_d[None, None, :], other=0.0)
            acc = acc * shrink[:, :, None] + dot(probs, v, IEEE)
            running_max = new_max
        norm = tl.where(norm > 0, norm, 1.0)
        tl.store(out_ptr + rows, (acc / norm[:, :, None]).to(out_ptr.dtype.element_ty), mask=inside)
        tl.store(lse_ptr + heads_at[:, None] + offs_m[None, :], running_max + tl.log(norm),
                 mask=in_h[:, None] & in_m[None, :])

    @triton.jit
    def _backward(q_ptr, k_ptr, v_ptr, bias_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, dout_ptr, lse_ptr, delta_ptr,
                  dq_ptr, dk_ptr, dv_ptr, dbias_ptr, dw1_ptr, db1_ptr, dw2_ptr, db2_ptr, length, bias_batch_stride,
                  slope, scale, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  H: tl.constexpr, HP: tl.constexpr, C: tl.constexpr, WIDTH: tl.constexpr, WP: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
        row_block, batch = tl.program_id(0), tl.program_id(1)
        offs_h, offs_d, offs_w = tl.arange(0, HP), tl.arange(0, DP), tl.arange(0, WP)
        offs_m = row_block * BM + tl.arange(0, BM)
        in_h, in_m, in_d = offs_h < H, offs_m < length, offs_d < D
        heads_at = (batch * H + offs_h).to(tl.int64) * length
        bias_at = batch.to(tl.int64) * bias_batch_stride + offs_h.to(tl.int64) * length * length
        rows = (heads_at[:, None, None] + offs_m[None, :, None]) * D + offs_d[None, None, :]
        inside = in_h[:, None, None] & in_m[None, :, None] & in_d[None, None, :]
        q = tl.load(q_ptr + rows, mask=inside, other=0.0)  # [HP, BM, DP]
        dout = tl.load(dout_ptr + rows, mask=inside, other=0.0)
        row_at = heads_at[:, None] + offs_m[None, :]  # [HP, BM]
        lse = tl.load(lse_ptr + row_at, mask=in_h[:, None] & in_m[None, :], other=0.0)
        delta = tl.load(delta_ptr + row_at, mask=in_h[:, None] & in_m[None, :], other=0.0)  # D = dO . O
        b2 = tl.load(b2_ptr + offs_h, mask=in_h, other=0.0)
        dq = tl.zeros([HP, BM, DP], tl.float32)
        dw1_s = tl.zeros([WP, HP], tl.float32)  # dW1 of S's inputs, of B's, db1, dW2 (transposed), db2
        dw1_b = tl.zeros([WP, HP], tl.float32)
        db1 = tl.zeros([WP], tl.float32)
        dw2 = tl.zeros([WP, HP], tl.float32)
        db2 = tl.zeros([HP], tl.float32)
        for start in range(0, tl.minimum((row_block + 1) * BM, length), BN):
            offs_n = start + tl.arange(0, BN)
            in_n = offs_n < length
            s, bias, seen = _scores(q, k_ptr, bias_ptr, offs_h, in_h, heads_at, bias_at, offs_m, offs_n,
                                    in_m, length, scale, IEEE, HAS_BIAS, D, DP)
            logits = _logits(s, bias, w1_ptr, b1_ptr, w2_ptr, b2, slope, offs_h, in_h, seen, H, C, WIDTH, HAS_BIAS)
            probs = tl.exp(logits - lse[:, :, None])  # P, 0 where hidden: [HP, BM, BN]
            cols = (heads_at[:, None, None] + offs_n[None, :, None]) * D + offs_d[None, None, :]
            key_inside = in_h[:, None, None] & in_n[None, :, None] & in_d[None, None, :]
            k = tl.load(k_ptr + cols, mask=key_inside, other=0.0)  # [HP, BN, DP]
            v = tl.load(v_ptr + cols, mask=key_inside, other=0.0)
            dlogits = probs * (dot(dout, tl.permute(v, (0, 2, 1)), IEEE) - delta[:, :, None])  # dA
            ds = dlogits  # dS and dB: dA, and what the network passes back
            dbias = dlogits
            db2 += tl.sum(tl.sum(dlogits, axis=2), axis=1)
            for unit in range(WIDTH):
                pre = _hidden(s, bias, w1_ptr, b1_ptr, unit, offs_h, in_h, H, C, HAS_BIAS)  # [BM, BN]
                w_out = tl.load(w2_ptr + offs_h * WIDTH + unit, mask=in_h, other=0.0)  # [HP]
                at_unit = (offs_w == unit)[:, None]  # [WP, 1]
                hidden = tl.where(pre > 0, pre, pre * slope)
                dw2 += tl.where(at_unit, tl.sum(tl.sum(dlogits * hidden[None, :, :], axis=2), axis=1)[None, :], 0.0)
                dpre = tl.sum(w_out[:, None, None] * dlogits, axis=0)  # [BM, BN]
                dpre = tl.where(pre > 0, dpre, dpre * slope)
                db1 += tl.where(offs_w == unit, tl.sum(tl.sum(dpre, axis=1), axis=0), 0.0)
                w_s = tl.load(w1_ptr + unit * C + offs_h, mask=in_h, other=0.0)
                ds += w_s[:, None, None] * dpre[None, :, :]
                dw1_s += tl.where(at_unit, tl.sum(tl.sum(s * dpre[None, :, :], axis=2), axis=1)[None, :], 0.0)
                if HAS_BIAS:
                    w_b = tl.load(w1_ptr + unit * C + H + offs_h, mask=in_h, other=0.0)
                    dbias += w_b[:, None, None] * dpre[None, :, :]
                    dw1_b += tl.where(at_unit, tl.sum(tl.sum(bias * dpre[None, :, :], axis=2), axis=1)[None, :], 0.0)
            ds = ds * scale  # d(q . k)
            dq += dot(ds, k, IEEE)
            tl.atomic_add(dk_ptr + cols, dot(tl.permute(ds, (0, 2, 1)), q, IEEE), mask=key_inside)
            tl.atomic_add(dv_ptr + cols, dot(tl.permute(probs, (0, 2, 1)), dout, IEEE), mask=key_inside)
            if HAS_BIAS:
                tl.atomic_add(dbias_ptr + bias_at[:, None, None] + offs_m[None, :, None] * length
                              + offs_n[None, None, :], dbias, mask=in_h[:, None, None] & seen[None, :, :])
        tl.store(dq_ptr + rows, dq, mask=inside)
        in_w = offs_w < WIDTH
        tl.atomic_add(dw1_ptr + offs_w[:, None] * C + offs_h[None, :], dw1_s, mask=in_w[:, None] & in_h[None, :])
        if HAS_BIAS:
            tl.atomic_add(dw1_ptr + offs_w[:, None] * C + H + offs_h[None, :], dw1_b,
                          mask=in_w[:, None] & in_h[None, :])
        tl.atomic_add(db1_ptr + offs_w, db1, mask=in_w)
        tl.atomic_add(dw2_ptr + offs_h[None, :] * WIDTH + offs_w[:, None], dw2, mask=in_w[:, None] & in_h[None, :])
        tl.atomic_add(db2_ptr + offs_h, db2, mask=in_h)


class _DAPEAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, w1, b1, w2, b2, slope: float, scale: float):
        # q, k, v: [B, H, L, d]; bias: [B', H, L, L] or None; w1 [D, C], b1 [D], w2 [H, D], b2 [H] (nn.Linear's)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        batch, heads, length, d = q.shape
        weights = [w.float().contiguous() for w in (w1, b1, w2, b2)]
        flat_bias = None if bias is None else bias.float().contiguous()
        out = torch.empty_like(q)
        lse = q.new_empty(batch, heads, length, dtype=torch.float32)
        shape = _shape(q, bias, w1)
        bm, bn, warps, _ = tiles(shape["HP"], shape["DP"])
        _forward[(triton.cdiv(length, bm), batch)](
            q, k, v, q if flat_bias is None else flat_bias, *weights, out, lse, length, shape.pop("stride"), slope,
            scale, BM=bm, BN=bn, num_warps=warps, **shape)
        ctx.save_for_backward(q, k, v, flat_bias, *weights, out, lse)
        ctx.slope, ctx.scale = slope, scale
        bias_dtype = None if bias is None else bias.dtype
        ctx.dtypes = [t.dtype for t in (q, k, v)], bias_dtype, [w.dtype for w in (w1, b1, w2, b2)]
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias, w1, b1, w2, b2, out, lse = ctx.saved_tensors
        batch, length = q.shape[0], q.shape[2]
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)  # D = dO . O: [B, H, L]
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = (torch.zeros(q.shape, dtype=torch.float32, device=q.device) for _ in range(2))
        dbias = None if bias is None else torch.zeros_like(bias)
        dw1, db1, dw2, db2 = (torch.zeros_like(w) for w in (w1, b1, w2, b2))
        shape = _shape(q, bias, w1)
        bm, bn, _, warps = tiles(shape["HP"], shape["DP"])
        stride = shape.pop("stride")
        _backward[(triton.cdiv(length, bm), batch)](
            q, k, v, q if bias is None else bias, w1, b1, w2, b2, dout, lse, delta, dq, dk, dv,
            dq if dbias is None else dbias, dw1, db1, dw2, db2, length, stride, ctx.slope, ctx.scale, BM=bm, BN=bn,
            WP=triton.next_power_of_2(w1.shape[0]), num_warps=warps, **shape)
        inputs, bias_dtype, weights = ctx.dtypes
        grads = [g.to(dtype) for g, dtype in zip((dq, dk, dv, dw1, db1, dw2, db2), inputs + weights)]
        return *grads[:3], None if dbias is None else dbias.to(bias_dtype), *grads[3:], None, None


def _shape(q: torch.Tensor, bias: torch.Tensor | None, w1: torch.Tensor) -> dict:
    """The kernels' sizes: the head (padded to the products' 16 features), the heads (to a power of 2), the
    network's inputs and width, and the bias's batch stride (0: one bias shared by the batch)."""
    heads, length, d = q.shape[1:]
    stride = 0 if bias is None or bias.shape[0] == 1 else heads * length * length
    return {"HAS_BIAS": bias is not None, "IEEE": q.dtype == torch.float32, "D": d,
            "DP": max(16, triton.next_power_of_2(d)), "H": heads, "HP": triton.next_power_of_2(heads),
            "C": w1.shape[1], "WIDTH": w1.shape[0], "stride": stride}


def dape_attention(q, k, v, bias, w1, b1, w2, b2, slope: float, scale: float) -> torch.Tensor:
    """softmax(S + B + f([S; B])) v, causal, in Triton: q, k, v [B, H, L, d] (queries are the keys), bias
    [B', H, L, L] (B' = 1 or B) or None, f's weights as nn.Linear's -> [B, H, L, d]."""
    if triton is None:
        raise ValueError("DAPE's kernel needs Triton (it comes with CUDA builds of torch)")
    return _DAPEAttention.apply(q, k, v, bias, w1, b1, w2, b2, slope, scale)
