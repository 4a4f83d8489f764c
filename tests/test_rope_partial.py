"""Partial rotary (encoding.rotary_fraction): only the first d' = round(fraction * d) features of each
head rotate, with frequencies base^(-2m/d'); the rest pass through. Formula in float64, the
relative property, fraction 1 as before, the scalings on the rotated part, refusals, and equivalence
with transformers' GPT-NeoX (rotary_pct / partial_rotary_factor, half layout) and GPT-J (rotary_dim,
interleaved) rotaries (skipped without transformers)."""
from __future__ import annotations

import math

import pytest
import torch

from posbench.encodings.base import ModelDims
from posbench.encodings.rope import SCALINGS, RoPE, rope_inv_freq, rotate
from tests.helpers import assert_close_scaled, make_encoding, random_qk, rope_dims

HEADS, HEAD_DIM, SEQ = 4, 32, 20
LAYOUTS = ("half", "interleaved")
FRACTIONS = (0.0625, 0.25, 0.5, 0.75)  # 2, 8, 16, 24 of 32 features


def dims(head_dim: int = HEAD_DIM, train_positions: int = 64) -> ModelDims:
    return rope_dims(HEADS, head_dim, train_positions)


def qk_pair(head_dim: int = HEAD_DIM, dtype=torch.float64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return random_qk(HEADS, SEQ, head_dim, dtype, seed)


def pairs(rotated: int, layout: str) -> list[tuple[int, int]]:
    """The feature pairs (a, b) of a rotated slice of `rotated` features, pair m first."""
    if layout == "interleaved":
        return [(2 * m, 2 * m + 1) for m in range(rotated // 2)]
    return [(m, m + rotated // 2) for m in range(rotated // 2)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_rotated_features_follow_the_formula_and_the_rest_pass_through(fraction, layout):
    """Pair m of the first d' features turns by k * base^(-2m/d') (frequencies over d', not d);
    features d'.. are returned exactly as given."""
    rotated = round(fraction * HEAD_DIM)
    q, k = qk_pair()
    pos = torch.stack([torch.arange(SEQ) + 3, torch.arange(SEQ) + 500])  # [B, L]
    rq, rk = RoPE(dims(), layout=layout, rotary_fraction=fraction).qk(q, k, pos, pos, layer=0)
    for x, out in ((q, rq), (k, rk)):
        assert torch.equal(out[..., rotated:], x[..., rotated:])
        expected = torch.empty_like(x[..., :rotated])
        for m, (a, b) in enumerate(pairs(rotated, layout)):
            angle = pos[:, None, :].double() * 10000.0 ** (-2 * m / rotated)  # [B, 1, L]
            expected[..., a] = x[..., a] * angle.cos() - x[..., b] * angle.sin()
            expected[..., b] = x[..., a] * angle.sin() + x[..., b] * angle.cos()
        assert_close_scaled(out[..., :rotated], expected, rtol=0, atol_scale=1e-12, name=layout)


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fraction_one_is_the_whole_head_rope_bit_for_bit(layout, scaling):
    """rotary_fraction=1 (the default) rotates every feature with the head-size frequencies, as before it existed."""
    q, k = qk_pair(dtype=torch.float32)
    pos = torch.arange(SEQ)[None] + 7
    inv_freq, factor = SCALINGS[scaling](HEAD_DIM, 10000.0, 16, 48)
    for enc in (RoPE(dims(train_positions=16), layout=layout, scaling=scaling),
                RoPE(dims(train_positions=16), layout=layout, scaling=scaling, rotary_fraction=1.0)):
        enc = enc.float()
        enc.set_eval_length(16, 48)
        rq, rk = enc.qk(q, k, pos, pos, layer=0)
        assert enc.rotary_dim == HEAD_DIM and torch.equal(enc.inv_freq, inv_freq.float())
        assert torch.equal(rq, rotate(q, pos, inv_freq.float(), layout) * factor)
        assert torch.equal(rk, rotate(k, pos, inv_freq.float(), layout) * factor)
        assert enc.params()["rotary_fraction"] == 1.0


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fraction", (0.25, 0.5))
def test_partial_rope_logits_depend_on_the_offset_only(fraction, layout, scaling):
    """<R_i q, R_j k> is unchanged when every position moves by the same amount, scaled or not."""
    enc = RoPE(dims(train_positions=16), layout=layout, scaling=scaling, rotary_fraction=fraction).double()
    enc.set_eval_length(16, 64)
    q, k = qk_pair()
    logits = []
    for shift in (0, 1, 1000):
        pos = torch.arange(SEQ)[None] + shift
        rq, rk = enc.qk(q, k, pos, pos, layer=0)
        logits.append(rq @ rk.transpose(-1, -2))  # [B, H, L, L]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(logits[2], logits[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scaling", sorted(set(SCALINGS) - {"none"}))
def test_scalings_act_on_the_rotated_part_frequencies(scaling):
    """Past the training length the rotated pairs get the scaling computed for a head of d' features."""
    enc = RoPE(dims(train_positions=16), scaling=scaling, rotary_fraction=0.25).double()
    enc.set_eval_length(16, 64)
    inv_freq, factor = SCALINGS[scaling](8, 10000.0, 16, 64)
    assert torch.equal(enc.inv_freq, inv_freq) and enc.attention_factor == factor
    enc.train()  # back at the training length: unscaled
    assert torch.equal(enc.inv_freq, rope_inv_freq(8))


def test_ntk_frequencies_over_the_rotated_size():
    """base' = base * s^(d'/(d'-2)) with d' the rotated size: the lowest rotated frequency is theta_{d'/2-1} / s."""
    enc = RoPE(dims(train_positions=16), scaling="ntk", rotary_fraction=0.25).double()
    enc.set_eval_length(16, 64)
    rotated, s = 8, 4.0
    expected = [(10000.0 * s ** (rotated / (rotated - 2))) ** (-2 * m / rotated) for m in range(rotated // 2)]
    assert enc.inv_freq.tolist() == pytest.approx(expected, rel=1e-15)
    assert enc.inv_freq[-1].item() == pytest.approx(10000.0 ** (-(rotated - 2) / rotated) / s, rel=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_yarn_attention_factor_scales_the_whole_logit(layout):
    """The temperature (0.1 ln s + 1)^2 multiplies every logit, the rotated part's and the rest's."""
    enc = RoPE(dims(train_positions=16), layout=layout, scaling="yarn", rotary_fraction=0.25).double()
    enc.set_eval_length(16, 64)
    q, k = qk_pair()
    pos = torch.arange(SEQ)[None]
    rq, rk = enc.qk(q, k, pos, pos, layer=0)
    plain = enc.rotate_head(q, pos) @ enc.rotate_head(k, pos).transpose(-1, -2)
    # logits up to ~30: a rounding per product of the head_dim-long dot products
    assert_close_scaled(rq @ rk.transpose(-1, -2), plain * (0.1 * math.log(4) + 1) ** 2, ulps=HEAD_DIM, name="logits")


@pytest.mark.parametrize("fraction,message", [
    (0.0, r"encoding.rotary_fraction=0.0: must be in \(0, 1\]"),
    (-0.25, r"encoding.rotary_fraction=-0.25: must be in \(0, 1\]"),
    (1.5, r"encoding.rotary_fraction=1.5: must be in \(0, 1\]"),
    ("quarter", r"encoding.rotary_fraction='quarter': must be a finite number"),
    (True, r"encoding.rotary_fraction=True: must be a finite number"),
    (0.28, (r"encoding.rotary_fraction=0.28 rotates round\(0.28 \* 32\) = 9 features of the head size 32 "
            r"\(model.d_model / model.n_heads\); features rotate in pairs, so that must be even and >= 2")),
    (0.02, r"encoding.rotary_fraction=0.02 rotates round\(0.02 \* 32\) = 1 features of the head size 32"),
    (0.01, r"encoding.rotary_fraction=0.01 rotates round\(0.01 \* 32\) = 0 features of the head size 32"),
])
def test_bad_fractions_are_refused(fraction, message):
    with pytest.raises(ValueError, match=message):
        RoPE(dims(), rotary_fraction=fraction)


def test_the_rotated_size_is_the_fraction_of_the_head_rounded():
    assert [RoPE(dims(), rotary_fraction=f).rotary_dim for f in (1, 0.75, 0.3, 0.25, 0.0625)] == [32, 24, 10, 8, 2]


@pytest.mark.parametrize("scaling", ["ntk", "dynamic_ntk"])
def test_ntk_refuses_two_rotated_features_before_training(scaling):
    with pytest.raises(ValueError, match="rotated head size above 2.*got 2"):
        RoPE(dims(), scaling=scaling, rotary_fraction=0.0625)


def test_rotary_fraction_is_set_from_the_command_line_and_in_a_composite():
    from posbench.build import build
    from tests.helpers import compose_cfg

    built = build(compose_cfg("encoding=rope", "encoding.rotary_fraction=0.25"), torch.device("cpu"))
    assert built.encoding.params()["rotary_fraction"] == 0.25 and built.encoding.rotary_dim == 4  # model=small: d = 16
    composite = make_encoding("composite", d_model=64, n_heads=2, parts=["rope", "t5"],
                              part_params={"rope": {"rotary_fraction": 0.25}})
    assert composite.params()["rope"]["rotary_fraction"] == 0.25 and composite.parts[0].rotary_dim == 8


# --- HF transformers: GPT-NeoX (half layout) and GPT-J (interleaved) ------------------------------

@pytest.mark.parametrize("fraction", (0.25, 0.5))
def test_half_layout_matches_transformers_gpt_neox(fraction):
    """GPT-NeoX's rotary (partial_rotary_factor, its rotary_pct): its own inv_freq over int(fraction * d)
    features and its apply_rotary_pos_emb, which splits q and k at the rotated size itself. transformers
    forms the angles in float32: agreement to float32 angle resolution at positions up to 1000."""
    pytest.importorskip("transformers")
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import (
        GPTNeoXRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = GPTNeoXConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": fraction})
    rotary = GPTNeoXRotaryEmbedding(config)
    enc = RoPE(dims(), layout="half", rotary_fraction=fraction).double()
    torch.testing.assert_close(enc.inv_freq, rotary.inv_freq.double(), rtol=2e-7, atol=0)
    q, k = qk_pair()
    pos = torch.stack([torch.arange(SEQ) + 5, torch.arange(SEQ) + 1000])  # [B, L]
    cos, sin = rotary(q, pos)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    q_ours, k_ours = enc.qk(q, k, pos, pos, layer=0)
    torch.testing.assert_close(q_ours, q_ref, rtol=0, atol=2e-4)
    torch.testing.assert_close(k_ours, k_ref, rtol=0, atol=2e-4)
    assert torch.equal(q_ours[..., enc.rotary_dim:], q_ref[..., enc.rotary_dim:])


def test_interleaved_layout_matches_transformers_gpt_j():
    """GPT-J's rotary (rotary_dim of the head; Kazemnejad et al.'s code has the same form): its sin/cos
    table create_sinusoidal_positions(n, rotary_dim) and apply_rotary_pos_emb (rotate_every_two) on the
    first rotary_dim features of [B, L, H, d], the rest concatenated back as GPTJAttention.forward does."""
    pytest.importorskip("transformers")
    from transformers.models.gptj.modeling_gptj import (
        apply_rotary_pos_emb,
        create_sinusoidal_positions,
    )

    rotary_dim = HEAD_DIM // 4
    q, _ = qk_pair()
    pos = torch.arange(SEQ)[None] + 300  # [1, L]
    sincos = create_sinusoidal_positions(2048, rotary_dim)[pos].double()  # [1, L, rotary_dim]
    sin, cos = sincos.chunk(2, dim=-1)  # [1, L, rotary_dim / 2] each
    x = q.transpose(1, 2)  # [B, L, H, d], GPT-J's layout
    theirs = torch.cat((apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos), x[..., rotary_dim:]), dim=-1)
    ours = RoPE(dims(), layout="interleaved", rotary_fraction=0.25).double().rotate_head(q, pos)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=2e-4)


@pytest.mark.parametrize("rope_type,scaling,params,seq_len", [
    ("linear", "pi", {"factor": 4.0}, None),
    ("dynamic", "dynamic_ntk", {"factor": 1.0}, 256),
    ("yarn", "yarn", {"factor": 4.0, "original_max_position_embeddings": 64}, None),
])
@pytest.mark.parametrize("fraction", (0.25, 0.5))
def test_scalings_match_transformers_with_partial_rotary_factor(fraction, rope_type, scaling, params, seq_len):
    """transformers' ROPE_INIT_FUNCTIONS on a GPT-NeoX config with partial_rotary_factor: the scaled
    frequencies of the rotated part (float32 tables: rtol at float32 resolution) and the attention factor."""
    pytest.importorskip("transformers")
    from transformers import GPTNeoXConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = GPTNeoXConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, max_position_embeddings=64,
                           rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0,
                                            "partial_rotary_factor": fraction, **params})
    theirs, their_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)
    enc = RoPE(dims(train_positions=64), scaling=scaling, rotary_fraction=fraction).double()
    enc.set_eval_length(64, 256)
    torch.testing.assert_close(enc.inv_freq, theirs.double(), rtol=1e-6, atol=0)
    assert enc.attention_factor == pytest.approx(their_factor, rel=1e-12)
