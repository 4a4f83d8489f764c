"""Transformer-XL segment recurrence: a segment read after a memory of the previous one gives
the logits of the two segments read as one sequence (every relative encoding, both backends)."""
import pytest
import torch

from posbench.model import Transformer, recurrence_refusal
from tests.helpers import ENCODING_CASES, assert_close_scaled, make_case, trained_looking_model

RECURRENT = [case for case in ENCODING_CASES  # built instances; 1-D: segments of a stream, grids have none
             if recurrence_refusal(enc := make_case(case)) is None and enc.position_dims == 1]


def model_for(case: str, backend: str = "eager", causal: bool = True) -> Transformer:
    return trained_looking_model(case, backend, causal).eval()


@pytest.mark.parametrize("case", RECURRENT)
def test_second_segment_after_memory_equals_reading_both_at_once(case):
    model = model_for(case)
    ids = torch.randint(0, 11, (2, 14), generator=torch.Generator().manual_seed(1))  # [B, 2 L]
    full = model(ids, torch.arange(14)[None])  # [B, 2L, V]
    first, memory = model.forward_recurrent(ids[:, :7], None, memory_length=7)
    second, _ = model.forward_recurrent(ids[:, 7:], memory, memory_length=7)
    assert_close_scaled(first, full[:, :7], rtol=0, atol_scale=1e-10, name="first segment")
    assert_close_scaled(second, full[:, 7:], rtol=0, atol_scale=1e-10, name="second segment")


@pytest.mark.parametrize("name", ["nope", "alibi", "rope"])
def test_sdpa_aligns_queries_to_the_end_of_the_memory(name):
    eager, sdpa = model_for(name, "eager"), model_for(name, "sdpa")
    ids = torch.randint(0, 11, (2, 10), generator=torch.Generator().manual_seed(2))
    _, memory = eager.forward_recurrent(ids[:, :6], None, memory_length=6)
    expected, _ = eager.forward_recurrent(ids[:, 6:], memory, memory_length=6)
    got, _ = sdpa.forward_recurrent(ids[:, 6:], memory, memory_length=6)
    assert_close_scaled(got, expected, rtol=0, atol_scale=1e-10, name=name)


def test_memory_keeps_the_last_tokens_without_gradient():
    model = model_for("alibi").float()
    ids = torch.randint(0, 11, (1, 5))
    _, memory = model.forward_recurrent(ids, None, memory_length=3)
    _, memory = model.forward_recurrent(ids[:, :2], memory, memory_length=3)
    assert [m.shape for m in memory] == [(1, 3, 32)] * 2 and not any(m.requires_grad for m in memory)
    assert torch.equal(memory[0], model.tok(ids[:, [4, 0, 1]]))  # block 0's inputs: 1 old + 2 new tokens


@pytest.mark.parametrize("case", ["learned", "sinusoidal", "fire", "composite:rope+tener"])
def test_encodings_that_are_not_relative_are_refused(case):
    """Absolute ones, and a composite of relative parts that is not relative (tener's content term reads
    the q and k that rope rotated): positions restart every segment, so only offsets may matter."""
    with pytest.raises(ValueError, match=f"needs a relative encoding.*{case.partition(':')[0]!r} is not one"):
        model_for(case).check_recurrent()


def test_bidirectional_model_is_refused():
    with pytest.raises(ValueError, match="causal"):
        model_for("alibi", causal=False).forward_recurrent(torch.zeros(1, 3, dtype=torch.long), None, 3)
