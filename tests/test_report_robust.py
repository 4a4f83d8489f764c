"""The report on broken input and on runs that never learned their task: run directories written by
hand (tests.test_report.write_run), with garbage bytes, stray and truncated lines, and groups below
the learned bar at N, against hand-computed numbers."""
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from posbench import report
from posbench.headline import LEARNED_AT_N, learned
from posbench.report import main as report_main
from posbench.report import write_report
from posbench.results import SCHEMA, RowWriter, cost_figure
from tests.test_report import write_run

GARBAGE = b"\xce\xff\x00\x12 not text\n\x80\x81\x82\n"  # two lines, neither UTF-8: 0xce, then 0x80 opens no character


def section(text: str, title: str) -> str:
    return text.split(f"## {title}")[1].split("\n## ")[0]


def table_rows(text: str) -> list[list[str]]:
    """The cells of a markdown table's rows, the header's first."""
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| ")]


def table(text: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell (the header's too)."""
    return {row[0]: row[1:] for row in table_rows(text)}


def add_status(run_dir: Path, state: str = "ok") -> None:
    rows = [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]
    (run_dir / "status.json").write_text(json.dumps({
        "state": state, "run_id": rows[0]["run_id"], "run_name": rows[0]["run_name"],
        "lengths": [2, 4, 6, 8], "lengths_done": [r["eval_length"] for r in rows]}))


# ---- input nothing may block on -------------------------------------------------------------------

@pytest.fixture
def broken_sweep(tmp_path):
    """Four runs on copy: 'garbage' whose results.jsonl is binary; 'stray' with a {"a": 1} line, a JSON
    array and a row whose eval_length is a string among its rows; 'torn' whose last line is cut; 'bad_status'
    whose rows are fine and whose status.json is binary."""
    root = tmp_path / "sweep"
    curves = {"garbage": {2: 1.0, 4: 1.0, 6: 0.5, 8: 0.1}, "stray": {2: 1.0, 4: 1.0, 6: 0.8, 8: 0.4},
              "torn": {2: 1.0, 4: 1.0, 6: 0.6, 8: 0.2}, "bad_status": {2: 1.0, 4: 1.0, 6: 1.0, 8: 0.0}}
    for seed, (name, curve) in enumerate(curves.items()):
        add_status(write_run(root, name, "alibi", seed, curve))
    (root / "garbage" / "results.jsonl").write_bytes(GARBAGE)
    stray = root / "stray" / "results.jsonl"
    lines = stray.read_text().splitlines()
    wrong_type = json.loads(lines[0]) | {"eval_length": "eight"}
    lines[2:2] = ['{"a": 1}', "[1, 2]", json.dumps(wrong_type)]  # lines 3, 4, 5 of 7
    stray.write_text("\n".join(lines) + "\n")
    torn = root / "torn" / "results.jsonl"
    torn.write_bytes(torn.read_bytes()[:-40])  # the last of 4 rows cut mid-line, no newline
    (root / "bad_status" / "status.json").write_bytes(b"\n\xce\xff{")
    return root


EXPECTED_SKIPS = [
    ("garbage/results.jsonl:1", "not UTF-8 text (byte 0xce at column 1)"),
    ("garbage/results.jsonl:2", "not UTF-8 text (byte 0x80 at column 1)"),
    ("stray/results.jsonl:3", "not a result row: it lacks ['run_id', 'run_name', 'status', 'task', 'encoding'"),
    ("stray/results.jsonl:4", "a JSON list, not a row object"),
    ("stray/results.jsonl:5", 'values of the wrong type: eval_length="eight"'),
    ("torn/results.jsonl:4", "the file ends mid-line: a truncated last line"),
    ("bad_status/status.json:2", "not UTF-8 text (byte 0xce at column 1)"),
]
SUMMARY = "6 lines in 3 files and 1 whole file (status.json)"


def test_a_broken_sweep_is_reported_with_every_skipped_line_named_and_counted(broken_sweep, capsys):
    out = write_report([broken_sweep], out=broken_sweep / "report")
    captured = capsys.readouterr()
    for where, reason in EXPECTED_SKIPS:  # warned with file:line as the report reads them
        assert any(line.startswith(f"warning: skipped {broken_sweep / where}: ") and reason in line
                   for line in captured.err.splitlines()), (where, captured.err)
    assert f"skipped {SUMMARY}: listed in report.md" in captured.out
    text = (out / "report.md").read_text()
    assert f"- Skipped input: {SUMMARY}, each named under 'Skipped input' below." in section(text, "What was run")
    listed = [line for line in section(text, "Skipped input").splitlines() if line.startswith("- ")]
    assert len(listed) == len(EXPECTED_SKIPS)
    for (where, reason), line in zip(EXPECTED_SKIPS, listed):
        assert line.startswith(f"- {broken_sweep / where}: ") and reason in line
    # what was readable is measured: stray's 4 rows, torn's first 3, bad_status's 4; garbage has none
    results = pd.read_csv(out / "results.csv")
    assert results.groupby("run_id").size().to_dict() == {"bad_status-id": 4, "stray-id": 4, "torn-id": 3}
    headline = pd.read_csv(out / "headline.csv").iloc[0]
    assert headline["runs"] == 3 and headline["incomplete_runs"] == 1  # torn lost its length 8
    # OOD per run: stray (0.8+0.4)/2, torn 0.6 (8 lost), bad_status (1.0+0.0)/2
    assert headline["ood_score_mean"] == pytest.approx((0.6 + 0.6 + 0.5) / 3)
    runs = table(section(text, "Runs that did not finish every length"))
    assert "alibi-copy-N4-s2" in runs and "| 2, 4, 6 | 8 |" in text  # torn; bad_status's rows decide its state
    assert "alibi-copy-N4-s3" not in runs
    no_rows = table(text.split("Runs that wrote no rows")[1].split("\n## ")[0])
    assert no_rows["alibi-copy-N4-s0"][0] == "ok"  # garbage: status ok, its only lines unreadable


def test_progress_counts_what_the_report_skips(broken_sweep, capsys):
    assert report_main([str(broken_sweep), "--progress"]) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("bad_status: unreadable status.json (") and EXPECTED_SKIPS[-1][1] in lines[0]
    assert lines[1].startswith("alibi-copy-N4-s0: ok;")  # garbage
    assert lines[4] == f"3 ok, 1 unreadable; skipped {SUMMARY}, as the report skips them:"
    assert len(lines) == 5 + len(EXPECTED_SKIPS)
    for (where, reason), line in zip(EXPECTED_SKIPS, lines[5:]):  # as the report lists them
        assert line.startswith(f"  {broken_sweep / where}: ") and reason in line, line


def test_a_binary_config_yaml_is_skipped_and_the_rows_give_the_steps(tmp_path, capsys):
    run_dir = write_run(tmp_path, "run", "alibi", 0, {2: 1.0, 4: 1.0, 6: 0.5, 8: 0.1}, steps_done=13)
    add_status(run_dir)
    (run_dir / "config.yaml").write_bytes(b"train:\n  steps: \xce\xff\n")
    out = write_report([tmp_path], out=tmp_path / "report")
    message = f"{run_dir / 'config.yaml'}:2: not UTF-8 text (byte 0xce at column 10)"
    assert f"warning: skipped {message} (the run's steps and lengths come from its rows)" in capsys.readouterr().err
    assert pd.read_csv(out / "results.csv")["steps"].tolist() == [13] * 4
    assert "1 whole file (config.yaml)" in (out / "report.md").read_text()
    report_main([str(tmp_path), "--progress"])
    assert "1 ok; skipped 1 whole file (config.yaml), as the report skips them:" in capsys.readouterr().out


def test_no_usable_row_names_what_was_skipped(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "results.jsonl").write_bytes(GARBAGE)
    with pytest.raises(SystemExit):
        report_main([str(tmp_path)])
    err = capsys.readouterr().err
    assert "no results.jsonl rows found under" in err
    assert f"skipped {run_dir / 'results.jsonl'}:2: not UTF-8 text (byte 0x80 at column 1)" in err


# ---- groups that did not learn their task -----------------------------------------------------------

@pytest.fixture(scope="module")
def unlearned(tmp_path_factory):
    """copy: alibi learned (OOD 0.3), t5 learned (OOD 0.1), rope at 0.883 at N with the best OOD score
    (0.95), nope 0.000 everywhere. sort: nope learned (OOD 0.5), alibi learned (OOD 0.2), rope over
    seeds 1.0 and 0.7 at N (mean 0.85: not learned, though one seed did)."""
    root = tmp_path_factory.mktemp("unlearned")
    write_run(root, "ca", "alibi", 0, {2: 1.0, 4: 1.0, 6: 0.4, 8: 0.2})
    write_run(root, "ct", "t5", 0, {2: 1.0, 4: 0.95, 6: 0.2, 8: 0.0})
    write_run(root, "cr", "rope", 0, {2: 1.0, 4: 0.883, 6: 0.95, 8: 0.95})
    write_run(root, "cn", "nope", 0, {n: 0.0 for n in (2, 4, 6, 8)})
    write_run(root, "sn", "nope", 0, {2: 1.0, 4: 1.0, 6: 0.6, 8: 0.4}, task="sort")
    write_run(root, "sa", "alibi", 0, {2: 1.0, 4: 1.0, 6: 0.3, 8: 0.1}, task="sort")
    write_run(root, "sr0", "rope", 0, {2: 1.0, 4: 1.0, 6: 0.9, 8: 0.9}, task="sort")
    write_run(root, "sr1", "rope", 1, {2: 1.0, 4: 0.7, 6: 0.9, 8: 0.9}, task="sort")
    drawn, draw = [], report.plot_ranking

    def plot_ranking(ranking, path):  # what ranking.png is drawn from
        drawn.append(ranking)
        draw(ranking, path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "plot_ranking", plot_ranking)
        out = write_report([root], out=root / "report")
    return out, drawn[0]


def test_learned_is_an_accuracy_at_n_at_or_above_the_bar():
    assert LEARNED_AT_N == 0.9
    assert learned("exact_match", 0.9) and learned("token_acc", (0.9 + 0.9 + 0.9) / 3)
    assert learned("exact_match", 0.883) is False and learned("exact_match", math.nan) is False
    assert learned("perplexity", 50.0) is None  # no bar: ranked as measured


def test_groups_that_did_not_learn_are_not_ranked_and_count_zero_in_the_mrr(unlearned):
    out, _ = unlearned
    headline = pd.read_csv(out / "headline.csv").set_index(["task", "label"])
    assert headline["learned"].to_dict() == {
        ("copy", "alibi"): True, ("copy", "nope"): False, ("copy", "rope"): False, ("copy", "t5"): True,
        ("sort", "alibi"): True, ("sort", "nope"): True, ("sort", "rope"): False}
    assert headline.loc[("sort", "rope"), "learned_runs"] == 1 and headline.loc[("sort", "rope"), "runs"] == 2
    ranks = headline["rank_in_task"]
    assert (ranks[("copy", "alibi")], ranks[("copy", "t5")]) == (1, 2)  # rope's 0.95 past N outranks neither
    assert (ranks[("sort", "nope")], ranks[("sort", "alibi")]) == (1, 2)
    assert ranks[[("copy", "rope"), ("copy", "nope"), ("sort", "rope")]].isna().all()
    mrr = headline.groupby("label")["mrr"].first().to_dict()
    assert mrr == pytest.approx({"alibi": (1 + 1 / 2) / 2, "nope": (0 + 1) / 2, "rope": 0.0, "t5": 1 / 2})
    # the rows of headline.csv: per task, the ranked groups first, then those not learned
    assert [label for task, label in headline.index if task == "copy"] == ["alibi", "t5", "nope", "rope"]


def test_tables_and_ranking_figure_mark_not_learned(unlearned):
    out, ranking = unlearned
    text = (out / "report.md").read_text()
    rows = table_rows(section(text, "Headline metrics"))[1:]
    assert [(task, group, rank) for task, group, rank, *_ in rows] == [
        ("copy", "alibi", "1"), ("copy", "t5", "2"), ("copy", "nope", "not learned"), ("copy", "rope", "not learned"),
        ("sort", "nope", "1"), ("sort", "alibi", "2"), ("sort", "rope", "not learned")]
    assert "not learned (N not measured)" not in text
    by_task = table(section(text, "Past N by task"))
    assert by_task["rope"] == ["0.950 ± – (0.883, not learned)", "0.900 ± 0.000 (0.850, not learned)"]
    assert by_task["alibi"] == ["0.300 ± – (1.000)", "0.200 ± – (1.000)"]
    mrr_table = table(section(text, "Ranking across tasks"))
    assert mrr_table["group"] == ["MRR", "tasks", "not learned", "rank on copy", "rank on sort"]
    assert list(mrr_table)[1:] == ["alibi", "nope", "t5", "rope"]
    assert mrr_table["alibi"] == ["0.750", "2", "", "1", "2"]
    assert mrr_table["nope"] == ["0.500", "2", "1", "not learned", "1"]
    assert mrr_table["t5"] == ["0.500", "1", "", "2", "–"]
    assert mrr_table["rope"] == ["0.000", "2", "2", "not learned", "not learned"]
    # ranking.png draws the same table
    figure = ranking.set_index("label")
    assert figure["mrr"].to_dict() == pytest.approx({"alibi": 0.75, "nope": 0.5, "t5": 0.5, "rope": 0.0})
    assert figure["not_learned"].to_dict() == {"alibi": 0, "nope": 1, "t5": 0, "rope": 2}


def test_learned_groups_are_ranked_within_their_model_size():
    from posbench.report import add_ranking

    def group(encoding, size, score, is_learned=True):
        return {"task": "copy", "setting": "", "encoding_label": encoding, "curve_label": encoding, "size": size,
                "label": f"{encoding} [{size}]", "metric": "exact_match", "ood_score_mean": score,
                "learned": is_learned}

    headline = add_ranking(pd.DataFrame([
        group("alibi", "26k", 0.5), group("nope", "26k", 0.8), group("rope", "26k", 0.9, is_learned=False),
        group("alibi", "151k", 0.9), group("nope", "151k", 0.2), group("rope", "151k", 0.6)]))
    ranks = headline.set_index("label")["rank_in_task"]
    order = ["nope [26k]", "alibi [26k]", "alibi [151k]", "rope [151k]", "nope [151k]"]
    assert ranks[order].tolist() == [1, 2, 1, 2, 3]
    assert math.isnan(ranks["rope [26k]"])
    assert headline.set_index("label")["mrr"]["rope [26k]"] == 0.0


def test_two_runs_that_learned_nothing_rank_nowhere(tmp_path):
    for name, encoding in (("a", "alibi"), ("r", "rope")):
        write_run(tmp_path, name, encoding, 0, {n: 0.0 for n in (2, 4, 6, 8)})
    headline = pd.read_csv(write_report([tmp_path], out=tmp_path / "report") / "headline.csv")
    assert headline["rank_in_task"].isna().all() and headline["mrr"].tolist() == [0.0, 0.0]
    assert not headline["learned"].any()


def test_perplexity_groups_have_no_bar_and_stay_ranked(tmp_path):
    for encoding, ppl in (("alibi", 4.0), ("rope", 60.0)):  # rope's 60 at N: no bar says it did not learn
        writer = RowWriter(tmp_path / encoding)
        for length in (64, 128):
            writer.write({key: None for key in SCHEMA} | {
                "run_id": encoding, "run_name": f"{encoding}-wikitext", "status": "ok", "encoding": encoding,
                "encoding_params": {}, "task": "wikitext", "task_params": {}, "model": {}, "seed": 0,
                "train_length": 64, "train_steps": 5, "eval_length": length, "ratio": length / 64,
                "perplexity": ppl * length / 64, "time": "2026-01-01T00:00:00"})
    headline = pd.read_csv(write_report([tmp_path], out=tmp_path / "report") / "headline.csv").set_index("label")
    assert headline["learned"].isna().all() and headline["learned_runs"].isna().all()
    assert headline["rank_in_task"].to_dict() == {"alibi": 1, "rope": 2}


# ---- cost.png ----------------------------------------------------------------------------------------

def test_cost_axes_start_at_zero_and_say_what_memory_they_show(tmp_path):
    write_run(tmp_path, "a", "alibi", 0, {2: 1.0, 4: 1.0, 6: 0.5, 8: 0.1})  # peak 20..80 MiB, rss_hwm
    summary = pd.read_csv(write_report([tmp_path], out=tmp_path / "report") / "summary.csv")
    figure = cost_figure(summary)
    throughput, memory = figure.axes[0], figure.axes[1]
    assert throughput.get_ylim()[0] == 0 and memory.get_ylim()[0] == 0
    assert memory.get_ylabel().startswith("process peak RSS, MiB") and "mostly torch" in memory.get_ylabel()
    assert memory.get_ylim()[1] >= 80
