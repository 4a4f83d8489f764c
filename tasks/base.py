"""The task interface: a seeded generator of batches at a given length, plus metrics.

`length` is the task's own length (for the synthetic transductions, the number of input
symbols); `sequence_length(length)` is the number of tokens the model actually sees.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, T] token ids fed to the model
    targets: torch.Tensor  # [B, T] next-token ids
    loss_mask: torch.Tensor  # [B, T] bool, True where the prediction is scored


class Task:
    """Subclasses implement `sequence_length` and `sample`; evaluation may override
    `eval_batches` (e.g. windows over a fixed corpus), `batch_sums` and `finalize`."""

    name: str = ""
    vocab_size: int = 0
    default_length: int = 16

    def params(self) -> dict:
        return {}

    def sequence_length(self, length: int) -> int:
        raise NotImplementedError

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def eval_batches(self, length: int, samples: int, batch_size: int,
                     generator: torch.Generator) -> Iterator[Batch]:
        """The evaluation set at one length: `samples` fresh sequences by default."""
        done = 0
        while done < samples:
            size = min(batch_size, samples - done)
            yield self.sample(size, length, generator)
            done += size

    def batch_sums(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return batch_metrics(logits, batch)

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        return finalize_metrics(sums)

    def write_figures(self, rows: list[dict], run_dir: Path) -> list[Path]:
        """Task-specific figures beside the run's curve.png; returns the files written."""
        return []


class TransductionTask(Task):
    """Read n symbols, a separator, then write f(symbols): `[BOS] x_1..x_n SEP y_1..y_n`.

    The model sees `[BOS] x SEP y_1..y_{n-1}` (2n tokens, 2n + 1 with BOS) and is scored on
    predicting y_1..y_n. BOS gives every encoding, NoPE included, a fixed anchor to count from.
    """

    def __init__(self, symbols: int = 10, default_length: int = 16, bos: bool = True):
        if symbols < 2:
            raise ValueError(f"task.symbols={symbols}: need at least 2 symbols")
        self.symbols = int(symbols)
        self.sep = self.symbols  # ids: symbols 0..S-1, then SEP, then BOS
        self.bos = self.symbols + 1 if bos else None
        self.vocab_size = self.symbols + 2
        self.default_length = int(default_length)

    def params(self) -> dict:
        return {"symbols": self.symbols, "bos": self.bos is not None}

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, n] -> the expected output [B, n]."""
        raise NotImplementedError

    def sequence_length(self, length: int) -> int:
        return 2 * length + (self.bos is not None)

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        if length < 1:
            raise ValueError(f"{self.name}: length must be >= 1, got {length}")
        device = generator.device
        x = torch.randint(0, self.symbols, (batch_size, length), generator=generator, device=device)  # [B, n]
        sep = torch.full((batch_size, 1), self.sep, dtype=torch.long, device=device)  # [B, 1]
        parts = (x, sep, self.transform(x))
        if self.bos is not None:
            parts = (torch.full((batch_size, 1), self.bos, dtype=torch.long, device=device), *parts)
        seq = torch.cat(parts, dim=1)  # [B, T + 1]
        loss_mask = torch.zeros(batch_size, seq.shape[1] - 1, dtype=torch.bool, device=device)  # [B, T]
        loss_mask[:, -length:] = True
        return Batch(inputs=seq[:, :-1], targets=seq[:, 1:], loss_mask=loss_mask)


def batch_metrics(logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
    """Sums over the batch (so batches can be accumulated): loss, correct tokens, scored
    tokens, exactly-matched sequences, sequences. logits: [B, T, V]."""
    mask = batch.loss_mask
    token_loss = F.cross_entropy(logits.transpose(1, 2).float(), batch.targets, reduction="none")  # [B, T]
    correct = (logits.argmax(-1) == batch.targets) & mask  # [B, T]
    return {
        "loss_sum": (token_loss * mask).sum(),
        "correct": correct.sum(),
        "tokens": mask.sum(),
        "exact": (correct.sum(1) == mask.sum(1)).sum(),
        "sequences": torch.tensor(mask.shape[0]),
    }


def finalize_metrics(sums: dict[str, float]) -> dict[str, float]:
    return {
        "loss": sums["loss_sum"] / sums["tokens"],
        "token_acc": sums["correct"] / sums["tokens"],
        "exact_match": sums["exact"] / sums["sequences"],
    }
