"""The embed-hook encodings: baselines (index, normalized, binary), hierarchical, complex_order, floater.

Formulas in float64 against values written out by hand; the generic properties (causality,
sdpa vs eager, per-sequence positions) come from tests/test_encodings.py via the registry.
"""
import math

import pytest
import torch

from posbench.attention import get_backend
from posbench.encodings import REGISTRY, ModelDims
from posbench.encodings.baselines import position_bits
from posbench.encodings.floater import rk4_trajectory
from posbench.encodings.hierarchical import hierarchical_rows
from posbench.model import ModelConfig, Transformer
from tests.helpers import assert_close_scaled, make_encoding


def dims(d_model=4, max_positions=8, train_positions=None, vocab_size=11):
    return ModelDims(d_model=d_model, n_heads=1, n_layers=1, max_positions=max_positions,
                     train_positions=train_positions or max_positions, vocab_size=vocab_size)


def zeros_input(length, d_model=4, batch=1):
    return torch.zeros(batch, length, d_model, dtype=torch.float64), torch.zeros(batch, length, dtype=torch.long)


# ---- index / normalized -------------------------------------------------------------------------

def test_index_broadcast_adds_k_to_every_channel():
    enc = REGISTRY["index"](dims(), learned_scale=False)
    x, ids = zeros_input(4)
    x[0, :, 0] = 10.0
    out = enc.embed(x, torch.arange(4)[None], ids)
    assert out[0].tolist() == [[10, 0, 0, 0], [11, 1, 1, 1], [12, 2, 2, 2], [13, 3, 3, 3]]
    assert not list(enc.parameters())


def test_index_learned_scale_is_k_times_w():
    enc = REGISTRY["index"](dims(d_model=3), learned_scale=True).double()
    with torch.no_grad():
        enc.scale.copy_(torch.tensor([0.5, -2.0, 0.0]))
    x, ids = zeros_input(3, d_model=3)
    out = enc.embed(x, torch.tensor([[0, 1, 7]]), ids)
    assert out[0].tolist() == [[0, 0, 0], [0.5, -2, 0], [3.5, -14, 0]]


def test_normalized_is_k_over_n_minus_one_and_spacing_changes_with_n():
    enc = REGISTRY["normalized"](dims(), learned_scale=False)
    for n, expected in ((3, [0, 0.5, 1]), (5, [0, 0.25, 0.5, 0.75, 1])):
        x, ids = zeros_input(n)
        out = enc.embed(x, torch.arange(n)[None], ids)
        assert out[0, :, 2].tolist() == expected
    x, ids = zeros_input(1)
    assert enc.embed(x, torch.zeros(1, 1, dtype=torch.long), ids).tolist() == [[[0, 0, 0, 0]]]  # n = 1: 0


def test_normalized_learned_scale():
    enc = REGISTRY["normalized"](dims(d_model=2)).double()
    with torch.no_grad():
        enc.scale.copy_(torch.tensor([4.0, -1.0]))
    x, ids = zeros_input(5, d_model=2)
    out = enc.embed(x, torch.arange(5)[None], ids)  # k / 4 * w
    assert out[0].tolist() == [[0, 0], [1, -0.25], [2, -0.5], [3, -0.75], [4, -1]]


def test_broadcast_scalar_is_erased_by_pre_layernorm():
    """Why learned_scale defaults to true: a constant vector k*1 vanishes under LayerNorm's mean
    subtraction, so the broadcast index leaves a pre-LN model's output exactly as with nope."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=2)
    ids, pos = torch.randint(0, 11, (2, 9)), torch.arange(9)[None]
    outs = []
    for name, params in (("nope", {}), ("index", {"learned_scale": False})):
        torch.manual_seed(1)
        model = Transformer(cfg, make_encoding(name, **params), get_backend("eager")).double()
        outs.append(model(ids, pos))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-9)


# ---- binary --------------------------------------------------------------------------------------

def test_binary_bits_known_values():
    # 5 = 101b, 6 = 110b: bit 0 first, set -> +1, clear -> -1
    assert position_bits(torch.tensor([0, 5, 6]), 3).tolist() == [[-1, -1, -1], [1, -1, 1], [-1, 1, 1]]


def test_binary_fills_the_first_bits_and_leaves_the_rest():
    enc = REGISTRY["binary"](dims(d_model=5, max_positions=6))  # positions 0..5 need 3 bits
    assert enc.n_bits == 3
    x, ids = zeros_input(6, d_model=5)
    x[..., 4] = 7.0
    out = enc.embed(x, torch.arange(6)[None], ids)
    assert out[0].tolist() == [[-1, -1, -1, 0, 7], [1, -1, -1, 0, 7], [-1, 1, -1, 0, 7],
                               [1, 1, -1, 0, 7], [-1, -1, 1, 0, 7], [1, -1, 1, 0, 7]]


@pytest.mark.parametrize("max_positions,n_bits", [(1, 1), (2, 1), (3, 2), (8, 3), (9, 4), (1024, 10), (1025, 11)])
def test_binary_uses_ceil_log2_bits(max_positions, n_bits):
    assert REGISTRY["binary"](dims(d_model=16, max_positions=max_positions)).n_bits == n_bits


def test_binary_refuses_a_model_too_narrow_and_positions_past_its_bits():
    with pytest.raises(ValueError, match=r"needs 10 channels.*d_model=8"):
        REGISTRY["binary"](dims(d_model=8, max_positions=1000))
    enc = REGISTRY["binary"](dims(max_positions=8))
    x, ids = zeros_input(2)
    with pytest.raises(IndexError, match="positions 0..7"):
        enc.embed(x, torch.tensor([[3, 8]]), ids)


# ---- hierarchical --------------------------------------------------------------------------------

def test_hierarchical_hand_computed_n2():
    """n = 2, D = 2, alpha = 0.4, p[0] = (1, 0), p[1] = (0, 2) (0-indexed rows).

    u[i] = (p[i] - 0.4 p[0]) / 0.6: u[0] = p[0] = (1, 0), u[1] = (-0.4, 2) / 0.6 = (-2/3, 10/3).
    q[k] = 0.4 u[k // 2] + 0.6 u[k % 2]:
      q[0] = 0.4 u0 + 0.6 u0 = (1, 0) = p[0];  q[1] = 0.4 u0 + 0.6 u1 = (0.4 - 0.4, 2) = (0, 2) = p[1]
      q[2] = 0.4 u1 + 0.6 u0 = (-4/15 + 0.6, 4/3) = (1/3, 4/3)
      q[3] = 0.4 u1 + 0.6 u1 = u1 = (-2/3, 10/3)
    """
    table = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    rows = hierarchical_rows(table, torch.arange(4), 0.4)
    expected = torch.tensor([[1, 0], [0, 2], [1 / 3, 4 / 3], [-2 / 3, 10 / 3]], dtype=torch.float64)
    assert_close_scaled(rows, expected, rtol=0, atol_scale=1e-12)


def test_hierarchical_hand_computed_n3():
    """n = 3, D = 2, alpha = 0.4, p[0] = (3, 0), p[1] = (0, 3), p[2] = (3, 3).

    u[0] = (3, 0), u[1] = ((0, 3) - (1.2, 0)) / 0.6 = (-2, 5), u[2] = ((3, 3) - (1.2, 0)) / 0.6 = (3, 5).
    q[5] (a = 1, b = 2) = 0.4 (-2, 5) + 0.6 (3, 5) = (1, 5);  q[7] (a = 2, b = 1) = 0.4 (3, 5) + 0.6 (-2, 5) = (0, 5)
    q[8] (a = b = 2) = u[2] = (3, 5);  q[3] (a = 1, b = 0) = 0.4 (-2, 5) + 0.6 (3, 0) = (1, 2).
    """
    table = torch.tensor([[3.0, 0.0], [0.0, 3.0], [3.0, 3.0]], dtype=torch.float64)
    rows = hierarchical_rows(table, torch.tensor([3, 5, 7, 8]), 0.4)
    assert_close_scaled(rows, torch.tensor([[1.0, 2], [1, 5], [0, 5], [3, 5]], dtype=torch.float64), rtol=0,
                        atol_scale=1e-12)


def test_hierarchical_reproduces_the_learned_rows_exactly_and_follows_the_formula_beyond():
    torch.manual_seed(0)
    enc = REGISTRY["hierarchical"](dims(d_model=6, max_positions=49, train_positions=7), alpha=0.3).double()
    x, ids = zeros_input(49, d_model=6)
    out = enc.embed(x, torch.arange(49)[None], ids)[0]  # [49, 6]
    p = enc.table.detach()
    assert torch.equal(out[:7], p)  # bit-exact on the trained rows
    u = (p - 0.3 * p[0]) / 0.7
    for k in range(49):
        assert_close_scaled(out[k], 0.3 * u[k // 7] + 0.7 * u[k % 7], rtol=0, atol_scale=1e-12, name=f"row {k}")
    assert len({tuple(row.tolist()) for row in out}) == 49  # alpha != 0.5: all n^2 positions distinct


def test_hierarchical_trains_only_n_rows_and_gradients_reach_them_from_extended_positions():
    enc = REGISTRY["hierarchical"](dims(max_positions=20, train_positions=5))
    assert enc.table.shape == (5, 4)
    x, ids = torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long)
    enc.embed(x, torch.tensor([[13]]), ids).sum().backward()  # 13 = 2 * 5 + 3: rows 0, 2, 3
    assert enc.table.grad.abs().sum(dim=1).nonzero().flatten().tolist() == [0, 2, 3]


@pytest.mark.parametrize("alpha", [0.5, 0.0, 1.0, -0.2, 1.5])
def test_hierarchical_rejects_bad_alpha(alpha):
    with pytest.raises(ValueError, match=rf"alpha={alpha}.*0 < alpha < 1 and alpha != 0.5"):
        REGISTRY["hierarchical"](dims(), alpha=alpha)


def test_hierarchical_refuses_positions_past_n_squared():
    with pytest.raises(ValueError, match=r"4 trained rows covers 16 positions.*up to 16"):
        REGISTRY["hierarchical"](dims(max_positions=17, train_positions=4))
    enc = REGISTRY["hierarchical"](dims(max_positions=16, train_positions=4))
    x, ids = zeros_input(1)
    with pytest.raises(IndexError, match=r"positions 0..15"):
        enc.embed(x.float(), torch.tensor([[16]]), ids)


# ---- complex_order -------------------------------------------------------------------------------

def test_complex_order_hand_computed():
    """One word w = 2 with r = 2, omega = pi/2, theta = pi/6 (D = 2: one complex channel).

    k = 0: 2 exp(i pi/6) = (2 cos(pi/6), 2 sin(pi/6)) = (sqrt(3), 1)
    k = 1: 2 exp(i (pi/6 + pi/2)) = 2 exp(i 2pi/3) = (-1, sqrt(3))
    """
    enc = REGISTRY["complex_order"](dims(d_model=2, vocab_size=3)).double()
    with torch.no_grad():
        enc.amplitude[2], enc.frequency[2], enc.phase[2] = 2.0, math.pi / 2, math.pi / 6
    x = torch.full((1, 2, 2), 100.0, dtype=torch.float64)  # replaced, not added to
    out = enc.embed(x, torch.tensor([[0, 1]]), torch.tensor([[2, 2]]))
    assert_close_scaled(out[0], torch.tensor([[math.sqrt(3), 1], [-1, math.sqrt(3)]], dtype=torch.float64), rtol=0.0,
                        atol_scale=1e-12, name="embedding")


def test_complex_order_real_then_imaginary_halves_float64():
    torch.manual_seed(0)
    enc = REGISTRY["complex_order"](dims(d_model=6, vocab_size=5)).double()
    for p in enc.parameters():
        torch.nn.init.normal_(p)
    ids, pos = torch.tensor([[4, 0, 4], [1, 1, 3]]), torch.tensor([[0, 5, 9]])
    out = enc.embed(torch.zeros(2, 3, 6, dtype=torch.float64), pos, ids)
    z = enc.amplitude[ids] * torch.exp(1j * (enc.phase[ids] + enc.frequency[ids] * pos[..., None]))  # complex128
    assert_close_scaled(out, torch.cat((z.real, z.imag), dim=-1).detach(), rtol=0.0, atol_scale=1e-12,
                        name="real and imaginary halves")


def test_complex_order_needs_an_even_model_size():
    with pytest.raises(ValueError, match="even model size.*d_model=5"):
        REGISTRY["complex_order"](dims(d_model=5))


# ---- floater -------------------------------------------------------------------------------------

def test_rk4_decay_matches_exp():
    y0 = torch.tensor([1.0, -3.0], dtype=torch.float64)
    path = rk4_trajectory(lambda t, y: -y, y0, 0.1, 20)  # dy/dt = -y on t = 0..2
    t = torch.arange(21, dtype=torch.float64)[:, None] * 0.1
    # y_n = y0 R(h)^n: a relative error of about t h^4 / 120, 1.8e-6 at t = 2, whatever y0
    assert_close_scaled(path, y0 * torch.exp(-t), rtol=2e-6, atol_scale=0, name="path")
    assert torch.equal(path[0], y0)


def test_rk4_is_exact_for_a_cubic_in_time_and_records_every_substep_block():
    # dy/dt = t^3: RK4 is Simpson's rule here, exact, so y(t) = t^4 / 4 at every recorded time
    path = rk4_trajectory(lambda t, y: torch.full_like(y, t ** 3), torch.zeros(1, dtype=torch.float64), 0.25, 12, 4)
    assert path.shape == (4, 1)
    assert_close_scaled(path[:, 0], torch.tensor([0.0, 0.25, 4.0, 81 / 4], dtype=torch.float64), rtol=0,
                        atol_scale=1e-12)  # grows as t^4


def test_floater_constant_velocity_is_linear_in_position():
    """h's output layer set to W2 = 0, b2 = c: dp/dt = c, so p(k delta) = p(0) + c k delta exactly."""
    enc = REGISTRY["floater"](dims(d_model=3, max_positions=10), delta=0.5, substeps=2).double()
    c = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    with torch.no_grad():
        enc.dynamics.out.weight.zero_()
        enc.dynamics.out.bias.copy_(c)
        enc.initial.copy_(torch.tensor([0.1, 0.2, 0.3]))
    x, ids = zeros_input(3, d_model=3)
    out = enc.embed(x, torch.tensor([[0, 3, 9]]), ids)[0]
    expected = torch.stack([enc.initial.detach() + c * k * 0.5 for k in (0, 3, 9)])
    assert_close_scaled(out, expected, rtol=0, atol_scale=1e-12)  # grows with the position
    assert torch.equal(out[0], enc.initial.detach())  # p(t_0) = p0


def test_floater_matches_its_own_rk4_and_gathers_per_sequence():
    torch.manual_seed(0)
    enc = REGISTRY["floater"](dims(d_model=4, max_positions=30), substeps=3).double()
    path = rk4_trajectory(enc.dynamics, enc.initial, 0.1 / 3, 3 * 12, 3)  # [13, 4]
    pos = torch.tensor([[0, 4, 12], [2, 3, 5]])
    out = enc.embed(torch.zeros(2, 3, 4, dtype=torch.float64), pos, torch.zeros(2, 3, dtype=torch.long))
    torch.testing.assert_close(out, path[pos], rtol=0, atol=0)


def test_floater_zero_initial_and_gradients_through_the_solver():
    enc = REGISTRY["floater"](dims(), learn_initial=False)
    x, ids = torch.zeros(1, 5, 4), torch.zeros(1, 5, dtype=torch.long)
    out = enc.embed(x, torch.arange(5)[None], ids)
    assert out[0, 0].tolist() == [0, 0, 0, 0]
    out.square().sum().backward()
    for name, p in enc.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_floater_eval_cache_follows_parameter_updates():
    enc = REGISTRY["floater"](dims())
    x, ids, pos = torch.zeros(1, 6, 4), torch.zeros(1, 6, dtype=torch.long), torch.arange(6)[None]
    with torch.no_grad():
        first = enc.embed(x, pos, ids)
        torch.testing.assert_close(enc.embed(x[:, :3], pos[:, :3], ids[:, :3]), first[:, :3], rtol=0, atol=0)
        enc.dynamics.out.bias.add_(1.0)  # an optimiser step: must not reuse the old trajectory
        second = enc.embed(x, pos, ids)
    torch.testing.assert_close(second, enc.embed(x, pos, ids).detach(), rtol=0, atol=0)
    assert not torch.allclose(first, second)


@pytest.mark.parametrize("params,message", [({"delta": 0}, "delta=0"), ({"substeps": 0}, "substeps=0")])
def test_floater_rejects_bad_settings(params, message):
    with pytest.raises(ValueError, match=message):
        REGISTRY["floater"](dims(), **params)


def test_learned_policy_hierarchical_equals_the_hierarchical_encoding():
    """The trained rows of a learned table, extended by Su's decomposition at evaluation time."""
    learned = REGISTRY["learned"](dims(d_model=6, max_positions=30, train_positions=6), policy="hierarchical",
                                  alpha=0.3).double()
    hier = REGISTRY["hierarchical"](dims(d_model=6, max_positions=30, train_positions=6), alpha=0.3).double()
    with torch.no_grad():
        hier.table.copy_(learned.table[:6])
    x, pos = torch.zeros(1, 30, 6, dtype=torch.float64), torch.arange(30)[None]
    out = learned.embed(x, pos, torch.zeros(1, 30, dtype=torch.long))
    torch.testing.assert_close(out, hier.embed(x, pos, torch.zeros(1, 30, dtype=torch.long)), rtol=0, atol=0)
    torch.testing.assert_close(out[0, :6], learned.table[:6], rtol=0, atol=0)
    assert learned.params()["alpha"] == 0.3 and "alpha" not in REGISTRY["learned"](dims()).params()


def test_learned_policy_hierarchical_refuses_past_n_squared_and_bad_alpha():
    with pytest.raises(ValueError, match=r"policy=hierarchical.*4 trained rows covers 16 positions"):
        REGISTRY["learned"](dims(max_positions=17, train_positions=4), policy="hierarchical")
    with pytest.raises(ValueError, match="alpha=0.5 is not valid"):
        REGISTRY["learned"](dims(), policy="hierarchical", alpha=0.5)
