"""2-D encodings: formulas in float64 (article 000's 2-D sinusoid, rope-vit's equations, T5 / Swin
indices and ALiBi distances written out by hand), 2-D shift invariance, query blocks, the learned
table's policies, the raster adapter for 1-D encodings, composites, and refusals. The registry-wide
properties (causality, sdpa = eager, per-sequence positions) are in tests/test_encodings.py."""
import math

import pytest
import torch

from posbench.attention import get_backend
from posbench.encodings import REGISTRY, ModelDims
from posbench.encodings.alibi import alibi_slopes
from posbench.encodings.learned_2d import resample_table
from posbench.encodings.rope import rope_inv_freq
from posbench.model import ModelConfig, Transformer
from posbench.positions import raster
from tests.helpers import assert_close_scaled, grid_positions, make_encoding

TWO_D = sorted(name for name, cls in REGISTRY.items() if cls.position_dims == 2)
RELATIVE_2D = [name for name in TWO_D if REGISTRY[name].relative]


def grid_dims(d_model=16, n_heads=2, n_layers=2, max_side=8, train_side=8, causal=False) -> ModelDims:
    return ModelDims(d_model=d_model, n_heads=n_heads, n_layers=n_layers, max_positions=max_side ** 2,
                     train_positions=train_side ** 2, causal=causal, max_side=max_side, train_side=train_side)


def randomised(enc):
    """Learned tables start at zero or tiny: make them matter."""
    torch.manual_seed(0)
    for p in enc.parameters():
        torch.nn.init.normal_(p)
    return enc


def logits_of(enc, q, k, q_pos, k_pos):
    """The pre-mask logits of one layer (eager order: qk, then q.k^T * scale + bias)."""
    if "qk" in enc.hooks:
        q, k = enc.qk(q, k, q_pos, k_pos, 0)
    logits = q @ k.transpose(-1, -2) * enc.logit_scale(q.shape[-1])  # [B, H, Lq, Lk]
    bias = enc.bias(q_pos, k_pos, 0)
    return logits if bias is None else logits + bias


def test_the_six_2d_encodings_are_registered():
    assert TWO_D == ["alibi_2d", "learned_2d", "rope_2d", "rope_mixed", "sinusoidal_2d", "t5_2d"]
    assert RELATIVE_2D == ["alibi_2d", "rope_2d", "rope_mixed", "t5_2d"]


# ---- sinusoidal_2d --------------------------------------------------------------------------------

def test_sinusoidal_2d_matches_article_000():
    """p_{w,2i} = sin(w / 10000^(2i/d)), p_{w,2i+1} = cos(...) on the first D/2 = d channels (the
    column, as the article's code writes the width first), the same for the row h on the last D/2."""
    d_model = 12
    enc = REGISTRY["sinusoidal_2d"](grid_dims(d_model=d_model))
    pos = grid_positions(3, 5, 2, 7)  # rows 2..4, columns 7..11
    out = enc.embed(torch.zeros(1, 15, d_model, dtype=torch.float64), pos, torch.zeros(1, 15, dtype=torch.long))
    half = d_model // 2
    for cell, (h, w) in enumerate(pos[0].tolist()):
        for i in range(half // 2):
            angle_w, angle_h = w / 10000 ** (2 * i / half), h / 10000 ** (2 * i / half)
            expected = [math.sin(angle_w), math.cos(angle_w), math.sin(angle_h), math.cos(angle_h)]
            got = out[0, cell, [2 * i, 2 * i + 1, half + 2 * i, half + 2 * i + 1]].tolist()
            assert got == pytest.approx(expected, abs=1e-6)  # a float32 table


def test_sinusoidal_2d_needs_d_model_divisible_by_4():
    with pytest.raises(ValueError, match=r"model.d_model % 4 == 0; got model.d_model=18"):
        REGISTRY["sinusoidal_2d"](grid_dims(d_model=18))


# ---- rope_2d and rope_mixed against rope-vit's equations (Heo et al. 2024) --------------------------

def rotate_complex(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """q' = q * e^{i angle} on the complex pairs (x_2t + i x_2t+1). x: [B, H, L, d], angles: [B', H', L, d/2]."""
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())  # [B, H, L, d/2]
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def test_rope_2d_matches_the_axial_equations():
    """RoPE-Axial: theta_t = 100^(-t/(d/4)); complex pair t < d/4 turns by theta_t * p^x (the column),
    pair d/4 + t by theta_t * p^y (the row), as rope-vit's compute_axial_cis concatenates them."""
    d = 8
    enc = REGISTRY["rope_2d"](grid_dims(d_model=2 * d))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 12, d, dtype=torch.float64, generator=gen)
    pos = grid_positions(3, 4, 1, 5)
    rows, cols = pos[0, :, 0].double(), pos[0, :, 1].double()
    theta = torch.tensor([100.0 ** (-t / (d / 4)) for t in range(d // 4)], dtype=torch.float64)
    angles = torch.cat((cols[:, None] * theta, rows[:, None] * theta), dim=-1)  # [L, d/2]
    expected = rotate_complex(q, angles[None, None])
    got, _ = enc.qk(q, q, pos, pos, 0)
    assert_close_scaled(got, expected, rtol=0, atol_scale=1e-12)


def test_rope_2d_equals_the_papers_alternating_axes_up_to_a_pair_permutation():
    """The paper writes R(n, 2t) = e^{i theta_t p^x}, R(n, 2t+1) = e^{i theta_t p^y} (axes alternate);
    the concatenated layout gives the same logits once q and k pairs are permuted alike."""
    d = 8
    enc = REGISTRY["rope_2d"](grid_dims(d_model=2 * d))
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, 12, d, dtype=torch.float64, generator=gen) for _ in range(2))
    pos = grid_positions(3, 4)
    rows, cols = pos[0, :, 0].double(), pos[0, :, 1].double()
    theta = torch.tensor([100.0 ** (-t / (d / 4)) for t in range(d // 4)], dtype=torch.float64)
    alternating = torch.stack((cols[:, None] * theta, rows[:, None] * theta), dim=-1).flatten(-2)  # [L, d/2]
    paper = rotate_complex(q, alternating[None, None]) @ rotate_complex(k, alternating[None, None]).transpose(-1, -2)
    pairs = torch.tensor([0, 2, 1, 3])  # our pair t <- the paper's pair: columns 0, 2, rows 1, 3
    features = torch.stack((2 * pairs, 2 * pairs + 1), dim=-1).flatten()
    rq, rk = enc.qk(q[..., features], k[..., features], pos, pos, 0)
    assert_close_scaled(rq @ rk.transpose(-1, -2), paper, rtol=0, atol_scale=1e-12, name="logits")  # up to ~17


def test_rope_mixed_matches_the_mixed_equations():
    """RoPE-Mixed: R(n, t) = e^{i (theta^x_t p^x_n + theta^y_t p^y_n)} with (theta^x, theta^y) learned per
    head and layer; each layer uses its own."""
    d = 8
    enc = randomised(REGISTRY["rope_mixed"](grid_dims(d_model=2 * d))).double()
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 12, d, dtype=torch.float64, generator=gen)
    pos = grid_positions(4, 3, 2, 1)
    rows, cols = pos[0, :, 0].double(), pos[0, :, 1].double()
    for layer in (0, 1):
        fx, fy = enc.freqs[0, layer].detach(), enc.freqs[1, layer].detach()  # [H, d/2] each
        angles = fx[:, None, :] * cols[None, :, None] + fy[:, None, :] * rows[None, :, None]  # [H, L, d/2]
        got, _ = enc.qk(q, q, pos, pos, layer)
        assert_close_scaled(got, rotate_complex(q, angles[None]), rtol=0, atol_scale=1e-12)


def test_rope_mixed_init_follows_rope_vit():
    """Per layer and head: (fx, fy) = mag_t (cos a, sin a) for t < d/4, mag_t (cos, sin)(a + pi/2) for the
    rest, mag_t = 1 / 10^(4t/d), a random angle per head."""
    d, heads = 16, 4
    torch.manual_seed(0)
    enc = REGISTRY["rope_mixed"](grid_dims(d_model=d * heads, n_heads=heads, n_layers=3))
    fx, fy = enc.freqs.detach().double()  # [layers, H, d/2] each
    mag = torch.tensor([10.0 ** (-4 * t / d) for t in range(d // 4)], dtype=torch.float64)
    torch.testing.assert_close(torch.hypot(fx, fy), mag.repeat(2).expand_as(fx), rtol=1e-6, atol=0)
    angle = torch.atan2(fy, fx)  # [layers, H, d/2]
    first, second = angle[..., : d // 4], angle[..., d // 4:]
    assert torch.allclose(first, first[..., :1].expand_as(first), atol=1e-6)  # one angle a per head ...
    turn = torch.remainder(second - first, 2 * math.pi)
    torch.testing.assert_close(turn, torch.full_like(turn, math.pi / 2), rtol=0, atol=1e-5)  # ... then a + pi/2
    assert first[..., 0].unique().numel() == 3 * heads  # drawn per layer and head


@pytest.mark.parametrize("name", ["rope_2d", "rope_mixed"])
def test_2d_ropes_need_a_head_size_divisible_by_4(name):
    with pytest.raises(ValueError, match=r"head size divisible by 4, got model.d_model / model.n_heads = 12/2 = 6"):
        REGISTRY[name](grid_dims(d_model=12, n_heads=2))


@pytest.mark.parametrize("name", ["rope_2d", "rope_mixed"])
def test_pi_scaling_divides_both_axes_by_the_side_ratio(name):
    """Evaluating 16 x 16 after training 8 x 8 with scaling=pi: each axis's positions / 2."""
    enc = randomised(REGISTRY[name](grid_dims(d_model=16, max_side=16), scaling="pi")).double().eval()
    reference = randomised(REGISTRY[name](grid_dims(d_model=16, max_side=16))).double().eval()
    q = torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pos = grid_positions(3, 4, 5, 9)
    enc.set_eval_length(64, 256)  # the runner's token counts: 8^2 trained, 16^2 evaluated
    assert_close_scaled(enc.qk(q, q, pos, pos, 1)[0], reference.qk(q, q, pos / 2, pos / 2, 1)[0], rtol=0,
                        atol_scale=1e-12)
    enc.set_eval_length(64, 64)  # within the trained side: unscaled
    torch.testing.assert_close(enc.qk(q, q, pos, pos, 1)[0], reference.qk(q, q, pos, pos, 1)[0], rtol=0, atol=0)
    enc.set_eval_length(64, 256)
    enc.train()  # training: unscaled again
    torch.testing.assert_close(enc.qk(q, q, pos, pos, 1)[0], reference.qk(q, q, pos, pos, 1)[0], rtol=0, atol=0)


def test_rope_2d_ntk_and_yarn_act_on_each_axis_as_the_1d_rules_for_a_head_of_d_over_2():
    d, base = 16, 100.0
    enc = REGISTRY["rope_2d"](grid_dims(d_model=2 * d, max_side=32), scaling="ntk")
    enc.set_eval_length(64, 1024)  # sides 8 -> 32: s = 4 on each axis
    expected = rope_inv_freq(d // 2, base * 4 ** ((d / 2) / (d / 2 - 2)))  # base' = base * s^(d'/(d'-2)), d' = d/2
    torch.testing.assert_close(enc.inv_freq, expected, rtol=0, atol=0)
    yarn = REGISTRY["rope_2d"](grid_dims(d_model=2 * d, max_side=32), scaling="yarn")
    yarn.set_eval_length(64, 1024)
    assert yarn.attention_factor == pytest.approx(0.1 * math.log(4) + 1)


def test_rope_mixed_scalings_scale_the_learned_frequencies_per_pair():
    enc = REGISTRY["rope_mixed"](grid_dims(d_model=32, max_side=32), scaling="ntk")
    enc.set_eval_length(64, 1024)  # s = 4
    half = 8  # the 1-D rule for a head of d/2, at the init magnitudes' index t
    factor = rope_inv_freq(half, 10.0 * 4 ** (half / (half - 2))) / rope_inv_freq(half, 10.0)  # [d/4]
    torch.testing.assert_close(enc.freq_scale.double(), factor.repeat(2).float().double(), rtol=0, atol=0)


# ---- t5_2d ----------------------------------------------------------------------------------------

def index_revealing(enc):
    """Table entry e holds e * (h + 1) in head h, so the bias shows which entry each pair read."""
    entries = enc.table.weight.shape[0]
    with torch.no_grad():
        enc.table.weight.copy_(torch.arange(entries, dtype=torch.float32)[:, None] * torch.tensor([1.0, 2.0]))
    return enc


def entries_read(enc, q_pos, k_pos):
    bias = enc.bias(q_pos, k_pos, 0)  # [1, H, Lq, Lk]
    torch.testing.assert_close(bias[0, 1], 2 * bias[0, 0])
    return bias[0, 0].round().long()  # [Lq, Lk]


def test_t5_2d_bucket_ids_by_hand():
    """num_buckets = 8 per axis, max_distance = 8. Per axis, T5's bidirectional rule on the distance
    n = query - key: 4 buckets per sign, exact below 2, then 2 + floor(2 ln(|n|/2) / ln 4) capped at 3;
    keys after the query (n < 0) add 4. So n = 0, 1, 2, 3, 4, 9 -> 0, 1, 2, 2, 3, 3 and
    n = -1, -2, -3, -4, -9 -> 5, 6, 6, 7, 7. The entry is bucket(dy) * 8 + bucket(dx)."""
    enc = index_revealing(REGISTRY["t5_2d"](grid_dims(), num_buckets=8, max_distance=8))
    per_axis = {0: 0, 1: 1, 2: 2, 3: 2, 4: 3, 9: 3, -1: 5, -2: 6, -3: 6, -4: 7, -9: 7}
    query = torch.tensor([[[10, 10]]])  # [1, 1, 2] (row, column)
    offsets = [(0, 0), (1, 0), (0, 1), (3, -2), (-4, 9), (9, -9), (2, 4), (-1, -3)]  # (dy, dx) = query - key
    keys = torch.tensor([[[10 - dy, 10 - dx] for dy, dx in offsets]])  # [1, 8, 2]
    expected = [per_axis[dy] * 8 + per_axis[dx] for dy, dx in offsets]
    assert expected == [0, 8, 1, 22, 59, 31, 19, 46]
    assert entries_read(enc, query, keys)[0].tolist() == expected


def test_t5_2d_unbucketed_is_swins_clipped_table():
    """bucketed=false, max_distance K = 2: Swin's (2M-1)^2 = 25 entries for M = 3,
    entry (clip(dy) + 2) * 5 + clip(dx) + 2, (dy, dx) = query - key clipped to [-2, 2]."""
    enc = index_revealing(REGISTRY["t5_2d"](grid_dims(), bucketed=False, max_distance=2))
    assert enc.table.weight.shape == (25, 2)
    query = torch.tensor([[[4, 4]]])
    offsets = [(0, 0), (1, -1), (-2, 2), (5, -7), (-1, 0), (2, 1)]
    keys = torch.tensor([[[4 - dy, 4 - dx] for dy, dx in offsets]])
    assert entries_read(enc, query, keys)[0].tolist() == [12, 16, 4, 20, 7, 23]


def test_t5_2d_symmetric_reads_the_articles_absolute_offsets():
    """Article 000's code: entry |dx| * fmap + |dy| over (|dx|, |dy|); ours |dy| * (K + 1) + |dx|, the same
    table with the axes named the other way (its x is the first grid index, the row)."""
    enc = index_revealing(REGISTRY["t5_2d"](grid_dims(), bucketed=False, max_distance=3, symmetric=True))
    assert enc.table.weight.shape == (16, 2)
    query = torch.tensor([[[3, 3]]])
    offsets = [(0, 0), (1, -2), (-1, 2), (-3, 0), (2, 3)]
    keys = torch.tensor([[[3 - dy, 3 - dx] for dy, dx in offsets]])
    assert entries_read(enc, query, keys)[0].tolist() == [0, 6, 6, 12, 11]
    bucketed = index_revealing(REGISTRY["t5_2d"](grid_dims(), num_buckets=4, max_distance=8, symmetric=True))
    # one-sided buckets of |n| (4 per axis, exact below 2, then 2 + floor(2 ln(|n|/2) / ln 4) capped at 3)
    assert entries_read(bucketed, query, keys)[0].tolist() == [0, 1 * 4 + 2, 1 * 4 + 2, 2 * 4 + 0, 2 * 4 + 2]


def test_t5_2d_refuses_bad_sizes():
    with pytest.raises(ValueError, match=r"encoding.num_buckets=3: must be >= 4 \(bidirectional"):
        REGISTRY["t5_2d"](grid_dims(), num_buckets=3)
    with pytest.raises(ValueError, match="encoding.max_distance=0: must be >= 1"):
        REGISTRY["t5_2d"](grid_dims(), bucketed=False, max_distance=0)


# ---- alibi_2d -------------------------------------------------------------------------------------

@pytest.mark.parametrize("distance, expected", [
    ("euclidean", [0.0, 5.0, 5.0, 1.0, math.sqrt(2), 13.0]),
    ("manhattan", [0.0, 7.0, 7.0, 1.0, 2.0, 17.0]),
])
def test_alibi_2d_distances_by_hand(distance, expected):
    enc = REGISTRY["alibi_2d"](grid_dims(n_heads=4, d_model=16), distance=distance)
    query = torch.tensor([[[2, 3]]])
    keys = torch.tensor([[[2, 3], [5, 7], [-1, -1], [2, 4], [1, 2], [14, 8]]])  # |dy| |dx|: 00 34 34 01 11 (12)5
    bias = enc.bias(query, keys, 0)  # [1, H, 1, 6]
    for h, slope in enumerate(alibi_slopes(4).tolist()):
        assert bias[0, h, 0].tolist() == pytest.approx([-slope * e for e in expected], rel=1e-6)


def test_alibi_2d_refuses_an_unknown_distance():
    with pytest.raises(ValueError, match=r"alibi_2d: encoding.distance='chebyshev' is not valid; choose one of"):
        REGISTRY["alibi_2d"](grid_dims(), distance="chebyshev")


# ---- properties of every 2-D encoding --------------------------------------------------------------

@pytest.mark.parametrize("name", RELATIVE_2D + ["composite"])
def test_relative_2d_encodings_depend_on_the_offset_only(name):
    """Shifting rows by a and columns by b (a != b) leaves the logits unchanged; query and key grids differ."""
    params = {"parts": ["rope_2d", "t5_2d"]} if name == "composite" else {}
    enc = randomised(REGISTRY[name](grid_dims(max_side=64), **params)).double()
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 6, 8, dtype=torch.float64, generator=gen), torch.randn(1, 2, 12, 8, dtype=torch.float64,
                                                                                   generator=gen)
    q_pos, k_pos = grid_positions(2, 3, 1, 1), grid_positions(3, 4)
    base = logits_of(enc, q, k, q_pos, k_pos)
    for a, b in ((1, 0), (0, 5), (7, 30), (1000, 3)):
        shift = torch.tensor([a, b])
        torch.testing.assert_close(logits_of(enc, q, k, q_pos + shift, k_pos + shift), base, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", ["sinusoidal_2d", "learned_2d"])
def test_absolute_2d_encodings_change_with_a_shift(name):
    enc = randomised(REGISTRY[name](grid_dims()))
    x, ids = torch.zeros(1, 6, 16), torch.zeros(1, 6, dtype=torch.long)
    pos = grid_positions(2, 3)
    for shift in ([1, 0], [0, 1]):
        assert not torch.allclose(enc.embed(x, pos, ids), enc.embed(x, pos + torch.tensor(shift), ids))


@pytest.mark.parametrize("name", TWO_D)
def test_a_block_of_queries_reads_its_slice(name):
    """Attention may take queries in blocks (pos[:, a:b]): every hook then equals the slice of the whole."""
    enc = randomised(REGISTRY[name](grid_dims())).double()
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, 2, 20, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    pos = grid_positions(4, 5)
    whole = logits_of(enc, q, k, pos, pos)
    block = logits_of(enc, q[:, :, 7:13], k, pos[:, 7:13], pos)
    assert_close_scaled(block, whole[:, :, 7:13], rtol=0, atol_scale=1e-12)


def test_2d_encodings_refuse_a_1d_task():
    dims = ModelDims(d_model=16, n_heads=2, n_layers=1, max_positions=64, train_positions=64)
    for name in TWO_D:
        with pytest.raises(ValueError, match=rf"encoding {name} reads \(row, column\) positions and needs a grid task"):
            REGISTRY[name](dims)
    with pytest.raises(ValueError, match=r"encoding rope_2d reads \(row, column\) positions \[B', L, 2\] but got 1-D"):
        REGISTRY["rope_2d"](grid_dims()).read_positions(torch.arange(5)[None])


# ---- learned_2d policies ----------------------------------------------------------------------------

def test_learned_2d_interpolation_reproduces_the_table_at_the_trained_size():
    enc = randomised(REGISTRY["learned_2d"](grid_dims(max_side=16, train_side=6))).double()
    table = enc.table.detach()
    assert_close_scaled(resample_table(table, 6, 6), table, rtol=0, atol_scale=1e-12)
    x, ids = torch.zeros(1, 36, 16, dtype=torch.float64), torch.zeros(1, 36, dtype=torch.long)
    out = enc.embed(x, grid_positions(6, 6), ids)  # the whole trained grid: the table itself
    torch.testing.assert_close(out[0], table.reshape(36, 16), rtol=0, atol=0)


def test_learned_2d_interpolation_resamples_past_the_table_bicubically():
    enc = randomised(REGISTRY["learned_2d"](grid_dims(max_side=16, train_side=4))).double()
    table = enc.table.detach()  # [4, 4, D]
    x, ids = torch.zeros(1, 64, 16, dtype=torch.float64), torch.zeros(1, 64, dtype=torch.long)
    out = enc.embed(x, grid_positions(8, 8), ids)[0].reshape(8, 8, 16)
    expected = torch.nn.functional.interpolate(table.permute(2, 0, 1)[None], size=(8, 8), mode="bicubic",
                                               align_corners=False)[0].permute(1, 2, 0)
    assert_close_scaled(out, expected, rtol=0, atol_scale=1e-12)
    # a row-constant table stays row-constant: resampling acts on each axis on its own
    with torch.no_grad():
        enc.table.copy_(torch.arange(4.0, dtype=torch.float64)[:, None, None].expand(4, 4, 16))
    wide = enc.embed(torch.zeros(1, 24, 16, dtype=torch.float64), grid_positions(3, 8),
                     torch.zeros(1, 24, dtype=torch.long))[0].reshape(3, 8, 16)
    torch.testing.assert_close(wide, torch.arange(3.0, dtype=torch.float64)[:, None, None].expand(3, 8, 16))


def test_learned_2d_clamp_and_error():
    enc = randomised(REGISTRY["learned_2d"](grid_dims(max_side=8, train_side=4), policy="clamp"))
    out = enc.embed(torch.zeros(1, 36, 16), grid_positions(6, 6), torch.zeros(1, 36, dtype=torch.long))[0]
    table = enc.table.detach()
    torch.testing.assert_close(out.reshape(6, 6, 16)[5, 5], table[3, 3])
    torch.testing.assert_close(out.reshape(6, 6, 16)[1, 4], table[1, 3])
    REGISTRY["learned_2d"](grid_dims(max_side=4, train_side=4), policy="error")  # every cell trained: accepted
    with pytest.raises(ValueError, match=r"policy=error: evaluation reaches grids of side 8 .* 4 x 4 trained grid"):
        REGISTRY["learned_2d"](grid_dims(max_side=8, train_side=4), policy="error")
    with pytest.raises(ValueError, match=r"learned_2d: encoding.policy='random' is not valid; choose one of"):
        REGISTRY["learned_2d"](grid_dims(), policy="random")


# ---- the raster adapter and whole models on grids ---------------------------------------------------

def test_raster_index_is_row_times_width_plus_column():
    assert raster(grid_positions(2, 3)).tolist() == [[0, 1, 2, 3, 4, 5]]
    assert raster(grid_positions(2, 3, 4, 10)).tolist() == [[22, 23, 24, 25, 26, 27]]  # offsets: r * 3 + c
    gaps = torch.tensor([[[0, 1], [0, 5], [3, 1], [3, 5]]])  # randomized columns 1, 5: width 5 keeps them apart
    assert raster(gaps).tolist() == [[1, 5, 16, 20]]
    per_sequence = torch.cat((grid_positions(2, 2), grid_positions(2, 2, 0, 3)))  # widths 2 and 2
    assert raster(per_sequence).tolist() == [[0, 1, 2, 3], [3, 4, 5, 6]]


def grid_model(name: str, backend: str, **params) -> Transformer:
    torch.manual_seed(0)
    enc = make_encoding(name, causal=False, d_model=32, n_heads=4, max_positions=64, **params)
    for p in enc.parameters():
        torch.nn.init.normal_(p, std=0.5)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=4, causal=False)
    return Transformer(cfg, enc, get_backend(backend, enc)).double().eval()


# grids are read by encoders: a causal-only encoding refuses them (test_configs checks the refusal)
ON_GRIDS = sorted(name for name in REGISTRY if name != "composite" and not REGISTRY[name].causal_only) + ["composite"]


@pytest.mark.parametrize("name", ON_GRIDS)
def test_every_encoding_runs_on_a_life_grid_through_both_backends(name):
    """A grid task's batch through sdpa and eager (where sdpa can run the hooks): equal outputs. 1-D
    encodings read the raster index: the same as handing them r * W + c themselves."""
    from tasks.grid import Life

    batch = Life().sample_grid(2, 5, 7, torch.Generator().manual_seed(6))
    pos = grid_positions(5, 7)
    params = {"parts": ["rope_2d", "t5_2d"]} if name == "composite" else {}
    eager = grid_model(name, "eager", **params)
    out = eager(batch.inputs, pos)
    assert out.shape == (2, 35, 11) and torch.isfinite(out).all()
    if eager.encoding.position_dims == 1:
        torch.testing.assert_close(eager(batch.inputs, torch.arange(35)[None]), out, rtol=0, atol=0)
    if not set(eager.encoding.hooks) - {"embed"} - get_backend("sdpa").supported_hooks:
        sdpa = grid_model(name, "sdpa", **params)
        sdpa.load_state_dict(eager.state_dict())
        assert_close_scaled(sdpa(batch.inputs, pos), out, rtol=0, atol_scale=1e-10, name=name)


# ---- composites ---------------------------------------------------------------------------------

def test_composite_of_2d_parts_equals_its_parts():
    enc = randomised(make_encoding("composite", parts=["rope_2d", "t5_2d"])).double()
    rope, t5 = (randomised(make_encoding(name)).double() for name in ("rope_2d", "t5_2d"))
    t5.load_state_dict(enc.parts[1].state_dict())
    assert enc.position_dims == 2 and enc.relative and enc.hooks == {"qk", "bias"}
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    pos = grid_positions(3, 4)
    rq, rk = rope.qk(q, k, pos, pos, 0)
    expected = rq @ rk.transpose(-1, -2) / math.sqrt(8) + t5.bias(pos, pos, 0)
    assert_close_scaled(logits_of(enc, q, k, pos, pos), expected, rtol=0, atol_scale=1e-12)
    assert make_encoding("composite", parts=["nope", "alibi_2d"]).position_dims == 2  # no hooks: either kind


def test_composite_refuses_1d_beside_2d_parts():
    with pytest.raises(ValueError, match=r"parts \['rope'\] read 1-D .* parts \['t5_2d'\] read \(row, column\)"):
        make_encoding("composite", parts=["rope", "t5_2d"])
