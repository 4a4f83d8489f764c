"""posbench's own Triton kernels lower to a GPU's code on a machine without one (Triton compiles for sm_90 and its
bundled ptxas assembles): a kernel Triton cannot compile fails here, not first on a device call."""
from __future__ import annotations

import importlib.util

import pytest

from tests.helpers import NO_TRITON, ROOT

SCRIPT = ROOT / "scripts" / "kernel_resources.py"


@pytest.mark.skipif(NO_TRITON, reason="triton is not installed (CUDA builds of torch ship it)")
@pytest.mark.parametrize("name", ["cope backward", "dape backward (a bias)", "relative bias backward",
                                  "fire backward"])
def test_the_backward_kernels_compile_for_sm_90_in_bf16(name):
    spec = importlib.util.spec_from_file_location("kernel_resources", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = {kernel[0]: kernel[1:] for kernel in module.kernels(16, 4, 32, "bf16")}
    function, constexprs, warps, inputs = found[name]
    used = module.compile_kernel(function, constexprs, "bf16", warps, 90, inputs)
    assert 0 < used["registers"] <= 255 and used["shared"] > 0
