"""Gated attention (Qiu et al. 2025, G1): a layer's output against softmax attention written as a loop with each
head's output times sigmoid(x W_h) (elementwise and headwise, causal and bidirectional, eager and sdpa), the
headwise gate one scalar per head, rope=true as posbench's RoPE, and the whole layer against transformers'
Qwen3NextAttention (q_proj emitting query and gate) with our weights copied in; the refusals of bad settings."""
import math

import pytest
import torch

from posbench.attention import PositionContext, get_backend
from posbench.encodings.rope import RoPE
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled, make_encoding, random_qk

D_MODEL, HEADS, LENGTH = 16, 2, 7
HEAD = D_MODEL // HEADS


def gated_attention_by_hand(x, attn, gate_weight, causal):
    """o_i,h = sum_j softmax_j(q_i.k_j / sqrt(d)) v_j (j <= i when causal), times sigmoid(x_i W_h) (a vector of d
    per head, or one number per head), then joined and projected. gate_weight: [H d or H, D]."""
    b, length, _ = x.shape
    q, k, v = (t.view(b, length, HEADS, HEAD) for t in (x @ attn.qkv.weight.T).split(D_MODEL, dim=-1))
    gate = torch.sigmoid(x @ gate_weight.T).view(b, length, HEADS, -1)  # [B, L, H, d or 1]
    out = torch.zeros(b, length, HEADS, HEAD, dtype=x.dtype)
    for s in range(b):
        for h in range(HEADS):
            for i in range(length):
                seen = i + 1 if causal else length
                logits = torch.stack([q[s, i, h] @ k[s, j, h] / math.sqrt(HEAD) for j in range(seen)])
                out[s, i, h] = (logits.softmax(0) @ v[s, :seen, h]) * gate[s, i, h]
    return out.reshape(b, length, D_MODEL) @ attn.out.weight.T


def gated_model(backend: str = "eager", causal: bool = True, **params) -> Transformer:
    torch.manual_seed(0)
    enc = make_encoding("gated", causal=causal, d_model=D_MODEL, n_heads=HEADS, **params)
    cfg = ModelConfig(vocab_size=11, d_model=D_MODEL, n_layers=2, n_heads=HEADS, causal=causal)
    model = Transformer(cfg, enc, get_backend(backend, enc)).double()
    for p in model.parameters():  # gates far from 0.5, different per head and feature; attention far from uniform
        torch.nn.init.normal_(p, std=0.5)
    return model


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("form", ["elementwise", "headwise"])
def test_gated_attention_is_the_papers_formula(backend, causal, form):
    model = gated_model(backend, causal, form=form).eval()
    enc, attn = model.encoding, model.blocks[1].attn
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = attn(x, PositionContext(enc, torch.arange(LENGTH)[None]))
    assert_close_scaled(got, gated_attention_by_hand(x, attn, enc.gates[1].weight, causal), rtol=1e-12)
    assert enc.hooks == {"output"} and enc.params()["form"] == form


def test_headwise_gate_is_one_scalar_per_head_and_token():
    enc = gated_model(form="headwise").encoding
    assert enc.gates[0].weight.shape == (HEADS, D_MODEL) and enc.gates[0].bias is None
    assert make_encoding("gated").gates[0].weight.shape == (D_MODEL, D_MODEL)  # elementwise: H d gates
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64)
    y = torch.randn(2, HEADS, LENGTH, HEAD, dtype=torch.float64)
    ratio = enc.output(y, x, 0) / y  # [B, H, L, d]: the gate
    expected = torch.sigmoid(x @ enc.gates[0].weight.T).transpose(1, 2)  # [B, H, L]
    assert_close_scaled(ratio, expected[..., None].expand_as(ratio), rtol=1e-14)


def test_gate_starts_as_the_papers_init():
    enc = make_encoding("gated", d_model=64, n_heads=4)
    weights = torch.cat([gate.weight.flatten() for gate in enc.gates])  # 2 x 64 x 64 draws
    assert all(gate.bias is None for gate in enc.gates)
    assert abs(weights.std().item() - 0.02) < 0.002 and abs(weights.mean().item()) < 0.002


def test_rope_option_rotates_as_posbenchs_rope():
    enc = make_encoding("gated", d_model=D_MODEL, n_heads=HEADS, rope=True, rope_base=500.0).double()
    rope = RoPE(enc.dims, base=500.0)
    q, k = random_qk(HEADS, LENGTH, HEAD)
    pos = torch.arange(5, 5 + LENGTH)[None]
    for got, expected in zip(enc.qk(q, k, pos, pos, 1), rope.qk(q, k, pos, pos, 1)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert enc.hooks == {"output", "qk"} and enc.relative
    assert enc.params() == {"form": "elementwise", "rope": True, "rope_base": 500.0}


def qwen3_next_attention(rope: bool):
    """A tiny transformers Qwen3NextAttention (the gated attention of the Qwen3-Next release: q_proj emits each
    head's query then its gate), QK-norm off (posbench's gated has none), in float64 on sdpa, and its rotary
    embedding (full rotation, base 10000) when rope is on."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    config = Qwen3NextConfig(hidden_size=D_MODEL, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                             head_dim=HEAD, num_hidden_layers=1, layer_types=["full_attention"],
                             partial_rotary_factor=1.0, attention_bias=False, vocab_size=11, rope_theta=10000.0)
    config._attn_implementation = "sdpa"  # eager's softmax runs in float32
    attn = modeling.Qwen3NextAttention(config, 0).double()
    attn.q_norm, attn.k_norm = torch.nn.Identity(), torch.nn.Identity()
    return attn, modeling.Qwen3NextRotaryEmbedding(config) if rope else None


@pytest.mark.parametrize("rope", [False, True])
def test_gated_layer_equals_transformers_qwen3_next_attention(rope):
    reference, rotary = qwen3_next_attention(rope)
    model = gated_model("sdpa", rope=rope).eval()
    enc, attn = model.encoding, model.blocks[0].attn
    w_q, w_k, w_v = attn.qkv.weight.split(D_MODEL)  # [D, D] each: head h's rows h d .. (h + 1) d
    w_gate = enc.gates[0].weight  # [H d, D]
    with torch.no_grad():  # q_proj per head: its query rows, then its gate rows
        reference.q_proj.weight.copy_(torch.stack([w_q.view(HEADS, HEAD, D_MODEL), w_gate.view(HEADS, HEAD, D_MODEL)],
                                                  dim=1).reshape(2 * D_MODEL, D_MODEL))
        reference.k_proj.weight.copy_(w_k)
        reference.v_proj.weight.copy_(w_v)
        reference.o_proj.weight.copy_(attn.out.weight)
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(LENGTH)[None]
    if rope:
        cos, sin = rotary(x, pos)  # [1, L, d]
    else:  # no rotation: cos 1, sin 0
        cos, sin = torch.ones(1, LENGTH, HEAD, dtype=torch.float64), torch.zeros(1, LENGTH, HEAD, dtype=torch.float64)
    with torch.no_grad():
        expected, _ = reference(x, (cos, sin), None)  # causal: no mask, one query per key
        got = attn(x, PositionContext(enc, pos))
    # with rope, transformers' cos and sin are float32 (~1e-7 relative; the rotation changes outputs by ~1)
    assert_close_scaled(got, expected, rtol=1e-6 if rope else 1e-12)


def test_gated_refuses_bad_settings():
    with pytest.raises(ValueError, match=r"gated: encoding.form='vector' is not valid; choose one of "
                                         r"\['elementwise', 'headwise'\]"):
        make_encoding("gated", form="vector")
    with pytest.raises(ValueError, match=r"gated: encoding.rope_base=1.0: must be > 1"):
        make_encoding("gated", rope=True, rope_base=1.0)
    with pytest.raises(ValueError, match=r"gated: encoding.rope='yes': must be true or false"):
        make_encoding("gated", rope="yes")
    with pytest.raises(ValueError, match="gated: encoding.rope=true .* even head size"):
        make_encoding("gated", d_model=6, n_heads=2, rope=True)
