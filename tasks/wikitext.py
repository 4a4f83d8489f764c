"""WikiText language modelling: train a causal LM at context N, evaluate at contexts N..kN.

Length = the context: the model reads L tokens and predicts each next one.
- Training: random windows of L + 1 tokens from the training split (one seeded draw of
  start offsets per batch); inputs = window[:-1], targets = window[1:], every target scored.
- Evaluation over the first `eval_tokens` targets of `eval_split` (the same tokens at every
  length), two protocols in one pass, each scoring every token of that range exactly once:
  * non-overlapping windows of L tokens (`loss`, `perplexity`, `bits_per_byte`, `token_acc`,
    and `loss_by_position`: the loss binned by the token's position in its window);
  * sliding windows of L tokens moved by `stride`: the first window scores all its tokens,
    each later one only its last `stride` (the tokens no earlier window scored), so most
    tokens are predicted from at least L - stride tokens of context (the sliding-window
    evaluation of Press et al. 2022, ALiBi) -> the same metrics prefixed `sliding_`.
  A range that is not a multiple of the window ends with one window aligned to its end whose
  already-scored tokens are masked out.
  * with `memory` > 0, a third protocol, Transformer-XL segment recurrence (Dai et al. 2019):
    consecutive segments of L tokens, each block attending also to its own inputs over the
    previous `memory` tokens (no gradient), one stream from the start of the range; every
    token scored once -> metrics prefixed `recurrent_`. Needs a relative encoding.
- perplexity = exp(mean loss over tokens); bits per byte = total loss / (ln 2 x bytes of the
  scored text): the loss / ln 2 for the byte tokenizer, the words' and newlines' bytes for
  the word tokenizer (see tasks.text_data), so the two tokenizers are comparable.

Data and tokenisation live in tasks.text_data.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from posbench.checks import Choice, Flag, Integer
from posbench.metrics import LANGUAGE_MODEL
from tasks.base import Batch, Task, batch_metrics
from tasks.text_data import SPLITS, Corpus, TokenIds

PROTOCOLS = {"non_overlapping": "", "sliding": "sliding_", "recurrent": "recurrent_"}  # -> prefix of its metrics


@dataclass
class WindowBatch(Batch):
    """Evaluation windows over the token stream, tagged with their protocol."""

    protocol: str = "non_overlapping"
    stream_index: torch.Tensor | None = None  # [B, T] index in the stream of each target token
    byte_counts: torch.Tensor | None = None  # [B, T] bytes of text per target; None: one byte each


def window_plan(targets: int, length: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of `length` targets over targets 0..targets-1 moved by `stride`, each scoring only
    the targets no earlier window scored. -> (first target of each window [W], targets it scores [W]).
    stride = length is the non-overlapping protocol."""
    ends = torch.arange(length, targets + 1, stride)  # [W] one past each window's last target
    if ends[-1] != targets:  # the last window is aligned to the end of the range
        ends = torch.cat([ends, torch.tensor([targets])])  # [W]
    fresh = torch.diff(ends, prepend=torch.tensor([0]))  # [W]
    return ends - length, fresh


def position_bins(length: int, bins: int) -> torch.Tensor:
    """The bin of each position of a window: [length] in 0..min(bins, length)-1."""
    return torch.arange(length) * min(bins, length) // length  # [L]


class WikiText(Task):
    name = "wikitext"
    metrics = LANGUAGE_MODEL  # loss, perplexity, bits per byte, token accuracy per protocol (exact_match: None)

    def __init__(self, dataset: str = "wikitext-2-v1", data_dir: str | None = None, tokenizer: str = "byte",
                 default_length: int = 64, eval_split: str = "validation", eval_tokens: int | None = 32768,
                 stride: int | None = None, train_tokens: int | None = None, position_bins: int = 16,
                 cache_dir: str | None = "~/.cache/posbench", memory: int = 0, causal: bool = True):
        if not Flag()("task.causal", causal, self.name):
            raise ValueError(f"task={self.name}: causal={causal} is not possible; language modelling predicts each "
                             "next token, so it needs a causal decoder (model.causal=true)")
        Choice(SPLITS[1:])("task.eval_split", eval_split, self.name)
        self.memory = Integer(0)("task.memory", memory, self.name)  # segment-recurrence tokens; 0: off
        self.eval_tokens = Integer(1, null="the whole split")("task.eval_tokens", eval_tokens, self.name)
        self.stride = Integer(1, null="L // 4")("task.stride", stride, self.name)
        self.train_tokens = Integer(1, null="the whole split")("task.train_tokens", train_tokens, self.name)
        self.position_bins = Integer(1)("task.position_bins", position_bins, self.name)
        self.default_length = Integer(1)("task.default_length", default_length, self.name)
        self.corpus = Corpus(dataset, data_dir, tokenizer, cache_dir)
        self.eval_split = eval_split
        # The byte vocabulary is fixed, so building a byte model reads no data; words need the training split.
        self.vocab_size = self.corpus.tokenizer.vocab_size
        self._streams: dict[tuple[str, str], TokenIds] = {}  # (split, device) -> the split's tokens there

    def params(self) -> dict:
        return {"dataset": self.corpus.dataset, "tokenizer": self.corpus.tokenizer_name,
                "data_dir": str(self.corpus.data_dir) if self.corpus.data_dir else None,
                "eval_split": self.eval_split, "eval_tokens": self.eval_tokens, "stride": self.stride,
                "train_tokens": self.train_tokens, "position_bins": self.position_bins,
                "memory": self.memory, "vocab_size": self.vocab_size}

    def sequence_length(self, length: int) -> int:
        return length

    def stride_for(self, length: int) -> int:
        """The sliding stride at window length L: task.stride (at most L), or L // 4 when null."""
        return max(1, length // 4) if self.stride is None else min(self.stride, length)

    def _stream(self, split: str, device: torch.device) -> TokenIds:
        """The split's tokens on `device`, cut to train_tokens / eval_tokens + 1 (loaded once)."""
        key = (split, str(device))
        if key not in self._streams:
            tokens = self.corpus.token_ids(split)
            if split == "train":
                keep = self.train_tokens
            else:  # eval_tokens targets need one token more
                keep = None if self.eval_tokens is None else self.eval_tokens + 1
            counts = tokens.byte_counts
            self._streams[key] = TokenIds(tokens.ids[:keep].to(device),
                                          None if counts is None else counts[:keep].to(device))
        return self._streams[key]

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        if length < 1:
            raise ValueError(f"{self.name}: length must be >= 1, got {length}")
        device = generator.device
        ids = self._stream("train", device).ids
        if ids.numel() < length + 1:
            raise ValueError(f"{self.name}: the training split has {ids.numel()} tokens, fewer than a window of "
                             f"{length + 1}; lower train.length or raise task.train_tokens")
        starts = torch.randint(0, ids.numel() - length, (batch_size,), generator=generator, device=device)  # [B]
        window = ids[starts[:, None] + torch.arange(length + 1, device=device)].long()  # [B, L + 1]
        mask = torch.ones(batch_size, length, dtype=torch.bool, device=device)  # [B, L]
        return Batch(inputs=window[:, :-1], targets=window[:, 1:], loss_mask=mask)

    def eval_batches(self, length: int, samples: int, batch_size: int,
                     generator: torch.Generator) -> Iterator[WindowBatch]:
        """Both protocols over the fixed evaluation range; `samples` and the generator's state are
        unused (the range is set by task.eval_tokens), the generator only names the device."""
        device = generator.device
        stream = self._stream(self.eval_split, device)
        targets = stream.ids.numel() - 1
        if targets < length:
            raise ValueError(f"{self.name}: the evaluation range has {targets} tokens, fewer than the window "
                             f"length {length}; raise task.eval_tokens (null = the whole {self.eval_split} split)")
        offsets = torch.arange(length + 1, device=device)  # [L + 1]
        for protocol, stride in (("non_overlapping", length), ("sliding", self.stride_for(length))):
            starts, fresh = window_plan(targets, length, stride)
            for chunk in range(0, len(starts), batch_size):
                first = starts[chunk:chunk + batch_size].to(device)  # [B]
                new = fresh[chunk:chunk + batch_size].to(device)  # [B]
                index = first[:, None] + offsets  # [B, L + 1]
                window = stream.ids[index].long()  # [B, L + 1]
                mask = offsets[None, 1:] > length - new[:, None]  # [B, L] the last `new` targets
                counts = None if stream.byte_counts is None else stream.byte_counts[index[:, 1:]]  # [B, L]
                yield WindowBatch(inputs=window[:, :-1], targets=window[:, 1:], loss_mask=mask,
                                  protocol=protocol, stream_index=index[:, 1:], byte_counts=counts)
        if self.memory:
            yield from self.recurrent_segments(stream, targets, length)

    def recurrent_segments(self, stream: TokenIds, targets: int, length: int) -> Iterator[WindowBatch]:
        """Consecutive segments of `length` targets (the last one shorter), one stream, every
        target scored once; the model carries `memory` tokens of hidden states between them."""
        for first in range(0, targets, length):
            index = torch.arange(first, min(first + length, targets) + 1, device=stream.ids.device)[None]  # [1, L + 1]
            window = stream.ids[index].long()  # [1, L + 1]
            counts = None if stream.byte_counts is None else stream.byte_counts[index[:, 1:]]  # [1, L]
            yield WindowBatch(inputs=window[:, :-1], targets=window[:, 1:],
                              loss_mask=torch.ones_like(window[:, 1:], dtype=torch.bool), protocol="recurrent",
                              stream_index=index[:, 1:], byte_counts=counts, memory_length=self.memory,
                              new_stream=first == 0)

    def batch_sums(self, logits: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        if not isinstance(batch, WindowBatch):  # training batches
            return batch_metrics(logits, batch)
        mask = batch.loss_mask
        token_loss = F.cross_entropy(logits.transpose(1, 2).float(), batch.targets, reduction="none")  # [B, T]
        token_loss = token_loss * mask  # [B, T]
        correct = (logits.argmax(-1) == batch.targets) & mask  # [B, T]
        scored_bytes = mask.sum() if batch.byte_counts is None else (batch.byte_counts * mask).sum()
        prefix = PROTOCOLS[batch.protocol]
        sums = {f"{prefix}loss_sum": token_loss.sum(), f"{prefix}correct": correct.sum(),
                f"{prefix}tokens": mask.sum(), f"{prefix}bytes": scored_bytes,
                f"{prefix}windows": torch.tensor(mask.shape[0])}
        if batch.protocol == "non_overlapping":
            bins = position_bins(mask.shape[1], self.position_bins).to(mask.device)  # [T]
            n_bins = int(bins[-1]) + 1
            loss_by_bin = token_loss.new_zeros(n_bins).index_add_(0, bins, token_loss.sum(0))  # [n_bins]
            tokens_by_bin = token_loss.new_zeros(n_bins).index_add_(0, bins, mask.sum(0).float())  # [n_bins]
            for b in range(n_bins):
                sums[f"position_loss_sum_{b}"] = loss_by_bin[b]
                sums[f"position_tokens_{b}"] = tokens_by_bin[b]
        return sums

    def finalize(self, sums: dict[str, float]) -> dict:
        metrics: dict = {"exact_match": None}
        for prefix in PROTOCOLS.values():
            if f"{prefix}tokens" not in sums:  # recurrent: only with task.memory
                continue
            tokens, loss_sum = sums[f"{prefix}tokens"], sums[f"{prefix}loss_sum"]
            loss = loss_sum / tokens
            metrics |= {f"{prefix}loss": loss, f"{prefix}perplexity": exp_or_inf(loss),
                        f"{prefix}bits_per_byte": loss_sum / (math.log(2) * sums[f"{prefix}bytes"])
                        if sums[f"{prefix}bytes"] else None,
                        f"{prefix}token_acc": sums[f"{prefix}correct"] / tokens}
        n_bins = sum(key.startswith("position_tokens_") for key in sums)
        metrics["loss_by_position"] = [sums[f"position_loss_sum_{b}"] / sums[f"position_tokens_{b}"]
                                       if sums[f"position_tokens_{b}"] else None for b in range(n_bins)]
        metrics["eval_tokens"] = int(sums["tokens"])
        metrics["samples"] = int(sums["windows"])  # the row's `samples`: windows of the non-overlapping pass
        return metrics

    def write_figures(self, rows: list[dict], run_dir: Path) -> list[Path]:
        """loss_by_position.png: the loss against the token's position in its window, one line per
        evaluation length; a model that fails to extrapolate rises past the training length."""
        done = [r for r in rows if r.get("status") == "ok" and r.get("loss_by_position")]
        if not done:
            return []
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.8), constrained_layout=True)
        for row in done:
            length, losses = row["eval_length"], row["loss_by_position"]
            bins = position_bins(length, self.position_bins)  # [L]
            context = [float((bins == b).nonzero().float().mean()) + 1 for b in range(len(losses))]
            points = [(x, y) for x, y in zip(context, losses) if y is not None]
            ax.plot(*zip(*points), marker="o", ms=3, label=f"L={length}")
        train_length = done[0]["train_length"]
        ax.axvline(train_length, color="grey", ls="--", lw=1)
        ax.text(train_length, 0.02, f" train N={train_length}", color="grey", fontsize=8,
                transform=ax.get_xaxis_transform())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens of context (position in the window + 1; mean of the bin)")
        ax.set_ylabel("loss (nats / token)")
        ax.set_title(f"{done[0]['encoding']} on {self.name} ({self.corpus.tokenizer_name} tokens): loss by position")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = Path(run_dir) / "loss_by_position.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return [path]


def exp_or_inf(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
