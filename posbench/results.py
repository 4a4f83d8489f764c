"""Result rows: the schema, the append-only writer, collection across runs, and the figures.

One row per (run, evaluation length), appended and flushed as soon as the length is
measured, so a crash loses nothing already written.
"""
from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import yaml

from posbench.headline import HEADLINE_METRICS, LEARNED_AT_N
from posbench.memory import PER_STRETCH_KINDS
from posbench.metrics import LABELS, PRIMARY_METRICS, ROW_METRICS
from posbench.rundir import ROW_FILE, STATUS_FILE, atomic_write, describe, read_regular
from posbench.runinfo import RUN_KEYS

METRICS = ROW_METRICS  # every row carries these (posbench.metrics declares every metric and its label)
METRIC_LABELS = LABELS
PLOT_METRICS = PRIMARY_METRICS  # a run's curve shows the first two it has
# Every row carries these keys: the run's (posbench.runinfo.RunInfo), then the length's
# (metrics may be None for a length that was not measured).
LENGTH_KEYS = ("status", "eval_length", "eval_sequence_length", "ratio", "samples", *METRICS, "eval_tokens_per_s",
               "peak_mem_mb", "mem_kind", "data_fingerprint", "eval_backend", "time")
SCHEMA = (*RUN_KEYS, *LENGTH_KEYS)


def json_lines(data: bytes):
    """(line number, the line, its JSON value, None) for each line of data that is JSON, (line number,
    the line, None, why) for each that is not (not UTF-8, not JSON); blank lines are left out."""
    for line_no, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            yield line_no, line, json.loads(line.decode()), None
        except UnicodeDecodeError as err:
            yield line_no, line, None, undecodable(line, err)[1]
        except json.JSONDecodeError as err:
            yield line_no, line, None, f"not JSON: {err.msg} (column {err.colno})"


def read_lines(path: Path) -> list[dict | bytes]:
    """Every line of one results.jsonl in order: a row (a JSON object with a run_id), or the line's own
    bytes where it is not one (torn by a kill, not UTF-8, not JSON, not a row), each of those warned
    with file:line. Blank lines carry nothing and are left out."""
    lines: list[dict | bytes] = []
    for line_no, line, row, reason in json_lines(read_regular(Path(path))):
        if reason is None:
            if isinstance(row, dict) and "run_id" in row:
                lines.append(row)
                continue
            reason = "not a result row: it lacks run_id" if isinstance(row, dict) else \
                f"a JSON {type(row).__name__}, not a row object"
        warnings.warn(f"{path}:{line_no}: {reason}; the line stays in the file as it is, unused", stacklevel=2)
        lines.append(line)
    return lines


def read_rows(path: Path) -> list[dict]:
    """The rows of one results.jsonl; a line that is not a row (one torn by a kill, say) is warned
    with file:line and left out of the rows (read_lines)."""
    return [line for line in read_lines(path) if isinstance(line, dict)]


class RowWriter:
    """<run dir>/results.jsonl, one JSON object per row, rewritten whole and atomically on
    every row (so a kill or a full disk leaves the previous rows intact).

    `keep` selects the rows already there that stay (a resumed run keeps its measured lengths).
    A line that is not a row is never dropped: it is warned with file:line and written back as it
    was, in its place, so no rewrite loses a line the run cannot read (it may hold a measured row).
    `writes=False` neither reads nor writes the file, only holds the rows it is given (the ranks > 0
    of a data-parallel run: rank 0 writes it)."""

    def __init__(self, run_dir: str | Path, keep=None, writes: bool = True):
        self.path = Path(run_dir) / ROW_FILE
        self.writes = writes
        if not writes:
            self.lines = []
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = read_lines(self.path) if self.path.exists() else []
        self.lines = [line for line in lines if not isinstance(line, dict) or keep is None or keep(line)]

    @property
    def rows(self) -> list[dict]:
        return [line for line in self.lines if isinstance(line, dict)]

    def write(self, row: dict) -> None:
        missing = set(SCHEMA) - set(row)
        if missing:
            raise KeyError(f"result row lacks {sorted(missing)}")
        self.lines.append(row)
        if self.writes:
            atomic_write(self.path, b"".join(line + b"\n" if isinstance(line, bytes)
                                             else (json.dumps(line, default=str) + "\n").encode()
                                             for line in self.lines))


def find_run_files(paths) -> tuple[list[Path], list[Path]]:
    """The results.jsonl and status.json files under the given paths (a path may be one such file)."""
    rows, statuses = [], []
    for path in map(Path, paths):
        if path.is_file():
            (statuses if path.name == STATUS_FILE else rows).append(path)
        elif path.is_dir():
            rows.extend(sorted(path.rglob(ROW_FILE)))
            statuses.extend(sorted(path.rglob(STATUS_FILE)))
        else:
            raise FileNotFoundError(f"no such run or sweep directory: {path}")
    return rows, statuses


# What a row needs for the report to place it, and the type of each: a line without them is skipped.
REQUIRED_KEYS = {"run_id": str, "run_name": str, "status": str, "task": str, "encoding": str, "seed": int,
                 "train_length": int, "eval_length": int, "ratio": (int, float)}
OBJECT_KEYS = ("encoding_params", "task_params", "model", "config")  # JSON objects where present
NUMBER_KEYS = (*HEADLINE_METRICS, "eval_tokens_per_s", "peak_mem_mb", "train_tokens_per_s", "train_seconds",
               "train_steps", "n_params")  # numbers where present: the report averages them


@dataclass(frozen=True)
class Skipped:
    """Input the report could not use: one line of a results.jsonl, or a whole file (whole_file;
    line, where known, says where it breaks)."""
    file: Path
    line: int | None
    reason: str
    whole_file: bool = False

    def __str__(self) -> str:
        return f"{self.file}{'' if self.line is None else f':{self.line}'}: {self.reason}"


def _type_ok(value, kind) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)  # JSON true is no number


def row_problem(row) -> str | None:
    """Why a parsed line is not a row the report can use, or None."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not a row object"
    missing = [key for key in REQUIRED_KEYS if row.get(key) is None]
    if missing:
        return f"not a result row: it lacks {missing}"
    wrong = [key for key, kind in REQUIRED_KEYS.items() if not _type_ok(row[key], kind)]
    wrong += [key for key in NUMBER_KEYS if row.get(key) is not None and not _type_ok(row[key], (int, float))]
    wrong += [key for key in OBJECT_KEYS if row.get(key) is not None and not isinstance(row[key], dict)]
    if wrong:
        return "values of the wrong type: " + ", ".join(f"{key}={json.dumps(row[key])[:40]}" for key in wrong)
    return None


def undecodable(data: bytes, err: UnicodeDecodeError) -> tuple[int, str]:
    """The line of data where err happened and what it says."""
    line_start = data.rfind(b"\n", 0, err.start) + 1
    return (data.count(b"\n", 0, err.start) + 1,
            f"not UTF-8 text (byte 0x{data[err.start]:02x} at column {err.start - line_start + 1})")


SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML has it: several times faster


def read_yaml(file: Path) -> tuple[object, int | None, str | None]:
    """The YAML document in file, or None with the line and the reason it cannot be read (unreadable,
    not UTF-8, not YAML). A missing file raises FileNotFoundError (a directory, IsADirectoryError)."""
    try:
        data = read_regular(file)
    except (FileNotFoundError, IsADirectoryError):
        raise
    except OSError as err:
        return None, None, f"unreadable: {err.strerror or err}"
    try:
        return yaml.load(data.decode(), Loader=SAFE_LOADER), None, None
    except UnicodeDecodeError as err:
        return None, *undecodable(data, err)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        return None, (mark.line + 1 if mark else None), f"not YAML: {getattr(err, 'problem', None) or err}"


def read_row_file(file: Path) -> tuple[list[dict], list[Skipped]]:
    """The rows of one results.jsonl, each with its source (the run directory), and the lines
    skipped: not UTF-8, not JSON (a torn or truncated line) or not a row (row_problem)."""
    try:
        data = read_regular(file)
    except OSError as err:
        return [], [Skipped(file, None, f"unreadable: {err.strerror or err}", whole_file=True)]
    rows, skipped = [], []
    last = data.count(b"\n") + 1  # a last line without a newline after it
    for line_no, _, row, reason in json_lines(data):
        if reason is None:
            reason = row_problem(row)
        elif line_no == last and reason.startswith("not JSON"):
            reason += " (the file ends mid-line: a truncated last line)"
        if reason:
            skipped.append(Skipped(file, line_no, reason))
            continue
        rows.append(row | {"source": str(file.parent)})
    return rows, skipped


def read_status_file(file: Path) -> tuple[dict | None, Skipped | None]:
    """A status.json's record, or None and why it cannot be used (unreadable, not UTF-8, not JSON,
    not an object with a state)."""
    try:
        data = read_regular(file)
        record = json.loads(data.decode())
    except OSError as err:
        where, reason = None, f"unreadable: {err.strerror or err}"
    except UnicodeDecodeError as err:
        where, reason = undecodable(data, err)
    except json.JSONDecodeError as err:
        where, reason = err.lineno, f"not JSON: {err.msg} (column {err.colno})"
    else:
        if isinstance(record, dict) and isinstance(record.get("state"), str):
            return record, None
        where, reason = None, "not a status record: no state"
    return None, Skipped(file, where, reason, whole_file=True)


def read_run_files(paths) -> tuple[list[dict], dict[str, dict], list[Skipped]]:
    """Every usable row and status record under paths, and what was skipped: the rows, the
    status records by run directory, the skipped lines and files. The report and --progress
    both read through here, so they count the same skipped input."""
    files, status_files = find_run_files(paths)
    rows, statuses, skipped = [], {}, []
    for file in files:
        found, bad = read_row_file(file)
        rows += found
        skipped += bad
    for file in status_files:
        record, problem = read_status_file(file)
        if record is None:
            skipped.append(problem)
        else:
            statuses[str(file.parent)] = record
    return rows, statuses, skipped


def skipped_summary(skipped: list[Skipped]) -> str:
    """'3 lines in 2 files and 1 whole file (status.json)': the count of skipped input the report and
    --progress print."""
    def count(n: int, noun: str) -> str:
        return f"{n} {noun}{'s' * (n != 1)}"

    lines = [item for item in skipped if not item.whole_file]
    files = [item for item in skipped if item.whole_file]
    parts = [f"{count(len(lines), 'line')} in {count(len({item.file for item in lines}), 'file')}"] if lines else []
    if files:
        names = sorted({item.file.name for item in files})
        parts.append(f"{count(len(files), 'whole file')} ({', '.join(names)})")
    return " and ".join(parts)


def skipped_lines(skipped: list[Skipped], per_file: int = 5) -> list[str]:
    """One line per skipped item, file:line: reason; past per_file items of one file, a count."""
    by_file: dict = {}
    for item in skipped:
        by_file.setdefault(item.file, []).append(item)
    lines = []
    for file, items in by_file.items():
        lines += [str(item) for item in items[:per_file]]
        if len(items) > per_file:
            lines.append(f"{file}: {len(items) - per_file} more lines skipped")
    return lines


class SharedRecord(dict):
    """A record that rides in frame.attrs without being copied: pandas deep-copies attrs on every
    slice and groupby, and a sweep's statuses copied that way made the report minutes slower."""

    def __deepcopy__(self, memo):
        return self


def collect(paths):
    """Every usable row under the given run/sweep directories (or results.jsonl files) -> DataFrame.

    frame.attrs["input"]["skipped"] lists the input left out (read_run_files); ["statuses"] maps
    every run directory found with a readable status.json to its record, rows or not."""
    import pandas as pd

    rows, statuses, skipped = read_run_files(paths)
    if not rows:
        found = "".join(f"\n  {source}: {describe(status)}" for source, status in statuses.items())
        raise FileNotFoundError(f"no {ROW_FILE} rows found under {[str(p) for p in paths]}"
                                + (f"; runs found without rows:{found}" if found else "")
                                + "".join(f"\n  skipped {line}" for line in skipped_lines(skipped)))
    frame = pd.DataFrame(rows)
    for key in SCHEMA:  # rows written by an older version may lack newer keys
        if key not in frame:
            frame[key] = None
    frame["init_steps"] = frame["init_steps"].fillna(0).astype(int)  # older rows: trained from scratch
    # a process-lifetime peak (rows before per-length measurement) says nothing about its own length
    frame.loc[~frame["mem_kind"].isin(PER_STRETCH_KINDS), "peak_mem_mb"] = None
    for key in OBJECT_KEYS:
        frame[key] = frame[key].map(lambda v: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v)
    frame.attrs["input"] = SharedRecord(skipped=skipped, statuses=statuses)
    return frame


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(rows: list[dict], path: str | Path) -> None:
    """Saves run_figure(rows) to path."""
    _save(run_figure(rows), path)


def run_figure(rows: list[dict]):
    """The extrapolation curve of one run: its two main metrics against eval/train ratio."""
    plt = _pyplot()
    done = [r for r in rows if r["status"] == "ok"]
    metrics = [m for m in PLOT_METRICS if any(r.get(m) is not None for r in done)][:2] or ["exact_match"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.4), squeeze=False,
                             constrained_layout=True)
    first = rows[0]
    for ax, metric in zip(axes[0], metrics):
        ax.plot([r["ratio"] for r in done], [r[metric] for r in done], marker="o")
        _decorate(ax, metric, first["train_length"], [r["ratio"] for r in rows])
    fig.suptitle(f"{first['encoding']} on {first['task']} (seed {first['seed']}, status {first['status']})")
    return fig


def save_png(fig, path: str | Path, dpi: int = 120) -> None:
    """The figure as a PNG of at most 256 colours (a third of matplotlib's RGBA bytes for the same picture: the
    figures of results/reference/ are tracked, and a GPU call carries the tree)."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    image = Image.open(buffer).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)


def _save(fig, path: str | Path) -> None:
    save_png(fig, path)
    _pyplot().close(fig)


def _line_styles(labels) -> dict:
    """A (colour, dash) per label: ten colours, then the same colours dashed, dotted, ..."""
    plt = _pyplot()
    colors = plt.get_cmap("tab10").colors
    return {label: (colors[i % 10], ("-", "--", ":", "-.")[i // 10 % 4]) for i, label in enumerate(sorted(labels))}


def _figure_legend(fig, axes, title: str | None = None) -> None:
    """One legend for every panel's lines, right of the panels."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize=7, title=title,
               title_fontsize=7)


def size_order(sizes) -> list[str]:
    """Model-size labels (2.58k, 151k, 3.2M; "" for a report of one size) from small to large."""
    scale = {"k": 1e3, "M": 1e6}
    return sorted(sizes, key=lambda size: float(size[:-1]) * scale[size[-1]] if size[-1:] in scale
                  else float(size or 0))


def plot_curves(summary, path: str | Path, metric: str, threshold: float | None = None) -> None:
    """One panel per task (and per model size, in rows, when the groups span several), one line
    per curve label: the mean over seeds of metric against eval/train length (log2 axis), a
    min..max band over seeds, N marked.

    summary: one row per (group, eval length) with label, curve_label, size, task,
    train_length, ratio, runs and <metric>_mean, _min, _max."""
    plt = _pyplot()
    tasks = sorted(summary["task"].unique())
    sizes = size_order(summary["size"].unique())
    styles = _line_styles(summary["curve_label"].unique())
    fig, axes = plt.subplots(len(sizes), len(tasks), figsize=(5.2 * len(tasks) + 2.5, 4.2 * len(sizes)),
                             squeeze=False, layout="constrained")
    several_seeds = summary["runs"].max() > 1
    for row, size in enumerate(sizes):
        for ax, task in zip(axes[row], tasks):
            part = summary[(summary["task"] == task) & (summary["size"] == size)]
            for label, curve in part.groupby("curve_label", sort=True):
                curve = curve.sort_values("ratio")
                seeds, (color, dash) = int(curve["runs"].max()), styles[label]
                ax.plot(curve["ratio"], curve[f"{metric}_mean"], marker="o", ms=3, color=color, ls=dash,
                        label=f"{label} ({seeds} seed{'s' * (seeds > 1)})" if several_seeds else label)
                if seeds > 1:
                    ax.fill_between(curve["ratio"], curve[f"{metric}_min"], curve[f"{metric}_max"],
                                    color=color, alpha=0.15, lw=0)
            if threshold is not None and metric in ("exact_match", "token_acc"):
                ax.axhline(threshold, color="grey", ls=":", lw=1)
                ax.text(0.99, threshold, f"threshold {threshold:g}", color="grey", fontsize=7, ha="right",
                        va="bottom", transform=ax.get_yaxis_transform())
            train_lengths = ", ".join(map(str, sorted(summary.loc[summary["task"] == task, "train_length"].unique())))
            _decorate(ax, metric, train_lengths, summary.loc[summary["task"] == task, "ratio"])
            ax.set_title(f"{task}, {size} parameters" if size else task)
    _figure_legend(fig, axes.flat, "line: mean over seeds\nband: min..max over seeds" if several_seeds
                   else "one seed per line")
    _save(fig, path)


def plot_scaling(headline, path: str | Path) -> None:
    """Saves scaling_figure(headline) to path."""
    _save(scaling_figure(headline), path)


def scaling_figure(headline):
    """OOD score against parameter count (log axis), one panel per task and setting (e.g. a copy
    variant), one line per encoding label (one colour in every panel): the mean over seeds with a
    min..max bar. For reports whose groups span model sizes."""
    from posbench.headline import lower_is_better

    plt = _pyplot()
    panels = sorted(headline.groupby(["task", "setting"]).groups)
    styles = _line_styles(headline["encoding_label"].unique())
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels) + 2.5, 3.8), squeeze=False,
                             layout="constrained")
    for ax, (task, setting) in zip(axes[0], panels):
        part = headline[(headline["task"] == task) & (headline["setting"] == setting)]
        for label, line in part.groupby("encoding_label", sort=True):
            line = line.sort_values("n_params")
            color, dash = styles[label]
            mean = line["ood_score_mean"].to_numpy(dtype=float)
            ax.errorbar(line["n_params"], mean, yerr=[mean - line["ood_score_min"].to_numpy(dtype=float),
                                                      line["ood_score_max"].to_numpy(dtype=float) - mean],
                        marker="o", ms=3, capsize=2, color=color, ls=dash, label=label)
        metric = part["metric"].iloc[0]
        ax.set_xscale("log")
        ax.set_xlabel("parameters (log)")
        ax.set_ylabel(f"OOD {METRIC_LABELS.get(metric, metric)}")
        if lower_is_better(metric):
            ax.set_yscale("log")
        else:
            ax.set_ylim(-0.03, 1.03)
        ax.set_title(f"{task} {setting}".strip(), fontsize=9)
        ax.grid(alpha=0.3)
    _figure_legend(fig, axes[0], "mean over seeds,\nbar: min..max")
    return fig


def plot_heatmap(headline, path: str | Path) -> None:
    """Saves heatmap_figure(headline) to path."""
    _save(heatmap_figure(headline), path)


def heatmap_figure(headline):
    """OOD score (mean over seeds) per group label x task, cells annotated; each task's
    column coloured on its metric's scale (perplexity-like: log, reversed: light = good)."""
    import numpy as np
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm, Normalize

    from posbench.headline import lower_is_better

    plt = _pyplot()
    table = headline.pivot_table(index="label", columns="task", values="ood_score_mean", aggfunc="first",
                                 dropna=False)
    ran = set(zip(headline["label"], headline["task"]))
    metric_of = headline.groupby("task")["metric"].first()
    scales = {}  # metric -> (norm, cmap)
    for metric in sorted(set(metric_of)):
        values = headline.loc[headline["metric"] == metric, "ood_score_mean"].to_numpy(dtype=float)
        finite = values[np.isfinite(values)]
        if lower_is_better(metric):
            low, high = (finite.min(), finite.max()) if finite.size and finite.min() > 0 else (1.0, 10.0)
            norm = LogNorm(low, max(high, low * 1.01))
        else:
            norm = Normalize(0, 1)
        scales[metric] = (norm, plt.get_cmap("viridis_r" if lower_is_better(metric) else "viridis"))
    colors = np.full((*table.shape, 4), 0.85)
    for (i, j), v in np.ndenumerate(table.to_numpy(dtype=float)):
        if np.isfinite(v):
            norm, cmap = scales[metric_of[table.columns[j]]]
            colors[i, j] = cmap(norm(v))
    fig, ax = plt.subplots(figsize=(1.4 * len(table.columns) + 2.5 + 1.3 * len(scales),
                                    max(2.5, 0.32 * len(table) + 1.5)), layout="constrained")
    ax.imshow(colors, aspect="auto")
    for (i, j), v in np.ndenumerate(table.to_numpy(dtype=float)):
        if np.isfinite(v):
            text = f"{v:.3g}" if lower_is_better(metric_of[table.columns[j]]) else f"{v:.2f}"
        else:  # a group that ran but measured nothing past N, or a (group, task) never run
            text = "–" if (table.index[i], table.columns[j]) in ran else "not run"
        dark = float(np.dot(colors[i, j, :3], (0.299, 0.587, 0.114))) < 0.5
        ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(table.columns)), [f"{t}\n({metric_of[t]})" for t in table.columns], fontsize=8)
    ax.set_yticks(range(len(table.index)), table.index, fontsize=8)
    # two lines each: one task column makes a narrow figure
    fig.suptitle("OOD score: mean of the metric past N\n(mean over seeds; –: nothing measured past N)", fontsize=9)
    for metric, (norm, cmap) in scales.items():
        bar = fig.colorbar(ScalarMappable(norm, cmap), ax=ax, shrink=0.8,
                           label=f"{metric}\n({'lower' if lower_is_better(metric) else 'higher'} is better)")
        bar.ax.yaxis.set_major_formatter(lambda v, _: f"{v:g}")
        bar.ax.yaxis.set_minor_formatter(lambda v, _: f"{v:g}")  # log scales: label the minor ticks too
    return fig


# What a row's peak_mem_mb measures, by its mem_kind (posbench.memory), as cost.png's axis says it.
MEM_KIND_LABELS = {
    "rss_hwm": "process peak RSS, MiB\n(the whole process: mostly torch and the model)",
    "cuda_max_allocated": "peak CUDA memory allocated, MiB\n(torch's tensors: the model and the batch)"}


def plot_cost(summary, path: str | Path) -> None:
    """Saves cost_figure(summary) to path."""
    _save(cost_figure(summary), path)


def cost_figure(summary):
    """Evaluation throughput and peak memory against evaluation length, per task and group; y axes
    from zero, so a process's fixed memory does not read as growth."""
    plt = _pyplot()
    tasks = sorted(summary["task"].unique())
    styles = _line_styles(summary["label"].unique())
    measured = summary["peak_mem_mb_mean"].notna()
    mem_kinds = sorted({kind for kinds in summary.loc[measured, "mem_kind"].dropna() for kind in kinds.split(",")})
    mem_label = " and ".join(MEM_KIND_LABELS.get(kind, f"peak memory, MiB ({kind})") for kind in mem_kinds)
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.0 * len(tasks) + 2.5, 6.4), squeeze=False,
                             layout="constrained")
    panels = (("eval_tokens_per_s", "evaluation tokens / s"),
              ("peak_mem_mb", mem_label or "peak memory, MiB (not measured per length)"))
    for col, task in enumerate(tasks):
        part = summary[summary["task"] == task]
        for row, (column, ylabel) in enumerate(panels):
            ax = axes[row][col]
            for label, curve in part.groupby("label", sort=True):
                curve = curve.sort_values("eval_length")
                color, dash = styles[label]
                ax.plot(curve["eval_length"], curve[f"{column}_mean"], marker="o", ms=3, color=color, ls=dash,
                        label=label)
            ax.set_xscale("log", base=2)
            lengths = sorted(part["eval_length"].unique())
            ax.set_xticks(lengths, [str(n) for n in lengths])
            ax.minorticks_off()
            ax.set_xlabel(f"evaluation length ({task} units)")
            if column == "eval_tokens_per_s":
                ax.yaxis.set_major_formatter(lambda v, _: f"{v / 1000:,.4g}k")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"{task} (mean over seeds)")
    _figure_legend(fig, axes.flat)
    return fig


def plot_ranking(ranking, path: str | Path) -> None:
    """Mean reciprocal rank of the OOD score across tasks, one bar per group label, annotated with
    its tasks and those it did not learn (which count 0; posbench.report.add_ranking)."""
    plt = _pyplot()
    ranking = ranking.sort_values(["mrr", "label"], ascending=[True, False])
    fig, ax = plt.subplots(figsize=(6.5, max(2.2, 0.3 * len(ranking) + 1.2)), constrained_layout=True)
    bars = ax.barh(ranking["label"], ranking["mrr"], color="tab:blue")
    for bar, tasks, unlearned in zip(bars, ranking["tasks"], ranking["not_learned"]):
        text = f"{tasks} task{'s' * (tasks > 1)}" + (f", {unlearned} not learned" if unlearned else "")
        ax.text(bar.get_width() + 0.01, bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=7,
                color="grey")
    ax.set_xlim(0, 1.3)
    notes = [f"a task not learned (accuracy at N < {LEARNED_AT_N:g}) counts 0"] if ranking["not_learned"].any() else []
    if ranking["tasks"].nunique() > 1:
        notes.append("groups ranked on different numbers of tasks: compare those with equal counts")
    if notes:
        ax.set_title("\n".join(notes), fontsize=8)
    ax.set_xlabel("mean reciprocal rank of OOD score across tasks (1 = best on every task)")
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    _save(fig, path)


def _decorate(ax, metric: str, train_length, ratios) -> None:
    """Log2 ratio axis with ticks at the evaluated ratios, N marked, the metric's scale (perplexity:
    log when the plotted values span a decade or more, else linear)."""
    ax.set_xscale("log", base=2)
    ticks = sorted({float(r) for r in ratios})
    ax.set_xticks(ticks, [f"{r:g}" for r in ticks])
    ax.minorticks_off()
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.text(1.0, 0.02, f" N={train_length}", color="grey", fontsize=8, va="bottom",
            transform=ax.get_xaxis_transform())
    ax.set_xlabel("evaluation length / training length N (log2)")
    ax.set_ylabel(METRIC_LABELS.get(metric, metric))
    if metric in ("exact_match", "token_acc"):
        ax.set_ylim(-0.03, 1.03)
    elif metric.endswith("perplexity"):
        low, high = ax.dataLim.intervaly  # the plotted values
        # log only across a decade or more, which always holds a labelled power of ten: a shorter
        # span may hold no labelled tick at all (110..190)
        if low > 0 and high >= 10 * low:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_minor_formatter(lambda v, _: f"{v:g}" if str(round(v))[0] in "2346" else "")
    ax.grid(alpha=0.3)
