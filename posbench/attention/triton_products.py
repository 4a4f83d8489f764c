"""What posbench's own Triton kernels (cope_kernel, dape_kernel) share: Triton, where it is installed (CUDA builds of
torch ship it), and their matrix product."""
from __future__ import annotations

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
