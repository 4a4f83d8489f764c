"""Content-dependent relative terms (shaw, transformer_xl, tener, deberta).

For each: the whole eager attention against a naive float64 reference that materialises
the [L, L, d] relative vectors with a loop over (i, j) following the paper's formula; a
hand-computed case with 2-3 positions; where transformers has the same attention
(XLNet's Transformer-XL core, DeBERTa v1), equality with it. And a memory test: the
hooks never allocate an [L, L, d]-sized tensor.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from posbench.attention import AttentionCall, EagerBackend, get_backend
from tests.helpers import assert_close_scaled, make_encoding

NAMES = ["shaw", "transformer_xl", "tener", "deberta"]
B, H, L, D_HEAD = 2, 2, 5, 4
CLIP = 2  # shaw's K and deberta's k in the naive tests: distances up to 16 get clipped
POSITIONS = {
    "shared": torch.arange(L)[None] + 3,  # [1, L]
    "per-row": torch.tensor([[0, 1, 2, 3, 4], [3, 5, 6, 10, 17]]),  # [B, L], the second with gaps
}


def clip(x: int, bound: int) -> int:
    return max(-bound, min(bound, x))


def sinusoid(t: float, dim: int, base: float = 10000.0) -> torch.Tensor:
    """[sin(t w_0), ..., sin(t w_{M-1}), cos(t w_0), ..., cos(t w_{M-1})], w_m = base^(-2m/dim): [dim]."""
    freqs = [base ** (-2 * m / dim) for m in range(dim // 2)]
    return torch.tensor([math.sin(t * w) for w in freqs] + [math.cos(t * w) for w in freqs], dtype=torch.float64)


def softmax_mix(logits: torch.Tensor, values: torch.Tensor, causal: bool) -> torch.Tensor:
    """logits [H, L, L], values [H, L, L, d] (v_j plus any relative vector for (i, j)) -> [H, L, d]."""
    if causal:
        logits = logits.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hij,hijd->hid", logits.softmax(-1), values)


def shaw_reference(enc, q, k, v, pos, layer, causal):
    """e_ij = q_i.(k_j + a^K_c(j-i)) / sqrt(d), z_i = sum_j alpha_ij (v_j + a^V_c(j-i))."""
    a_k, a_v, bound = enc.key_table[layer], enc.value_table[layer], enc.max_relative_position
    out = []
    for b in range(q.shape[0]):
        p = pos[min(b, pos.shape[0] - 1)].tolist()
        rel_k = torch.stack([torch.stack([a_k[clip(p[j] - p[i], bound) + bound] for j in range(L)])
                             for i in range(L)])  # [L, L, d]
        rel_v = torch.stack([torch.stack([a_v[clip(p[j] - p[i], bound) + bound] for j in range(L)])
                             for i in range(L)])  # [L, L, d]
        logits = torch.einsum("hid,hijd->hij", q[b], k[b][:, None] + rel_k) / math.sqrt(D_HEAD)
        out.append(softmax_mix(logits, v[b][:, None] + rel_v, causal))
    return torch.stack(out)


def transformer_xl_reference(enc, q, k, v, pos, layer, causal):
    """(q_i.k_j + q_i.W_R R(i-j) + u.k_j + v.W_R R(i-j)) / sqrt(d), R of size d_model."""
    w_r, u, v_bias = enc.position_proj[layer].weight, enc.content_bias, enc.position_bias
    d_model = H * D_HEAD
    out = []
    for b in range(q.shape[0]):
        p = pos[min(b, pos.shape[0] - 1)].tolist()
        rel = torch.stack([torch.stack([w_r @ sinusoid(p[i] - p[j], d_model) for j in range(L)])
                           for i in range(L)])  # [L, L, D]
        rel = rel.view(L, L, H, D_HEAD).permute(2, 0, 1, 3)  # head h's slice of W_R R: [H, L, L, d]
        logits = (torch.einsum("hid,hjd->hij", q[b], k[b]) + torch.einsum("hid,hijd->hij", q[b], rel)
                  + torch.einsum("hd,hjd->hj", u, k[b])[:, None] + torch.einsum("hd,hijd->hij", v_bias, rel))
        out.append(softmax_mix(logits / math.sqrt(D_HEAD), v[b][:, None].expand(H, L, L, D_HEAD), causal))
    return torch.stack(out)


def tener_reference(enc, q, k, v, pos, layer, causal):
    """q_t.k_j + q_t.R(t-j) + u.k_j + v.R(t-j), R of size d, unscaled."""
    u, v_bias = enc.content_bias[layer], enc.position_bias[layer]
    out = []
    for b in range(q.shape[0]):
        p = pos[min(b, pos.shape[0] - 1)].tolist()
        rel = torch.stack([torch.stack([sinusoid(p[i] - p[j], D_HEAD) for j in range(L)])
                           for i in range(L)])  # [L, L, d], the same for every head
        logits = (torch.einsum("hid,hjd->hij", q[b], k[b]) + torch.einsum("hid,ijd->hij", q[b], rel)
                  + torch.einsum("hd,hjd->hj", u, k[b])[:, None] + torch.einsum("hd,ijd->hij", v_bias, rel))
        out.append(softmax_mix(logits, v[b][:, None].expand(H, L, L, D_HEAD), causal))
    return torch.stack(out)


def deberta_reference(enc, q, k, v, pos, layer, causal):
    """(Qc_i.Kc_j + Qc_i.Kr_delta(i,j) + Kc_j.Qr_delta(j,i)) / sqrt(3d), delta(i, j) = clip(i - j, -k, k);
    with p2c_delta=code the last term reads Qr_delta(i,j) instead."""
    bound, sign = enc.max_relative_positions, 1 if enc.p2c_delta == "paper" else -1
    key_rel = (enc.rel_table @ enc.key_proj[layer].weight.T).view(-1, H, D_HEAD)  # Kr: [2k+1, H, d]
    query_rel = (enc.rel_table @ enc.query_proj[layer].weight.T).view(-1, H, D_HEAD)  # Qr: [2k+1, H, d]
    out = []
    for b in range(q.shape[0]):
        p = pos[min(b, pos.shape[0] - 1)].tolist()
        rel_k = torch.stack([torch.stack([key_rel[clip(p[i] - p[j], bound) + bound] for j in range(L)])
                             for i in range(L)])  # [L, L, H, d]
        rel_q = torch.stack([torch.stack([query_rel[clip(sign * (p[j] - p[i]), bound) + bound] for j in range(L)])
                             for i in range(L)])  # [L, L, H, d]
        logits = (torch.einsum("hid,hjd->hij", q[b], k[b]) + torch.einsum("hid,ijhd->hij", q[b], rel_k)
                  + torch.einsum("hjd,ijhd->hij", k[b], rel_q))
        out.append(softmax_mix(logits / math.sqrt(3 * D_HEAD), v[b][:, None].expand(H, L, L, D_HEAD), causal))
    return torch.stack(out)


REFERENCES = {"shaw": ("shaw", shaw_reference, {"max_relative_position": CLIP}),
              "transformer_xl": ("transformer_xl", transformer_xl_reference, {}),
              "tener": ("tener", tener_reference, {}),
              "deberta": ("deberta", deberta_reference, {"max_relative_positions": CLIP}),
              "deberta-code": ("deberta", deberta_reference, {"max_relative_positions": CLIP, "p2c_delta": "code"})}


@pytest.mark.parametrize("positions", sorted(POSITIONS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("case", sorted(REFERENCES))
def test_attention_matches_naive_reference_float64(case, causal, positions):
    name, reference, params = REFERENCES[case]
    enc = make_encoding(name, causal=causal, n_heads=H, d_model=H * D_HEAD, **params).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in enc.parameters():  # tables start small: make every term matter
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    q, k, v = (torch.randn(B, H, L, D_HEAD, generator=gen, dtype=torch.float64) for _ in range(3))
    pos = POSITIONS[positions]
    with torch.no_grad():
        ours = EagerBackend().attend(q, k, v, AttentionCall(enc, pos, pos, layer=1, causal=causal))
        expected = reference(enc, q, k, v, pos, 1, causal)
    assert_close_scaled(ours, expected, rtol=1e-12)


# --- hand-computed cases ----------------------------------------------------------------------

def one_head(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)[None, None]  # [1, 1, L, d]


def set_(param: torch.Tensor, rows) -> None:
    with torch.no_grad():
        param.copy_(torch.as_tensor(rows, dtype=torch.float64))


def test_shaw_hand_computed():
    """K = 1, d = 2, positions 10, 11, 12. a^K rows for offsets (-1, 0, +1) = (1,0), (0,1), (2,-1).
    q.a^K: q0 = (1,2) -> 1, 2, 0; q1 = (0,1) -> 0, 1, -1; q2 = (3,0) -> 3, 0, 6.
    c(j - i): row 0 -> 0, +1, +1 (2 clipped); row 1 -> -1, 0, +1; row 2 -> -1 (-2 clipped), -1, 0.
    Key term = those values / sqrt(2). a^V rows = (1,1), (0,2), (-1,0); with p below:
    row 0: 0.5 a^V_0 + (0.25 + 0.25) a^V_+1 = (-0.5, 1); row 1: 0.2 a^V_-1 + 0.3 a^V_0 + 0.5 a^V_+1
    = (-0.3, 0.8); row 2: (0.1 + 0.6) a^V_-1 + 0.3 a^V_0 = (0.7, 1.3)."""
    enc = make_encoding("shaw", causal=False, n_heads=1, d_model=2, max_relative_position=1).double()
    set_(enc.key_table[0], [[1, 0], [0, 1], [2, -1]])
    set_(enc.value_table[0], [[1, 1], [0, 2], [-1, 0]])
    pos = torch.tensor([[10, 11, 12]])
    q = one_head([[1, 2], [0, 1], [3, 0]])
    with torch.no_grad():
        term = enc.key_term(q, torch.zeros_like(q), pos, pos, 0)[0, 0]
        p = one_head([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5], [0.1, 0.6, 0.3]])
        value = enc.value_term(p, pos, pos, 0)[0, 0]
    expected = torch.tensor([[2, 0, 0], [0, 1, -1], [3, 3, 0]], dtype=torch.float64) / math.sqrt(2)
    # hand-computed: a few roundings per entry over d = 2 features
    assert_close_scaled(term, expected, ulps=8, name="key term")
    assert_close_scaled(value, torch.tensor([[-0.5, 1], [-0.3, 0.8], [0.7, 1.3]], dtype=torch.float64), ulps=8,
                        name="value term")


def test_transformer_xl_hand_computed():
    """One head, d = d_model = 2, so R(t) = (sin t, cos t). W_R swaps the two features:
    W_R R(t) = (cos t, sin t). u = (1,0), v = (0,1), q = (1,0), (0,1), k = (2,0), (0,3), positions 4, 5.
    Term = (u.k_j + (q_i + v).W_R R(i-j)) / sqrt(2), u.k = (2, 0), q + v = (1,1), (0,2):
    (0,0): 2 + (1,1).(1,0) = 3;  (0,1): t = -1: 0 + (1,1).(cos 1, -sin 1) = cos 1 - sin 1;
    (1,0): t = 1: 2 + (0,2).(cos 1, sin 1) = 2 + 2 sin 1;  (1,1): 0 + (0,2).(1,0) = 0."""
    enc = make_encoding("transformer_xl", causal=False, n_heads=1, d_model=2).double()
    set_(enc.position_proj[0].weight, [[0, 1], [1, 0]])
    set_(enc.content_bias, [[1, 0]])
    set_(enc.position_bias, [[0, 1]])
    pos = torch.tensor([[4, 5]])
    with torch.no_grad():
        term = enc.key_term(one_head([[1, 0], [0, 1]]), one_head([[2, 0], [0, 3]]), pos, pos, 0)[0, 0]
    s, c = math.sin(1), math.cos(1)
    expected = torch.tensor([[3, c - s], [2 + 2 * s, 0]], dtype=torch.float64) / math.sqrt(2)
    assert_close_scaled(term, expected, ulps=8)  # a few roundings per entry over d = 2 features
    assert enc.logit_scale(2) == 1 / math.sqrt(2)


def test_tener_hand_computed_and_direction_aware():
    """One head, d = 2, R(t) = (sin t, cos t), no projection, unscaled. u = (1,0), v = (0,1),
    q = (1,0), (0,1), k = (2,0), (0,3), positions 7, 8. Term = u.k_j + (q_t + v).R(t - j):
    (0,0): 2 + (1,1).(0,1) = 3;  (0,1): t - j = -1: 0 + (1,1).(-sin 1, cos 1) = cos 1 - sin 1;
    (1,0): t - j = 1: 2 + (0,2).(sin 1, cos 1) = 2 + 2 cos 1;  (1,1): 0 + (0,2).(0,1) = 2.
    With q + v = (1,1) at both distances +-1, sin's sign is the only thing telling them apart."""
    enc = make_encoding("tener", causal=False, n_heads=1, d_model=2).double()
    set_(enc.content_bias[0], [[1, 0]])
    set_(enc.position_bias[0], [[0, 1]])
    pos = torch.tensor([[7, 8]])
    with torch.no_grad():
        term = enc.key_term(one_head([[1, 0], [0, 1]]), one_head([[2, 0], [0, 3]]), pos, pos, 0)[0, 0]
        q_same = one_head([[1, 0], [1, 0]])  # q + v = (1,1) on both rows
        both_ways = enc.key_term(q_same, torch.zeros_like(q_same), pos, pos, 0)[0, 0]
    s, c = math.sin(1), math.cos(1)
    expected = torch.tensor([[3, c - s], [2 + 2 * c, 2]], dtype=torch.float64)
    assert_close_scaled(term, expected, ulps=8)  # a few roundings per entry over d = 2 features
    assert both_ways[0, 1].item() == pytest.approx(c - s) and both_ways[1, 0].item() == pytest.approx(c + s)
    assert enc.logit_scale(2) == 1.0


def test_deberta_hand_computed():
    """One head, d = D = 2, k = 1, positions 5, 6, 7. P rows for delta = -1, 0, +1: (1,0), (0,1), (1,1).
    W_k,r = I so Kr = P; W_q,r swaps features so Qr rows = (0,1), (1,0), (1,1).
    c2p(i,j) = q_i.Kr[clip(i-j)], q = (1,0), (0,1), (1,-1): q.Kr = (1,0,1), (0,1,1), (1,-1,0) for -1,0,+1;
    rows i: deltas (0,-1,-1), (+1,0,-1), (+1,+1,0) -> c2p = [[0,1,1], [1,1,0], [0,0,-1]].
    p2c(i,j) = k_j.Qr[clip(j-i)], k = (2,1), (0,1), (1,0): k.Qr = (1,2,3), (1,0,1), (0,1,1);
    rows i: deltas (0,+1,+1), (-1,0,+1), (-1,-1,0) -> p2c = [[2,1,1], [1,0,1], [1,1,1]].
    Term = (c2p + p2c) / sqrt(3 * 2)."""
    enc = make_encoding("deberta", causal=False, n_heads=1, d_model=2, max_relative_positions=1).double()
    set_(enc.rel_table, [[1, 0], [0, 1], [1, 1]])
    set_(enc.key_proj[0].weight, [[1, 0], [0, 1]])
    set_(enc.query_proj[0].weight, [[0, 1], [1, 0]])
    pos = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        term = enc.key_term(one_head([[1, 0], [0, 1], [1, -1]]), one_head([[2, 1], [0, 1], [1, 0]]), pos, pos, 0)
    expected = torch.tensor([[2, 2, 2], [2, 1, 1], [1, 1, 0]], dtype=torch.float64) / math.sqrt(6)
    assert_close_scaled(term[0, 0], expected, ulps=8)  # a few roundings per entry over d = 2 features
    assert enc.logit_scale(2) == 1 / math.sqrt(6)


# --- independent implementations (transformers) -----------------------------------------------

def merge_heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)  # [B, H, L, d] -> [B, L, H*d]


def time_major(x: torch.Tensor) -> torch.Tensor:
    return x.permute(2, 0, 1, 3)  # [B, H, L, d] -> [L, B, H, d], XLNet's layout


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_transformer_xl_matches_transformers_xlnet(causal):
    """XLNet's relative attention core is Transformer-XL's ((q+u).k + (q+v).W_R R, relative shift,
    * 1/sqrt(d)). Its R table is built in float32 from small distances, hence atol 1e-6."""
    pytest.importorskip("transformers")
    from transformers import XLNetConfig
    from transformers.models.xlnet.modeling_xlnet import XLNetModel, XLNetRelativeAttention

    heads, d, length = 2, 4, 6
    config = XLNetConfig(vocab_size=11, d_model=heads * d, n_layer=1, n_head=heads, d_inner=16, dropout=0.0)
    theirs = XLNetRelativeAttention(config).double().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    q, k, v = (torch.randn(B, heads, length, d, generator=gen, dtype=torch.float64) for _ in range(3))
    pos_emb = XLNetModel(config).relative_positional_encoding(length, length, bsz=B).double()  # [2L, B, D]
    k_head_r = torch.einsum("ibh,hnd->ibnd", pos_emb, theirs.r)
    mask = torch.ones(length, length).triu(1)[:, :, None, None].double() if causal else None  # 1 = hidden
    with torch.no_grad():
        expected = theirs.rel_attn_core(time_major(q), time_major(k), time_major(v), k_head_r, attn_mask=mask)
    expected = expected.permute(1, 2, 0, 3)  # [B, H, L, d]

    enc = make_encoding("transformer_xl", causal=causal, n_heads=heads, d_model=heads * d).double()
    set_(enc.position_proj[0].weight, theirs.r.permute(1, 2, 0).reshape(heads * d, heads * d))  # r[D, H, d]
    set_(enc.content_bias, theirs.r_w_bias)  # u
    set_(enc.position_bias, theirs.r_r_bias)  # v
    pos = torch.arange(length)[None] + 9
    with torch.no_grad():
        ours = EagerBackend().attend(q, k, v, AttentionCall(enc, pos, pos, layer=0, causal=causal))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_deberta_matches_transformers_disentangled_attention(causal):
    """DeBERTa v1's DisentangledSelfAttention with c2p + p2c, which reads Qr at delta(i, j)
    (p2c_delta=code; the paper's delta(j, i) is checked by the naive and hand-computed tests).
    Its table has 2M rows over [-M, M - 1]; with L <= k < M no distance is clipped on either
    side, and our row r is its row M - k + r. Biases the paper's formula lacks (q, v, and the
    p2c projection's) are zeroed. transformers takes sqrt(3d) in float32, hence atol 1e-6."""
    pytest.importorskip("transformers")
    from transformers import DebertaConfig
    from transformers.models.deberta.modeling_deberta import DisentangledSelfAttention, build_relative_position

    heads, d, length, table_half, clip_at = 2, 4, 6, 8, 5
    config = DebertaConfig(hidden_size=heads * d, num_attention_heads=heads, relative_attention=True,
                           max_relative_positions=table_half, pos_att_type=["c2p", "p2c"],
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    theirs = DisentangledSelfAttention(config).double().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (theirs.in_proj.weight, theirs.pos_proj.weight, theirs.pos_q_proj.weight):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        theirs.pos_q_proj.bias.zero_()
    rel_embeddings = torch.randn(2 * table_half, heads * d, generator=gen, dtype=torch.float64)
    hidden = torch.randn(B, length, heads * d, generator=gen, dtype=torch.float64)
    visible = torch.ones(length, length, dtype=torch.bool)
    mask = (visible.tril() if causal else visible)[None, None].expand(B, 1, length, length)
    with torch.no_grad():
        q, k, v = theirs.transpose_for_scores(theirs.in_proj(hidden)).chunk(3, dim=-1)  # [B, H, L, d] each
        expected, _ = theirs(hidden, mask, relative_pos=build_relative_position(q, k),
                             rel_embeddings=rel_embeddings)

    enc = make_encoding("deberta", causal=causal, n_heads=heads, d_model=heads * d,
                        max_relative_positions=clip_at, p2c_delta="code").double()
    set_(enc.rel_table, rel_embeddings[table_half - clip_at: table_half + clip_at + 1])
    set_(enc.key_proj[0].weight, theirs.pos_proj.weight)
    set_(enc.query_proj[0].weight, theirs.pos_q_proj.weight)
    pos = torch.arange(length)[None] + 3
    with torch.no_grad():
        ours = EagerBackend().attend(q, k, v, AttentionCall(enc, pos, pos, layer=0, causal=causal))
    torch.testing.assert_close(merge_heads(ours), expected, rtol=0, atol=1e-6)


# --- memory, options, backends ----------------------------------------------------------------

def largest_allocation(fn) -> int:
    """Bytes of the largest net allocation any single op (with its children) made while fn ran."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(event.cpu_memory_usage for event in prof.events())


MEMORY_LENGTH, MEMORY_HEAD_DIM = 1024, 64


@pytest.mark.parametrize("name", NAMES)
def test_hooks_never_allocate_length_squared_times_head_size(name):
    """At L = 1024, d = 64 (forward and backward of every hook this encoding has), no op allocates
    L * L * d float32s; in fact nothing bigger than two [B, H, L, L] logits tensors."""
    length, d = MEMORY_LENGTH, MEMORY_HEAD_DIM
    params = {"max_relative_positions": 16} if name == "deberta" else {}
    enc = make_encoding(name, n_heads=H, d_model=H * d, max_positions=length, **params)
    q, k = (torch.randn(1, H, length, d, requires_grad=True) for _ in range(2))
    p = torch.rand(1, H, length, length, requires_grad=True)
    pos = torch.arange(length)[None]

    def run():
        total = enc.key_term(q, k, pos, pos, 0).sum()
        if "value_term" in enc.hooks:
            total = total + enc.value_term(p, pos, pos, 0).sum()
        total.backward()

    largest = largest_allocation(run)
    assert largest < length * length * d * 4
    assert largest <= 2 * H * length * length * 4


def test_memory_measurement_sees_a_materialised_table():
    """Guard: the measurement above does catch an [L, L, d] tensor when one is made."""
    length, d = 256, MEMORY_HEAD_DIM
    table = torch.randn(2 * length - 1, d)
    rows = torch.arange(length)[:, None] - torch.arange(length)[None] + length - 1
    assert largest_allocation(lambda: table[rows]) >= length * length * d * 4


@pytest.mark.parametrize("name,params,message", [
    ("shaw", {"max_relative_position": 0}, "max_relative_position=0"),
    ("shaw", {"max_relative_position": 2.5}, "encoding.max_relative_position=2.5: must be an integer >= 1"),
    ("deberta", {"max_relative_positions": -3}, "max_relative_positions=-3"),
    ("deberta", {"p2c_delta": "bogus"}, r"bogus.*choose one of \['paper', 'code'\]"),
    ("transformer_xl", {"d_model": 9, "n_heads": 1}, "even model size"),
    ("tener", {"d_model": 12, "n_heads": 4}, "even head size"),
])
def test_bad_settings_are_refused_with_the_value(name, params, message):
    with pytest.raises(ValueError, match=message):
        make_encoding(name, **params)


def test_deberta_default_clip_is_the_longest_training_distance():
    assert make_encoding("deberta", max_positions=40).params() == {"max_relative_positions": 39, "p2c_delta": "paper"}


@pytest.mark.parametrize("name", NAMES)
def test_sdpa_refuses_and_names_eager(name):
    enc = make_encoding(name)
    with pytest.raises(ValueError, match=r"backend=sdpa cannot run .*key_term.*use backend=eager"):
        get_backend("sdpa").check(enc)
    get_backend("eager").check(enc)
