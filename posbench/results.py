"""Result rows: the schema, the append-only writer, collection across runs, and plots.

One row per (run, evaluation length), appended and flushed as soon as the length is
measured, so a crash loses nothing already written.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

ROW_FILE = "results.jsonl"
METRICS = ("exact_match", "token_acc", "loss")
METRIC_LABELS = {"exact_match": "exact-match accuracy", "token_acc": "token accuracy", "loss": "loss",
                 "perplexity": "perplexity", "bits_per_byte": "bits per byte",
                 "sliding_perplexity": "perplexity (sliding window)",
                 "sliding_bits_per_byte": "bits per byte (sliding window)"}
PLOT_METRICS = ("exact_match", "perplexity", "token_acc", "loss")  # a run's curve shows the first two it has
# Every row carries these keys (metrics may be None for a length that was not measured).
SCHEMA = (
    "run_id", "run_name", "status", "encoding", "encoding_params", "task", "task_params", "model",
    "backend", "seed", "train_length", "train_sequence_length", "train_lengths", "positions", "max_position", "train_steps", "train_seconds",
    "eval_length", "eval_sequence_length", "ratio", "samples", *METRICS,
    "train_tokens_per_s", "eval_tokens_per_s", "peak_mem_mb", "mem_kind", "device", "torch",
    "git_commit", "time",
)


class RowWriter:
    """Appends rows to <run dir>/results.jsonl, one JSON object per line, flushed at once."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ROW_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict) -> None:
        missing = set(SCHEMA) - set(row)
        if missing:
            raise KeyError(f"result row lacks {sorted(missing)}")
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())


def find_row_files(paths) -> list[Path]:
    files = []
    for path in map(Path, paths):
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(sorted(path.rglob(ROW_FILE)))
        else:
            raise FileNotFoundError(f"no such run or sweep directory: {path}")
    return files


def collect(paths):
    """Every row under the given run/sweep directories (or results.jsonl files) -> DataFrame."""
    import pandas as pd

    files = find_row_files(paths)
    rows = []
    for file in files:
        for line_no, line in enumerate(file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:  # a run killed mid-write leaves a torn last line
                print(f"warning: skipping unreadable line {line_no} of {file}: {err}")
                continue
            row["source"] = str(file.parent)
            rows.append(row)
    if not rows:
        raise FileNotFoundError(f"no {ROW_FILE} rows found under {[str(p) for p in paths]}")
    frame = pd.DataFrame(rows)
    for key in SCHEMA:  # rows written by an older version may lack newer keys
        if key not in frame:
            frame[key] = None
    for key in ("encoding_params", "task_params", "model"):
        frame[key] = frame[key].map(lambda v: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v)
    return frame


def plot_run(rows: list[dict], path: str | Path) -> None:
    """The extrapolation curve of one run: its two main metrics against eval/train ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["status"] == "ok"]
    metrics = [m for m in PLOT_METRICS if any(r.get(m) is not None for r in done)][:2] or ["exact_match"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.4), squeeze=False,
                             constrained_layout=True)
    first = rows[0]
    for ax, metric in zip(axes[0], metrics):
        ax.plot([r["ratio"] for r in done], [r[metric] for r in done], marker="o")
        _decorate(ax, metric, first["train_length"])
    fig.suptitle(f"{first['encoding']} on {first['task']} (seed {first['seed']}, status {first['status']})")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_comparison(frame, path: str | Path, metric: str = "exact_match") -> None:
    """One panel per task, one line per encoding (mean over seeds, band = min..max)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = frame[frame[metric].notna()]
    tasks = sorted(frame["task"].unique())
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.6 * len(tasks), 3.6), squeeze=False,
                             constrained_layout=True)
    for ax, task in zip(axes[0], tasks):
        part = measured[measured["task"] == task]
        for encoding, curve in part.groupby("encoding"):
            stats = curve.groupby("ratio")[metric].agg(["mean", "min", "max"]).reset_index()
            line, = ax.plot(stats["ratio"], stats["mean"], marker="o", ms=3, label=encoding)
            ax.fill_between(stats["ratio"], stats["min"], stats["max"], color=line.get_color(), alpha=0.15)
        train_lengths = sorted(frame.loc[frame["task"] == task, "train_length"].unique())
        _decorate(ax, metric, ", ".join(map(str, train_lengths)))
        ax.set_title(task)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _decorate(ax, metric: str, train_length) -> None:
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.text(1.0, 0.97, f" train N={train_length}", color="grey", fontsize=8, va="top",
            transform=ax.get_xaxis_transform())
    ax.set_xlabel("evaluation length / training length")
    ax.set_ylabel(METRIC_LABELS[metric])
    if metric in ("exact_match", "token_acc"):
        ax.set_ylim(-0.03, 1.03)
    elif metric.endswith("perplexity"):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
