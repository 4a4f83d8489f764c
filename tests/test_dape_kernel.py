"""DAPE v1's Triton kernel (posbench.attention.dape_kernel, run by backend=fla): Triton's interpreter runs it on the
CPU, against the formula in float64 and against the eager model with each base. tests/test_cuda.py repeats the
model comparison on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posbench.attention import fla
from tests.helpers import assert_interpreted_errors_within, assert_kernel_models_match, make_case, needs_interpreter


def dape_by_formula(q, k, v, bias, w1, b1, w2, b2, slope, scale):
    """softmax(S + B + f([S; B])) v, causal, f = Linear -> LeakyReLU -> Linear at every pair (f([S]) without B)."""
    s = q @ k.transpose(-1, -2) * scale  # [B, H, L, L]
    seen = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    features = s if bias is None else torch.cat([s, bias.expand_as(s)], dim=1)  # [B, C, L, L]
    f = F.linear(F.leaky_relu(F.linear(features.movedim(1, -1), w1, b1), slope), w2, b2).movedim(-1, 1)
    logits = s + f if bias is None else s + bias + f
    return logits.masked_fill(~seen, float("-inf")).softmax(-1) @ v


FORMULA = """
import json, sys
import torch
from posbench.attention import dape_kernel
from posbench.attention.dape_kernel import dape_attention
from tests.helpers import interpreted_case
from tests.test_dape_kernel import dape_by_formula
found = {}
for case in sys.argv[1:]:
    heads, length, head_dim, width, bias, precision = interpreted_case(case, dape_kernel)
    heads, length, head_dim, width = int(heads), int(length), int(head_dim), int(width)
    precision = getattr(torch, precision)
    gen = torch.Generator().manual_seed(0)
    draw = lambda *shape, std=1.0: torch.randn(*shape, generator=gen, dtype=torch.float64) * std
    q, k, v = (draw(2, heads, length, head_dim).to(precision).double() for _ in range(3))
    b = None if bias == "none" else draw(1 if bias == "shared" else 2, heads, length, length)
    channels = heads if b is None else 2 * heads
    inputs = [q, k, v, b, draw(width, channels, std=0.5), draw(width, std=0.5), draw(heads, width, std=0.3),
              draw(heads, std=0.3)]
    want = [None if x is None else x.clone().requires_grad_() for x in inputs]
    out = dape_by_formula(*want, 0.01, head_dim ** -0.5)
    grad = draw(*out.shape)
    out.backward(grad)
    got = [x.to(precision).requires_grad_() for x in inputs[:3]] + [
        None if x is None else x.float().requires_grad_() for x in inputs[3:]]
    mine = dape_attention(*got, 0.01, head_dim ** -0.5)
    mine.backward(grad.to(precision))
    errors = {"out": ((mine.double() - out).abs().max() / out.abs().max()).item()}
    for name, a, b in zip(["q", "k", "v", "bias", "w1", "b1", "w2"], got, want):
        if a is not None:
            errors[name] = ((a.grad.double() - b.grad).abs().max() / b.grad.abs().max()).item()
    # b2 shifts every logit of a head alike, which the softmax ignores: its gradient is 0 up to rounding
    errors["b2 against w2's"] = (got[-1].grad.abs().max() / want[-2].grad.abs().max()).item()
    found[case] = errors
print(json.dumps(found))
"""
# heads, length, head dim, network width, the bias (shared by the batch, per sequence, none), q, k and v's dtype:
# partial blocks of queries and keys, heads not a power of 2 (padded), heads of 8 and 32 features (padded to 16 /
# not); float16 runs the products as on a GPU's tensor cores (the interpreter has no bfloat16 products); "launch:"
# the GPU's tiles (16 queries by 32 keys at 4 heads of 16 features), partial too
FORMULA_CASES = ["4,16,16,8,shared,float32", "4,37,16,8,none,float32", "3,37,8,8,per,float32",
                 "2,40,32,4,shared,float32", "4,37,16,8,shared,float16", "launch:4,70,16,8,per,float32"]
TOLERANCE = {"float32": 1e-5, "float16": 5e-3}  # of each largest entry: float16 probabilities in the products


@needs_interpreter
def test_the_kernel_through_tritons_interpreter_gives_the_formula_and_its_gradients():
    found = assert_interpreted_errors_within(FORMULA, FORMULA_CASES, TOLERANCE)  # against float64, same inputs
    for case, errors in found.items():
        assert len(errors) == (8 if ",none," in case else 9)


@needs_interpreter
def test_a_model_on_the_kernel_gives_the_float64_eager_model_with_each_base():
    """Logits within 1e-4 and each gradient within 0.5% of the float64 eager model's (tests/test_cuda.py's check):
    the base's bias (kerple's, fire's) gets its gradient through the kernel; rope's network reads S alone, after
    the rotation."""
    narrow = "mlp_width=8"  # 8 hidden units: the interpreter runs the network one unit at a time
    assert_kernel_models_match("dape_attention", [f"dape?{narrow}", f"dape?base=fire&{narrow}",
                                                  f"dape?base=rope&{narrow}"])


def test_v2_and_dape_beside_a_decay_are_refused(monkeypatch):
    monkeypatch.setattr(fla, "fla_refusal", lambda cuda, encoding=None: None)
    for case in ("dape?version=2", "composite:dape+fox"):
        with pytest.raises(ValueError, match="backend=fla cannot run the .*logit_transform"):
            fla.FlaBackend().check(make_case(case, d_model=32, n_heads=2))
    fla.FlaBackend().check(make_case("dape", d_model=32, n_heads=2))


def test_the_guard_counts_the_bias_and_no_pairs_of_the_batch():
    """On fla, DAPE's kernel holds the base's [1, H, L, L] bias (and in training its gradient and autograd's copies),
    not the eager path's [B, H, L, L] network inputs and outputs."""
    import dataclasses

    from posbench import guard
    from posbench.build import build
    from tests.helpers import compose_cfg

    eager = build(compose_cfg("encoding=dape", "backend=eager", "device=cpu", "model=small"), torch.device("cpu"))
    on_fla = dataclasses.replace(eager, backend="fla", eval_backends={})
    cfg, batch, tokens = eager.model.cfg, 8, 4096
    bias = 4.0 * cfg.n_heads * tokens * tokens
    fused = 4.0 * batch * cfg.n_heads * tokens * guard.FLOAT
    assert guard.training_attention_bytes(on_fla, batch, tokens) == cfg.n_layers * (fused + 3 * bias)
    assert guard.training_attention_bytes(eager, batch, tokens) > batch * cfg.n_layers * (fused + 3 * bias)
    in_evaluation, _ = guard.attention_bytes(on_fla, None, tokens, batch, tokens, tokens, 0, "auto")
    assert in_evaluation == fused + bias
