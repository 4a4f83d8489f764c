"""Long-context retrieval: find one item (the needle) in a long context (the haystack) and output it.

- passkey (Mohtashami & Jaggi 2023, Landmark Attention): `digits` digits marked `KEY d_1..d_D /KEY`,
  hidden among filler tokens; after `QUERY SEP` the model writes the digits. Length = the number of
  filler tokens (the passkey and its markers come on top, so every length >= 1 holds a passkey).
- associative_recall (Ba et al. 2016; Zoology's multi-query associative recall, Arora et al. 2023):
  `length` pairs `k v` with distinct keys; after `QUERY k SEP` the model writes k's value.
  Length = the number of key-value pairs.
- mqar: associative_recall with every pair queried by default (queries=null), in random order, as
  Zoology's MQAR queries every key. Zoology writes no QUERY or SEP token, spreads its queries among
  random tokens at power-law gaps and draws distinct values; here the layout is associative_recall's.

Layout, causal (a decoder): `[BOS] context (QUERY [key] SEP answer)*Q`; the model sees every token but
the last and is scored on predicting the answer tokens. Encoder (causal=False): the whole sequence with
every answer token replaced by PLACEHOLDER; the targets hold the answers at those positions, scored there.

Depth of a query = the share of the haystack before its needle, in [0, 1] (passkey: filler tokens before
the passkey / all filler tokens; recall: pairs before the queried pair / the other pairs). The metrics add
`exact_by_depth`: the exact match of queries binned by depth, drawn by `write_figures` as a heatmap over
evaluation length and depth (the "needle in a haystack" figure).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from posbench.checks import Choice, Flag, Integer
from tasks.base import Batch, Task, batch_metrics, finalize_metrics

FILLERS = ("pattern", "random")


@dataclass(kw_only=True)
class RetrievalBatch(Batch):
    depth: torch.Tensor  # [B, Q] float in [0, 1]: the share of the haystack before each query's needle
    depth_bin: torch.Tensor  # [B, Q] long in 0..depth_bins-1, from integers (no float rounding at bin edges)


@dataclass
class Draw:
    """One batch of a retrieval task before the shared layout is applied."""

    context: torch.Tensor  # [B, C] the haystack with the needles in it
    prompts: torch.Tensor  # [B, Q, P] what asks each query (QUERY, then its key if any)
    answers: torch.Tensor  # [B, Q, A] what each query must output
    before: torch.Tensor  # [B, Q] haystack units before each query's needle
    haystack: int  # haystack units in all


class RetrievalTask(Task):
    """The shared layout, depth bookkeeping and metrics. Subclasses set `content` (the ids 0..content-1
    they use) before calling this constructor, and implement `check_length`, `context_length`,
    `query_shape` and `draw`."""

    content: int = 0

    def __init__(self, default_length: int, causal: bool = True, depth_bins: int = 10):
        self.depth_bins = Integer(1)("task.depth_bins", depth_bins, self.name)
        self.causal = Flag()("task.causal", causal, self.name)
        self.default_length = Integer(1)("task.default_length", default_length, self.name)
        self.check_length(self.default_length)
        self.query, self.sep, self.bos, self.placeholder = range(self.content, self.content + 4)
        self.vocab_size = self.content + 4

    def params(self) -> dict:
        return {"causal": self.causal, "depth_bins": self.depth_bins, "vocab_size": self.vocab_size}

    def check_length(self, length: int) -> None:
        if length < 1:
            raise ValueError(f"{self.name}: length must be >= 1, got {length}")

    def context_length(self, length: int) -> int:
        raise NotImplementedError

    def query_shape(self, length: int) -> tuple[int, int, int]:
        """(queries Q, prompt tokens P, answer tokens A) at this length."""
        raise NotImplementedError

    def draw(self, batch_size: int, length: int, generator: torch.Generator) -> Draw:
        raise NotImplementedError

    def sequence_length(self, length: int) -> int:
        self.check_length(length)
        queries, prompt, answer = self.query_shape(length)
        return 1 + self.context_length(length) + queries * (prompt + 1 + answer) - self.causal

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> RetrievalBatch:
        self.check_length(length)
        draw = self.draw(batch_size, length, generator)
        device = generator.device
        (_, queries, prompt), answer = draw.prompts.shape, draw.answers.shape[2]
        sep = torch.full((batch_size, queries, 1), self.sep, dtype=torch.long, device=device)  # [B, Q, 1]
        blocks = torch.cat([draw.prompts, sep, draw.answers], dim=2).flatten(1)  # [B, Q * (P + 1 + A)]
        bos = torch.full((batch_size, 1), self.bos, dtype=torch.long, device=device)  # [B, 1]
        seq = torch.cat([bos, draw.context, blocks], dim=1)  # [B, S]
        in_block = torch.arange(prompt + 1 + answer, device=device) > prompt  # [P + 1 + A]
        is_answer = torch.cat([torch.zeros(1 + draw.context.shape[1], dtype=torch.bool, device=device),
                               in_block.repeat(queries)])  # [S]
        if self.causal:
            inputs, targets, mask = seq[:, :-1], seq[:, 1:], is_answer[1:]
        else:
            inputs, targets, mask = seq.masked_fill(is_answer, self.placeholder), seq, is_answer
        depth_bin = (draw.before * self.depth_bins // max(draw.haystack, 1)).clamp(max=self.depth_bins - 1)  # [B, Q]
        return RetrievalBatch(inputs=inputs, targets=targets, loss_mask=mask.repeat(batch_size, 1),
                              depth=draw.before / max(draw.haystack, 1), depth_bin=depth_bin)

    def batch_sums(self, logits: torch.Tensor, batch: RetrievalBatch) -> dict[str, torch.Tensor]:
        """The usual sums, plus per depth bin the queries answered exactly and the queries."""
        sums = batch_metrics(logits, batch)
        batch_size, queries = batch.depth_bin.shape
        right = (logits.argmax(-1) == batch.targets)[batch.loss_mask].view(batch_size, queries, -1)  # [B, Q, A]
        bins = batch.depth_bin.flatten()  # [B * Q]
        exact = torch.zeros(self.depth_bins, device=bins.device).index_add_(
            0, bins, right.all(-1).flatten().float())  # [bins]
        total = torch.bincount(bins, minlength=self.depth_bins)  # [bins]
        for b in range(self.depth_bins):
            sums[f"depth_bin_{b}_exact"] = exact[b]
            sums[f"depth_bin_{b}_total"] = total[b]
        return sums

    def finalize(self, sums: dict[str, float]) -> dict:
        exact_by_depth = [sums[f"depth_bin_{b}_exact"] / sums[f"depth_bin_{b}_total"]
                          if sums[f"depth_bin_{b}_total"] else None for b in range(self.depth_bins)]
        return {**finalize_metrics(sums), "exact_by_depth": exact_by_depth}

    def write_figures(self, rows: list[dict], run_dir: Path) -> list[Path]:
        """depth.png: exact match of the queries by evaluation length (x) and depth of the needle (y)."""
        done = sorted((r for r in rows if r.get("status") == "ok" and r.get("exact_by_depth")),
                      key=lambda r: r["eval_length"])
        if not done:
            return []
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        grid = torch.tensor([[float("nan") if v is None else v for v in r["exact_by_depth"]]
                             for r in done]).T  # [bins, lengths]
        bins, lengths = grid.shape
        fig, ax = plt.subplots(figsize=(1.8 + 0.7 * lengths, 4.2), constrained_layout=True)
        cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")  # grey: no query in this bin at this length
        image = ax.imshow(grid.numpy(), cmap=cmap, vmin=0, vmax=1, aspect="auto", origin="upper")
        for b in range(bins):
            for i in range(lengths):
                if not grid[b, i].isnan():
                    ax.text(i, b, f"{grid[b, i]:.2f}", ha="center", va="center", fontsize=7)
        train_length = done[0]["train_length"]
        ax.set_xticks(range(lengths), [str(r["eval_length"]) + ("*" if r["eval_length"] == train_length else "")
                                       for r in done])
        ax.set_yticks(range(bins), [f"{100 * b // bins}-{100 * (b + 1) // bins}%" for b in range(bins)])
        ax.set_xlabel(f"evaluation length (* = train N={train_length})")
        ax.set_ylabel("depth of the needle (start at the top)")
        ax.set_title(f"{done[0]['encoding']} on {self.name}: exact match by depth", fontsize=10)
        fig.colorbar(image, ax=ax, label="exact match")
        path = Path(run_dir) / "depth.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return [path]


class Passkey(RetrievalTask):
    """Ids: digits 0..9, filler 10..10+F-1, KEY, /KEY, then QUERY, SEP, BOS, PLACEHOLDER."""

    name = "passkey"

    def __init__(self, digits: int = 5, filler: str = "pattern", filler_symbols: int = 4,
                 default_length: int = 64, causal: bool = True, depth_bins: int = 10):
        Choice(FILLERS)("task.filler", filler, self.name)
        self.digits = Integer(1)("task.digits", digits, self.name)
        self.filler, self.filler_symbols = filler, Integer(1)("task.filler_symbols", filler_symbols, self.name)
        self.key_open, self.key_close = 10 + self.filler_symbols, 11 + self.filler_symbols
        self.content = 12 + self.filler_symbols
        super().__init__(default_length, causal, depth_bins)

    def params(self) -> dict:
        return {"digits": self.digits, "filler": self.filler, "filler_symbols": self.filler_symbols,
                **super().params()}

    def context_length(self, length: int) -> int:
        return length + self.digits + 2

    def query_shape(self, length: int) -> tuple[int, int, int]:
        return 1, 1, self.digits

    def draw(self, batch_size: int, length: int, generator: torch.Generator) -> Draw:
        device, digits = generator.device, self.digits
        before = torch.randint(0, length + 1, (batch_size, 1), generator=generator, device=device)  # [B, 1]
        key = torch.randint(0, 10, (batch_size, digits), generator=generator, device=device)  # [B, D]
        if self.filler == "pattern":  # 0 1 .. F-1 0 1 .. running on across the passkey
            filler = (torch.arange(length, device=device) % self.filler_symbols).expand(batch_size, -1)  # [B, L]
        else:
            filler = torch.randint(0, self.filler_symbols, (batch_size, length), generator=generator,
                                   device=device)  # [B, L]
        position = torch.arange(length + digits + 2, device=device)  # [C]
        offset = position - before  # [B, C] position from KEY
        filler_index = torch.where(offset < 0, position, position - digits - 2).clamp(0, length - 1)  # [B, C]
        context = torch.where(offset == 0, self.key_open, torch.where(
            offset == digits + 1, self.key_close, key.gather(1, (offset - 1).clamp(0, digits - 1))))  # [B, C]
        outside = (offset < 0) | (offset > digits + 1)  # [B, C]
        context = torch.where(outside, 10 + filler.gather(1, filler_index), context)  # [B, C]
        prompts = torch.full((batch_size, 1, 1), self.query, dtype=torch.long, device=device)  # [B, 1, 1]
        return Draw(context=context, prompts=prompts, answers=key[:, None], before=before, haystack=length)


class AssociativeRecall(RetrievalTask):
    """Ids: keys 0..K-1, values K..K+V-1, then QUERY, SEP, BOS, PLACEHOLDER."""

    name = "associative_recall"
    alphabet_setting = "keys"  # each sequence permutes all task.keys (posbench.guard)

    def __init__(self, keys: int = 64, values: int = 32, queries: int | None = 1, default_length: int = 16,
                 causal: bool = True, depth_bins: int = 10):
        self.keys = Integer(1)("task.keys", keys, self.name)
        self.values = Integer(1)("task.values", values, self.name)
        self.queries = Integer(1, null="every pair")("task.queries", queries, self.name)
        self.content = self.keys + self.values
        super().__init__(default_length, causal, depth_bins)

    def params(self) -> dict:
        return {"keys": self.keys, "values": self.values, "queries": self.queries, **super().params()}

    def check_length(self, length: int) -> None:
        super().check_length(length)
        if length > self.keys:
            raise ValueError(f"{self.name}: length {length} needs {length} distinct keys but task.keys="
                             f"{self.keys}; raise task.keys to at least the longest length")

    def context_length(self, length: int) -> int:
        return 2 * length

    def query_shape(self, length: int) -> tuple[int, int, int]:
        return length if self.queries is None else min(self.queries, length), 2, 1  # at most one query per pair

    def draw(self, batch_size: int, length: int, generator: torch.Generator) -> Draw:
        device = generator.device
        keys = torch.rand(batch_size, self.keys, generator=generator, device=device).argsort(1)[:, :length]  # [B, n]
        values = self.keys + torch.randint(0, self.values, (batch_size, length), generator=generator,
                                           device=device)  # [B, n]
        queries = self.query_shape(length)[0]
        asked = torch.rand(batch_size, length, generator=generator, device=device).argsort(1)[:, :queries]  # [B, Q]
        query = torch.full((batch_size, queries), self.query, dtype=torch.long, device=device)  # [B, Q]
        return Draw(context=torch.stack([keys, values], dim=2).flatten(1),  # [B, 2n] k_1 v_1 k_2 v_2 ..
                    prompts=torch.stack([query, keys.gather(1, asked)], dim=2),  # [B, Q, 2]
                    answers=values.gather(1, asked)[..., None],  # [B, Q, 1]
                    before=asked, haystack=length - 1)


class MQAR(AssociativeRecall):
    """Multi-query associative recall (Zoology): associative_recall that queries every pair by default."""

    name = "mqar"

    def __init__(self, keys: int = 64, values: int = 32, queries: int | None = None, default_length: int = 16,
                 causal: bool = True, depth_bins: int = 10):
        super().__init__(keys, values, queries, default_length, causal, depth_bins)
