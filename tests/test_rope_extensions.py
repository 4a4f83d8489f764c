"""RoPE scalings (pi, ntk, dynamic_ntk, yarn) and xPos: formulas in float64, the runner's
set_eval_length path, and equivalence with transformers' ROPE_INIT_FUNCTIONS and
rotary-embedding-torch (optional libraries: skipped when missing)."""
from __future__ import annotations

import math

import pytest
import torch

from posbench.encodings.base import ModelDims
from posbench.encodings.rope import SCALINGS, RoPE, rope_inv_freq, rotate
from posbench.encodings.xpos import XPos, xpos_zeta
from tests.helpers import assert_close_scaled, make_encoding, random_qk, rope_dims

HEADS, HEAD_DIM, SEQ = 2, 16, 24
SCALED = sorted(set(SCALINGS) - {"none"})


def dims(head_dim: int = HEAD_DIM, train_positions: int = 64) -> ModelDims:
    return rope_dims(HEADS, head_dim, train_positions)


def qk_pair(length: int = SEQ, dtype=torch.float64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return random_qk(HEADS, length, HEAD_DIM, dtype, seed)


def theta(head_dim: int, base: float, m: int) -> float:
    return base ** (-2 * m / head_dim)


# --- the scaling functions against their formulas (float64) -----------------------------------

def test_registry_names():
    assert set(SCALINGS) == {"none", "pi", "ntk", "dynamic_ntk", "yarn", "longrope"}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_no_change_within_the_training_length(name):
    """s = 1 (L <= N, no forced factor): every scaling gives theta_m exactly and factor 1."""
    for eval_positions in (10, 64):
        inv_freq, factor = SCALINGS[name](HEAD_DIM, 10000.0, 64, eval_positions)
        assert inv_freq.dtype == torch.float64 and factor == 1.0
        torch.testing.assert_close(inv_freq, rope_inv_freq(HEAD_DIM), rtol=0, atol=0)


@pytest.mark.parametrize("train,eval_", [(64, 256), (100, 250), (16, 17)])
def test_position_interpolation_divides_frequencies(train, eval_):
    s = eval_ / train
    inv_freq, factor = SCALINGS["pi"](HEAD_DIM, 10000.0, train, eval_)
    assert factor == 1.0
    assert inv_freq.tolist() == pytest.approx([theta(HEAD_DIM, 1e4, m) / s for m in range(HEAD_DIM // 2)],
                                              rel=1e-15)


def test_position_interpolation_is_rope_at_positions_k_over_s():
    """Chen et al.: rotating with theta_m / s equals rotating position k / s with theta_m."""
    q, _ = qk_pair()
    pos = (torch.arange(SEQ) + 40)[None]
    inv_freq, _ = SCALINGS["pi"](HEAD_DIM, 10000.0, 32, 80)
    expected = rotate(q, pos.double() / 2.5, rope_inv_freq(HEAD_DIM), "half")
    assert_close_scaled(rotate(q, pos, inv_freq, "half"), expected, rtol=1e-12)


@pytest.mark.parametrize("head_dim", [4, 16, 64])
@pytest.mark.parametrize("s", [2.0, 3.7, 8.0])
def test_ntk_changes_the_base(head_dim, s):
    """base' = base * s^(d/(d-2)); so theta_0 stays and the lowest frequency is theta_{d/2-1} / s."""
    inv_freq, factor = SCALINGS["ntk"](head_dim, 10000.0, 100, int(100 * s))
    new_base = 10000.0 * s ** (head_dim / (head_dim - 2))
    assert factor == 1.0
    assert inv_freq.tolist() == pytest.approx([theta(head_dim, new_base, m) for m in range(head_dim // 2)],
                                              rel=1e-13)
    assert inv_freq[0].item() == 1.0
    assert inv_freq[-1].item() == pytest.approx(theta(head_dim, 1e4, head_dim // 2 - 1) / s, rel=1e-13)


@pytest.mark.parametrize("factor", [None, 2.0])
@pytest.mark.parametrize("eval_", [32, 64, 200])
def test_dynamic_ntk_formula(factor, eval_):
    """transformers' rule: base' = base * (f L / N - (f - 1))^(d/(d-2)), L = max(L, N), f = 1 by default."""
    f, length = factor or 1.0, max(eval_, 64)
    new_base = 10000.0 * (f * length / 64 - (f - 1)) ** (HEAD_DIM / (HEAD_DIM - 2))
    inv_freq, attention = SCALINGS["dynamic_ntk"](HEAD_DIM, 10000.0, 64, eval_, factor)
    assert attention == 1.0
    assert inv_freq.tolist() == pytest.approx([theta(HEAD_DIM, new_base, m) for m in range(HEAD_DIM // 2)],
                                              rel=1e-13)


def test_ntk_and_dynamic_ntk_agree_unless_a_factor_is_forced():
    for eval_ in (100, 256, 640):
        torch.testing.assert_close(SCALINGS["dynamic_ntk"](HEAD_DIM, 1e4, 64, eval_)[0],
                                   SCALINGS["ntk"](HEAD_DIM, 1e4, 64, eval_)[0], rtol=1e-14, atol=0)
    # forced f = 4: static keeps base * 4^(d/(d-2)) at every L > N; dynamic starts from base at L = N
    static = [SCALINGS["ntk"](HEAD_DIM, 1e4, 64, eval_, 4.0)[0] for eval_ in (65, 640)]
    torch.testing.assert_close(static[0], static[1], rtol=0, atol=0)
    torch.testing.assert_close(SCALINGS["dynamic_ntk"](HEAD_DIM, 1e4, 64, 64, 4.0)[0], rope_inv_freq(HEAD_DIM))
    assert not torch.allclose(SCALINGS["dynamic_ntk"](HEAD_DIM, 1e4, 64, 65, 4.0)[0], static[0])


def reference_yarn(head_dim: int, base: float, train: int, s: float) -> tuple[list[float], float]:
    """YaRN written out in plain floats: the pair index m(r) whose wavelength fits r times in N is
    m(r) = d ln(N / (2 pi r)) / (2 ln base); the ramp runs linearly in m from floor(m(32)) (keep
    theta_m) to ceil(m(1)) (theta_m / s); attention factor 0.1 ln s + 1."""
    def index(r):
        return head_dim * math.log(train / (2 * math.pi * r)) / (2 * math.log(base))
    low, high = max(math.floor(index(32)), 0), min(math.ceil(index(1)), head_dim - 1)
    out = []
    for m in range(head_dim // 2):
        ramp = min(max((m - low) / (high - low), 0.0), 1.0)
        t = theta(head_dim, base, m)
        out.append(t * (1 - ramp) + t / s * ramp)
    return out, 0.1 * math.log(s) + 1


@pytest.mark.parametrize("head_dim,base,train,s", [
    (16, 1e4, 64, 4.0), (16, 1e4, 64, 2.5), (64, 1e4, 512, 8.0), (128, 1e4, 4096, 16.0),
    (128, 5e5, 8192, 4.0), (32, 1e4, 24, 3.0),
])
def test_yarn_formula(head_dim, base, train, s):
    inv_freq, factor = SCALINGS["yarn"](head_dim, base, train, int(train * s), s)
    expected, expected_factor = reference_yarn(head_dim, base, train, s)
    assert inv_freq.tolist() == pytest.approx(expected, rel=1e-14)
    assert factor == pytest.approx(expected_factor, rel=1e-15)


def test_yarn_hand_computed_case():
    """d = 16, base 1e4, N = 64, s = 4. m(32) = 8 ln(1/pi)/ln(1e4) = -0.994 -> floor -1 -> 0;
    m(1) = 8 ln(64/(2 pi))/ln(1e4) = 2.016 -> ceil 3. Ramp m/3: pair 0 keeps theta_0 = 1, pair 1
    gets theta_1 (1 - (3/4)(1/3)) = 0.75 * 10^-0.5, pair 2 theta_2 (1 - (3/4)(2/3)) = 0.05, pairs 3..7
    theta_m / 4. Attention factor 0.1 ln 4 + 1 = 1.138629436..."""
    inv_freq, factor = SCALINGS["yarn"](16, 10000.0, 64, 256)
    expected = [1.0, 0.75 * 10 ** -0.5, 0.05] + [10 ** (-m / 2) / 4 for m in range(3, 8)]
    assert inv_freq.tolist() == pytest.approx(expected, rel=1e-14)
    assert factor == pytest.approx(1.1386294361119890, rel=1e-15)


@pytest.mark.parametrize("head_dim,train", [(64, 512), (128, 4096), (128, 2048)])
def test_yarn_agrees_with_the_paper_outside_the_ramp(head_dim, train):
    """Peng et al.: r = N theta_m / (2 pi) rotations within N; r > beta = 32 keeps theta_m, r < alpha = 1
    gives theta_m / s, in between theta_m / s <= theta'_m <= theta_m."""
    s = 8.0
    inv_freq, _ = SCALINGS["yarn"](head_dim, 1e4, train, int(train * s))
    base_freq = rope_inv_freq(head_dim)
    rotations = train * base_freq / (2 * math.pi)
    fast, slow = rotations > 32, rotations < 1
    assert fast.any() and slow.any()
    torch.testing.assert_close(inv_freq[fast], base_freq[fast], rtol=0, atol=0)
    torch.testing.assert_close(inv_freq[slow], base_freq[slow] / s, rtol=1e-15, atol=0)
    assert ((inv_freq <= base_freq) & (inv_freq >= base_freq / s * (1 - 1e-15))).all()


# --- the RoPE class: options, the runner's set_eval_length path, training unaffected ------------

@pytest.mark.parametrize("scaling", SCALED)
def test_set_eval_length_scales_then_restores(scaling):
    """The runner calls set_eval_length(train, eval) before each evaluation length."""
    enc = RoPE(dims(train_positions=16), scaling=scaling)
    original = enc.inv_freq.clone()
    enc.set_eval_length(16, 64)
    expected, factor = SCALINGS[scaling](HEAD_DIM, 10000.0, 16, 64)
    torch.testing.assert_close(enc.inv_freq, expected, rtol=0, atol=0)
    assert not torch.equal(enc.inv_freq, original) and enc.attention_factor == factor
    enc.set_eval_length(16, 16)
    assert torch.equal(enc.inv_freq, original) and enc.attention_factor == 1.0


@pytest.mark.parametrize("scaling", SCALED)
def test_training_after_an_evaluation_uses_unscaled_frequencies(scaling):
    enc = RoPE(dims(train_positions=16), scaling=scaling)
    q, k = qk_pair()
    pos = torch.arange(SEQ)[None]
    fresh = enc.qk(q, k, pos, pos, 0)
    enc.eval()
    enc.set_eval_length(16, 128)
    assert not torch.allclose(enc.qk(q, k, pos, pos, 0)[0], fresh[0])
    enc.train()
    for ours, theirs in zip(enc.qk(q, k, pos, pos, 0), fresh):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_no_scaling_ignores_the_evaluation_length():
    enc = RoPE(dims())
    original = enc.inv_freq.clone()
    enc.set_eval_length(64, 512)
    assert torch.equal(enc.inv_freq, original) and enc.attention_factor == 1.0
    assert enc.params() == {"base": 10000.0, "layout": "half", "scaling": "none", "scaling_factor": None,
                            "original_positions": None, "rotary_fraction": 1.0, "frequency_fraction": 1.0,
                            "frequency_cut": "none", "short_factors": None, "long_factors": None,
                            "resonance": False}


def test_forced_scaling_factor_replaces_the_length_ratio():
    enc = RoPE(dims(train_positions=16), scaling="pi", scaling_factor=2.0)
    enc.set_eval_length(16, 64)  # s would be 4 without the forced factor
    torch.testing.assert_close(enc.inv_freq, rope_inv_freq(HEAD_DIM) / 2, rtol=0, atol=0)
    enc.set_eval_length(16, 16)  # within the training length: unscaled
    torch.testing.assert_close(enc.inv_freq, rope_inv_freq(HEAD_DIM), rtol=0, atol=0)


@pytest.mark.parametrize("scaling", SCALED)
def test_original_positions_scale_training_and_evaluation(scaling):
    """Fine-tuning at 32 tokens a model first trained at 16: the scaling acts against 16 in
    training (s = 2), keeps the training's s at shorter evaluation lengths (the model knows no
    other frequencies now) and grows as L / 16 past 32."""
    enc = RoPE(dims(train_positions=32), scaling=scaling, original_positions=16)
    enc.train()
    expected, factor = SCALINGS[scaling](HEAD_DIM, 10000.0, 16, 32)
    torch.testing.assert_close(enc.inv_freq, expected, rtol=0, atol=0)
    assert enc.attention_factor == factor
    enc.eval()
    enc.set_eval_length(32, 128)
    torch.testing.assert_close(enc.inv_freq, SCALINGS[scaling](HEAD_DIM, 10000.0, 16, 128)[0],
                               rtol=0, atol=0)
    for shorter in (8, 16, 32):
        enc.set_eval_length(32, shorter)
        torch.testing.assert_close(enc.inv_freq, expected, rtol=0, atol=0)
        assert enc.attention_factor == factor
    assert enc.params()["original_positions"] == 16


def test_original_positions_at_the_training_length_change_nothing():
    enc = RoPE(dims(train_positions=16), scaling="pi", original_positions=16).train()
    assert torch.equal(enc.inv_freq, rope_inv_freq(HEAD_DIM))
    enc.set_eval_length(16, 8)
    assert torch.equal(enc.inv_freq, rope_inv_freq(HEAD_DIM))
    enc.set_eval_length(16, 64)
    torch.testing.assert_close(enc.inv_freq, rope_inv_freq(HEAD_DIM) / 4, rtol=0, atol=0)


def test_pi_fine_tuning_halves_the_frequencies():
    enc = RoPE(dims(train_positions=32), scaling="pi", original_positions=16).train()
    torch.testing.assert_close(enc.inv_freq, rope_inv_freq(HEAD_DIM) / 2, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_yarn_scales_the_logits_by_the_square_of_the_attention_factor(layout):
    enc = RoPE(dims(train_positions=16), layout=layout, scaling="yarn")
    enc.set_eval_length(16, 64)
    inv_freq, factor = SCALINGS["yarn"](HEAD_DIM, 10000.0, 16, 64)
    q, k = qk_pair()
    pos = torch.arange(SEQ)[None]
    rq, rk = enc.qk(q, k, pos, pos, 0)
    plain = rotate(q, pos, inv_freq, layout) @ rotate(k, pos, inv_freq, layout).transpose(-1, -2)
    # logits up to ~25: a rounding per product of the head_dim-long dot products
    assert_close_scaled(rq @ rk.transpose(-1, -2), plain * (0.1 * math.log(4) + 1) ** 2, ulps=HEAD_DIM, name="logits")
    assert factor == pytest.approx(0.1 * math.log(4) + 1, rel=1e-15)


def test_buffer_keeps_the_module_dtype():
    enc = RoPE(dims(), scaling="ntk").float()
    enc.set_eval_length(64, 256)
    assert enc.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("params,message", [
    ({"scaling": "bogus"}, r"scaling='bogus' is not valid; choose one of \['none', 'pi'"),
    ({"scaling_factor": 2.0}, "no effect with scaling=none"),
    ({"scaling": "pi", "scaling_factor": 0.5}, "must be >= 1"),
    ({"original_positions": 16}, r"original_positions=16 needs a scaling among \['pi'"),
    ({"scaling": "pi", "original_positions": 0}, "encoding.original_positions=0: must be >= 1"),
])
def test_bad_scaling_options_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        RoPE(dims(), **params)


@pytest.mark.parametrize("scaling", ["ntk", "dynamic_ntk"])
def test_ntk_refuses_head_size_two_before_training(scaling):
    with pytest.raises(ValueError, match="head size above 2"):
        RoPE(ModelDims(d_model=4, n_heads=2, n_layers=1, max_positions=64, train_positions=16), scaling=scaling)


def test_scaling_is_set_from_the_command_line():
    """`encoding=rope encoding.scaling=yarn` composes and builds a yarn RoPE."""
    from posbench.build import build
    from tests.helpers import compose_cfg

    built = build(compose_cfg("encoding=rope", "encoding.scaling=yarn", "encoding.scaling_factor=4"),
                  torch.device("cpu"))
    assert built.encoding.params() == {"base": 10000.0, "layout": "half", "scaling": "yarn", "scaling_factor": 4.0,
                                       "original_positions": None, "rotary_fraction": 1.0, "frequency_fraction": 1.0,
                                       "frequency_cut": "none", "short_factors": None, "long_factors": None,
                                       "resonance": False}


# --- HF transformers ROPE_INIT_FUNCTIONS -------------------------------------------------------

def hf_rope(rope_type: str, base: float, train: int, head_dim: int = HEAD_DIM, **params):
    """transformers' own function for rope_type, on a LlamaConfig carrying the keys it reads:
    rope_parameters {rope_type, rope_theta, factor, (original_max_position_embeddings)},
    max_position_embeddings, head_dim (via hidden_size / num_attention_heads)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=HEADS * head_dim, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=train,
                         rope_parameters={"rope_type": rope_type, "rope_theta": base, **params})
    assert config.head_dim == head_dim
    return lambda seq_len=None: ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


@pytest.mark.parametrize("train,eval_", [(64, 160), (512, 4096), (100, 333)])
def test_pi_matches_transformers_linear(train, eval_):
    """transformers builds the table in float32: rtol at float32 resolution."""
    theirs, factor = hf_rope("linear", 10000.0, train, factor=eval_ / train)()
    ours, our_factor = SCALINGS["pi"](HEAD_DIM, 10000.0, train, eval_)
    torch.testing.assert_close(ours, theirs.double(), rtol=3e-7, atol=0)
    assert our_factor == factor == 1.0


@pytest.mark.parametrize("factor", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("eval_", [32, 64, 100, 512])
def test_dynamic_ntk_matches_transformers_dynamic(factor, eval_):
    theirs, their_factor = hf_rope("dynamic", 10000.0, 64, factor=factor)(seq_len=eval_)
    ours, our_factor = SCALINGS["dynamic_ntk"](HEAD_DIM, 10000.0, 64, eval_, None if factor == 1.0 else factor)
    torch.testing.assert_close(ours, theirs.double(), rtol=3e-7, atol=0)
    assert our_factor == their_factor == 1.0


@pytest.mark.parametrize("head_dim,base,train,s", [
    (16, 1e4, 64, 4.0), (16, 1e4, 64, 2.5), (64, 1e4, 512, 8.0), (128, 1e4, 4096, 16.0),
    (128, 5e5, 8192, 4.0), (32, 1e4, 24, 3.0),
])
def test_yarn_matches_transformers_yarn(head_dim, base, train, s):
    """Keys transformers 5 reads for yarn: factor, original_max_position_embeddings (beta_fast = 32,
    beta_slow = 1, truncate = True and the attention factor 0.1 ln s + 1 are its defaults)."""
    theirs, their_factor = hf_rope("yarn", base, train, head_dim, factor=s,
                                   original_max_position_embeddings=train)()
    ours, our_factor = SCALINGS["yarn"](head_dim, base, train, int(train * s), s)
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(their_factor, rel=1e-15)


# --- rotary-embedding-torch --------------------------------------------------------------------

def exact_rotary(**kwargs):
    """A float64 RotaryEmbedding whose float32-built frequency table (checked at float32
    resolution) is replaced by the exact one, so the rest of its computation is compared tightly."""
    rotary_embedding_torch = pytest.importorskip("rotary_embedding_torch")
    rotary = rotary_embedding_torch.RotaryEmbedding(dim=HEAD_DIM, **kwargs).double()
    torch.testing.assert_close(rotary.freqs.detach(), rope_inv_freq(HEAD_DIM), rtol=2e-7, atol=0)
    with torch.no_grad():
        rotary.freqs.copy_(rope_inv_freq(HEAD_DIM))
    return rotary


@pytest.mark.parametrize("s", [2.0, 3.5])
@pytest.mark.parametrize("offset", [0, 300])
def test_pi_matches_rotary_embedding_torch_interpolate_factor(s, offset):
    """interpolate_factor s divides the positions (arange(L) + offset) / s; our pi divides theta_m."""
    rotary = exact_rotary(interpolate_factor=s)
    enc = RoPE(dims(train_positions=20), layout="interleaved", scaling="pi").double()
    enc.set_eval_length(20, int(20 * s))
    q, k = qk_pair()
    pos = (torch.arange(SEQ) + offset)[None]
    ours, _ = enc.qk(q, k, pos, pos, 0)
    torch.testing.assert_close(ours, rotary.rotate_queries_or_keys(q, offset=offset), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("length", [SEQ, SEQ + 1])
def test_xpos_matches_rotary_embedding_torch(length):
    """RotaryEmbedding(use_xpos=True, xpos_scale_base=512).rotate_queries_and_keys: interleaved pairs,
    q scaled by zeta^((k - L//2)/512) and k by its inverse; our centre for arange(L) is L // 2 too."""
    rotary = exact_rotary(use_xpos=True, xpos_scale_base=512)
    torch.testing.assert_close(rotary.scale, xpos_zeta(HEAD_DIM), rtol=2e-7, atol=0)
    rotary.scale.copy_(xpos_zeta(HEAD_DIM))
    q, k = qk_pair(length)
    pos = torch.arange(length)[None]
    ours = XPos(dims(), layout="interleaved").double().qk(q, k, pos, pos, 0)
    for got, expected in zip(ours, rotary.rotate_queries_and_keys(q, k)):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


# --- xPos formulas -----------------------------------------------------------------------------

def reference_xpos_logits(q, k, q_pos, k_pos, base=10000.0, gamma=0.4, scale_base=512.0):
    """Interleaved pairs as complex numbers: logit = sum_m Re(q_m conj(k_m) e^{i (i-j) theta_m})
    * zeta_m^((i-j)/B), with no centring, in float64: [B, H, Lq, Lk]."""
    d = q.shape[-1]
    zeta = torch.tensor([(2 * m / d + gamma) / (1 + gamma) for m in range(d // 2)], dtype=torch.float64)
    inv_freq = torch.tensor([theta(d, base, m) for m in range(d // 2)], dtype=torch.float64)
    qc = torch.view_as_complex(q.reshape(*q.shape[:-1], d // 2, 2))  # [B, H, Lq, d/2]
    kc = torch.view_as_complex(k.reshape(*k.shape[:-1], d // 2, 2))  # [B, H, Lk, d/2]
    distance = (q_pos[0, :, None] - k_pos[0, None, :]).double()[..., None]  # [Lq, Lk, 1]
    angle = distance * inv_freq  # [Lq, Lk, d/2]
    phase = torch.polar(torch.ones_like(angle), angle)  # [Lq, Lk, d/2]
    pair_terms = (qc[..., :, None, :] * kc[..., None, :, :].conj() * phase).real  # [B, H, Lq, Lk, d/2]
    return (pair_terms * zeta ** (distance / scale_base)).sum(-1)  # [B, H, Lq, Lk]


@pytest.mark.parametrize("start", [0, 37, 10_000])
@pytest.mark.parametrize("scale_base", [512.0, 8.0])
def test_xpos_logits_match_the_formula(start, scale_base):
    """Includes positions near 10^4 with B = 8, where the uncentred zeta_0^(-k/B) = e^(1566) would
    overflow even float64: the centred computation gives the formula's logits, since only i - j matters."""
    q, k = qk_pair()
    pos = (torch.arange(SEQ) + start)[None]
    rq, rk = XPos(dims(), layout="interleaved", scale_base=scale_base).double().qk(q, k, pos, pos, 0)
    expected = reference_xpos_logits(q, k, pos, pos, scale_base=scale_base)
    # logits up to ~130, rotated by angles up to start + SEQ radians (rounded to that many ulps) and summed
    # over head_dim features
    assert_close_scaled(rq @ rk.transpose(-1, -2), expected, ulps=start + SEQ + HEAD_DIM, name="logits")


def test_xpos_stays_finite_at_large_positions_in_float32():
    """Uncentred, zeta_0^(-k/512) = e^(1.2528 k / 512) overflows float32 beyond k of about 36,000;
    centring keeps it finite, and the logits equal the float64 formula to float32 angle resolution
    (angles k theta_m near 6e4 rad carry float32 steps of 4e-3 rad, as plain rope does)."""
    q, k = qk_pair()
    pos = (torch.arange(SEQ) + 60_000)[None]
    assert math.isinf(torch.tensor(2 / 7, dtype=torch.float32) ** torch.tensor(-60_000 / 512, dtype=torch.float32))
    rq, rk = XPos(dims(), layout="interleaved").qk(q.float(), k.float(), pos, pos, 0)
    logits = rq @ rk.transpose(-1, -2)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits.double(), reference_xpos_logits(q, k, pos, pos), rtol=0, atol=2e-2)


def test_xpos_hand_computed_case():
    """d = 2 (one pair, theta_0 = 1), B = 1, q = k = (1, 0), query at 2, key at 0: the rotations give
    cos(2 - 0) = -0.41614683654714241, zeta_0 = 0.4 / 1.4 = 2/7, decay (2/7)^(2/1) = 4/49 = 0.0816326530612245,
    so logit = -0.0339711703303790."""
    enc = XPos(ModelDims(d_model=2, n_heads=1, n_layers=1, max_positions=4, train_positions=4),
               scale_base=1.0).double()
    x = torch.tensor([1.0, 0.0], dtype=torch.float64).expand(1, 1, 3, 2)
    pos = torch.tensor([[0, 1, 2]])
    rq, rk = enc.qk(x, x, pos, pos, 0)
    assert (rq[0, 0, 2] @ rk[0, 0, 0]).item() == pytest.approx(-0.0339711703303790, rel=1e-13)
    assert xpos_zeta(4).tolist() == pytest.approx([2 / 7, 9 / 14], rel=1e-15)  # (0 + 0.4)/1.4, (0.5 + 0.4)/1.4


def test_xpos_layouts_agree_up_to_feature_permutation():
    q, k = qk_pair()
    gen = torch.Generator().manual_seed(2)
    pos = torch.randint(0, 3000, (2, SEQ), generator=gen)
    perm = torch.cat([torch.arange(0, HEAD_DIM, 2), torch.arange(1, HEAD_DIM, 2)])
    q_int, k_int = XPos(dims(), layout="interleaved").double().qk(q, k, pos, pos, 0)
    q_half, k_half = XPos(dims(), layout="half").double().qk(q[..., perm], k[..., perm], pos, pos, 0)
    assert_close_scaled(q_half, q_int[..., perm], rtol=1e-12, name="q")  # xpos-scaled up to ~80
    assert_close_scaled(k_half, k_int[..., perm], rtol=1e-12, name="k")


def test_xpos_centres_each_row_on_its_positions():
    """The key scale at j is zeta_0^(-(j - c)/B), c = (min + max + 1) // 2 of the row's positions:
    1000 for (0, 1000, 2000), 6 for (5, 6, 7); rotations keep the norm, so |k'| / |k| is that scale."""
    enc = XPos(ModelDims(d_model=2, n_heads=1, n_layers=1, max_positions=4096, train_positions=64)).double()
    x = torch.tensor([1.0, 0.0], dtype=torch.float64).expand(2, 1, 3, 2)
    pos = torch.tensor([[0, 1000, 2000], [5, 6, 7]])
    rq, rk = enc.qk(x, x, pos, pos, 0)
    for row, c in ((0, 1000), (1, 6)):
        expected = [(2 / 7) ** ((p - c) / 512) for p in pos[row].tolist()]
        assert rq[row, 0].norm(dim=-1).tolist() == pytest.approx(expected, rel=1e-12)
        assert rk[row, 0].norm(dim=-1).tolist() == pytest.approx([1 / e for e in expected], rel=1e-12)


@pytest.mark.parametrize("params,message", [
    ({"layout": "bogus"}, r"layout='bogus' is not valid; choose one of \['half', 'interleaved'\]"),
    ({"gamma": 0.0}, "encoding.gamma=0.0: must be > 0"),
    ({"scale_base": -1}, "encoding.scale_base=-1: must be > 0"),
])
def test_xpos_bad_options_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        make_encoding("xpos", **params)
