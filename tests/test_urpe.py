"""URPE: probabilities times a learned Toeplitz c(i - j), on top of a base encoding."""
import math

import pytest
import torch

from posbench.attention import AttentionCall, EagerBackend
from posbench.encodings import REGISTRY
from tests.helpers import make_encoding


def attend(enc, q, k, v, pos, layer=0, causal=True):
    return EagerBackend().attend(q, k, v, AttentionCall(enc, pos, pos, layer, causal))  # [B, H, L, d]


def test_hand_computed_three_positions_one_head():
    """Base nope, q = k = 0 so every causal row of alpha is uniform: row i is 1/(i+1) on j <= i.
    c(0) = 2, c(1) = 3, c(2) = 5 (offset i - j), v_j = j + 1 (d = 1). Then
    z_0 = c(0) v_0 = 2;  z_1 = (c(1) v_0 + c(0) v_1) / 2 = (3 + 4) / 2 = 3.5;
    z_2 = (c(2) v_0 + c(1) v_1 + c(0) v_2) / 3 = (5 + 6 + 6) / 3 = 17/3."""
    enc = make_encoding("urpe", d_model=1, n_heads=1, base="nope", max_distance=2).double()
    with torch.no_grad():
        centre = enc.max_distance
        enc.toeplitz[0, centre:, 0] = torch.tensor([2.0, 3.0, 5.0])
    q = k = torch.zeros(1, 1, 3, 1, dtype=torch.float64)
    v = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).view(1, 1, 3, 1)
    out = attend(enc, q, k, v, torch.arange(3)[None])
    assert out.flatten().tolist() == pytest.approx([2.0, 3.5, 17 / 3], abs=1e-12)


def test_offsets_beyond_max_distance_share_the_edge_entries():
    enc = make_encoding("urpe", n_heads=1, max_distance=2)
    with torch.no_grad():
        enc.toeplitz[0, :, 0] = torch.arange(5.0)  # offsets -2..2 -> 0..4
    pos = torch.arange(6)[None]
    c = enc.modulation(pos, pos, layer=0)[0, 0]  # [L, L]
    expected = (pos[0, :, None] - pos[0, None, :]).clamp(-2, 2) + 2
    assert torch.equal(c, expected.float())


def test_starts_as_its_base():
    torch.manual_seed(0)
    urpe, t5 = make_encoding("urpe"), make_encoding("t5")
    with torch.no_grad():
        t5.table.weight.normal_()
        urpe.parts[0].table.weight.copy_(t5.table.weight)
    q, k, v = (torch.randn(2, 2, 7, 8) for _ in range(3))
    pos = torch.arange(7)[None]
    torch.testing.assert_close(attend(urpe, q, k, v, pos, layer=1), attend(t5, q, k, v, pos, layer=1))


def test_rows_no_longer_sum_to_one_and_layers_differ():
    enc = make_encoding("urpe", n_heads=1, max_distance=4, base="nope")
    with torch.no_grad():
        enc.toeplitz[1].mul_(0.5)
    pos = torch.arange(5)[None]
    p = torch.full((1, 1, 5, 5), 0.2)
    assert enc.prob(p, pos, pos, layer=0).sum(-1).flatten().tolist() == pytest.approx([1.0] * 5)
    assert enc.prob(p, pos, pos, layer=1).sum(-1).flatten().tolist() == pytest.approx([0.5] * 5)
    shared = make_encoding("urpe", shared_layers=True)
    assert shared.toeplitz.shape == (1, 2 * 128 + 1, 2)


def test_toeplitz_and_base_both_learn():
    torch.manual_seed(0)
    enc = make_encoding("urpe", n_heads=2)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    attend(enc, q, k, v, torch.arange(6)[None]).square().sum().backward()
    assert enc.toeplitz.grad.abs().sum() > 0 and enc.parts[0].table.weight.grad.abs().sum() > 0


def test_params_record_base_settings():
    params = make_encoding("urpe", base="t5", base_params={"num_buckets": 16}, max_distance=8).params()
    assert params == {"base": "t5", "max_distance": 8, "shared_layers": False,
                      "t5": {"num_buckets": 16, "max_distance": 128, "bidirectional": False, "bucketed": True}}


@pytest.mark.parametrize("base", ["composite", "urpe"])
def test_refuses_a_composite_base(base):
    with pytest.raises(ValueError, match=f"base={base!r}"):
        make_encoding("urpe", base=base)


def test_unknown_base_names_the_choices():
    with pytest.raises(ValueError, match="unknown part 'rop'.*'rope'"):
        make_encoding("urpe", base="rop")


def test_registered_with_prob_hook():
    assert REGISTRY["urpe"].hooks == {"bias", "prob"}
    assert make_encoding("urpe", base="alibi").relative
    assert not make_encoding("urpe", base="learned").relative
    assert math.isfinite(make_encoding("urpe").logit_scale(8))
