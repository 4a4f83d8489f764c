"""Stick-breaking attention: the output against the paper's product written out with loops (float64),
every remainder and attend_current; float32 against float64 at long length; scores past float32's exp
range (a huge score takes the stick in every precision, its gradients finite and right); the
properties: shift invariance, causality, chunks and query blocks equal to one pass, finite gradients
(masked -inf logits, saturated gates, rows with no key), refusals."""
import math
import re

import pytest
import torch

from posbench.attention import AttentionCall, EagerBackend, get_backend
from posbench.encodings.stick_breaking import BrokenStick
from tests.helpers import (assert_chunks_equal_one_pass, assert_close_scaled,
                           assert_query_blocks_give_one_pass_gradients, assert_recurrence_equals_one_pass, drawn_model,
                           make_encoding, token_ids)

D_MODEL, HEADS, LENGTH = 16, 2, 8
HEAD = D_MODEL // HEADS
REMAINDERS = ("value", "learned", "none")


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def naive_stick_breaking(q, k, v, u, attend_current, causal):
    """o_i = sum_j A_ij v_j + (1 - sum_j A_ij) u_i, A_ij = sigmoid(s_ij) prod_t (1 - sigmoid(s_it)) over
    the keys t after j that break the stick: up to i - 1 (i with attend_current) when causal, every
    key after j but i (i included with attend_current) when bidirectional. u_i: [d] or None."""
    batch, heads, length, d = q.shape
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            s = [[sum(q[b, h, i, c].item() * k[b, h, j, c].item() for c in range(d)) / math.sqrt(d)
                  for j in range(length)] for i in range(length)]
            for i in range(length):
                keys = [t for t in range(length) if (t <= i if causal else True) and (attend_current or t != i)]
                total = 0.0
                for j in keys:
                    a = sigmoid(s[i][j])
                    for t in keys:
                        if t > j:
                            a *= 1 - sigmoid(s[i][t])
                    total += a
                    for c in range(d):
                        out[b, h, i, c] += a * v[b, h, j, c].item()
                if u is not None:
                    for c in range(d):
                        out[b, h, i, c] += (1 - total) * u(b, h, i)[c].item()
    return out


def encoding(remainder="value", attend_current=False, causal=True):
    enc = make_encoding("stick_breaking", causal=causal, d_model=D_MODEL, n_heads=HEADS, remainder=remainder,
                        attend_current=attend_current).double()
    if remainder == "learned":
        with torch.no_grad():
            enc.head_bias.normal_(generator=torch.Generator().manual_seed(5))
    return enc


def qkv(length=LENGTH, scale=1.0, seed=1, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, HEADS, length, HEAD, dtype=dtype, generator=gen) * s for s in (scale, scale, 1.0)]


def attend(enc, q, k, v, causal=True, pos=None):
    pos = torch.arange(q.shape[-2])[None] if pos is None else pos
    return EagerBackend().attend(q, k, v, AttentionCall(enc, pos, pos, 0, causal))  # [B, H, L, d]


@pytest.mark.parametrize("remainder", REMAINDERS)
@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_the_product_written_out(remainder, attend_current, causal):
    enc = encoding(remainder, attend_current, causal)
    q, k, v = qkv(scale=1.5)
    u = {"value": lambda b, h, i: v[b, h, i], "learned": lambda b, h, i: enc.head_bias[h].detach(),
         "none": None}[remainder]
    expected = naive_stick_breaking(q, k, v, u, attend_current, causal)
    assert_close_scaled(attend(enc, q, k, v, causal), expected, rtol=0, atol_scale=1e-12, name="attention")


def test_weights_form_a_broken_stick():
    """Weights >= 0, summing to at most 1; the first token (no key before it) takes its own value whole."""
    enc = encoding()
    q, k, v = qkv(scale=3.0)
    logits = (q @ k.transpose(-1, -2) / math.sqrt(HEAD)).masked_fill(
        ~torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(), float("-inf"))
    pos = torch.arange(LENGTH)[None]
    weights, extra = enc.normalize(logits, v, AttentionCall(enc, pos, pos, 0, True))
    assert (weights >= 0).all() and (weights.sum(-1) <= 1 + 1e-12).all()
    assert (weights.triu() == 0).all()  # the current token and the future take nothing
    torch.testing.assert_close(extra[..., 0, :], v[..., 0, :], rtol=0, atol=0)
    assert_close_scaled(extra, (1 - weights.sum(-1, keepdim=True)) * v, rtol=0, atol_scale=1e-12, name="r_i v_i")


def test_float32_at_length_2048_matches_float64():
    """The reverse cumulative sums of ~2000 log(1 - beta) in float32 stay close to float64."""
    enc = encoding()
    q, k, v = qkv(length=2048, scale=1.0)
    q, k, v = q[:1, :1], k[:1, :1], v[:1, :1]
    reference = attend(enc, q, k, v)
    got = attend(enc.float(), q.float(), k.float(), v.float())
    assert_close_scaled(got.double(), reference, rtol=0, atol_scale=1e-5)  # outputs up to ~3


def test_backward_equals_autograd_of_the_formula():
    """BrokenStick's own backward against autograd through the formula written with a triangular
    matrix (float64): keys that take no part, a row where none does, saturated gates; and gradcheck."""
    gen = torch.Generator().manual_seed(4)
    scores = (torch.randn(2, 3, 6, 9, dtype=torch.float64, generator=gen) * 4).requires_grad_()
    takes = torch.rand(6, 9, generator=gen) > 0.3
    takes[2] = False
    grad_weights, grad_log_rest = torch.randn(2, 3, 6, 9, dtype=torch.float64, generator=gen), torch.randn(
        2, 3, 6, 1, dtype=torch.float64, generator=gen)

    weights, log_rest = BrokenStick.apply(scores, takes)
    got = torch.autograd.grad((weights * grad_weights).sum() + (log_rest * grad_log_rest).sum(), scores)[0]

    s = torch.where(takes, scores, 0.0)
    breaks = torch.where(takes, torch.nn.functional.logsigmoid(-s), 0.0)  # log(1 - beta)
    after = breaks @ torch.ones(9, 9, dtype=torch.float64).tril(-1)  # sum over t > j: [B, H, Lq, Lk]
    expected_weights = torch.where(takes, torch.exp(torch.nn.functional.logsigmoid(s) + after), 0.0)
    expected_log_rest = breaks.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-12, atol=1e-300)
    assert_close_scaled(log_rest, expected_log_rest, rtol=1e-12, name="log_rest")  # sums of logs: up to ~20
    expected = torch.autograd.grad((expected_weights * grad_weights).sum()
                                   + (expected_log_rest * grad_log_rest).sum(), scores)[0]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert (got[..., ~takes] == 0).all() and got.abs().sum() > 0
    assert torch.autograd.gradcheck(lambda x: BrokenStick.apply(x, takes), (scores[:1, :1].detach().requires_grad_(),))


def product_form(scores, takes):
    """A and r in float64 as the paper's product over the keys that take part: A_ij = sigmoid(s_ij)
    prod_{t > j} sigmoid(-s_it), r_i = prod_t sigmoid(-s_it). sigmoid(-s), not 1 - sigmoid(s), keeps
    1 - beta down to e^-745 (sigmoid(-100) ~ 3.7e-44)."""
    s = scores.double()
    beta = torch.where(takes, torch.sigmoid(s), 0.0)  # [..., Lq, Lk]
    rest = torch.where(takes, torch.sigmoid(-s), 1.0)  # 1 - beta: [..., Lq, Lk]
    later = torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool).triu(1)  # later[j, t]: t > j
    return beta * torch.where(later, rest[..., None, :], 1.0).prod(-1), rest.prod(-1, keepdim=True)


CAUSAL_KEYS = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(-1)  # keys before the query: [L, L]


def huge_scores(huge, dtype=torch.float32, seed=6):
    """Causal scores [1, H, L, L] of a few units, -inf on the keys that take no part; from the third row on,
    head 0's nearest key at +huge (it takes the whole stick), head 1's first key at +huge (it takes what
    the later keys leave) and its nearest at -huge (no share, no break)."""
    s = torch.randn(1, HEADS, LENGTH, LENGTH, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 2
    rows = torch.arange(2, LENGTH)
    s[0, 0, rows, rows - 1] = huge
    s[0, 1, rows, 0] = huge
    s[0, 1, rows, rows - 1] = -huge
    return s.masked_fill(~CAUSAL_KEYS, float("-inf")).to(dtype)


@pytest.mark.parametrize("huge", [100.0, 1e3, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_huge_score_takes_the_stick_in_every_precision(huge, dtype):
    """Scores past 88.7, where log(sigmoid(-s)) is -inf in float32 and zeroed the row, against the product
    in float64: finite weights, none of the rows empty, the nearest key at +huge taking the whole stick.
    bfloat16 and float16 logits (autocast's) run in float32."""
    enc = make_encoding("stick_breaking", d_model=D_MODEL, n_heads=HEADS)
    logits = huge_scores(huge, dtype)
    compute = torch.promote_types(dtype, torch.float32)
    v = torch.randn(1, HEADS, LENGTH, HEAD, dtype=compute, generator=torch.Generator().manual_seed(7))
    pos = torch.arange(LENGTH)[None]
    weights, extra = enc.normalize(logits, v, AttentionCall(enc, pos, pos, 0, True))
    expected, rest = product_form(logits, CAUSAL_KEYS)
    assert torch.isfinite(weights).all() and torch.isfinite(extra).all()
    assert (weights[..., 1:, :].sum(-1) > 0).all()  # every row with a key gives it a share
    rows = torch.arange(2, LENGTH)
    # a few dozen ulps of the precision computed in
    assert_close_scaled(weights[0, 0, rows, rows - 1], torch.ones(LENGTH - 2, dtype=compute), ulps=32, name="taken")
    assert_close_scaled(weights, expected, ulps=32, name="weights")
    assert_close_scaled(extra, rest * v.double(), ulps=32, name="extra")


@pytest.mark.parametrize("huge", [100.0, 1e3, 1e4])
def test_gradients_at_huge_scores_are_finite_and_match_the_product(huge):
    """BrokenStick's backward in float32 at scores of +-huge against autograd through the product in
    float64 (log r as the sum of torch's logsigmoid(-s))."""
    gen = torch.Generator().manual_seed(8)
    grad_weights = torch.randn(1, HEADS, LENGTH, LENGTH, dtype=torch.float64, generator=gen)
    grad_log_rest = torch.randn(1, HEADS, LENGTH, 1, dtype=torch.float64, generator=gen)
    scores = huge_scores(huge).requires_grad_()
    weights, log_rest = BrokenStick.apply(scores, CAUSAL_KEYS)
    got = torch.autograd.grad((weights * grad_weights.float()).sum() + (log_rest * grad_log_rest.float()).sum(),
                              scores)[0]
    assert torch.isfinite(weights).all() and torch.isfinite(log_rest).all() and torch.isfinite(got).all()

    reference = scores.detach().double().requires_grad_()
    expected_weights, _ = product_form(reference, CAUSAL_KEYS)
    expected_log_rest = torch.where(CAUSAL_KEYS, torch.nn.functional.logsigmoid(-reference), 0.0).sum(-1, keepdim=True)
    assert_close_scaled(log_rest, expected_log_rest, ulps=32, name="log_rest")  # float32, up to ~huge
    expected = torch.autograd.grad((expected_weights * grad_weights).sum() + (expected_log_rest * grad_log_rest).sum(),
                                   reference)[0]
    assert_close_scaled(got, expected, ulps=32, name="gradient")


def test_gradcheck_with_saturating_scores():
    """gradcheck in float64 with scores up to +-60 (beta within e^-60 of 0 or 1) and keys that take no part."""
    gen = torch.Generator().manual_seed(9)
    scores = torch.randn(1, HEADS, LENGTH, LENGTH, dtype=torch.float64, generator=gen) * 20
    scores[0, 0, 3:, 1] = 60.0
    scores[0, 1, 3:, 2] = -60.0
    assert torch.autograd.gradcheck(lambda x: BrokenStick.apply(x, CAUSAL_KEYS), (scores.requires_grad_(),))


def model(causal=True, remainder="value", attend_current=False, dtype=torch.float64):
    return drawn_model("stick_breaking", causal, dtype, remainder=remainder, attend_current=attend_current)


def ids(length=20, batch=2, seed=3):
    return token_ids(length, batch, seed)


SETTINGS = [(remainder, current) for remainder in REMAINDERS for current in (False, True)]


@pytest.mark.parametrize("remainder,attend_current", SETTINGS)
@pytest.mark.parametrize("causal", [True, False])
def test_a_shift_of_every_position_changes_nothing(remainder, attend_current, causal):
    net = model(causal, remainder, attend_current).eval()
    tokens = ids()
    base = net(tokens, torch.arange(20)[None])
    for pos in (torch.arange(20)[None] + 1000, torch.arange(0, 60, 3)[None]):  # shifted, scattered
        assert_close_scaled(net(tokens, pos), base, rtol=0, atol_scale=1e-12, name="logits")


@pytest.mark.parametrize("remainder,attend_current", SETTINGS)
def test_future_tokens_never_change_the_past(remainder, attend_current):
    net = model(True, remainder, attend_current).eval()
    tokens, pos = ids(), torch.arange(20)[None]
    out = net(tokens, pos)
    for t in (0, 9, 18):
        changed = tokens.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1) % 11
        assert_close_scaled(net(changed, pos)[:, :t + 1], out[:, :t + 1], rtol=0, atol_scale=1e-12, name="past logits")
        assert not torch.allclose(net(changed, pos)[:, t + 1:], out[:, t + 1:])


@pytest.mark.parametrize("remainder,attend_current", SETTINGS)
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_evaluation_equals_one_pass(remainder, attend_current, causal):
    net = model(causal, remainder, attend_current).eval()
    for pos in (torch.arange(20)[None], torch.stack((torch.arange(20), torch.arange(20) * 2 + 1))):
        assert_chunks_equal_one_pass(net, ids(), pos, (1, 6, 19))


def test_segment_recurrence_equals_reading_both_segments_at_once():
    assert_recurrence_equals_one_pass(model(attend_current=True).eval(), ids(length=18))


def test_query_blocks_in_training_give_the_one_pass_gradients(monkeypatch):
    assert_query_blocks_give_one_pass_gradients(lambda: model(remainder="learned"), ids(), monkeypatch)


@pytest.mark.parametrize("remainder,attend_current", SETTINGS)
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_are_finite_with_saturated_gates(remainder, attend_current, causal):
    """float32, logits of hundreds (sigmoid exactly 0 or 1), -inf where masked, a first row with no key."""
    net = model(causal, remainder, attend_current, dtype=torch.float32).train()
    with torch.no_grad():
        net.blocks[0].attn.qkv.weight.mul_(300)
    out = net(ids(length=40), torch.arange(40)[None])
    assert torch.isfinite(out).all()
    out.logsumexp(-1).sum().backward()
    for name, p in net.named_parameters():
        assert torch.isfinite(p.grad).all(), name
    if remainder == "learned":
        assert net.encoding.head_bias.grad.abs().sum() > 0


def test_bidirectional_own_key_is_its_index_not_its_position():
    """Repeated position ids (every token at 0) change nothing: the own key is the key index."""
    enc = encoding(causal=False)
    q, k, v = qkv()
    torch.testing.assert_close(attend(enc, q, k, v, causal=False, pos=torch.zeros(1, LENGTH, dtype=torch.long)),
                               attend(enc, q, k, v, causal=False), rtol=0, atol=0)


def test_defaults_and_params():
    enc = make_encoding("stick_breaking")
    assert enc.params() == {"remainder": "value", "attend_current": False}
    assert enc.hooks == {"normalize"} and not list(enc.parameters())
    assert [name for name, _ in make_encoding("stick_breaking", remainder="learned").named_parameters()] == \
        ["head_bias"]
    assert get_backend("auto", enc).name == "eager"


@pytest.mark.parametrize("params,message", [
    ({"remainder": "bias"}, "stick_breaking: encoding.remainder='bias' is not valid; choose one of "
                            "['value', 'learned', 'none']"),
    ({"attend_current": "no"}, "stick_breaking: encoding.attend_current='no': must be true or false"),
])
def test_bad_parameters_are_refused(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_encoding("stick_breaking", **params)
