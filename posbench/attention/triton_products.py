"""What posbench's own Triton kernels (cope_kernel, dape_kernel, relative_bias_kernel, fire_kernel) share: Triton, where
it is installed (CUDA builds of torch ship it), their matrix product, the tiles where Triton's interpreter runs them,
the per-head kernels' row loads and flash forward's start and end (cope_kernel, relative_bias_kernel, fire_kernel),
and the flash steps of the kernels whose logits are q . k plus a bias (relative_bias_kernel, fire_kernel)."""
from __future__ import annotations

import os

import torch

INTERPRETED_BLOCKS = 16, 16  # smaller tiles where Triton's interpreter runs a kernel on the CPU


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1): on the CPU, with INTERPRETED_BLOCKS."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def head_launch(q: torch.Tensor, tiles) -> dict:
    """A per-head kernel's sizes for q [..., d]: the head (padded to the products' 16 features), and the queries
    and keys per tile and warps that tiles(padded head) gives."""
    padded = max(16, triton.next_power_of_2(q.shape[-1]))
    queries, keys, warps = tiles(padded)
    return {"D": q.shape[-1], "DP": padded, "BM": queries, "BN": keys, "num_warps": warps}


try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels need Triton; their entry points refuse without it
    triton = tl = None

if triton is None:
    dot = head_rows = softmax_start = softmax_block = store_rows = softmax_block_grads = store_key_grads = None
else:
    @triton.jit
    def dot(a, b, IEEE: tl.constexpr):
        """a @ b (2-D, or batched over a leading axis), a in b's dtype; float32 products in float32 (IEEE) rather
        than TF32."""
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a.to(b.dtype), b)

    @triton.jit
    def head_rows(a_ptr, b_ptr, base, offs, in_rows, offs_d, in_d, D: tl.constexpr):
        """Rows `offs` of two [length, D] matrices of one sequence and head (its rows start at `base`), zero past
        the ends -> (the rows' offsets and where they lie inside, both [len(offs), DP]; a's rows, b's rows)."""
        rows = (base + offs[:, None]) * D + offs_d[None, :]
        inside = in_rows[:, None] & in_d[None, :]
        a, b = tl.load(a_ptr + rows, mask=inside, other=0.0), tl.load(b_ptr + rows, mask=inside, other=0.0)
        return rows, inside, a, b

    @triton.jit
    def softmax_start(BM: tl.constexpr, DP: tl.constexpr):
        """A flash forward before its first key block: each query's running max, softmax sum and weighted values."""
        return tl.full([BM], float("-inf"), tl.float32), tl.zeros([BM], tl.float32), tl.zeros([BM, DP], tl.float32)

    @triton.jit
    def softmax_block(q, k, v, bias, seen, running_max, norm, acc, scale, IEEE: tl.constexpr):
        """One key block of a flash forward: the logits q . k * scale + bias (-inf where a query does not see a key)
        folded into each query's running max, softmax sum and weighted values -> (running_max, norm, acc)."""
        logits = tl.where(seen, dot(q, tl.trans(k), IEEE) * scale + bias, float("-inf"))  # [BM, BN]
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        new_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with nothing seen yet
        shrink = tl.exp(running_max - new_max)
        probs = tl.exp(logits - new_max[:, None])  # [BM, BN]
        return new_max, norm * shrink + tl.sum(probs, axis=1), acc * shrink[:, None] + dot(probs, v, IEEE)

    @triton.jit
    def store_rows(out_ptr, lse_ptr, rows, lse_rows, in_m, inside, running_max, norm, acc):
        """A flash forward's end: the output acc / norm at rows and each query's log-sum-exp at lse_rows."""
        norm = tl.where(in_m, norm, 1.0)
        tl.store(out_ptr + rows, (acc / norm[:, None]).to(out_ptr.dtype.element_ty), mask=inside)
        tl.store(lse_ptr + lse_rows, running_max + tl.log(norm), mask=in_m)

    @triton.jit
    def softmax_block_grads(q, k, v, dout, lse, delta, bias, seen, dk, dv, dq_ptr, rows_m, inside_m, scale,
                            IEEE: tl.constexpr):
        """One query block of a flash backward, in a program of one key block: P and dS (the logits' gradient,
        [BM, BN]) from the forward's log-sum-exps and D = dO . O; dk and dv summed, dq added atomically -> (ds, dk,
        dv)."""
        logits = dot(q, tl.trans(k), IEEE) * scale + bias
        probs = tl.where(seen, tl.exp(logits - lse[:, None]), 0.0)  # P: [BM, BN]
        ds = probs * (dot(dout, tl.trans(v), IEEE) - delta[:, None])  # d logit: [BM, BN]
        dv += dot(tl.trans(probs), dout, IEEE)
        dk += dot(tl.trans(ds), q, IEEE)
        tl.atomic_add(dq_ptr + rows_m, dot(ds, k, IEEE) * scale, mask=inside_m)
        return ds, dk, dv

    @triton.jit
    def store_key_grads(dk_ptr, dv_ptr, rows, inside, dk, dv, scale):
        """A flash backward's end, in a program of one key block: dk (times the logits' scale) and dv."""
        tl.store(dk_ptr + rows, (dk * scale).to(dk_ptr.dtype.element_ty), mask=inside)
        tl.store(dv_ptr + rows, dv.to(dv_ptr.dtype.element_ty), mask=inside)
