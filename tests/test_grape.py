"""GRAPE's three forms against their formulas written as loops (float64): the multiplicative rotation with
its learned frequencies (and QK-RMSNorm after it), GRAPE-A's gated bias per head and pair, GRAPE-AP's path sum
of psi over the keys after j, each also inside a whole attention layer computed by hand; the relative trait
both ways, causality, chunked evaluation and training in query blocks equal to one pass, gradients, and the refusals."""
import math

import pytest
import torch
import torch.nn.functional as F

from posbench.attention import Attention, AttentionCall, PositionContext, get_backend
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled, assert_query_blocks_give_one_pass_gradients, make_encoding

D_MODEL, HEADS, HEAD, LENGTH = 16, 2, 8, 7
SLOPES = [2 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)]  # ALiBi's m_h for H = 2: 1/16, 1/256


def drawn_grape(std: float = 0.5, **params):
    """Every parameter drawn N(0, std): far from its initial value."""
    torch.manual_seed(0)
    enc = make_encoding("grape", d_model=D_MODEL, n_heads=HEADS, **params).double()
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=std)
    return enc


def rms_by_hand(x, weight, eps=1e-5):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def turned_by_hand(x, pos, freq):
    """Half layout: pair (m, m + d/2) turns by pos * freq[m]. x [B, H, L, d], pos [B', L]."""
    out = torch.empty_like(x)
    half = x.shape[-1] // 2
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            for i in range(x.shape[2]):
                t = float(pos[b if pos.shape[0] > 1 else 0, i])
                for m in range(half):
                    angle = t * float(freq[m])
                    a, z = x[b, h, i, m], x[b, h, i, m + half]
                    out[b, h, i, m] = a * math.cos(angle) - z * math.sin(angle)
                    out[b, h, i, m + half] = z * math.cos(angle) + a * math.sin(angle)
    return out


def additive_by_hand(enc, q, k, q_pos, k_pos, layer):
    """b_h(i, j) = -(i - j) softplus(o_h) m_h [softplus(v^_h.q_i / sqrt d) + softplus(u^_h.k_j / sqrt d)]."""
    out = torch.zeros(q.shape[0], HEADS, q.shape[2], k.shape[2], dtype=q.dtype)
    for h in range(HEADS):
        u = enc.u[layer, h] / enc.u[layer, h].norm()
        v = enc.v[layer, h] / enc.v[layer, h].norm()
        rate = math.log1p(math.exp(float(enc.rate_logit[layer, h].detach()))) * SLOPES[h]
        for b in range(q.shape[0]):
            for i in range(q.shape[2]):
                for j in range(k.shape[2]):
                    gates = F.softplus(v @ q[b, h, i] / math.sqrt(HEAD)) + F.softplus(u @ k[b, h, j] / math.sqrt(HEAD))
                    out[b, h, i, j] = -int(q_pos[0, i] - k_pos[0, j]) * rate * gates
    return out


def path_by_hand(enc, x, pos, layer):
    """b(t, j) = sum_{l = j+1..t} m_h logsigmoid(p_t . R_l rmsnorm(p_l) / d_p), R_l turning every plane by l
    radians; x [B, L, D], pos [1, L] -> [B, H, L, L] (zero for j >= t)."""
    d_p = enc.p_dim
    p = (x @ enc.w_p[layer].weight.T).view(x.shape[0], x.shape[1], HEADS, d_p).transpose(1, 2)  # [B, H, L, d_p]
    keys = turned_by_hand(rms_by_hand(p, 1.0, eps=torch.finfo(p.dtype).eps), pos, [1.0] * (d_p // 2))
    out = torch.zeros(x.shape[0], HEADS, x.shape[1], x.shape[1], dtype=x.dtype)
    for b in range(x.shape[0]):
        for h in range(HEADS):
            for t in range(x.shape[1]):
                for j in range(t + 1):
                    out[b, h, t, j] = sum(SLOPES[h] * F.logsigmoid(p[b, h, t] @ keys[b, h, l] / d_p)
                                          for l in range(j + 1, t + 1))
    return out


def attention_by_hand(x, attn, enc, bias):
    """o_i = sum_{j<=i} softmax_j(q_i.k_j / sqrt(d) + bias_ij) v_j, q and k after QK-RMSNorm."""
    b, length, _ = x.shape
    q, k, v = (t.view(b, length, HEADS, HEAD).transpose(1, 2) for t in (x @ attn.qkv.weight.T).split(D_MODEL, -1))
    q, k = rms_by_hand(q, enc.norm_weight[attn.layer, 0]), rms_by_hand(k, enc.norm_weight[attn.layer, 1])
    extra, out = bias(q, k), torch.zeros_like(q)
    for s in range(b):
        for h in range(HEADS):
            for i in range(length):
                logits = torch.stack([q[s, h, i] @ k[s, h, j] / math.sqrt(HEAD) + extra[s, h, i, j]
                                      for j in range(i + 1)])
                out[s, h, i] = logits.softmax(0) @ v[s, h, :i + 1]
    return out.transpose(1, 2).reshape(b, length, D_MODEL) @ attn.out.weight.T


def layer_of(enc, layer=1):
    torch.manual_seed(1)
    attn = Attention(D_MODEL, HEADS, layer, enc, get_backend("auto", enc), True).double()
    assert attn.backend.name == ("sdpa" if enc.form == "multiplicative" else "eager")
    return attn


def model_of(enc, causal=True):
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS, causal=causal)
    return Transformer(cfg, enc, get_backend("auto", enc)).double().eval()


# --- multiplicative --------------------------------------------------------------------------------

def test_multiplicative_starts_at_rope_frequencies():
    enc = make_encoding("grape", d_model=D_MODEL, n_heads=HEADS, base=500.0)
    expected = torch.tensor([16 * math.log(500.0 ** (-2 * m / HEAD)) for m in range(HEAD // 2)])
    assert enc.log_freq.dtype == torch.float32 and enc.log_freq.shape == (2, HEAD // 2)
    for layer in (0, 1):
        assert_close_scaled(enc.log_freq[layer].detach(), expected, rtol=1e-6, name=f"log_freq {layer}")


@pytest.mark.parametrize("qk_norm", [False, True])
def test_multiplicative_rotation_matches_the_formula(qk_norm):
    enc = drawn_grape(qk_norm=qk_norm)
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 2, HEADS, 5, HEAD, generator=gen, dtype=torch.float64)
    q_pos, k_pos = torch.tensor([[3, 4, 5, 6, 7], [40, 41, 42, 43, 44]]), torch.arange(5)[None]
    for layer in (0, 1):
        freq = [math.exp(float(w) / 16) for w in enc.log_freq[layer].detach()]
        expected_q, expected_k = turned_by_hand(q, q_pos, freq), turned_by_hand(k, k_pos, freq)
        if qk_norm:  # after the rotation, as the paper
            expected_q = rms_by_hand(expected_q, enc.norm_weight[layer, 0])
            expected_k = rms_by_hand(expected_k, enc.norm_weight[layer, 1])
        got_q, got_k = enc.qk(q, k, q_pos, k_pos, layer)
        assert_close_scaled(got_q, expected_q.detach(), rtol=1e-12, name=f"q, layer {layer}")
        assert_close_scaled(got_k, expected_k.detach(), rtol=1e-12, name=f"k, layer {layer}")


# --- multiplicative_ctx (GRAPE-M-ctx) -------------------------------------------------------------------

def test_contextual_form_starts_as_the_official_code():
    enc = make_encoding("grape", d_model=D_MODEL, n_heads=HEADS, form="multiplicative_ctx")
    gate = torch.sigmoid(enc.ctx_b.detach() / 16)  # u = 0: every token's w
    assert_close_scaled(gate, torch.full((2,), 0.394), rtol=2e-3, name="w at start")
    assert torch.all(enc.ctx_u == 0) and not enc.qk_norm
    expected = torch.tensor([10000.0 ** (-2 * m / HEAD) for m in range(HEAD // 2)])
    assert_close_scaled(enc.ctx_theta[1].detach(), expected, rtol=1e-6, name="theta at start")


@pytest.mark.parametrize("qk_norm", [False, True])
def test_contextual_phases_match_the_formula(qk_norm):
    """Plane m of token t turns by Phi_t theta_m, Phi_t = sum_{tau < t} sigmoid((u.x_tau + b) / 16), then the norm."""
    enc = drawn_grape(form="multiplicative_ctx", qk_norm=qk_norm)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, D_MODEL, generator=gen, dtype=torch.float64)
    q, k, v = torch.randn(3, 2, HEADS, 6, HEAD, generator=gen, dtype=torch.float64)
    pos = torch.arange(6)[None]
    layer = 1
    call = AttentionCall(enc, pos, pos, layer, True, x=x)
    got_q, got_k, got_v = enc.qkv(q, k, v, call)
    got_q, got_k = enc.qk(got_q, got_k, pos, pos, layer) if qk_norm else (got_q, got_k)
    u, b = enc.ctx_u[layer].detach(), float(enc.ctx_b[layer])
    theta = enc.ctx_theta[layer].detach()
    for s in range(2):
        phases = []
        for t in range(6):
            phases.append(sum(1 / (1 + math.exp(-(float(u @ x[s, tau]) + b) / 16)) for tau in range(t)))
        phase_pos = torch.tensor([phases], dtype=torch.float64)  # Phi as a position: [1, L]
        expected_q = turned_by_hand(q[s:s + 1], phase_pos, theta)
        expected_k = turned_by_hand(k[s:s + 1], phase_pos, theta)
        if qk_norm:
            expected_q = rms_by_hand(expected_q, enc.norm_weight[layer, 0]).detach()
            expected_k = rms_by_hand(expected_k, enc.norm_weight[layer, 1]).detach()
        assert_close_scaled(got_q[s:s + 1].detach(), expected_q, rtol=1e-12, name=f"q, sequence {s}")
        assert_close_scaled(got_k[s:s + 1].detach(), expected_k, rtol=1e-12, name=f"k, sequence {s}")
    assert got_v is v


def shift_change(enc) -> float:
    model = model_of(enc)
    ids = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(4))
    base = model(ids, torch.arange(12)[None])
    return max((model(ids, torch.arange(12)[None] + s) - base).abs().max().item() for s in (1, 37, 1000))


@pytest.mark.parametrize("params,relative", [({}, True), ({"qk_norm": True}, False), ({"form": "additive"}, True),
                                             ({"form": "multiplicative_ctx"}, True),
                                             ({"form": "multiplicative_ctx", "qk_norm": True}, True),
                                             ({"form": "additive", "qk_norm": False}, True),
                                             ({"form": "path"}, False)])
def test_the_relative_trait_matches_a_shift_of_every_position(params, relative):
    enc = drawn_grape(**params)
    assert enc.relative is relative
    assert (shift_change(enc) < 1e-9) if relative else (shift_change(enc) > 1e-6)


# --- additive (GRAPE-A) ----------------------------------------------------------------------------

def test_additive_starts_as_the_paper():
    torch.manual_seed(5)
    enc = make_encoding("grape", d_model=64, n_heads=4, max_positions=64, form="additive")
    assert torch.allclose(F.softplus(enc.rate_logit), torch.ones(2, 4))
    spread = torch.cat([enc.u.flatten(), enc.v.flatten()]).std().item()  # N(0, 1/d), d = 16
    assert abs(spread / 0.25 - 1) < 0.1
    assert enc.hooks == {"qk", "key_term"} and enc.qk_norm  # the paper's QK-RMSNorm


def test_additive_term_matches_the_formula():
    enc = drawn_grape(form="additive")
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, 2, HEADS, 6, HEAD, generator=gen, dtype=torch.float64)
    q_pos, k_pos = torch.arange(3, 9)[None], torch.arange(2, 8)[None]
    for layer in (0, 1):
        got = enc.key_term(q, k, q_pos, k_pos, layer)
        expected = additive_by_hand(enc, q, k, q_pos, k_pos, layer).detach()
        assert_close_scaled(got, expected, rtol=1e-12, name=f"bias, layer {layer}")


def test_additive_attention_is_the_formula():
    enc = drawn_grape(form="additive")
    attn = layer_of(enc)
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    pos = torch.arange(LENGTH)[None]
    with torch.no_grad():
        got = attn(x, PositionContext(enc, pos))
        expected = attention_by_hand(x, attn, enc, lambda q, k: additive_by_hand(enc, q, k, pos, pos, 1))
    assert_close_scaled(got, expected, rtol=1e-12)


def test_additive_with_even_gates_is_alibi_times_a_gate():
    """u, v orthogonal to every q and k: each gate is softplus(0) = log 2, so b = -2 log 2 m_h (i - j)."""
    enc = drawn_grape(form="additive")
    with torch.no_grad():
        enc.rate_logit.fill_(math.log(math.expm1(1.0)))
        enc.u.zero_()[..., 0] = 1.0
        enc.v.zero_()[..., 1] = 1.0
    q, k = torch.randn(2, 1, HEADS, 5, HEAD, dtype=torch.float64)
    q[..., :2], k[..., :2] = 0.0, 0.0
    pos = torch.arange(5)[None]
    distance = (pos[0, :, None] - pos[0, None, :]).double()  # [L, L]
    expected = torch.stack([-2 * math.log(2) * m * distance for m in SLOPES])[None]  # [1, H, L, L]
    assert_close_scaled(enc.key_term(q, k, pos, pos, 0), expected, rtol=1e-14)


# --- path (GRAPE-AP) -------------------------------------------------------------------------------

def test_path_term_matches_the_formula():
    enc = drawn_grape(form="path")
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    pos = torch.arange(5, 5 + LENGTH)[None]  # absolute key positions from 5
    q, k = torch.zeros(2, 2, HEADS, LENGTH, HEAD, dtype=torch.float64)
    logits = torch.randn(2, HEADS, LENGTH, LENGTH, dtype=torch.float64)
    with torch.no_grad():
        for layer in (0, 1):
            call = AttentionCall(enc, pos, pos, layer, True, x=x)
            expected = logits + path_by_hand(enc, x, pos, layer)
            assert_close_scaled(enc.logit_transform(logits, q, k, call), expected, rtol=1e-12, name=f"layer {layer}")
            # one block: queries 4.. against keys 2..6 of a call whose x starts at the layer's first key
            block = AttentionCall(enc, pos[:, 4:], pos[:, 2:], layer, True, x=x, first_key=2)
            got = enc.logit_transform(logits[..., 4:, 2:], q[..., 4:, :], k[..., 2:, :], block)
            assert_close_scaled(got, expected[..., 4:, 2:], rtol=1e-12, name=f"block, layer {layer}")


def test_path_attention_is_the_formula():
    enc = drawn_grape(form="path")
    attn = layer_of(enc)
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    pos = torch.arange(LENGTH)[None]
    with torch.no_grad():
        got = attn(x, PositionContext(enc, pos))
        bias = path_by_hand(enc, x, pos, 1)
        expected = attention_by_hand(x, attn, enc, lambda q, k: bias)
    assert_close_scaled(got, expected, rtol=1e-12)


# --- every form ------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["multiplicative", "multiplicative_ctx", "additive", "path"])
def test_chunked_evaluation_and_causality(form):
    model = model_of(drawn_grape(form=form))
    ids = torch.randint(0, 11, (2, 20), generator=torch.Generator().manual_seed(10))
    pos = torch.arange(20)[None]
    reference = model(ids, pos)
    model.set_eval_chunk(6)
    assert_close_scaled(model(ids, pos), reference, rtol=0, atol_scale=1e-12, name="chunked logits")
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 11
    assert_close_scaled(model(changed, pos)[:, :12], reference[:, :12], rtol=0, atol_scale=1e-12, name="past logits")
    assert (model(changed, pos)[:, 12:] - reference[:, 12:]).abs().max() > 1e-3


@pytest.mark.parametrize("form", ["additive", "path"])
def test_training_in_query_blocks_gives_the_one_pass_gradients(form, monkeypatch):
    def make_net():
        enc = drawn_grape(form=form)
        torch.manual_seed(11)
        cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS)
        return Transformer(cfg, enc, get_backend("eager")).double()

    tokens = torch.randint(0, 11, (2, 15), generator=torch.Generator().manual_seed(12))
    assert_query_blocks_give_one_pass_gradients(make_net, tokens, monkeypatch)


@pytest.mark.parametrize("params", [{}, {"qk_norm": True}, {"form": "additive"}, {"form": "path"},
                                    {"form": "multiplicative_ctx"}])
def test_gradients_reach_every_parameter(params):
    enc = drawn_grape(**params)
    model = model_of(enc).train()
    model(torch.randint(0, 11, (2, 9)), torch.arange(9)[None]).sin().sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0 for p in enc.parameters())


def test_the_hooks_follow_the_form():
    assert make_encoding("grape").hooks == {"qk"}
    assert make_encoding("grape", form="additive", qk_norm=False).hooks == {"key_term"}
    assert make_encoding("grape", form="path").hooks == {"qk", "logit_transform"}
    assert make_encoding("grape", form="path", qk_norm=False).hooks == {"logit_transform"}
    assert make_encoding("grape", causal=False).hooks == {"qk"}  # multiplicative runs bidirectional
    assert make_encoding("grape", form="multiplicative_ctx").hooks == {"qkv"}
    assert make_encoding("grape", form="multiplicative_ctx", qk_norm=True).hooks == {"qkv", "qk"}


@pytest.mark.parametrize("params,message", [
    ({"form": "ctx"},
     r"grape: encoding.form='ctx' is not valid; choose one of \['multiplicative', 'multiplicative_ctx', 'additive', "
     r"'path'\]"),
    ({"qk_norm": "yes"}, r"grape: encoding.qk_norm='yes': must be true or false, or null"),
    ({"base": 0.5}, r"grape: encoding.base=0.5: must be > 1"),
    ({"form": "path", "p_dim": 7}, r"grape: encoding.p_dim=7: must be even"),
    ({"p_dim": 0}, r"grape: encoding.p_dim=0: must be >= 2"),
])
def test_bad_parameters_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        make_encoding("grape", **params)


@pytest.mark.parametrize("form", ["additive", "path"])
def test_a_bidirectional_model_is_refused(form):
    with pytest.raises(ValueError, match=f"grape: encoding.form={form} .*set model.causal=true"):
        make_encoding("grape", form=form, causal=False)
