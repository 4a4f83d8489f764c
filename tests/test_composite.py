"""Composite encodings: each hybrid equals its parts applied by hand (float64), and the
combination rules refuse what they cannot combine, naming the problem."""
import json
import math

import pytest
import torch

from posbench.attention import AttentionCall, causal_mask, get_backend, query_key_hooks
from posbench.build import build
from posbench.encodings import REGISTRY
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.base import Encoding
from posbench.encodings.sinusoidal import sinusoidal_table
from tests.helpers import assert_close_scaled, compose_cfg, make_encoding

D_MODEL, HEADS, LENGTH = 16, 2, 7
HEAD = D_MODEL // HEADS


def composite(parts, **params):
    enc = make_encoding("composite", d_model=D_MODEL, n_heads=HEADS, parts=parts, **params).double()
    torch.manual_seed(0)
    for p in enc.parameters():  # tables start at zero or tiny: make them matter
        torch.nn.init.normal_(p)
    return enc


def qkv(batch: int = 2):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(batch, HEADS, LENGTH, HEAD, dtype=torch.float64, generator=gen) for _ in range(3)]


def attention_by_hand(q, k, v, bias):
    """softmax(q.k^T / sqrt(d) + bias, causal) v, written out."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(HEAD) + bias  # [B, H, L, L]
    logits = logits.masked_fill(~causal_mask(LENGTH, LENGTH, q.device), float("-inf"))
    return logits.softmax(-1) @ v  # [B, H, L, d]


def attend(enc, q, k, v, pos, backend="eager"):
    """What posbench.attention.Attention does with the encoding after the projections."""
    call = AttentionCall(enc, pos, pos, 0, True)
    q, k = query_key_hooks(q, k, call)
    return get_backend(backend).attend(q, k, v, call)


def test_rope_plus_t5_equals_the_two_parts_applied_by_hand():
    enc = composite(["rope", "t5"])
    rope, t5 = make_encoding("rope", d_model=D_MODEL, n_heads=HEADS), make_encoding("t5", d_model=D_MODEL,
                                                                                       n_heads=HEADS).double()
    t5.load_state_dict(enc.parts[1].state_dict())  # the standalone t5 gets the composite's learned table
    q, k, v = qkv()
    pos = torch.arange(3, 3 + LENGTH)[None]
    rq, rk = rope.qk(q, k, pos, pos, 0)  # rotated separately by a standalone rope
    expected = attention_by_hand(rq, rk, v, t5.bias(pos, pos, 0))
    assert enc.hooks == {"qk", "bias"} and enc.relative
    assert_close_scaled(attend(enc, q, k, v, pos), expected, rtol=0, atol_scale=1e-12, name="eager")
    assert_close_scaled(attend(enc, q, k, v, pos, "sdpa"), expected, rtol=0, atol_scale=1e-12, name="sdpa")


def test_learned_plus_alibi_equals_table_row_and_linear_bias_by_hand():
    enc = composite(["learned", "alibi"])
    q, k, v = qkv()
    pos = torch.arange(LENGTH)[None]
    x = torch.randn(2, LENGTH, D_MODEL, dtype=torch.float64)
    ids = torch.zeros(2, LENGTH, dtype=torch.long)
    torch.testing.assert_close(enc.embed(x, pos, ids), x + enc.parts[0].table[:LENGTH], rtol=0, atol=0)
    slopes = alibi_slopes(HEADS)  # [H]: 2^-4, 2^-8 for two heads
    distance = (pos[0, :, None] - pos[0, None, :]).double()  # [L, L], i - j
    expected = attention_by_hand(q, k, v, -slopes[:, None, None] * distance.abs())
    assert enc.hooks == {"embed", "decay"} and not enc.relative  # alibi in a causal model: a decay
    assert_close_scaled(attend(enc, q, k, v, pos), expected, rtol=0, atol_scale=1e-12, name="eager")


def test_embed_sum_of_sinusoidal_and_learned():
    enc = composite(["sinusoidal", "learned"], embed_rule="sum")
    pos = torch.tensor([[0, 1, 2, 5], [2, 3, 4, 9]])  # [B, L]: per-sequence positions
    x = torch.randn(2, 4, D_MODEL, dtype=torch.float64)
    p_sin = sinusoidal_table(pos, D_MODEL).double()  # integer positions: the float32 table the part adds
    expected = x + p_sin + enc.parts[1].table[pos]
    got = enc.embed(x, pos, torch.zeros(2, 4, dtype=torch.long))
    assert_close_scaled(got, expected, rtol=0, atol_scale=1e-12, name="embedding")


@pytest.mark.parametrize("parts,params,message", [
    (["sinusoidal", "learned"], {}, r"\['sinusoidal', 'learned'\] all have an embed hook; set encoding.embed_rule=sum"),
    (["rope", "xpos"], {}, r"\['rope', 'xpos'\] all transform q and k \(qk hook\); at most one"),
    (["tener", "deberta"], {}, r"disagree on the logit scale \{'tener': 1.0, 'deberta': 0.2041"),
    (["rope", "bogus"], {}, r"unknown part 'bogus'; registered encodings: \['alibi', .*'xpos'\]"),
    (["rope", "composite"], {}, "a composite cannot be a part of a composite"),
    (["learned", "complex_order"], {"embed_rule": "sum"}, r"cannot add \['complex_order'\].*replaces the token"),
    (["t5", "t5"], {}, r"parts \['t5'\] appear more than once"),
    ("rope", {}, "must be a non-empty list"),
    ([], {}, "must be a non-empty list"),
    (["rope"], {"part_params": {"t5": {"num_buckets": 16}}}, r"part_params names \['t5'\].*not among parts"),
    (["t5"], {"part_params": {"t5": {"num_bucket": 16}}}, r"part t5 has no parameter\(s\) \['num_bucket'\]"),
    (["t5"], {"embed_rule": "concat"}, r"embed_rule='concat' is not valid; choose one of \['error', 'sum'\]"),
])
def test_refusals_name_the_problem(parts, params, message):
    with pytest.raises(ValueError, match=message):
        make_encoding("composite", d_model=D_MODEL, n_heads=HEADS, parts=parts, **params)


def test_unknown_part_list_leaves_out_composite():
    with pytest.raises(ValueError) as err:
        make_encoding("composite", parts=["nothing"])
    assert "'composite'" not in str(err.value) and "'rope'" in str(err.value)


def test_logit_scale_one_override_wins_over_defaults():
    assert composite(["rope", "t5"]).logit_scale(HEAD) == 1 / math.sqrt(HEAD)
    assert composite(["tener", "t5"]).logit_scale(HEAD) == 1.0
    assert composite(["alibi", "deberta"]).logit_scale(HEAD) == 1 / math.sqrt(3 * HEAD)
    assert composite(["tener", "urpe"]).logit_scale(HEAD) == 1.0  # urpe (itself a composite) keeps the default


def test_params_record_parts_rule_and_each_parts_settings():
    enc = make_encoding("composite", parts=["rope", "t5"], part_params={"t5": {"num_buckets": 16}})
    params = enc.params()
    assert params == {"parts": ["rope", "t5"], "embed_rule": "error",
                      "rope": {"base": 10000.0, "layout": "half", "scaling": "none", "scaling_factor": None,
                               "original_positions": None, "rotary_fraction": 1.0, "frequency_fraction": 1.0,
                               "frequency_cut": "none", "short_factors": None, "long_factors": None,
                               "resonance": False},
                      "t5": {"num_buckets": 16, "max_distance": 128, "bidirectional": False, "bucketed": True}}
    json.dumps(params)  # result rows are JSON


@pytest.mark.parametrize("parts,part_params,relative", [
    (["rope", "alibi"], {}, True), (["nope", "t5"], {}, True), (["alibi", "shaw"], {}, True),
    (["shaw", "transformer_xl"], {}, True), (["xpos", "urpe"], {}, True),
    (["learned", "alibi"], {}, False), (["fire", "rope"], {}, False),
    # a content term reads the rotated q and k, whichever part comes first
    (["rope", "tener"], {}, False), (["tener", "rope"], {}, False), (["xpos", "shaw"], {}, False),
    (["rope", "deberta"], {}, False), (["rope", "urpe"], {"urpe": {"base": "transformer_xl"}}, False),
])
def test_relative_when_every_part_is_and_no_content_term_is_rotated(parts, part_params, relative):
    assert make_encoding("composite", parts=parts, part_params=part_params).relative is relative


def test_replaces_token_embedding_when_a_part_does():
    assert make_encoding("composite", parts=["complex_order", "alibi"]).replaces_token_embedding
    assert not make_encoding("composite", parts=["learned", "alibi"]).replaces_token_embedding


@pytest.mark.parametrize("causal", [True, False])
def test_rope_plus_alibi_is_shift_invariant(causal):
    enc = make_encoding("composite", causal=causal, d_model=D_MODEL, n_heads=HEADS, parts=["rope", "alibi"]).double()
    q, k, _ = qkv(1)
    pos = torch.arange(LENGTH)[None]

    def logits(shift):
        call = AttentionCall(enc, pos + shift, pos + shift, 0, causal)
        rq, rk = query_key_hooks(q, k, call)
        if causal:  # alibi as a decay: c_i - c_j
            term = call.q_levels[..., :, None] - call.k_levels[..., None, :]
        else:
            term = enc.bias(pos + shift, pos + shift, 0)
        return rq @ rk.transpose(-1, -2) * enc.logit_scale(HEAD) + term

    for shift in (1, 37, 1000):
        assert_close_scaled(logits(shift), logits(0), rtol=0, atol_scale=1e-9, name=f"shift {shift}")


def test_parts_parameters_are_registered_and_train():
    enc = make_encoding("composite", parts=["learned", "t5"])
    names = {name for name, _ in enc.named_parameters()}
    assert names == {"parts.0.table", "parts.1.table.weight"}
    pos = torch.arange(4)[None]
    loss = enc.embed(torch.zeros(1, 4, 16), pos, None).sum() + enc.bias(pos, pos, 0).sum()
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.parameters())


def test_set_eval_length_reaches_every_part():
    enc = make_encoding("composite", parts=["rope", "t5"], part_params={"rope": {"scaling": "pi"}})
    before = enc.parts[0].inv_freq.clone()
    enc.set_eval_length(10, 20)  # position interpolation with s = 2
    torch.testing.assert_close(enc.parts[0].inv_freq, before / 2)
    enc.train()  # and training mode reaches the part too: rope drops its scaling
    torch.testing.assert_close(enc.parts[0].inv_freq, before)


def test_backend_auto_picks_eager_when_a_part_needs_it():
    assert get_backend("auto", make_encoding("composite", parts=["rope", "t5"])).name == "sdpa"
    assert get_backend("auto", make_encoding("composite", parts=["rope", "shaw"])).name == "eager"
    with pytest.raises(ValueError, match="backend=sdpa cannot run"):
        get_backend("sdpa").check(make_encoding("composite", parts=["alibi", "shaw"]))


class Halve(Encoding):
    """Test part: prob halves every probability, value_term adds 1; bias adds 1."""
    name = "halve"
    hooks = frozenset({"prob", "value_term", "bias"})
    relative = True

    def prob(self, p, q_pos, k_pos, layer):
        return p / 2

    def value_term(self, p, q_pos, k_pos, layer):
        return torch.ones(*p.shape[:-1], HEAD, dtype=p.dtype)

    def bias(self, q_pos, k_pos, layer):
        return torch.ones(1, HEADS, q_pos.shape[1], k_pos.shape[1], dtype=torch.float64)


class Square(Halve):
    """Test part: prob squares every probability, value_term adds 2; no bias."""
    name = "square"
    hooks = frozenset({"prob", "value_term"})

    def prob(self, p, q_pos, k_pos, layer):
        return p ** 2

    def value_term(self, p, q_pos, k_pos, layer):
        return 2 * super().value_term(p, q_pos, k_pos, layer)


def test_prob_in_sequence_value_terms_summed(monkeypatch):
    monkeypatch.setitem(REGISTRY, "halve", Halve)
    monkeypatch.setitem(REGISTRY, "square", Square)
    q, k, v = qkv()
    pos = torch.arange(LENGTH)[None]
    logits = q @ k.transpose(-1, -2) / math.sqrt(HEAD) + 1  # the one bias: Halve's
    p = logits.masked_fill(~causal_mask(LENGTH, LENGTH, q.device), float("-inf")).softmax(-1)
    for order, modulated in ((["halve", "square"], (p / 2) ** 2), (["square", "halve"], p ** 2 / 2)):
        enc = make_encoding("composite", d_model=D_MODEL, n_heads=HEADS, parts=order)
        assert_close_scaled(attend(enc, q, k, v, pos), modulated @ v + 3, rtol=0, atol_scale=1e-12,
                            name="+".join(order))


def test_cli_shape_composes_and_builds():
    cfg = compose_cfg("encoding=composite", "encoding.parts=[learned,alibi]")
    assert [part.name for part in build(cfg, torch.device("cpu")).encoding.parts] == ["learned", "alibi"]
    cfg = compose_cfg("encoding=composite", "encoding.part_params={t5: {num_buckets: 16}}")
    built = build(cfg, torch.device("cpu"))
    assert built.encoding.params()["t5"]["num_buckets"] == 16 and built.backend == "sdpa"
    cfg = compose_cfg("encoding=composite", "encoding.parts=[sinusoidal,learned,alibi]", "encoding.embed_rule=sum")
    assert build(cfg, torch.device("cpu")).encoding.hooks == {"embed", "decay"}  # alibi in a causal model


def test_a_composite_or_schedule_follows_its_parts_relative_trait_past_n():
    """longrope's start positions make rope not relative past N (and self_extend is not while extending): a
    composite, a schedule or DAPE holding it says so past N and relative again once training resumes."""
    rope = {"scaling": "longrope", "start_positions": 2}
    holders = [make_encoding("composite", parts=["rope", "t5"], part_params={"rope": rope}),
               make_encoding("schedule", pattern=["r", "nope"], kinds={"r": {"encoding": "rope", **rope}}),
               make_encoding("composite", parts=["self_extend", "alibi"])]
    for enc in holders:
        assert enc.relative, enc.name
        enc.eval()
        enc.set_eval_length(64, 256)
        assert not enc.relative, enc.name
        enc.set_eval_length(64, 64)
        assert enc.relative, enc.name
        enc.set_eval_length(64, 256)
        enc.train()
        assert enc.relative, enc.name


def test_every_hook_of_the_table_has_a_combination(monkeypatch):
    """Each hook of posbench.hooks is combined by its rule, none left to Encoding's "no change" (which would
    drop the parts' terms); a hook the table gains without a combination, or a rule composite does not know,
    fails construction naming it."""
    from posbench.encodings.composite import COMBINE_RULES, Composite
    from posbench.hooks import HOOKS, Hook

    assert [name for name in HOOKS if getattr(Composite, name) is getattr(Encoding, name)] == []
    assert {hook.combine for hook in HOOKS.values()} <= set(COMBINE_RULES)
    monkeypatch.setitem(HOOKS, "fake", Hook("fake", "a test hook", frozenset({"eager"}), False, "sum"))
    with pytest.raises(TypeError, match=r"no combination of hook\(s\) \{'fake': 'sum'\}"):
        make_encoding("composite", parts=["rope", "t5"])
    monkeypatch.delitem(HOOKS, "fake")
    monkeypatch.setitem(HOOKS, "bias", Hook("bias", "a bias", frozenset({"eager"}), True, "max"))
    with pytest.raises(TypeError, match=r"no combination of hook\(s\) \{'bias': 'max'\}"):
        make_encoding("composite", parts=["rope", "t5"])


def test_query_scales_multiply():
    enc = make_encoding("composite", d_model=D_MODEL, n_heads=HEADS, parts=["ssmax", "temperature"],
                        part_params={"temperature": {"floor_scale": 2}})
    torch.nn.init.normal_(enc.parts[0].scale)
    pos = torch.arange(LENGTH)[None]
    call = AttentionCall(enc, pos, pos, 0, True, x=torch.zeros(1, LENGTH, D_MODEL))
    factors = [part.query_scale(call) for part in enc.parts]  # [1, H, L, 1], [1, 1, L, 1]
    assert not torch.equal(factors[1], torch.ones_like(factors[1]))
    torch.testing.assert_close(enc.query_scale(call), factors[0] * factors[1], rtol=0, atol=0)


class ShiftKeys(Encoding):
    """Test part: kv adds 1 to the keys and doubles the values."""
    name = "shift_keys"
    hooks = frozenset({"kv"})

    def kv(self, k, v, call):
        return k + 1, 2 * v


class SquareKeys(ShiftKeys):
    """Test part: kv squares the keys and leaves the values."""
    name = "square_keys"

    def kv(self, k, v, call):
        return k ** 2, v


def test_kv_in_sequence_threads_keys_and_values(monkeypatch):
    monkeypatch.setitem(REGISTRY, "shift_keys", ShiftKeys)
    monkeypatch.setitem(REGISTRY, "square_keys", SquareKeys)
    _, k, v = qkv()
    pos = torch.arange(LENGTH)[None]
    for order, keys, values in ((["shift_keys", "square_keys"], (k + 1) ** 2, 2 * v),
                                (["square_keys", "shift_keys"], k ** 2 + 1, 2 * v)):
        enc = make_encoding("composite", d_model=D_MODEL, n_heads=HEADS, parts=order)
        got = enc.kv(k, v, AttentionCall(enc, pos, pos, 0, True))
        torch.testing.assert_close(got, (keys, values), rtol=0, atol=0)


WIDENED = r"composite: parts \['pope'\] return q and k wider than the head size d = 8 from their qk hook; "
READS = r"parts \['{}'\] read q or k themselves \(a key term or reads_query_key\) with tables as wide as the head"
SCALE = r"parts \['{}'\] set their own logit scale \{{'{}': {}\}}, and beside the wider q and k \['pope'\] keep the head's"


@pytest.mark.parametrize("parts,message", [
    (["pope", "shaw"], WIDENED + READS.format("shaw")),
    (["cope", "pope"], WIDENED + READS.format("cope")),  # whatever the order of the parts
    (["pope", "path"], WIDENED + READS.format("path")),
    (["pope", "tener"], WIDENED + READS.format("tener") + r".*; and " + SCALE.format("tener", "tener", "1.0")),
    (["pope", "cable"], WIDENED + SCALE.format("cable", "cable", "1.0")),  # cable's logit_scale=none reads no q
])
def test_a_part_widening_q_and_k_is_refused_beside_a_reader_or_another_logit_scale(parts, message):
    """Each of these failed in the forward before (a shape error, or 'parts disagree on the logit scale' at
    head size 2d): refused at construction, naming both parts and why."""
    with pytest.raises(ValueError, match=message):
        make_encoding("composite", d_model=D_MODEL, n_heads=HEADS, parts=parts)


@pytest.mark.parametrize("parts,part_params", [(["pope", "alibi"], None), (["pope", "fox"], None),
                                               (["pope", "cable"], {"cable": {"logit_scale": "sqrt_d"}})])
def test_a_part_widening_q_and_k_builds_beside_parts_that_read_only_logits(parts, part_params):
    """pope's logits with alibi's or fox's decay or cable's: the composite's scale is pope's 1/sqrt(d) at q's 2d."""
    enc = composite(parts, part_params=part_params)
    assert enc.widens_query_key and not make_encoding("composite", parts=["rope", "alibi"]).widens_query_key
    assert enc.logit_scale(2 * HEAD) == 1 / math.sqrt(HEAD)


def test_pope_plus_alibi_equals_polar_logits_and_linear_bias_by_hand():
    """PoPE written with complex numbers (Re sum_c conj(mu^q_c e^{i t theta_c}) mu^k_c e^{i (s theta_c + delta_c)},
    theta_c = 10000^(-c/d), scaled 1/sqrt(d)) plus alibi's -m |t - s|, beside the 2d-wide q and k."""
    enc = composite(["pope", "alibi"])
    q, k, v = qkv()
    pos = torch.arange(2, 2 + LENGTH)[None]
    theta = torch.tensor([10000.0 ** (-c / HEAD) for c in range(HEAD)], dtype=torch.float64)  # [d]
    delta = enc.parts[0].delta[0].detach().clamp(-2 * math.pi, 0)  # [H, d]
    phase_q = pos[0, :, None] * theta  # [L, d]
    phase_k = pos[0, :, None] * theta + delta[:, None, :]  # [H, L, d]
    q_polar = torch.nn.functional.softplus(q) * torch.exp(1j * phase_q)  # [B, H, L, d]
    k_polar = torch.nn.functional.softplus(k) * torch.exp(1j * phase_k)  # [B, H, L, d]
    logits = (q_polar.conj() @ k_polar.transpose(-1, -2)).real / math.sqrt(HEAD)  # [B, H, L, L]
    distance = (pos[0, :, None] - pos[0, None, :]).double()  # [L, L]
    logits = logits - alibi_slopes(HEADS)[:, None, None] * distance.abs()
    logits = logits.masked_fill(~causal_mask(LENGTH, LENGTH, q.device), float("-inf"))
    assert_close_scaled(attend(enc, q, k, v, pos), logits.softmax(-1) @ v, rtol=1e-12, name="pope + alibi")
