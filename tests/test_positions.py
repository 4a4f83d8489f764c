"""Position schemes: sorted, distinct, inside [0, L_max), seeded; L_max checked, never clamped."""
import pytest
import torch

from posbench.positions import PositionScheme
from tests.helpers import compose_cfg


def test_sequential_is_arange():
    assert PositionScheme("sequential", 10)(4, torch.Generator()).tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("length", [1, 7, 50])
def test_randomized_positions_are_sorted_distinct_and_in_range(length):
    scheme = PositionScheme("randomized", 64)
    draws = [scheme(length, torch.Generator().manual_seed(seed))[0] for seed in range(20)]
    for pos in draws:
        assert pos.shape == (length,)
        assert torch.all(pos[1:] > pos[:-1])  # sorted and distinct
        assert 0 <= pos.min() and pos.max() < 64
    assert len({tuple(p.tolist()) for p in draws}) > 1  # actually random


def test_randomized_positions_cover_the_range():
    scheme = PositionScheme("randomized", 32)
    seen = torch.cat([scheme(4, torch.Generator().manual_seed(s))[0] for s in range(200)])
    assert set(seen.tolist()) == set(range(32))


def test_randomized_and_offset_are_seeded():
    for name in ("randomized", "offset"):
        scheme = PositionScheme(name, 100)
        first = scheme(10, torch.Generator().manual_seed(3))
        assert torch.equal(first, scheme(10, torch.Generator().manual_seed(3)))


def test_offset_is_a_shifted_arange_inside_the_range():
    scheme = PositionScheme("offset", 20)
    for seed in range(30):
        pos = scheme(8, torch.Generator().manual_seed(seed))[0]
        assert torch.equal(pos - pos[0], torch.arange(8))
        assert 0 <= pos[0] and pos[-1] < 20


def test_full_length_randomized_is_every_position():
    assert PositionScheme("randomized", 6)(6, torch.Generator()).tolist() == [[0, 1, 2, 3, 4, 5]]


def test_too_small_range_is_refused():
    with pytest.raises(ValueError, match=r"max_position=40.*129 tokens.*>= 129"):
        PositionScheme("randomized", 40).check(129)
    with pytest.raises(ValueError, match="choose one of"):
        PositionScheme("shuffled", 40)


def test_runner_checks_the_range_before_training():
    from posbench.build import build

    with pytest.raises(ValueError, match="train.max_position"):
        build(compose_cfg("train.positions=randomized", "train.max_position=100"), torch.device("cpu"))
    built = build(compose_cfg("train.positions=randomized", "train.max_position=1000", "encoding=learned"),
                  torch.device("cpu"))
    assert built.encoding.table.shape[0] == 1000  # every row can be trained
