"""CABLE (Veisi et al. 2025): the decay levels against the paper's bias built as an [L, L] loop of softplus sums,
a layer's attention against that bias added to q.k (unscaled, as the released code, and / sqrt(d)) on every
backend, causality, sdpa against eager through the model (outputs and gradients), chunked evaluation equal to
one pass, shift invariance of the position ids, and the refusals of bad settings."""
import math

import pytest
import torch
import torch.nn.functional as F

from posbench.attention import AttentionCall, PositionContext, get_backend
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_chunks_equal_one_pass, assert_close_scaled, make_encoding, token_ids

D_MODEL, HEADS, LENGTH = 16, 2, 9
HEAD = D_MODEL // HEADS


def cable_bias_by_hand(x, gate):
    """The paper's bias: -sum_{s=j+1..i} softplus(w_h . x_s + c_h) for j <= i, one pair at a time. x: [B, L, D]
    -> [B, H, L, L] (zero above the diagonal, never read there)."""
    b, length, _ = x.shape
    z = x @ gate.weight.T + gate.bias  # [B, L, H]
    bias = torch.zeros(b, HEADS, length, length, dtype=x.dtype)
    for s in range(b):
        for h in range(HEADS):
            for i in range(length):
                for j in range(i + 1):
                    bias[s, h, i, j] = -sum(math.log1p(math.exp(z[s, t, h].item())) for t in range(j + 1, i + 1))
    return bias


def cable_attention_by_hand(x, attn, gate, scale):
    """o_i = sum_{j<=i} softmax_j(q_i.k_j * scale + bias_ij) v_j, projected."""
    b, length, _ = x.shape
    q, k, v = (t.view(b, length, HEADS, HEAD) for t in (x @ attn.qkv.weight.T).split(D_MODEL, dim=-1))
    bias = cable_bias_by_hand(x, gate)
    out = torch.zeros(b, length, HEADS, HEAD, dtype=x.dtype)
    for s in range(b):
        for h in range(HEADS):
            for i in range(length):
                logits = torch.stack([q[s, i, h] @ k[s, j, h] * scale + bias[s, h, i, j] for j in range(i + 1)])
                out[s, i, h] = logits.softmax(0) @ v[s, :i + 1, h]
    return out.reshape(b, length, D_MODEL) @ attn.out.weight.T


def cable_model(backend: str = "eager", **params) -> Transformer:
    torch.manual_seed(0)
    enc = make_encoding("cable", d_model=D_MODEL, n_heads=HEADS, **params)
    cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS)
    model = Transformer(cfg, enc, get_backend(backend, enc)).double()
    for gate in enc.gates:  # far from softplus(0) = ln 2 everywhere: the bias differs per token and head
        torch.nn.init.normal_(gate.weight, std=1.0)
        torch.nn.init.normal_(gate.bias, std=1.0)
    return model


def test_cable_levels_give_the_papers_bias():
    enc = cable_model().encoding
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(LENGTH)[None]
    levels = enc.decay(AttentionCall(enc, pos, pos, 1, True, x=x))  # [B, H, L]
    assert levels.dtype == torch.float64 and levels.shape == (2, HEADS, LENGTH)
    got = (levels[..., :, None] - levels[..., None, :]).tril()  # b_i - b_j for j <= i: [B, H, L, L]
    assert_close_scaled(got, cable_bias_by_hand(x, enc.gates[1]), rtol=0, atol_scale=1e-12)  # sums grow with L
    # b_t itself: minus the inclusive sum up to t
    z = x @ enc.gates[1].weight.T + enc.gates[1].bias  # [B, L, H]
    assert_close_scaled(levels, -F.softplus(z).cumsum(1).transpose(1, 2), rtol=0, atol_scale=1e-12)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
@pytest.mark.parametrize("logit_scale", ["none", "sqrt_d"])
def test_cable_attention_is_the_papers_formula(backend, logit_scale):
    model = cable_model(backend, logit_scale=logit_scale).eval()
    if backend == "flex":
        model.blocks[0].attn.backend.compiled = False
    attn = model.blocks[0].attn
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = attn(x, PositionContext(model.encoding, torch.arange(LENGTH)[None]))
    scale = 1.0 if logit_scale == "none" else 1 / math.sqrt(HEAD)
    expected = cable_attention_by_hand(x, attn, model.encoding.gates[0], scale)
    assert_close_scaled(got, expected, rtol=1e-12)
    assert model.encoding.params() == {"logit_scale": logit_scale}


def test_cable_is_causal():
    model = cable_model().eval()
    ids, pos = token_ids(20), torch.arange(20)[None]
    reference = model(ids, pos)
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 11
    out = model(changed, pos)
    assert_close_scaled(out[:, :12], reference[:, :12], rtol=0, atol_scale=1e-12, name="past logits")
    assert (out[:, 12:] - reference[:, 12:]).abs().max() > 1e-3


@pytest.mark.parametrize("logit_scale", ["none", "sqrt_d"])
def test_cable_sdpa_matches_eager_through_the_model(logit_scale):
    ids, pos = token_ids(30), torch.arange(30)[None]
    outs, grads = [], []
    for backend in ("eager", "sdpa"):
        model = cable_model(backend, logit_scale=logit_scale).train()
        out = model(ids, pos)
        out.sin().sum().backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert_close_scaled(outs[1], outs[0], rtol=1e-10, name="logits")
    assert grads[1]["encoding.gates.1.bias"].abs().sum() > 0
    for name, grad in grads[0].items():
        assert_close_scaled(grads[1][name], grad, rtol=1e-9, atol_scale=1e-11, name=name)


def test_cable_chunked_evaluation_gives_one_pass():
    model = cable_model("sdpa").eval()
    assert_chunks_equal_one_pass(model, token_ids(20), torch.arange(20)[None], chunks=(1, 6, 19))


def test_cable_reads_no_position_id():
    model = cable_model().eval()
    ids = token_ids(12)
    base = model(ids, torch.arange(12)[None])
    for shift in (1, 37, 1000):
        assert_close_scaled(model(ids, torch.arange(12)[None] + shift), base, rtol=0, atol_scale=1e-12)
    assert model.encoding.relative


def test_cable_refuses_bad_settings():
    with pytest.raises(ValueError, match=r"cable: encoding.logit_scale='sqrt' is not valid; choose one of "
                                         r"\['none', 'sqrt_d'\]"):
        make_encoding("cable", logit_scale="sqrt")
    with pytest.raises(ValueError, match="cable: .*causal sum; set model.causal=true"):
        make_encoding("cable", causal=False)
