"""The task interface: a seeded generator of batches at a given length, plus metrics.

`length` is the task's own length (for the synthetic tasks, as their source paper counts it:
input symbols, digits per operand, actions, ...); `sequence_length(length)` is the number of
tokens the model actually sees. `SequenceTask` lays out an input/answer pair for a decoder
(causal) or an encoder (causal=False); `TransductionTask` is the n-symbols-in, n-out case.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from posbench.metrics import ACCURACY


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, T] token ids fed to the model
    targets: torch.Tensor  # [B, T] next-token ids
    loss_mask: torch.Tensor  # [B, T] bool, True where the prediction is scored
    grid: tuple[int, int] | None = None  # (H, W) when the T = H * W tokens are a grid's cells in raster order
    memory_length: int = 0  # segment recurrence: tokens of memory the model carries into this segment
    new_stream: bool = False  # segment recurrence: the first segment of a stream, read with no memory


class Task:
    """Subclasses implement `sequence_length` and `sample`; evaluation may override
    `eval_batches` (e.g. windows over a fixed corpus), `batch_sums` and `finalize`.

    What the runner reads from a task (its contract): `causal` (the layout it lays out, which
    must match model.causal), `position_dims` (the positions it hands the model), `memory`
    (segment recurrence in evaluation: the model must then be relative, checked before
    training), `vocab_size`, `default_length`, `metrics` (what `finalize` measures, declared in
    posbench.metrics), `params()` and the methods below."""

    name: str = ""
    vocab_size: int = 0
    default_length: int = 16
    causal: bool = True  # True: a decoder layout (scored on next tokens); False: an encoder layout
    position_dims: int = 1  # the positions handed to the model: 1 ids [1, T]; 2 (row, column) [1, T, 2] (grids)
    memory: int = 0  # tokens of segment-recurrence memory its evaluation batches carry (0: none)
    metrics: tuple[str, ...] = ACCURACY  # the metrics `finalize` measures: names declared in posbench.metrics
    # what the memory guard (posbench.guard) charges a drawn batch: bytes a token (the batch, int64 inputs,
    # targets and mask, with its generation's temporaries: 14-55 measured for most tasks), and the setting
    # naming an alphabet every sequence draws a permutation of, whatever its length (None: no such draw)
    data_bytes_per_token: float = 96.0
    alphabet_setting: str | None = None

    def params(self) -> dict:
        return {}

    def sequence_length(self, length: int) -> int:
        raise NotImplementedError

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def train_sample(self, batch_size: int, length: int, train_length: int, generator: torch.Generator) -> Batch:
        """One training batch at the drawn length (train.lengths), N = train_length; grid tasks draw
        their width here. Default: `sample` at that length."""
        return self.sample(batch_size, length, generator)

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


class SequenceTask(Task):
    """A task that maps an input x [B, n'] to an answer y [B, m]; this class lays the pair out.

    Ids: 0..alphabet-1 are the task's own tokens (symbols, digits, operators, labels), then EOS
    (with eos only), SEP, BOS and, in the encoder layout only, QUERY. Subclasses give
    `input_length` (n'), `output_length` (m) and `generate` (batched tensor ops on the generator's
    device). With eos, the answer is y followed by EOS: m + 1 tokens, written y' below (y' = y
    without eos). With b = 1 when there is a BOS token, else 0, the two layouts are:

    - causal (a decoder): the sequence `[BOS] x SEP y'`; the model sees all but its last token
      (T = b + n' + |y'|) and is scored on predicting every token of y' (teacher forcing).
    - encoder (causal=False, as Deletang et al. 2022 run their tasks): a non-causal model reads
      `[BOS] x SEP QUERY*|y'|` (T = b + n' + 1 + |y'|) and predicts y' at the QUERY positions in
      one pass; no answer token is in the inputs. Targets elsewhere repeat the inputs, never scored.

    In both the answer is scored at the last |y'| positions. An answer shorter than its fixed width
    m (e.g. a final stack ended by an END token, then padded) marks the positions that count in
    `scored`; EOS always counts. BOS gives every encoding, NoPE included, a fixed anchor to count
    from. EOS makes the model say where the answer ends: teacher-forced exact match (every scored
    argmax right) is then greedy generation's exact match (generate y, then EOS, stop).
    """

    options: tuple[str, ...] = ()  # the subclass's constructor options, recorded by params()

    def __init__(self, alphabet: int, default_length: int = 16, bos: bool = True, causal: bool = True,
                 eos: bool = False):
        self.alphabet = int(alphabet)
        self.eos = bool(eos)  # the option (params() records it where a task lists it in `options`)
        self.eos_id = self.alphabet if self.eos else None
        self.sep = self.alphabet + self.eos
        self.bos = self.sep + 1 if bos else None
        self.causal = bool(causal)
        self.query = None if self.causal else self.sep + 2
        self.vocab_size = self.sep + (2 if self.causal else 3)
        self.default_length = int(default_length)

    def params(self) -> dict:
        return {**{key: getattr(self, key) for key in self.options}, "bos": self.bos is not None,
                "causal": self.causal}

    def check_length(self, length: int) -> None:
        if length < 1:
            raise ValueError(f"{self.name}: length must be >= 1, got {length}")

    def input_length(self, length: int) -> int:
        """n': tokens of x at this task length."""
        raise NotImplementedError

    def output_length(self, length: int) -> int:
        """m: tokens of y at this task length (a fixed width, so batches are rectangular)."""
        raise NotImplementedError

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x [B, n'], y [B, m]), ids in 0..alphabet-1, on the generator's device."""
        raise NotImplementedError

    def scored(self, y: torch.Tensor) -> torch.Tensor:
        """y: [B, m] -> [B, m] bool, the answer positions that count (all by default)."""
        return torch.ones_like(y, dtype=torch.bool)

    def sequence_length(self, length: int) -> int:
        self.check_length(length)
        # |y'| answer tokens; the encoder's inputs drop no last token, so one more
        answer = self.output_length(length) + self.eos + (0 if self.causal else 1)
        return (self.bos is not None) + self.input_length(length) + answer

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        self.check_length(length)
        x, y = self.generate(batch_size, length, generator)  # [B, n'], [B, m]
        scored = self.scored(y)  # [B, m]
        if self.eos:  # y' = y EOS: where the answer ends is scored too
            y = torch.cat([y, filled(self.eos_id, y, 1)], dim=1)  # [B, m + 1]
            scored = F.pad(scored, (0, 1), value=True)  # [B, m + 1]
        m = y.shape[1]  # |y'|
        parts = [filled(self.bos, x, 1)] if self.bos is not None else []
        parts += [x, filled(self.sep, x, 1)]
        if self.causal:
            seq = torch.cat(parts + [y], dim=1)  # [B, T + 1]
            inputs, targets = seq[:, :-1], seq[:, 1:]  # [B, T]
        else:
            inputs = torch.cat(parts + [filled(self.query, x, m)], dim=1)  # [B, T]
            targets = inputs.clone()
            targets[:, -m:] = y
        loss_mask = torch.zeros_like(inputs, dtype=torch.bool)  # [B, T]
        loss_mask[:, -m:] = scored
        return Batch(inputs=inputs, targets=targets, loss_mask=loss_mask)


def filled(token: int, like: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] of one token, B and device from `like`."""
    return torch.full((like.shape[0], width), token, dtype=torch.long, device=like.device)


def uniform_ids(generator: torch.Generator, high: int, *shape: int) -> torch.Tensor:
    """Ids drawn uniformly from 0..high-1, on the generator's device."""
    return torch.randint(0, high, shape, generator=generator, device=generator.device)


class TransductionTask(SequenceTask):
    """Read n uniform random symbols, then write f(symbols), n of them: `x_1..x_n SEP y_1..y_n`.

    Length = n, the number of input symbols. Causal: the model sees `[BOS] x SEP y_1..y_{n-1}`
    (2n tokens, 2n + 1 with BOS) and is scored on predicting y_1..y_n; with eos it sees y_n too and
    is scored on the EOS after it as well.
    """

    options = ("symbols",)

    def __init__(self, symbols: int = 10, default_length: int = 16, bos: bool = True, causal: bool = True,
                 eos: bool = False):
        if symbols < 2:
            raise ValueError(f"task.symbols={symbols}: need at least 2 symbols")
        super().__init__(symbols, default_length, bos, causal, eos)
        self.symbols = int(symbols)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, n] -> the expected output [B, n]."""
        raise NotImplementedError

    def input_length(self, length: int) -> int:
        return length

    def output_length(self, length: int) -> int:
        return length

    def generate(self, batch_size: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = uniform_ids(generator, self.symbols, batch_size, length)  # [B, n]
        return x, self.transform(x)


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
