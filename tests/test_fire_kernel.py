"""FIRE's kernel (posbench.attention.fire_kernel, run by backend=fla for FIRE alone or beside a rotation): Triton's
interpreter runs it on the CPU (TRITON_INTERPRET=1, in a subprocess), against FIRE's formula in float64, whose MLP is
the literal Linear -> ReLU -> Linear, and against the eager model. tests/test_cuda.py repeats the model comparison on
a GPU."""
from __future__ import annotations

import pytest
import torch

from posbench.attention import fla
from tests.helpers import (NO_TRITON, assert_interpreted_errors_within, assert_kernel_models_match, make_case,
                           needs_interpreter)

EPS = 1e-6  # FIRE's, added to the normaliser


def fire_by_formula(q, k, v, c, threshold, w1, b1, w2, b2, q_pos, k_pos, scale, causal):
    """softmax(q . k * scale + f(log(1 + c |i - j|) / (log(1 + c max(i, L)) + eps))) v, the bias formed whole and f
    the MLP as written."""
    distance = (q_pos[:, :, None] - k_pos[:, None, :]).abs().double()  # [B', L, L]
    normaliser = torch.log1p(c * torch.maximum(q_pos.double(), threshold)) + EPS  # [B', L]
    x = torch.log1p(c * distance) / normaliser[:, :, None]  # [B', L, L]
    bias = (torch.relu(x[..., None] * w1 + b1) @ w2.T + b2).permute(0, 3, 1, 2)  # [B', H, L, L]
    length = q.shape[-2]
    seen = torch.ones(length, length, dtype=torch.bool)
    if causal:
        seen = seen.tril()
    logits = (q @ k.transpose(-1, -2) * scale + bias).masked_fill(~seen, float("-inf"))
    return logits.softmax(-1) @ v


def kernel_inputs(c, threshold, q_pos, k_pos):
    """log(1 + c d) at every distance the positions span, and each query's 1 / (log(1 + c max(i, L)) + eps)."""
    farthest = int(max(q_pos.max() - k_pos.min(), k_pos.max() - q_pos.min()))
    distances = torch.log1p(c * torch.arange(farthest + 1, dtype=torch.float64))  # [n]
    return distances, 1 / (torch.log1p(c * torch.maximum(q_pos.double(), threshold)) + EPS)  # [B', L]


def draw(length, head_dim, per_sequence, width, precision=torch.float32, seed=0):
    """q, k, v [2, 3, length, head_dim] (rounded to `precision`), positions [B', length] (B' = 2: increasing with gaps,
    per sequence; else 0..length-1 shared), and FIRE's parameters: c, the threshold L (a third of the way up the
    positions, so the normaliser is constant below it and grows above) and an MLP of `width` hidden units whose
    breakpoints lie inside the normalised distances' range (else a unit is on or off for every pair, and its
    gradients are those of a constant)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, length, head_dim, generator=gen, dtype=torch.float64).to(precision).double()
               for _ in range(3))
    if per_sequence:
        positions = (torch.randint(1, 4, (2, length), generator=gen).cumsum(-1) + 5).int()  # [2, L]
    else:
        positions = torch.arange(length, dtype=torch.int32)[None]  # [1, L]
    c = torch.tensor(0.3, dtype=torch.float64)
    threshold = positions.max().double() / 3
    w1 = torch.randn(width, generator=gen, dtype=torch.float64)
    b1 = -w1 * torch.rand(width, generator=gen, dtype=torch.float64)  # breakpoints -b1 / w1 in (0, 1)
    w2 = torch.randn(3, width, generator=gen, dtype=torch.float64)
    b2 = torch.randn(3, generator=gen, dtype=torch.float64)
    return q, k, v, (c, threshold, w1, b1, w2, b2), positions


FORMULA = """
import json, sys
import torch
from posbench.attention import fire_kernel
from posbench.attention.fire_kernel import fire_attention
from tests.helpers import interpreted_case
from tests.test_fire_kernel import draw, fire_by_formula, kernel_inputs
found = {}
for case in sys.argv[1:]:
    *sizes, precision = interpreted_case(case, fire_kernel)
    length, head_dim, causal, per_sequence, width = (int(x) for x in sizes)
    precision = getattr(torch, precision)
    q, k, v, params, positions = draw(length, head_dim, per_sequence, width, precision)
    scale = head_dim ** -0.5
    want = [x.clone().requires_grad_() for x in (q, k, v, *params)]
    out = fire_by_formula(*want, positions, positions, scale, bool(causal))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    out.backward(grad)
    got = [x.to(precision).requires_grad_() for x in (q, k, v)] + [x.float().requires_grad_() for x in params]
    distances, normalisers = kernel_inputs(got[3], got[4], positions, positions)
    mine = fire_attention(*got[:3], distances, normalisers, *got[5:], positions, positions, scale, bool(causal))
    mine.backward(grad.to(precision))
    errors = {"out": ((mine.double() - out).abs().max() / out.abs().max()).item()}
    for name, a, b in zip(("q", "k", "v", "c", "threshold", "w1", "b1", "w2"), got, want):
        errors[name] = ((a.grad.double() - b.grad).abs().max() / b.grad.abs().max()).item()
    # b2's gradient is the sum of each row's dS, 0 by softmax's shift invariance: its error against w2's, the
    # gradient of the same layer
    errors["b2"] = ((got[-1].grad.double() - want[-1].grad).abs().max() / want[-2].grad.abs().max()).item()
    found[case] = errors
print(json.dumps(found))
"""
# length, head dim, causal, positions per sequence (with gaps) or shared, hidden units, q, k and v's dtype: partial
# blocks of queries and keys, heads padded to the products' 16 features, bidirectional, a width that is not a power of
# 2; float16 runs the products as on a GPU's tensor cores (the interpreter has no bfloat16 products); "launch:" the
# GPU's tiles (16 queries by 32 keys at heads of 16, 16 by 16 at 32), partial too, the second at FIRE's default 32
# hidden units
FORMULA_CASES = ["37,16,1,0,8,float32", "40,8,1,1,6,float32", "33,32,0,1,8,float32", "37,16,1,0,8,float16",
                 "launch:40,16,1,0,12,float32", "launch:35,32,1,1,32,float32"]
TOLERANCE = {"float32": 1e-5, "float16": 5e-3}  # of each largest entry: float16 probabilities in the products


@needs_interpreter
def test_the_kernel_through_tritons_interpreter_gives_the_formula_and_its_gradients():
    assert_interpreted_errors_within(FORMULA, FORMULA_CASES, TOLERANCE)  # against float64 on the same inputs


@needs_interpreter
def test_a_model_on_the_kernel_gives_the_float64_eager_model():
    """Logits within 1e-4 and each gradient within 0.5% of the float64 eager model's (tests/test_cuda.py's check),
    c, the threshold's scale and the MLP's weights among them: FIRE alone, beside a rotation, and in a schedule's
    first layer (its second, t5's, runs on the relative bias kernel)."""
    assert_kernel_models_match("fire_attention", [
        "fire?mlp_width=8",  # 8 hidden units: the interpreter's time
        "composite:fire+rope?part_params={fire: {mlp_width: 8}}",
        "schedule?pattern=[f,t5]&kinds={f: {encoding: fire, mlp_width: 8}}"])  # layer 2 on the relative bias kernel


@pytest.mark.parametrize("case", ["fire", "composite:fire+rope", "fire?share_layers=true", "schedule?pattern=[fire,t5]",
                                  "schedule?pattern=[fire,rope]"])
def test_fire_alone_beside_a_rotation_or_in_a_schedule_runs_on_the_kernels(case):
    encoding = make_case(case, d_model=32, n_heads=2)
    fla.FlaBackend().check(encoding)


def test_fire_beside_another_bias_is_refused():
    """The kernel computes FIRE's bias alone: t5's beside it would be lost."""
    encoding = make_case("composite:fire+t5", d_model=32, n_heads=2)
    with pytest.raises(ValueError, match=r"backend=fla cannot run the \['bias'\] hook"):
        fla.FlaBackend().check(encoding)


def test_the_guard_counts_the_kernels_gradient_rows_not_a_bias():
    """In training the kernel holds per sequence and head one float32 row by distance and one by query; evaluating,
    nothing beyond its output (the eager path declares the bias's autograd record: 3.25 [1, H, L, L] tensors)."""
    from posbench.encodings.base import LayerShape

    encoding = make_case("fire", d_model=32, n_heads=2)
    assert fla.FlaBackend().runs_kernel_of(encoding)
    assert fla.FlaBackend().runs_kernel_of(make_case("composite:fire+rope", d_model=32, n_heads=2))
    training = LayerShape(batch=8, heads=2, tokens=1024, keys=1024, block=None, pairs=0.0, training=True)
    assert encoding.kernel_memory(0, training) == 4 * 8 * 2 * 2048
    assert encoding.kernel_memory(0, LayerShape(8, 2, 1024, 1024, None, 0.0, training=False)) == 0


@pytest.mark.skipif(NO_TRITON, reason="triton is not installed (CUDA builds of torch ship it)")
def test_positions_and_normalisers_of_other_shapes_are_refused():
    from posbench.attention.fire_kernel import fire_attention

    q, w = torch.zeros(2, 1, 4, 16), torch.zeros(3)
    positions = torch.arange(4).expand(2, 4)
    with pytest.raises(ValueError, match=r"alike, \[B', L\]; got \[2, 4\], \[2, 4\] and \[1, 4\]"):
        fire_attention(q, q, q, torch.zeros(4), torch.ones(1, 4), w, w, torch.zeros(1, 3), torch.zeros(1), positions,
                       positions, 0.25, True)


def test_the_kernel_inputs_of_a_recorded_step_cover_the_training_distances_with_the_same_values():
    """kernel_inputs reads the positions' largest distance on the host; in graph_safe (a recorded or compiled step)
    it takes every distance the training positions allow instead (ModelDims.train_positions): the same log(1 + c d)
    at each distance the positions span, the same normalisers and weights."""
    from posbench.encodings.base import graph_safe

    encoding = make_case("fire", d_model=32, n_heads=2, max_positions=64)
    q_pos = torch.tensor([[5, 9, 20]])
    read = encoding.kernel_inputs(q_pos, q_pos, 0)  # distances 0 .. 15
    with graph_safe():
        bounded = encoding.kernel_inputs(q_pos, q_pos, 0)  # distances 0 .. 63
    assert read[0].shape == (16,) and bounded[0].shape == (64,)
    assert torch.equal(bounded[0][:16], read[0])
    for a, b in zip(read[1:], bounded[1:]):
        assert torch.equal(a, b)
