"""The tables of README.md and docs/*.md that quote committed results, rebuilt from the rows.

    python scripts/docs_tables.py           # rewrite every generated table in place
    python scripts/docs_tables.py --check   # exit 1, naming each table, when a page differs from the rows

A generated table sits between two markers in the Markdown source:

    <!-- table:NAME -->
    ...
    <!-- /table:NAME -->

and NAME is a function of TABLES below. Each reads the committed rows under results/reference/
through the report's own code (posbench.results.collect, posbench.report's groups, run table,
summary and headline, posbench.headline's `learned` bar), so a figure quoted in the docs is the
number `python -m posbench.report` gives for the same directories.

A count in the prose sits between inline markers on one line:

    <!-- value:KIND ARG... -->TEXT<!-- /value -->

and KIND is a function of VALUES below, called with the ARGs: how many encodings, tasks, runs of a
sweep (Hydra's own expansion of the config globs), committed runs, test cases, and what a study
cost (from its rows' own times). `tests` is the suite's size, which needs a collection: the
script runs `pytest --collect-only` (seconds) unless given `--tests N`, and `--skip tests` leaves
it unchecked; tests/test_docs.py passes its own session's count. Other prose numbers (scores
quoted from the tables) are checked by hand. tests/test_docs.py runs --check.
"""
from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import re
import subprocess
import sys
from datetime import datetime, timedelta
from functools import cache
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file from a checkout that is not installed
    sys.path.insert(0, str(ROOT))

from posbench import report  # noqa: E402
from posbench.headline import DEFAULT_THRESHOLD, lower_is_better, spread  # noqa: E402
from posbench.results import collect  # noqa: E402

REFERENCE = ROOT / "results" / "reference"
ENCODINGS = ROOT / "configs" / "encoding"
MARKER = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)
INLINE = re.compile(r"(<!-- value:(?P<name>[\w-]+)(?P<args>(?: [^ ]+)*?) -->)(?P<body>[^\n]*?)(<!-- /value -->)")
CORE = ("nope", "sinusoidal", "learned", "rope", "alibi", "t5")


class Study(NamedTuple):
    frame: object  # every row with its group (report.add_groups)
    runs: object  # one row per run (report.run_table)
    summary: object  # per group and length: mean, std, min, max over seeds (report.summary_table)
    headline: object  # per group: headline scores over seeds, learned, rank (report.headline_table)


@cache
def study(*dirs: str, metric: str | None = None) -> Study:
    """The report's tables for these directories under results/reference/, as
    `python -m posbench.report DIR... [--metric M]` computes them (nothing is written)."""
    frame = collect([REFERENCE / d for d in dirs])
    frame = report.add_groups(frame).sort_values(["task", "label", "seed", "eval_length"]).reset_index(drop=True)
    metrics = report.task_metrics(frame, metric)
    runs = report.run_table(frame, metrics, DEFAULT_THRESHOLD)
    summary = report.summary_table(frame)
    headline = report.headline_table(frame, runs, summary, DEFAULT_THRESHOLD)
    return Study(frame, runs, summary, headline)


def params(record) -> dict:
    """A row's settings as flat keys: encoding, task, encoding.<param>, task.<param>, n_params, ..."""
    flat = {"encoding": record["encoding"], "task": record["task"], "n_params": record["n_params"],
            "backend": record["backend"], "max_position": record["max_position"]}
    for column, prefix in (("encoding_params", "encoding."), ("task_params", "task."), ("model", "model.")):
        value = record[column]
        flat |= {prefix + k: v for k, v in (json.loads(value) if isinstance(value, str) else value or {}).items()}
    return flat


def group_params(s: Study) -> dict:
    """group -> the settings of its first row."""
    return {record["group"]: params(record) for _, record in s.frame.drop_duplicates("group").iterrows()}


def num(value, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> str:
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def length_cells(s: Study, metric: str, key, digits: int = 3, by: str = "eval_length") -> tuple[list, dict]:
    """key(settings) -> a row key or None (left out); returns the evaluated lengths (or ratios,
    by="ratio") and {row key: {length: mean over seeds}} from the report's summary."""
    settings = group_params(s)
    cells: dict = {}
    for _, r in s.summary.iterrows():
        k = key(settings[r["group"]])
        if k is not None:
            cells.setdefault(k, {})[r[by]] = num(r[f"{metric}_mean"], digits)
    lengths = sorted({n for row in cells.values() for n in row})
    return lengths, cells


def train_seconds(s: Study, key) -> dict:
    """row key -> training seconds (the mean over its runs), as an integer."""
    settings = group_params(s)
    out: dict = {}
    for _, r in s.runs.iterrows():
        k = key(settings[r["group"]])
        if k is not None:
            out.setdefault(k, []).append(r["train_seconds"])
    return {k: f"{sum(v) / len(v):.0f}" for k, v in out.items()}


def by_length(s: Study, metric: str, key, names: list[str], order, digits: int = 3, length_name=None,
              extra=None, by: str = "eval_length") -> str:
    """Rows in `order` (their keys, tuples of the first cells), one column per evaluated length."""
    lengths, cells = length_cells(s, metric, key, digits, by)
    length_name = length_name or (lambda n: f"n={n}")
    extra = extra or {}
    header = names + [length_name(n) for n in lengths] + list(extra)
    rows = [[*k, *(cells[k].get(n, "") for n in lengths), *(column.get(k, "") for column in extra.values())]
            for k in order if k in cells]
    return table(header, rows, ["---"] * len(names) + ["---:"] * (len(header) - len(names)))


def by_encoding(p: dict) -> tuple:
    return (p["encoding"],)


def by_task_encoding(p: dict) -> tuple:
    return (p["task"], p["encoding"])


def headline_by(s: Study, key) -> dict:
    """row key -> its group's headline record."""
    settings = group_params(s)
    return {k: r for _, r in s.headline.iterrows() if (k := key(settings[r["group"]])) is not None}


def run_window_mean(s: Study, metric: str, low: float, high: float, key) -> dict:
    """row key -> spread over seeds of each run's mean of the metric over evaluated lengths in
    (low, high] (in units of N), as published.csv averages a published range."""
    settings = group_params(s)
    frame, n = s.frame, s.frame["train_length"]
    inside = frame[(frame["eval_length"] > low * n) & (frame["eval_length"] <= high * n) & (frame["status"] == "ok")]
    means = inside.groupby("run_id", sort=False).agg(group=("group", "first"), value=(metric, "mean"))
    per_run: dict = {}
    for run_id in frame["run_id"].unique():  # the runs in the frame's order, as each seed's value is listed
        if run_id in means.index and (k := key(settings[means.at[run_id, "group"]])) is not None:
            per_run.setdefault(k, []).append(float(means.at[run_id, "value"]))
    return {k: spread(v) for k, v in per_run.items()}


# ---- the tables ----------------------------------------------------------------------------------

def glance() -> str:
    """README: the six core encodings' OOD score (mean over seeds) on the reference studies."""
    columns = [  # (header, study dirs, task, task settings the column takes)
        ("copy", ("core_copy_sort",), "copy", {}),
        ("sort", ("core_copy_sort",), "sort", {}),
        ("cmc, 3 seeds", ("scale_study/xs", "scale_study/small"), "copy", {"task.variant": "cmc", "model.d_model": 64}),
        ("sort, 3 seeds", ("scale_study/xs", "scale_study/small"), "sort", {"model.d_model": 64}),
        ("rsc, stop scored, 3 seeds", ("scale_study/small_eos",), "copy", {"task.variant": "rsc"}),
        ("duplicate (5k steps)", ("kazemnejad_causal",), "duplicate", {}),
        ("WikiText-2 bytes (perplexity)", ("lm_extrapolation",), "wikitext", {}),
    ]
    cells: dict = {}
    for header, dirs, task, wanted in columns:
        s = study(*dirs)
        records = headline_by(s, lambda p, t=task, w=wanted: p["encoding"] if p["task"] == t and all(
            p.get(k) == v for k, v in w.items()) else None)
        scored = {e: r for e, r in records.items() if not report.not_learned(r)}
        lower = any(lower_is_better(r["metric"]) for r in records.values())
        best = (min if lower else max)(scored, key=lambda e: scored[e]["ood_score_mean"]) if scored else None
        for encoding, r in records.items():
            digits = 2 if lower else 3
            text = num(r["ood_score_mean"], digits)
            if report.not_learned(r):
                text = f"not learned ({num(r['id_score_mean'], 2)} at N)"
            elif encoding == best:
                text = f"**{text}**"
            cells[(encoding, header)] = text
    rows = [[f"`{e}`", *(cells.get((e, h), "–") for h, *_ in columns)] for e in CORE]
    return table(["encoding", *(h for h, *_ in columns)], rows)


def core_copy_sort() -> str:
    s = study("core_copy_sort")
    order = [(t, e) for t in ("copy", "sort") for e in sorted(CORE)]
    return by_length(s, "exact_match", by_task_encoding, ["task", "encoding"], order,
                     extra={"train s": train_seconds(s, by_task_encoding)})


def quickstart() -> str:
    """The README's first sweep, in its report's order: exact match by length, the OOD score, the rank."""
    s = study("quickstart")
    head = headline_by(s, by_encoding)
    order = sorted(head, key=lambda k: (head[k]["rank_in_task"], k))
    return by_length(s, "exact_match", by_encoding, ["encoding"], order, by="ratio",
                     length_name=lambda r: "N" if r == 1 else f"{r:g}N",
                     extra={"past N (OOD)": {k: num(r["ood_score_mean"]) for k, r in head.items()},
                            "rank": {k: f"{r['rank_in_task']:.0f}" for k, r in head.items()}})


def default_job_seeds() -> str:
    """Exact match at N of the default job, CPUs x seeds x CPU kernel settings (scripts/default_job_seeds.py)."""
    rows = list(csv.DictReader((REFERENCE / "default_job_seeds.csv").open()))
    seeds = sorted({int(r["seed"]) for r in rows})
    cells: dict = {}
    for r in rows:
        schedule = "3,500 steps (the default)" if not r["overrides"] else f"`{r['overrides']}`"
        key = (r["cpu"], schedule, f"`{r['setting']}`")
        cells.setdefault(key, {})[int(r["seed"])] = num(float(r["exact_match_at_n"]))
    cpus = list(dict.fromkeys(r["cpu"] for r in rows))  # the file's order
    settings = [f"`{name}`" for name in dict.fromkeys(r["setting"] for r in rows)]
    order = sorted(cells, key=lambda k: (cpus.index(k[0]), k[1] != "3,500 steps (the default)", k[1],
                                         settings.index(k[2])))
    return table(["CPU", "schedule", "CPU kernels", *(f"seed {s}" for s in seeds)],
                 [[*k, *(cells[k].get(s, "") for s in seeds)] for k in order],
                 ["---", "---", "---"] + ["---:"] * len(seeds))


def catalogue_copy() -> str:
    s, long = study("catalogue_copy"), study("catalogue_copy_20k")
    key = lambda p: (p["encoding"], p["backend"])  # noqa: E731
    at_n = {k: num(r["id_score_mean"]) for k, r in headline_by(long, lambda p: (p["encoding"], p["backend"])).items()}
    order = sorted(k for k in length_cells(s, "exact_match", key)[1])
    return by_length(s, "exact_match", key, ["encoding", "backend"], order,
                     extra={"train s": train_seconds(s, key), "n=16, 20k steps": at_n})


def randomized_copy() -> str:
    s = study("randomized_copy")
    key = lambda p: (p["encoding"], str(p["max_position"]))  # noqa: E731
    order = [(e, m) for m in ("129", "512") for e in ("rope", "sinusoidal")]
    return by_length(s, "exact_match", key, ["encoding", "`train.max_position`"], order)


def chomsky_encoder() -> str:
    s = study("chomsky_encoder")
    order = [(t, e) for t in ("even_pairs", "cycle_navigation", "bucket_sort", "odds_first")
             for e in ("nope", "rope", "alibi")]
    return by_length(s, "exact_match", by_task_encoding, ["task", "encoding"], order,
                     length_name=lambda n: "n=16 (N)" if n == 16 else f"n={n}")


def kazemnejad_causal() -> str:
    s = study("kazemnejad_causal")
    # the tasks this budget learned; the others are named in the text
    order = [(t, e) for t in ("duplicate", "parity") for e in ("nope", "rope", "alibi", "t5")]
    return by_length(s, "exact_match", by_task_encoding, ["task", "encoding"], order, by="ratio",
                     length_name=lambda r: "N" if r == 1 else f"{r:g}N")


def addition_20k() -> str:
    s = study("addition_20k")
    head = headline_by(s, by_encoding)
    _, exact = length_cells(s, "exact_match", by_encoding)
    _, tokens = length_cells(s, "token_acc", by_encoding)
    rows = [[e, exact[(e,)][4], num(head[(e,)]["id_score_mean"]), num(head[(e,)]["ood_score_mean"]),
             tokens[(e,)][8]] for e in ("nope", "rope")]
    return table(["encoding", "exact match at N/2", "at N", "past N", "token accuracy at N"], rows)


def grid_extrapolation() -> str:
    s = study("grid_extrapolation/seed0", "grid_extrapolation/seeds12", metric="token_acc")
    tasks = ("life", "grid_flip", "grid_row_count", "grid_nearest")
    records = headline_by(s, by_task_encoding)
    best = {t: max((r["ood_score_mean"], e) for (task, e), r in records.items() if task == t)[1] for t in tasks}
    encodings = ("rope_2d", "rope_mixed", "t5_2d", "alibi_2d", "sinusoidal_2d", "learned_2d", "rope", "alibi", "nope")
    names = {"rope": "`rope` (raster)", "alibi": "`alibi` (raster)"}
    rows = []
    for e in encodings:
        cells = []
        for t in tasks:
            r = records[(t, e)]
            score = f"{num(r['ood_score_mean'])} ± {num(r['ood_score_std'])}"
            cells.append(f"{f'**{score}**' if best[t] == e else score} ({num(r['id_score_mean'])})")
        rows.append([names.get(e, f"`{e}`"), *cells])
    return table(["encoding", *tasks], rows, ["---"] * (len(tasks) + 1))


def scale_size(p: dict) -> str:
    return {32: "xs", 64: "small", 128: "medium"}[p["model.d_model"]]


def scale_task(p: dict) -> str:
    return p["task.variant"] if p["task"] == "copy" else p["task"]


def by_task_size_encoding(p: dict) -> tuple:
    return scale_task(p), scale_size(p), p["encoding"]


def seed_range(w: dict) -> str:
    """The range of the seeds to two decimals, one number when both ends print equal."""
    return num(w["min"], 2) if f"{w['min']:.2f}" == f"{w['max']:.2f}" else f"{num(w['min'], 2)}–{num(w['max'], 2)}"


def scale_study() -> str:
    s = study("scale_study/xs", "scale_study/small")
    window = run_window_mean(s, "exact_match", 1, 2, by_task_size_encoding)
    at_n = {k: r["id_score_mean"] for k, r in headline_by(s, by_task_size_encoding).items()}
    columns = [(t, z) for t in ("cmc", "rsc", "sort") for z in ("xs", "small")]
    rows = []
    for e in CORE:
        cells = []
        for column in columns:
            k = (*column, e)
            w = window[k]
            best = max(window[(*column, other)]["mean"] for other in CORE)
            mean = f"**{num(w['mean'])}**" if w["mean"] == best and best < 1 else num(w["mean"])
            cells.append(f"{mean} ({seed_range(w)}) [{num(at_n[k], 2)}]")
        rows.append([f"`{e}`", *cells])
    return table(["encoding", *(f"{t} `{z}`" for t, z in columns)], rows, ["---"] * (len(columns) + 1))


def scale_study_eos() -> str:
    """copy with the stop scored: small_eos/ and medium_eos/."""
    s = study("scale_study/small_eos", "scale_study/medium_eos")
    exact = run_window_mean(s, "exact_match", 1, 2, by_task_size_encoding)
    tokens = run_window_mean(s, "token_acc", 1, 2, by_task_size_encoding)
    columns = [(t, z) for t in ("rsc", "cmc") for z in ("small", "medium")]

    def cell(k) -> str:
        e, t = exact[k], tokens[k]
        seeds = "" if e["n"] == 3 else f", {e['n']} seed{'s' if e['n'] > 1 else ''}"
        return f"{num(e['mean'])} ({num(e['min'], 2)}–{num(e['max'], 2)}{seeds}) [{num(t['mean'])}]"
    rows = [[f"`{e}`", *(cell((*column, e)) for column in columns)] for e in CORE]
    return table(["encoding", *(f"{t} `{z}`" for t, z in columns)], rows, ["---"] * (len(columns) + 1))


def scale_study_medium() -> str:
    s = study("scale_study/medium")
    window = run_window_mean(s, "exact_match", 1, 2, lambda p: (scale_task(p), p["encoding"]))
    at_n = {k: r["id_score_mean"] for k, r in headline_by(s, lambda p: (scale_task(p), p["encoding"])).items()}
    tasks = ("cmc", "rsc", "sort")

    def cell(k) -> str:
        if k not in window:
            return "–"
        w = window[k]
        spread_text = ("1 seed" if w["n"] == 1 else seed_range(w) if w["n"] == 3
                       else f"{seed_range(w)}, {w['n']} seeds")
        return f"{num(w['mean'])} ({spread_text}) [{num(at_n[k], 2)}]"
    rows = [[f"`{e}`", *(cell((t, e)) for t in tasks)] for e in CORE]
    return table(["encoding", *tasks], rows, ["---"] * (len(tasks) + 1))


def report_sweep() -> str:
    s = study("report_sweep")
    rows = []
    for _, r in s.headline.iterrows():  # the report's order: task, then rank, not-learned groups last
        rows.append([r["task"], r["encoding"], report.pm(r, "id_score"), report.pm(r, "ood_score"),
                     report.pm(r, "extrapolation_ratio", "ratio"), report.rank_text(r)])
    ranking = report.ranking_table(s.headline)
    mrr = ", ".join(f"{r['label']} {r['mrr']:.2f}" for _, r in ranking.iterrows())
    return (table(["task", "encoding", "at N", "past N (OOD)", "L / N", "rank"], rows, ["---"] * 6)
            + f"\nMean reciprocal rank of the OOD score over the three tasks (0 for a task not learned): {mrr}.\n")


def lm_key(p: dict) -> tuple:
    return (p["encoding"],)


def lm_extrapolation() -> str:
    s = study("lm_extrapolation")
    order = [(e,) for e in ("alibi", "learned", "rope", "sinusoidal", "t5")]
    return by_length(s, "perplexity", lm_key, ["encoding"], order, digits=2, length_name=str)


def lm_extrapolation_sliding() -> str:
    s = study("lm_extrapolation")
    order = [(e,) for e in ("alibi", "learned", "rope", "sinusoidal", "t5")]
    return by_length(s, "sliding_perplexity", lm_key, ["encoding"], order, digits=2, length_name=str)


def lm_memory() -> str:
    s = study("lm_memory")
    rows = []
    for metric, name in (("perplexity", "non-overlapping windows"), ("sliding_perplexity", "sliding windows"),
                         ("recurrent_perplexity", "segment recurrence, memory 64")):
        lengths, cells = length_cells(s, metric, by_encoding, 2)
        rows.append([name, *(cells[("transformer_xl",)][n] for n in lengths)])
    return table(["protocol", *map(str, lengths)], rows)


def scaling_name(p: dict) -> tuple:
    factor = p.get("encoding.scaling_factor")
    return (p["encoding.scaling"] + (f", s = {factor:g}" if factor else ""),)


def rope_scaling() -> str:
    s = study("rope_scaling")
    order = [(n,) for n in ("none", "pi", "pi, s = 8", "ntk", "ntk, s = 8", "dynamic_ntk", "yarn", "yarn, s = 8")]
    return by_length(s, "perplexity", scaling_name, ["scaling"], order, digits=2,
                     length_name=lambda n: "64 (N)" if n == 64 else str(n))


def rope_finetune() -> str:
    s = study("rope_finetune")
    key = lambda p: ("no scaling" if p["encoding.scaling"] == "none" else p["encoding.scaling"],)  # noqa: E731
    order = [(n,) for n in ("no scaling", "pi", "ntk", "yarn")]
    return by_length(s, "perplexity", key, ["fine-tuned at 128 with"], order, digits=2,
                     length_name=lambda n: "128 (new N)" if n == 128 else str(n))


def frontier_method(p: dict) -> str:
    """The configs/frontier_method option a run's settings come from."""
    if p["encoding"] == "rope" and p.get("encoding.frequency_fraction", 1.0) != 1.0:
        return "p_rope"
    if p["encoding"] == "grape":
        return {"multiplicative": "grape_m", "additive": "grape_a", "path": "grape_ap"}[p["encoding.form"]]
    return {"composite": "ssmax", "schedule": "rnope"}.get(p["encoding"], p["encoding"])


def frontier_task(p: dict) -> str:
    """The configs/frontier_task option: flip-flop by its evaluation density."""
    if p["task"] == "flip_flop":
        return {0.98: "flip_flop_sparse", 0.1: "flip_flop_dense"}.get(p.get("task.eval_p_ignore"), "flip_flop")
    return p["task"]


def frontier_key(task: str):
    """settings -> the run's frontier method when it ran this frontier task, else None (left out)."""
    def key(p: dict) -> str | None:
        return frontier_method(p) if frontier_task(p) == task else None
    return key


def ranged(w: dict, digits: int, bold: bool = False) -> str:
    """A spread over seeds: the mean (in bold if asked), and the range when its ends print differently."""
    mean = f"**{num(w['mean'], digits)}**" if bold else num(w["mean"], digits)
    same = f"{w['min']:.{digits}f}" == f"{w['max']:.{digits}f}"
    return mean + ("" if same else f" ({num(w['min'], digits)}–{num(w['max'], digits)})")


def frontier(task: str) -> str:
    """experiment=frontier on one task: each method's score at N and past it (mean and range over
    seeds), with its training throughput and its evaluation memory at the longest length."""
    s = study("frontier")
    key = frontier_key(task)
    records = headline_by(s, key)
    metric = next(iter(records.values()))["metric"]
    lower = lower_is_better(metric)
    digits = 2 if lower else 3
    at_n, near, far = (run_window_mean(s, metric, low, high, key) for low, high in ((0.99, 1), (1, 2), (1, math.inf)))
    settings = group_params(s)
    rows_of = {k: part for group, part in s.frame.groupby("group", sort=False) if (k := key(settings[group]))}
    longest = {k: part[part["eval_length"] == part["eval_length"].max()] for k, part in rows_of.items()}

    def order(method: str):
        score = near[method]["mean"] if method in near else math.nan
        return (report.not_learned(records[method]), score if lower else -score)

    rows = []
    for method in sorted(records, key=order):
        learned = "not learned" if report.not_learned(records[method]) else "yes"
        part = rows_of[method]
        rows.append([f"`{method}`", str(part["seed"].nunique()), ranged(at_n[method], digits), learned,
                     ranged(near[method], digits), ranged(far[method], digits),
                     f"{part.drop_duplicates('run_id')['train_tokens_per_s'].mean():,.0f}",
                     f"{longest[method]['peak_mem_mb'].max():,.0f}"])
    header = ["method", "seeds", f"{metric} at N", "learned at N", "(N, 2N]", "(N, longest]", "train tokens/s",
              "eval peak MiB at the longest"]
    return table(header, rows, ["---", "---:", "---:", "---", "---:", "---:", "---:", "---:"])


FRONTIER_TASKS = (  # (task, column, the window past N it is scored over, in units of N)
    ("copy", "copy, stop scored", (1, 2)), ("flip_flop_sparse", "flip-flop, sparse", (1, 2)),
    ("wikitext", "WikiText-2 bytes, perplexity over (N, 8N]", (1, math.inf)), ("counting", "counting", (1, 2)))
FRONTIER_COST = REFERENCE / "frontier" / "cost.csv"  # scripts/benchmark_encodings.py --methods ... --out
FRONTIER_2025_COST = REFERENCE / "frontier" / "cost_2025.csv"  # the same for issue 38's methods, with its own nope


def frontier_costs(path: Path) -> dict[str, dict[int, float]]:
    """method -> copy's n -> training tokens/s against nope's in the same benchmark run."""
    cost = {}
    if path.exists():
        with path.open() as handle:
            for row in csv.DictReader(handle):
                if row["status"] == "ok" and row["tokens_per_s_vs_nope"]:
                    cost.setdefault(row["encoding"], {})[int(row["length"])] = float(row["tokens_per_s_vs_nope"])
    return cost


def frontier_glance() -> str:
    """README: each frontier method's mean past N per task (over (N, 2N], WikiText over (N, 8N]), over seeds
    (their range), the best of a column in bold, "not learned" where the run misses the bar at N; beside
    them the training step's cost at the study's size on copy, against nope (FRONTIER_COST)."""
    s = study("frontier")
    columns, cells = [], {}
    for task, header, window in FRONTIER_TASKS:
        key = frontier_key(task)
        records = headline_by(s, key)
        if not records:
            continue
        metric = next(iter(records.values()))["metric"]
        lower = lower_is_better(metric)
        digits = 2 if lower else 3
        near = run_window_mean(s, metric, *window, key)
        learned = {m: w for m, w in near.items() if not report.not_learned(records[m])}
        best = (min if lower else max)(w["mean"] for w in learned.values()) if learned else None
        columns.append(header)
        for method, w in near.items():
            if method in FRONTIER_2025:  # copy only: their own line (frontier_2025_scores) keeps the README short
                continue
            if report.not_learned(records[method]):
                text = "not learned"
            else:
                text = ranged(w, digits, bold=w["mean"] == best)
                if w["n"] < 3:  # a method whose seeds were cut short
                    text += f" [{w['n']} seed{'s' if w['n'] > 1 else ''}]"
            cells.setdefault(method, {})[header] = text
    cost = frontier_costs(FRONTIER_COST)
    lengths = sorted({n for by_length in cost.values() for n in by_length})
    header = ["method", *columns, *(f"step time vs nope, copy n = {n}" for n in lengths)]
    rows = [[f"`{m}`", *(cells[m].get(c, "–") for c in columns),
             *(num(1 / cost[m][n], 2) if n in cost.get(m, {}) else "–" for n in lengths)] for m in sorted(cells)]
    return table(header, rows, ["---"] + ["---:"] * (len(header) - 1))


class Claim(NamedTuple):
    method: str
    paper: str  # what the paper reports, with its setting
    task: str  # the frontier task that tests it
    baselines: tuple[str, ...]  # the methods the paper says it beats: the best of them measured here
    window: tuple[float, float]  # where, in units of N: (1, 2) = (N, 2N], (0.99, 1) = at N, (1.99, 2) = at 2N


FRONTIER_CLAIMS = (
    Claim("cope", "solves Flip-Flop where RoPE fails (Golovneva et al. 2024, abstract)", "flip_flop_sparse",
          ("rope",), (1, 2)),
    Claim("path", "0.0001% error on sparse flip-flop against RoPE's 40.3% (Yang et al. 2025, Table 1: one layer, "
          "two heads, tested on FFL(0.98) at the training length)", "flip_flop_sparse", ("rope",), (0.99, 1)),
    Claim("cope", "solves counting where RoPE fails (abstract; 4 layers, 256 wide, 3 or 5 variables)", "counting",
          ("rope",), (1, 2)),
    Claim("fox", "extrapolates in language modelling where RoPE does not (760M, 48B tokens, trained at 16k)",
          "wikitext", ("rope",), (1, math.inf)),
    Claim("stick_breaking", "trained at 2^11, better perplexity at 2^14 (350M, 15B tokens, WikiText)", "wikitext",
          ("rope",), (1, math.inf)),
    Claim("dape", "trained at 128, better at 8192 than every static encoding, FIRE and ALiBi among them "
          "(125M, Arxiv and Books3)", "wikitext", ("nope", "rope", "alibi", "fire", "t5"), (1, math.inf)),
    Claim("ssmax", "beside RoPE, holds long-context loss and retrieval where softmax degrades (162M)", "wikitext",
          ("rope",), (1, math.inf)),
    Claim("path", "stable to 8x its training length where RoPE fails past it (760M, trained at 4k)", "wikitext",
          ("rope",), (1, math.inf)),
    Claim("p_rope", "0.75-RoPE 4.4414 against RoPE 4.4627 Wiki perplexity at the training length (Gemma 2B, 8k); "
          "not an extrapolation claim", "wikitext", ("rope",), (0.99, 1)),
    Claim("rnope", "RoPE and NoPE layers together beat RoPE on long context (Cohere, arXiv 2501.18795)",
          "wikitext", ("rope",), (1, math.inf)),
    Claim("pope", "trained at 1024, PG-19 perplexity flat to 10x where RoPE degrades (OWT, 124M-774M; a figure)",
          "wikitext", ("rope",), (1, math.inf)),
    Claim("fope", "perplexity more stable than RoPE's and ALiBi's past the training length (OLMo 60M-1.2B, C4; a "
          "figure)", "wikitext", ("rope", "alibi"), (1, math.inf)),
    Claim("scale_invariant", "trained at 4k, validation loss at 16k and 64k below RoPE's and ALiBi's (162M)",
          "wikitext", ("rope", "alibi"), (1, math.inf)),
    Claim("cable", "trained at 512, lower perplexity at 1024-8192 than sinusoidal, ALiBi and FoX (334M, FineWeb-Edu)",
          "wikitext", ("alibi", "fox"), (1, math.inf)),
    Claim("tape", "passkey retrieval past the training length above RoPE, FIRE and ALiBi (Llama-2-7B fine-tuned, "
          "a figure)", "passkey", ("rope", "fire", "alibi"), (1, math.inf)),
    Claim("string", "a longer effective context than RoPE's, training-free (Llama-3.1-70B: RULER's needles at "
          "128k); read at 2N, the furthest its shifted distances reach", "passkey", ("rope",), (1.99, 2)),
)


def claim_verdict(ours: dict, theirs: dict, lower: bool, digits: int) -> str:
    """"yes" when every seed of the method beats every seed of the baseline, "no" when every seed of the baseline
    beats every seed of the method; otherwise their means decide, said as such: "tie" when they print equal,
    "overlap, mean better" or "overlap, mean worse" over several seeds each, "... (1 seed)" before then."""
    def better(a: float, b: float) -> bool:
        return a < b if lower else a > b

    def worst(w: dict) -> float:
        return w["max"] if lower else w["min"]

    def best(w: dict) -> float:
        return w["min"] if lower else w["max"]

    seeds = ours["n"] > 1 and theirs["n"] > 1
    if seeds and better(worst(ours), best(theirs)):
        return "yes"
    if seeds and better(worst(theirs), best(ours)):
        return "no"
    if f"{ours['mean']:.{digits}f}" == f"{theirs['mean']:.{digits}f}":
        return "tie"
    direction = "better" if better(ours["mean"], theirs["mean"]) else "worse"
    if seeds:
        return f"overlap, mean {direction}"
    return f"{'yes' if direction == 'better' else 'no'} (1 seed)"


def frontier_claims() -> str:
    """docs/studies.md: each paper's claim against what the frontier study measured: the method against the
    best measured of the baselines the paper says it beats (by mean), on the task and lengths that test it,
    with claim_verdict's reading; "–" until both are measured."""
    s = study("frontier")
    rows = []
    for claim in FRONTIER_CLAIMS:
        key = frontier_key(claim.task)
        records = headline_by(s, key)
        scores = run_window_mean(s, next(iter(records.values()))["metric"], *claim.window, key) if records else {}
        lower = bool(records) and lower_is_better(next(iter(records.values()))["metric"])
        digits = 2 if lower else 3

        def measured(method: str) -> str:
            if method not in scores:
                return "–"
            w = scores[method]
            text = num(w["mean"], digits)
            if w["n"] > 1:
                text += f" ({num(w['min'], digits)}–{num(w['max'], digits)})"
            return text + ("" if w["n"] > 1 else ", 1 seed")

        measured_baselines = [b for b in claim.baselines if b in scores]
        baseline = (min if lower else max)(measured_baselines, key=lambda b: scores[b]["mean"]) \
            if measured_baselines else claim.baselines[0]
        verdict = claim_verdict(scores[claim.method], scores[baseline], lower, digits) \
            if claim.method in scores and baseline in scores else "–"
        low, high = claim.window
        if high - low < 0.05:  # one length
            where = "at N" if high == 1 else f"at {high:g}N"
        else:
            where = "(N, 2N]" if high == 2 else "(N, longest]"
        rows.append([f"`{claim.method}`", claim.paper, claim.task.replace("_", " "), where, measured(claim.method),
                     f"`{baseline}` {measured(baseline)}", verdict])
    header = ["method", "the paper's claim", "task", "where", "measured", "against (the best of its baselines)",
              "reproduced"]
    return table(header, rows, ["---", "---", "---", "---", "---:", "---:", "---"])


FRONTIER_2025 = ("grape_m", "grape_a", "grape_ap", "pope", "fope", "scale_invariant", "gated", "selective", "cable",
                 "drope", "string", "tape")  # issue 38's methods, after the baselines they are read against
FRONTIER_2025_BASELINES = ("rope", "alibi", "nope", "fox")


def frontier_2025(task: str, ratios: tuple[int, ...] = (1, 2, 4), past: int = 2,
                  baselines: tuple[str, ...] = FRONTIER_2025_BASELINES, with_cost: bool = False) -> str:
    """docs/studies.md: the 2025-26 methods on one frontier task beside their baselines (rope, alibi, nope and
    fox): the metric at each ratio of N and its mean over (N, past N], each the mean over seeds with their range;
    `with_cost`: the training step's time against nope's on copy (the study's size, scripts/benchmark_encodings.py)."""
    s = study("frontier")
    key = frontier_key(task)
    records = headline_by(s, key)
    metric = next(iter(records.values()))["metric"]
    digits = 2 if lower_is_better(metric) else 3
    at = {r: run_window_mean(s, metric, r - 0.01, r, key) for r in ratios}
    near = run_window_mean(s, metric, 1, past, key)
    cost = frontier_costs(FRONTIER_COST) | frontier_costs(FRONTIER_2025_COST) if with_cost else {}
    lengths = sorted({n for m in (*baselines, *FRONTIER_2025) for n in cost.get(m, {})})
    rows = [[f"`{m}`", str(near[m]["n"]), "not learned" if report.not_learned(records[m]) else "yes",
             *(ranged(at[r][m], digits) if m in at[r] else "–" for r in ratios), ranged(near[m], digits),
             *(num(1 / cost[m][n], 2) if n in cost.get(m, {}) else "–" for n in lengths)]
            for m in (*baselines, *FRONTIER_2025) if m in near]
    header = ["method", "seeds", "learned at N", f"{metric} at N", *(f"at {r}N" for r in ratios[1:]),
              f"(N, {past}N]", *(f"step time vs nope, copy n = {n}" for n in lengths)]
    return table(header, rows, ["---", "---:", "---"] + ["---:"] * (len(ratios) + 1 + len(lengths)))


def frontier_2025_scores(task: str) -> str:
    """One line: each 2025-26 method's mean over (N, 2N] on a frontier task, over seeds, best first;
    "not learned" where its runs miss the bar at N."""
    s = study("frontier")
    key = frontier_key(task)
    records = headline_by(s, key)
    near = run_window_mean(s, next(iter(records.values()))["metric"], 1, 2, key)
    methods = sorted((m for m in FRONTIER_2025 if m in near),
                     key=lambda m: (report.not_learned(records[m]), -near[m]["mean"], m))
    return ", ".join(f"`{m}` " + ("not learned" if report.not_learned(records[m]) else num(near[m]["mean"]))
                     for m in methods)


def frontier_2025_copy() -> str:
    return frontier_2025("copy", with_cost=True)


def frontier_2025_flip_flop_sparse() -> str:
    return frontier_2025("flip_flop_sparse")


def frontier_2025_wikitext() -> str:
    return frontier_2025("wikitext", (1, 2, 4, 8), past=8)


def frontier_2025_passkey() -> str:
    return frontier_2025("passkey", (1, 2, 3, 4), past=4, baselines=("rope", "alibi", "nope", "fire"))


def drope_pilot() -> str:
    """docs/studies.md: DroPE with the drop at half the steps (results/reference/drope_pilot), with and without
    its QK-norm, beside the frontier study's nope and rope on copy: exact match at N, 1.25N and 1.5N over seeds."""
    pilot, frontier_runs = study("drope_pilot"), study("frontier")
    ratios = (1, 1.25, 1.5)

    def pilot_key(p: dict) -> str:
        return f"`drope` drop_at {p['encoding.drop_at']}, qk_norm {str(p['encoding.qk_norm']).lower()}"

    def baseline_key(p: dict) -> str | None:
        method = frontier_key("copy")(p)
        return f"`{method}` (the study's)" if method in ("nope", "rope") else None

    rows = []
    for s, key in ((frontier_runs, baseline_key), (pilot, pilot_key)):
        at = {r: run_window_mean(s, "exact_match", r - 0.01, r, key) for r in ratios}
        rows += [[k, str(at[1][k]["n"]), *(ranged(at[r][k], 3) for r in ratios)] for k in sorted(at[1])]
    return table(["run", "seeds", "exact_match at N", "at 1.25N", "at 1.5N"], rows, ["---", "---:"] + ["---:"] * 3)


def frontier_copy() -> str:
    return frontier("copy")


def frontier_flip_flop_sparse() -> str:
    return frontier("flip_flop_sparse")


def frontier_wikitext() -> str:
    return frontier("wikitext")


def frontier_counting() -> str:
    return frontier("counting")


GPU = ROOT / "results" / "gpu"
NO_GPU_FILES = ("No GPU measurement is committed yet: `scripts/gpu_session.sh` runs `scripts/gpu_measure.py` on "
                "one device and its files go to `results/gpu/<device>/`.\n")


def gpu_files(name: str) -> list[tuple[str, list[dict]]]:
    """(device folder, rows) of every results/gpu/<device>/<name> committed."""
    found = []
    for path in sorted(GPU.glob(f"*/{name}")):
        with path.open(newline="") as handle:
            found.append((path.parent.name, list(csv.DictReader(handle))))
    return found


def gpu_encodings() -> str:
    """Per device and training mode: each encoding's tokens/s against nope on the backend auto gives it, by
    sequence length, and where the backend is a choice, the fastest one measured there."""
    found = gpu_files("encodings.csv")
    if not found:
        return NO_GPU_FILES
    out = []
    for device, rows in found:
        for mode in dict.fromkeys(r["mode"] for r in rows):
            here = [r for r in rows if r["mode"] == mode]
            lengths = sorted({int(r["tokens"]) for r in here if r["status"] == "ok"})
            if not lengths:  # a mode the device call did not reach
                continue
            out += [f"`{device}`, training `{mode}`: tokens/s against nope's at the same length (auto's backend; "
                    "the fastest measured backend in brackets where it is another)", "",
                    "| encoding | auto | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |",
                    "|---|---|" + "---:|" * len(lengths)]
            for encoding in dict.fromkeys(r["encoding"] for r in here):
                mine = [r for r in here if r["encoding"] == encoding and r["status"] == "ok"]
                auto = {int(r["tokens"]): r for r in mine if r["auto"] == "True"}
                cells = []
                for n in lengths:
                    named = [r for r in mine if r["auto"] == "False" and int(r["tokens"]) == n]
                    best = max(named, key=lambda r: float(r["tokens_per_s"]), default=None)
                    cell = f"{float(auto[n]['vs_nope']):.2f}" if n in auto and auto[n]["vs_nope"] else "–"
                    if best is not None and n in auto and best["backend"] != auto[n]["backend"]:
                        cell += f" ({best['backend']} {float(best['vs_nope']):.2f})"
                    cells.append(cell)
                backend = next(iter(auto.values()))["backend"] if auto else "–"
                out.append(f"| {encoding} | {backend} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


def gpu_table(name: str, header: list[str], align: str, cells) -> str:
    """A table with a row per row of every results/gpu/<device>/<name>: cells(device, row) -> its cells."""
    found = gpu_files(name)
    if not found:
        return NO_GPU_FILES
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    out += ["| " + " | ".join(map(str, cells(device, r))) + " |" for device, rows in found for r in rows]
    return "\n".join(out) + "\n"


def default_job_cells(device: str, r: dict) -> list:
    if r.get("status", "ok") != "ok":
        return [r["device"], r.get("compile", ""), r["status"], "", "", "", "", ""]
    timed = f"{float(r['train_tokens_per_s']):,.0f}" if r.get("train_tokens_per_s") else "–"
    return [r["device"], r.get("compile", "eager"), f"{float(r['wall_s']):.1f}", f"{float(r['train_s']):.1f}",
            r.get("train_steps_per_s", "–"), timed, f"{float(r['exact_match_at_n']):.3f}", f"`{r['data_fingerprint']}`"]


def gpu_default_job() -> str:
    return gpu_table("default_job.csv", ["device", "train.compile", "wall s", "train s", "steps/s (all training)",
                                         "tokens/s (after 10 steps)", "exact match at N", "data_fingerprint"],
                     "llrrrrrl", default_job_cells)


def gpu_sweep() -> str:
    return gpu_table("sweep.csv", ["device", "runs", "at a time", "wall min", "runs/hour", "training steps/s (all runs)",
                                   "the study (156 runs), min", "how"], "lrrrrrrl",
                     lambda device, r: [f"`{device}`", r["runs"], r["concurrent"], f"{float(r['wall_min']):.1f}",
                                        r["runs_per_hour"], r.get("train_steps_per_s") or "–",
                                        r["extrapolated_study_min"] or "–", r["note"]])


def guard_memory() -> str:
    """docs/performance.md: the memory guard's estimate against the measured peak, every encoding at 4,095 tokens
    (results/reference/guard_memory.csv, scripts/memory_guard_check.py)."""
    with (REFERENCE / "guard_memory.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    cells = {}
    for r in rows:
        cells.setdefault((r["encoding"], r["setting"]), {})[r["mode"]] = r
    out = []
    for (encoding, setting), modes in cells.items():
        row = [f"{encoding} `{setting}`" if setting else encoding]
        for mode in ("train", "eval"):
            r = modes.get(mode)
            tokens = "" if r is None or int(r["tokens"]) == 4095 else f" ({int(r['tokens']):,} tokens)"
            row += ["–"] * 3 if r is None else [f"{float(r['estimate_mib']):,.0f}", f"{float(r['measured_mib']):,.0f}",
                                                f"{float(r['ratio']):.2f}{tokens}"]
        out.append(row)
    header = ["encoding", "training: estimate MiB", "measured MiB", "ratio", "evaluation: estimate MiB",
              "measured MiB", "ratio"]
    return table(header, out)


TABLES = {f.__name__.replace("_", "-"): f for f in (
    glance, quickstart, default_job_seeds, core_copy_sort, catalogue_copy, randomized_copy, chomsky_encoder, kazemnejad_causal, addition_20k,
    grid_extrapolation, scale_study, scale_study_eos, scale_study_medium, report_sweep, lm_extrapolation,
    lm_extrapolation_sliding, lm_memory, rope_scaling, rope_finetune, frontier_glance, frontier_claims,
    frontier_copy, frontier_flip_flop_sparse, frontier_wikitext, frontier_counting, frontier_2025_copy,
    frontier_2025_flip_flop_sparse, frontier_2025_wikitext, frontier_2025_passkey, drope_pilot, gpu_encodings, gpu_default_job,
    gpu_sweep, guard_memory)}


# ---- the inline values -----------------------------------------------------------------------------

WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def count(n: int) -> str:
    """A count as the docs write it: a word below ten, else digits with thousands separators."""
    return WORDS[n] if n < len(WORDS) else f"{n:,}"


def duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


def encodings(*args: str) -> str:
    """The configs/encoding options (`dims=2`: those of 2-D encodings, by the registry's position_dims)."""
    from posbench.encodings import REGISTRY
    dims = dict(a.split("=") for a in args).get("dims")
    names = [p.stem for p in ENCODINGS.glob("*.yaml")]
    return count(sum(dims is None or REGISTRY[n].position_dims == int(dims) for n in names))


def axes(*overrides: str) -> dict[str, int]:
    """{key: how many values} of what `python -m posbench -m OVERRIDES` sweeps: the config's sweeper params,
    the command line's sweeps over them, expanded by Hydra (globs over the config groups included)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from tests.helpers import CONFIGS, multirun_config
    params = multirun_config(*overrides).hydra.sweeper.params or {}
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        parsed = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + list(overrides))
    sizes = {o.get_key_element(): len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1
             for o in parsed}
    return {key: n for key, n in sizes.items() if n > 1}


def sweep(*overrides: str) -> str:
    """The runs of `python -m posbench -m OVERRIDES`."""
    return f"{math.prod(axes(*overrides).values()):,}"


def sweep_axes(*overrides: str) -> str:
    """The same as a product: "31 × 24 × 3 = 2,232", axes in the sweep's order."""
    sizes = axes(*overrides).values()
    return " × ".join(map(str, sizes)) + f" = {math.prod(sizes):,}"


def axis(key: str, *overrides: str) -> str:
    """How many values the sweep takes for one key (`task`, `encoding`, `seed`, ...)."""
    return count(axes(*overrides)[key])


@cache
def rows(*dirs: str):
    return collect([REFERENCE / d for d in dirs])


FILTER = re.compile(r"(?P<column>\w+)(?P<op>>=|<|=)(?P<value>.*)")
COMPARE = {"=": lambda a, b: a == b, "<": lambda a, b: a < b, ">=": lambda a, b: a >= b}


def runs_of(args: tuple[str, ...]) -> list:
    """args: directories under results/reference/ and filters column=value, column<value or column>=value
    (compared as text, so ISO times order: time<2026-11-27); one frame per run, of the rows that pass."""
    filters = [m for a in args if (m := FILTER.fullmatch(a))]
    frame = rows(*(a for a in args if not FILTER.fullmatch(a)))
    for m in filters:
        frame = frame[COMPARE[m["op"]](frame[m["column"]].astype(str), m["value"])]
    return [part for _, part in frame.groupby("run_id")]


def run_span(part) -> tuple[datetime, datetime]:
    """A run's start (its first row's time less its training) and end (its last row's time): a lower
    bound, as the time before training and the first length's evaluation are in neither."""
    times = sorted(map(datetime.fromisoformat, part["time"]))
    return times[0] - timedelta(seconds=float(part["train_seconds"].iloc[0])), times[-1]


def runs(*args: str) -> str:
    return count(len(runs_of(args)))


def cost(*args: str) -> str:
    """What the runs took of both cores: their spans summed, over 2 (two single-thread jobs at a time)."""
    return duration(sum((end - start).total_seconds() for start, end in map(run_span, runs_of(args))) / 2)


def wall(*args: str) -> str:
    """From the first run's start to the last run's end: a sweep that ran in one go."""
    spans = list(map(run_span, runs_of(args)))
    return duration((max(end for _, end in spans) - min(start for start, _ in spans)).total_seconds())


def train_range(*args: str) -> str:
    """The runs' training seconds: "100–206 s, median 155 s"."""
    seconds = sorted(float(part["train_seconds"].iloc[0]) for part in runs_of(args))
    middle = (seconds[(len(seconds) - 1) // 2] + seconds[len(seconds) // 2]) / 2
    return f"{seconds[0]:.0f}–{seconds[-1]:.0f} s, median {middle:.0f} s"


def cases(module: str, *tests: str) -> str:
    """The test cases of these test functions of a test module: their parametrisations' product, 1 unparametrised."""
    found = importlib.import_module(module)
    total = 0
    for name in tests:
        marks = [m for m in getattr(getattr(found, name), "pytestmark", []) if m.name == "parametrize"]
        total += math.prod(len(m.args[1]) for m in marks)
    return count(total)


def length(module: str, name: str) -> str:
    """len() of a module's object: a test module's table of cases or settings."""
    return count(len(getattr(importlib.import_module(module), name)))


def suite_size() -> int:
    """pytest's count of the suite's tests: a collection in one process (some seconds)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "",  # slow ones too
                           "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
    found = re.search(r"^(\d+) tests? collected", done.stdout, re.M)
    if done.returncode or not found:
        raise SystemExit(f"pytest --collect-only failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return int(found[1])


def tests_text(n: int) -> str:
    """"over 4,300": the suite's size rounded down to the hundred, so it holds until the next hundred."""
    return f"over {n // 100 * 100:,}"


VALUES = {f.__name__.replace("_", "-"): f for f in (
    encodings, sweep, sweep_axes, axis, runs, cost, wall, train_range, cases, length, frontier_2025_scores)}
VALUES["tests"] = lambda: tests_text(suite_size())


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def regenerate(text: str, page: Path, values: dict, skip: set) -> tuple[str, list[str]]:
    """The page with its tables and values rebuilt, and what changed ("table NAME", "line N: value ...")."""
    where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
    changed = []

    def block(match):
        name = match["name"]
        if name not in TABLES:
            raise SystemExit(f"{where}: unknown table {name!r}; known: {sorted(TABLES)}")
        body = TABLES[name]()
        if body != match["body"]:
            changed.append(f"table {name}")
        return match[1] + body + match[4]

    def inline(match):
        name, args = match["name"], match["args"].split()
        if name not in values:
            raise SystemExit(f"{where}: unknown value {name!r}; known: {sorted(values)}")
        body = match["body"] if name in skip else values[name](*args)
        if body != match["body"]:
            line = text.count("\n", 0, match.start()) + 1
            changed.append(f"line {line}: value {' '.join([name, *args])} is {body!r}, not {match['body']!r}")
        return match[1] + body + match[5]

    new = INLINE.sub(inline, MARKER.sub(block, text))
    return new, changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table or value differs")
    parser.add_argument("--tests", type=int, help="the suite's collected tests, when known (else pytest collects them)")
    parser.add_argument("--skip", action="append", default=[], help="a value left as the page has it (repeatable)")
    args = parser.parse_args(argv)
    values = dict(VALUES)
    if args.tests is not None:
        values["tests"] = lambda: tests_text(args.tests)
    drift, used = [], set()
    for page in pages():
        text = page.read_text()
        used |= {m["name"] for m in MARKER.finditer(text)}
        new, changed = regenerate(text, page, values, set(args.skip))
        drift += [f"{page.relative_to(ROOT)}: {change}" for change in changed]
        if changed and not args.check:
            page.write_text(new)
    unused = sorted(set(TABLES) - used)
    if unused:
        print(f"tables no page shows: {unused}", file=sys.stderr)
    if drift:
        verb = "differs from its source" if args.check else "rewritten"
        print("\n".join(f"{line}: {verb}" for line in drift), file=sys.stderr)
        if args.check:
            print("run `python scripts/docs_tables.py` to rewrite them", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
