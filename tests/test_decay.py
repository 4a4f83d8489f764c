"""The decay hook (logits + c_i - c_j) and the query scale: FoX and causal ALiBi against their papers'
formulas written as loops, SSMax against its formula, every backend against eager, gradients
through the mask-free kernel's extra column, and the chunk-relative levels exact in float32 at
32k tokens against a float64 reference."""
import math

import pytest
import torch
import torch.nn.functional as F

from posbench.attention import Attention, AttentionCall, PositionContext, get_backend
from posbench.encodings.alibi import alibi_slopes
from posbench.model import ModelConfig, Transformer
from tests.helpers import (assert_chunks_equal_one_pass, assert_close_scaled, assert_recurrence_equals_one_pass,
                           make_encoding)

D_MODEL, HEADS, LENGTH = 16, 2, 9
HEAD = D_MODEL // HEADS


def fox_by_hand(x, attn, gate):
    """Lin et al.'s forgetting attention, one query and key at a time (float64), projected."""
    return fox_heads_by_hand(x, attn, gate) @ attn.out.weight.T


def shifted_by_hand(t, x, weight):
    """The official ShiftLinear after the projection, one token at a time: t_i <- a_i t_{i-1} + (1 - a_i) t_i
    per head, a_i = sigmoid(w . x_i), t_{-1} = 0. t: [B, L, H, d], weight: [H, D]."""
    a = torch.sigmoid(x @ weight.T)  # [B, L, H]
    out = torch.zeros_like(t)
    for s in range(t.shape[0]):
        for i in range(t.shape[1]):
            previous = t[s, i - 1] if i else torch.zeros_like(t[s, i])
            out[s, i] = a[s, i, :, None] * previous + (1 - a[s, i, :, None]) * t[s, i]
    return out


def fox_heads_by_hand(x, attn, gate, k_shift=None, v_shift=None):
    """The heads' output [B, L, D] before the projection:
    o_i = sum_{j<=i} softmax_j(q_i.k_j / sqrt(d) + sum_{l=j+1..i} log f_l) v_j, f_l = sigmoid(w . x_l + b);
    k and v shifted first where their shift weights are given."""
    b, length, _ = x.shape
    q, k, v = (t.view(b, length, HEADS, HEAD) for t in (x @ attn.qkv.weight.T).split(D_MODEL, dim=-1))
    k = k if k_shift is None else shifted_by_hand(k, x, k_shift)
    v = v if v_shift is None else shifted_by_hand(v, x, v_shift)
    log_f = F.logsigmoid(x @ gate.weight.T + gate.bias)  # [B, L, H]
    out = torch.zeros(b, length, HEADS, HEAD, dtype=x.dtype)
    for s in range(b):
        for h in range(HEADS):
            for i in range(length):
                logits = torch.stack([q[s, i, h] @ k[s, j, h] / math.sqrt(HEAD) + log_f[s, j + 1:i + 1, h].sum()
                                      for j in range(i + 1)])
                out[s, i, h] = logits.softmax(0) @ v[s, :i + 1, h]
    return out.reshape(b, length, D_MODEL)


def fox_model(backend: str, **params) -> Transformer:
    torch.manual_seed(0)
    enc = make_encoding("fox", d_model=D_MODEL, n_heads=HEADS, **params)
    cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS)
    model = Transformer(cfg, enc, get_backend(backend, enc)).double()
    for gate in enc.gates:  # gates far from f = 0.5, so that the decay differs per token and head
        torch.nn.init.normal_(gate.weight, std=1.0)
        torch.nn.init.normal_(gate.bias, std=1.0)
    return model


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
def test_fox_attention_is_the_papers_formula(backend):
    model = fox_model(backend).eval()
    if backend == "flex":
        model.blocks[0].attn.backend.compiled = False
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(LENGTH)[None]
    attn = model.blocks[0].attn
    with torch.no_grad():
        got = attn(x, PositionContext(model.encoding, pos))
    assert_close_scaled(got, fox_by_hand(x, attn, model.encoding.gates[0]), rtol=1e-12)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_fox_pro_output_norm_and_gate_follow_the_official_layer(backend):
    """The official layer's order (ForgettingAttentionLayer with use_output_norm and use_output_gate):
    o -> a group RMSNorm over each head's features (eps 1e-6, a weight of d_model features) -> times
    sigmoid(x W_o^T) -> the output projection."""
    model = fox_model(backend, output_norm=True, output_gate=True).eval()
    enc, attn = model.encoding, model.blocks[1].attn
    with torch.no_grad():
        enc.output_norm_weight.normal_(1.0, 0.5)  # away from ones, so a weight applied per the wrong head fails
        for gate in enc.output_gates:
            gate.weight.normal_(0.0, 1.0)
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    o = fox_heads_by_hand(x, attn, enc.gates[1]).view(2, LENGTH, HEADS, HEAD)  # [B, L, H, d]
    normed = o / (o.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    weight = enc.output_norm_weight[1].reshape(D_MODEL)  # as the official layer holds it: d_model features
    gated = normed.reshape(2, LENGTH, D_MODEL) * weight * torch.sigmoid(x @ enc.output_gates[1].weight.T)
    with torch.no_grad():
        got = attn(x, PositionContext(enc, torch.arange(LENGTH)[None]))
    assert_close_scaled(got, gated @ attn.out.weight.T, rtol=1e-12)
    assert enc.hooks == {"decay", "output"} and enc.params()["output_gate"] is True


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("shifts", [("k",), ("v",), ("k", "v")])
def test_fox_pro_token_shifts_follow_the_official_shift_linear(backend, shifts):
    """k_shift / v_shift: the projected keys / values mixed with the previous token's by a per-head gate from
    the layer input, before the attention (ShiftLinear in the official layer)."""
    params = {f"{name}_shift": True for name in shifts}
    model = fox_model(backend, **params).eval()
    enc, attn = model.encoding, model.blocks[1].attn
    with torch.no_grad():
        for name in shifts:  # gates far from a = 0.5, different per head
            getattr(enc, f"{name}_shifts")[1].weight.normal_(0.0, 1.0)
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    weights = {f"{name}_shift": getattr(enc, f"{name}_shifts")[1].weight for name in shifts}
    with torch.no_grad():
        got = attn(x, PositionContext(enc, torch.arange(LENGTH)[None]))
    expected = fox_heads_by_hand(x, attn, enc.gates[1], **weights) @ attn.out.weight.T
    assert_close_scaled(got, expected, rtol=1e-12)
    assert enc.hooks == {"decay", "kv"} and all(enc.params()[key] for key in weights)


def test_fox_token_shifts_in_chunks_and_after_a_memory_give_one_pass():
    model = fox_model("eager", k_shift=True, v_shift=True).eval()
    with torch.no_grad():
        for shift in (*model.encoding.k_shifts, *model.encoding.v_shifts):
            shift.weight.normal_(0.0, 1.0)
    ids = torch.randint(0, 11, (2, 20), generator=torch.Generator().manual_seed(4))
    assert_chunks_equal_one_pass(model, ids, torch.arange(20)[None], chunks=(1, 6, 19))
    assert_recurrence_equals_one_pass(model, ids)


def test_fox_gates_get_the_eager_gradient_through_the_extra_column():
    ids = torch.randint(0, 11, (2, 40), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(40)[None]
    grads = []
    for backend in ("eager", "sdpa"):
        model = fox_model(backend).train()
        model(ids, pos).sin().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[1]["encoding.gates.0.weight"].abs().sum() > 0
    for name, grad in grads[0].items():
        assert_close_scaled(grads[1][name], grad, rtol=1e-9, atol_scale=1e-11, name=name)  # up to ~500


@pytest.mark.parametrize("columns", [3, 8])
def test_the_decay_columns_padded_as_on_cuda_give_the_one_column_logits_and_gradients(columns, monkeypatch):
    """On CUDA zero columns follow the decay's up to a multiple of 8 (a head of 17 leaves the fused kernels);
    forced here on the CPU: a pass, a pass in query blocks (a layer's decay room, written block by block) and
    the gradients equal one column's."""
    from posbench.attention import layer, sdpa

    ids = torch.randint(0, 11, (2, 30), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(30)[None]

    def run(columns_used):
        with monkeypatch.context() as patch:
            patch.setattr(sdpa, "decay_columns", lambda q: columns_used)
            model = fox_model("sdpa").train()
            logits = model(ids, pos)
            logits.sin().sum().backward()
            patch.setattr(layer, "DECAY_CHUNK", 7)  # blocks of 7 queries in evaluation
            with torch.no_grad():
                blocked = model.eval()(ids, pos)
        return logits.detach(), blocked, {n: p.grad for n, p in model.named_parameters()}

    one, padded = run(1), run(columns)
    assert_close_scaled(padded[0], one[0], rtol=0, atol_scale=1e-12, name="logits")
    assert_close_scaled(padded[1], one[1], rtol=0, atol_scale=1e-12, name="logits in blocks")
    assert_close_scaled(padded[1], one[0], rtol=0, atol_scale=1e-12, name="blocks against one pass")
    for name, grad in one[2].items():
        assert_close_scaled(padded[2][name], grad, rtol=1e-9, atol_scale=1e-11, name=name)


def test_decay_columns_keep_cuda_heads_a_multiple_of_8():
    from posbench.attention.sdpa import decay_columns

    assert decay_columns(torch.zeros(1, 1, 1, 16)) == 1  # CPU: the decay's column alone
    stand_in = type("CudaHead", (), {"is_cuda": True, "shape": None})  # the rule reads is_cuda and the shape
    for width, columns in ((16, 8), (15, 1), (8, 8), (17, 7), (64, 8), (7, 1)):
        stand_in.shape = (1, 1, 1, width)
        assert decay_columns(stand_in) == columns and (width + columns) % 8 == 0


def test_fox_levels_are_a_float64_cumulative_sum_of_log_forget_gates():
    model = fox_model("sdpa")
    enc = model.encoding
    x = torch.randn(1, 5, D_MODEL, dtype=torch.float64)
    levels = enc.decay(AttentionCall(enc, torch.arange(5)[None], torch.arange(5)[None], 1, True, x=x))
    log_f = F.logsigmoid(x @ enc.gates[1].weight.T + enc.gates[1].bias)[0].T  # [H, L]
    expected = torch.stack([log_f[:, :i + 1].sum(-1) for i in range(5)], dim=-1)  # [H, L]
    assert levels.dtype == torch.float64 and levels.shape == (1, HEADS, 5)
    assert_close_scaled(levels[0], expected, rtol=0, atol_scale=1e-12)  # a sum: levels grow with the length


def test_fox_qk_norm_and_rope_follow_their_formulas():
    enc = make_encoding("fox", d_model=D_MODEL, n_heads=HEADS, qk_norm=True, rope=True).double()
    torch.nn.init.normal_(enc.norm_weight)
    assert enc.hooks == {"decay", "qk"}
    q, k = torch.randn(2, 2, HEADS, LENGTH, HEAD, dtype=torch.float64)
    pos = torch.arange(3, 3 + LENGTH)[None]
    got_q, got_k = enc.qk(q, k, pos, pos, 1)
    w_q, w_k = enc.norm_weight[1]
    normed = q / torch.sqrt((q * q).mean(-1, keepdim=True) + 1e-6) * w_q  # RMSNorm per head

    def rotate_half(t, positions, base=500000.0):  # GPT-NeoX layout: pairs (x_m, x_{m + d/2})
        half = HEAD // 2
        angle = positions[0, :, None].double() * base ** (-torch.arange(half, dtype=torch.float64) * 2 / HEAD)
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1)

    assert_close_scaled(got_q, rotate_half(normed, pos), rtol=1e-12)
    normed_k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + 1e-6) * w_k
    assert_close_scaled(got_k, rotate_half(normed_k, pos), rtol=1e-12)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_causal_alibi_as_a_decay_is_the_papers_linear_bias(backend):
    enc = make_encoding("alibi", d_model=D_MODEL, n_heads=HEADS)
    assert enc.hooks == {"decay"} and make_encoding("alibi", causal=False).hooks == {"bias"}
    torch.manual_seed(3)
    attn = Attention(D_MODEL, HEADS, 0, enc, get_backend(backend, enc), causal=True).double()
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64)
    pos = torch.arange(5, 5 + LENGTH)[None]
    q, k, v = (t.view(2, LENGTH, HEADS, HEAD).transpose(1, 2) for t in (x @ attn.qkv.weight.T).split(D_MODEL, -1))
    slopes = torch.tensor([2.0 ** (-8 * h / HEADS) for h in range(1, HEADS + 1)], dtype=torch.float64)
    distance = (pos[0, :, None] - pos[0, None, :]).double()  # i - j
    logits = q @ k.transpose(-1, -2) / math.sqrt(HEAD) - slopes[:, None, None] * distance
    logits = logits.masked_fill(distance < 0, float("-inf"))
    expected = (logits.softmax(-1) @ v).transpose(1, 2).reshape(2, LENGTH, D_MODEL) @ attn.out.weight.T
    with torch.no_grad():
        assert_close_scaled(attn(x, PositionContext(enc, pos)), expected, rtol=1e-12)


def test_composite_decays_add_their_levels():
    enc = make_encoding("composite", d_model=D_MODEL, n_heads=HEADS, parts=["alibi", "fox"]).double()
    x = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    call = AttentionCall(enc, torch.arange(6)[None], torch.arange(6)[None], 0, True, x=x)
    alibi, fox = enc.parts
    torch.testing.assert_close(enc.decay(call), alibi.decay(call) + fox.decay(call), rtol=0, atol=0)
    assert enc.hooks == {"decay"} and enc.relative  # neither reads a position id beyond i - j


def selected_rows_by_hand(x, attn, rows, bias_row):
    """Attention output of query rows `rows` in float64, every key j <= i, logits + bias_row(i) [H, i+1]."""
    q, k, v = (t.view(x.shape[1], HEADS, HEAD).transpose(0, 1) for t in (x[0] @ attn.qkv.weight.T).split(D_MODEL, -1))
    out = []
    for i in rows:
        logits = q[:, i:i + 1] @ k[:, :i + 1].transpose(-1, -2) / math.sqrt(HEAD) + bias_row(i)[:, None]  # [H, 1, i+1]
        out.append((logits.softmax(-1) @ v[:, :i + 1]).reshape(D_MODEL))
    return torch.stack(out) @ attn.out.weight.T  # [rows, D]


@pytest.mark.parametrize("name", ["alibi", "fox"])
def test_decay_is_exact_in_float32_at_32k_tokens(name):
    """The evaluation path (sdpa, chunks of DECAY_CHUNK queries, levels relative to each chunk's first
    query) against float64 by hand on rows spread over 32,768 tokens, where c reaches ~1e4."""
    length, rows = 32768, [0, 1023, 1024, 20000, 32767]
    torch.manual_seed(4)
    enc = make_encoding(name, d_model=D_MODEL, n_heads=HEADS, max_positions=length)
    attn = Attention(D_MODEL, HEADS, 0, enc, get_backend("sdpa", enc), causal=True).eval()
    x = torch.randn(1, length, D_MODEL)
    pos = torch.arange(length)[None]
    with torch.no_grad():
        got = attn(x, PositionContext(enc, pos))[0, rows]  # float32
        x64 = x.double()
        attn64 = Attention(D_MODEL, HEADS, 0, enc, get_backend("eager", enc), causal=True).double()
        attn64.load_state_dict(attn.state_dict())
        if name == "alibi":
            slopes = alibi_slopes(HEADS)
            def bias_row(i):
                return -slopes[:, None] * (i - torch.arange(i + 1, dtype=torch.float64))
        else:
            gate = enc.gates[0].double()
            log_f = F.logsigmoid(x64[0] @ gate.weight.T + gate.bias).T  # [H, L]
            levels = log_f.cumsum(-1)
            def bias_row(i):
                return levels[:, i:i + 1] - levels[:, :i + 1]
            assert levels[:, -1].abs().min() > 1e4  # the levels are large: only differences are small
        expected = selected_rows_by_hand(x64, attn64, rows, bias_row)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5)


def test_ssmax_scales_the_logits_by_s_log_keys_seen():
    enc = make_encoding("ssmax", d_model=D_MODEL, n_heads=HEADS, bias=True).double()
    torch.nn.init.normal_(enc.scale)
    torch.nn.init.normal_(enc.shift)
    torch.manual_seed(5)
    for backend in ("eager", "sdpa"):
        attn = Attention(D_MODEL, HEADS, 1, enc, get_backend(backend, enc), causal=True).double()
        x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64)
        q, k, v = (t.view(2, LENGTH, HEADS, HEAD).transpose(1, 2) for t in (x @ attn.qkv.weight.T).split(D_MODEL, -1))
        n = torch.arange(1, LENGTH + 1, dtype=torch.float64)  # keys seen by query i: i + 1
        factor = enc.scale[1][:, None] * n.log() + enc.shift[1][:, None]  # [H, L]
        logits = factor[:, :, None] * (q @ k.transpose(-1, -2)) / math.sqrt(HEAD)
        logits = logits.masked_fill(torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1), float("-inf"))
        expected = (logits.softmax(-1) @ v).transpose(1, 2).reshape(2, LENGTH, D_MODEL) @ attn.out.weight.T
        with torch.no_grad():
            got = attn(x, PositionContext(enc, torch.arange(LENGTH)[None]))
        assert_close_scaled(got, expected, rtol=1e-12, name=backend)


def test_ssmax_beside_rope_scales_the_rotated_query():
    enc = make_encoding("composite", d_model=D_MODEL, n_heads=HEADS, parts=["rope", "ssmax"]).double()
    assert enc.hooks == {"qk", "query_scale"}
    rope, ssmax = make_encoding("rope", d_model=D_MODEL, n_heads=HEADS), enc.parts[1]
    pos = torch.arange(LENGTH)[None]
    call = AttentionCall(enc, pos, pos, 0, True)
    q, k = torch.randn(2, 2, HEADS, LENGTH, HEAD, dtype=torch.float64)
    rq, rk = enc.qk(q, k, pos, pos, 0)
    torch.testing.assert_close(rq, rope.qk(q, k, pos, pos, 0)[0], rtol=0, atol=0)
    torch.testing.assert_close(enc.query_scale(call), ssmax.query_scale(call), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"encoding.init=0: must be > 0"):
        make_encoding("ssmax", init=0)
