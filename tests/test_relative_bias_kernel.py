"""The relative bias kernel (posbench.attention.relative_bias_kernel, run by backend=fla for a bias of i - j alone):
Triton's interpreter runs it on the CPU (TRITON_INTERPRET=1, in a subprocess), against the formula in float64 and
against the eager model. tests/test_cuda.py repeats the model comparison on a GPU."""
from __future__ import annotations

import pytest
import torch

from posbench.attention import fla
from tests.helpers import (NO_TRITON, assert_interpreted_errors_within, assert_kernel_models_match, make_case,
                           needs_interpreter)


def relative_bias_by_formula(q, k, v, rows, q_pos, k_pos, first, scale, causal):
    """softmax(q . k * scale + rows_h[pos_i - pos_j - first]) v, the bias formed whole."""
    index = (q_pos[:, :, None] - k_pos[:, None, :] - first).long()  # [B', L, L]
    bias = rows[:, index].transpose(0, 1)  # [B', H, L, L]
    length = q.shape[-2]
    seen = torch.ones(length, length, dtype=torch.bool)
    if causal:
        seen = seen.tril()
    logits = (q @ k.transpose(-1, -2) * scale + bias).masked_fill(~seen, float("-inf"))
    return logits.softmax(-1) @ v


def draw(length, head_dim, per_sequence, precision=torch.float32, seed=0):
    """q, k, v [2, 3, length, head_dim] (rounded to `precision`), positions [B', length] (B' = 2: increasing with gaps,
    per sequence; else 0..length-1 shared) and rows [3, n] over every offset they span, with its first offset."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, length, head_dim, generator=gen, dtype=torch.float64).to(precision).double()
               for _ in range(3))
    if per_sequence:
        positions = (torch.randint(1, 4, (2, length), generator=gen).cumsum(-1) + 5).int()  # [2, L]
    else:
        positions = torch.arange(length, dtype=torch.int32)[None]  # [1, L]
    first = int(positions.min() - positions.max())
    rows = torch.randn(3, 2 * int(positions.max() - positions.min()) + 1, generator=gen, dtype=torch.float64)
    return q, k, v, rows, positions, first


FORMULA = """
import json, sys
import torch
from posbench.attention import relative_bias_kernel
from posbench.attention.relative_bias_kernel import relative_bias_attention
from tests.helpers import interpreted_case
from tests.test_relative_bias_kernel import draw, relative_bias_by_formula
found = {}
for case in sys.argv[1:]:
    *sizes, precision = interpreted_case(case, relative_bias_kernel)
    length, head_dim, causal, per_sequence = (int(x) for x in sizes)
    precision = getattr(torch, precision)
    q, k, v, rows, positions, first = draw(length, head_dim, per_sequence, precision)
    scale = head_dim ** -0.5
    want = [x.clone().requires_grad_() for x in (q, k, v, rows)]
    out = relative_bias_by_formula(*want, positions, positions, first, scale, bool(causal))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    out.backward(grad)
    got = [x.to(precision).requires_grad_() for x in (q, k, v)] + [rows.float().requires_grad_()]
    mine = relative_bias_attention(*got, positions, positions, first, scale, bool(causal))
    mine.backward(grad.to(precision))
    errors = {"out": ((mine.double() - out).abs().max() / out.abs().max()).item()}
    for name, a, b in zip(("q", "k", "v", "rows"), got, want):
        errors[name] = ((a.grad.double() - b.grad).abs().max() / b.grad.abs().max()).item()
    found[case] = errors
print(json.dumps(found))
"""
# length, head dim, causal, positions per sequence (with gaps) or shared, q, k and v's dtype: partial blocks of
# queries and keys, heads padded to the products' 16 features, bidirectional; float16 runs the products as on a
# GPU's tensor cores (the interpreter has no bfloat16 products); "launch:" the GPU's tiles (64 x 64 at heads of 16,
# 32 x 32 above), partial too
FORMULA_CASES = ["37,16,1,0,float32", "40,8,1,1,float32", "33,32,0,1,float32", "16,16,1,0,float32",
                 "37,16,1,1,float16", "launch:100,16,1,0,float32", "launch:70,32,1,1,float32"]
TOLERANCE = {"float32": 1e-5, "float16": 5e-3}  # of each largest entry: float16 probabilities in the products


@needs_interpreter
def test_the_kernel_through_tritons_interpreter_gives_the_formula_and_its_gradients():
    assert_interpreted_errors_within(FORMULA, FORMULA_CASES, TOLERANCE)  # against float64 on the same inputs


@needs_interpreter
def test_a_model_on_the_kernel_gives_the_float64_eager_model():
    """Logits within 1e-4 and each gradient within 0.5% of the float64 eager model's (tests/test_cuda.py's check):
    a learned bias (kerple's scalars, t5's table), alone, beside a rotation, and in a schedule's first layer (its
    second, rope's, has no bias). tests/test_cuda.py adds sandwich's fixed bias."""
    assert_kernel_models_match("relative_bias_attention", ["kerple", "t5", "composite:kerple+rope",
                                                           "schedule?pattern=[t5,rope]"])


@pytest.mark.parametrize("case", ["kerple", "t5", "sandwich", "composite:kerple+rope", "composite:t5+kerple"])
def test_a_bias_of_i_minus_j_alone_runs_on_the_kernel(case):
    fla.FlaBackend().check(make_case(case, d_model=32, n_heads=2))


@pytest.mark.parametrize("case,why", [
    ("composite:fire+t5", "a bias of i and j beside it (FIRE's kernel takes FIRE's alone)"),
    ("composite:kerple+fox", "beside a decay: the decay's kernel takes no bias"),
    ("composite:cope+kerple", "beside another kernel"),
])
def test_a_bias_the_kernel_cannot_take_is_refused_naming_the_backends_that_can(case, why):
    encoding = make_case(case, d_model=32, n_heads=2)
    with pytest.raises(ValueError, match=r"backend=fla cannot run the \[.*'bias'.*\] hook"):
        fla.FlaBackend().check(encoding)


def test_a_bias_on_a_grid_is_refused():
    """A 2-D encoding's bias is of (dy, dx), not of one offset."""
    encoding = make_case("t5_2d", d_model=32, n_heads=2)
    assert "bias" in fla.fla_missing_hooks(encoding)


def test_the_kernel_needs_triton_not_fla_core(monkeypatch):
    encoding = make_case("kerple", d_model=32, n_heads=2)
    monkeypatch.setattr(fla.importlib.util, "find_spec", lambda name: None if name == "fla" else object())
    assert fla.fla_refusal(True, encoding) is None
    monkeypatch.setattr(fla.importlib.util, "find_spec", lambda name: None)
    assert "Triton" in fla.fla_refusal(True, encoding)


@pytest.mark.skipif(NO_TRITON, reason="triton is not installed (CUDA builds of torch ship it)")
def test_positions_of_other_shapes_for_queries_and_keys_are_refused():
    from posbench.attention.relative_bias_kernel import relative_bias_attention

    q = torch.zeros(2, 1, 4, 16)
    with pytest.raises(ValueError, match=r"positions alike, \[B', L\]; got \[2, 4\] and \[1, 4\]"):
        relative_bias_attention(q, q, q, torch.zeros(1, 7), torch.arange(4).expand(2, 4), torch.arange(4)[None], -3,
                                0.25, True)
