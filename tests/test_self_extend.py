"""SelfExtend (encoding=self_extend): against a naive attention written here from the paper's rule
(every pair's logit from rotations at absolute, then grouped, positions; a where; one softmax), rope
in training and within the training length bit for bit, chunked evaluation as one pass, the trait
and the refusals; the optional query log-scale (scale_base) against the official formula written out
one query at a time."""
from __future__ import annotations

import math

import pytest
import torch

from posbench.attention import get_backend
from posbench.attention.context import AttentionCall
from posbench.attention.eager import EagerBackend
from posbench.attention.layer import query_key_hooks
from posbench.encodings import REGISTRY
from posbench.encodings.base import ModelDims
from posbench.encodings.self_extend import SelfExtend
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled, compose_cfg, make_encoding

HEADS, HEAD_DIM, TRAIN = 2, 16, 32


def dims(train_positions: int = TRAIN, causal: bool = True) -> ModelDims:
    return ModelDims(d_model=HEADS * HEAD_DIM, n_heads=HEADS, n_layers=1, max_positions=8 * train_positions,
                     train_positions=train_positions, causal=causal)


def naive_rotate(x: torch.Tensor, pos: torch.Tensor, base: float, layout: str) -> torch.Tensor:
    """Pair m (interleaved (2m, 2m+1) or half (m, m + d/2)) turned by pos * base^(-2m/d), one pair at a
    time. x: [B, H, L, d], pos: [B', L] (float) -> [B, H, L, d]."""
    d = x.shape[-1]
    out = x.clone()
    for m in range(d // 2):
        a, b = (2 * m, 2 * m + 1) if layout == "interleaved" else (m, m + d // 2)
        angle = pos[:, None, :].double() * base ** (-2 * m / d)  # [B', 1, L]
        out[..., a] = x[..., a] * angle.cos() - x[..., b] * angle.sin()
        out[..., b] = x[..., a] * angle.sin() + x[..., b] * angle.cos()
    return out


def naive_self_extend(q, k, v, q_pos, k_pos, group: int, window: int, causal: bool, base: float = 10000.0,
                      layout: str = "half") -> torch.Tensor:
    """Jin et al.'s attention: neighbour logits from q at i and k at j; grouped logits from q at
    floor(i/G) + W - W/G and k at floor(j/G) (bidirectional, keys right of the window: q at
    floor(i/G) - (W - W/G)); neighbour where i - j < W (and j - i < W), grouped elsewhere; the causal
    mask (queries the last keys), softmax, times v. q: [B, H, Lq, d], k, v: [B, H, Lk, d]."""
    scale = 1 / math.sqrt(q.shape[-1])
    shift = window - window / group

    def logits(q_at, k_at):
        return naive_rotate(q, q_at, base, layout) @ naive_rotate(k, k_at, base, layout).transpose(-1, -2) * scale

    gq, gk = torch.floor(q_pos.double() / group), torch.floor(k_pos.double() / group)  # [B', Lq], [B', Lk]
    distance = (q_pos[:, :, None] - k_pos[:, None, :])[:, None]  # [B', 1, Lq, Lk]
    out = torch.where(distance < window, logits(q_pos.double(), k_pos.double()), logits(gq + shift, gk))
    if not causal:
        out = torch.where(distance <= -window, logits(gq - shift, gk), out)
    else:
        lq, lk = q.shape[-2], k.shape[-2]
        seen = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        out = out.masked_fill(~seen, float("-inf"))
    return out.softmax(-1) @ v


def naive_log_scaled(q: torch.Tensor, q_pos: torch.Tensor, scale_base: int) -> torch.Tensor:
    """LongLM's scaled_query: q_i times max(ln(i + 1) / ln b, 1), one query at a time, in float64.
    q: [B, H, Lq, d], q_pos: [B', Lq] -> [B, H, Lq, d]."""
    out = q.clone()
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            position = q_pos[b if q_pos.shape[0] > 1 else 0, i].item()
            out[b, :, i] = q[b, :, i] * max(math.log(position + 1) / math.log(scale_base), 1.0)
    return out


def extended(enc: SelfExtend, length: int) -> SelfExtend:
    enc.eval()
    enc.set_eval_length(enc.dims.train_positions, length)
    return enc


def qkv(lq: int, lk: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, lq, HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, HEADS, lk, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("group,window", [(4, 8), (4, 6), (3, 5), (1, 4), (8, 32)])
def test_attention_matches_the_naive_rule(group, window, layout, causal):
    """W/G fractional (6/4, 5/3) as in the official eager code; G = 1 is rope; positions from 0 and shifted."""
    enc = extended(SelfExtend(dims(causal=causal), layout=layout, group_size=group, window=window).double(), 96)
    q, k, v = qkv(40, 40)
    for pos in (torch.arange(40)[None], torch.stack([torch.arange(40) + 7, torch.arange(40) * 2 + 100])):
        rq, rk = enc.qk(q, k, pos, pos, 0)
        got = EagerBackend().attend(rq, rk, v, AttentionCall(enc, pos, pos, 0, causal))
        assert_close_scaled(got, naive_self_extend(q, k, v, pos, pos, group, window, causal, layout=layout), rtol=1e-10)


def test_queries_after_a_memory_match_the_naive_rule():
    """Fewer queries than keys (a memory then the queries, aligned to the last keys)."""
    enc = extended(SelfExtend(dims(), group_size=4, window=8).double(), 96)
    q, k, v = qkv(10, 40)
    k_pos = torch.arange(40)[None] + 3
    q_pos = k_pos[:, 30:]
    rq, rk = enc.qk(q, k, q_pos, k_pos, 0)
    got = EagerBackend().attend(rq, rk, v, AttentionCall(enc, q_pos, k_pos, 0, True))
    assert_close_scaled(got, naive_self_extend(q, k, v, q_pos, k_pos, 4, 8, True), rtol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("scale_base", [2, 16, TRAIN])
def test_query_log_scale_matches_the_official_formula(scale_base, causal):
    """scale_base b: every query, neighbour and grouped logits alike, times max(ln(i + 1) / ln b, 1) (the
    official position_ids + 1, natural logs, clip at 1), through the hooks as attention runs them."""
    enc = extended(SelfExtend(dims(causal=causal), group_size=4, window=6, scale_base=scale_base).double(), 96)
    q, k, v = qkv(40, 40)
    for pos in (torch.arange(40)[None], torch.stack([torch.arange(40) + 7, torch.arange(40) * 2 + 100])):
        call = AttentionCall(enc, pos, pos, 0, causal, x=torch.zeros(2, 40, HEADS * HEAD_DIM, dtype=torch.float64))
        assert enc.query_scale(call).max() > 1  # some queries past b
        rq, rk = query_key_hooks(q, k, call)
        got = EagerBackend().attend(rq, rk, v, call)
        expected = naive_self_extend(naive_log_scaled(q, pos, scale_base), k, v, pos, pos, 4, 6, causal)
        assert_close_scaled(got, expected, rtol=1e-10)


def test_query_log_scale_acts_only_while_extending_and_is_the_identity_when_off():
    """Off (null) and in training or within N: the model is rope bit for bit; past N a base above every
    position + 1 clips every factor to 1 (bit for bit the model without it), b = N changes the outputs."""
    rope, scaled = model_pair(group_size=4, window=8, scale_base=TRAIN)
    _, plain = model_pair(group_size=4, window=8)
    _, clipped = model_pair(group_size=4, window=8, scale_base=1000)
    assert scaled.encoding.hooks == {"qk", "query_scale", "logit_transform"}
    assert plain.encoding.hooks == SelfExtend.hooks == {"qk", "logit_transform"}
    ids = torch.randint(0, 11, (2, 80), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(80)[None]
    scaled.encoding.set_eval_length(TRAIN, 80)  # ignored in train mode
    assert torch.equal(scaled(ids, pos), rope(ids, pos))
    for model in (rope, scaled, plain, clipped):
        model.eval()
    scaled.encoding.set_eval_length(TRAIN, TRAIN)
    assert torch.equal(scaled(ids[:, :TRAIN], pos[:, :TRAIN]), rope(ids[:, :TRAIN], pos[:, :TRAIN]))
    for model in (scaled, plain, clipped):
        model.encoding.set_eval_length(TRAIN, 80)
    call = AttentionCall(plain.encoding, pos, pos, 0, True)
    assert plain.encoding.query_scale(call) is None and clipped.encoding.query_scale(call).eq(1).all()
    assert torch.equal(clipped(ids, pos), plain(ids, pos))
    assert (scaled(ids, pos) - plain(ids, pos)).abs().max() > 1e-6


def test_far_keys_see_grouped_distances_and_near_keys_plain_rope():
    """Query 37, G = 4, W = 8: g_q = 9 + 8 - 2 = 15, so key 0 (g_k = 0) is seen at distance 15 and key 29
    (i - j = 8 = W, g_k = 7) at 8; key 30 (i - j = 7 < W) at 7, plain rope."""
    enc = extended(SelfExtend(dims(), group_size=4, window=8).double(), 96)
    q, k, _ = qkv(1, 3)
    q_pos, k_pos = torch.tensor([[37]]), torch.tensor([[0, 29, 30]])
    rq, rk = enc.qk(q, k, q_pos, k_pos, 0)
    logits = enc.logit_transform(rq @ rk.transpose(-1, -2) / 4, rq, rk, AttentionCall(enc, q_pos, k_pos, 0, False))
    for column, distance in enumerate((15, 8, 7)):
        expected = naive_rotate(q, torch.tensor([[distance]]), 1e4, "half") @ k[:, :, column:column + 1].transpose(-1, -2)
        assert_close_scaled(logits[..., column:column + 1], expected / 4, rtol=1e-12)


def model_pair(causal: bool = True, **params) -> tuple[Transformer, Transformer]:
    """A rope model and a self_extend model with the same weights (float64, eager)."""
    models = []
    for name in ("rope", "self_extend"):
        torch.manual_seed(0)
        enc = make_encoding(name, causal=causal, d_model=32, n_heads=2, max_positions=TRAIN,
                            **(params if name == "self_extend" else {}))
        cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, causal=causal)
        models.append(Transformer(cfg, enc, get_backend("eager")).double())
    return models[0], models[1]


@pytest.mark.parametrize("causal", [True, False])
def test_training_and_the_training_length_are_rope_bit_for_bit(causal):
    rope, self_extend = model_pair(causal, group_size=4, window=8)
    ids = torch.randint(0, 11, (2, 80), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(80)[None]
    rope.train(), self_extend.train()
    self_extend.encoding.set_eval_length(TRAIN, 80)  # ignored in train mode
    assert torch.equal(self_extend(ids, pos), rope(ids, pos))
    rope.eval(), self_extend.eval()
    for length in (16, TRAIN):
        self_extend.encoding.set_eval_length(TRAIN, length)
        assert torch.equal(self_extend(ids[:, :length], pos[:, :length]), rope(ids[:, :length], pos[:, :length]))
    self_extend.encoding.set_eval_length(TRAIN, 80)
    assert (self_extend(ids, pos) - rope(ids, pos)).abs().max() > 1e-5  # past N: grouped far keys (4e-4 here)
    self_extend.train()  # training resets
    assert torch.equal(self_extend(ids, pos), rope(ids, pos))


@pytest.mark.parametrize("scale_base", [None, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_chunked_evaluation_equals_one_pass(causal, scale_base):
    _, model = model_pair(causal, group_size=4, window=8, scale_base=scale_base)
    model.eval()
    model.encoding.set_eval_length(TRAIN, 70)
    ids = torch.randint(0, 11, (2, 70), generator=torch.Generator().manual_seed(2))
    for pos in (torch.arange(70)[None], torch.stack([torch.arange(70), torch.arange(70) * 3 + 5])):
        reference = model(ids, pos)
        for chunk in (1, 5, 69):
            model.set_eval_chunk(chunk)
            assert_close_scaled(model(ids, pos), reference, rtol=1e-12, name=f"chunk {chunk}")
        model.set_eval_chunk(None)


def test_relative_only_while_not_extending():
    """Grouping reads positions modulo G: a shift by 1 changes the outputs past N, not within it."""
    _, model = model_pair(group_size=4, window=8)
    model.eval()
    ids = torch.randint(0, 11, (2, 60), generator=torch.Generator().manual_seed(3))
    shifted = lambda: (model(ids, torch.arange(60)[None] + 1) - model(ids, torch.arange(60)[None])).abs().max()
    model.encoding.set_eval_length(TRAIN, TRAIN)
    assert model.encoding.relative and shifted() < 1e-9
    model.encoding.set_eval_length(TRAIN, 60)
    assert not model.encoding.relative and shifted() > 1e-6
    model.train()
    assert model.encoding.relative and REGISTRY["self_extend"].relative


def test_a_composite_part_keeps_its_bias_on_far_keys():
    """self_extend beside t5: the far pairs' rotary term is grouped, the t5 bias stays on every pair."""
    composite = make_encoding("composite", d_model=32, n_heads=2, max_positions=TRAIN, parts=["self_extend", "t5"],
                              part_params={"self_extend": {"group_size": 4, "window": 8}}).double()
    for p in composite.parameters():
        torch.nn.init.normal_(p, std=0.5)
    composite.eval()
    composite.set_eval_length(TRAIN, 64)
    alone = composite.parts[0]
    q, k, v = qkv(64, 64)
    pos = torch.arange(64)[None]
    rq, rk = composite.qk(q, k, pos, pos, 0)
    bias = composite.bias(pos, pos, 0)  # [1, H, L, L]
    call = AttentionCall(composite, pos, pos, 0, True)
    got = composite.logit_transform(rq @ rk.transpose(-1, -2) / 4 + bias, rq, rk, call)
    expected = alone.logit_transform(rq @ rk.transpose(-1, -2) / 4, rq, rk, AttentionCall(alone, pos, pos, 0, True))
    assert_close_scaled(got, expected + bias, rtol=1e-12)


def test_window_defaults_to_a_quarter_of_the_training_positions_and_params_record_it():
    enc = SelfExtend(dims(train_positions=40))
    assert enc.window == 10 and enc.shift == 10 - 10 / 8
    assert enc.params() == {"base": 10000.0, "layout": "half", "rotary_fraction": 1.0, "group_size": 8, "window": 10,
                            "scale_base": None}
    assert SelfExtend(dims(), scale_base=4096).params()["scale_base"] == 4096
    assert SelfExtend(dims(train_positions=3)).window == 1


@pytest.mark.parametrize("params,message", [
    ({"group_size": 0}, r"self_extend: encoding.group_size=0: must be >= 1"),
    ({"group_size": 2.5}, r"self_extend: encoding.group_size=2.5: must be an integer >= 1"),
    ({"window": 0}, r"self_extend: encoding.window=0: must be >= 1, or null \(a quarter of the training positions, "
                    r"here 8\)"),
    ({"window": 33}, r"self_extend: encoding.window=33 is past the training positions 32.*choose 1 <= window <= 32, "
                     r"or null \(8\)"),
    ({"layout": "bogus"}, r"self_extend: encoding.layout='bogus' is not valid; choose one of \['half', 'interleaved'\]"),
    ({"rotary_fraction": 0.03}, "self_extend: encoding.rotary_fraction=0.03 rotates"),
    ({"scale_base": 1}, r"self_extend: encoding.scale_base=1: must be >= 2, or null \(off, the official default\)"),
    ({"scale_base": -1}, r"self_extend: encoding.scale_base=-1: must be >= 2"),
    ({"scale_base": 4096.5}, r"self_extend: encoding.scale_base=4096.5: must be an integer >= 2"),
])
def test_bad_settings_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        SelfExtend(dims(), **params)


def test_runs_on_the_eager_backend_only():
    enc = SelfExtend(dims())
    with pytest.raises(ValueError, match=r"backend=sdpa cannot run the \['logit_transform'\] hook"):
        get_backend("sdpa").check(enc)
    assert get_backend("auto", enc).name == "eager"


def test_builds_from_the_command_line():
    from posbench.build import build

    built = build(compose_cfg("encoding=self_extend", "encoding.group_size=4", "encoding.window=3",
                              "encoding.scale_base=64"), torch.device("cpu"))
    assert built.encoding.params()["group_size"] == 4 and built.encoding.window == 3
    assert built.encoding.scale_base == 64 and "query_scale" in built.encoding.hooks
    assert built.model.blocks[0].attn.backend.name == "eager"
