"""What length costs each encoding, against the plain-attention floor (issue: scale).

    python scripts/benchmark_scale.py train [--lengths 1024,2048] [--encodings ...] [--rounds 3]
    python scripts/benchmark_scale.py eval [--lengths 4096] [--encodings ...] [--rounds 3]
    python scripts/benchmark_scale.py long [--tokens 4096,16384,32768] [--encodings ...]
    (each with --out FILE.csv; an --encodings entry may be a variant, name+key=value, e.g.
    rope+frequency_fraction=0.25)
    python scripts/benchmark_scale.py figure --train A.csv,B.csv --long C.csv --out scale.png
    python scripts/benchmark_scale.py blocks [--lengths 1024] [--encodings cope,...] [--rounds 5]

train, eval: one process, one thread, every model built first, then rounds that time each
model once in turn (floor, a, b, ..., floor, a, b, ...) with process CPU time, so a busy
machine slows every model alike. The floor is nope: plain SDPA with is_causal and no
encoding. Shape: a decoder of 4 layers, d_model 256, 8 heads, batch 8, on copy batches of
`length` tokens (task length (length - 1) / 2). `train` times posbench.training.train_step (the
runner's own step: forward, loss, backward, clip, AdamW) and, for the encodings it shares,
x-transformers' decoder of the same shape; `eval` times a no-grad forward with the runner's
evaluation chunking. Ratios are per round against the floor's time in that round: median
[min, max] over the timed rounds (one untimed round first). Memory: each model's peak
resident set during one step over the level before it (posbench.memory, VmHWM reset).

blocks: the training step of each encoding with its eager query blocks' q, k and v views taken
from posbench.attention.layer.BlockViews (one gradient buffer per tensor) and from plain slices
(autograd's slice backward: a zeroed whole-size tensor per block), in turn in each round (in
alternating order), in one process: the ratio views / slices per round, median [min, max].

long: `python -m posbench encoding=E task=copy train.length=128 train.steps=0 eval.lengths=[n]
eval.samples=1 eval.batch_size=1` in a subprocess per (encoding, tokens) with the default model,
untrained (N = 128 so that hierarchical's N^2 extension reaches 32k tokens), reading the row it
writes: tokens/s and the length's own peak resident set (whole process), and the ratio of that
peak to nope's at the same length.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FLOOR = "nope"
SHAPE = ["model.d_model=256", "model.n_layers=4", "model.n_heads=8", "model.mlp_ratio=4", "train.batch_size=8"]
BATCH = 8
X_TRANSFORMERS = {"nope": {}, "alibi": {"alibi_pos_bias": True}, "t5": {"rel_pos_bias": True},
                  "rope": {"rotary_pos_emb": True}}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def encoding_overrides(spec: str) -> list[str]:
    """An --encodings entry as overrides: `name` or `name+key=value+...` (a variant, e.g.
    rope+frequency_fraction=0.25 for p-RoPE) -> ["encoding=name", "encoding.key=value", ...]."""
    name, *settings = spec.split("+")
    return [f"encoding={name}", *(f"encoding.{setting}" for setting in settings)]


def build_posbench(encoding: str, tokens: int):
    import torch

    from posbench.build import build
    from posbench.training import make_optimizer
    from scripts.benchmark_encodings import compose_cfg

    cfg = compose_cfg([*encoding_overrides(encoding), f"train.length={(tokens - 1) // 2}", "device=cpu", *SHAPE])
    built = build(cfg, torch.device("cpu"))
    return built, make_optimizer(built.model, cfg.train), cfg


def posbench_step(encoding: str, tokens: int, training: bool):
    """A function that runs one training step (or one evaluation forward) of this encoding."""
    import torch

    from posbench.training import train_step
    from posbench.validate import eval_chunk

    built, optimizer, cfg = build_posbench(encoding, tokens)
    generator = torch.Generator().manual_seed(0)
    length = (tokens - 1) // 2
    built.model.train(training)
    built.model.set_eval_chunk(eval_chunk(cfg.eval.chunk))

    def step():
        batch = built.task.sample(BATCH, length, generator)
        pos = torch.arange(batch.inputs.shape[1])[None]  # [1, T]
        if training:
            train_step(built.model, built.model, built.task, batch, pos, optimizer, cfg.train, torch.device("cpu"))
        else:
            with torch.no_grad():
                built.model(batch.inputs, pos)

    return step, built.backend


def x_transformers_step(encoding: str, tokens: int):
    """One training step of x-transformers' decoder of the same shape, with this encoding's flag."""
    import torch
    import torch.nn.functional as F
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    vocab = 12
    model = TransformerWrapper(num_tokens=vocab, max_seq_len=tokens, use_abs_pos_emb=False,
                               attn_layers=Decoder(dim=256, depth=4, heads=8, **X_TRANSFORMERS[encoding]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)

    def step():
        ids = torch.randint(0, vocab, (BATCH, tokens + 1), generator=generator)
        logits = model(ids[:, :-1])  # [B, T, V]
        loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def step_memory(step) -> float:
    """MiB the resident set rose above its level before one step (its VmHWM reset first)."""
    import torch

    from posbench.memory import PeakMemory

    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    step()
    return memory.peak() - memory.base


def interleaved(args, training: bool) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as posbench.runner.run
    rows = []
    for tokens in args.lengths:
        steps, backends = {}, {}
        for encoding in args.encodings:
            steps[encoding], backends[encoding] = posbench_step(encoding, tokens, training)
        if training and args.x_transformers:
            for encoding in X_TRANSFORMERS:
                if encoding in args.encodings:
                    steps[f"x-transformers {encoding}"] = x_transformers_step(encoding, tokens)
                    backends[f"x-transformers {encoding}"] = "x-transformers"
        times = {name: [] for name in steps}
        for round_ in range(args.rounds + 1):
            for name, step in steps.items():
                start = time.process_time()
                step()
                times[name].append(time.process_time() - start)
            log(f"{tokens} tokens, round {round_}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()))
        memory = {name: step_memory(step) for name, step in steps.items()}
        for name in steps:
            ratios = [t / f for t, f in zip(times[name][1:], times[FLOOR][1:])]
            rows.append({"mode": "train" if training else "eval", "name": name, "backend": backends[name],
                         "tokens": tokens, "batch": BATCH, "seconds_median": statistics.median(times[name][1:]),
                         "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios), "rounds": args.rounds, "step_mem_mb": memory[name],
                         "step_mem_over_floor_mb": memory[name] - memory[FLOOR]})
    return rows


def block_views_against_slices(args) -> list[dict]:
    import torch

    from posbench.attention import layer

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    views = layer.BlockViews.apply

    def slices(q, k, v, spans):
        return [view for span in spans for view in layer.block_views(q, k, v, span)]

    rows = []
    for tokens in args.lengths:
        for encoding in args.encodings:
            step, backend = posbench_step(encoding, tokens, True)
            times = {"slices": [], "views": []}
            try:
                for round_ in range(args.rounds + 1):  # the order alternates: a drift favours neither
                    for name, take in (("slices", slices), ("views", views))[::1 if round_ % 2 else -1]:
                        layer.BlockViews.apply = take
                        start = time.process_time()
                        step()
                        times[name].append(time.process_time() - start)
                    log(f"{encoding} {tokens} tokens, round {round_}: slices {times['slices'][-1]:.2f}s, "
                        f"views {times['views'][-1]:.2f}s")
            finally:
                layer.BlockViews.apply = views
            ratios = [v / s for v, s in zip(times["views"][1:], times["slices"][1:])]
            rows.append({"mode": "blocks", "name": encoding, "backend": backend, "tokens": tokens,
                         "slices_seconds_median": statistics.median(times["slices"][1:]),
                         "views_seconds_median": statistics.median(times["views"][1:]),
                         "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios), "rounds": args.rounds})
    return rows


def long_evaluation(args) -> list[dict]:
    rows = []
    for tokens in args.tokens:
        for encoding in args.encodings:
            length = (tokens - 1) // 2  # copy: [BOS] x SEP y, 2n + 1 tokens
            with tempfile.TemporaryDirectory() as run_dir:
                command = [sys.executable, "-m", "posbench", *encoding_overrides(encoding), "task=copy",
                           "train.length=128", "train.steps=0",
                           f"eval.lengths=[{length}]", "eval.samples=1", "eval.batch_size=1", "threads=1",
                           "train.save_checkpoint=false", f"hydra.run.dir={run_dir}"]
                began = time.perf_counter()
                done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
                seconds = time.perf_counter() - began
                results = Path(run_dir) / "results.jsonl"
                row = json.loads(results.read_text().splitlines()[-1]) if results.exists() else {}
            status = row.get("status", f"failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
            rows.append({"mode": "long", "name": encoding, "backend": row.get("backend"),
                         "tokens": row.get("eval_sequence_length", 2 * length + 1), "batch": 1,
                         "seconds_median": seconds, "eval_tokens_per_s": row.get("eval_tokens_per_s"),
                         "peak_mem_mb": row.get("peak_mem_mb"), "mem_kind": row.get("mem_kind"),
                         "status": status[:300]})
            log(f"{encoding} at {tokens} tokens: {status}, {seconds:.0f} s, peak {row.get('peak_mem_mb')} MiB")
    floor = {r["tokens"]: r["peak_mem_mb"] for r in rows if r["name"] == FLOOR and r["peak_mem_mb"]}
    for row in rows:
        base = floor.get(row["tokens"])
        row["peak_mem_vs_nope"] = row["peak_mem_mb"] / base if base and row["peak_mem_mb"] else None
    return rows


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(rows: list[dict]) -> str:
    if rows[0]["mode"] == "blocks":
        lines = ["| encoding | backend | tokens | slices s per step | views s per step "
                 "| views / slices, median [min, max] |", "|---|---|---:|---:|---:|---|"]
        for r in rows:
            lines.append(f"| {r['name']} | {r['backend']} | {r['tokens']} | {r['slices_seconds_median']:.2f} | "
                         f"{r['views_seconds_median']:.2f} | {r['ratio_median']:.3f} [{r['ratio_min']:.3f}, "
                         f"{r['ratio_max']:.3f}] |")
        return "\n".join(lines)
    if rows[0]["mode"] == "long":
        lines = ["| encoding | backend | tokens | status | wall s | tokens/s | peak MiB | peak vs nope |",
                 "|---|---|---:|---|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['name']} | {r['backend']} | {r['tokens']} | {r['status']} | {r['seconds_median']:.0f} "
                         f"| {fmt(r['eval_tokens_per_s'], ',.0f')} | {fmt(r['peak_mem_mb'], ',.0f')} "
                         f"| {fmt(r['peak_mem_vs_nope'], '.2f')} |")
        return "\n".join(lines)
    lines = ["| encoding | backend | tokens | s per step | vs floor, median [min, max] | step MiB | over floor MiB |",
             "|---|---|---:|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['backend']} | {r['tokens']} | {r['seconds_median']:.2f} | "
                     f"{r['ratio_median']:.2f} [{r['ratio_min']:.2f}, {r['ratio_max']:.2f}] | "
                     f"{r['step_mem_mb']:,.0f} | {r['step_mem_over_floor_mb']:+,.0f} |")
    return "\n".join(lines)


def figure(train_csvs: list[str], long_csv: str, out: str) -> None:
    """Training step / floor per encoding and length; evaluation memory and speed against length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from posbench.results import save_png

    train = pd.concat([pd.read_csv(path) for path in train_csvs]).drop_duplicates(["name", "tokens"], keep="last")
    train = train[~train["name"].str.startswith("x-transformers")]
    long = pd.read_csv(long_csv)
    long = long[long["status"] == "ok"]
    fig, axes = plt.subplots(1, 3, figsize=(19, 6), layout="constrained")
    lengths = sorted(train["tokens"].unique())
    names = list(dict.fromkeys(train.sort_values("tokens")["name"]))
    width = 0.8 / len(lengths)
    for i, tokens in enumerate(lengths):
        part = train[train["tokens"] == tokens].set_index("name").reindex(names)
        axes[0].barh([n + i * width for n in range(len(names))], part["ratio_median"], height=width,
                     xerr=[part["ratio_median"] - part["ratio_min"], part["ratio_max"] - part["ratio_median"]],
                     label=f"{tokens} tokens")
    axes[0].set_yticks([n + width * (len(lengths) - 1) / 2 for n in range(len(names))], names)
    axes[0].invert_yaxis()
    axes[0].axvline(1.0, color="black", lw=0.8)
    axes[0].set_xlabel("training step / plain SDPA floor (median, min..max)")
    axes[0].legend()
    for ax, column, label in ((axes[1], "peak_mem_mb", "evaluation peak resident set, MiB"),
                              (axes[2], "eval_tokens_per_s", "evaluation tokens / s")):
        for name, curve in long.groupby("name", sort=True):
            curve = curve.sort_values("tokens")
            ax.plot(curve["tokens"], curve[column], marker="o", ms=3, label=name,
                    lw=2.5 if name == FLOOR else 1.0, color="black" if name == FLOOR else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("evaluation length, tokens (batch 1)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7, ncol=2)
    fig.suptitle("posbench at length (CPU, one thread)")
    save_png(fig, out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    from posbench.encodings import REGISTRY

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["train", "eval", "long", "figure", "blocks"])
    parser.add_argument("--train", help="figure: comma-separated CSVs of the train part")
    parser.add_argument("--long", help="figure: the CSV of the long part")
    parser.add_argument("--encodings", help="comma-separated registry names, or variants name+key=value "
                                            "(default: every 1-D encoding); nope is always added")
    parser.add_argument("--lengths", default=None, help="train/eval: tokens per sequence (default 1024,2048 / 4096)")
    parser.add_argument("--tokens", default="4096,16384,32768", help="long: tokens per sequence")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (one untimed round first)")
    parser.add_argument("--no-x-transformers", dest="x_transformers", action="store_false")
    parser.add_argument("--out", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    if args.part == "figure":
        if not (args.train and args.long and args.out):
            raise SystemExit("figure needs --train A.csv[,B.csv] --long C.csv --out FILE.png")
        figure(args.train.split(","), args.long, args.out)
        return
    names = args.encodings.split(",") if args.encodings else [n for n, c in REGISTRY.items() if c.position_dims == 1]
    unknown = sorted({name.split("+")[0] for name in names} - set(REGISTRY))
    if unknown:
        raise SystemExit(f"--encodings: unknown {unknown}; registered: {sorted(REGISTRY)}")
    names = list(dict.fromkeys(names))
    args.encodings = names if args.part == "blocks" else [FLOOR] + [n for n in names if n != FLOOR]
    default_lengths = {"train": "1024,2048", "blocks": "1024"}.get(args.part, "4096")
    args.lengths = [int(n) for n in (args.lengths or default_lengths).split(",")]
    args.tokens = [int(n) for n in args.tokens.split(",")]
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds} must be >= 1")
    if args.part == "blocks":
        rows = block_views_against_slices(args)
    else:
        rows = long_evaluation(args) if args.part == "long" else interleaved(args, args.part == "train")
    print(markdown(rows))
    if args.out:
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
