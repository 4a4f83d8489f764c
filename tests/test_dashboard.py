"""posbench.dashboard: the wandb view of a sweep, built for a real offline sweep (smoke runs with
WANDB_MODE=offline) and checked against the keys those runs logged. No network: a view is saved
only through a stand-in."""
import json
import re
import shutil
import sys

import pytest
import yaml

from posbench import dashboard
from posbench.dashboard import LOGGED_FILE, build_dashboard, local_sweep, main
from posbench.evaluation import UNMEASURED
from posbench.loggers import EVAL_LENGTH, STATUS, TRAIN_STEP, TRAIN_TOKENS_PER_S, eval_key, headline_key, train_key
from posbench.runinfo import RUN_KEYS
from tests.helpers import posbench, read_rows, wandb_records, write_wikitext_release


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A --multirun of two smoke runs logged offline: copy (exact match) and wikitext (perplexity)."""
    root = tmp_path_factory.mktemp("dashboard")
    data = write_wikitext_release(root / "data")
    sweep = root / "sweep"
    posbench("-m", "debug=smoke", "logger=wandb", "encoding=nope", "task=copy,wikitext", f"hydra.sweep.dir={sweep}",
             env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "POSBENCH_WIKITEXT_DIR": str(data),
                  "POSBENCH_CACHE": str(root / "cache")})
    return sweep


def logged(sweep) -> dict[str, set]:
    """What the sweep's runs wrote to wandb, read back from their offline .wandb logs."""
    found = {"history": set(), "summary": set(), "config": set(), "group": set()}
    logs = sorted(sweep.rglob("offline-run-*/*.wandb"))
    assert len(logs) == 2
    for log in logs:
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                found["history"] |= {item.key or "/".join(item.nested_key) for item in record.history.item}
            elif kind == "summary":
                found["summary"] |= {item.key or "/".join(item.nested_key) for item in record.summary.update}
            elif kind == "config":
                found["config"] |= {item.key for item in record.config.update}
            elif kind == "run":
                found["config"] |= {item.key for item in record.run.config.update}
                found["group"].add(record.run.run_group)
    return found


# ---- the keys: every one a panel reads is one the runs logged -----------------------------------

@pytest.mark.parametrize("kind", ["workspace", "report"])
def test_every_key_the_view_reads_was_logged(sweep, kind):
    view = build_dashboard(local_sweep(sweep))
    keys, wrote = view.keys(kind), logged(sweep)
    assert wrote["group"] == {view.sweep.group} == {"sweep"}  # the directory gives the group the logger used
    assert keys["run"] == {"group"}
    for where in ("history", "summary", "config"):
        assert keys[where] <= wrote[where], f"{where} keys no run logged: {sorted(keys[where] - wrote[where])}"
    # the check covers every kind of panel: per-task curves, cost, training, headline
    assert {eval_key("exact_match"), eval_key("perplexity"), eval_key("peak_mem_mb"), EVAL_LENGTH,
            train_key("loss"), TRAIN_STEP} <= keys["history"]
    assert {headline_key("ood_score"), headline_key("id_score"), TRAIN_TOKENS_PER_S} <= keys["summary"]
    assert {"encoding", "task"} <= keys["config"]


def panel_keys(panel: dict) -> tuple[set, set]:
    """(history, summary) keys of a panel as wandb stores it."""
    config = panel["config"]
    if panel["viewType"] == "Run History Line Plot":
        return {config["xAxis"], *config["metrics"]}, set()
    if panel["viewType"] == "Bar Chart":
        return set(), set(config["metrics"])
    if panel["viewType"] == "Scatter Plot":
        return set(), {config["xAxis"].removeprefix("summary:"), config["yAxis"].removeprefix("summary:")}
    assert panel["viewType"] == "Markdown Panel"
    return set(), set()


def filter_keys(filters: dict) -> dict[str, set]:
    found = {"run": set(), "config": set(), "summary": set()}
    for item in filters["filters"]:
        found[item["key"]["section"]].add(item["key"]["name"])
    return found


def test_the_built_workspace_reads_the_specified_keys(sweep):
    pytest.importorskip("wandb_workspaces")
    view = build_dashboard(local_sweep(sweep))
    spec = dashboard.build_workspace(view)._spec["spec"]["section"]
    history, summary = set(), set()
    for section in spec["panelBankConfig"]["sections"]:
        for panel in section["panels"]:
            h, s = panel_keys(panel)
            history |= h
            summary |= s
    (runset,) = spec["runSets"]
    columns = [c for c in runset["runFeed"]["columnOrder"] if c != "run:displayName"]
    summary |= {c.removeprefix("summary:") for c in columns if c.startswith("summary:")}
    summary |= {key["key"]["name"] for key in runset["sort"]["keys"]}
    config = {g["name"].removesuffix(".value") for g in runset["grouping"]}
    config |= {c.removeprefix("config:").removesuffix(".value") for c in columns if c.startswith("config:")}
    wanted = view.keys("workspace")
    assert (history, summary, config) == (wanted["history"], wanted["summary"], wanted["config"])
    assert filter_keys(runset["filters"])["run"] == {"group"}
    assert runset["filters"]["filters"][0]["value"] == "sweep"
    assert [g["name"] for g in runset["grouping"]] == ["task.value", "encoding.value"]
    names = [s["name"] for s in spec["panelBankConfig"]["sections"]]
    assert names == [s.name for s in view.sections]
    log_axes = {p["config"]["metrics"][0]: p["config"].get("yLogScale") for s in spec["panelBankConfig"]["sections"]
                for p in s["panels"] if p["viewType"] == "Run History Line Plot"}
    assert log_axes[eval_key("perplexity")] is True and log_axes[eval_key("exact_match")] is None
    line = next(p for s in spec["panelBankConfig"]["sections"] for p in s["panels"]
                if p["viewType"] == "Run History Line Plot")
    assert (line["config"]["groupAgg"], line["config"]["groupArea"]) == ("mean", "minmax")


def test_the_built_report_reads_the_specified_keys(sweep):
    pytest.importorskip("wandb_workspaces")
    from wandb_workspaces import expr

    view = build_dashboard(local_sweep(sweep), headline_table="| table |")
    report = dashboard.build_report(view)
    grids = [b for b in report.blocks if type(b).__name__ == "PanelGrid"]
    assert len(grids) == len(view.sections)
    history, summary, config, run = set(), set(), set(), set()
    for grid in grids:
        for panel in grid.panels:
            h, s = panel_keys(panel._to_model().model_dump(by_alias=True, exclude_none=True))
            history |= h
            summary |= s
        for runset in grid.runsets:  # Runset._to_model looks the project up online: read its parts instead
            found = filter_keys(expr.filters_tree_to_v2(expr.expr_to_filters(runset.filters)))
            run |= found["run"]
            summary |= found["summary"]
            config |= found["config"] | {expr.groupby_str_to_key(g).name.removesuffix(".value") for g in runset.groupby}
    wanted = view.keys("report")
    assert (history, summary, config, run) == (wanted["history"], wanted["summary"], wanted["config"], wanted["run"])
    assert any(type(b).__name__ == "MarkdownBlock" and b.text == "| table |" for b in report.blocks)


# ---- the command ----------------------------------------------------------------------------------

def test_dry_run_prints_a_workspace_covering_every_task(sweep, capsys, monkeypatch):
    pytest.importorskip("wandb_workspaces")
    monkeypatch.setenv("WANDB_ENTITY", "from-env")  # the runs set no logger.entity: wandb's environment names it
    main([str(sweep), "--dry-run"])
    spec = json.loads(capsys.readouterr().out)
    assert spec["kind"] == "workspace" and spec["group"] == "sweep" and spec["runs"] == 2
    assert (spec["entity"], spec["project"]) == ("from-env", "posbench")
    assert spec["runset"]["filter"] == [{"section": "run", "key": "group", "op": "=", "value": "sweep"}]
    assert spec["runset"]["group_by"] == ["task", "encoding"]
    by_task = {s["task"]: s["panels"] for s in spec["sections"] if "task" in s}
    assert set(by_task) == {"copy", "wikitext"}
    assert [p["y"] for p in by_task["copy"]] == [[eval_key("exact_match")], [eval_key("token_acc")], [eval_key("loss")]]
    assert by_task["wikitext"][0] == {"kind": "line", "title": "wikitext: perplexity", "x": EVAL_LENGTH,
                                      "y": [eval_key("perplexity")], "log_y": True}
    assert not any(p.get("log_y") for p in by_task["copy"])
    sections = {s["name"]: s for s in spec["sections"]}
    assert [p["y"] for p in sections["headline"]["panels"] if p["kind"] == "bar"] == [
        [headline_key("ood_score")], [headline_key("extrapolation_ratio")], [headline_key("id_score")]]
    assert [p["y"] for p in sections["cost"]["panels"]] == [
        [eval_key("eval_tokens_per_s")], [eval_key("peak_mem_mb")], [TRAIN_TOKENS_PER_S]]
    assert sections["training"]["panels"][0]["x"] == TRAIN_STEP
    assert "headline_table" not in spec and "runsets" not in sections["headline"]


def test_report_dry_run_holds_the_headline_table_and_sets_apart_runs_not_learned(sweep, capsys):
    pytest.importorskip("wandb_workspaces")
    main([str(sweep), "--report", "--dry-run", "--entity", "team", "--project", "study"])
    spec = json.loads(capsys.readouterr().out)
    assert (spec["kind"], spec["entity"], spec["project"]) == ("report", "team", "study")
    rows = [line for line in spec["headline_table"].splitlines() if line.startswith("| copy ") or
            line.startswith("| wikitext ")]
    assert len(rows) == 2 and "not learned" in rows[0]  # 20 smoke steps do not learn copy
    sections = {s["name"]: s for s in spec["sections"]}
    copy = next(s for s in spec["sections"] if s.get("task") == "copy")
    assert [c["key"] for c in copy["runsets"][0]["filter"]] == ["group", "task"]
    assert copy["runsets"][0]["filter"][1]["value"] == "copy"
    headline = sections["headline"]["runsets"]
    assert [r["name"] for r in headline] == ["learned at N (accuracy >= 0.9)", "not learned at N (accuracy < 0.9)",
                                             "perplexity or loss (no bar at N)"]
    learned, not_learned = ({c["op"]: c["value"] for c in r["filter"] if c["key"] == headline_key("id_score")}
                            for r in headline[:2])
    assert learned[">="] > not_learned["<="] and learned[">="] == pytest.approx(0.9)


def copy_run(sweep, into, task="copy"):
    """A copy of the sweep's run of task (without its wandb files and checkpoint) at `into`."""
    source = next(p.parent for p in sweep.rglob("results.jsonl") if f"task={task}" in p.parent.name)
    shutil.copytree(source, into, ignore=shutil.ignore_patterns("wandb", "*.pt"))
    return into


def edit_yaml(path, change):
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data))


def test_the_group_of_a_directory_is_the_one_the_logger_gives(sweep, tmp_path):
    study = tmp_path / "2026-01-01_12-00-00"
    run = copy_run(sweep, study / "0_encoding=nope")
    (study / "multirun.yaml").write_text("{}")
    edit_yaml(run / ".hydra" / "hydra.yaml",
              lambda d: d["hydra"]["runtime"]["choices"].update(experiment="synthetic_suite"))
    assert local_sweep(study).group == "synthetic_suite-2026-01-01_12-00-00"
    assert local_sweep(study, group="renamed").group == "renamed"
    edit_yaml(run / "config.yaml", lambda d: d["logger"].update(group="mine", entity="team", project="study"))
    found = local_sweep(study)
    assert (found.group, found.entity, found.project) == ("mine", "team", "study")
    edit_yaml(run / "config.yaml", lambda d: d["logger"].update(group=None))
    edit_yaml(run / ".hydra" / "hydra.yaml", lambda d: d["hydra"].update(mode="RUN"))
    assert local_sweep(run).group == "nope-copy"  # a single run: <encoding>-<task>


def test_bad_input_says_what_to_do(sweep, tmp_path, capsys):
    pytest.importorskip("wandb_workspaces")  # the command asks for the extra first
    def error(*args) -> str:
        with pytest.raises(SystemExit):
            main([*map(str, args), "--dry-run"])
        return capsys.readouterr().err

    assert "no results.jsonl under" in error(tmp_path)
    assert "is not a directory: --dry-run reads the sweep directory" in error("some-group")
    offline = copy_run(sweep, tmp_path / "none" / "run")
    edit_yaml(offline / "config.yaml", lambda d: d["logger"].update(name="none"))
    assert "run the sweep with logger=wandb" in error(tmp_path / "none")
    two = tmp_path / "two"
    for name in ("a", "b"):
        edit_yaml(copy_run(sweep, two / name) / "config.yaml", lambda d, name=name: d["logger"].update(group=name))
    message = error(two)
    assert "2 wandb groups: a (1 runs), b (1 runs); pass the directory of one sweep" in message


def test_a_missing_extra_names_the_install_command(sweep, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb_workspaces", None)  # import fails as if not installed
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--dry-run"])
    assert "wandb-workspaces" in str(exit_.value) and "pip install -e '.[wandb]'" in str(exit_.value)


# ---- saving: through stand-ins, never the network ------------------------------------------------

@pytest.mark.parametrize("report", [False, True])
def test_saving_prints_the_url(sweep, monkeypatch, capsys, report):
    pytest.importorskip("wandb_workspaces")
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    saved = []
    cls = wr.Report if report else ws.Workspace
    monkeypatch.setattr(cls, "save", lambda self: saved.append(self) or self)
    monkeypatch.setattr(cls, "url", property(lambda self: f"https://wandb.test/{self.entity}/{self.project}/view"))
    main([str(sweep), "--entity", "team", *(["--report"] if report else [])])
    (view,) = saved
    assert (view.entity, view.project) == ("team", "posbench")
    kind = "report" if report else "workspace"
    assert capsys.readouterr().out.strip() == f"saved the {kind} for group sweep: https://wandb.test/team/posbench/view"


def test_a_group_name_reads_the_runs_through_the_wandb_api(monkeypatch):
    import wandb

    class Run:
        def __init__(self, task, metric, measured):
            self.config = {"task": task, "encoding": "rope"}
            self.summary_metrics = {headline_key("metric"): metric, **{eval_key(m): 0.5 for m in measured}}

    class Api:
        default_entity = "me"

        def runs(self, path, filters, lazy):
            assert (path, filters) == ("me/posbench", {"group": "grid-2026"})
            return [Run("copy", "exact_match", ["exact_match", "loss"]), Run("copy", "exact_match", ["token_acc"]),
                    Run("wikitext", "perplexity", ["perplexity"])]

    monkeypatch.setattr(wandb, "Api", Api)
    found = dashboard.remote_sweep("grid-2026", None, "posbench")
    assert (found.group, found.entity, found.runs, found.source) == ("grid-2026", "me", 3, None)
    assert [(t.name, t.metric, t.measured) for t in found.tasks] == [
        ("copy", "exact_match", ("exact_match", "token_acc", "loss")), ("wikitext", "perplexity", ("perplexity",))]
    panels = build_dashboard(found).sections[1].panels
    assert [p.y for p in panels] == [(eval_key("perplexity"),)]  # only what the runs measured


# ---- --log-rows: a sweep run without wandb, written as offline wandb runs afterwards -------------

def read_wandb_run(log) -> dict:
    """One offline run read back from its .wandb log: the run record's identity, config, history
    steps and the summary it ends with (values decoded from JSON), and its exit code."""
    run = {"config": {}, "history": [], "summary": {}}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run |= {"id": r.run_id, "name": r.display_name, "group": r.run_group, "tags": list(r.tags),
                    "project": r.project, "job_type": r.job_type}
            run["config"] |= {item.key: json.loads(item.value_json) for item in r.config.update}
        elif kind == "history":
            run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in record.history.item})
        elif kind == "summary":
            run["summary"] |= {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                               for item in record.summary.update}
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def offline_runs(folder) -> dict[str, dict]:
    """The offline runs under folder, by wandb run id."""
    runs = [read_wandb_run(log) for log in sorted(folder.rglob("offline-run-*/*.wandb"))]
    return {run["id"]: run for run in runs}


def eval_steps(run: dict) -> list[dict]:
    """The history steps log_eval wrote (one per row): those with eval/ratio."""
    return [{k: v for k, v in step.items() if not k.startswith("_")} for step in run["history"]
            if eval_key("ratio") in step]


def without_wandb(sweep, into, task: str):
    """A copy of the sweep's run of task at `into`, as if run with the default logger=none."""
    run = copy_run(sweep, into, task)
    edit_yaml(run / "config.yaml", lambda d: d.update(logger={"name": "none"}))
    return run


def log_rows(sweep, *args, env=None):
    return posbench(str(sweep), "--log-rows", *args, module="posbench.dashboard", env=env)


def test_log_rows_writes_the_run_the_live_logger_wrote(sweep, tmp_path):
    """The fixture's copy run, logged live with logger=wandb, against --log-rows on a copy of it made
    as if run with logger=none: the same run name, id, group, tags, config, evaluation history and
    summary. Only the training history is missing: the rows do not hold it."""
    plain = tmp_path / "sweep"  # the sweep directory's name is the group
    run = without_wandb(sweep, plain / "0_copy", "copy")
    (plain / "multirun.yaml").write_text("{}")
    result = log_rows(plain, "--wandb-dir", str(tmp_path / "out"))  # WANDB_MODE=disabled (helper): offline all the same
    (replayed,) = offline_runs(tmp_path / "out" / "wandb").values()
    (live,) = offline_runs(next(p.parent for p in sweep.rglob("results.jsonl") if "task=copy" in p.parent.name)
                           ).values()
    rows = read_rows(run)
    identity = ("id", "name", "group", "tags", "project", "job_type")
    assert {k: replayed[k] for k in identity} == {k: live[k] for k in identity}
    assert (replayed["id"], replayed["name"], replayed["group"]) == (rows[0]["run_id"], "nope-copy-N16-s0", "sweep")
    assert replayed["tags"] == ["nope", "copy", "positions=sequential", "N=16"]

    assert set(replayed["config"]) == set(live["config"])
    finished = {"train_steps", "train_seconds", "train_tokens_per_s"}  # None when a live run starts; the rows' here
    for key in set(live["config"]) - finished - {"config"}:
        assert replayed["config"][key] == live["config"][key], key
    assert {k: replayed["config"][k] for k in finished} == {k: rows[0][k] for k in finished}
    assert replayed["config"]["train_steps"] == 20
    resolved = [{k: v for k, v in r["config"]["config"].items() if k != "logger"} for r in (replayed, live)]
    assert resolved[0] == resolved[1] and resolved[0]["train"]["steps"] == 20

    assert eval_steps(replayed) == eval_steps(live)
    assert [(s[EVAL_LENGTH], s[eval_key("token_acc")]) for s in eval_steps(replayed)] == [
        (r["eval_length"], r["token_acc"]) for r in rows]
    shown = {k for k in live["summary"] if not k.startswith("_")}
    assert shown - set(replayed["summary"]) == {TRAIN_STEP, *map(train_key, ("loss", "token_acc", "length", "lr"))}
    assert {k for k in replayed["summary"] if not k.startswith("_")} <= shown
    judged = [k for k in shown if k.startswith("headline/")] + [STATUS, TRAIN_TOKENS_PER_S]
    assert {k: replayed["summary"][k] for k in judged} == {k: live["summary"][k] for k in judged}
    assert replayed["summary"][STATUS] == "ok" and replayed["summary"][eval_key("curve_png") + "/_type"] == "image-file"
    assert replayed["exit_code"] == live["exit_code"] == 0

    offline = next((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert f"wandb sync {offline}" in result.stdout
    record = json.loads((run / LOGGED_FILE).read_text())
    assert (record["group"], record["project"], record["offline_run"]) == ("sweep", "posbench", str(offline))


@pytest.fixture
def plain_sweep(sweep, tmp_path):
    """A sweep run without wandb: a real diverged smoke run, the fixture's copy run, its wikitext run
    with the last length failed (as the runner records an evaluation error) and a run killed
    during evaluation."""
    plain = tmp_path / "plain"
    posbench("-m", "debug=smoke", "train.lr=1e30", f"hydra.sweep.dir={plain}")
    without_wandb(sweep, plain / "1_copy", "copy")
    failed = without_wandb(sweep, plain / "2_wikitext", "wikitext")
    rows = read_rows(failed)
    rows[-1] = {k: rows[-1][k] for k in (*RUN_KEYS, "eval_length", "eval_sequence_length", "ratio", "samples", "time")
                } | {"status": "failed: RuntimeError: boom", **UNMEASURED}  # runner.length_row | runner.failed_fields
    (failed / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (failed / "status.json").write_text(json.dumps({"state": "failed", "error": "RuntimeError: boom"}))
    killed = without_wandb(sweep, plain / "3_killed", "copy")
    (killed / "status.json").write_text(json.dumps({"state": "killed", "signal": "SIGTERM", "phase": "evaluate",
                                                    "length": 32}))
    return plain


def test_log_rows_brings_a_sweep_without_wandb_to_the_dashboard(plain_sweep, tmp_path, capsys):
    pytest.importorskip("wandb_workspaces")
    with pytest.raises(SystemExit) as exit_:
        main([str(plain_sweep), "--dry-run"])
    assert exit_.value.code == 2
    assert f"python -m posbench.dashboard {plain_sweep} --log-rows" in capsys.readouterr().err

    result = log_rows(plain_sweep, env={"WANDB_DIR": str(tmp_path / "out")})
    runs = {run["name"]: run for run in offline_runs(tmp_path / "out" / "wandb").values()}
    assert sorted(runs) == ["nope-copy-N16-s0", "nope-wikitext-N64-s0", "rope-copy-N16-s0"]
    assert {run["group"] for run in runs.values()} == {"plain"}
    assert "3_killed: not finished (killed by SIGTERM at evaluating length 32)" in result.stderr
    assert len(re.findall("^logged ", result.stdout, re.M)) == 3

    diverged = runs["rope-copy-N16-s0"]  # debug=smoke's encoding, trained with lr 1e30
    assert (diverged["summary"][STATUS], diverged["exit_code"]) == ("diverged", 1)
    assert {k for s in eval_steps(diverged) for k in s} == {EVAL_LENGTH, eval_key("ratio")}  # nothing measured
    assert diverged["summary"][headline_key("complete")] is False

    wikitext = runs["nope-wikitext-N64-s0"]
    rows = read_rows(plain_sweep / "2_wikitext")
    assert (wikitext["summary"][STATUS], wikitext["exit_code"]) == ("failed: RuntimeError: boom", 1)
    assert [s.get(eval_key("perplexity")) for s in eval_steps(wikitext)] == [r.get("perplexity") for r in rows]
    assert rows[0]["perplexity"] > 1 and "perplexity" not in rows[-1]
    assert wikitext["summary"][headline_key("metric")] == "perplexity"
    assert runs["nope-copy-N16-s0"]["summary"][STATUS] == "ok"

    main([str(plain_sweep), "--dry-run"])
    spec = json.loads(capsys.readouterr().out)
    assert (spec["group"], spec["runs"], spec["project"]) == ("plain", 3, "posbench")
    assert spec["run_names"] == sorted(runs)
    assert spec["runset"]["filter"][0]["value"] == "plain" and set(spec["tasks"]) == {"copy", "wikitext"}


def test_log_rows_again_skips_the_runs_it_logged(plain_sweep, tmp_path):
    out = tmp_path / "out"
    log_rows(plain_sweep, "--wandb-dir", str(out))
    again = log_rows(plain_sweep, "--wandb-dir", str(out))
    assert len(offline_runs(out)) == 3 and len(list(out.rglob("offline-run-*"))) == 3  # nothing written twice
    assert again.stdout.strip() == f"no run under {plain_sweep} left to log (the reasons are above)"
    assert again.stderr.count("logged already on") == 3
    assert f"(remove {plain_sweep / '1_copy' / LOGGED_FILE} to log it again)" in again.stderr
    rows = (plain_sweep / "1_copy" / "results.jsonl").read_text().splitlines()
    (plain_sweep / "1_copy" / "results.jsonl").write_text(rows[0] + "\n")
    changed = log_rows(plain_sweep, "--wandb-dir", str(out)).stderr
    assert "1_copy: logged already" in changed and "its rows changed since" in changed
    assert len(list(out.rglob("offline-run-*"))) == 3


def test_log_rows_bad_input_names_the_path(tmp_path, capsys):
    def error(*args) -> str:
        with pytest.raises(SystemExit) as exit_:
            main([*map(str, args)])
        assert exit_.value.code == 2
        return capsys.readouterr().err

    missing = tmp_path / "no-such-sweep"
    assert f"'{missing}' is not a directory: --log-rows reads" in error(missing, "--log-rows")
    assert f"no results.jsonl under {tmp_path}: not a run or sweep directory" in error(tmp_path, "--log-rows")
    assert "run --dry-run or --report after it" in error(tmp_path, "--log-rows", "--dry-run")
    assert "--wandb-dir goes with --log-rows" in error(tmp_path, "--wandb-dir", tmp_path)
    result = posbench(str(missing), "--log-rows", module="posbench.dashboard", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr and str(missing) in result.stderr
