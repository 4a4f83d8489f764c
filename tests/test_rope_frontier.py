"""The rope settings of 2024-25: p-RoPE (encoding.frequency_fraction), HoPE (encoding.frequency_cut=hope),
LongRoPE (encoding.scaling=longrope with short_factors / long_factors, and its start positions
against the official start-token rule written out one position at a time) and Resonance RoPE
(encoding.resonance, against the official cos / sin tables written out pair by pair). Formulas in float64, the
difference from partial rotation, the defaults as before the settings existed, refusals, the config
hash, and equivalence with transformers' proportional and longrope rules and with Gemma's
rope_proportion rule written out here (transformers tests skipped when it is missing)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from posbench.encodings import REGISTRY
from posbench.encodings.rope import SCALINGS, RoPE, rope_inv_freq, rotate
from posbench.runinfo import ADDED_SETTINGS, config_hash, group_config
from tests.helpers import assert_close_scaled, compose_cfg, make_encoding, random_qk, rope_dims

HEADS, HEAD_DIM, SEQ = 2, 16, 20
LAYOUTS = ("half", "interleaved")


def dims(head_dim: int = HEAD_DIM, train_positions: int = 64):
    return rope_dims(HEADS, head_dim, train_positions)


def qk_pair(head_dim: int = HEAD_DIM, dtype=torch.float64):
    return random_qk(HEADS, SEQ, head_dim, dtype)


def theta(m: int, head_dim: int = HEAD_DIM, base: float = 10000.0) -> float:
    return base ** (-2 * m / head_dim)


def pairs(head_dim: int, layout: str) -> list[tuple[int, int]]:
    """The feature pairs (a, b) of a head, pair m first."""
    if layout == "interleaved":
        return [(2 * m, 2 * m + 1) for m in range(head_dim // 2)]
    return [(m, m + head_dim // 2) for m in range(head_dim // 2)]


# --- p-RoPE: frequency_fraction -----------------------------------------------------------------

@pytest.mark.parametrize("p,kept", [(0.0, 0), (0.25, 2), (0.3, 2), (0.5, 4), (0.75, 6), (0.99, 7), (1.0, 8)])
def test_p_rope_keeps_the_highest_frequencies_over_the_whole_head(p, kept):
    """floor(p * d/2) pairs keep theta_m = base^(-2m/d), d = 16 the whole head; the others get 0."""
    enc = RoPE(dims(), frequency_fraction=p)
    assert enc.kept_pairs == kept
    assert enc.inv_freq.tolist() == pytest.approx([theta(m) if m < kept else 0.0 for m in range(8)], rel=1e-15)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_p_rope_rotates_the_kept_pairs_and_leaves_the_others(layout):
    """Pair m < K turns by k theta_m; pairs m >= K come back exactly as given (wherever the layout puts them)."""
    q, k = qk_pair()
    pos = torch.stack([torch.arange(SEQ) + 3, torch.arange(SEQ) + 700])  # [B, L]
    rq, rk = RoPE(dims(), layout=layout, frequency_fraction=0.375).qk(q, k, pos, pos, layer=0)  # K = 3
    for x, out in ((q, rq), (k, rk)):
        for m, (a, b) in enumerate(pairs(HEAD_DIM, layout)):
            if m >= 3:
                assert torch.equal(out[..., a], x[..., a]) and torch.equal(out[..., b], x[..., b])
                continue
            angle = pos[:, None, :].double() * theta(m)  # [B, 1, L]
            assert_close_scaled(out[..., a], x[..., a] * angle.cos() - x[..., b] * angle.sin(), rtol=1e-12)
            assert_close_scaled(out[..., b], x[..., a] * angle.sin() + x[..., b] * angle.cos(), rtol=1e-12)


def test_p_rope_is_not_partial_rotation():
    """Half of the pairs either way, but p-RoPE keeps theta_0..3 over d = 16 (down to 10^-1.5) where
    rotary_fraction=0.5 recomputes base^(-2m/8) over 8 features (down to 10^-3), and the two move
    other features (half layout: p-RoPE features 0-3 and 8-11, partial 0-7)."""
    proportional = RoPE(dims(), frequency_fraction=0.5).double()
    partial = RoPE(dims(), rotary_fraction=0.5).double()
    assert proportional.inv_freq.tolist() == pytest.approx([1.0, 10 ** -0.5, 0.1, 10 ** -1.5, 0, 0, 0, 0], rel=1e-15)
    assert partial.inv_freq.tolist() == pytest.approx([1.0, 0.1, 0.01, 0.001], rel=1e-15)
    q, _ = qk_pair()
    pos = torch.arange(SEQ)[None] + 100
    ours, theirs = proportional.rotate_head(q, pos), partial.rotate_head(q, pos)
    assert (ours - theirs).abs().max() > 0.5
    moved = lambda out: sorted(set(torch.nonzero((out - q).abs().amax(dim=(0, 1, 2)) > 0).flatten().tolist()))
    assert moved(ours) == [0, 1, 2, 3, 8, 9, 10, 11] and moved(theirs) == list(range(8))


def test_p_rope_extremes_are_nope_and_rope():
    """0-RoPE is NoPE (q and k unchanged); 1-RoPE is today's rope, bit for bit."""
    q, k = qk_pair(dtype=torch.float32)
    pos = torch.arange(SEQ)[None] + 11
    for out, x in zip(RoPE(dims(), frequency_fraction=0.0).qk(q, k, pos, pos, 0), (q, k)):
        assert torch.equal(out, x)
    for out, x in zip(RoPE(dims(), frequency_fraction=1.0).qk(q, k, pos, pos, 0), (q, k)):
        assert torch.equal(out, rotate(x, pos, rope_inv_freq(HEAD_DIM).float(), "half"))


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_frequency_settings_at_their_defaults_change_nothing(layout, scaling):
    """frequency_fraction=1 and frequency_cut=none give the outputs rope gave before they existed."""
    q, k = qk_pair(dtype=torch.float32)
    pos = torch.arange(SEQ)[None] + 5
    inv_freq, factor = SCALINGS[scaling](HEAD_DIM, 10000.0, 16, 48)
    enc = RoPE(dims(train_positions=16), layout=layout, scaling=scaling, frequency_fraction=1.0,
               frequency_cut="none").float()
    enc.set_eval_length(16, 48)
    assert torch.equal(enc.inv_freq, inv_freq.float())
    rq, rk = enc.qk(q, k, pos, pos, 0)
    assert torch.equal(rq, rotate(q, pos, inv_freq.float(), layout) * factor)
    assert torch.equal(rk, rotate(k, pos, inv_freq.float(), layout) * factor)


@pytest.mark.parametrize("scaling", sorted(set(SCALINGS) - {"none"}))
def test_p_rope_pairs_stay_still_under_every_scaling(scaling):
    """The scalings act on the kept pairs as on plain rope; the others stay at frequency 0."""
    enc = RoPE(dims(train_positions=16), scaling=scaling, frequency_fraction=0.5)
    enc.set_eval_length(16, 64)
    expected, factor = SCALINGS[scaling](HEAD_DIM, 10000.0, 16, 64)
    assert torch.equal(enc.inv_freq[:4], expected[:4]) and not enc.inv_freq[4:].any()
    assert enc.attention_factor == factor


def test_p_rope_stays_relative():
    enc = RoPE(dims(), frequency_fraction=0.5, frequency_cut="hope").double()
    q, k = qk_pair()
    logits = []
    for shift in (0, 1, 999):
        pos = torch.arange(SEQ)[None] + shift
        rq, rk = enc.qk(q, k, pos, pos, 0)
        logits.append(rq @ rk.transpose(-1, -2))  # [B, H, L, L]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(logits[2], logits[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("head_dim,base,p", [(16, 1e4, 0.5), (16, 1e4, 0.3), (64, 1e6, 0.25), (32, 1e4, 0.75),
                                             (32, 1e4, 0.0), (16, 1e4, 1.0)])
def test_p_rope_matches_transformers_proportional(head_dim, base, p):
    """transformers' proportional rope (Gemma 4's global layers: p = 0.25, base 1e6) with p as its
    partial_rotary_factor; it builds the table in float32."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if "proportional" not in ROPE_INIT_FUNCTIONS:
        pytest.skip("this transformers has no proportional rope")
    config = LlamaConfig(hidden_size=HEADS * head_dim, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=64,
                         rope_parameters={"rope_type": "proportional", "rope_theta": base, "partial_rotary_factor": p})
    theirs, their_factor = ROPE_INIT_FUNCTIONS["proportional"](config, None)
    enc = RoPE(dims(head_dim), base=base, frequency_fraction=p).double()
    torch.testing.assert_close(enc.inv_freq, theirs.double(), rtol=3e-7, atol=0)
    assert torch.equal(enc.inv_freq == 0, theirs == 0) and their_factor == enc.attention_factor == 1.0


def gemma_rope(x: torch.Tensor, pos: torch.Tensor, base: float, proportion: float) -> torch.Tensor:
    """Gemma's apply_rope with rope_proportion, written out: timescales base^(2m/d) for the first
    int(proportion * d // 2) pairs, padded with infinity (angle 0); angle = position / timescale;
    the head split in halves (x_m, x_{m + d/2}). x: [B, H, L, d], pos: [B', L]."""
    d = x.shape[-1]
    angles_kept = int(proportion * d // 2)
    exponents = torch.arange(angles_kept, dtype=torch.float64) * 2 / d
    timescale = torch.cat((base ** exponents, torch.full((d // 2 - angles_kept,), math.inf, dtype=torch.float64)))
    angle = pos[:, None, :, None].double() / timescale  # [B', 1, L, d/2]
    first, second = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((first * angle.cos() - second * angle.sin(), second * angle.cos() + first * angle.sin()), dim=-1)


@pytest.mark.parametrize("p", [0.25, 0.5, 0.625, 1.0])
def test_p_rope_matches_gemmas_rope_proportion(p):
    q, k = qk_pair()
    pos = torch.stack([torch.arange(SEQ), torch.arange(SEQ) * 3 + 50])  # [B, L]
    rq, rk = RoPE(dims(), base=1e6, layout="half", frequency_fraction=p).double().qk(q, k, pos, pos, 0)
    assert_close_scaled(rq, gemma_rope(q, pos, 1e6, p), rtol=1e-12)
    assert_close_scaled(rk, gemma_rope(k, pos, 1e6, p), rtol=1e-12)


# --- HoPE: frequency_cut=hope -------------------------------------------------------------------

@pytest.mark.parametrize("train,kept", [(16, 1), (64, 3), (1000, 5), (4, 0), (7, 1)])
def test_hope_cuts_the_pairs_that_cannot_turn_once_in_training(train, kept):
    """d = 16, base 1e4: theta_m = 10^(-m/2). N = 64: 2 pi / 64 = 0.098, so theta_0..2 (1, 0.316, 0.1) keep
    turning and theta_3 = 0.0316 stops; N = 16: 0.393 keeps theta_0 only; N = 1000: 0.00628 keeps
    theta_0..4 (0.01); N = 4: 1.571 > theta_0 = 1, nothing turns; N = 7: 0.898 keeps theta_0."""
    enc = RoPE(dims(train_positions=train), frequency_cut="hope")
    assert enc.kept_pairs == kept
    assert enc.inv_freq.tolist() == pytest.approx([theta(m) if m < kept else 0.0 for m in range(8)], rel=1e-15)
    turns = rope_inv_freq(HEAD_DIM) * train / (2 * math.pi)  # turns pair m makes within N
    assert bool((turns[:kept] >= 1).all()) and bool((turns[kept:] < 1).all())


@pytest.mark.parametrize("scaling", ["none", "pi", "yarn", "longrope"])
def test_hope_cut_comes_from_the_training_positions_only(scaling):
    """Evaluating longer never moves the cut: N = 64 keeps 3 pairs at every evaluation length."""
    enc = RoPE(dims(train_positions=64), frequency_cut="hope", scaling=scaling)
    for length in (8, 64, 65, 4096):
        enc.set_eval_length(64, length)
        expected, _ = SCALINGS[scaling if length > 64 else "none"](HEAD_DIM, 10000.0, 64, length)
        assert torch.equal(enc.inv_freq[:3], expected[:3]) and not enc.inv_freq[3:].any(), length


def test_hope_with_p_rope_keeps_the_fewer():
    assert RoPE(dims(train_positions=64), frequency_cut="hope", frequency_fraction=0.25).kept_pairs == 2  # p: 2, HoPE: 3
    assert RoPE(dims(train_positions=64), frequency_cut="hope", frequency_fraction=0.75).kept_pairs == 3  # p: 6


def test_hope_and_p_rope_act_on_the_rotated_part():
    """With rotary_fraction, d is the rotated size: d' = 8 pairs base^(-2m/8) = 1, 0.1, 0.01, 0.001."""
    assert RoPE(dims(), rotary_fraction=0.5, frequency_fraction=0.5).inv_freq.tolist() == pytest.approx(
        [1.0, 0.1, 0, 0], rel=1e-15)
    assert RoPE(dims(train_positions=64), rotary_fraction=0.5, frequency_cut="hope").kept_pairs == 2  # 0.1 >= 0.098


# --- LongRoPE: scaling=longrope -----------------------------------------------------------------

SHORT = [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0]
LONG = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0]


def test_longrope_formula():
    """Past N: theta_m / lambda_long, m = sqrt(1 + ln s / ln N), s = L / N; within N: theta_m / lambda_short, m = 1."""
    inv_freq, factor = SCALINGS["longrope"](HEAD_DIM, 10000.0, 64, 256, None, SHORT, LONG)
    assert inv_freq.tolist() == pytest.approx([theta(m) / LONG[m] for m in range(8)], rel=1e-15)
    assert factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)), rel=1e-15)
    assert factor == pytest.approx(math.sqrt(4 / 3), rel=1e-15)  # ln 4 / ln 64 = 1/3
    inv_freq, factor = SCALINGS["longrope"](HEAD_DIM, 10000.0, 64, 64, None, SHORT, LONG)
    assert inv_freq.tolist() == pytest.approx([theta(m) / SHORT[m] for m in range(8)], rel=1e-15) and factor == 1.0


def test_longrope_switches_to_the_long_factors_strictly_past_n():
    at_n = SCALINGS["longrope"](HEAD_DIM, 10000.0, 64, 64, None, SHORT, LONG)[0]
    past_n = SCALINGS["longrope"](HEAD_DIM, 10000.0, 64, 65, None, SHORT, LONG)[0]
    torch.testing.assert_close(at_n, rope_inv_freq(HEAD_DIM) / torch.tensor(SHORT, dtype=torch.float64))
    torch.testing.assert_close(past_n, rope_inv_freq(HEAD_DIM) / torch.tensor(LONG, dtype=torch.float64))


def test_longrope_unset_factors_are_rope_within_n_and_interpolation_past_it():
    inv_freq, factor = SCALINGS["longrope"](HEAD_DIM, 10000.0, 64, 32)
    assert torch.equal(inv_freq, rope_inv_freq(HEAD_DIM)) and factor == 1.0
    inv_freq, factor = SCALINGS["longrope"](HEAD_DIM, 10000.0, 64, 160)
    torch.testing.assert_close(inv_freq, SCALINGS["pi"](HEAD_DIM, 10000.0, 64, 160)[0], rtol=1e-15, atol=0)
    assert factor == pytest.approx(math.sqrt(1 + math.log(2.5) / math.log(64)), rel=1e-15)


def test_longrope_forced_factor_sets_the_attention_factor_past_n():
    """Phi-3 takes s from the configured target length: with scaling_factor f, m = sqrt(1 + ln f / ln N) at every L > N."""
    for length in (65, 100, 4096):
        _, factor = SCALINGS["longrope"](HEAD_DIM, 10000.0, 64, length, 16.0, SHORT, LONG)
        assert factor == pytest.approx(math.sqrt(1 + math.log(16) / math.log(64)), rel=1e-15)
    assert SCALINGS["longrope"](HEAD_DIM, 10000.0, 64, 64, 16.0, SHORT, LONG)[1] == 1.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_longrope_in_the_model_trains_short_and_evaluates_long(layout):
    """Training (and evaluation up to N) rotates with the short factors; past N the long factors, and the
    logits scale by m^2; back in training, the short factors again."""
    enc = RoPE(dims(train_positions=16), layout=layout, scaling="longrope", short_factors=SHORT,
               long_factors=LONG).double()
    short = rope_inv_freq(HEAD_DIM) / torch.tensor(SHORT, dtype=torch.float64)
    assert torch.equal(enc.inv_freq, short) and enc.attention_factor == 1.0  # as built: training's
    enc.eval()
    enc.set_eval_length(16, 64)
    q, k = qk_pair()
    pos = torch.arange(SEQ)[None]
    rq, rk = enc.qk(q, k, pos, pos, 0)
    long = rope_inv_freq(HEAD_DIM) / torch.tensor(LONG, dtype=torch.float64)
    plain = rotate(q, pos, long, layout) @ rotate(k, pos, long, layout).transpose(-1, -2)
    # logits up to ~30: a rounding per product of the head_dim-long dot products
    assert_close_scaled(rq @ rk.transpose(-1, -2), plain * (1 + math.log(4) / math.log(16)), ulps=HEAD_DIM,
                        name="logits")
    enc.set_eval_length(16, 16)
    assert torch.equal(enc.inv_freq, short) and enc.attention_factor == 1.0
    enc.set_eval_length(16, 64)
    enc.train()
    assert torch.equal(enc.inv_freq, short) and enc.attention_factor == 1.0


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("seq_len", [None, 64, 65, 256])
def test_longrope_matches_transformers(seq_len, fraction):
    """transformers' longrope (Phi-3) on a config with max_position_embeddings 256 and
    original_max_position_embeddings 64: the factors by seq_len (short up to 64, long past it; float32
    tables), its attention factor from 256 / 64 = ours with scaling_factor 4 past N; within N ours stays 1."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    pairs_kept = round(HEAD_DIM * fraction) // 2
    short, long = SHORT[:pairs_kept], LONG[:pairs_kept]
    config = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=256,
                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": fraction,
                                          "original_max_position_embeddings": 64, "short_factor": short,
                                          "long_factor": long})
    theirs, their_factor = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=seq_len)
    enc = RoPE(dims(train_positions=64), scaling="longrope", scaling_factor=4.0, rotary_fraction=fraction,
               short_factors=short, long_factors=long).double()
    enc.set_eval_length(64, seq_len or 64)
    torch.testing.assert_close(enc.inv_freq, theirs.double(), rtol=3e-7, atol=0)
    assert their_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)), rel=1e-12)
    assert enc.attention_factor == (pytest.approx(their_factor, rel=1e-12) if (seq_len or 64) > 64 else 1.0)
    enc = RoPE(dims(train_positions=64), scaling="longrope", rotary_fraction=fraction, short_factors=short,
               long_factors=long)
    enc.set_eval_length(64, 256)  # s = L / N = 4 without the forced factor: the same m at L = 256
    assert enc.attention_factor == pytest.approx(their_factor, rel=1e-12)


def naive_longrope(x: torch.Tensor, pos: torch.Tensor, scaled: list[float], factor: float, start: int, layout: str,
                   rotary_dim: int, kept: int) -> torch.Tensor:
    """microsoft/LongRoPE's start-token class one position at a time: cos and sin of the scaled
    frequencies times the factor, their first `start` rows replaced by plain rope's (theta_m, no
    factor). Pairs m >= kept never turn; features past rotary_dim pass through, times the factor as
    posbench scales the whole q and k. x: [B, H, L, d], pos: [B', L] -> [B, H, L, d], float64."""
    out = x.clone()
    for b in range(x.shape[0]):
        for t in range(x.shape[2]):
            position = pos[b if pos.shape[0] > 1 else 0, t].item()
            gain = 1.0 if position < start else factor
            out[b, :, t] = x[b, :, t] * gain
            for m, (i, j) in enumerate(pairs(rotary_dim, layout)):
                frequency = 0.0 if m >= kept else theta(m, rotary_dim) if position < start else scaled[m]
                cos, sin = math.cos(position * frequency), math.sin(position * frequency)
                xi, xj = x[b, :, t, i], x[b, :, t, j]
                out[b, :, t, i] = gain * (xi * cos - xj * sin)
                out[b, :, t, j] = gain * (xi * sin + xj * cos)
    return out


@pytest.mark.parametrize("fraction,p", [(1.0, 1.0), (0.5, 0.75)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_longrope_start_positions_match_the_official_rule(layout, fraction, p):
    """n̂ = 5: positions 0-4 turn by theta_m at factor 1, the others by theta_m / lambda_m at m past N, in
    training and within N by theta_m / lambda_short at 1; partial rotation and p-RoPE's cut hold for both."""
    rotary = round(HEAD_DIM * fraction)
    short, long = SHORT[:rotary // 2], LONG[:rotary // 2]
    kept = math.floor(p * rotary / 2)
    enc = RoPE(dims(train_positions=16), layout=layout, scaling="longrope", rotary_fraction=fraction,
               frequency_fraction=p, short_factors=short, long_factors=long, start_positions=5).double()
    q, k = qk_pair()
    pos = torch.stack([torch.arange(SEQ), torch.arange(SEQ) * 3 + 2])  # [B, L]: starts 0-4, then 2
    factor = math.sqrt(1 + math.log(4) / math.log(16))  # L = 64, N = 16
    for length, lambdas, gain in ((None, short, 1.0), (64, long, factor), (16, short, 1.0)):
        if length is not None:  # None: as built, training's
            enc.eval()
            enc.set_eval_length(16, length)
        scaled = [theta(m, rotary) / lambdas[m] for m in range(rotary // 2)]
        for x, got in zip((q, k), enc.qk(q, k, pos, pos, 0)):
            assert_close_scaled(got, naive_longrope(x, pos, scaled, gain, 5, layout, rotary, kept), rtol=1e-12)


@pytest.mark.parametrize("length", [16, 64])
def test_longrope_without_start_positions_is_the_plain_rule_bit_for_bit(length):
    """n̂ = 0 (the default), or n̂ below every position fed: theta_m / lambda_m and m everywhere, as before."""
    plain = RoPE(dims(train_positions=16), scaling="longrope", short_factors=SHORT, long_factors=LONG).double()
    started = RoPE(dims(train_positions=16), scaling="longrope", short_factors=SHORT, long_factors=LONG,
                   start_positions=5).double()
    assert plain.params()["start_positions"] == 0 and started.params()["start_positions"] == 5
    inv_freq, factor = SCALINGS["longrope"](HEAD_DIM, 10000.0, 16, length, None, SHORT, LONG)
    q, k = qk_pair()
    pos = torch.arange(SEQ)[None] + 5
    for enc in (plain, started):
        enc.eval()
        enc.set_eval_length(16, length)
        for x, got in zip((q, k), enc.qk(q, k, pos, pos, 0)):
            assert torch.equal(got, rotate(x, pos, inv_freq, "half") * factor)
    assert plain.relative and not started.relative


def test_longrope_start_positions_are_not_relative_while_the_rest_is_scaled():
    """A key below n̂ meets a later query at m q_i . R(i theta / lambda - j theta) k_j: shifting every position
    moves the logits, and `relative` says so past N, and within N (training too) with short factors; within
    N without short factors every position has theta_m and factor 1, and n̂ changes nothing."""
    q, k = qk_pair()

    def shift_change(enc) -> float:
        def logits(shift):
            pos = torch.arange(SEQ)[None] + shift
            rq, rk = enc.qk(q, k, pos, pos, 0)
            return rq @ rk.transpose(-1, -2)  # [B, H, L, L]
        return max((logits(shift) - logits(0)).abs().max().item() for shift in (1, 37))

    enc = RoPE(dims(train_positions=16), scaling="longrope", start_positions=4).double()
    assert enc.relative and shift_change(enc) < 1e-9
    enc.eval()
    enc.set_eval_length(16, 64)
    assert not enc.relative and shift_change(enc) > 1e-6
    enc.train()
    assert enc.relative
    short = RoPE(dims(train_positions=16), scaling="longrope", short_factors=SHORT, start_positions=4).double()
    assert not short.relative and shift_change(short) > 1e-6
    assert REGISTRY["rope"].relative and RoPE(dims(), scaling="longrope").relative


# --- settings: refusals, the command line, params, the config hash ------------------------------

@pytest.mark.parametrize("params,message", [
    ({"frequency_fraction": 1.5}, r"rope: encoding.frequency_fraction=1.5: must be in \[0, 1\]"),
    ({"frequency_fraction": -0.1}, r"rope: encoding.frequency_fraction=-0.1: must be in \[0, 1\]"),
    ({"frequency_fraction": "half"}, r"encoding.frequency_fraction='half': must be a finite number in \[0, 1\]"),
    ({"frequency_cut": "yarn"}, r"rope: encoding.frequency_cut='yarn' is not valid; choose one of \['none', 'hope'\]"),
    ({"long_factors": LONG}, r"encoding.long_factors=\[1.0, 1.5.*has no effect with scaling=none; set "
                             r"encoding.scaling=longrope"),
    ({"scaling": "pi", "short_factors": SHORT}, "encoding.short_factors=.* has no effect with scaling=pi"),
    ({"scaling": "longrope", "long_factors": [1.0, 2.0]},
     r"encoding.long_factors=\[1.0, 2.0\] has 2 factors; longrope needs one per rotated pair, rotary_dim / 2 = 8"),
    ({"scaling": "longrope", "rotary_fraction": 0.5, "short_factors": SHORT}, "has 8 factors.*rotary_dim / 2 = 4"),
    ({"scaling": "longrope", "short_factors": [1.0] * 7 + [0.0]}, r"encoding.short_factors\[7\]=0.0: must be > 0"),
    ({"scaling": "longrope", "long_factors": "big"},
     r"encoding.long_factors='big': must be a non-empty list of numbers, or null \(every lambda_m = s\)"),
    ({"start_positions": 4}, r"rope: encoding.start_positions=4 has no effect with scaling=none; set "
                             r"encoding.scaling=longrope or drop the start positions \(0\)"),
    ({"scaling": "yarn", "start_positions": 2}, "encoding.start_positions=2 has no effect with scaling=yarn"),
    ({"scaling": "longrope", "start_positions": -1}, r"rope: encoding.start_positions=-1: must be >= 0"),
    ({"scaling": "longrope", "start_positions": 2.5}, r"rope: encoding.start_positions=2.5: must be an integer >= 0"),
])
def test_bad_settings_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        RoPE(dims(), **params)


def test_longrope_refuses_a_single_training_position_before_training():
    with pytest.raises(ValueError, match=r"longrope's attention factor sqrt\(1 \+ ln s / ln N\) needs N >= 2"):
        RoPE(dims(train_positions=1), scaling="longrope")


def test_settings_from_the_command_line_and_in_a_composite():
    from posbench.build import build

    built = build(compose_cfg("encoding=rope", "encoding.frequency_fraction=0.5", "encoding.frequency_cut=hope",
                              "encoding.scaling=longrope", "encoding.long_factors=[1,1,2,2,4,4,8,8]",
                              "encoding.start_positions=4"), torch.device("cpu"))
    params = built.encoding.params()  # model=small: head size 16, 8 pairs
    assert (params["frequency_fraction"], params["frequency_cut"]) == (0.5, "hope")
    assert params["long_factors"] == [1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0] and params["short_factors"] is None
    assert params["start_positions"] == 4 and "start_positions" not in RoPE(dims()).params()  # longrope's only
    assert built.encoding.kept_pairs <= 4
    composite = make_encoding("composite", d_model=64, n_heads=2, parts=["rope", "t5"],
                              part_params={"rope": {"frequency_fraction": 0.25}})
    assert composite.params()["rope"]["frequency_fraction"] == 0.25 and composite.parts[0].kept_pairs == 4


@pytest.mark.parametrize("key,other", [("encoding.frequency_fraction", 0.5), ("encoding.frequency_cut", "hope"),
                                       ("encoding.short_factors", [1.0] * 4), ("encoding.long_factors", [2.0] * 4),
                                       ("encoding.start_positions", 4), ("encoding.resonance", True)])
def test_new_settings_keep_old_hashes_and_separate_new_runs(key, other):
    """At their defaults the settings drop out of the group (runs made before them keep their hash);
    any other value is part of it."""
    resolved = OmegaConf.to_container(compose_cfg(), resolve=True)
    section, leaf = key.split(".")
    assert ADDED_SETTINGS[key] == resolved[section][leaf]
    before = copy.deepcopy(resolved)
    del before[section][leaf]
    assert config_hash(group_config(resolved)) == config_hash(group_config(before))
    changed = copy.deepcopy(resolved)
    changed[section][leaf] = other
    assert config_hash(group_config(changed)) != config_hash(group_config(resolved))


def test_rope_2d_takes_longrope_through_the_shared_table():
    """rope_2d's scalings come from SCALINGS: longrope there is interpolation per axis with m past the trained side."""
    enc = make_encoding("rope_2d", d_model=32, n_heads=2, max_positions=256, scaling="longrope")
    enc.set_eval_length(64, 256)  # sides 8 -> 16
    expected, factor = SCALINGS["longrope"](8, 100.0, 8, 16)
    assert enc.inv_freq.tolist() == pytest.approx(expected.tolist(), rel=1e-6)
    assert factor == pytest.approx(math.sqrt(1 + math.log(2) / math.log(8)), rel=1e-15) == enc.attention_factor


# --- Resonance RoPE: resonance ------------------------------------------------------------------

def official_resonance_angles(head_dim: int, length: int, wavelengths: list[float], freqs: list[float]):
    """The official tables' angles (sheryc/resonance_rope, rotary_resonance.py, compute_freqs), pair by pair:
    a pair whose integer wavelength fits in the length repeats arange(wavelength) * theta' over it,
    the others run arange(length) * theta'. -> [length, d/2] float64."""
    angles = torch.zeros(length, head_dim // 2, dtype=torch.float64)
    for m in range(head_dim // 2):
        for k in range(length):
            step = k % int(wavelengths[m]) if length >= wavelengths[m] else k
            angles[k, m] = step * freqs[m]
    return angles


def test_resonance_rounds_every_wavelength_to_an_integer():
    enc = RoPE(dims(), resonance=True)
    wavelengths = [round(2 * math.pi / theta(m)) for m in range(HEAD_DIM // 2)]  # 6, 20, 63, 199, 628, ...
    assert wavelengths[:3] == [6, 20, 63]
    expected = torch.tensor([2 * math.pi / w for w in wavelengths], dtype=torch.float64)
    torch.testing.assert_close(enc.inv_freq, expected, rtol=1e-15, atol=0)
    assert enc.params()["resonance"] is True and RoPE(dims()).params()["resonance"] is False


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resonance_rotates_as_the_official_tables(layout):
    """300 positions: the first four pairs' wavelengths (6, 20, 63, 199) fit and repeat, the others run on."""
    enc = RoPE(dims(), resonance=True, layout=layout).double()
    length = 300
    q = torch.randn(1, HEADS, length, HEAD_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(length)[None]
    got, _ = enc.qk(q, q, pos, pos, 0)
    wavelengths = [round(2 * math.pi / theta(m)) for m in range(HEAD_DIM // 2)]
    angles = official_resonance_angles(HEAD_DIM, length, wavelengths, [2 * math.pi / w for w in wavelengths])
    expected = q.clone()
    for m, (a, b) in enumerate(pairs(HEAD_DIM, layout)):
        cos, sin = angles[:, m].cos(), angles[:, m].sin()  # [L]
        expected[..., a] = q[..., a] * cos - q[..., b] * sin
        expected[..., b] = q[..., a] * sin + q[..., b] * cos
    assert_close_scaled(got, expected, rtol=1e-12)


def test_resonance_is_shift_invariant_far_past_any_period():
    enc = RoPE(dims(), resonance=True).double()
    q, k = qk_pair()
    pos = torch.arange(SEQ)[None]

    def logits(shift):
        q_r, k_r = enc.qk(q, k, pos + shift, pos + shift, 0)
        return q_r @ k_r.transpose(-1, -2)  # [1, H, L, L]

    assert_close_scaled(logits(100_003), logits(0), rtol=1e-10)


def test_resonance_keeps_float32_angles_exact_at_a_million_positions():
    """Angles from k mod lambda stay below 2 pi: in float32 the rotation at position 10^6 is the float64
    one (k theta' in float32 there would be off by a whole ulp of 10^6 radians, about 0.06)."""
    enc = RoPE(dims(), resonance=True)
    q, k = qk_pair(dtype=torch.float32)
    pos = torch.arange(SEQ)[None] + 1_000_000
    got, _ = enc.qk(q, k, pos, pos, 0)
    want, _ = copy.deepcopy(enc).double().qk(q.double(), k.double(), pos, pos, 0)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_resonance_rounds_after_the_scaling_and_keeps_still_pairs_still():
    """Resonance YaRN: the rounding acts on YaRN's frequencies past N; p-RoPE's cut pairs stay at 0."""
    enc = RoPE(dims(), scaling="yarn", resonance=True, frequency_fraction=0.75)
    enc.set_eval_length(64, 256)
    yarn_freq, factor = SCALINGS["yarn"](HEAD_DIM, 10000.0, 64, 256, None)
    expected = 2 * math.pi / torch.round(2 * math.pi / yarn_freq)
    expected[6:] = 0.0  # floor(0.75 * 8) = 6 pairs kept
    torch.testing.assert_close(enc.inv_freq, expected, rtol=1e-15, atol=0)
    assert enc.attention_factor == factor
    q, k = qk_pair()
    pos = torch.arange(SEQ)[None]
    rotated, _ = enc.qk(q, k, pos, pos, 0)
    still = [f for a, b in pairs(HEAD_DIM, "half")[6:] for f in (a, b)]
    assert_close_scaled(rotated[..., still], q[..., still] * factor, ulps=2)  # angle 0: the factor's rounding at most
