"""Tasks: seeded determinism, lengths honoured, targets checked by an independent solver, exact masks."""
import pytest
import torch

from tasks import REGISTRY
from tasks.base import TransductionTask, batch_metrics, finalize_metrics

SOLVERS = {"copy": lambda xs: list(xs), "reverse": lambda xs: xs[::-1], "sort": sorted}
TRANSDUCTIONS = sorted(n for n, c in REGISTRY.items() if issubclass(c, TransductionTask))


def test_every_transduction_task_has_a_solver():
    assert set(TRANSDUCTIONS) == set(SOLVERS)


@pytest.mark.parametrize("name", TRANSDUCTIONS)
@pytest.mark.parametrize("length", [1, 2, 7, 33])
@pytest.mark.parametrize("bos", [True, False])
def test_sequences_are_exact(name, length, bos):
    task = REGISTRY[name](symbols=10, bos=bos)
    batch = task.sample(16, length, torch.Generator().manual_seed(0))
    assert batch.inputs.shape == batch.targets.shape == batch.loss_mask.shape == (16, task.sequence_length(length))
    start = 1 if bos else 0
    for inputs, targets, mask in zip(batch.inputs.tolist(), batch.targets.tolist(), batch.loss_mask.tolist()):
        if bos:
            assert inputs[0] == task.bos == 11
        x = inputs[start:start + length]
        assert all(0 <= s < 10 for s in x)
        assert inputs[start + length] == task.sep == 10
        assert targets[:-1] == inputs[1:]  # next-token targets
        assert mask == [False] * (start + length) + [True] * length
        scored = [t for t, m in zip(targets, mask) if m]
        assert scored == SOLVERS[name](x)
        assert task.sep not in scored and 11 not in scored


@pytest.mark.parametrize("name", TRANSDUCTIONS)
def test_seeded_determinism(name):
    task = REGISTRY[name]()
    a = task.sample(8, 12, torch.Generator().manual_seed(5))
    b = task.sample(8, 12, torch.Generator().manual_seed(5))
    c = task.sample(8, 12, torch.Generator().manual_seed(6))
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.inputs, c.inputs)


def test_bad_length_is_refused():
    with pytest.raises(ValueError, match="length must be >= 1, got 0"):
        REGISTRY["copy"]().sample(2, 0, torch.Generator())


def test_metrics_on_a_hand_made_batch():
    task = REGISTRY["copy"](symbols=3, bos=False)
    batch = task.sample(2, 2, torch.Generator().manual_seed(0))
    logits = torch.full((2, 4, task.vocab_size), -10.0)
    logits.scatter_(2, batch.targets[..., None], 10.0)  # every prediction right ...
    wrong = (batch.targets[0, 3] + 1) % 3
    logits[0, 3] = -10.0
    logits[0, 3, wrong] = 10.0  # ... except the last scored token of sequence 0
    metrics = finalize_metrics({k: float(v) for k, v in batch_metrics(logits, batch).items()})
    assert metrics["token_acc"] == 0.75
    assert metrics["exact_match"] == 0.5
    assert metrics["loss"] == pytest.approx(20.0 / 4, rel=1e-4)  # one token at ~20 nats, three at ~0
