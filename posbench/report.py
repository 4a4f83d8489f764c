"""`python -m posbench.report DIR [DIR ...] [--out OUT] [--metric M] [--threshold T]`

Collects every results.jsonl under the given run or sweep directories and writes to OUT
(default: the first directory): results.csv (every row), summary.csv (per group and
evaluation length: mean, std, min, max, n over seeds), headline.csv (per group: the
headline metrics of posbench.headline over seeds, cost at the longest length, the
ranking), published.csv (the paper's numbers an experiment states beside the groups'
own, posbench.published), the figures, report.md and a self-contained report.html.

A group is one configuration minus the seed: runs that differ in anything else (encoding
parameters, task parameters, model, N, position scheme, training steps, ...) stay apart.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import itertools
import json
import math
import re
import sys
from functools import cache
from pathlib import Path

from posbench.headline import (DEFAULT_THRESHOLD, HEADLINE_METRICS, LEARNED_AT_N, SCORES, criterion, learned,
                               lower_is_better, primary_metric, run_headline, spread)
from posbench.results import (METRIC_LABELS, Skipped, collect, plot_cost, plot_curves, plot_heatmap,
                              plot_ranking, plot_scaling, read_run_files, read_yaml, skipped_lines, skipped_summary)
from posbench import published
from posbench.checks import Choice
from posbench.rundir import FINAL_STATES, STATUS_FILE, describe
from posbench.runinfo import flatten, with_added_settings
from posbench.sweeps import read_multirun, sweep_progress

# Row columns that define a configuration besides task, encoding and the three parameter dicts.
SETTING_COLUMNS = ("backend", "train_length", "train_lengths", "positions", "max_position", "steps", "init_steps")
PARAM_COLUMNS = {"encoding_params": "encoding.", "task_params": "task.", "model": "model."}
# where the data lives, not what it is; a trait older rows recorded as a parameter
IGNORED_PARAMS = ("task.data_dir", "task.cache_dir", "encoding.replaces_token_embedding")
SHORT_NAMES = {"train_length": "N", "train.length": "N"}
COST_COLUMNS = ("eval_tokens_per_s", "peak_mem_mb")


@cache
def read_config(source: str) -> tuple[dict, Skipped | None]:
    """The run directory's resolved config.yaml ({} when absent), and why it could not be used
    when it could not: the run's steps and lengths then come from its rows."""
    file = Path(source) / "config.yaml"
    try:
        config, where, reason = read_yaml(file)
    except (FileNotFoundError, IsADirectoryError):
        return {}, None
    if reason is None:
        problem = config_problem(config)
        if problem is None:
            return config or {}, None
        where, reason = None, problem
    return {}, Skipped(file, where, f"{reason} (the run's steps and lengths come from its rows)", whole_file=True)


def config_problem(config) -> str | None:
    """Why a parsed config.yaml cannot give the run's steps and lengths, or None: not a mapping, a
    train: or eval: section that is not one, or a train.steps that is not a whole number."""
    if config is None:
        return None
    if not isinstance(config, dict):
        return "not a mapping of settings"
    for section in ("train", "eval"):
        value = config.get(section)
        if value is not None and not isinstance(value, dict):
            return f"{section}: is {json.dumps(value, default=str)[:40]}, not a mapping of settings"
    steps = (config.get("train") or {}).get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
        return f"train.steps: is {json.dumps(steps, default=str)[:40]}, not a whole number"
    return None


def run_config(source: str) -> dict:
    return read_config(source)[0]


def unreadable_configs(sources) -> list[Skipped]:
    """The config.yaml files of these run directories that could not be used."""
    return [problem for source in sorted(set(sources)) if (problem := read_config(source)[1])]


def configured_steps(source: str) -> int | None:
    """train.steps the run was given: a diverged run's rows record the steps it got through."""
    steps = (run_config(source).get("train") or {}).get("steps")  # read_config checked its type
    return int(steps) if steps is not None else None


def configured_lengths(source: str, train_length: int) -> list[int] | None:
    """The evaluation lengths the run was configured for (None without its config.yaml)."""
    from omegaconf import OmegaConf

    from posbench.build import eval_lengths

    evaluation = run_config(source).get("eval")
    try:
        return eval_lengths(OmegaConf.create(evaluation), train_length) if evaluation else None
    except (AttributeError, KeyError, TypeError, ValueError):  # a config.yaml of another layout
        return None


def _plain(value):
    """JSON-stable python value: numpy scalars unwrapped, integral floats as int, NaN as None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if value.is_integer():
            return int(value)
    return value


def settings(row) -> dict:
    """The configuration of a row's run as flat keys (encoding.*, task.*, model.*, N, ...)."""
    flat = {}
    for column, prefix in PARAM_COLUMNS.items():
        params = json.loads(row[column]) if isinstance(row[column], str) else {}
        flat |= {f"{prefix}{key}": _plain(v) for key, v in params.items()}
    flat |= {column: _plain(row[column]) for column in SETTING_COLUMNS}
    # a null setting is one not set: rows written before a parameter existed group with those that leave it null
    return {key: v for key, v in flat.items() if key not in IGNORED_PARAMS and v is not None}


def group_settings(row) -> tuple[str, dict]:
    """A row's group key and its settings as flat keys. Rows with a config_hash are grouped by
    it (the whole configuration minus the seed, posbench.runinfo); older rows by their columns."""
    if isinstance(row.get("config_hash"), str) and isinstance(row.get("config"), str):
        config = with_added_settings(json.loads(row["config"]))  # what group_config left out, for the labels
        flat = {key: _plain(v) for key, v in flatten(config).items()}
        return row["config_hash"], {key: v for key, v in flat.items() if v is not None}
    flat = settings(row)
    return json.dumps({"task": row["task"], "encoding": row["encoding"], **flat}, sort_keys=True, default=str), flat


def setting_name(key: str) -> str:
    """How a setting is shown in a label: encoding parameters bare, N for the training length."""
    return SHORT_NAMES.get(key, key.removeprefix("encoding."))


HELD = {"composite": ("encoding.parts", "+"), "schedule": ("encoding.pattern", ",")}  # what names the whole


def holding(encoding: str, s: dict) -> tuple[str, set[str]]:
    """A composite or a schedule named by what it holds, composite(rope+ssmax), schedule(rope,rope,nope),
    and the setting that name shows (left out of the label's settings)."""
    key, joiner = HELD.get(encoding, (None, ""))
    held = s.get(key)
    if not isinstance(held, (list, tuple)) or not held:
        return encoding, set()
    return f"{encoding}({joiner.join(map(str, held))})", {key}


def parameter_count(n) -> str:
    """2.58k, 151k, 3.2M: a model size as the labels show it."""
    n = int(n)
    return f"{n / 1e6:.2g}M" if n >= 10**6 else f"{n / 1e3:.3g}k" if n >= 10**3 else str(n)


def add_groups(frame):
    """Adds steps (configured), group (a key: the configuration minus the seed), size (when
    groups of one task and encoding differ in model size, the parameter count of the model's
    smallest group, so an encoding's own parameters such as learned's table leave it at its
    model's size; else ""), curve_label (the encoding plus the other settings that tell its groups
    apart), setting (those settings other than the encoding's: the groups whose encodings are
    compared share it), encoding_label (curve_label less the setting), label (curve_label and
    the size: one per group) and devices (keep_costs_per_device)."""
    frame = frame.copy()
    frame["steps"] = [configured_steps(src) or _plain(done) for src, done in zip(frame["source"], frame["train_steps"])]
    firsts = frame.drop_duplicates("run_id")  # settings are per run: every row of a run joins its group
    per_run = {r["run_id"]: (r["task"], r["encoding"], *group_settings(r)) for _, r in firsts.iterrows()}
    frame["group"] = frame["run_id"].map({run: key for run, (_, _, key, _) in per_run.items()})
    per_group = {key: (t, e, s) for t, e, key, s in per_run.values()}
    varying = set()  # settings that tell apart groups of one task and encoding (not e.g. backend=auto's pick)
    for key in {k for _, _, s in per_group.values() for k in s}:
        seen: dict = {}
        for t, e, s in per_group.values():
            seen.setdefault((t, e), set()).add(json.dumps(s.get(key), default=str))
        if any(len(values) > 1 for values in seen.values()):
            varying.add(key)
    params = frame.groupby("group")["n_params"].first()
    model_keys = {k for k in varying if k.startswith("model.") or k == "model"}
    sizes = {}
    if model_keys and params.notna().all():  # a size axis: a parameter count names each model's settings
        model_of = {group: json.dumps([s.get(k) for k in sorted(model_keys)]) for group, (_, _, s) in per_group.items()}
        smallest: dict = {}
        for group, model in model_of.items():
            smallest[model] = min(smallest.get(model, params[group]), params[group])
        names = {model: parameter_count(n) for model, n in smallest.items()}
        if len(set(names.values())) == len(names):
            sizes = {group: names[model] for group, model in model_of.items()}
            varying -= model_keys
    curve_labels, comparable, encoding_labels = {}, {}, {}
    for group, (_, encoding, s) in per_group.items():
        encoding, named = holding(encoding, s)
        shown = [(k, f"{setting_name(k)}={s[k]}") for k in sorted(varying - named) if k in s]
        curve_labels[group] = " ".join([encoding, ", ".join(text for _, text in shown)]).strip()
        comparable[group] = ", ".join(text for k, text in shown if not k.startswith("encoding."))
        encoding_labels[group] = " ".join([encoding, ", ".join(text for k, text in shown
                                                               if k.startswith("encoding."))]).strip()
    frame["size"] = frame["group"].map(sizes).fillna("") if sizes else ""
    frame["curve_label"] = frame["group"].map(curve_labels)
    frame["setting"] = frame["group"].map(comparable)
    frame["encoding_label"] = frame["group"].map(encoding_labels)
    frame["label"] = [f"{c} [{z}]" if z else c for c, z in zip(frame["curve_label"], frame["size"])]
    return keep_costs_per_device(frame)


def keep_costs_per_device(frame):
    """Adds devices (each group's devices, sorted). Throughput and memory belong to a machine: in a
    group whose seeds ran on different devices they are blanked, not averaged across machines;
    its scores still pool, as the device is not part of the configuration."""
    frame = frame.copy()
    devices = frame.groupby("group")["device"].agg(lambda s: ", ".join(sorted(set(s.dropna().astype(str)))))
    frame["devices"] = frame["group"].map(devices)
    mixed = frame["devices"].str.contains(",", regex=False)
    costs = [c for c in ("train_tokens_per_s", *COST_COLUMNS) if c in frame]
    frame.loc[mixed, costs] = math.nan
    return frame


def task_metrics(frame, metric: str | None) -> dict[str, str]:
    """The headline metric of each task: the one asked for, else the task's primary metric."""
    chosen = {}
    for task, part in frame.groupby("task"):
        rows = part.to_dict("records")
        chosen[task] = metric or primary_metric(rows)
    return chosen


def run_table(frame, metrics: dict[str, str], threshold: float):
    """One row per run: its status, the lengths it finished and those it was configured for
    but did not measure, its headline metrics."""
    import pandas as pd

    grid = frame.groupby("group")["eval_length"].agg(lambda s: sorted({int(n) for n in s}))
    run_statuses = frame.attrs.get("input", {}).get("statuses", {})  # run directory -> its status.json
    records = []
    for run_id, part in frame.groupby("run_id", sort=False):
        rows = part.sort_values("eval_length").to_dict("records")
        first = rows[0]
        # the lengths its config asked for; without config.yaml, those any run of its group has
        expected = configured_lengths(first["source"], int(first["train_length"])) or grid[first["group"]]
        head = run_headline(rows, metrics[first["task"]], threshold, expected)
        finished = [int(r["eval_length"]) for r in rows if r["status"] == "ok"]
        statuses = [r["status"] for r in rows if r["status"] != "ok"]
        failed = [s for s in statuses if str(s).startswith("failed")]
        steps_done, steps = _plain(first["train_steps"]), first["steps"]
        recorded = run_statuses.get(first["source"])
        if recorded and recorded.get("run_id") not in (None, run_id):  # a directory shared by older runs
            recorded = None
        if failed:
            status = failed[0]
        elif recorded and recorded.get("state") not in FINAL_STATES:  # running, killed or failed per status.json
            status = describe(recorded)
        elif "diverged" in statuses:
            status = f"diverged after {steps_done} of {steps} steps"
        elif statuses:
            status = statuses[0]
        elif len(finished) < len(expected):
            status = "stopped early"
        else:
            status = "ok"
        records.append({
            "run_id": run_id, "run_name": first["run_name"], "group": first["group"], "label": first["label"],
            "task": first["task"], "encoding": first["encoding"], "seed": first["seed"], "source": first["source"],
            "status": status, "finished_lengths": finished, "missing_lengths": head.missing_lengths,
            "complete": head.complete, "metric": head.metric,
            **{score: getattr(head, score) for score in SCORES},
            "train_tokens_per_s": first["train_tokens_per_s"], "train_seconds": first["train_seconds"],
        })
    return pd.DataFrame(records)


def summary_table(frame):
    """One row per (group, evaluation length): the group's runs, n measured at this length,
    and mean, std (ddof 1), min, max over them of every measured metric and cost."""
    measured = [m for m in HEADLINE_METRICS if m in frame and frame[m].notna().any()]
    measured += [m for m in COST_COLUMNS if m in frame]  # kept when unmeasured: the cost figure says so
    ok = frame[frame["status"] == "ok"]
    keys = ["group", "label", "curve_label", "setting", "encoding_label", "size", "task", "encoding", "train_length",
            "eval_length"]
    base = frame.groupby(keys, sort=True).agg(ratio=("ratio", "first"))
    base["runs"] = base.index.get_level_values("group").map(frame.groupby("group")["run_id"].nunique())
    base = base.join(ok.groupby(keys).agg(n=("run_id", "nunique"),
                                          mem_kind=("mem_kind", lambda s: ",".join(sorted(set(s.dropna()))))))
    stats = ok.groupby(keys)[measured].agg(["mean", "std", "min", "max"])
    stats.columns = [f"{metric}_{stat}" for metric, stat in stats.columns]
    table = base.join(stats).reset_index()
    table["n"] = table["n"].fillna(0).astype(int)
    return table[[c for c in table.columns if c != "group"] + ["group"]]  # the long key last


def headline_table(frame, runs, summary, threshold: float):
    """One row per group: headline scores over seeds (mean, std, min, max, n), training
    throughput, and evaluation throughput and peak memory at the group's longest length."""
    import pandas as pd

    records = []
    for group, part in runs.groupby("group", sort=False):
        first = frame[frame["group"] == group].iloc[0]
        at_longest = summary[(summary["group"] == group)].sort_values("eval_length").iloc[-1]
        metric = part["metric"].iloc[0]
        record = {"label": first["label"], "curve_label": first["curve_label"], "setting": first["setting"],
                  "encoding_label": first["encoding_label"], "size": first["size"],
                  "n_params": first["n_params"], "task": first["task"], "encoding": first["encoding"], "metric": metric,
                  "criterion": criterion(metric, threshold), "train_length": first["train_length"],
                  "longest_length": at_longest["eval_length"], "runs": len(part),
                  "seeds": ",".join(map(str, sorted(part["seed"]))), "devices": first["devices"],
                  "incomplete_runs": int((~part["complete"]).sum())}
        for score in SCORES:
            record |= {f"{score}_{stat}": v for stat, v in spread(part[score]).items()}
        record["learned"] = learned(metric, record["id_score_mean"])
        record["learned_runs"] = (None if record["learned"] is None
                                  else sum(learned(metric, score) for score in part["id_score"]))
        record |= {f"train_tokens_per_s_{stat}": v for stat, v in spread(part["train_tokens_per_s"]).items()}
        for column in COST_COLUMNS:
            record |= {f"{column}_at_longest_{stat}": at_longest.get(f"{column}_{stat}", math.nan)
                       for stat in ("mean", "std", "min", "max")}
            record[f"{column}_at_longest_n"] = at_longest["n"]
        record["mem_kind"] = at_longest.get("mem_kind")
        record |= {column: first[column] for column in ("encoding_params", "task_params", "model", *SETTING_COLUMNS)}
        record["group"] = group
        records.append(record)
    return add_ranking(pd.DataFrame(records))


def add_ranking(headline):
    """rank_in_task: rank of the mean OOD score among the task's learned groups of one setting and
    model size (1 = best; ties share the better rank; a group without an OOD score ranks last; a group
    that did not learn the task, `learned` False, is not ranked: NaN); mrr: the mean over tasks of
    1 / rank for the group's rank_label (its encoding label and size; a task and setting, e.g. copy's
    cmc and rsc, counts as a task of its own: ranked_on), 0 on a task not learned, as a mean
    reciprocal rank counts an item never found, after Kazemnejad et al. (2023), who rank encodings
    by it; tasks: how many it ran on."""
    headline = headline.copy()
    headline["ranked_on"] = [f"{task} {setting}".strip() for task, setting in zip(headline["task"], headline["setting"])]
    headline["rank_label"] = [f"{e} [{z}]" if z else e for e, z in zip(headline["encoding_label"], headline["size"])]
    headline["rank_in_task"] = math.nan
    ranked = headline[headline["learned"].ne(False)]  # learned, or a metric without a bar (None)
    for _, part in ranked.groupby(["task", "setting", "size"]):
        ascending = lower_is_better(part["metric"].iloc[0])
        headline.loc[part.index, "rank_in_task"] = part["ood_score_mean"].rank(method="min", ascending=ascending,
                                                                                na_option="bottom")
    reciprocal = (1 / headline["rank_in_task"]).fillna(0.0)
    headline["mrr"] = reciprocal.groupby(headline["rank_label"]).transform("mean")
    headline["tasks"] = headline.groupby("rank_label")["ranked_on"].transform("nunique")
    return headline.sort_values(["task", "rank_in_task", "label"]).reset_index(drop=True)


def ranking_table(headline):
    """One row per rank label: its MRR, the number of tasks, how many of them it did not learn, and
    its rank on each (task and setting; NaN where not learned or not run)."""
    import pandas as pd

    ranks = headline.pivot_table(index="rank_label", columns="ranked_on", values="rank_in_task", aggfunc="first",
                                 dropna=False)  # keeps a task no group learned
    ranks.columns = [f"rank on {task}" for task in ranks.columns]
    mrr = headline.groupby("rank_label").agg(mrr=("mrr", "first"), tasks=("tasks", "first"),
                                             not_learned=("learned", lambda s: int(s.eq(False).sum())))
    table = pd.concat([mrr, ranks], axis=1).rename_axis("label").reset_index()
    return table.sort_values(["mrr", "label"], ascending=[False, True])


def published_table(frame, runs):
    """One row per (published entry, group it matches): the paper's number beside the group's,
    the mean over each run's evaluated lengths in the entry's range (posbench.published), then
    mean/std/min/max/n over the group's runs. Entries come from each run's config.yaml."""
    import pandas as pd

    records, rows_of_run = [], None
    for group, part in runs.groupby("group", sort=False):
        first = part.iloc[0]
        config = run_config(first["source"])
        try:
            references = published.parse(config.get(published.KEY))
        except ValueError as err:  # a block edited by hand after the run: say so, keep the report
            print(f"published numbers of {first['source']} not read: {err}")
            continue
        flat = flatten(config)
        for reference in references:
            value = reference.values.get(first["encoding"])
            if value is None or not reference.applies(first["task"], flat):
                continue
            if rows_of_run is None:  # split once, when some group has a published number
                rows_of_run = {run_id: rows.to_dict("records") for run_id, rows in frame.groupby("run_id")}
            per_run, lengths = [], set()
            for run_id in part["run_id"]:
                number, used = published.measured(rows_of_run[run_id], reference)
                per_run.append(number)
                lengths |= set(used)
            stats = spread(per_run)
            records.append({"source": reference.source, "setting": reference.setting(), "task": first["task"],
                            "label": first["label"], "encoding": first["encoding"], "metric": reference.metric,
                            "lengths": reference.span(), "lengths_measured": len(lengths),
                            "lengths_in_range": reference.lengths[1] - reference.lengths[0] + 1,
                            "published": value, **{f"posbench_{k}": v for k, v in stats.items()},
                            "difference": stats["mean"] - value, "note": reference.note, "group": group})
    return pd.DataFrame(records)


def published_rows(table) -> list[dict]:
    """The comparison as shown: published beside mean ± std (min..max, n runs) over the group."""
    rows = []
    for _, r in table.iterrows():
        spanned = (f"{r['lengths']} ({r['lengths_measured']} of {r['lengths_in_range']} measured)"
                   if r["lengths_measured"] < r["lengths_in_range"] else r["lengths"])
        rows.append({"setting": r["setting"], "group": r["label"], "metric": r["metric"], "lengths": spanned,
                     "published": fmt(r["published"]),
                     "posbench": f"{fmt(r['posbench_mean'])} ± {fmt(r['posbench_std'])}",
                     "min..max (runs)": f"{fmt(r['posbench_min'])}..{fmt(r['posbench_max'])} ({r['posbench_n']})",
                     "posbench − published": fmt(r["difference"])})
    return rows


def ordering_table(headline):
    """Every pair of curve labels (encodings) of one task and setting, compared past N at every model size
    both ran at with two or more scored seeds: '>' when every seed of the first beats every seed of
    the second (its worst OOD score is better than the other's best), '<' the reverse, '≈' when
    the ranges overlap. verdict: holds (one direction at every size), reverses (both directions),
    depends on size (one direction at some sizes, overlapping at others), not separated."""
    import pandas as pd

    records = []
    for (task, setting), part in headline.groupby(["task", "setting"]):
        lower = lower_is_better(part["metric"].iloc[0])
        sizes = part.groupby("size")["n_params"].min().sort_values().index.tolist()
        scored = {(r["curve_label"], r["size"]): r for _, r in part.iterrows() if r["ood_score_n"] >= 2}
        for first, second in itertools.combinations(sorted(part["curve_label"].unique()), 2):
            relations = {}
            for size in sizes:
                a, b = scored.get((first, size)), scored.get((second, size))
                if a is None or b is None:
                    continue
                if lower:
                    ahead = a["ood_score_max"] < b["ood_score_min"], b["ood_score_max"] < a["ood_score_min"]
                else:
                    ahead = a["ood_score_min"] > b["ood_score_max"], b["ood_score_min"] > a["ood_score_max"]
                relations[size] = ">" if ahead[0] else "<" if ahead[1] else "≈"
            if len(relations) < 2:
                continue
            seen = set(relations.values())
            verdict = ("reverses" if {">", "<"} <= seen else "not separated" if seen == {"≈"}
                       else "depends on size" if "≈" in seen else "holds")
            records.append({"task": task, "setting": setting, "first": first, "second": second, "verdict": verdict,
                            "relations": ", ".join(f"{size}: {rel}" for size, rel in relations.items())})
    return pd.DataFrame(records, columns=["task", "setting", "first", "second", "verdict", "relations"])


# ---- formatting -------------------------------------------------------------------------------

def fmt(value, kind: str = "score") -> str:
    """A number for a table: '–' for missing; kind: score (3 decimals, 3 significant digits
    for perplexity-like values), ratio, int, count (thousands separated)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    value = float(value)
    if kind == "int":  # lengths and ranks; a mean over seeds may fall between
        return f"{value:.0f}" if value.is_integer() else f"{value:.1f}"
    if kind == "count":
        return f"{value:,.0f}"
    if kind == "ratio":
        return f"{value:.2f}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def pm(record, column: str, kind: str = "score") -> str:
    return f"{fmt(record[f'{column}_mean'], kind)} ± {fmt(record[f'{column}_std'], kind)}"


def not_learned(record) -> bool:
    """Whether a headline record is marked not learned (learned False; None: a metric without a bar)."""
    return record["learned"] is not None and not record["learned"]


def rank_text(record) -> str:
    """A group's rank on its task as the tables show it: the number, or why it has none."""
    if not_learned(record):
        return "not learned (N not measured)" if math.isnan(record["id_score_mean"]) else "not learned"
    return fmt(record["rank_in_task"], "int")


def headline_rows(headline):
    """The headline table as shown in report.md/html: mean ± std over seeds."""
    rows = []
    for _, r in headline.iterrows():
        rows.append({"task": r["task"], "group": r["label"], "rank": rank_text(r),
                     "seeds (runs)": f"{r['seeds']} ({r['runs']})", "metric": r["metric"],
                     "at N": pm(r, "id_score"), "past N (OOD)": pm(r, "ood_score"),
                     "extrapolation L": pm(r, "extrapolation_length", "int"),
                     "L / N": pm(r, "extrapolation_ratio", "ratio"),
                     "train tok/s": fmt(r["train_tokens_per_s_mean"], "count"),
                     "eval tok/s at longest": fmt(r["eval_tokens_per_s_at_longest_mean"], "count"),
                     "peak MiB at longest": fmt(r["peak_mem_mb_at_longest_mean"], "count"),
                     "incomplete": str(r["incomplete_runs"]) if r["incomplete_runs"] else ""})
    return rows


def by_task_rows(headline, ranking) -> list[dict]:
    """Rank label × task (and setting): the OOD score, mean ± std over seeds, and the score at N
    in brackets; rows in the order of the ranking across tasks."""
    cells = {(r["rank_label"], r["ranked_on"]): f"{pm(r, 'ood_score')} ({fmt(r['id_score_mean'])}"
             + (", not learned)" if not_learned(r) else ")") for _, r in headline.iterrows()}
    tasks = sorted(headline["ranked_on"].unique())
    return [{"group": label, **{task: cells.get((label, task), "") for task in tasks}} for label in ranking["label"]]


def ranking_rows(headline, ranking) -> list[dict]:
    """The ranking across tasks as shown: per rank label its MRR, tasks, and rank on each task
    ('not learned' where it did not learn it, '–' where it did not run)."""
    ranks = {(r["rank_label"], r["ranked_on"]): rank_text(r) for _, r in headline.iterrows()}
    tasks = sorted(headline["ranked_on"].unique())
    return [{"group": r["label"], "MRR": fmt(r["mrr"]), "tasks": str(r["tasks"]),
             "not learned": str(r["not_learned"]) if r["not_learned"] else "",
             **{f"rank on {task}": ranks.get((r["label"], task), "–") for task in tasks}}
            for _, r in ranking.iterrows()]


def params_text(params_json: str) -> str:
    return ", ".join(f"{k}={v}" for k, v in json.loads(params_json).items())


def lengths_text(lengths) -> str:
    return ", ".join(map(str, lengths)) if len(lengths) else "none"


# ---- the document: blocks rendered to markdown and to html ------------------------------------

def runs_without_rows(frame) -> list[dict]:
    """Run directories with a status record and no rows (stopped or failed before their first length)."""
    with_rows = set(frame["source"])
    return [{"run": status.get("run_name") or Path(source).name, "status": describe(status), "directory": source}
            for source, status in frame.attrs.get("input", {}).get("statuses", {}).items() if source not in with_rows]


def orderings_blocks(orderings) -> list:
    """The orderings across model sizes: the pairs separated at some size, and a count of the rest."""
    if not len(orderings):
        return []
    separated = orderings[orderings["verdict"] != "not separated"]
    text = ("Pairs of encodings of one task and setting, compared past N at each model size where both "
            "have two or more seeds: "
            "'>' when every seed of the first scores better than every seed of the second (no overlap of "
            "their min..max over seeds), '<' the reverse, '≈' overlap. Holds: one direction at every size; "
            "reverses: both directions; depends on size: one direction at some sizes, overlap at others. "
            f"{len(orderings) - len(separated)} of {len(orderings)} pairs are not separated at any size "
            "(orderings.csv lists every pair).")
    rows = [{"task": r["task"], "pair": f"{r['first']} vs {r['second']}", "by size": r["relations"],
             "verdict": r["verdict"]} for _, r in separated.iterrows()]
    return [("h2", "Orderings across model sizes"), ("p", text), ("table", rows)]


def build_blocks(frame, runs, headline, comparison, orderings, figures: dict[str, Path], out: Path,
                 skipped: list[Skipped]) -> list:
    """The report as a list of (kind, content) blocks: h1, h2, p, list, table (list of dicts), figure."""
    problems = runs[runs["status"] != "ok"]
    rowless = runs_without_rows(frame)
    ok_runs = runs[runs["status"] == "ok"]
    blocks = [("h1", "posbench report")]
    tasks = ", ".join(f"{t} (N = {', '.join(map(str, sorted(p['train_length'].unique())))}, "
                      f"lengths {lengths_text(sorted(p['eval_length'].unique()))})"
                      for t, p in frame.groupby("task"))
    sources = sorted({str(Path(s).parent) for s in frame["source"]})
    mixed = [f"{r['task']} {r['label']} ({r['devices']})" for _, r in headline.iterrows() if "," in r["devices"]]
    blocks += [("h2", "What was run"), ("list", [
        f"{len(runs)} runs ({len(ok_runs)} finished every length, {len(problems)} did not) in "
        f"{len(headline)} groups; a group is a configuration minus the seed"
        + (f"; {len(rowless)} more runs have no rows yet (listed below)." if rowless else "."),
        f"Tasks: {tasks}.",
        f"Encodings: {', '.join(sorted(frame['encoding'].unique()))}.",
        f"Seeds: {', '.join(map(str, sorted(frame['seed'].unique())))}; "
        f"training steps: {', '.join(map(str, sorted(set(frame['steps']))))}.",
        f"Models: {'; '.join(sorted(params_text(m) for m in frame['model'].dropna().unique()))}.",
        f"Devices: {', '.join(sorted(frame['device'].dropna().unique()))}; torch "
        f"{', '.join(sorted(frame['torch'].dropna().unique()))}; commits "
        f"{', '.join(sorted({str(c)[:12] for c in frame['git_commit'].dropna()}))}.",
        *([f"Groups whose seeds ran on different devices: {', '.join(mixed)}; their throughput and memory "
           "are left blank, as they belong to one machine."] if mixed else []),
        f"Rows written {frame['time'].min()} to {frame['time'].max()}, read from {', '.join(sources)}.",
        *([f"Skipped input: {skipped_summary(skipped)}, each named under 'Skipped input' below."] if skipped else []),
    ])]
    blocks += [("h2", "Headline metrics"), ("p",
        "Per group, mean ± sample standard deviation over seeds ('–': one seed, or nothing measured); "
        "min, max and n of every score are in headline.csv. At N: the metric at the training length. "
        "Past N (OOD): the mean of the metric over the evaluated lengths longer than N. "
        "Extrapolation L: the largest evaluated length up to which the criterion holds at every "
        "evaluated length (0: not even the shortest); L / N the same as a ratio. Criteria: "
        + "; ".join(sorted(set(headline["criterion"]))) + ". Throughput and memory are means over seeds; "
        "rank is the rank of the OOD score within the task (its setting and model size) among the groups "
        f"that learned it: 'not learned' when the accuracy at N is below {LEARNED_AT_N:g} "
        "(posbench.headline.LEARNED_AT_N; perplexity has no such bar), listed after the ranked groups."),
        ("table", headline_rows(headline))]
    ranking = ranking_table(headline)
    if headline["ranked_on"].nunique() > 1:
        blocks += [("h2", "Past N by task"), ("p",
            "The OOD score of each group on each task, mean ± sample standard deviation over seeds, and in "
            "brackets the mean at N ('not learned': below the bar at N, not ranked); groups in the order of the "
            "ranking across tasks below."),
            ("table", by_task_rows(headline, ranking))]
    for source, part in comparison.groupby("source", sort=False) if len(comparison) else ():
        notes = sorted({n for n in part["note"] if n})
        blocks += [("h2", f"Published numbers: {source}"), ("p",
            "The experiment's published numbers (its `published` block) beside this report's: per run the mean "
            "of the metric over its evaluated lengths in the range, then mean ± sample standard deviation, "
            "min..max and the number of runs over the group; '(k of n measured)' when the runs evaluated only "
            "some lengths of the range." + (" Notes: " + " ".join(notes) if notes else "")),
            ("table", published_rows(part))]
    blocks += [("h2", "Ranking across tasks"), ("p",
        "Mean reciprocal rank of the OOD score per group label over the tasks it ran on (1 = best "
        "on every task; ties share the better rank; a group without an OOD score ranks last), as "
        "Kazemnejad et al. (2023) rank encodings; a rank is among this report's groups on that task "
        f"that learned it. A task not learned (accuracy at N below {LEARNED_AT_N:g}) has no rank and "
        "counts 0 in the mean, as a mean reciprocal rank counts an item never found."
        + (" Groups ran on different numbers of tasks here: compare MRRs only between groups ranked on "
           "the same tasks." if headline["tasks"].nunique() > 1 else "")),
        ("table", ranking_rows(headline, ranking)),
        ("figure", figures["ranking"], "Mean reciprocal rank of the OOD score across tasks.")]
    blocks += [("h2", "Figures")]
    lines = ("line: mean over seeds, band: min..max over seeds" if headline["runs"].max() > 1
             else "one seed per line")
    for metric, path in figures.items():
        if metric in HEADLINE_METRICS:
            blocks.append(("figure", path, f"{METRIC_LABELS.get(metric, metric)} against evaluation length / N "
                           f"(log2), one panel per task{' and model size' if 'scaling' in figures else ''}; {lines}."))
    if "scaling" in figures:
        blocks.append(("figure", figures["scaling"], "OOD score against parameter count, one panel per task "
                       "and setting, one line per encoding, mean over seeds with a min..max bar; ranks above are "
                       "within one setting and model size."))
    blocks += [("figure", figures["heatmap"], "OOD score (mean over seeds) per group and task."),
               ("figure", figures["cost"], "Evaluation throughput and peak memory against evaluation length "
                "(mean over seeds; y axes from zero). On CPU the peak is the whole process's resident high-water "
                "mark, mostly torch itself and the model, so it grows little with the length; on CUDA it is the "
                "memory torch allocated for tensors.")]
    if orderings is not None:
        blocks += orderings_blocks(orderings)
    blocks.append(("h2", "Runs that did not finish every length"))
    if len(problems):
        blocks += [("p", "Their measured lengths count in the tables above; missing lengths are left out of "
                    "the means, end the extrapolation chain, and are counted in the 'incomplete' column."),
                   ("table", [{"run": r["run_name"], "group": r["label"], "seed": str(r["seed"]),
                               "status": r["status"], "finished lengths": lengths_text(r["finished_lengths"]),
                               "missing lengths": lengths_text(r["missing_lengths"]),
                               "directory": r["source"]} for _, r in problems.iterrows()])]
    else:
        blocks.append(("p", "None: every run measured every length of its group."))
    if rowless:
        blocks += [("p", "Runs that wrote no rows (stopped, killed or failed before their first evaluated length; "
                    "the same command resumes one from its last checkpoint):"), ("table", rowless)]
    if skipped:
        blocks += [("h2", "Skipped input"), ("p",
            f"Skipped: {skipped_summary(skipped)}. Lines that are not UTF-8 text, not JSON (a torn or "
            "truncated line) or not a result row (one without the run, task, encoding, seed and lengths, or "
            "with values of the wrong type), and files that could not be read. The tables above leave them "
            "out; a skipped status.json leaves its run's state to its rows."), ("list", skipped_lines(skipped))]
    blocks += [("h2", "Files"), ("list", [
        "results.csv: every row; summary.csv: per group and evaluation length, mean/std/min/max/n over seeds;",
        "headline.csv: per group, the headline scores (mean/std/min/max/n over seeds), cost and ranking;",
        *(["published.csv: per published number, the groups it applies to and their numbers;"]
          if len(comparison) else []),
        f"figures: {', '.join(p.name for p in figures.values())}; written to {out}."])]
    return blocks


def _md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks) -> str:
    lines = []
    for kind, *content in blocks:
        if kind in ("h1", "h2"):
            lines += [f"{'#' * int(kind[1])} {content[0]}", ""]
        elif kind == "p":
            lines += [content[0], ""]
        elif kind == "list":
            lines += [f"- {item}" for item in content[0]] + [""]
        elif kind == "table":
            rows = content[0]
            if rows:
                header = list(rows[0])
                lines.append("| " + " | ".join(map(_md_cell, header)) + " |")
                lines.append("|" + "|".join("---" for _ in header) + "|")
                lines += ["| " + " | ".join(_md_cell(r[c]) for c in header) + " |" for r in rows]
                lines.append("")
        elif kind == "figure":
            path, caption = content
            lines += [f"![{caption}]({path.name})", "", f"*{caption}*", ""]
    return "\n".join(lines)


HTML_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; color: #222; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; }}
th {{ background: #f3f3f3; }}
tr:nth-child(even) td {{ background: #fafafa; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }} figcaption {{ font-size: 0.85em; color: #555; }}
code {{ background: #f3f3f3; padding: 0 0.2em; }}
</style></head>
<body>
{body}
</body></html>
"""


def _inline(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(str(text)))


def _palette_png(path: Path) -> bytes:
    """The figure in a 256-colour palette, a third of its size or less: plots have few colours."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.open(path).quantize(256, method=Image.Quantize.FASTOCTREE).save(buffer, "PNG", optimize=True)
    return buffer.getvalue()


def render_html(blocks) -> str:
    """The report as one html file, the figures embedded as base64 palette PNGs."""
    parts = []
    for kind, *content in blocks:
        if kind in ("h1", "h2"):
            parts.append(f"<{kind}>{_inline(content[0])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline(content[0])}</p>")
        elif kind == "list":
            parts.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in content[0]) + "</ul>")
        elif kind == "table" and content[0]:
            rows = content[0]
            head = "".join(f"<th>{_inline(c)}</th>" for c in rows[0])
            body = "".join("<tr>" + "".join(f"<td>{_inline(v)}</td>" for v in r.values()) + "</tr>" for r in rows)
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "figure":
            path, caption = content
            data = base64.b64encode(_palette_png(path)).decode("ascii")
            parts.append(f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
                         f"<figcaption>{_inline(caption)}</figcaption></figure>")
    return HTML_PAGE.format(title="posbench report", body="\n".join(parts))


# ---- entry point ------------------------------------------------------------------------------

def write_report(paths, out=None, metric: str | None = None, threshold: float = DEFAULT_THRESHOLD) -> Path:
    """Every file of the report, written to out (default: the first path); returns out."""
    Choice(HEADLINE_METRICS, null="each task's primary metric")("--metric", metric)
    if not 0 < threshold <= 1:
        raise ValueError(f"--threshold {threshold} must be in (0, 1]: it applies to accuracies")
    frame = collect(paths)  # before output_directory: a missing input path is named, not made
    out = output_directory(out, paths[0])
    if metric is not None and (metric not in frame or frame[metric].isna().all()):
        present = [m for m in HEADLINE_METRICS if m in frame and frame[m].notna().any()]
        raise ValueError(f"--metric {metric}: no row measures it; these rows measure {present}")
    skipped = frame.attrs["input"]["skipped"] + unreadable_configs(frame["source"])
    for line in skipped_lines(skipped):
        print(f"warning: skipped {line}", file=sys.stderr)
    frame = add_groups(frame).sort_values(["task", "label", "seed", "eval_length"]).reset_index(drop=True)
    metrics = task_metrics(frame, metric)
    runs = run_table(frame, metrics, threshold)
    summary = summary_table(frame)
    headline = headline_table(frame, runs, summary, threshold)
    comparison = published_table(frame, runs)

    frame.to_csv(out / "results.csv", index=False)
    summary.to_csv(out / "summary.csv", index=False)
    headline.astype({"rank_in_task": "Int64"}).to_csv(out / "headline.csv", index=False)  # NaN: not ranked
    if len(comparison):
        comparison.to_csv(out / "published.csv", index=False)
    figures = {}
    for shown in sorted(set(metrics.values())):
        tasks = [t for t, m in metrics.items() if m == shown]
        figures[shown] = out / f"comparison_{shown}.png"
        plot_curves(summary[summary["task"].isin(tasks)], figures[shown], shown, threshold)
    figures["heatmap"] = out / "ood_heatmap.png"
    plot_heatmap(headline, figures["heatmap"])
    figures["cost"] = out / "cost.png"
    plot_cost(summary, figures["cost"])
    figures["ranking"] = out / "ranking.png"
    plot_ranking(ranking_table(headline), figures["ranking"])
    orderings = None
    if headline["size"].nunique() > 1:
        figures["scaling"] = out / "ood_vs_parameters.png"
        plot_scaling(headline, figures["scaling"])
        orderings = ordering_table(headline)
        orderings.to_csv(out / "orderings.csv", index=False)
    blocks = build_blocks(frame, runs, headline, comparison, orderings, figures, out, skipped)
    (out / "report.md").write_text(render_markdown(blocks))
    (out / "report.html").write_text(render_html(blocks))

    table = headline_rows(headline)
    columns = ["task", "group", "rank", "seeds (runs)", "at N", "past N (OOD)", "L / N", "incomplete"]
    print(render_markdown([("table", [{c: r[c] for c in columns} for r in table])]))
    for source, part in comparison.groupby("source", sort=False) if len(comparison) else ():
        print(f"published: {source}")
        print(render_markdown([("table", published_rows(part))]))
    problems = runs[runs["status"] != "ok"]
    for _, r in problems.iterrows():
        print(f"not complete: {r['run_name']} ({r['source']}): {r['status']}; "
              f"finished {lengths_text(r['finished_lengths'])}")
    for r in runs_without_rows(frame):
        print(f"no rows: {r['run']} ({r['directory']}): {r['status']}")
    if skipped:
        print(f"skipped {skipped_summary(skipped)}: listed in report.md under 'Skipped input'")
    print(f"wrote report.md, report.html, results.csv, summary.csv, headline.csv and "
          f"{', '.join(p.name for p in figures.values())} to {out}")
    return out


def progress(paths) -> list[str]:
    """One line per run directory under paths with a status record: its name, where it stands, the
    lengths written; then the count per state and of the input the report would skip (the same
    count: both read through posbench.results.read_run_files), each skipped line and file, and for
    each sweep directory given, its jobs finished of the total and the time left (posbench.sweeps).
    What `--progress` prints for a sweep under way."""
    rows, statuses, skipped = read_run_files(paths)
    skipped += unreadable_configs(row["source"] for row in rows)
    unreadable = {str(item.file.parent): item for item in skipped if item.file.name == STATUS_FILE}
    if not statuses and not unreadable:
        raise FileNotFoundError(f"no run directories with a status.json under {[str(p) for p in paths]}")
    # a run whose status.json is unreadable stands as 'unreadable': started, state unknown
    records = statuses | {run_dir: {"state": "unreadable"} for run_dir in unreadable}
    lines, states = [], {}
    for run_dir, status in sorted(records.items()):
        if run_dir in unreadable:
            text = f"unreadable status.json ({unreadable[run_dir]})"
            lines.append(f"{Path(run_dir).name}: {text}")
        else:
            text = describe(status)
            done = status.get("lengths_done") or []
            lines.append(f"{status.get('run_name') or Path(run_dir).name}: {text}; lengths written "
                         f"{lengths_text(done)} of {lengths_text(status.get('lengths') or [])} ({run_dir})")
        state = text.split(" ")[0]
        states[state] = states.get(state, 0) + 1
    sweep_lines = []
    for sweep in map(Path, paths):  # a sweep directory: its jobs against the total, and the time left
        if not sweep.is_dir():
            continue
        read = read_multirun(sweep)
        if read[1] is not None:  # a multirun.yaml that cannot be used: skipped input like any other
            skipped.append(read[1])
        inside = [status for run_dir, status in records.items() if sweep in Path(run_dir).parents]
        line = sweep_progress(sweep, inside, read)
        if line:
            sweep_lines.append(line)
    counts = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    lines.append(counts + (f"; skipped {skipped_summary(skipped)}, as the report skips them:" if skipped else ""))
    lines += [f"  {line}" for line in skipped_lines(skipped)]
    return lines + sweep_lines


def output_directory(out, first_path) -> Path:
    """The report's directory (--out, default the first path), made; a file there (or above it) is named."""
    out = Path(out or first_path)
    given = f"--out {out}" if out != Path(first_path) else f"{out} (the default --out: the first path)"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        file = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), out)
        raise ValueError(f"{given}: {file} is a file, not a directory; --out names the directory the report is "
                         "written to (results.csv, report.md, ...)") from None
    except OSError as err:
        raise ValueError(f"{given}: cannot make the report's directory: {err.strerror}") from None
    return out


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(prog="python -m posbench.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run or sweep directories (searched for results.jsonl)")
    parser.add_argument("--out", help="output directory (default: the first path)")
    parser.add_argument("--metric", choices=HEADLINE_METRICS,
                        help="headline metric for every task (default: exact_match where measured, else perplexity)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help=f"accuracy the extrapolation length requires (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--progress", action="store_true",
                        help="only list every run's status (running, killed, failed, ok) and the lengths written")
    args = parser.parse_args(argv)
    try:
        if args.progress:
            print("\n".join(progress(args.paths)))
            return None
        return write_report(args.paths, args.out, args.metric, args.threshold)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
