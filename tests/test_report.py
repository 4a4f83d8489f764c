"""Headline metrics on hand-made curves; the report on run directories written here (a crashed,
a diverged and a partial run among them) against hand-computed numbers; wandb summary keys."""
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from posbench.headline import lower_is_better, primary_metric, run_headline, spread
from posbench.report import main as report_main
from posbench.report import holding, write_report
from posbench.results import SCHEMA, RowWriter
from posbench.runinfo import with_added_settings
from tests.helpers import posbench, read_rows, wandb_records

N = 4
LENGTHS = (2, 4, 6, 8)


def curve_rows(curve: dict, metric: str = "exact_match", train_length: int = N) -> list[dict]:
    """Rows of one run: curve maps length -> value (None: the row says diverged)."""
    return [{"eval_length": n, "train_length": train_length, "status": "ok" if v is not None else "diverged",
             metric: v} for n, v in curve.items()]


# ---- headline metrics ------------------------------------------------------------------------

@pytest.mark.parametrize("curve,length", [
    ({2: 1.0, 4: 1.0, 6: 0.9, 8: 0.89}, 6),  # exactly the threshold holds; just below does not
    ({2: 1.0, 4: 1.0, 6: 0.5, 8: 0.95}, 4),  # a dip then recovery: L stops before the dip
    ({2: 1.0, 4: 0.95, 6: 0.92, 8: 0.91}, 8),  # all above: the longest length
    ({2: 0.5, 4: 0.4, 6: 0.1, 8: 0.0}, 0),  # none above: 0
    ({2: 1.0, 4: 0.8, 6: 0.95, 8: 0.95}, 2),  # fails at N: L below N
])
def test_extrapolation_length_holds_at_every_length_up_to_it(curve, length):
    head = run_headline(curve_rows(curve))
    assert head.extrapolation_length == length and head.extrapolation_ratio == length / N
    assert head.id_score == curve[N]
    assert head.ood_score == pytest.approx((curve[6] + curve[8]) / 2)
    assert head.complete and head.metric == "exact_match"


def test_threshold_is_a_parameter():
    curve = curve_rows({2: 1.0, 4: 1.0, 6: 0.7, 8: 0.5})
    assert run_headline(curve, threshold=0.7).extrapolation_length == 6
    assert run_headline(curve, threshold=0.5).extrapolation_length == 8


def test_perplexity_within_ten_percent_of_its_value_at_n():
    # shorter contexts are not judged (5.0 is 25% above N's 4.0); 4.4 is within 10%; 4.5 is not
    rows = curve_rows({2: 5.0, 4: 4.0, 6: 4.3, 8: 4.5}, "perplexity")
    head = run_headline(rows)
    assert head.metric == "perplexity" and lower_is_better("perplexity")
    assert (head.id_score, head.extrapolation_length, head.extrapolation_ratio) == (4.0, 6, 1.5)
    assert head.ood_score == pytest.approx(4.4)
    edge = run_headline(curve_rows({4: 10.0, 6: 11.0, 8: 11.5}, "perplexity"))
    assert edge.extrapolation_length == 6  # exactly 10% above holds
    assert math.isnan(run_headline(curve_rows({6: 4.0, 8: 4.0}, "perplexity"),
                                   expected_lengths=[4, 6, 8]).extrapolation_length)  # no value at N


def test_missing_lengths_are_flagged_and_end_the_chain():
    rows = curve_rows({2: 1.0, 4: 1.0, 6: 1.0})
    head = run_headline(rows, expected_lengths=LENGTHS)
    assert not head.complete and head.missing_lengths == [8]
    assert head.extrapolation_length == 6 and head.ood_score == 1.0  # a lower bound, from what was measured
    diverged = run_headline(curve_rows({n: None for n in LENGTHS}))
    assert diverged.missing_lengths == list(LENGTHS)
    assert all(math.isnan(getattr(diverged, s)) for s in ("id_score", "ood_score", "extrapolation_length"))


def test_primary_metric_and_directions():
    lm_rows = [{"status": "ok", "exact_match": None, "perplexity": 4.0, "token_acc": 0.5}]
    assert primary_metric(lm_rows) == "perplexity"
    assert primary_metric([{"status": "ok", "exact_match": 0.0}]) == "exact_match"
    assert not lower_is_better("exact_match") and lower_is_better("bits_per_byte")
    with pytest.raises(ValueError, match=r"'bogus'.*exact_match"):
        lower_is_better("bogus")


def test_spread_over_seeds():
    assert spread([1.0, 2.0, 3.0, float("nan")]) == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0, "n": 3}
    one = spread([0.5])
    assert one["mean"] == 0.5 and math.isnan(one["std"]) and one["n"] == 1
    assert spread([])["n"] == 0


# ---- the report on written run directories ----------------------------------------------------

def write_run(root: Path, name: str, encoding: str, seed: int, curve: dict, task: str = "copy",
              encoding_params: dict | None = None, status: dict | None = None, steps_done: int = 20,
              device: str = "cpu") -> Path:
    """A run directory as the runner leaves it: config.yaml (20 steps, lengths 2..8) and one row per
    entry of curve (length -> exact match); status overrides a length's status (metrics then None)."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("train:\n  steps: 20\neval:\n  ratios: [0.5, 1, 1.5, 2]\n  lengths: null\n")
    writer = RowWriter(run_dir)
    for length, exact in curve.items():
        row_status = (status or {}).get(length, "ok")
        measured = row_status == "ok"
        row = {key: None for key in SCHEMA} | {
            "run_id": f"{name}-id", "run_name": f"{encoding}-{task}-N{N}-s{seed}", "status": row_status,
            "encoding": encoding, "encoding_params": encoding_params or {}, "task": task,
            "task_params": {"symbols": 10, "bos": True}, "model": {"d_model": 16, "n_layers": 1},
            "backend": "sdpa", "seed": seed, "train_length": N, "train_sequence_length": 2 * N + 2,
            "train_lengths": "uniform", "positions": "sequential", "max_position": 18,
            "train_steps": steps_done, "train_seconds": 1.0, "train_tokens_per_s": 1000.0 * (seed + 1),
            "eval_length": length, "eval_sequence_length": 2 * length + 2, "ratio": length / N, "samples": 8,
            "exact_match": exact if measured else None, "token_acc": exact if measured else None,
            "loss": 1.0 - exact if measured else None,
            "eval_tokens_per_s": 100.0 * length if measured else None,
            "peak_mem_mb": 10.0 * length if measured else None, "mem_kind": "rss_hwm" if measured else None,
            "device": device, "torch": "test", "git_commit": "abc", "time": f"2026-01-01T00:00:{length:02d}"}
        writer.write(row)
    return run_dir


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Groups on copy (N = 4, lengths 2..8): alibi over seeds 0, 1 and a crashed seed 2; rope
    base=10000 with a diverged seed 1; rope base=500 stopped before length 8. On sort: one run each."""
    root = tmp_path_factory.mktemp("sweep")
    write_run(root, "a0", "alibi", 0, {2: 1.0, 4: 1.0, 6: 0.9, 8: 0.5})
    write_run(root, "a1", "alibi", 1, {2: 1.0, 4: 0.8, 6: 0.6, 8: 0.2})
    write_run(root, "a2", "alibi", 2, {2: 1.0, 4: 1.0, 6: 0.0},
              status={6: "failed: RuntimeError: out of memory"})
    write_run(root, "r0", "rope", 0, {2: 1.0, 4: 1.0, 6: 0.0, 8: 0.0}, encoding_params={"base": 10000})
    write_run(root, "r1", "rope", 1, {n: 0.0 for n in LENGTHS}, encoding_params={"base": 10000},
              status={n: "diverged" for n in LENGTHS}, steps_done=7)
    write_run(root, "p0", "rope", 0, {2: 1.0, 4: 1.0, 6: 1.0}, encoding_params={"base": 500})
    write_run(root, "sa", "alibi", 0, {2: 1.0, 4: 1.0, 6: 0.2, 8: 0.0}, task="sort")
    write_run(root, "sr", "rope", 0, {2: 1.0, 4: 1.0, 6: 0.4, 8: 0.2}, task="sort",
              encoding_params={"base": 10000})
    out = write_report([root], out=root / "report")
    return out


def read(out: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(out / name)


def test_every_file_is_written(report):
    for name in ("results.csv", "summary.csv", "headline.csv", "report.md", "report.html",
                 "comparison_exact_match.png", "ood_heatmap.png", "cost.png", "ranking.png"):
        assert (report / name).stat().st_size > 500, name
    assert len(read(report, "results.csv")) == 4 + 4 + 3 + 4 + 4 + 3 + 4 + 4


def test_groups_pool_seeds_and_keep_encoding_params_apart(report):
    headline = read(report, "headline.csv")
    copy = headline[headline["task"] == "copy"].set_index("label")
    assert sorted(copy.index) == ["alibi", "rope base=10000", "rope base=500"]
    assert copy.loc["alibi", "runs"] == 3 and copy.loc["alibi", "seeds"] == "0,1,2"
    assert copy.loc["rope base=10000", "runs"] == 2 and copy.loc["rope base=500", "runs"] == 1


def test_summary_numbers(report):
    summary = read(report, "summary.csv").set_index(["task", "label", "eval_length"])
    at_n = summary.loc[("copy", "alibi", 4)]  # 1.0, 0.8, 1.0
    assert (at_n["runs"], at_n["n"]) == (3, 3)
    assert at_n["exact_match_mean"] == pytest.approx(2.8 / 3)
    assert at_n["exact_match_std"] == pytest.approx(math.sqrt(0.04 / 3))  # deviations 1/15, -2/15, 1/15
    assert (at_n["exact_match_min"], at_n["exact_match_max"]) == (0.8, 1.0)
    past = summary.loc[("copy", "alibi", 6)]  # 0.9, 0.6; seed 2 failed here
    assert (past["runs"], past["n"]) == (3, 2)
    assert past["exact_match_mean"] == pytest.approx(0.75) and past["exact_match_std"] == pytest.approx(0.3 / 2**0.5)
    longest = summary.loc[("copy", "alibi", 8)]  # 0.5, 0.2; seed 2 never got here
    assert longest["n"] == 2 and longest["exact_match_mean"] == pytest.approx(0.35)
    assert longest["eval_tokens_per_s_mean"] == 800.0 and longest["peak_mem_mb_max"] == 80.0
    diverged = summary.loc[("copy", "rope base=10000", 6)]  # seed 0 only; seed 1 diverged
    assert diverged["n"] == 1 and diverged["exact_match_mean"] == 0.0 and math.isnan(diverged["exact_match_std"])


def test_headline_numbers(report):
    headline = read(report, "headline.csv").set_index(["task", "label"])
    alibi = headline.loc[("copy", "alibi")]
    # per seed: id 1.0, 0.8, 1.0; OOD (0.9+0.5)/2, (0.6+0.2)/2, none; L 6, 2, 4 (seed 2: a lower bound)
    assert alibi["id_score_mean"] == pytest.approx(2.8 / 3) and alibi["id_score_n"] == 3
    assert alibi["ood_score_mean"] == pytest.approx(0.55) and alibi["ood_score_n"] == 2
    assert alibi["ood_score_std"] == pytest.approx(0.3 / 2**0.5)
    assert (alibi["extrapolation_length_mean"], alibi["extrapolation_length_std"]) == (4.0, 2.0)
    assert (alibi["extrapolation_length_min"], alibi["extrapolation_length_max"]) == (2.0, 6.0)
    assert alibi["extrapolation_ratio_mean"] == 1.0 and alibi["extrapolation_ratio_std"] == 0.5
    assert alibi["incomplete_runs"] == 1 and alibi["longest_length"] == 8
    assert alibi["train_tokens_per_s_mean"] == 2000.0  # seeds 0..2: 1000, 2000, 3000
    assert alibi["eval_tokens_per_s_at_longest_mean"] == 800.0 and alibi["peak_mem_mb_at_longest_mean"] == 80.0
    rope = headline.loc[("copy", "rope base=10000")]  # the diverged seed counts nowhere but in runs
    assert (rope["runs"], rope["id_score_n"], rope["extrapolation_length_n"]) == (2, 1, 1)
    assert rope["extrapolation_length_mean"] == 4.0 and math.isnan(rope["id_score_std"])
    partial = headline.loc[("copy", "rope base=500")]
    assert partial["ood_score_mean"] == 1.0 and partial["extrapolation_length_mean"] == 6.0
    assert partial["incomplete_runs"] == 1


def test_seeds_on_different_devices_pool_their_scores_but_not_their_costs(tmp_path):
    write_run(tmp_path, "c0", "alibi", 0, {2: 1.0, 4: 1.0, 6: 0.8, 8: 0.4})
    write_run(tmp_path, "g1", "alibi", 1, {2: 1.0, 4: 1.0, 6: 0.6, 8: 0.2}, device="cuda")
    write_run(tmp_path, "r0", "rope", 0, {2: 1.0, 4: 1.0, 6: 0.0, 8: 0.0})
    out = write_report([tmp_path], out=tmp_path / "report")
    headline = read(out, "headline.csv").set_index("label")
    alibi, rope = headline.loc["alibi"], headline.loc["rope"]
    assert alibi["devices"] == "cpu, cuda" and alibi["runs"] == 2
    assert alibi["ood_score_mean"] == pytest.approx(0.5)  # (0.8 + 0.4) / 2 and (0.6 + 0.2) / 2
    assert math.isnan(alibi["train_tokens_per_s_mean"]) and math.isnan(alibi["eval_tokens_per_s_at_longest_mean"])
    assert math.isnan(alibi["peak_mem_mb_at_longest_mean"])
    assert rope["devices"] == "cpu" and rope["train_tokens_per_s_mean"] == 1000.0
    assert rope["peak_mem_mb_at_longest_mean"] == 80.0
    assert "different devices: copy alibi (cpu, cuda)" in (out / "report.md").read_text()


def test_ranking_is_the_mean_reciprocal_rank_over_tasks(report):
    headline = read(report, "headline.csv").set_index(["task", "label"])
    # OOD on copy: rope base=500 1.0 > alibi 0.55 > rope base=10000 0.0; on sort: rope 0.3 > alibi 0.1
    assert headline.loc[("copy", "rope base=500"), "rank_in_task"] == 1
    assert headline.loc[("copy", "alibi"), "rank_in_task"] == 2
    assert headline.loc[("sort", "rope base=10000"), "rank_in_task"] == 1
    assert headline.loc[("copy", "alibi"), "mrr"] == pytest.approx((1 / 2 + 1 / 2) / 2)
    assert headline.loc[("sort", "rope base=10000"), "mrr"] == pytest.approx((1 / 3 + 1) / 2)
    assert headline.loc[("copy", "rope base=500"), ["mrr", "tasks"]].tolist() == [1.0, 1]


def test_a_task_setting_is_ranked_on_its_own_and_the_mrr_pools_an_encoding_over_them():
    """Copy's cmc and rsc are two comparisons: an encoding is ranked within each, and its MRR is
    over both and sort, as Kazemnejad et al. rank encodings over their tasks."""
    from posbench.report import add_ranking, ranking_table

    def group(task, setting, encoding, score):
        label = f"{encoding} {setting}".strip()
        return {"task": task, "setting": setting, "encoding_label": encoding, "curve_label": label, "label": label,
                "size": "", "metric": "exact_match", "ood_score_mean": score, "learned": True}

    headline = add_ranking(pd.DataFrame([
        group("copy", "variant=cmc", "alibi", 0.8), group("copy", "variant=cmc", "nope", 0.1),
        group("copy", "variant=rsc", "alibi", 0.9), group("copy", "variant=rsc", "nope", 1.0),
        group("sort", "", "alibi", 0.4), group("sort", "", "nope", 0.9)]))
    ranks = headline.set_index(["task", "label"])["rank_in_task"]
    assert ranks[("copy", "alibi variant=cmc")] == 1 and ranks[("copy", "nope variant=rsc")] == 1
    table = ranking_table(headline).set_index("label")
    assert table.loc["alibi", "mrr"] == pytest.approx((1 + 1 / 2 + 1 / 2) / 3)
    assert table.loc["nope", "mrr"] == pytest.approx((1 / 2 + 1 + 1) / 3)
    assert table.loc["nope", ["tasks", "rank on copy variant=cmc", "rank on copy variant=rsc", "rank on sort"]
                     ].tolist() == [3, 2, 1, 1]


def test_past_n_by_task_is_the_headline_pivoted(report):
    text = (report / "report.md").read_text()
    section = text.split("## Past N by task")[1].split("## ")[0]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in section.splitlines() if line.startswith("| ")]
    assert rows[0] == ["group", "copy", "sort"]
    cells = {row[0]: row[1:] for row in rows[1:]}
    # alibi on copy: OOD 0.55 ± 0.3/sqrt(2), at N 2.8/3; on sort: one run, OOD 0.1, at N 1.0
    assert cells["alibi"] == ["0.550 ± 0.212 (0.933)", "0.100 ± – (1.000)"]
    assert cells["rope base=500"] == ["1.000 ± – (1.000)", ""]  # ran on copy only
    assert list(cells) == ["rope base=500", "rope base=10000", "alibi"]  # by MRR: 1.0 (one task), 0.67, 0.5


def test_report_lists_every_run_that_did_not_finish(report):
    text = (report / "report.md").read_text()
    section = text.split("## Runs that did not finish every length")[1].split("## ")[0]
    lines = {line.split(" | ")[0].strip("| "): line for line in section.splitlines() if line.startswith("| ")}
    assert "failed: RuntimeError: out of memory" in lines["alibi-copy-N4-s2"]
    assert "| 2, 4 | 6, 8 |" in lines["alibi-copy-N4-s2"]  # finished, missing
    assert "diverged after 7 of 20 steps" in lines["rope-copy-N4-s1"] and "| none | 2, 4, 6, 8 |" in lines["rope-copy-N4-s1"]
    assert "stopped early" in lines["rope-copy-N4-s0"] and "| 2, 4, 6 | 8 |" in lines["rope-copy-N4-s0"]
    assert len(lines) == 4  # the header and the three runs


def test_html_is_self_contained(report):
    page = (report / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    assert "src=\"http" not in page and "<link" not in page
    assert "rope base=500" in page and "±" in page


def test_runs_from_a_checkpoint_form_their_own_group(tmp_path):
    """Rows written before init_steps existed read as trained from scratch (init_steps 0), and
    before a parameter existed as leaving it null."""
    old = write_run(tmp_path, "old", "alibi", 0, {2: 1.0, 4: 1.0, 6: 0.5, 8: 0.1})
    rows = read_rows(old)
    (old / "results.jsonl").write_text("".join(json.dumps({k: v for k, v in row.items() if k != "init_steps"}) + "\n"
                                               for row in rows))
    for name, seed, init_steps in (("new", 1, 0), ("tuned", 0, 40)):
        run_dir = write_run(tmp_path, name, "alibi", seed, {2: 1.0, 4: 1.0, 6: 0.7, 8: 0.3},
                            encoding_params={"added_later": None})
        rows = [json.loads(line) | {"init_steps": init_steps} for line in (run_dir / "results.jsonl").open()]
        (run_dir / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    headline = read(write_report([tmp_path], out=tmp_path / "report"), "headline.csv").set_index("label")
    assert sorted(headline.index) == ["alibi init_steps=0", "alibi init_steps=40"]
    assert headline.loc["alibi init_steps=0", "seeds"] == "0,1"
    assert headline.loc["alibi init_steps=0", "ood_score_mean"] == pytest.approx((0.3 + 0.5) / 2)
    assert headline.loc["alibi init_steps=40", "runs"] == 1


def test_one_run_one_seed_and_language_model_rows(tmp_path):
    run_dir = tmp_path / "lm"
    writer = RowWriter(run_dir)
    for length, ppl in ((32, 5.0), (64, 4.0), (128, 4.2), (256, 6.0)):
        writer.write({key: None for key in SCHEMA} | {
            "run_id": "lm", "run_name": "alibi-wikitext-N64-s0", "status": "ok", "encoding": "alibi",
            "encoding_params": {}, "task": "wikitext", "task_params": {"data_dir": "/somewhere", "tokenizer": "byte"},
            "model": {}, "seed": 0, "train_length": 64, "train_steps": 5, "eval_length": length,
            "ratio": length / 64, "token_acc": 0.5, "loss": math.log(ppl), "perplexity": ppl,
            "sliding_perplexity": ppl * 0.9, "bits_per_byte": math.log2(ppl), "eval_tokens_per_s": 10.0,
            "peak_mem_mb": 5.0, "mem_kind": "process_peak_rss", "time": "2026-01-01T00:00:00"})
    out = write_report([run_dir])
    headline = read(out, "headline.csv").iloc[0]
    assert headline["metric"] == "perplexity" and headline["label"] == "alibi"
    assert (headline["id_score_mean"], headline["extrapolation_length_mean"]) == (4.0, 128)
    assert headline["ood_score_mean"] == pytest.approx(5.1) and math.isnan(headline["ood_score_std"])
    assert math.isnan(headline["peak_mem_mb_at_longest_mean"])  # a process-lifetime peak is not the length's own
    assert (out / "comparison_perplexity.png").exists()
    assert "| 4.000 ± – | 5.100 ± – |" in (out / "report.md").read_text()
    write_report([run_dir], out=tmp_path / "sliding", metric="sliding_perplexity")
    assert read(tmp_path / "sliding", "headline.csv").iloc[0]["id_score_mean"] == pytest.approx(3.6)


def test_bad_arguments_name_the_choices(tmp_path, capsys):
    run_dir = write_run(tmp_path, "a", "alibi", 0, {4: 1.0})
    with pytest.raises(SystemExit):
        report_main([str(run_dir), "--metric", "perplexity"])
    assert "no row measures it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report_main([str(run_dir), "--threshold", "1.5"])
    assert "(0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report_main([str(tmp_path / "absent")])
    assert "no such run or sweep directory" in capsys.readouterr().err


# ---- wandb: the summary of an offline run ------------------------------------------------------

def test_wandb_offline_sweep_run_has_group_tags_and_headline_summary(tmp_path):
    sweep = tmp_path / "sweep"
    posbench("-m", "debug=smoke", "logger=wandb", "encoding=alibi", f"hydra.sweep.dir={sweep}",
             env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    (log,) = sweep.rglob("offline-run-*/*.wandb")
    records = list(wandb_records(log))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.run_group == "sweep"  # no experiment: the sweep dir name and run.display_name == "alibi-copy-N16-s0"
    assert set(run.tags) == {"alibi", "copy", "positions=sequential", "N=16"}
    summary = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for u in r.summary.update if u.key}
    rows = read_rows(next(sweep.rglob("results.jsonl")).parent)
    expected = run_headline(rows)
    assert summary["headline/metric"] == "exact_match" and summary["status"] == "ok"
    assert summary["headline/id_score"] == expected.id_score
    assert summary["headline/extrapolation_ratio"] == expected.extrapolation_ratio
    assert {"headline/ood_score", "headline/extrapolation_length", "headline/complete"} <= set(summary)


def test_orderings_across_sizes_separate_only_when_every_seed_does():
    from posbench.report import ordering_table

    def group(label, size, n_params, low, high, n=3, task="copy", metric="exact_match", setting=""):
        return {"task": task, "setting": setting, "curve_label": label, "size": size, "n_params": n_params,
                "metric": metric, "ood_score_min": low, "ood_score_max": high, "ood_score_n": n}

    headline = pd.DataFrame([
        group("alibi", "26k", 26_000, 0.5, 0.6), group("alibi", "151k", 151_000, 0.6, 0.7),
        group("alibi", "794k", 794_000, 0.7, 0.8),
        group("nope", "26k", 26_000, 0.1, 0.2), group("nope", "151k", 151_000, 0.65, 0.75),  # overlaps alibi
        group("nope", "794k", 794_000, 0.9, 0.95),
        group("rope", "26k", 26_000, 0.0, 0.05), group("rope", "151k", 151_000, 0.0, 0.05),
        group("rope", "794k", 794_000, 0.3, 0.9, n=1),  # one seed: not compared at this size
        group("t5", "26k", 26_000, 0.0, 0.3), group("t5", "151k", 151_000, 0.04, 0.5),
        # another variant of copy: its groups are compared with each other only
        group("alibi variant=rsc", "26k", 26_000, 0.95, 1.0, setting="variant=rsc"),
        group("alibi variant=rsc", "151k", 151_000, 0.95, 1.0, setting="variant=rsc"),
        group("sinusoidal variant=rsc", "26k", 26_000, 0.2, 0.97, setting="variant=rsc"),
        group("sinusoidal variant=rsc", "151k", 151_000, 0.3, 0.5, setting="variant=rsc"),
        # perplexity: lower is better
        group("alibi", "26k", 26_000, 20.0, 21.0, task="wikitext", metric="perplexity"),
        group("alibi", "151k", 151_000, 18.0, 19.0, task="wikitext", metric="perplexity"),
        group("rope", "26k", 26_000, 30.0, 40.0, task="wikitext", metric="perplexity"),
        group("rope", "151k", 151_000, 25.0, 35.0, task="wikitext", metric="perplexity"),
    ])
    table = ordering_table(headline).set_index(["task", "first", "second"])
    assert table.loc[("copy", "alibi variant=rsc", "sinusoidal variant=rsc"), "setting"] == "variant=rsc"
    table = table[["verdict", "relations"]]
    assert table.loc[("copy", "alibi", "nope")].tolist() == ["reverses", "26k: >, 151k: ≈, 794k: <"]
    assert table.loc[("copy", "alibi", "rope")].tolist() == ["holds", "26k: >, 151k: >"]
    assert table.loc[("copy", "nope", "t5")].tolist() == ["depends on size", "26k: ≈, 151k: >"]
    assert table.loc[("copy", "rope", "t5")].tolist() == ["not separated", "26k: ≈, 151k: ≈"]
    assert table.loc[("wikitext", "alibi", "rope")].tolist() == ["holds", "26k: >, 151k: >"]
    assert table.loc[("copy", "alibi variant=rsc", "sinusoidal variant=rsc")].tolist() == [
        "depends on size", "26k: ≈, 151k: >"]
    # every pair of the four on copy at two or more sizes, the one of rsc, and the one on wikitext
    assert len(table) == 6 + 1 + 1


def test_added_parameters_reach_only_the_classes_that_take_them():
    """Labels fill in parameters added after a run was made, but only where its class has them: an alibi
    group never shows rope's frequency_fraction."""
    alibi = with_added_settings({"encoding": {"_target_": "posbench.encodings.alibi.ALiBi"},
                                 "task": {"_target_": "tasks.copy.Copy"}, "model": {}})
    assert "frequency_fraction" not in alibi["encoding"] and alibi["task"]["eos"] is False
    assert alibi["model"]["activation"] == "gelu"  # settings outside encoding and task: always
    rope = with_added_settings({"encoding": {"_target_": "posbench.encodings.rope.RoPE"}})
    assert rope["encoding"]["frequency_fraction"] == 1.0 and rope["encoding"]["start_positions"] == 0


def test_a_composite_or_schedule_is_labelled_by_what_it_holds():
    assert holding("composite", {"encoding.parts": ["rope", "ssmax"]}) == ("composite(rope+ssmax)", {"encoding.parts"})
    assert holding("schedule", {"encoding.pattern": ["rope", "rope", "nope"]}) == (
        "schedule(rope,rope,nope)", {"encoding.pattern"})
    assert holding("alibi", {"encoding.parts": ["x"]}) == ("alibi", set())
