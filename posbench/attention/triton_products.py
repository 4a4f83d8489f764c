"""What posbench's own Triton kernels (cope_kernel, dape_kernel, relative_bias_kernel) share: Triton, where it is
installed (CUDA builds of torch ship it), their matrix product, and the tiles where Triton's interpreter runs them."""
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
    dot = None
else:
    @triton.jit
    def dot(a, b, IEEE: tl.constexpr):
        """a @ b (2-D, or batched over a leading axis), a in b's dtype; float32 products in float32 (IEEE) rather
        than TF32."""
        if IEEE:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a.to(b.dtype), b)
