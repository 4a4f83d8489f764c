"""Transformer-XL segment recurrence: a segment read after a memory of the previous one gives
the logits of the two segments read as one sequence (every relative encoding, both backends)."""
import pytest
import torch

from posbench.attention import get_backend
from posbench.encodings import REGISTRY
from posbench.model import ModelConfig, Transformer
from tests.conftest import make_encoding

RECURRENT = sorted(name for name, cls in REGISTRY.items()  # 1-D: segments of a stream; grids have none
                   if "embed" not in cls.hooks and (cls.relative or not cls.hooks) and cls.position_dims == 1)


def model_for(name: str, backend: str = "eager", causal: bool = True) -> Transformer:
    torch.manual_seed(0)
    enc = make_encoding(name, causal=causal, d_model=32, n_heads=4, max_positions=64)
    for p in enc.parameters():  # trained-looking values, not the zero / one initialisations
        torch.nn.init.normal_(p, std=0.3)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=4, causal=causal)
    return Transformer(cfg, enc, get_backend(backend, enc)).double().eval()


@pytest.mark.parametrize("name", RECURRENT)
def test_second_segment_after_memory_equals_reading_both_at_once(name):
    model = model_for(name)
    ids = torch.randint(0, 11, (2, 14), generator=torch.Generator().manual_seed(1))  # [B, 2 L]
    full = model(ids, torch.arange(14)[None])  # [B, 2L, V]
    first, memory = model.forward_recurrent(ids[:, :7], None, memory_length=7)
    second, _ = model.forward_recurrent(ids[:, 7:], memory, memory_length=7)
    torch.testing.assert_close(first, full[:, :7], rtol=0, atol=1e-10)
    torch.testing.assert_close(second, full[:, 7:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", ["nope", "alibi", "rope"])
def test_sdpa_aligns_queries_to_the_end_of_the_memory(name):
    eager, sdpa = model_for(name, "eager"), model_for(name, "sdpa")
    ids = torch.randint(0, 11, (2, 10), generator=torch.Generator().manual_seed(2))
    _, memory = eager.forward_recurrent(ids[:, :6], None, memory_length=6)
    expected, _ = eager.forward_recurrent(ids[:, 6:], memory, memory_length=6)
    got, _ = sdpa.forward_recurrent(ids[:, 6:], memory, memory_length=6)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_memory_keeps_the_last_tokens_without_gradient():
    model = model_for("alibi").float()
    ids = torch.randint(0, 11, (1, 5))
    _, memory = model.forward_recurrent(ids, None, memory_length=3)
    _, memory = model.forward_recurrent(ids[:, :2], memory, memory_length=3)
    assert [m.shape for m in memory] == [(1, 3, 32)] * 2 and not any(m.requires_grad for m in memory)
    assert torch.equal(memory[0], model.tok(ids[:, [4, 0, 1]]))  # block 0's inputs: 1 old + 2 new tokens


@pytest.mark.parametrize("name, message", [("learned", "relative encoding"), ("sinusoidal", "relative encoding")])
def test_absolute_encodings_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        model_for(name).forward_recurrent(torch.zeros(1, 3, dtype=torch.long), None, memory_length=3)


def test_bidirectional_model_is_refused():
    with pytest.raises(ValueError, match="causal"):
        model_for("alibi", causal=False).forward_recurrent(torch.zeros(1, 3, dtype=torch.long), None, 3)
