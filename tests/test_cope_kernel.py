"""CoPE's Triton kernel (posbench.attention.cope_kernel, run by backend=fla): Triton's interpreter runs it on the
CPU (TRITON_INTERPRET=1, in a subprocess: the flag is read when the kernels are defined), against the formula in
float64 and against the eager model. tests/test_cuda.py repeats the model comparison on a GPU."""
from __future__ import annotations

import pytest
import torch

from posbench.attention import fla
from tests.helpers import assert_interpreted_errors_within, assert_kernel_models_match, make_case, needs_interpreter


def cope_by_formula(q, k, v, e, scale, causal):
    """softmax(s + r) v, the paper's r: gates sigmoid(s), p their reversed cumulative sum clamped to the table's
    last row, r interpolated between z[floor p] and z[floor p + 1] (z = q . e^T, e times the scale)."""
    s = q @ k.transpose(-1, -2) * scale  # [B, H, L, L]
    length = q.shape[-2]
    seen = torch.ones(length, length, dtype=torch.bool)
    if causal:
        seen = seen.tril()
    p = torch.sigmoid(s).masked_fill(~seen, 0).flip(-1).cumsum(-1).flip(-1).clamp(max=e.shape[0] - 2)
    floor = p.floor()
    z = q @ e.T  # [B, H, L, rows + 1]
    below, above = z.gather(-1, floor.long()), z.gather(-1, floor.long() + 1)
    logits = s + below + (p - floor) * (above - below)
    return logits.masked_fill(~seen, float("-inf")).softmax(-1) @ v


def farthest_from_the_kinks(length, head_dim, rows, causal, precision=torch.float32, seeds=range(200)):
    """Inputs [2, 2, length, head_dim] (q, k and v rounded to `precision`; and e) whose positions p all lie at least
    1e-4 from an integer: r's slope jumps at each integer, so float32 and float64 could take different sides of one
    there."""
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(2, 2, length, head_dim, generator=gen, dtype=torch.float64).to(precision).double()
                   for _ in range(3))
        e = torch.randn(rows + 1, head_dim, generator=gen, dtype=torch.float64) * 0.5
        e[-1] = 0  # the zero row past the table
        s = q @ k.transpose(-1, -2) * head_dim ** -0.5
        seen = torch.ones(length, length, dtype=torch.bool)
        seen = seen.tril() if causal else seen
        p = torch.sigmoid(s).masked_fill(~seen, 0).flip(-1).cumsum(-1).flip(-1)[..., seen]
        if ((p - p.round()).abs() > 1e-4).all():
            return q, k, v, e
    raise AssertionError("no draw keeps every position away from an integer")


FORMULA = """
import json, sys
import torch
from posbench.attention import cope_kernel
from posbench.attention.cope_kernel import cope_attention
from tests.helpers import interpreted_case
from tests.test_cope_kernel import cope_by_formula, farthest_from_the_kinks
found = {}
for case in sys.argv[1:]:
    *sizes, precision = interpreted_case(case, cope_kernel)
    length, head_dim, rows, causal = (int(x) for x in sizes)
    precision = getattr(torch, precision)
    inputs = farthest_from_the_kinks(length, head_dim, rows, bool(causal), precision)
    scale = head_dim ** -0.5
    want = [x.clone().requires_grad_() for x in inputs]
    out = cope_by_formula(*want, scale, bool(causal))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    out.backward(grad)
    got = [x.to(precision).requires_grad_() for x in inputs[:3]] + [inputs[3].float().requires_grad_()]
    mine = cope_attention(*got, scale, bool(causal))
    mine.backward(grad.to(precision))
    errors = {"out": ((mine.double() - out).abs().max() / out.abs().max()).item()}
    for name, a, b in zip("qkve", got, want):
        errors[name] = ((a.grad.double() - b.grad).abs().max() / b.grad.abs().max()).item()
    found[case] = errors
print(json.dumps(found))
"""
# length, head dim, table rows, causal, q, k and v's dtype: partial blocks of queries and keys, the clamp binding
# (rows < length) or not, heads padded to the products' 16 features, bidirectional; float16 runs the products as
# on a GPU's tensor cores (the interpreter has no bfloat16 products); "launch:" the GPU's tiles (32 x 16), partial too
FORMULA_CASES = ["37,16,20,1,float32", "37,16,40,1,float32", "40,8,12,1,float32", "33,32,34,0,float32",
                 "16,16,17,1,float32", "37,16,20,1,float16", "launch:70,16,40,1,float32"]
TOLERANCE = {"float32": 2e-5, "float16": 5e-3}  # of each largest entry: float16 probabilities in the products


@needs_interpreter
def test_the_kernel_through_tritons_interpreter_gives_the_formula_and_its_gradients():
    assert_interpreted_errors_within(FORMULA, FORMULA_CASES, TOLERANCE)  # against float64 on the same inputs


@needs_interpreter
def test_a_model_on_the_kernel_gives_the_float64_eager_model():
    """Logits within 1e-4 and each gradient within 0.5% of the float64 eager model's (tests/test_cuda.py's check)."""
    assert_kernel_models_match("cope_attention", ["cope", "composite:cope+rope"])


@pytest.mark.parametrize("case", ["composite:cope+alibi", "composite:cope+dape"])
def test_cope_beside_a_part_that_adds_to_its_logits_is_refused(case, monkeypatch):
    monkeypatch.setattr(fla, "fla_refusal", lambda cuda, encoding=None: None)
    encoding = make_case(case, d_model=32, n_heads=2)
    with pytest.raises(ValueError, match="backend=fla cannot run the .*logit_transform"):
        fla.FlaBackend().check(encoding)


def test_cope_beside_a_part_that_sets_the_logits_scale_is_refused(monkeypatch):
    """The kernel's gates read the scaled logits; eager's read q . k at CoPE's own scale: they differ there."""
    encoding = make_case("composite:cope+rope", d_model=32, n_heads=2)
    fla.FlaBackend().check(encoding)
    monkeypatch.setattr(encoding, "logit_scale", lambda head_dim: 0.1)
    with pytest.raises(ValueError, match="CoPE's kernel reads its gates from the logits.*use backend=eager"):
        fla.FlaBackend().check(encoding)


def test_the_kernel_needs_triton_not_fla_core(monkeypatch):
    encoding = make_case("cope", d_model=32, n_heads=2)
    monkeypatch.setattr(fla.importlib.util, "find_spec", lambda name: None if name == "fla" else object())
    assert fla.fla_refusal(True, encoding) is None
    assert "posbench[fla]" in fla.fla_refusal(True, make_case("fox", d_model=32, n_heads=2))
    monkeypatch.setattr(fla.importlib.util, "find_spec", lambda name: None)
    assert "Triton" in fla.fla_refusal(True, encoding)
    assert "CUDA only" in fla.fla_refusal(False, encoding)


def test_the_scaled_table_is_the_one_the_eager_path_reads():
    encoding = make_case("cope", d_model=32, n_heads=2)
    torch.nn.init.normal_(encoding.table)
    table = encoding.scaled_table(1, keys=5)  # rows = min(npos, keys + 1) = 6, then the zero row
    assert table.shape == (7, 16)
    torch.testing.assert_close(table[:6], encoding.table[1, :6] * 16 ** -0.5)
    assert (table[6] == 0).all()


def test_the_guard_counts_the_kernels_z_and_no_pairs():
    """On fla, CoPE's kernel keeps z = q . e^T [B, H, L, rows + 1] (and its gradient in backward), not the eager
    path's [B, H, L, L] gates, positions and lookups."""
    import dataclasses

    from posbench import guard
    from posbench.build import build
    from tests.helpers import compose_cfg

    eager = build(compose_cfg("encoding=cope", "backend=eager", "device=cpu", "model=small", "train.length=64"),
                  torch.device("cpu"))
    on_fla = dataclasses.replace(eager, backend="fla", eval_backends={})
    cfg, batch, tokens = eager.model.cfg, 8, 4096
    rows = eager.encoding.npos + 1  # the table's rows at 4,096 keys, with its zero row
    z = 4.0 * batch * cfg.n_heads * tokens * rows
    fused = 4.0 * batch * cfg.n_heads * tokens * guard.FLOAT
    assert guard.training_attention_bytes(on_fla, batch, tokens) == cfg.n_layers * (fused + 2 * z)
    assert guard.training_attention_bytes(eager, batch, tokens) > 10 * cfg.n_layers * (fused + 2 * z)
    in_evaluation, _ = guard.attention_bytes(on_fla, None, tokens, batch, tokens, tokens, 0, "auto")
    assert in_evaluation == fused + z
