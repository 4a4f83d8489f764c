"""Scalar-bias encodings: kerple, fire, sandwich, and t5's unbucketed variant.

Each has a float64 formula test (random positions, the closed formula written out again here
in plain Python) and a hand-computed small case whose values are written out with their
derivation. No third-party library implements these: x-transformers has no KERPLE, FIRE or
Sandwich (its DynamicPositionBias is a different MLP bias) and only T5's bucketed bias;
transformers and rotary-embedding-torch have none of them.
"""
import math

import pytest
import torch

from posbench.attention import get_backend
from posbench.encodings import ModelDims
from posbench.encodings.fire import FIRE
from posbench.encodings.kerple import inverse_softplus
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled, make_encoding

F64 = 1e-12  # float64 comparisons: this times the largest |expected| (at least 1)


def bias_of(enc, pos, layer: int = 0) -> torch.Tensor:
    """Self-attention bias for positions given as a list (one sequence) or a [B', L] tensor."""
    pos = pos if torch.is_tensor(pos) else torch.tensor(pos)[None]
    return enc.bias(pos, pos, layer).detach()  # [B', H, L, L]


def random_positions(n: int = 9, high: int = 3000, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (2, n), generator=gen)  # [B'=2, L]: one row of ids per sequence


# --- kerple ----------------------------------------------------------------------------------

def set_kerple(enc, r1: list[float], r2: list[float]) -> None:
    """Write raw parameters so that the kernel sees exactly (r1, r2)."""
    r1_t, r2_t = torch.tensor(r1, dtype=torch.float64), torch.tensor(r2, dtype=torch.float64)
    with torch.no_grad():
        enc.raw_r1.copy_(inverse_softplus(r1_t))
        enc.raw_r2.copy_(inverse_softplus(r2_t) if enc.variant == "log" else torch.logit(r2_t / 2))


def test_kerple_log_hand_computed():
    """r1 = (1, 0.5), r2 = (1, 2), positions 0, 1, 2; b = -r1 log(1 + r2 |i - j|):
    head 0: |i-j|=1 -> -log 2 = -0.693147..., |i-j|=2 -> -log 3 = -1.098612...
    head 1: |i-j|=1 -> -0.5 log 3 = -0.549306..., |i-j|=2 -> -0.5 log 5 = -0.804718..."""
    enc = make_encoding("kerple", variant="log").double()
    set_kerple(enc, [1.0, 0.5], [1.0, 2.0])
    d1 = [0.0, -0.6931471805599453, -1.0986122886681098]
    d2 = [0.0, -0.5493061443340549, -0.8047189562170501]
    expected = torch.tensor([[[d1[abs(i - j)] for j in range(3)] for i in range(3)],
                             [[d2[abs(i - j)] for j in range(3)] for i in range(3)]], dtype=torch.float64)
    assert_close_scaled(bias_of(enc, [0, 1, 2])[0], expected, rtol=F64)


def test_kerple_power_hand_computed():
    """r1 = (1, 0.5), r2 = (1, 0.5), positions 0, 1, 2; b = -r1 |i - j|^r2:
    head 0: -|i-j| -> 0, -1, -2;  head 1: -0.5 sqrt|i-j| -> 0, -0.5, -0.5 sqrt 2 = -0.707106..."""
    enc = make_encoding("kerple", variant="power").double()
    set_kerple(enc, [1.0, 0.5], [1.0, 0.5])
    d1 = [0.0, -1.0, -2.0]
    d2 = [0.0, -0.5, -0.7071067811865476]
    expected = torch.tensor([[[d1[abs(i - j)] for j in range(3)] for i in range(3)],
                             [[d2[abs(i - j)] for j in range(3)] for i in range(3)]], dtype=torch.float64)
    assert_close_scaled(bias_of(enc, [0, 1, 2])[0], expected, rtol=F64)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_matches_formula_float64(variant):
    torch.manual_seed(0)
    enc = make_encoding("kerple", variant=variant, n_heads=3).double()
    r1, r2 = (r.tolist() for r in enc.kernel_params())
    pos = random_positions()
    got = bias_of(enc, pos)
    for b in range(2):
        for h in range(3):
            for qi, i in enumerate(pos[b].tolist()):
                for kj, j in enumerate(pos[b].tolist()):
                    d = abs(i - j)
                    want = -r1[h] * (math.log(1 + r2[h] * d) if variant == "log" else d ** r2[h])
                    assert got[b, h, qi, kj].item() == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_parameters_stay_in_range_and_start_as_the_paper(variant):
    enc = make_encoding("kerple", variant=variant, n_heads=64)
    r1, r2 = enc.kernel_params()
    upper1, upper2 = (2.0, 1.0) if variant == "log" else (1.0, 2.0)  # the authors' U(0, upper) draws
    assert (r1 >= 0.01 - 1e-6).all() and (r1 <= upper1 + 1e-6).all()
    assert (r2 >= 0.01 - 1e-6).all() and (r2 <= upper2 + 1e-6).all()
    with torch.no_grad():  # whatever the optimiser does to the raw values, the constraints hold
        enc.raw_r1.fill_(-50.0)
        enc.raw_r2.fill_(50.0)
    r1, r2 = enc.kernel_params()
    assert (r1 > 0).all() and (r2 > 0).all()
    if variant == "power":
        assert (r2 <= 2).all()


def test_kerple_power_gradients_are_finite_on_the_diagonal():
    """0^r2 on the diagonal: the gradient w.r.t. r2 (0^r2 * log 0) must not turn into NaN."""
    enc = make_encoding("kerple", variant="power").double()
    set_kerple(enc, [1.0, 0.7], [0.5, 1.5])
    enc.bias(torch.arange(6)[None], torch.arange(6)[None], 0).sum().backward()
    assert torch.isfinite(enc.raw_r1.grad).all() and torch.isfinite(enc.raw_r2.grad).all()


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_bias_is_shift_invariant(variant):
    torch.manual_seed(0)
    enc = make_encoding("kerple", variant=variant).double()
    pos = torch.arange(10)[None]
    for shift in (1, 37, 1000):
        assert_close_scaled(bias_of(enc, pos + shift), bias_of(enc, pos), rtol=F64)


def test_kerple_rejects_unknown_variant():
    with pytest.raises(ValueError, match=r"variant='bogus'.*choose one of \['log', 'power'\]"):
        make_encoding("kerple", variant="bogus")


# --- fire ------------------------------------------------------------------------------------

def set_fire_mlp(enc) -> None:
    """Width 2, two heads: hidden = (relu(x), relu(-x)) = (x, 0) for x >= 0;
    head 0 = 2 * hidden_0 + 0.5 = 2x + 0.5, head 1 = -hidden_0 = -x."""
    for mlp in enc.mlps:
        first, second = mlp[0], mlp[2]
        with torch.no_grad():
            first.weight.copy_(torch.tensor([[1.0], [-1.0]]))
            first.bias.zero_()
            second.weight.copy_(torch.tensor([[2.0, 0.0], [-1.0, 0.0]]))
            second.bias.copy_(torch.tensor([0.5, 0.0]))


def test_fire_hand_computed():
    """c = 1, L = 2, eps = 1e-6, x(i, j) = log(1 + |i - j|) / (log(1 + max(2, i)) + 1e-6):
    (1, 0): log 2 / (log 3 + 1e-6) = 0.6309291792749692
    (3, 1): log 3 / (log 4 + 1e-6) = 0.7924806787066057
    (i, i): 0
    head 0 = 2x + 0.5, head 1 = -x (set_fire_mlp)."""
    enc = make_encoding("fire", mlp_width=2, init_c=1.0, init_threshold=2.0).double()
    set_fire_mlp(enc)
    bias = bias_of(enc, [0, 1, 2, 3])[0]  # [H, 4, 4]
    for i in range(4):
        assert bias[0, i, i].item() == pytest.approx(0.5, abs=1e-12)
        assert bias[1, i, i].item() == pytest.approx(0.0, abs=1e-12)
    assert bias[0, 1, 0].item() == pytest.approx(2 * 0.6309291792749692 + 0.5, abs=1e-12)
    assert bias[1, 1, 0].item() == pytest.approx(-0.6309291792749692, abs=1e-12)
    assert bias[0, 3, 1].item() == pytest.approx(2 * 0.7924806787066057 + 0.5, abs=1e-12)
    assert bias[1, 3, 1].item() == pytest.approx(-0.7924806787066057, abs=1e-12)


def test_fire_uses_the_position_ids_passed_in():
    """Positions 10..13 (past L = 2): (13, 10) has x = log 4 / (log 14 + 1e-6) = 0.5252988710264676,
    not the 0.99999927... the same offset 3 gets at i = 3: FIRE is not shift invariant."""
    enc = make_encoding("fire", mlp_width=2, init_c=1.0, init_threshold=2.0).double()
    set_fire_mlp(enc)
    shifted = bias_of(enc, [10, 11, 12, 13])[0]
    assert shifted[1, 3, 0].item() == pytest.approx(-0.5252988710264676, abs=1e-12)
    assert bias_of(enc, [0, 1, 2, 3])[0, 1, 3, 0].item() == pytest.approx(-math.log(4) / (math.log(4) + 1e-6),
                                                                         abs=1e-12)
    assert enc.relative is False


def test_fire_matches_formula_float64():
    torch.manual_seed(0)
    enc = make_encoding("fire", n_heads=3, init_threshold=40.0).double()
    with torch.no_grad():
        enc.c[1] = 0.3
        enc.threshold_scale[1] = 1.5  # L = 60 for layer 1
    pos = random_positions(n=7, high=200)
    for layer, (c, threshold) in enumerate([(0.1, 40.0), (0.3, 60.0)]):
        assert enc.c[layer].item() == pytest.approx(c, rel=1e-7)  # float32 start: 0.1 is 0.100000001...
        assert enc.threshold_scale[layer].item() * enc.init_threshold == threshold
        c = enc.c[layer].item()
        mlp = enc.mlps[layer]
        got = bias_of(enc, pos, layer=layer)
        for b in range(2):
            for qi, i in enumerate(pos[b].tolist()):
                for kj, j in enumerate(pos[b].tolist()):
                    x = math.log(c * abs(i - j) + 1) / (math.log(c * max(threshold, i) + 1) + 1e-6)
                    want = mlp(torch.tensor([x], dtype=torch.float64)).detach()  # [H]
                    assert_close_scaled(got[b, :, qi, kj], want, rtol=F64)


def test_fire_is_shift_invariant_only_below_the_threshold():
    torch.manual_seed(0)
    enc = make_encoding("fire", init_threshold=100.0).double()
    pos = torch.arange(12)[None]
    # every query position stays below L = 100: the normaliser is the constant psi(L)
    assert_close_scaled(bias_of(enc, pos + 50), bias_of(enc, pos), rtol=F64)
    assert not torch.allclose(bias_of(enc, pos + 500), bias_of(enc, pos))


def test_fire_layers_are_separate_unless_shared():
    dims = ModelDims(d_model=16, n_heads=2, n_layers=3, max_positions=64, train_positions=64)
    assert len(FIRE(dims).mlps) == 3 and FIRE(dims).c.shape == (3,)
    shared = FIRE(dims, share_layers=True)
    assert len(shared.mlps) == 1
    pos = torch.arange(5)[None]
    torch.testing.assert_close(shared.bias(pos, pos, 0), shared.bias(pos, pos, 2))
    assert FIRE(dims).init_threshold == 16.0  # null: a quarter of the training positions, as 512 of 2048


# --- sandwich --------------------------------------------------------------------------------

def test_sandwich_hand_computed():
    """d' = 2: p_k = (sin k, cos k), p_i . p_j = cos(i - j); H = 2: head h divides by 8h/H = 4h.
    head 1: (cos 1 - 1) / 4 = -0.11492442353296506, (cos 2 - 1) / 4 = -0.3540367091367856
    head 2: (cos 1 - 1) / 8 = -0.05746221176648253, (cos 2 - 1) / 8 = -0.1770183545683928"""
    enc = make_encoding("sandwich", dim=2).double()
    bias = bias_of(enc, [0, 1, 2])[0]
    d1 = [0.0, -0.11492442353296506, -0.3540367091367856]
    d2 = [0.0, -0.05746221176648253, -0.1770183545683928]
    expected = torch.tensor([[[d1[abs(i - j)] for j in range(3)] for i in range(3)],
                             [[d2[abs(i - j)] for j in range(3)] for i in range(3)]], dtype=torch.float64)
    assert_close_scaled(bias, expected, rtol=F64)


def test_sandwich_hand_computed_four_dims():
    """d' = 4: frequencies 10000^0 = 1 and 10000^(-1/2) = 0.01, so p_i . p_j = cos r + cos(0.01 r),
    r = i - j; one head (H = 1): scale 1/8. r = 3: (cos 3 + cos 0.03 - 2) / 8."""
    enc = make_encoding("sandwich", dim=4, n_heads=1).double()
    want = (math.cos(3) + math.cos(0.03) - 2) / 8  # (-0.9899924966 + 0.9995500337 - 2) / 8
    assert want == pytest.approx(-0.2488053079, abs=1e-9)
    assert bias_of(enc, [0, 3])[0, 0, 1, 0].item() == pytest.approx(want, abs=1e-12)


def test_sandwich_matches_formula_float64():
    enc = make_encoding("sandwich", n_heads=4, d_model=64).double()  # d' = head size = 16
    assert enc.dim == 16
    pos = random_positions(n=8, high=5000)
    got = bias_of(enc, pos)
    for b in range(2):
        for h in range(1, 5):
            for qi, i in enumerate(pos[b].tolist()):
                for kj, j in enumerate(pos[b].tolist()):
                    dot = sum(math.cos((i - j) * 10000 ** (-2 * m / 16)) for m in range(8))
                    want = (dot - 8) / (8 * h / 4)
                    assert got[b, h - 1, qi, kj].item() == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("dim", [2, 8, None])
def test_sandwich_bias_is_shift_invariant_zero_on_diagonal_and_nonpositive(dim):
    enc = make_encoding("sandwich", dim=dim).double()
    pos = torch.arange(16)[None]
    base = bias_of(enc, pos)
    for shift in (1, 37, 1000):
        assert_close_scaled(bias_of(enc, pos + shift), base, rtol=1e-9)
    assert_close_scaled(base.diagonal(dim1=-2, dim2=-1), torch.zeros(1, 2, 16, dtype=torch.float64), rtol=F64)
    assert (base <= 1e-12).all()


def test_sandwich_follows_the_model_dtype_and_rejects_odd_dim():
    enc = make_encoding("sandwich")
    assert bias_of(enc, [0, 1]).dtype == torch.float32
    with pytest.raises(ValueError, match="dim=3"):
        make_encoding("sandwich", dim=3)


# --- t5 unbucketed ---------------------------------------------------------------------------

def numbered_table(enc) -> None:
    """Row r, head h holds 10 r + h, so each bias value names the row it came from."""
    rows, heads = enc.table.weight.shape
    with torch.no_grad():
        enc.table.weight.copy_(10 * torch.arange(rows, dtype=torch.float64)[:, None] + torch.arange(heads))


def test_t5_unbucketed_bidirectional_hand_computed():
    """max_distance = 2, bidirectional: rows 0..4 hold i - j = -2..2 (row = clip(i - j, -2, 2) + 2).
    Positions 0..4, query i = 4: keys j = 0..4 have i - j = 4, 3, 2, 1, 0 -> rows 4, 4, 4, 3, 2.
    Query i = 0: i - j = 0, -1, -2, -3, -4 -> rows 2, 1, 0, 0, 0."""
    enc = make_encoding("t5", causal=False, bucketed=False, max_distance=2).double()
    assert enc.table.weight.shape == (5, 2)
    numbered_table(enc)
    bias = bias_of(enc, [0, 1, 2, 3, 4])[0]
    assert bias[0, 4].tolist() == [40, 40, 40, 30, 20]
    assert bias[1, 4].tolist() == [41, 41, 41, 31, 21]
    assert bias[0, 0].tolist() == [20, 10, 0, 0, 0]


def test_t5_unbucketed_causal_hand_computed():
    """max_distance = 2, one-sided: rows 0..2 hold i - j = 0..2 (row = clip(i - j, 0, 2)); keys after
    the query (i - j < 0, masked in a causal model) share row 0. Query i = 3, keys 0..4:
    i - j = 3, 2, 1, 0, -1 -> rows 2, 2, 1, 0, 0."""
    enc = make_encoding("t5", causal=True, bucketed=False, max_distance=2).double()
    assert enc.table.weight.shape == (3, 2)
    numbered_table(enc)
    assert bias_of(enc, [0, 1, 2, 3, 4])[0, 0, 3].tolist() == [20, 20, 10, 0, 0]


@pytest.mark.parametrize("causal", [True, False])
def test_t5_unbucketed_matches_formula_and_never_indexes_past_the_table(causal):
    enc = make_encoding("t5", causal=causal, bucketed=False, max_distance=5).double()
    torch.nn.init.normal_(enc.table.weight)
    pos = random_positions(n=10, high=40)  # offsets up to +-39, far past max_distance
    got = bias_of(enc, pos)
    for b in range(2):
        for qi, i in enumerate(pos[b].tolist()):
            for kj, j in enumerate(pos[b].tolist()):
                row = max(-5, min(5, i - j)) + 5 if not causal else max(0, min(5, i - j))
                assert_close_scaled(got[b, :, qi, kj], enc.table.weight[row].detach(), rtol=F64)


@pytest.mark.parametrize("causal", [True, False])
def test_t5_unbucketed_is_shift_invariant(causal):
    enc = make_encoding("t5", causal=causal, bucketed=False, max_distance=4).double()
    torch.nn.init.normal_(enc.table.weight)
    pos = torch.arange(12)[None]
    for shift in (1, 37, 1000):
        assert_close_scaled(bias_of(enc, pos + shift), bias_of(enc, pos), rtol=F64)


def test_t5_default_stays_bucketed():
    enc = make_encoding("t5")
    assert enc.bucketed and enc.table.weight.shape == (32, 2)
    assert enc.params() == {"num_buckets": 32, "max_distance": 128, "bidirectional": False, "bucketed": True}
    assert make_encoding("t5", bucketed=False).params()["num_buckets"] is None
    with pytest.raises(ValueError, match="max_distance=0"):
        make_encoding("t5", bucketed=False, max_distance=0)


# --- training through the model --------------------------------------------------------------

@pytest.mark.parametrize("name,params", [("kerple", {"variant": "log"}), ("kerple", {"variant": "power"}),
                                         ("fire", {}), ("sandwich", {}), ("t5", {"bucketed": False})])
def test_gradients_reach_the_encoding_and_stay_finite(name, params):
    torch.manual_seed(0)
    enc = make_encoding(name, d_model=16, n_heads=2, **params)
    model = Transformer(ModelConfig(vocab_size=7, d_model=16, n_layers=2, n_heads=2), enc, get_backend("sdpa"))
    ids = torch.randint(0, 7, (2, 12))
    model(ids, torch.arange(12)[None]).logsumexp(-1).mean().backward()
    for n, p in enc.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
