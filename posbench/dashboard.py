"""`python -m posbench.dashboard SWEEP_DIR_OR_GROUP [--entity E] [--project P] [--report] [--dry-run]`
`python -m posbench.dashboard SWEEP_DIR --log-rows [--wandb-dir DIR]`

Builds the wandb view that compares one sweep's runs, its wandb group (posbench.loggers), with
wandb-workspaces (the `wandb` extra: `pip install -e '.[wandb]'`):

- runs: the group's, grouped by encoding (by task, then encoding, when the sweep has several
  tasks); every panel draws the mean over seeds with a min-max band;
- one section per task: its headline metric (perplexity on a log axis) against eval/length,
  token accuracy and loss;
- headline: OOD score, extrapolation ratio and score at N by encoding, and each run's score at N
  against its OOD score, so runs that did not learn the task (accuracy at N below
  posbench.headline.LEARNED_AT_N) stand apart;
- cost: evaluation tokens/s and peak memory against eval/length, training tokens/s;
- training: loss against train/step.

By default it saves a workspace view and prints its URL; --report saves a Report with the same
sections, each filtered to its task, not-learned runs in a run set of their own, and the local
report's headline table; --dry-run prints the specification as JSON and touches no network.

From a sweep (or run) directory the group, the tasks and the metrics each task measured come
from the runs' files; from a group name they come from the wandb API. Every key a panel reads
is built from the declaration the logger writes with (posbench.loggers).

--log-rows brings a sweep run without logger=wandb to wandb: it writes each run directory's rows
as an offline wandb run, as the logger would have logged it (no training history: the rows hold
none), records that in the run directory (wandb-rows.json) and prints the `wandb sync` command;
a run logged already is skipped with the reason. The view of the sweep can be built afterwards.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from posbench.checks import Choice
from posbench.headline import (DEFAULT_THRESHOLD, HIGHER_IS_BETTER, LEARNED_AT_N, LEARNED_SLACK, LOWER_IS_BETTER,
                               criterion, primary_metric, value)
from posbench.loggers import (EVAL_KEYS, EVAL_LENGTH, STATUS, TRAIN_STEP, TRAIN_TOKENS_PER_S, eval_key,
                              headline_key, run_group, sweep_group_name, train_key)
from posbench.results import METRIC_LABELS, ROW_FILE, read_rows
from posbench.rundir import atomic_write, describe, read_status
from posbench.runinfo import RUN_KEYS, RunInfo

INSTALL = "pip install -e '.[wandb]' in the posbench clone (or: bash scripts/install.sh wandb)"
DEFAULT_PROJECT = "posbench"  # configs/logger/wandb.yaml
# Config keys of the runs (posbench.runinfo.RunInfo, logged as flat config)
ENCODING, TASK = "encoding", "task"
TABLE_CONFIG = (ENCODING, TASK, "seed", "train_length", "positions")
TABLE_SUMMARY = ("id_score", "ood_score", "extrapolation_ratio", "complete")  # headline fields
CURVE_METRICS = ("token_acc", "loss")  # drawn for every task beside its headline metric
COST_LABELS = {"eval_tokens_per_s": "evaluation tokens / s", "peak_mem_mb": "peak memory, MiB"}
RUN_ATTRIBUTES = {"group": "Group"}  # a Condition's run keys -> wandb_workspaces' names
MIN_RUNS_SHOWN = 100  # wandb draws 10 runs per panel unless told more


def label(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric.replace("_", " "))


# ---- the specification: plain data, no wandb ----------------------------------------------------

PANEL_KINDS = ("line", "bar", "scatter", "text")


@dataclass(frozen=True)
class Panel:
    """line: history keys y against history key x; bar: summary keys y per group; scatter:
    summary key x against summary key y[0], one point per run; text: markdown."""
    kind: str  # PANEL_KINDS
    title: str
    y: tuple[str, ...] = ()
    x: str | None = None
    log_y: bool = False
    text: str = ""

    def __post_init__(self):
        Choice(PANEL_KINDS)("panel.kind", self.kind)

    def as_dict(self) -> dict:
        shown = {"kind": self.kind, "title": self.title, "x": self.x, "y": list(self.y), "log_y": self.log_y,
                 "text": self.text}
        return {k: v for k, v in shown.items() if v not in (None, [], "", False) or k == "kind"}


@dataclass(frozen=True)
class Condition:
    """A run filter: section run (a run attribute), config or summary; op =, in, >= or <= (wandb
    filters have no strict < or >)."""
    section: str
    key: str
    op: str
    value: object

    def as_dict(self) -> dict:
        return {"section": self.section, "key": self.key, "op": self.op, "value": self.value}


@dataclass(frozen=True)
class Runset:
    name: str
    conditions: tuple[Condition, ...]

    def as_dict(self) -> dict:
        return {"name": self.name, "filter": [c.as_dict() for c in self.conditions]}


@dataclass
class Section:
    name: str
    panels: list[Panel]
    x_axis: str | None = None
    task: str | None = None  # the report shows only this task's runs
    split_learned: bool = False  # the report puts learned and not-learned runs in run sets of their own


@dataclass(frozen=True)
class TaskInfo:
    name: str
    metric: str  # its headline metric (posbench.headline.primary_metric)
    measured: tuple[str, ...]  # the EVAL_KEYS its runs logged


@dataclass
class Sweep:
    """What the dashboard needs to know about a sweep's runs."""
    group: str
    tasks: list[TaskInfo]
    runs: int
    entity: str | None = None
    project: str | None = None
    source: Path | None = None  # the sweep directory, when the runs are local
    run_names: tuple[str, ...] = ()  # one per run directory, when the runs are local


@dataclass
class Dashboard:
    sweep: Sweep
    entity: str | None
    project: str
    group_by: tuple[str, ...]  # config keys
    sections: list[Section]
    headline_table: str | None = None  # the local report's, as markdown (report only)
    columns: tuple[tuple[str, str], ...] = ()  # runs table: (config | summary, key)
    order_by: str = headline_key("ood_score")  # summary key, descending

    @property
    def title(self) -> str:
        return f"posbench: {self.sweep.group}"

    def base_conditions(self, task: str | None = None) -> tuple[Condition, ...]:
        return (Condition("run", "group", "=", self.sweep.group),
                *([Condition("config", TASK, "=", task)] if task else []))

    def runsets(self, section: Section) -> list[Runset]:
        """The report's run sets of a section: its task's runs, or the group's; split into learned
        and not learned at N by the accuracy at N where some task is judged by accuracy."""
        base = self.base_conditions(section.task)
        tasks = [t for t in self.sweep.tasks if section.task in (None, t.name)]
        if not (section.split_learned and any(t.metric in HIGHER_IS_BETTER for t in tasks)):
            return [Runset(section.task or "runs", base)]
        accuracy = Condition("summary", headline_key("metric"), "in", list(HIGHER_IS_BETTER))
        at_n = headline_key("id_score")
        bar = LEARNED_AT_N - LEARNED_SLACK  # as posbench.headline.learned; below it by one more slack: not learned
        sets = [Runset(f"learned at N (accuracy >= {LEARNED_AT_N:g})",
                       (*base, accuracy, Condition("summary", at_n, ">=", bar))),
                Runset(f"not learned at N (accuracy < {LEARNED_AT_N:g})",
                       (*base, accuracy, Condition("summary", at_n, "<=", bar - LEARNED_SLACK)))]
        if any(t.metric in LOWER_IS_BETTER for t in tasks):
            sets.append(Runset("perplexity or loss (no bar at N)",
                               (*base, Condition("summary", headline_key("metric"), "in", list(LOWER_IS_BETTER)))))
        return sets

    def keys(self, kind: str = "workspace") -> dict[str, set[str]]:
        """Every key the view reads, by where wandb keeps it: history, summary, config (run: run attributes)."""
        read = {"history": set(), "summary": set(), "config": set(self.group_by), "run": set()}
        for section in self.sections:
            for panel in section.panels:
                if panel.kind == "line":
                    read["history"] |= {panel.x, *panel.y}
                elif panel.kind in ("bar", "scatter"):
                    read["summary"] |= {*panel.y, *([panel.x] if panel.x else [])}
        if kind == "report":  # run sets per section, grouped; no runs table
            conditions = [c for s in self.sections for r in self.runsets(s) for c in r.conditions]
        else:  # one run set with the runs table
            conditions = list(self.base_conditions())
            for where, key in self.columns:
                read[where].add(key)
            read["summary"].add(self.order_by)
        for condition in conditions:
            read[condition.section].add(condition.key)
        return read

    def as_dict(self, kind: str) -> dict:
        spec = {"kind": kind, "title": self.title, "entity": self.entity, "project": self.project,
                "group": self.sweep.group, "source": str(self.sweep.source) if self.sweep.source else "wandb api",
                "runs": self.sweep.runs, "run_names": list(self.sweep.run_names),
                "tasks": {t.name: {"metric": t.metric, "measured": list(t.measured)} for t in self.sweep.tasks},
                "runset": {"filter": [c.as_dict() for c in self.base_conditions()], "group_by": list(self.group_by),
                           "aggregate": "mean", "band": "minmax",
                           "columns": [f"{where}:{key}" for where, key in self.columns],
                           "order_by": f"-{self.order_by}"},
                "sections": []}
        for section in self.sections:
            shown = {"name": section.name, "task": section.task, "x_axis": section.x_axis,
                     "panels": [p.as_dict() for p in section.panels]}
            if kind == "report":
                shown["runsets"] = [r.as_dict() for r in self.runsets(section)]
            spec["sections"].append({k: v for k, v in shown.items() if v is not None})
        if kind == "report":
            spec["headline_table"] = self.headline_table
        return spec


def task_section(task: TaskInfo) -> Section:
    metric = task.metric
    panels = []
    if metric in task.measured:
        panels.append(Panel("line", f"{task.name}: {label(metric)}", (eval_key(metric),), EVAL_LENGTH,
                            log_y=metric.endswith("perplexity")))
    panels += [Panel("line", f"{task.name}: {label(m)}", (eval_key(m),), EVAL_LENGTH)
               for m in CURVE_METRICS if m != metric and m in task.measured]
    if not panels:
        panels.append(Panel("text", f"{task.name}: nothing measured",
                            text=f"No run of {task.name} logged an evaluation metric (diverged or failed runs)."))
    return Section(f"{task.name}: {label(metric)} against length", panels, x_axis=EVAL_LENGTH, task=task.name)


def headline_text(tasks: list[TaskInfo]) -> str:
    judged = sorted({t.metric for t in tasks})
    text = (f"Headline scores (posbench.headline) of each run's {', '.join(judged)}: "
            "`id_score` at the training length N, `ood_score` the mean past N, `extrapolation_ratio` L / N "
            f"(L: {'; '.join(criterion(m) for m in judged)}).")
    if any(t.metric in HIGHER_IS_BETTER for t in tasks):
        text += (f" A run whose accuracy at N is below {LEARNED_AT_N:g} did not learn its task: its score past N "
                 "measures under-fitting, not extrapolation. In the scatter such runs sit left of "
                 f"x = {LEARNED_AT_N:g}; the report puts them in a run set of their own.")
    return text + " Diverged or failed runs (`status`) have no headline scores."


def build_dashboard(sweep: Sweep, entity: str | None = None, project: str | None = None,
                    headline_table: str | None = None) -> Dashboard:
    """The view's specification for a sweep: sections, panels and the keys they read."""
    if not sweep.tasks:
        raise ValueError(f"group {sweep.group!r} has no runs with a task to show")
    group_by = (TASK, ENCODING) if len(sweep.tasks) > 1 else (ENCODING,)
    measured = {m for t in sweep.tasks for m in t.measured}
    sections = [task_section(t) for t in sorted(sweep.tasks, key=lambda t: t.name)]
    sections.append(Section("headline", [
        Panel("bar", "OOD score (mean past N)", (headline_key("ood_score"),)),
        Panel("bar", "extrapolation ratio L / N", (headline_key("extrapolation_ratio"),)),
        Panel("bar", "score at N", (headline_key("id_score"),)),
        Panel("scatter", "each run: score at N against OOD score", (headline_key("ood_score"),),
              headline_key("id_score")),
        Panel("text", "reading the headline", text=headline_text(sweep.tasks))], split_learned=True))
    cost = [Panel("line", title, (eval_key(m),), EVAL_LENGTH) for m, title in COST_LABELS.items() if m in measured]
    cost.append(Panel("bar", "training tokens / s", (TRAIN_TOKENS_PER_S,)))
    sections.append(Section("cost", cost, x_axis=EVAL_LENGTH))
    sections.append(Section("training", [Panel("line", "training loss", (train_key("loss"),), TRAIN_STEP)],
                            x_axis=TRAIN_STEP))
    columns = (*[("config", k) for k in TABLE_CONFIG], *[("summary", headline_key(k)) for k in TABLE_SUMMARY],
               ("summary", STATUS))
    return Dashboard(sweep, entity if entity is not None else sweep.entity,
                     project or sweep.project or DEFAULT_PROJECT, group_by, sections, headline_table, columns)


# ---- what a sweep logged: from its directory, or from the wandb API ------------------------------

def read_yaml(path: Path) -> dict:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def directory_group(run_dir: Path, rows: list[dict], config: dict) -> str:
    """The wandb group the logger gave the run in run_dir (posbench.loggers.run_group), from its
    config.yaml and Hydra's record: a --multirun's sweep directory is the one holding multirun.yaml."""
    hydra = read_yaml(run_dir / ".hydra" / "hydra.yaml").get("hydra") or {}
    configured, sweep = (config.get("logger") or {}).get("group"), None
    if not configured and hydra.get("mode") == "MULTIRUN":
        sweep_dir = next((p for p in run_dir.parents if (p / "multirun.yaml").exists()), None)
        if sweep_dir is None:
            raise ValueError(f"{run_dir} ran in a --multirun, but no directory above it holds Hydra's multirun.yaml; "
                             "name the group with --group")
        experiment = ((hydra.get("runtime") or {}).get("choices") or {}).get("experiment")
        sweep = sweep_group_name(experiment, sweep_dir)
    return run_group(configured, sweep, rows[0]["encoding"], rows[0]["task"])


def tasks_of(rows_by_task: dict[str, list[dict]]) -> list[TaskInfo]:
    return [TaskInfo(task, primary_metric(rows),
                     tuple(k for k in EVAL_KEYS if any(value(r, k) is not None for r in rows)))
            for task, rows in sorted(rows_by_task.items())]


def run_directories(path: Path):
    """(run directory, its rows, its config.yaml) of each run directory under path with rows."""
    files = sorted(path.rglob(ROW_FILE))
    if not files:
        raise FileNotFoundError(f"no {ROW_FILE} under {path}: not a run or sweep directory with results")
    for file in files:
        try:
            rows = [r for r in read_rows(file) if r.get("task") and r.get("encoding")]
        except OSError as err:  # a FIFO, a directory or an unreadable file named results.jsonl
            print(f"skipped {file}: unreadable: {err.strerror or err}", file=sys.stderr)
            continue
        if rows:
            yield file.parent, rows, read_yaml(file.parent / "config.yaml")


def local_sweep(path: Path, group: str | None = None) -> Sweep:
    """The sweep in a directory: its runs that logged to wandb (logger=wandb, or --log-rows afterwards),
    their group, tasks and metrics."""
    groups, rows_by_task, runs, names, targets, without = {}, {}, set(), [], set(), []
    for run_dir, rows, config in run_directories(path):
        logger = config.get("logger") or {}
        if logger.get("name") == "wandb":
            name = group or directory_group(run_dir, rows, config)
            targets.add((logger.get("entity"), logger.get("project")))
        elif (logged := read_logged(run_dir)) is not None:
            name = group or logged["group"]
            targets.add((logged["entity"], logged["project"]))
        else:
            without.append(run_dir)
            continue
        groups.setdefault(name, []).append(run_dir)
        runs |= {r["run_id"] for r in rows}
        names.append(rows[0]["run_name"])
        for row in rows:
            rows_by_task.setdefault(row["task"], []).append(row)
    if not groups:
        raise ValueError(f"no run under {path} logged to wandb ({len(without)} ran without: logger=none); "
                         "run the sweep with logger=wandb, or write its rows as offline wandb runs with "
                         f"python -m posbench.dashboard {shlex.quote(str(path))} --log-rows")
    if len(groups) > 1:
        found = ", ".join(f"{g} ({len(d)} runs)" for g, d in sorted(groups.items()))
        raise ValueError(f"{path} holds runs of {len(groups)} wandb groups: {found}; pass the directory of one sweep")
    if len(targets) > 1:
        raise ValueError(f"the runs under {path} logged to several wandb projects {sorted(map(str, targets))}; "
                         "pass --entity and --project")
    (entity, project), = targets
    return Sweep(next(iter(groups)), tasks_of(rows_by_task), len(runs), entity, project, path, tuple(sorted(names)))


def remote_sweep(group: str, entity: str | None, project: str) -> Sweep:
    """The sweep of a wandb group, from the wandb API (network and a login)."""
    import wandb

    api = wandb.Api()
    entity = entity or api.default_entity
    runs = list(api.runs(f"{entity}/{project}", filters={"group": group}, lazy=False))
    if not runs:
        raise ValueError(f"no runs in group {group!r} of {entity}/{project}; check --entity, --project and the group "
                         "name (the sweep directory's name, <experiment>-<name> with an experiment)")
    metrics, measured = {}, {}
    for run in runs:
        task = run.config.get(TASK)
        if task is None:
            continue
        summary = run.summary_metrics
        if summary.get(headline_key("metric")):
            metrics.setdefault(task, Counter())[summary[headline_key("metric")]] += 1
        measured.setdefault(task, set()).update(k for k in EVAL_KEYS if summary.get(eval_key(k)) is not None)
    tasks = [TaskInfo(t, metrics[t].most_common(1)[0][0] if t in metrics else primary_metric([]),
                      tuple(k for k in EVAL_KEYS if k in measured[t])) for t in sorted(measured)]
    return Sweep(group, tasks, len(runs), entity, project)


def headline_markdown(path: Path) -> str:
    """The local report's headline table (python -m posbench.report) of the rows under path, as markdown."""
    from posbench import report
    from posbench.results import collect

    frame = report.add_groups(collect([str(path)])).sort_values(["task", "label", "seed", "eval_length"])
    frame = frame.reset_index(drop=True)
    runs = report.run_table(frame, report.task_metrics(frame, None), DEFAULT_THRESHOLD)
    headline = report.headline_table(frame, runs, report.summary_table(frame), DEFAULT_THRESHOLD)
    return report.render_markdown([("table", report.headline_rows(headline))])


# ---- --log-rows: a finished sweep's rows as offline wandb runs -----------------------------------

LOGGED_FILE = "wandb-rows.json"  # in a run directory: what --log-rows wrote from its rows
UNFINISHED = ("running", "killed")  # status.json states of a run whose resumption adds rows


def read_logged(run_dir: Path) -> dict | None:
    """The record --log-rows left in run_dir, or None."""
    path = run_dir / LOGGED_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable ({err}); remove it and log the run again with --log-rows") from None
    if not isinstance(record, dict) or not {"group", "entity", "project"} <= set(record):
        raise ValueError(f"{path} is not a --log-rows record; remove it and log the run again with --log-rows")
    return record


def rows_digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]


def rows_status(rows: list[dict]) -> str:
    """The run's `status` summary from its rows: a failure's message, else diverged, else ok."""
    statuses = [str(r.get("status")) for r in rows if r.get("status") != "ok"]
    failed = [s for s in statuses if s.startswith("failed")]
    return failed[0] if failed else "diverged" if "diverged" in statuses else "ok"


def not_to_log(run_dir: Path, rows: list[dict], config: dict) -> str | None:
    """Why --log-rows leaves run_dir alone, or None."""
    if (config.get("logger") or {}).get("name") == "wandb":
        return "it ran with logger=wandb, which logged it already (its offline runs: <run dir>/wandb)"
    logged = read_logged(run_dir)
    if logged is not None:
        changed = ("; its rows changed since: remove that offline run (and the synced wandb run) and "
                   f"{run_dir / LOGGED_FILE}, then log it again" if logged.get("rows_digest") != rows_digest(rows)
                   else f" (remove {run_dir / LOGGED_FILE} to log it again)")
        return f"logged already on {logged.get('logged')} as {logged.get('offline_run')}{changed}"
    state = read_status(run_dir)
    if state is not None and state.get("state") in UNFINISHED:
        return f"not finished ({describe(state)}): resume it, then log its rows"
    if len({r["run_id"] for r in rows}) > 1:
        return f"its {ROW_FILE} holds the rows of several runs ({', '.join(sorted({r['run_id'] for r in rows}))})"
    return None


def log_rows(path: Path, group: str | None, entity: str | None, project: str, wandb_dir: str | None) -> list[Path]:
    """Writes the rows of each run directory under path as an offline wandb run, with the name, id,
    group, tags, config, evaluation history and summary logger=wandb gives a live run (through
    posbench.loggers.WandbLogger); the training history is not in the rows. Leaves a record in the run
    directory (LOGGED_FILE) that the dashboard reads and that keeps a second call from logging it
    again. Returns the offline runs' directories."""
    from posbench.loggers import WandbLogger, run_tags

    written = []
    for run_dir, rows, config in run_directories(path):
        reason = not_to_log(run_dir, rows, config)
        if reason:
            print(f"skipped {run_dir}: {reason}", file=sys.stderr)
            continue
        first, status = rows[0], rows_status(rows)
        flat = RunInfo(**{k: first.get(k) for k in RUN_KEYS}).flat_config(config)  # rows of older runs lack some
        name = group or directory_group(run_dir, rows, config)
        where = Path(wandb_dir) if wandb_dir else run_dir
        where.mkdir(parents=True, exist_ok=True)
        logger = WandbLogger(flat, first["run_name"], name, run_tags(flat), run_dir, project=project, entity=entity,
                             mode="offline", dir=str(where), run_id=first["run_id"])
        offline = Path(logger.run.dir).parent  # <where>/wandb/offline-run-<time>-<run id>
        for row in rows:
            logger.log_eval(row)
        curve = run_dir / "curve.png"
        logger.finish(rows, curve if curve.is_file() else None, status)
        atomic_write(run_dir / LOGGED_FILE, json.dumps(
            {"run_id": first["run_id"], "run_name": first["run_name"], "group": name, "entity": entity,
             "project": project, "offline_run": str(offline), "rows": len(rows), "rows_digest": rows_digest(rows),
             "logged": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
        print(f"logged {first['run_name']} ({len(rows)} rows, status {status}, group {name}): {offline}")
        written.append(offline)
    return written


# ---- wandb-workspaces: the workspace view and the report ----------------------------------------

def workspaces_modules():
    """wandb_workspaces' workspace, report and filter modules; a clear exit without the extra."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
        from wandb_workspaces import expr
    except ImportError as err:
        raise SystemExit(f"posbench.dashboard needs the optional package wandb-workspaces ({err}); "
                         f"install it with: {INSTALL}") from err
    return ws, wr, expr


def wandb_panel(panel: Panel, max_runs: int):
    _, wr, _ = workspaces_modules()
    band = {"groupby_aggfunc": "mean", "groupby_rangefunc": "minmax"}
    if panel.kind == "line":
        return wr.LinePlot(title=panel.title, x=panel.x, y=list(panel.y), log_y=panel.log_y or None,
                           title_x=panel.x, max_runs_to_show=max_runs, **band)
    if panel.kind == "bar":
        return wr.BarPlot(title=panel.title, metrics=list(panel.y), orientation="v", aggregate=True,
                          max_runs_to_show=max_runs, **band)
    if panel.kind == "scatter":
        return wr.ScatterPlot(title=panel.title, x=panel.x, y=panel.y[0])
    return wr.MarkdownPanel(markdown=panel.text)  # text


def wandb_filter(conditions):
    _, _, expr = workspaces_modules()
    terms = []
    for c in conditions:
        key = {"run": lambda k: expr.Metric(RUN_ATTRIBUTES[k]), "config": expr.Config,
               "summary": expr.Summary}[c.section](c.key)
        terms.append({"=": key.__eq__, "in": key.isin, ">=": key.__ge__, "<=": key.__le__}[c.op](c.value))
    return expr.And(*terms)


def max_runs(dashboard: Dashboard) -> int:
    return max(MIN_RUNS_SHOWN, dashboard.sweep.runs)


def build_workspace(dashboard: Dashboard):
    ws, _, _ = workspaces_modules()
    shown = max_runs(dashboard)
    sections = [ws.Section(name=s.name, is_open=True, panels=[wandb_panel(p, shown) for p in s.panels],
                           panel_settings=ws.SectionPanelSettings(x_axis=s.x_axis or "Step"))
                for s in dashboard.sections]
    columns = [f"config:{k}.value" if where == "config" else f"summary:{k}" for where, k in dashboard.columns]
    runset = ws.RunsetSettings(filters=wandb_filter(dashboard.base_conditions()),
                               groupby=[ws.Config(k) for k in dashboard.group_by],
                               order=[ws.Ordering(ws.Summary(dashboard.order_by), ascending=False)],
                               pinned_columns=columns)
    return ws.Workspace(entity=dashboard.entity or "", project=dashboard.project, name=dashboard.title,
                        sections=sections, runset_settings=runset, settings=ws.WorkspaceSettings(max_runs=shown))


def build_report(dashboard: Dashboard):
    _, wr, _ = workspaces_modules()
    sweep, shown = dashboard.sweep, max_runs(dashboard)
    blocks = [wr.P(f"The {sweep.runs} runs of wandb group {sweep.group} "
                   f"({', '.join(t.name for t in sweep.tasks)}), grouped by {' and '.join(dashboard.group_by)}: "
                   "lines and bars are the mean over seeds, bands the min..max. "
                   "Built by python -m posbench.dashboard."),
              wr.H2("Headline (local report)")]
    if dashboard.headline_table:
        blocks += [wr.P(f"python -m posbench.report {sweep.source}: mean ± std over seeds; 'not learned': accuracy "
                        f"at N below {LEARNED_AT_N:g}, not ranked."), wr.MarkdownBlock(text=dashboard.headline_table)]
    else:
        blocks.append(wr.P("Built from the group name: python -m posbench.report SWEEP_DIR on the sweep's "
                           "directory gives the headline table."))
    for section in dashboard.sections:
        group_by = [f"config.{k}" for k in dashboard.group_by if not (section.task and k == TASK)]
        runsets = [wr.Runset(entity=dashboard.entity or "", project=dashboard.project, name=r.name,
                             filters=wandb_filter(r.conditions), groupby=group_by)
                   for r in dashboard.runsets(section)]
        blocks += [wr.H2(section.name),
                   wr.PanelGrid(runsets=runsets, panels=[wandb_panel(p, shown) for p in section.panels])]
    return wr.Report(project=dashboard.project, entity=dashboard.entity or "", title=dashboard.title,
                     description=f"posbench sweep {sweep.group}", width="fluid", blocks=blocks)


# ---- entry point ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m posbench.dashboard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", metavar="SWEEP_DIR_OR_GROUP",
                        help="a sweep or run directory whose runs logged to wandb, or a wandb group name")
    parser.add_argument("--entity",
                        help="default: the runs' logger.entity, else WANDB_ENTITY, else your default entity")
    parser.add_argument("--project",
                        help=f"default: the runs' logger.project, else WANDB_PROJECT, else {DEFAULT_PROJECT}")
    parser.add_argument("--group", help="the wandb group of a directory's runs, where it differs from the one the "
                                        "directory implies (a renamed sweep directory)")
    parser.add_argument("--report", action="store_true",
                        help="save a wandb Report (the same panels and the local headline table), not a workspace view")
    parser.add_argument("--dry-run", action="store_true", help="print the specification as JSON; no network")
    parser.add_argument("--log-rows", action="store_true",
                        help="write the rows of each run directory (run without logger=wandb) as an offline wandb run "
                             "for `wandb sync`, as logger=wandb would have logged it; no network")
    parser.add_argument("--wandb-dir", help="with --log-rows: where the offline runs go (<dir>/wandb/offline-run-*); "
                                            "default: WANDB_DIR, else each run directory, as logger=wandb")
    args = parser.parse_args(argv)
    entity, project = os.environ.get("WANDB_ENTITY"), os.environ.get("WANDB_PROJECT")
    source = Path(args.sweep)
    if args.log_rows:
        os.environ.setdefault("WANDB_SILENT", "true")  # one line per run below instead of wandb's summary of each
        if args.report or args.dry_run:
            parser.error("--log-rows writes offline runs and builds no view: run --dry-run or --report after it")
        if not source.is_dir():
            parser.error(f"{args.sweep!r} is not a directory: --log-rows reads a sweep or run directory's rows")
        try:
            written = log_rows(source, args.group, args.entity or entity, args.project or project or DEFAULT_PROJECT,
                               args.wandb_dir or os.environ.get("WANDB_DIR"))
        except (ValueError, FileNotFoundError) as err:
            parser.error(str(err))
        if written:
            print(f"{len(written)} offline wandb runs written; upload them with:\n"
                  f"  wandb sync {shlex.join(map(str, written))}\n"
                  f"then build their view: python -m posbench.dashboard {shlex.quote(args.sweep)}")
        else:
            print(f"no run under {source} left to log (the reasons are above)")
        return
    if args.wandb_dir:
        parser.error("--wandb-dir goes with --log-rows")
    workspaces_modules()  # the extra, before anything else
    try:
        if source.is_dir():
            sweep = local_sweep(source, args.group)
        elif args.dry_run:
            raise ValueError(f"{args.sweep!r} is not a directory: --dry-run reads the sweep directory (a group name "
                             "is looked up through the wandb API, which --dry-run does not reach)")
        else:
            sweep = remote_sweep(args.group or args.sweep, args.entity or entity,
                                 args.project or project or DEFAULT_PROJECT)
        table = headline_markdown(source) if args.report and sweep.source else None
        # where the runs logged: the command's, else their logger's, else wandb's environment
        dashboard = build_dashboard(sweep, args.entity or sweep.entity or entity,
                                    args.project or sweep.project or project, table)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    kind = "report" if args.report else "workspace"
    if args.dry_run:
        (build_report if args.report else build_workspace)(dashboard)  # wandb-workspaces validates it, offline
        print(json.dumps(dashboard.as_dict(kind), indent=2))
        return
    if not dashboard.entity:
        import wandb

        dashboard.entity = wandb.Api().default_entity
    view = build_report(dashboard) if args.report else build_workspace(dashboard)
    view.save()
    print(f"saved the {kind} for group {sweep.group}: {view.url}")


if __name__ == "__main__":
    sys.exit(main())
