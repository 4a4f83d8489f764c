"""Stick-breaking attention: the output against the paper's product written out with loops (float64),
every remainder and attend_current; float32 against float64 at long length; the properties: shift
invariance, causality, chunks and query blocks equal to one pass, finite gradients (masked -inf
logits, saturated gates, rows with no key), refusals."""
import math
import re

import pytest
import torch

from posbench.attention import AttentionCall, EagerBackend, get_backend
from posbench.encodings.stick_breaking import BrokenStick
from tests.helpers import (assert_chunks_equal_one_pass, assert_query_blocks_give_one_pass_gradients,
                          assert_recurrence_equals_one_pass, drawn_model, make_encoding, token_ids)

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
    torch.testing.assert_close(attend(enc, q, k, v, causal), expected, rtol=0, atol=1e-12)


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
    torch.testing.assert_close(extra, (1 - weights.sum(-1, keepdim=True)) * v, rtol=0, atol=1e-12)  # r_i v_i


def test_float32_at_length_2048_matches_float64():
    """The reverse cumulative sums of ~2000 log(1 - beta) in float32 stay close to float64."""
    enc = encoding()
    q, k, v = qkv(length=2048, scale=1.0)
    q, k, v = q[:1, :1], k[:1, :1], v[:1, :1]
    reference = attend(enc, q, k, v)
    got = attend(enc.float(), q.float(), k.float(), v.float())
    torch.testing.assert_close(got.double(), reference, rtol=0, atol=1e-5)


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
    torch.testing.assert_close(log_rest, expected_log_rest, rtol=1e-12, atol=1e-12)
    expected = torch.autograd.grad((expected_weights * grad_weights).sum()
                                   + (expected_log_rest * grad_log_rest).sum(), scores)[0]
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    assert (got[..., ~takes] == 0).all() and got.abs().sum() > 0
    assert torch.autograd.gradcheck(lambda x: BrokenStick.apply(x, takes), (scores[:1, :1].detach().requires_grad_(),))


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
        torch.testing.assert_close(net(tokens, pos), base, rtol=0, atol=1e-12)


@pytest.mark.parametrize("remainder,attend_current", SETTINGS)
def test_future_tokens_never_change_the_past(remainder, attend_current):
    net = model(True, remainder, attend_current).eval()
    tokens, pos = ids(), torch.arange(20)[None]
    out = net(tokens, pos)
    for t in (0, 9, 18):
        changed = tokens.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1) % 11
        torch.testing.assert_close(net(changed, pos)[:, :t + 1], out[:, :t + 1], rtol=0, atol=1e-12)
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
