"""posbench's own Triton kernels (CoPE's, DAPE's, the relative bias's, FIRE's) compiled for a CUDA architecture
without a GPU, with the block sizes and warps they launch with: what each thread holds (registers, spilled bytes)
and each program's shared memory, from Triton's bundled ptxas. Spills mean local-memory traffic in the kernel's
inner loop, so this is the check to run after changing a kernel's tiles.

    python scripts/kernel_resources.py               # sm_90 (H100, H200), float32 and bfloat16 inputs
    python scripts/kernel_resources.py --arch 80     # an A100
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, set: it warns while unset

INPUT_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "dout_ptr")  # in the inputs' dtype; others float32 but:
INTEGER_POINTERS = ("qpos_ptr", "kpos_ptr")  # int32
INTEGERS = ("length", "rows", "bias_batch_stride", "heads", "n_rows", "first", "pos_stride")


def kernels(head_dim: int, heads: int, width: int, dtype: str) -> list[tuple[str, object, dict, int, tuple]]:
    """(name, Triton function, its constexprs, warps, its pointers in the inputs' dtype) as posbench launches them in
    `dtype` (fp32 or bf16)."""
    from posbench.attention import cope_kernel, dape_kernel, fire_kernel, relative_bias_kernel

    padded = max(16, 1 << (head_dim - 1).bit_length())
    ieee = dtype == "fp32"
    queries, keys, warps = cope_kernel.launch_tiles(padded)
    cope = {"CAUSAL": True, "IEEE": ieee, "D": head_dim, "DP": padded, "ZW": 1026, "BM": queries, "BN": keys}
    found = [("cope forward", cope_kernel._forward, cope, warps, INPUT_POINTERS),
             ("cope backward", cope_kernel._backward, cope, warps, INPUT_POINTERS)]
    heads_padded = 1 << (heads - 1).bit_length()
    queries, keys, forward_warps, backward_warps = dape_kernel.launch_tiles(heads_padded, padded)
    for bias in (True, False):
        dape = {"HAS_BIAS": bias, "IEEE": ieee, "D": head_dim, "DP": padded, "H": heads, "HP": heads_padded,
                "C": 2 * heads if bias else heads, "WIDTH": width, "BM": queries, "BN": keys}
        suffix = " (a bias)" if bias else " (rope, nope)"
        found += [("dape forward" + suffix, dape_kernel._forward, dape, forward_warps, INPUT_POINTERS),
                  ("dape backward" + suffix, dape_kernel._backward, {**dape, "WP": 1 << (width - 1).bit_length()},
                   backward_warps, INPUT_POINTERS)]
    queries, keys, warps = relative_bias_kernel.launch_tiles(padded)
    relative = {"CAUSAL": True, "IEEE": ieee, "D": head_dim, "DP": padded, "BM": queries, "BN": keys}
    found += [("relative bias forward", relative_bias_kernel._forward, relative, warps, INPUT_POINTERS),
              ("relative bias backward", relative_bias_kernel._backward, {**relative, "ROWS_GRAD": True}, warps,
               (*INPUT_POINTERS, "dk_ptr", "dv_ptr"))]
    queries, keys, warps = fire_kernel.launch_tiles(padded)
    fire = {"CAUSAL": True, "IEEE": ieee, "WIDTH": width, "D": head_dim, "DP": padded, "BM": queries, "BN": keys}
    found += [("fire forward", fire_kernel._forward, fire, warps, INPUT_POINTERS),
              ("fire backward", fire_kernel._backward, {**fire, "PARAMS_GRAD": True, "WP": 1 << width.bit_length()},
               warps, (*INPUT_POINTERS, "dk_ptr", "dv_ptr"))]
    return found


def compile_kernel(function, constexprs: dict, dtype: str, warps: int, arch: int, inputs: tuple) -> dict:
    """Compile for sm_<arch>: registers, spill stores and loads (bytes per thread) and shared memory (bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    names = list(inspect.signature(function.fn).parameters)
    signature = {name: "constexpr" if name in constexprs
                 else f"*{dtype}" if name in inputs
                 else "*i32" if name in INTEGER_POINTERS
                 else "*fp32" if name.endswith("_ptr")
                 else "i32" if name in INTEGERS else "fp32" for name in names}
    source = ASTSource(fn=function, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as folder:
        ptx = Path(folder) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", str(ptx), "-o",
                                 str(Path(folder) / "kernel.cubin")], capture_output=True, text=True, check=True)
    def number(pattern: str) -> int:
        found = re.search(pattern, report.stderr)
        return int(found.group(1)) if found else 0
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "shared": compiled.metadata.shared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability times 10 (90: H100, H200)")
    parser.add_argument("--head-dim", type=int, default=16, help="features per head (model=small: 16)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=32, help="DAPE's and FIRE's MLP width (their default)")
    args = parser.parse_args()
    import triton

    print(f"sm_{args.arch}, heads of {args.head_dim} features, {args.heads} heads, MLP width {args.width}, "
          f"triton {triton.__version__}")
    print("| kernel | inputs | warps | registers | spill stores (B) | spill loads (B) | shared memory (B) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for dtype in ("fp32", "bf16"):
        for name, function, constexprs, warps, inputs in kernels(args.head_dim, args.heads, args.width, dtype):
            used = compile_kernel(function, constexprs, dtype, warps, args.arch, inputs)
            print(f"| {name} | {dtype} | {warps} | {used['registers']} | {used['spill_stores']} | "
                  f"{used['spill_loads']} | {used['shared']:,} |", flush=True)


if __name__ == "__main__":
    main()
