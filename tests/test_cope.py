"""CoPE: the logit transform against the paper's algorithm written out with loops (float64), against
x-transformers' CoPE where installed, and the properties: shift invariance, causality, chunks and
query blocks equal to one pass, finite gradients, refusals."""
import math
import re

import pytest
import torch

from posbench.attention import AttentionCall
from posbench.build import build
from tests.helpers import (assert_chunks_equal_one_pass, assert_close_scaled,
                          assert_query_blocks_give_one_pass_gradients, assert_recurrence_equals_one_pass, compose_cfg,
                          drawn_model, make_encoding, token_ids)

D_MODEL, HEADS, LENGTH = 16, 2, 9
HEAD = D_MODEL // HEADS


def cope(npos=None, causal=True, seed=0, **kwargs):
    enc = make_encoding("cope", causal=causal, d_model=D_MODEL, n_heads=HEADS, npos=npos, **kwargs).double()
    with torch.no_grad():
        enc.table.normal_(generator=torch.Generator().manual_seed(seed))
    return enc


def qk(length=LENGTH, scale=1.5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, HEADS, length, HEAD, dtype=torch.float64, generator=gen) * scale for _ in range(2)]


def naive_cope(q, k, logits, table, npos, causal):
    """The official algorithm, one (b, h, i, j) at a time: gates sigmoid(q_i . k_t / sqrt(d)) summed over
    the keys t from j to i (every key t >= j when bidirectional), clamped to npos - 1, q_i . e[n] read at
    floor and ceil and interpolated, r added before dividing by sqrt(d)."""
    batch, heads, length, d = q.shape
    out = logits.clone()
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                def z(n):
                    return sum(q[b, h, i, c].item() * table[n, c].item() for c in range(d))

                last = i if causal else length - 1
                for j in range(last + 1):
                    p = 0.0
                    for t in range(j, last + 1):
                        p += 1 / (1 + math.exp(-sum(q[b, h, i, c].item() * k[b, h, t, c].item()
                                                    for c in range(d)) / math.sqrt(d)))
                    p = min(p, npos - 1)
                    low, high = math.floor(p), math.ceil(p)
                    r = (p - low) * z(high) + (1 - p + low) * z(low)
                    out[b, h, i, j] = logits[b, h, i, j] + r / math.sqrt(d)
    return out


def composite_beside(causal):
    """A composite holding cope: the owner of a call whose logits may carry its other parts' terms."""
    return make_encoding("composite", causal=causal, d_model=D_MODEL, n_heads=HEADS, parts=["cope", "t5"])


def visible_part(x, causal):
    return x.tril() if causal else x  # masked entries: the attention drops them


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("npos", [4, 40])  # 4: most positions clamp to the last row; 40: none do
@pytest.mark.parametrize("alone", [True, False])
def test_matches_the_algorithm_written_out(causal, npos, alone):
    """Alone, cope's gates read the logits it gets (q . k / sqrt(d)); in a composite they may hold another
    part's bias, which the gates must not read."""
    enc = cope(npos, causal)
    q, k = qk()
    pos = torch.arange(LENGTH)[None]
    logits = q @ k.transpose(-1, -2) / math.sqrt(HEAD)
    if not alone:
        logits = logits + torch.randn(2, HEADS, LENGTH, LENGTH, dtype=torch.float64)  # a composite's bias
    owner = enc if alone else composite_beside(causal)
    got = enc.logit_transform(logits, q, k, AttentionCall(owner, pos, pos, 1, causal))
    expected = naive_cope(q, k, logits, enc.table[1].detach(), npos, causal)
    # transformed logits up to ~10
    assert_close_scaled(visible_part(got, causal), visible_part(expected, causal), rtol=0, atol_scale=1e-12)


def formula_positions(q, k, visible):
    """p before the clamp: the gates, masked, summed over t >= j."""
    gates = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))
    return (gates if visible is None else gates.masked_fill(~visible, 0.0)).flip(-1).cumsum(-1).flip(-1)


def formula_cope(logits, q, k, table, npos, visible):
    """The formula as it reads, every step left to autograd: the rows at floor and ceil of p carry no
    gradient, the weight p - floor p does."""
    p = formula_positions(q, k, visible).clamp(max=npos - 1)
    z = q @ table.T
    floor, ceil = p.detach().floor(), p.detach().ceil()
    weight = p - floor
    r = z.gather(-1, ceil.long()) * weight + z.gather(-1, floor.long()) * (1 - weight)
    return logits + r / math.sqrt(q.shape[-1])


def block_call(enc, keys, queries, causal, window=None):
    """The last `queries` of `keys` positions, as the eager backend calls a block of queries, for a
    composite holding cope (logits that may hold another part's terms); `enc` gives its causal layout."""
    pos = torch.arange(keys)[None]
    return AttentionCall(composite_beside(causal), pos[:, keys - queries:], pos, 1, causal, window=window)


def block_inputs(queries, keys, seed=2):
    """logits, q, k and an upstream gradient, float64; head 1's scores run to hundreds: its gates are
    exactly 0 or 1, and its positions whole numbers."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, HEADS, n, HEAD, dtype=torch.float64, generator=gen) for n in (queries, keys))
    q[:, 1] *= 60
    logits, upstream = (torch.randn(2, HEADS, queries, keys, dtype=torch.float64, generator=gen) for _ in range(2))
    return logits, q, k, upstream


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 4), (False, 5)])
def test_backward_matches_autograd_of_the_formula(causal, window):
    """The values and the gradients of the logits, q, k and e, against autograd through the formula, with
    an upstream gradient on every entry (masked ones too): positions clamped to the last row, masked keys,
    and whole positions, where the floor/ceil form's rows meet and the weight gets no gradient."""
    npos, keys, queries = 4, 12, 8
    enc = cope(npos, causal)
    logits, q, k, upstream = block_inputs(queries, keys)
    call = block_call(enc, keys, queries, causal, window)
    visible = call.visible()
    p = formula_positions(q, k, visible)
    shown = torch.ones_like(p, dtype=torch.bool) if visible is None else visible.expand_as(p)
    assert (p[shown] > npos - 1).any() and (p[shown] < npos - 1).any()  # clamped and not
    assert ((p == p.round()) & shown & (p > 0) & (p < npos - 1)).any()  # whole positions below the clamp
    results = []
    for transform in (lambda *inputs: enc.logit_transform(*inputs, call),
                      lambda *inputs: formula_cope(*inputs, enc.table[1], npos, visible)):
        inputs = [t.clone().requires_grad_() for t in (logits, q, k)]
        enc.table.grad = None
        out = transform(*inputs)
        out.backward(upstream)
        results.append([out.detach(), *(t.grad for t in inputs), enc.table.grad[1].clone()])
    for name, got, expected in zip(("value", "logits", "q", "k", "e"), *results):
        assert_close_scaled(got, expected, rtol=1e-12, atol_scale=1e-13, name=name)  # values up to ~900
    assert enc.table.grad[0].abs().sum() == 0  # the other layer's rows


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 4)])
def test_alone_its_gates_read_the_logits_and_q_and_k_get_the_formulas_gradients(causal, window):
    """Alone, the logits are q . k / sqrt(d) and the gates read them: their gradient reaches q and k through
    the logits. Values and the gradients of q, k and e against autograd through the formula."""
    npos, keys, queries = 4, 12, 8
    enc = cope(npos, causal)
    _, q, k, upstream = block_inputs(queries, keys)
    pos = torch.arange(keys)[None]
    call = AttentionCall(enc, pos[:, keys - queries:], pos, 1, causal, window=window)
    results = []
    for transform in (lambda *inputs: enc.logit_transform(*inputs, call),
                      lambda *inputs: formula_cope(*inputs, enc.table[1], npos, call.visible())):
        q_in, k_in = (t.clone().requires_grad_() for t in (q, k))
        enc.table.grad = None
        out = transform(q_in @ k_in.transpose(-1, -2) / math.sqrt(HEAD), q_in, k_in)
        out.backward(upstream)
        results.append([out.detach(), q_in.grad, k_in.grad, enc.table.grad[1].clone()])
    for name, got, expected in zip(("value", "q", "k", "e"), *results):
        assert_close_scaled(got, expected, rtol=1e-12, atol_scale=1e-13, name=name)  # values up to ~900


def test_gradcheck():
    """Finite differences of the logits, q, k and e on a block with masked keys and clamped positions."""
    enc = cope(npos=3)
    logits, q, k, _ = block_inputs(4, 6, seed=3)
    q[:, 1] /= 60  # no whole positions: finite differences straddle no kink
    call = block_call(enc, 6, 4, True)
    inputs = [t.requires_grad_() for t in (logits, q, k)]
    assert torch.autograd.gradcheck(lambda logits, q, k, table: enc.logit_transform(logits, q, k, call),
                                    (*inputs, enc.table))
    alone = AttentionCall(enc, call.q_pos, call.k_pos, 1, True)
    assert torch.autograd.gradcheck(
        lambda q, k, table: enc.logit_transform(q @ k.transpose(-1, -2) / math.sqrt(HEAD), q, k, alone),
        (*inputs[1:], enc.table))


def test_matches_x_transformers_cope():
    """x-transformers' CoPE returns r from the masked logits; posbench adds r / sqrt(d)."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    enc = cope(6)
    reference = xt.CoPE(dim=HEAD, heads=HEADS, max_pos=6).double()
    with torch.no_grad():
        reference.pos_emb.copy_(enc.table[0])
    q, k = qk()
    pos = torch.arange(LENGTH)[None]
    logits = q @ k.transpose(-1, -2) / math.sqrt(HEAD)
    masked = logits.masked_fill(~torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril(), -torch.finfo(torch.float64).max)
    expected = logits + reference(q, masked) / math.sqrt(HEAD)
    got = enc.logit_transform(logits, q, k, AttentionCall(enc, pos, pos, 0, True))
    assert_close_scaled(got.tril(), expected.tril(), rtol=0, atol_scale=1e-12)  # logits up to ~10


def test_starts_as_plain_attention():
    """e starts at zero: the logits are unchanged until it learns."""
    enc = make_encoding("cope", d_model=D_MODEL, n_heads=HEADS).double()
    q, k = qk()
    pos = torch.arange(LENGTH)[None]
    logits = q @ k.transpose(-1, -2) / math.sqrt(HEAD)
    assert torch.equal(enc.logit_transform(logits, q, k, AttentionCall(enc, pos, pos, 0, True)), logits)


def test_npos_defaults_to_training_positions_plus_one_and_is_recorded():
    assert make_encoding("cope", max_positions=48).params() == {"npos": 49}
    assert make_encoding("cope", npos=16).params() == {"npos": 16}
    built = build(compose_cfg("encoding=cope", "task=copy", "debug=smoke"), torch.device("cpu"))
    assert built.encoding.npos == built.encoding.dims.train_positions + 1
    assert built.backend == "eager"


def model(causal=True, npos=6, seed=0, dtype=torch.float64):
    return drawn_model("cope", causal, dtype, seed, npos=npos)


def ids(length=20, batch=2, seed=3):
    return token_ids(length, batch, seed)


@pytest.mark.parametrize("causal", [True, False])
def test_a_shift_of_every_position_changes_nothing(causal):
    net = model(causal).eval()
    tokens = ids()
    base = net(tokens, torch.arange(20)[None])
    for pos in (torch.arange(20)[None] + 1000, torch.arange(0, 60, 3)[None]):  # shifted, scattered
        assert_close_scaled(net(tokens, pos), base, rtol=0, atol_scale=1e-12, name="shifted logits")


def test_future_tokens_never_change_the_past():
    net = model().eval()
    tokens, pos = ids(), torch.arange(20)[None]
    out = net(tokens, pos)
    for t in (0, 7, 18):
        changed = tokens.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1) % 11
        assert_close_scaled(net(changed, pos)[:, :t + 1], out[:, :t + 1], rtol=0, atol_scale=1e-12, name="past logits")
        assert not torch.allclose(net(changed, pos)[:, t + 1:], out[:, t + 1:])


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_evaluation_equals_one_pass(causal):
    assert_chunks_equal_one_pass(model(causal).eval(), ids(), torch.arange(20)[None], (1, 3, 7, 19))


def test_segment_recurrence_equals_reading_both_segments_at_once():
    assert_recurrence_equals_one_pass(model().eval(), ids(length=18))


def test_query_blocks_in_training_give_the_one_pass_gradients(monkeypatch):
    assert_query_blocks_give_one_pass_gradients(model, ids(), monkeypatch)


def test_gradients_are_finite_and_reach_the_table():
    """float32, positions past npos (clamped) and exactly integer positions (gates saturated at 0 and 1)."""
    net = model(npos=4, dtype=torch.float32).train()
    with torch.no_grad():
        net.blocks[0].attn.qkv.weight.mul_(200)  # logits of hundreds: gates exactly 0 or 1
    net(ids(length=40), torch.arange(40)[None]).logsumexp(-1).sum().backward()
    for name, p in net.named_parameters():
        assert torch.isfinite(p.grad).all(), name
    assert net.encoding.table.grad.abs().sum() > 0


@pytest.mark.parametrize("npos,message", [
    (1, "cope: encoding.npos=1: must be >= 2, or null (training positions + 1)"),
    (2.5, "cope: encoding.npos=2.5: must be an integer >= 2, or null (training positions + 1)"),
    ("many", "cope: encoding.npos='many': must be an integer >= 2, or null (training positions + 1)"),
])
def test_bad_npos_is_refused(npos, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_encoding("cope", npos=npos)
