"""backend=fla (fla-core's Triton kernels for a per-token decay, stick-breaking and PaTH, CUDA only): where it is
refused, and its wiring (the decay's levels to per-token log decays, the remainder term, the layouts, the scale,
the hooks around the kernel) against the eager backend, with the kernels replaced on the CPU by their formulas;
then fla-core's own kernels, run on the CPU by Triton's interpreter, against the float64 eager model, as
tests/test_cuda.py compares them on a GPU."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from posbench.attention import fla, get_backend
from posbench.attention.select import measured_backend
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled, assert_recurrence_equals_one_pass, make_encoding, needs_interpreter


def forgetting_attention_by_formula(q, k, v, g, scale):
    """softmax_j(scale q_i.k_j + G_i - G_j) v_j over j <= i, G the cumulative sum of g: q, k [B, L, H, K],
    v [B, L, H, V], g [B, L, H] -> [B, L, H, V]."""
    G = g.to(q.dtype).cumsum(1).transpose(1, 2)  # [B, H, L]
    logits = scale * torch.einsum("bihd,bjhd->bhij", q, k) + G[..., :, None] - G[..., None, :]  # [B, H, L, L]
    length = q.shape[1]
    hidden = torch.ones(length, length, dtype=torch.bool).triu(1)  # j > i
    p = logits.masked_fill(hidden, float("-inf")).softmax(-1)  # [B, H, L, L]
    return torch.einsum("bhij,bjhd->bihd", p, v)


def stick_breaking_by_formula(q, k, v, scale, attend_current):
    """A_ij = sigmoid(z_ij) prod_{j < l < i} (1 - sigmoid(z_il)) (l <= i and j <= i with attend_current), z = scale
    q_i.k_j, as products; r_i = 1 - sum_j A_ij: q, k [B, L, H, K], v [B, L, H, V] -> ([B, L, H, V], [B, L, H])."""
    beta = torch.sigmoid(scale * torch.einsum("bihd,bjhd->bhij", q, k))  # [B, H, L, L]
    length = q.shape[1]
    weights = torch.zeros_like(beta)
    for i in range(length):
        stick = torch.ones_like(beta[..., i, 0])  # [B, H]: what the keys nearer the query left
        for j in range(i if attend_current else i - 1, -1, -1):
            weights[..., i, j] = beta[..., i, j] * stick
            stick = stick * (1 - beta[..., i, j])
    return torch.einsum("bhij,bjhd->bihd", weights, v), (1 - weights.sum(-1)).transpose(1, 2)


def path_by_formula(q, k, v, w, beta, g, scale):
    """softmax_j(scale (q_i^T H_i H_(i-1) ... H_(j+1) k_j + G_i - G_j)) v_j over j <= i, H_t = I - beta_t w_t w_t^T,
    the product carried back from the query one transform at a time, G the cumulative sum of g (none: 0):
    q, k, w [B, L, H, K], v [B, L, H, V], beta [B, L, H], g [B, L, H] or None."""
    length = q.shape[1]
    G = torch.zeros(q.shape[0], q.shape[2], length, dtype=q.dtype) if g is None else \
        g.to(q.dtype).cumsum(1).transpose(1, 2)  # [B, H, L]
    logits = torch.full((*q.shape[:1], q.shape[2], length, length), float("-inf"), dtype=q.dtype)  # [B, H, L, L]
    for i in range(length):
        carried = q[:, i]  # [B, H, K]: H_(j+1) ... H_i q_i, H symmetric
        for j in range(i, -1, -1):
            logits[..., i, j] = scale * ((carried * k[:, j]).sum(-1) + G[..., i] - G[..., j])
            carried = carried - beta[:, j, :, None] * w[:, j] * (w[:, j] * carried).sum(-1, keepdim=True)
    return torch.einsum("bhij,bjhd->bihd", logits.softmax(-1), v)


def model(name: str, backend: str, heads: int = 2, **params) -> Transformer:
    torch.manual_seed(0)  # the encoding's initial values too: the same on either backend, whatever ran before
    encoding = make_encoding(name, d_model=16, n_heads=heads, **params)
    net = Transformer(ModelConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=heads), encoding,
                      get_backend(backend, encoding)).double()
    for gate in getattr(encoding, "gates", []):  # gates far from f = 0.5: the decay differs per token and head
        torch.nn.init.normal_(gate.weight, std=1.0)
    return net


def eager_and_fla(build, ids, pos) -> dict:
    """backend -> (logits, every parameter's gradient) of the model build(backend) makes, after one backward of
    sin(logits).sum(), for eager and fla."""
    results = {}
    for backend in ("eager", "fla"):
        net = build(backend).train()
        logits = net(ids, pos)
        logits.sin().sum().backward()
        results[backend] = logits.detach(), {n: p.grad for n, p in net.named_parameters()}
    return results


@pytest.mark.parametrize("name,params", [("fox", {}), ("fox", {"output_norm": True, "output_gate": True}),
                                         ("alibi", {}), ("nope", {})])
def test_the_fla_wiring_gives_the_eager_logits_and_gradients(name, params, monkeypatch):
    monkeypatch.setattr(fla, "fla_refusal", lambda cuda, encoding=None: None)  # the CPU stands in for CUDA
    monkeypatch.setattr(fla, "forgetting_attention", forgetting_attention_by_formula)
    ids = torch.randint(0, 11, (2, 21), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(21)[None] + 2
    results = eager_and_fla(lambda backend: model(name, backend, **params), ids, pos)
    # the kernel takes its decays in float32 (the models here are float64): agreement to float32's rounding
    assert_close_scaled(results["fla"][0], results["eager"][0], rtol=0, atol_scale=1e-6, name="logits")
    for parameter, grad in results["eager"][1].items():
        assert_close_scaled(results["fla"][1][parameter], grad, rtol=1e-5, atol_scale=1e-6, name=parameter)
    if name == "fox":
        assert results["fla"][1]["encoding.gates.0.weight"].abs().sum() > 0  # the gates learn through the kernel


@pytest.mark.parametrize("remainder", ["value", "learned", "none"])
@pytest.mark.parametrize("attend_current", [False, True])
def test_the_fla_stick_breaking_wiring_gives_the_eager_logits_and_gradients(remainder, attend_current, monkeypatch):
    monkeypatch.setattr(fla, "fla_refusal", lambda cuda, encoding=None: None)  # the CPU stands in for CUDA
    monkeypatch.setattr(fla, "stick_breaking_attention", stick_breaking_by_formula)
    ids = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(6))

    def build(backend):
        net = model("stick_breaking", backend, remainder=remainder, attend_current=attend_current)
        if remainder == "learned":
            torch.nn.init.normal_(net.encoding.head_bias, generator=torch.Generator().manual_seed(7))
        return net

    results = eager_and_fla(build, ids, torch.arange(12)[None])
    assert_close_scaled(results["fla"][0], results["eager"][0], rtol=0, atol_scale=1e-12, name="logits")
    for parameter, grad in results["eager"][1].items():
        assert_close_scaled(results["fla"][1][parameter], grad, rtol=1e-9, atol_scale=1e-11, name=parameter)


@pytest.mark.parametrize("name,params", [("path", {}), ("composite", {"parts": ["path", "fox"]})])  # PaTH, PaTH-FoX
def test_the_fla_path_wiring_gives_the_eager_logits_and_gradients(name, params, monkeypatch):
    monkeypatch.setattr(fla, "fla_refusal", lambda cuda, encoding=None: None)  # the CPU stands in for CUDA
    monkeypatch.setattr(fla, "path_attention", path_by_formula)
    ids = torch.randint(0, 11, (2, 10), generator=torch.Generator().manual_seed(8))

    def build(backend):
        net = model(name, backend, heads=1, **params)  # heads of 16 features: the kernel's smallest
        for parameter in net.encoding.parameters():  # transforms far from the identity, gates far from 0.5
            torch.nn.init.normal_(parameter, std=0.5, generator=torch.Generator().manual_seed(9))
        return net

    results = eager_and_fla(build, ids, torch.arange(10)[None])
    tolerance = 1e-6 if params else 1e-12  # FoX's decays reach the kernel in float32 (the models here are float64)
    assert_close_scaled(results["fla"][0], results["eager"][0], rtol=0, atol_scale=tolerance, name="logits")
    for parameter, grad in results["eager"][1].items():
        assert_close_scaled(results["fla"][1][parameter], grad, rtol=1e-3 * tolerance ** 0.5, atol_scale=tolerance,
                            name=parameter)
    beta = "encoding.parts.0.beta.0.weight" if params else "encoding.beta.0.weight"
    assert results["fla"][1][beta].abs().sum() > 0  # the transforms learn through the kernel
    if params:
        assert results["fla"][1]["encoding.parts.1.gates.0.weight"].abs().sum() > 0  # and FoX's gates


@pytest.mark.parametrize("name", ["fox", "stick_breaking", "path"])
def test_segments_after_a_memory_give_one_pass(name, monkeypatch):
    """A segment attending to the last one's keys (wikitext's recurrence) is a call the kernels do not take: it runs
    on sdpa (a decay) or eager, and two segments give the logits of one pass."""
    monkeypatch.setattr(fla, "fla_refusal", lambda cuda, encoding=None: None)
    kernels = {"forgetting_attention": forgetting_attention_by_formula, "path_attention": path_by_formula,
               "stick_breaking_attention": stick_breaking_by_formula}
    for kernel, formula in kernels.items():
        monkeypatch.setattr(fla, kernel, formula)
    net = model(name, "fla", heads=1).eval()
    ids = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # fox: the kernel's decays are float32, sdpa's levels float64
        assert_recurrence_equals_one_pass(net, ids, atol_scale=1e-6 if name == "fox" else 1e-12)


def test_per_token_decays_sum_to_the_level_differences():
    levels = torch.randn(1, 3, 9, dtype=torch.float64).cumsum(-1) * 50  # [1, H, L]
    g = fla.token_log_decay(levels, batch=2)  # [B, L, H]
    assert g.shape == (2, 9, 3) and g.dtype == torch.float32 and not g[:, 0].any()
    G = g.double().cumsum(1).transpose(1, 2)  # [B, H, L]
    want = levels[..., :, None] - levels[..., None, :]  # c_i - c_j
    assert_close_scaled(G[..., :, None] - G[..., None, :], want.expand(2, -1, -1, -1), rtol=1e-6, atol_scale=1e-6,
                        name="G_i - G_j")


def test_fla_is_refused_where_it_cannot_run(monkeypatch):
    fox = make_encoding("fox", d_model=32)
    with pytest.raises(ValueError, match="backend=fla runs on CUDA only"):
        measured_backend("fla", fox, torch.device("cpu"), tokens=16)
    monkeypatch.setattr(fla.importlib.util, "find_spec", lambda name: None)
    assert "pip install 'posbench[fla]'" in fla.fla_refusal(True)
    with pytest.raises(ValueError, match=r"cannot run the \['bias'\] hook.*backends that can: \['sdpa', 'flex', "
                                         r"'eager'\]"):
        fire_t5 = make_encoding("composite", d_model=32, parts=["fire", "t5"])  # two biases: FIRE's kernel takes
        get_backend("fla", fire_t5).check(fire_t5)  # FIRE's alone, the relative one a bias of i - j alone
    dape_v2 = make_encoding("dape", d_model=32, version=2)  # a logit transform with no kernel (v1 has one)
    with pytest.raises(ValueError, match=r"backend=fla cannot run the \['logit_transform'\] hook"):
        get_backend("fla", dape_v2).check(dape_v2)
    stick_and_decay = make_encoding("composite", d_model=32, parts=["stick_breaking", "alibi"])
    # that kernel takes no decay
    with pytest.raises(ValueError, match=r"backend=fla cannot run the \['normalize'\] hook"):
        get_backend("fla", stick_and_decay).check(stick_and_decay)
    bidirectional = make_encoding("fox", d_model=32, causal=False)
    with pytest.raises(ValueError, match="causal attention only"):
        get_backend("fla", bidirectional).check(bidirectional)


def test_path_with_heads_the_kernel_lacks_is_refused_naming_eager(monkeypatch):
    monkeypatch.setattr(fla, "fla_refusal", lambda cuda, encoding=None: None)
    net = model("path", "fla", heads=2)  # heads of 8 features
    with pytest.raises(ValueError, match=r"heads of \[16, 32, 64, 128\] features .*not 8; use backend=eager"):
        net(torch.zeros(1, 5, dtype=torch.long), torch.arange(5)[None])


def test_auto_never_picks_fla():
    for name in ("fox", "alibi", "nope", "stick_breaking", "path", "cope", "dape"):
        assert get_backend("auto", make_encoding(name, d_model=32), torch.device("cpu")).name != "fla"


@pytest.mark.parametrize("name", ["stick_breaking", "path"])
def test_the_guard_counts_no_eager_pairs_for_an_encoding_fla_runs_in_its_kernel(name):
    """stick-breaking's and PaTH's declared extra memory is their eager path's [B, H, L, L] tensors; on fla the
    kernel holds none, and the guard counts only what a fused kernel keeps."""
    import dataclasses

    from posbench import guard
    from posbench.build import build
    from tests.helpers import compose_cfg

    eager = build(compose_cfg(f"encoding={name}", "backend=eager", "device=cpu", "model=small"), torch.device("cpu"))
    on_fla = dataclasses.replace(eager, backend="fla", eval_backends={})
    batch, tokens = 8, 4096
    fused = eager.model.cfg.n_layers * 4.0 * batch * eager.model.cfg.n_heads * tokens * guard.FLOAT
    assert guard.training_attention_bytes(on_fla, batch, tokens) == fused
    assert guard.training_attention_bytes(eager, batch, tokens) > 100 * fused
    with_kernel, _ = guard.attention_bytes(on_fla, None, 4096, batch, tokens, tokens, 0, "auto")
    assert with_kernel == 4.0 * batch * eager.model.cfg.n_heads * tokens * guard.FLOAT


INTERPRETED = """
import sys
import triton.runtime.autotuner as autotuner
autotuner.Autotuner._bench = lambda self, *args, **kwargs: [1.0, 1.0, 1.0]  # no device to time configurations on
import torch
import tests.test_cuda as on_device
from posbench.attention import fla
on_device.CUDA = torch.device("cpu")  # the interpreter runs the kernels on CPU tensors
fla.fla_refusal = lambda cuda, encoding=None: None
for case in sys.argv[1:]:
    for heads in (1, 2):  # heads of 32 and 16 features
        on_device.compare_with_the_cpu_reference(case, True, heads, backend="fla")
        print(case, heads, "matches", flush=True)
"""
KERNEL_CASES = ["fox", "alibi", "nope", "stick_breaking", "path", "composite:path+fox"]


@pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                    reason="fla-core is not installed (posbench[reference] installs it on Linux)")
@needs_interpreter
def test_fla_cores_kernels_through_tritons_interpreter_give_the_float64_eager_model():
    """The kernels themselves (TRITON_INTERPRET=1 runs them on the CPU, in float32): logits within 1e-4 and each
    gradient within 0.5% of the float64 eager model's, the comparison tests/test_cuda.py makes on a GPU."""
    from tests.helpers import ROOT

    done = subprocess.run([sys.executable, "-c", INTERPRETED, *KERNEL_CASES], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.split("\n")[:-1] == [f"{case} {heads} matches" for case in KERNEL_CASES for heads in (1, 2)]


def test_refusals_list_fla_exactly_where_it_runs_the_encoding():
    """backends_that_run (every refusal's list) names fla for an encoding iff fla's check takes it: its kernels
    run logit hooks the hook table gives eager alone, and its bias kernel a bias of i - j alone."""
    from posbench.attention.backend import backends_that_run
    from posbench.encodings import REGISTRY
    from tests.helpers import COMPOSITE_PARTS

    def runs(encoding) -> bool:
        try:
            fla.FlaBackend().check(encoding)
        except ValueError:
            return False
        return True

    single = {name: make_encoding(name, d_model=32) for name in REGISTRY if name != "composite"}
    cases = [*single.values(), *(make_encoding("composite", d_model=32, parts=list(parts)) for parts in COMPOSITE_PARTS),
             make_encoding("kerple", d_model=32, causal=False)]  # fla runs causal models only
    for encoding in cases:
        assert ("fla" in backends_that_run(encoding)) == runs(encoding), encoding.name
    assert all(runs(single[name]) for name in ("cope", "dape", "stick_breaking", "path", "kerple", "t5", "fox", "fire"))
    assert not any(runs(single[name]) for name in ("urpe", "shaw"))
