"""DAPE: the logit transform against the papers' networks written out with loops (float64), for every
base and both versions; the base's bias read as a bias (never applied as alibi's decay); the
properties: shift invariance (fire excepted), causality, chunks and query blocks equal to one pass,
finite gradients, refusals."""
import math
import re

import pytest
import torch

from posbench.attention import AttentionCall, EagerBackend, get_backend
from posbench.encodings import dape as dape_module
from posbench.model import ModelConfig, Transformer
from tests.helpers import (assert_chunks_equal_one_pass, assert_close_scaled,
                           assert_query_blocks_give_one_pass_gradients, assert_recurrence_equals_one_pass, drawn_model,
                           make_encoding, token_ids)

D_MODEL, HEADS, LENGTH, WIDTH = 16, 2, 7, 3
HEAD = D_MODEL // HEADS
BASES = ("alibi", "kerple", "fire", "rope", "nope")
POSITIONS = [3, 4, 6, 7, 8, 11, 12]  # scattered: the bias reads the positions, not the indices


def dape(version=1, base="kerple", causal=True, kernel=3, seed=0, **params):
    torch.manual_seed(seed)
    enc = make_encoding("dape", causal=causal, d_model=D_MODEL, n_heads=HEADS, version=version, base=base,
                        mlp_width=WIDTH, kernel=kernel, **params).double()
    for p in enc.net.parameters():
        torch.nn.init.normal_(p, std=0.7)
    return enc


def leaky(x):
    return x if x > 0 else 0.01 * x  # nn.LeakyReLU's default slope


def reference_bias(enc, i, j, h):
    """Head h's bias between positions i and j, from the papers' formulas (fire: its own bias(), whose
    formula test_bias_encodings checks)."""
    if enc.base_name == "alibi":
        return -(2 ** (-8 * (h + 1) / HEADS)) * abs(i - j)
    if enc.base_name == "kerple":
        r1, r2 = (r[h].item() for r in enc.base.kernel_params())
        return -r1 * math.log(1 + r2 * abs(i - j))
    return enc.base.bias(torch.tensor([[i]]), torch.tensor([[j]]), 1)[0, h, 0, 0].item()


def naive_v1(enc, logits, pos):
    """A = S + B + f([S; B]) one (b, i, j) at a time; S alone (A = S + f(S)) without a bias."""
    w1, b1, w2, b2 = (t.detach() for t in (enc.net[0].weight, enc.net[0].bias, enc.net[2].weight, enc.net[2].bias))
    out = torch.empty_like(logits)
    batch, heads, lq, lk = logits.shape
    biased = enc.base_name in ("alibi", "kerple", "fire")
    for b in range(batch):
        for i in range(lq):
            for j in range(lk):
                s = [logits[b, h, i, j].item() for h in range(heads)]
                bias = [reference_bias(enc, pos[i], pos[j], h) for h in range(heads)] if biased else [0.0] * heads
                x = s + bias if biased else s
                hidden = [leaky(sum(w1[u, c] * x[c] for c in range(len(x))) + b1[u]) for u in range(WIDTH)]
                for h in range(heads):
                    out[b, h, i, j] = s[h] + bias[h] + sum(w2[h, u] * hidden[u] for u in range(WIDTH)) + b2[h]
    return out


def naive_v2(enc, logits, pos, causal, official_edge=False):
    """A = S + B + g(tril([S; B])): two 1 x k convolutions along keys (padding k // 2), entries of keys a
    query may not see set to 0. Beyond both ends of the key axis the row goes on with zeros and the
    first convolution's output (hidden) there is computed from them; official_edge: the hidden layer
    is the second convolution's zero padding there (the official full pass)."""
    w1, b1, w2, b2 = (t.detach() for t in (enc.net[0].weight, enc.net[0].bias, enc.net[2].weight, enc.net[2].bias))
    batch, heads, lq, lk = logits.shape
    reach, biased = enc.kernel // 2, enc.base_name in ("alibi", "kerple", "fire")
    out = torch.empty_like(logits)
    for b in range(batch):
        for i in range(lq):
            def x(c, j):
                if j < 0 or j >= lk or (causal and j > i):
                    return 0.0
                return logits[b, c, i, j].item() if c < heads else reference_bias(enc, pos[i], pos[j], c - heads)

            def hidden(u, j):
                if official_edge and (j < 0 or j >= lk):
                    return 0.0
                return leaky(b1[u].item() + sum(w1[u, c, 0, t].item() * x(c, j + t - reach)
                                                for c in range(w1.shape[1]) for t in range(enc.kernel)))

            for j in range(lk):
                hid = {(u, t): hidden(u, j + t - reach) for u in range(WIDTH) for t in range(enc.kernel)}
                for h in range(heads):
                    g = b2[h].item() + sum(w2[h, u, 0, t].item() * hid[u, t] for u in range(WIDTH)
                                           for t in range(enc.kernel))
                    bias = reference_bias(enc, pos[i], pos[j], h) if biased else 0.0
                    out[b, h, i, j] = logits[b, h, i, j] + bias + g
    return out


def scaled_logits(seed=1):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, HEADS, LENGTH, HEAD, dtype=torch.float64, generator=gen) for _ in range(2))
    return q, k, q @ k.transpose(-1, -2) / math.sqrt(HEAD)


def transform(enc, causal=True):
    q, k, logits = scaled_logits()
    pos = torch.tensor([POSITIONS])
    return logits, enc.logit_transform(logits, q, k, AttentionCall(enc, pos, pos, 1, causal))


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("causal", [True, False])
def test_v1_matches_the_network_written_out(base, causal):
    enc = dape(1, base, causal)
    logits, got = transform(enc, causal)
    expected = naive_v1(enc, logits, POSITIONS)
    assert_close_scaled(got, expected, rtol=0, atol_scale=1e-12)  # every entry: v1 is pointwise; up to ~10


def tiled(logits, bias, net):
    first, act, last = net
    return dape_module.PairMLP.apply(logits, bias, first.weight, first.bias, last.weight, last.bias,
                                     act.negative_slope)


@pytest.mark.parametrize("bias_batch", [None, 1, 3], ids=["no bias", "shared bias", "bias per sequence"])
@pytest.mark.parametrize("implementation", ["cpu tiles", "query blocks"])
def test_v1_backward_equals_autograd_of_the_network(bias_batch, implementation, monkeypatch):
    """v1's two implementations (PairMLP's tiles with their own backward, on the CPU; checkpointed
    blocks of queries, elsewhere) against autograd through nn's Linear -> LeakyReLU -> Linear over
    [S; B] (float64), tiles smaller than a row so that they cut rows, blocks of one query; and gradcheck."""
    monkeypatch.setattr(dape_module, "TILE_ELEMENTS", 20)  # 3 sequences x 3 hidden units: tiles of 2 pairs
    monkeypatch.setattr(dape_module, "BLOCK_ELEMENTS", 80)  # 3 sequences x 3 units x 5 keys: blocks of 1 query
    gen = torch.Generator().manual_seed(2)
    features = HEADS if bias_batch is None else 2 * HEADS
    net = torch.nn.Sequential(torch.nn.Linear(features, WIDTH), torch.nn.LeakyReLU(0.2),
                              torch.nn.Linear(WIDTH, HEADS)).double()
    logits = torch.randn(3, HEADS, 4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = None if bias_batch is None else torch.randn(bias_batch, HEADS, 4, 5, dtype=torch.float64,
                                                       generator=gen, requires_grad=True)
    grad = torch.randn(3, HEADS, 4, 5, dtype=torch.float64, generator=gen)
    inputs = [t for t in (logits, bias, *net.parameters()) if t is not None]
    v1 = tiled if implementation == "cpu tiles" else dape_module.pair_mlp_blocks

    got = v1(logits, bias, net)
    got_grads = torch.autograd.grad((got * grad).sum(), inputs)
    if bias is None:
        expected = logits + net(logits.movedim(1, -1)).movedim(-1, 1)
    else:
        both = torch.cat([logits, bias.expand_as(logits)], dim=1)  # [S; B]
        expected = logits + bias + net(both.movedim(1, -1)).movedim(-1, 1)
    expected_grads = torch.autograd.grad((expected * grad).sum(), inputs)
    assert_close_scaled(got, expected, rtol=1e-12, name="logits")
    for i, (g, e) in enumerate(zip(got_grads, expected_grads)):
        assert_close_scaled(g, e, rtol=1e-10, atol_scale=1e-12, name=f"gradient {i}")  # up to ~20
    # the weights are the network's own tensors: gradcheck's perturbations of them reach it through net
    assert torch.autograd.gradcheck(lambda *args: v1(args[0], args[1] if bias is not None else None, net),
                                    tuple(inputs))


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", [3, 5])
def test_v2_matches_the_convolutions_written_out(base, causal, kernel):
    enc = dape(2, base, causal, kernel)
    logits, got = transform(enc, causal)
    expected = naive_v2(enc, logits, POSITIONS, causal)
    visible = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril() if causal else torch.ones(LENGTH, LENGTH).bool()
    assert_close_scaled(got[..., visible], expected[..., visible], rtol=0, atol_scale=1e-12)  # up to ~16


def test_v2_differs_from_the_official_full_pass_only_at_the_ends_of_the_key_axis():
    """The official pass zero-pads the hidden layer at both ends of its key axis, where posbench's rows go
    on with zeros: causal, the first k // 2 keys of every row and the last k // 2 queries against the
    last k // 2 keys differ; every other entry agrees."""
    enc = dape(2, "alibi", kernel=5)
    logits, got = transform(enc)
    official = naive_v2(enc, logits, POSITIONS, causal=True, official_edge=True)
    visible = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    differs = ((got - official).abs() > 1e-9).any(0).any(0) & visible  # [L, L]
    expected = torch.zeros(LENGTH, LENGTH, dtype=torch.bool)
    expected[:, :2] = True  # keys 0, 1 (reach 2)
    expected[-2:, -2:] = True  # rows L-2, L-1 against keys L-2, L-1
    assert torch.equal(differs, expected & visible)


@pytest.mark.parametrize("version", [1, 2])
def test_causal_alibi_base_is_a_bias_in_the_network_never_a_decay(version):
    """In a causal model alibi alone is a decay (levels -m j); inside dape the network reads -m |i - j|
    and attention applies no decay: the output is softmax(S + B + f([S; B])) V, written out here."""
    enc = dape(version, "alibi")
    assert enc.hooks == {"logit_transform"} and "decay" in make_encoding("alibi").hooks
    q, k, logits = scaled_logits()
    v = torch.randn(2, HEADS, LENGTH, HEAD, dtype=torch.float64)
    pos = torch.tensor([POSITIONS])
    transformed = naive_v1(enc, logits, POSITIONS) if version == 1 else naive_v2(enc, logits, POSITIONS, causal=True)
    mask = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
    expected = transformed.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    got = EagerBackend().attend(q, k, v, AttentionCall(enc, pos, pos, 1, True))
    assert_close_scaled(got, expected, rtol=0.0, atol_scale=1e-12, name="attention output")


def test_with_a_silent_network_alibi_base_is_alibi():
    """f = 0 (last layer zeroed): dape-alibi's model gives plain alibi's outputs (decay and bias agree)."""
    enc = make_encoding("dape", d_model=32, n_heads=4, base="alibi")
    with torch.no_grad():
        enc.net[2].weight.zero_()
        enc.net[2].bias.zero_()
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=4)
    torch.manual_seed(0)
    net = Transformer(cfg, enc, get_backend("auto", enc)).double().eval()
    alibi = Transformer(cfg, make_encoding("alibi", d_model=32, n_heads=4), get_backend("sdpa")).double().eval()
    alibi.load_state_dict({k: v for k, v in net.state_dict().items() if not k.startswith("encoding")})
    tokens = ids()
    assert_close_scaled(net(tokens, torch.arange(20)[None]), alibi(tokens, torch.arange(20)[None]), rtol=0.0,
                        atol_scale=1e-10, name="logits")


def test_rope_base_owns_the_rotation():
    enc = dape(1, "rope")
    assert enc.hooks == {"qk", "logit_transform"}
    rope = make_encoding("rope", d_model=D_MODEL, n_heads=HEADS)
    q, k, _ = scaled_logits()
    pos = torch.arange(5, 5 + LENGTH)[None]
    for got, expected in zip(enc.qk(q, k, pos, pos, 0), rope.qk(q, k, pos, pos, 0)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    scaled = make_encoding("dape", base="rope", base_params={"scaling": "pi"})
    before = scaled.base.inv_freq.clone()
    scaled.set_eval_length(10, 40)  # reaches the base: position interpolation by 4
    torch.testing.assert_close(scaled.base.inv_freq, before / 4)


def test_params_record_the_base_and_its_settings():
    enc = make_encoding("dape", base="kerple", base_params={"variant": "power"})
    assert enc.params() == {"version": 1, "base": "kerple", "mlp_width": 32, "kernel": None,
                            "base_params": {"variant": "power"}}
    assert make_encoding("dape", version=2, base="nope").params()["kernel"] == 3
    assert {name for name, _ in make_encoding("dape").named_parameters()} >= {"base.raw_r1", "base.raw_r2"}


def model(version=1, base="kerple", causal=True, kernel=3, dtype=torch.float64):
    return drawn_model("dape", causal, dtype, version=version, base=base, kernel=kernel)


def ids(length=20, batch=2, seed=3):
    return token_ids(length, batch, seed)


VARIANTS = [(version, base) for version in (1, 2) for base in BASES]


@pytest.mark.parametrize("version,base", VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
def test_shift_invariant_as_its_base(version, base, causal):
    net = model(version, base, causal).eval()
    tokens = ids()
    reference = net(tokens, torch.arange(20)[None])
    change = (net(tokens, torch.arange(20)[None] + 1000) - reference).abs().max().item()
    assert net.encoding.relative is (base != "fire")
    if net.encoding.relative:
        assert change < 1e-9
    else:
        assert change > 1e-6


@pytest.mark.parametrize("version,base", VARIANTS)
def test_future_tokens_never_change_the_past(version, base):
    net = model(version, base).eval()
    tokens, pos = ids(), torch.arange(20)[None]
    out = net(tokens, pos)
    for t in (0, 9, 18):
        changed = tokens.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1) % 11
        assert_close_scaled(net(changed, pos)[:, :t + 1], out[:, :t + 1], rtol=0.0, atol_scale=1e-12,
                            name=f"logits up to {t}")


@pytest.mark.parametrize("version,base", VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_evaluation_equals_one_pass(version, base, causal):
    for kernel in ((3, 5) if version == 2 else (3,)):
        net = model(version, base, causal, kernel).eval()
        assert_chunks_equal_one_pass(net, ids(), torch.arange(20)[None], (1, 6, 19), atol_scale=1e-10)


def test_segment_recurrence_equals_reading_both_segments_at_once():
    assert_recurrence_equals_one_pass(model(2, "alibi").eval(), ids(length=18))


@pytest.mark.parametrize("version", [1, 2])
def test_query_blocks_in_training_give_the_one_pass_gradients(version, monkeypatch):
    assert_query_blocks_give_one_pass_gradients(lambda: model(version, "alibi"), ids(), monkeypatch, 1e-8, 1e-10)


@pytest.mark.parametrize("version,base", VARIANTS)
def test_gradients_are_finite_and_reach_every_parameter(version, base):
    net = model(version, base, dtype=torch.float32).train()
    net(ids(length=40), torch.arange(40)[None]).logsumexp(-1).sum().backward()
    for name, p in net.encoding.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("params,message", [
    ({"version": 3}, "dape: encoding.version=3: must be in [1, 2]"),
    ({"version": "v2"}, "dape: encoding.version='v2': must be an integer in [1, 2]"),
    ({"base": "t5"}, "dape: encoding.base='t5' is not valid; choose one of "
                     "['alibi', 'kerple', 'fire', 'rope', 'nope']"),
    ({"mlp_width": 0}, "dape: encoding.mlp_width=0: must be >= 1"),
    ({"kernel": 4}, "dape: encoding.kernel=4: must be odd"),
    ({"kernel": 0}, "dape: encoding.kernel=0: must be >= 1"),
    ({"base_params": {"slope": 1}}, "dape: encoding.base_params has ['slope'], which base kerple does not take; "
                                    "its parameters: ['variant']"),
    ({"base": "nope", "base_params": {"variant": "log"}}, "dape: encoding.base_params has ['variant'], which base "
                                                          "nope does not take; its parameters: []"),
    ({"base_params": {"variant": "cubic"}}, "kerple: encoding.variant='cubic' is not valid"),
])
def test_bad_parameters_are_refused(params, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_encoding("dape", **params)
