"""Scale-invariant attention (encoding=scale_invariant): a_t and m_t against the paper's numbers and its
general form written out with math, the attention against a direct transcription (every logit
a_t q_i.R(t)k_j / sqrt(d) + m_t one pair at a time, p-RoPE pairs turned one at a time, a causal softmax),
only the content logit scaled beside another part's bias, shift invariance, causality, chunked evaluation
and query-block training as one pass, and the refusals."""
from __future__ import annotations

import math

import pytest
import torch

from posbench.attention import get_backend
from posbench.attention.context import AttentionCall
from posbench.attention.eager import EagerBackend
from posbench.attention.layer import query_key_hooks
from posbench.encodings.scale_invariant import ScaleInvariant, scale_invariant_terms
from posbench.model import ModelConfig, Transformer
from tests.helpers import (assert_chunks_equal_one_pass, assert_close_scaled,
                           assert_query_blocks_give_one_pass_gradients, compose_cfg, make_encoding, rope_dims,
                           token_ids)

HEADS, HEAD_DIM = 2, 8


def a_and_m(t: float, tau: float = 10.0) -> tuple[float, float]:
    """The paper's general form with alpha = beta = e^(1/2): a_t = sqrt(2[ln(t/tau + 1) - ln alpha + beta/alpha]),
    m_t = beta/alpha - a_t^2."""
    alpha = beta = math.exp(0.5)
    a = math.sqrt(2 * (math.log(t / tau + 1) - math.log(alpha) + beta / alpha))
    return a, beta / alpha - a * a


def turned(x: torch.Tensor, position: float, fraction: float, layout: str, base: float = 10000.0) -> torch.Tensor:
    """x [d] with pair m (interleaved (2m, 2m+1), half (m, m + d/2)) turned by position * base^(-2m/d) for the
    floor(fraction * d/2) first pairs, the others still (p-RoPE)."""
    d = x.shape[-1]
    out = x.clone()
    for m in range(math.floor(fraction * d / 2)):
        a, b = (2 * m, 2 * m + 1) if layout == "interleaved" else (m, m + d // 2)
        angle = position * base ** (-2 * m / d)
        out[a] = x[a] * math.cos(angle) - x[b] * math.sin(angle)
        out[b] = x[a] * math.sin(angle) + x[b] * math.cos(angle)
    return out


def transcribed(q, k, v, q_pos, k_pos, tau: float, fraction: float | None, layout: str = "half") -> torch.Tensor:
    """softmax over keys j <= i (queries the last keys) of a_t q_i.R(t) k_j / sqrt(d) + m_t, t = i - j, one pair
    at a time; fraction None: no rotation. q: [B, H, Lq, d], k, v: [B, H, Lk, d], positions [B', L]."""
    out = torch.zeros_like(q)
    lq, lk = q.shape[2], k.shape[2]
    for b in range(q.shape[0]):
        qp, kp = q_pos[min(b, q_pos.shape[0] - 1)], k_pos[min(b, k_pos.shape[0] - 1)]
        for h in range(q.shape[1]):
            for r in range(lq):
                logits = []
                for j in range(lk - lq + r + 1):
                    i_at, j_at = float(qp[r]), float(kp[j])
                    qi, kj = q[b, h, r], k[b, h, j]
                    if fraction is not None:
                        qi, kj = turned(qi, i_at, fraction, layout), turned(kj, j_at, fraction, layout)
                    a, m = a_and_m(i_at - j_at, tau)
                    logits.append(a * (qi @ kj) / math.sqrt(q.shape[-1]) + m)
                out[b, h, r] = torch.stack(logits).softmax(0) @ v[b, h, :len(logits)]
    return out


def qkv(lq: int, lk: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, lq, HEAD_DIM, generator=gen, dtype=torch.float64) * 2
    k, v = (torch.randn(2, HEADS, lk, HEAD_DIM, generator=gen, dtype=torch.float64) * 2 for _ in range(2))
    return q, k, v


def attend(enc, q, k, v, q_pos, k_pos):
    call = AttentionCall(enc, q_pos, k_pos, 0, True)
    rq, rk = query_key_hooks(q, k, call)
    return EagerBackend().attend(rq, rk, v, call)


def test_terms_match_the_papers_numbers_and_boundary_pins():
    """t = 100: a 2.41, m -4.80; t = 4096: 3.61, -12.0; t = 65536: 4.31, -17.6 (tau = 10); a_0 = 1, m_0 = 0,
    a_tau^2 = 2 ln 2 + 1; and the general form at every t of a range."""
    t = torch.tensor([0.0, 10.0, 100.0, 4096.0, 65536.0], dtype=torch.float64)
    a, m = scale_invariant_terms(t, 10.0)
    assert a[0] == 1 and m[0] == 0
    assert math.isclose(a[1].item() ** 2, 2 * math.log(2) + 1, rel_tol=1e-15)
    for index, (paper_a, paper_m) in ((2, (2.41, -4.80)), (3, (3.61, -12.0)), (4, (4.31, -17.6))):
        assert round(a[index].item(), 2) == paper_a and round(m[index].item(), 1 if index > 2 else 2) == paper_m
    for tau in (0.5, 10.0, 100.0):
        t = torch.arange(0, 300, 7, dtype=torch.float64)
        a, m = scale_invariant_terms(t, tau)
        expected = torch.tensor([a_and_m(float(x), tau) for x in t], dtype=torch.float64)  # [n, 2]
        assert_close_scaled(torch.stack([a, m], -1), expected, ulps=8, name=f"tau {tau}")
        assert (m <= 0).all()


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rope,fraction", [(True, 0.75), (True, 1.0), (True, 0.5), (False, None)])
def test_attention_matches_the_transcription(rope, fraction, layout):
    """Positions from 0, shifted and per sequence; tau 10 and 3."""
    for tau in (10.0, 3.0):
        enc = ScaleInvariant(rope_dims(HEADS, HEAD_DIM), tau=tau, rope=rope, layout=layout,
                             frequency_fraction=fraction if rope else 0.75).double()
        q, k, v = qkv(12, 12)
        for pos in (torch.arange(12)[None], torch.stack([torch.arange(12) + 7, torch.arange(12) * 3 + 40])):
            got = attend(enc, q, k, v, pos, pos)
            assert_close_scaled(got, transcribed(q, k, v, pos, pos, tau, fraction, layout), rtol=1e-12,
                                name=f"tau {tau}")


def test_queries_after_a_memory_match_the_transcription():
    """A block of queries against more keys (the queries the last keys), as the layer's query blocks."""
    enc = ScaleInvariant(rope_dims(HEADS, HEAD_DIM)).double()
    q, k, v = qkv(4, 15, seed=1)
    k_pos = torch.arange(15)[None] + 5
    got = attend(enc, q, k, v, k_pos[:, 11:], k_pos)
    assert_close_scaled(got, transcribed(q, k, v, k_pos[:, 11:], k_pos, 10.0, 0.75), rtol=1e-12)


def test_beside_a_bias_only_the_content_logit_is_scaled():
    """scale_invariant with t5: a_t (q.k / sqrt(d)) + m_t + bias, the t5 bias not multiplied by a_t."""
    torch.manual_seed(0)
    composite = make_encoding("composite", d_model=HEADS * HEAD_DIM, n_heads=HEADS, parts=["scale_invariant", "t5"])
    composite = composite.double()
    for p in composite.parameters():
        torch.nn.init.normal_(p, std=2.0)
    alone = composite.parts[0]
    q, k, _ = qkv(10, 10)
    pos = torch.arange(10)[None] + 3
    rq, rk = composite.qk(q, k, pos, pos, 0)
    content = rq @ rk.transpose(-2, -1) / math.sqrt(HEAD_DIM)  # [B, H, L, L]
    bias = composite.bias(pos, pos, 0)  # [1, H, L, L]
    assert bias.abs().max() > 0.1
    got = composite.logit_transform(content + bias, rq, rk, AttentionCall(composite, pos, pos, 0, True))
    a, m = scale_invariant_terms((pos[0, :, None] - pos[0, None, :]).clamp(min=0).double(), 10.0)  # [L, L]
    assert_close_scaled(got, a * content + m + bias, rtol=1e-13)
    # alone, the logits it receives are the content logit
    alone_got = alone.logit_transform(content, rq, rk, AttentionCall(alone, pos, pos, 0, True))
    assert_close_scaled(alone_got, a * content + m, rtol=1e-15)


def model(**params) -> Transformer:
    torch.manual_seed(0)
    enc = make_encoding("scale_invariant", d_model=32, n_heads=2, max_positions=32, **params)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2)
    return Transformer(cfg, enc, get_backend("auto", enc)).double()


@pytest.mark.parametrize("rope", [True, False])
def test_shift_invariance_and_causality(rope):
    net = model(rope=rope).eval()
    ids = token_ids(40, seed=5)
    reference = net(ids, torch.arange(40)[None])
    assert_close_scaled(net(ids, torch.arange(40)[None] + 13), reference, rtol=1e-12, name="shifted by 13")
    changed = ids.clone()
    changed[:, 25:] = (changed[:, 25:] + 1) % 11
    later = net(changed, torch.arange(40)[None])
    assert torch.equal(later[:, :25], reference[:, :25])
    assert (later[:, 25:] - reference[:, 25:]).abs().max() > 1e-3


@pytest.mark.parametrize("rope", [True, False])
def test_chunked_evaluation_equals_one_block(rope):
    net = model(rope=rope).eval()
    ids = token_ids(70, seed=2)
    for pos in (torch.arange(70)[None], torch.stack([torch.arange(70), torch.arange(70) * 3 + 5])):
        assert_chunks_equal_one_pass(net, ids, pos, (1, 5, 69))


def test_training_in_query_blocks_gives_one_pass_gradients(monkeypatch):
    assert_query_blocks_give_one_pass_gradients(model, token_ids(20, seed=4), monkeypatch)


def test_defaults_hooks_and_params():
    enc = ScaleInvariant(rope_dims(HEADS, HEAD_DIM))
    assert enc.hooks == {"qk", "logit_transform"} and enc.relative and enc.causal_only
    assert enc.kept_pairs == 3  # pp-RoPE: floor(0.75 * 8/2) of 4 pairs turn
    assert enc.params() == {"tau": 10.0, "rope": True, "base": 10000.0, "layout": "half", "rotary_fraction": 1.0,
                            "frequency_fraction": 0.75, "frequency_cut": "none"}
    assert ScaleInvariant(rope_dims(HEADS, HEAD_DIM), rope=False).hooks == {"logit_transform"}


@pytest.mark.parametrize("params,message", [
    ({"tau": 0}, r"scale_invariant: encoding.tau=0: must be > 0"),
    ({"tau": -1.0}, r"scale_invariant: encoding.tau=-1.0: must be > 0"),
    ({"rope": "yes"}, r"scale_invariant: encoding.rope='yes': must be true or false"),
    ({"frequency_fraction": 1.5}, r"scale_invariant: encoding.frequency_fraction=1.5: must be in \[0, 1\]"),
    ({"layout": "bogus"}, r"scale_invariant: encoding.layout='bogus' is not valid"),
])
def test_bad_settings_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        ScaleInvariant(rope_dims(HEADS, HEAD_DIM), **params)


def test_a_bidirectional_model_is_refused_and_eager_runs_it():
    with pytest.raises(ValueError, match=r"scale_invariant: .*set model.causal=true"):
        make_encoding("scale_invariant", causal=False)
    enc = make_encoding("scale_invariant")
    with pytest.raises(ValueError, match=r"backend=sdpa cannot run the \['logit_transform'\] hook"):
        get_backend("sdpa").check(enc)
    assert get_backend("auto", enc).name == "eager"


def test_builds_from_the_command_line():
    from posbench.build import build

    built = build(compose_cfg("encoding=scale_invariant", "encoding.tau=2.5", "encoding.rope=false"),
                  torch.device("cpu"))
    assert built.encoding.tau == 2.5 and built.encoding.hooks == {"logit_transform"}
    assert built.model.blocks[0].attn.backend.name == "eager"
