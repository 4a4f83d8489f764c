"""Each encoding against its paper's formula (float64), and the properties every encoding owes."""
import math

import pytest
import torch

from posbench.attention import BACKENDS, AttentionCall, get_backend
from posbench.encodings import HOOKS, REGISTRY
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.rope import rotate, rope_inv_freq
from posbench.encodings.sinusoidal import sinusoidal_table
from posbench.encodings.t5 import t5_bucket
from posbench.model import ModelConfig, Transformer
from tests.helpers import (ENCODING_CASES, assert_close_scaled, grid_positions, make_case, make_encoding, positions_for,
                           with_layouts)


def test_sinusoidal_interleaved_matches_closed_formula():
    dim, pos = 12, torch.arange(50, dtype=torch.float64)
    table = sinusoidal_table(pos, dim)
    for k in (0, 1, 7, 49):
        for m in range(dim // 2):
            angle = k / 10000 ** (2 * m / dim)
            assert table[k, 2 * m].item() == pytest.approx(math.sin(angle), abs=1e-12)
            assert table[k, 2 * m + 1].item() == pytest.approx(math.cos(angle), abs=1e-12)


def test_sinusoidal_concat_is_a_permutation_of_interleaved():
    pos = torch.arange(30, dtype=torch.float64)
    inter, concat = sinusoidal_table(pos, 10), sinusoidal_table(pos, 10, layout="concat")
    perm = torch.cat((torch.arange(0, 10, 2), torch.arange(1, 10, 2)))
    torch.testing.assert_close(concat, inter[:, perm], rtol=0, atol=0)


def test_sinusoidal_row_zero_is_encoded():
    # position 0 is sin(0)=0, cos(0)=1 on every pair: not left blank
    assert sinusoidal_table(torch.zeros(1, dtype=torch.float64), 8)[0].tolist() == [0, 1] * 4


def test_rope_matches_complex_rotation_float64():
    """R_k x as multiplication by exp(i k theta_m) of the complex pairs (x_2m + i x_2m+1)."""
    torch.manual_seed(0)
    d, length = 8, 11
    x = torch.randn(2, 3, length, d, dtype=torch.float64)
    pos = torch.arange(5, 5 + length)[None]
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    phase = torch.polar(torch.ones(length, d // 2, dtype=torch.float64), pos[0, :, None].double() * theta)
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(2, 3, length, d // 2, 2)) * phase).flatten(-2)
    assert_close_scaled(rotate(x, pos, rope_inv_freq(d), "interleaved"), expected, rtol=1e-12)


def test_rope_layouts_agree_up_to_feature_permutation():
    torch.manual_seed(0)
    d = 16
    q, k = torch.randn(2, 2, 9, d, dtype=torch.float64), torch.randn(2, 2, 9, d, dtype=torch.float64)
    pos = torch.arange(9)[None]
    # interleaved pair (2m, 2m+1) <-> half pair (m, m + d/2)
    perm = torch.cat((torch.arange(0, d, 2), torch.arange(1, d, 2)))
    inv = rope_inv_freq(d)
    inter = rotate(q, pos, inv, "interleaved") @ rotate(k, pos, inv, "interleaved").transpose(-1, -2)
    half = rotate(q[..., perm], pos, inv, "half") @ rotate(k[..., perm], pos, inv, "half").transpose(-1, -2)
    assert_close_scaled(inter, half, rtol=0, atol_scale=1e-12, name="logits")  # up to ~14


def test_rope_rejects_odd_head_size():
    with pytest.raises(ValueError, match="even head size"):
        make_encoding("rope", d_model=12, n_heads=4)


def reference_slopes(n_heads: int) -> list[float]:
    """The ALiBi rule written out from ENCODINGS.md, independently of alibi_slopes."""
    p = 1
    while p * 2 <= n_heads:
        p *= 2
    first = [2 ** (-8 * h / p) for h in range(1, p + 1)]
    extra = [2 ** (-8 * h / (2 * p)) for h in range(1, 2 * p + 1, 2)]
    return first + extra[: n_heads - p]


@pytest.mark.parametrize("n_heads", range(1, 65))
def test_alibi_slopes_follow_the_rule(n_heads):
    assert alibi_slopes(n_heads).tolist() == pytest.approx(reference_slopes(n_heads), rel=1e-15)


def test_alibi_slopes_known_values():
    assert alibi_slopes(8).tolist() == [2 ** -i for i in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]


def test_alibi_bias_is_minus_slope_times_distance():
    enc = make_encoding("alibi", n_heads=4, causal=False)
    bias = enc.bias(torch.arange(5)[None], torch.arange(5)[None], 0)  # [1, H, 5, 5]
    slopes = alibi_slopes(4)
    for h in range(4):
        for i in range(5):
            for j in range(5):
                assert bias[0, h, i, j].item() == pytest.approx(-slopes[h].item() * abs(i - j), rel=1e-6)


def reference_bucket(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket rule for one offset rel = j - i, in plain Python floats."""
    n = -rel
    base = 0
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            base = num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return base + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return base + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (64, 256), (8, 20)])
def test_t5_buckets_follow_the_rule(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-1000, 1001)
    got = t5_bucket(rel, bidirectional, num_buckets, max_distance).tolist()
    expected = [reference_bucket(r, bidirectional, num_buckets, max_distance) for r in rel.tolist()]
    assert got == expected


def test_t5_causal_buckets_known_values():
    rel = torch.tensor([5, 1, 0, -1, -15, -16, -127, -128, -1000])
    assert t5_bucket(rel, False).tolist() == [0, 0, 0, 1, 15, 16, 31, 31, 31]


def test_learned_policy_error_is_refused_before_training():
    from posbench.encodings import ModelDims
    make_encoding("learned", max_positions=64, policy="error")  # every position trained: accepted
    dims = ModelDims(d_model=8, n_heads=2, n_layers=1, max_positions=128, train_positions=32)
    with pytest.raises(ValueError, match="positions up to 127"):
        REGISTRY["learned"](dims, policy="error")


def test_learned_clamp_reuses_last_trained_row():
    from posbench.encodings import ModelDims
    enc = REGISTRY["learned"](ModelDims(d_model=8, n_heads=2, n_layers=1, max_positions=20, train_positions=10),
                              policy="clamp")
    out = enc.embed(torch.zeros(1, 20, 8), torch.arange(20)[None], torch.zeros(1, 20, dtype=torch.long))
    torch.testing.assert_close(out[0, 15], enc.table[9].detach())
    torch.testing.assert_close(out[0, 5], enc.table[5].detach())


@pytest.mark.parametrize("name", ["sinusoidal", "learned", "rope"])
def test_bad_option_names_the_value_and_the_choices(name):
    key = {"learned": "policy"}.get(name, "layout")
    with pytest.raises(ValueError, match=r"bogus.*choose one of"):
        make_encoding(name, **{key: "bogus"})


def model_of(enc, causal: bool = True, backend: str = "eager") -> Transformer:
    """A float64 model around a built encoding, every parameter drawn at a trained-looking scale
    (learned tables start at zero or one: make them matter)."""
    torch.manual_seed(0)
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.5)
    cfg = ModelConfig(vocab_size=11, d_model=enc.dims.d_model, n_layers=enc.dims.n_layers,
                      n_heads=enc.dims.n_heads, causal=causal)
    return Transformer(cfg, enc, get_backend(backend)).double().eval()


def tiny_model(name: str, backend: str = "eager", causal: bool = True) -> Transformer:
    return model_of(make_encoding(name, causal=causal, d_model=32, n_heads=4, max_positions=40), causal, backend)


@pytest.mark.parametrize("case,causal", with_layouts(ENCODING_CASES))
def test_relative_trait_matches_a_shift_of_every_position(case, causal):
    """A built instance marked relative gives the same outputs when every position moves by a constant
    (every hook, the whole model); one not marked relative gives other outputs (so the trait is not
    merely false to be safe)."""
    enc = make_case(case, causal=causal, max_positions=2000)
    model = model_of(enc, causal)
    ids = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(4))
    base = model(ids, positions_for(enc, 12))  # 2-D encodings: a 3 x 4 grid
    # 2-D: rows by shift, columns by 2 * shift + 1; 1000 passes fire's threshold, past which it sees i
    changes = [(model(ids, positions_for(enc, 12, shift)) - base).abs().max().item() for shift in (1, 37, 1000)]
    if enc.relative:
        assert max(changes) < 1e-9
    else:
        assert max(changes) > 1e-6  # far above float64 rounding (fire: 4e-4 at shift 1000)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_class_traits_are_those_of_a_default_instance(name):
    """Code that reads a class (REGISTRY[name].hooks) sees what an instance with default parameters has."""
    enc, cls = make_encoding(name), REGISTRY[name]
    assert (enc.hooks, enc.relative, enc.replaces_token_embedding, enc.position_dims) == \
        (cls.hooks, cls.relative, cls.replaces_token_embedding, cls.position_dims)


@pytest.mark.parametrize("case", ENCODING_CASES)
def test_undeclared_hooks_change_nothing(case):
    """Attention skips the hooks an instance does not declare: they must be "no change"."""
    enc = make_case(case).double()
    for p in enc.parameters():
        torch.nn.init.normal_(p)
    pos = positions_for(enc, 6)
    x, ids = torch.randn(2, 6, 16, dtype=torch.float64), torch.randint(0, 11, (2, 6))
    q, k = torch.randn(2, 2, 6, 8, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64)
    p = torch.rand(2, 2, 6, 6, dtype=torch.float64)
    logits, v = torch.randn(2, 2, 6, 6, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64)
    call = AttentionCall(enc, pos, pos, 0, True, x=x)
    unchanged = {"embed": lambda: torch.equal(enc.embed(x, pos, ids), x),
                 "qk": lambda: all(map(torch.equal, enc.qk(q, k, pos, pos, 0), (q, k))),
                 "bias": lambda: enc.bias(pos, pos, 0) is None,
                 "key_term": lambda: enc.key_term(q, k, pos, pos, 0) is None,
                 "prob": lambda: torch.equal(enc.prob(p, pos, pos, 0), p),
                 "value_term": lambda: enc.value_term(p, pos, pos, 0) is None,
                 "query_scale": lambda: enc.query_scale(call) is None,
                 "layer_pass": lambda: enc.layer_pass(q, k, call) is None,
                 "state_init": lambda: enc.state_init(pos, x) is None,
                 "qkv": lambda: all(map(torch.equal, enc.qkv(q, k, v, call), (q, k, v))),
                 "state_update": lambda: torch.equal(enc.state_update(v, call)[0], v)
                 and enc.state_update(v, call)[1] is call.state,
                 "state_mlp": lambda: enc.state_mlp(x, x, 0) is x,
                 "decay": lambda: enc.decay(call) is None,
                 "logit_transform": lambda: torch.equal(enc.logit_transform(logits, q, k, call), logits),
                 "normalize": lambda: torch.equal(enc.normalize(logits, v, call)[0], logits.softmax(-1))
                 and enc.normalize(logits, v, call)[1] is None,
                 "output": lambda: torch.equal(enc.output(v, x, 0), v),
                 "kv": lambda: all(map(torch.equal, enc.kv(k, v, call), (k, v)))}
    assert set(unchanged) == set(HOOKS)
    assert [hook for hook in HOOKS if hook not in enc.hooks and not unchanged[hook]()] == []


@pytest.mark.parametrize("case", [case for case in ENCODING_CASES if "embed" in make_case(case).hooks])
def test_replaces_token_embedding_trait_matches_embed(case):
    """An embed that ignores the token embedding x says so; one that reads x does not."""
    enc = make_case(case)
    pos, ids = positions_for(enc, 6), torch.randint(0, 11, (2, 6))
    x = torch.randn(2, 6, 16)
    reads_x = not torch.equal(enc.embed(x, pos, ids), enc.embed(x + 1, pos, ids))
    assert enc.replaces_token_embedding is not reads_x


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_causality_future_tokens_never_change_the_past(name):
    model = tiny_model(name)
    ids = torch.randint(0, 11, (3, 30), generator=torch.Generator().manual_seed(1))
    pos = positions_for(name, 30)  # 2-D encodings: a 5 x 6 grid in raster order
    out = model(ids, pos)
    for t in (0, 9, 28):
        changed = ids.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1) % 11
        assert_close_scaled(model(changed, pos)[:, : t + 1], out[:, : t + 1], rtol=1e-12)
        if name != "nope" or t < 28:
            assert not torch.allclose(model(changed, pos)[:, t + 1:], out[:, t + 1:])


@pytest.mark.parametrize("name,causal", with_layouts(sorted(REGISTRY)))
def test_sdpa_backend_matches_eager(name, causal):
    if set(REGISTRY[name].hooks) - {"embed"} - get_backend("sdpa").supported_hooks:
        with pytest.raises(ValueError, match="backend=sdpa cannot run"):
            tiny_model(name, "sdpa", causal)
        return
    eager = tiny_model(name, "eager", causal)
    sdpa = tiny_model(name, "sdpa", causal)
    sdpa.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 11, (2, 25), generator=torch.Generator().manual_seed(2))
    pos = positions_for(name, 25)  # 2-D encodings: a 5 x 5 grid
    assert_close_scaled(sdpa(ids, pos), eager(ids, pos), rtol=1e-10)


def test_backends_refuse_hooks_they_cannot_run():
    from posbench.encodings.base import Encoding

    class NeedsProb(Encoding):
        name = "needs_prob"
        hooks = frozenset({"prob"})

    enc = NeedsProb(make_encoding("nope").dims)
    with pytest.raises(ValueError, match=r"backend=sdpa cannot run the \['prob'\].*use backend=eager"):
        get_backend("sdpa").check(enc)
    get_backend("eager").check(enc)
    assert set(BACKENDS) == {"eager", "fla", "flex", "sdpa"}
    assert get_backend("auto", enc).name == "eager"
    assert get_backend("auto", make_encoding("alibi")).name == "sdpa"
    with pytest.raises(ValueError, match=r"backend.name='flash' is not valid.*\['auto', 'eager', 'fla', 'flex', 'sdpa'\]"):
        get_backend("flash")


def test_per_sequence_positions_broadcast():
    """Positions may differ per sequence ([B, L], grids [B, L, 2]); each row must equal its own single-row run."""
    for name in sorted(REGISTRY):
        model = tiny_model(name)
        ids = torch.randint(0, 11, (2, 10), generator=torch.Generator().manual_seed(3))
        pos = torch.stack((torch.arange(10), torch.arange(10) + 5))  # [2, 10]
        if REGISTRY[name].position_dims == 2:  # 2 x 5 grids at (0, 0) and (1, 1), inside learned_2d's table
            pos = torch.cat((grid_positions(2, 5), grid_positions(2, 5, 1, 1)))  # [2, 10, 2]
        both = model(ids, pos)
        for b in range(2):
            assert_close_scaled(both[b], model(ids[b: b + 1], pos[b: b + 1])[0], rtol=1e-10)
