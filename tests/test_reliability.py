"""Runs you can trust, in process: exact grouping by config hash, one run per directory, a
failure recorded where it happened, clear words for a bad checkpoint."""
import json

import pytest
import torch
import yaml

from posbench import runner, training
from posbench.build import build
from posbench.rundir import read_status
from posbench.runinfo import NOT_RESULT_KEYS, RUN_KEYS, config_hash, group_config
from tests.helpers import compose_cfg, read_rows

TINY = ("debug=smoke", "train.steps=12", "eval.samples=8", "eval.batch_size=8")


def tiny(*overrides: str):
    return compose_cfg(*TINY, *overrides)


def test_runs_that_differ_only_in_lr_are_two_groups_and_their_labels_say_lr(tmp_path):
    from posbench.report import write_report

    for lr in ("1e-3", "3e-2"):
        for seed in (0, 1):
            runner.run(tiny(f"train.lr={lr}", f"seed={seed}"), tmp_path / "sweep" / f"lr{lr}-s{seed}")
    hashes = {row["config_hash"] for d in (tmp_path / "sweep").iterdir() for row in read_rows(d)}
    assert len(hashes) == 2  # the seeds share a hash; the learning rates do not
    out = write_report([str(tmp_path / "sweep")], tmp_path / "report")
    import pandas as pd

    headline = pd.read_csv(out / "headline.csv")
    assert sorted(headline["label"]) == ["rope train.lr=0.001", "rope train.lr=0.03"]
    assert headline["runs"].tolist() == [2, 2] and set(headline["seeds"]) == {"0,1"}


def test_groups_that_differ_in_an_added_setting_are_labelled_with_both_values(tmp_path):
    from posbench.report import write_report

    for activation in ("gelu", "relu"):
        runner.run(tiny(f"model.activation={activation}"), tmp_path / "sweep" / activation)
    import pandas as pd

    headline = pd.read_csv(write_report([str(tmp_path / "sweep")], tmp_path / "report") / "headline.csv")
    assert sorted(headline["label"]) == ["rope model.activation=gelu", "rope model.activation=relu"]


def test_the_group_leaves_out_only_what_cannot_change_a_result():
    resolved = {"seed": 3, "run_name": "x", "threads": 2, "logger": {"name": "wandb"}, "device": "cpu",
                "published": {"source": "a paper", "metric": "exact_match", "lengths": [1, 2], "results": []},
                "train": {"lr": 1e-3, "init_from": "/a/b", "resume": "auto", "checkpoint_every": 5,
                          "save_checkpoint": True, "steps": 10},
                "task": {"data_dir": "/data", "cache_dir": "/cache", "symbols": 10},
                "eval": {"chunk": "auto", "memory_limit": 4096}}
    group = group_config(resolved)
    assert group == {"device": "auto", "train": {"lr": 1e-3, "steps": 10}, "task": {"symbols": 10},
                     "eval": {"chunk": "auto"}}  # the device hashes as auto: it does not split a group
    assert len(NOT_RESULT_KEYS) == 12
    changed = json.loads(json.dumps(resolved))
    changed["train"]["lr"] = 2e-3
    assert config_hash(group_config(changed)) != config_hash(group)
    changed = json.loads(json.dumps(resolved)) | {"seed": 4, "threads": 1, "run_name": "y"}
    assert config_hash(group_config(changed)) == config_hash(group)


def test_rows_carry_the_run_record(tmp_path):
    rows = runner.run(tiny(), tmp_path / "run")
    assert list(rows[0])[:len(RUN_KEYS)] == list(RUN_KEYS)
    assert rows[0]["n_params"] == sum(p.numel() for p in build(tiny(), torch.device("cpu")).model.parameters())
    assert rows[0]["config"]["train"]["steps"] == 12 and "seed" not in rows[0]["config"]
    assert rows[0]["config_hash"] == config_hash(rows[0]["config"])


def test_a_directory_holding_another_run_is_refused_and_left_intact(tmp_path):
    run_dir = tmp_path / "run"
    runner.run(tiny(), run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match="holds results.jsonl, checkpoint.pt of run rope-copy-N16-s0 .* one directory "
                                         "holds one run"):
        runner.run(tiny("train.lr=3e-2"), run_dir)
    with pytest.raises(ValueError, match="one directory holds one run"):
        runner.run(tiny("seed=1"), run_dir)
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_resume_settings(tmp_path):
    with pytest.raises(ValueError, match="train.resume=true but .* holds no run to resume"):
        runner.run(tiny("train.resume=true"), tmp_path / "empty")
    run_dir = tmp_path / "run"
    runner.run(tiny(), run_dir)
    with pytest.raises(ValueError, match="train.resume=false refuses to continue it"):
        runner.run(tiny("train.resume=false"), run_dir)
    assert runner.run(tiny("train.resume=true"), run_dir) == read_rows(run_dir)  # finished: nothing to do


def test_an_exception_in_training_writes_failed_rows_and_status(tmp_path, monkeypatch):
    from posbench.report import write_report

    original, calls = training.train_step, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 7:
            raise RuntimeError("CUDA out of memory (injected)")
        return original(*args, **kwargs)

    monkeypatch.setattr(training, "train_step", failing)
    run_dir = tmp_path / "sweep" / "run"
    with pytest.raises(RuntimeError, match="injected"):
        runner.run(tiny(), run_dir)
    rows = read_rows(run_dir)
    assert [r["eval_length"] for r in rows] == [16, 32]
    assert all(r["status"] == "failed: RuntimeError: CUDA out of memory (injected)" and r["loss"] is None for r in rows)
    status = read_status(run_dir)
    assert status["state"] == "failed" and "injected" in status["error"]
    monkeypatch.setattr(training, "train_step", original)
    runner.run(tiny("seed=1"), tmp_path / "sweep" / "other")
    text = (write_report([str(tmp_path / "sweep")], tmp_path / "report") / "report.md").read_text()
    assert "failed: RuntimeError: CUDA out of memory (injected)" in text.split("## Runs that did not finish")[1]
    runner.run(tiny(), run_dir)  # the same command again: trains afresh, the failed rows are replaced
    assert [r["status"] for r in read_rows(run_dir)] == ["ok", "ok"] and read_status(run_dir)["state"] == "ok"


def test_a_run_that_fails_before_training_says_why_in_its_status(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="train.lengths"):
        runner.run(tiny("train.lengths=sometimes"), run_dir)
    status = read_status(run_dir)
    assert status["state"] == "failed" and status["phase"] == "build" and "train.lengths" in status["error"]
    assert not (run_dir / "results.jsonl").exists()
    runner.run(tiny(), run_dir)  # nothing was measured there: the directory takes the corrected run
    assert read_status(run_dir)["state"] == "ok"


@pytest.mark.parametrize("content", ["garbage", "truncated", "foreign", "config"])
def test_a_bad_checkpoint_gets_a_clear_message(tmp_path, content):
    path = tmp_path / "checkpoint.pt"
    if content == "garbage":
        path.write_bytes(b"not a checkpoint at all")
        message = r"train.init_from=.*: not a posbench checkpoint \(torch.load failed: "
    elif content == "truncated":
        runner.run(tiny(), tmp_path / "run")
        path.write_bytes((tmp_path / "run" / "checkpoint.pt").read_bytes()[:3000])
        message = r"not a posbench checkpoint \(torch.load failed: \w+Error: .*truncated, corrupted"
    elif content == "foreign":
        torch.save({"state_dict": {"w": torch.zeros(2)}, "epoch": 101}, path)
        message = r"train.init_from=.*: not a posbench checkpoint \(it lacks \['model', 'config', 'steps'\]"
    else:
        torch.save({"model": {}, "config": {"x": 1}, "steps": 3}, path)
        message = "its config lacks the encoding, model, train or task section"
    with pytest.raises(ValueError, match=message):
        runner.run(tiny(f"train.init_from={path}"), tmp_path / "from")
    assert read_status(tmp_path / "from")["phase"] == "build"


def saturated_colours(path, least_pixels: int = 30) -> set:
    """The colours (not white, grey or black) that cover at least least_pixels pixels of a PNG."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(path).convert("RGB"), dtype=int).reshape(-1, 3)  # [pixels, 3]
    pixels = pixels[pixels.max(1) - pixels.min(1) > 60]  # grey levels (text, axes, anti-aliasing of them) left out
    colours, counts = np.unique(pixels, axis=0, return_counts=True)
    return {tuple(c) for c, n in zip(colours.tolist(), counts) if n >= least_pixels}


def test_a_sweep_over_model_sizes_is_faceted_by_size_and_ranked_within_each(tmp_path):
    import pandas as pd

    from posbench.report import write_report

    for size in ("model.d_model=16", "model.d_model=32"):
        for encoding in ("nope", "alibi", "learned"):
            for seed in (0, 1):
                runner.run(tiny(size, f"encoding={encoding}", f"seed={seed}"),
                           tmp_path / "sweep" / f"{size}-{encoding}-{seed}")
    out = write_report([str(tmp_path / "sweep")], tmp_path / "report")
    headline = pd.read_csv(out / "headline.csv")
    params = dict(zip(headline["label"], headline["n_params"]))
    # learned's position table adds parameters; its size is still its model's (the smallest group's count)
    assert sorted(params) == ["alibi [2.58k]", "alibi [9.25k]", "learned [2.58k]", "learned [9.25k]",
                              "nope [2.58k]", "nope [9.25k]"], params
    assert params["learned [2.58k]"] > params["nope [2.58k]"] == params["alibi [2.58k]"] == 2576
    assert set(headline["curve_label"]) == {"alibi", "learned", "nope"} and headline["runs"].tolist() == [2] * 6
    for _, part in headline.groupby("size"):  # 12 steps learn nothing: not ranked, 0 in the MRR
        assert len(part) == 3 and not part["learned"].any() and part["rank_in_task"].isna().all()
    assert len(saturated_colours(out / "ood_vs_parameters.png")) >= 3  # one per encoding (a size in bytes varies
    # with matplotlib's and zlib's versions: 9,415 bytes under Python 3.10's matplotlib 3.10, over 10,000 here)
    assert "OOD score against parameter count" in (out / "report.md").read_text()
    orderings = pd.read_csv(out / "orderings.csv")  # every pair, each compared at both sizes
    pairs = orderings[["first", "second"]].values.tolist()
    assert pairs == [["alibi", "learned"], ["alibi", "nope"], ["learned", "nope"]], pairs
    assert all(r.startswith("2.58k: ") and ", 9.25k: " in r for r in orderings["relations"])


def test_progress_lists_every_run_and_counts_the_states(tmp_path, capsys):
    from posbench.report import main

    runner.run(tiny(), tmp_path / "sweep" / "done")
    with pytest.raises(ValueError):
        runner.run(tiny("train.steps=-1"), tmp_path / "sweep" / "refused")
    capsys.readouterr()  # the runs' own output
    assert main([str(tmp_path / "sweep"), "--progress"]) is None
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("rope-copy-N16-s0: ok; lengths written 16, 32 of 16, 32")
    assert lines[1].startswith("refused: failed at build: ValueError: train.steps=-1: must be >= 0")
    assert lines[2] == "1 failed, 1 ok"


def test_a_sweeps_progress_counts_its_jobs_and_the_time_left(tmp_path):
    """The total comes from the sweep's multirun.yaml (sweeper params, globs and command-line sweeps);
    the time left from the median of the runs that finished in one go, over the launcher's n_jobs."""
    from omegaconf import OmegaConf

    from posbench.report import progress
    from posbench.sweeps import job_count
    from tests.helpers import multirun_config

    def multirun(*overrides):
        cfg = multirun_config(*overrides)
        node = OmegaConf.to_container(cfg, resolve=False)
        node["hydra"]["overrides"] = {"task": list(overrides)}  # as Hydra records the command line
        return node

    assert job_count(multirun("experiment=scale_study")) == 6 * 3 * 3 * 3
    assert job_count(multirun("experiment=scale_study", "model=xs", "seed=0")) == 6 * 3
    assert job_count(multirun("experiment=grid_extrapolation")) == 9 * 4 * 3  # globs over the config groups
    assert job_count(multirun("encoding=nope,rope", "task=copy,sort,addition", "seed=0,1")) == 12

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    node = multirun("experiment=scale_study", "model=xs", "seed=0", "study_task=cmc")  # 6 jobs, n_jobs 2
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(node))
    records = [("ok", "10:00:00", "10:10:00", 0), ("ok", "10:00:00", "10:20:00", 0),
               ("ok", "11:00:00", "11:01:00", 1),  # resumed: its started is the resume's, left out
               ("running", "10:20:00", "10:25:00", 0)]
    for i, (state, started, updated, resumed) in enumerate(records):
        (sweep / str(i)).mkdir()
        (sweep / str(i) / "status.json").write_text(json.dumps(
            {"state": state, "run_name": f"run{i}", "started": f"2026-01-01T{started}",
             "updated": f"2026-01-01T{updated}", "resumed": resumed, "pid": 0, "host": "elsewhere"}))
    # 3 of 6 finished; median whole run 15 min; 3 left x 15 min / 2 jobs at a time
    assert progress([sweep])[-1] == (f"sweep {sweep}: 3 of 6 jobs finished, 1 running, 2 not started; "
                                     "median run 15 min: about 22 min left at 2 jobs at a time")
    # hydra/launcher=gpus: n_jobs is the resolver's, decided as the sweep started; its job slots tell
    node["hydra"]["launcher"]["n_jobs"] = "${posbench.gpu_jobs:auto}"
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(node))
    (sweep / ".gpu_slots").mkdir()
    for slot in range(3):
        (sweep / ".gpu_slots" / f"slot-{slot}.lock").touch()
    assert progress([sweep])[-1].endswith("median run 15 min: about 15 min left at 3 jobs at a time")
    node["hydra"]["launcher"]["n_jobs"] = 2
    node["hydra"]["overrides"]["task"].append("own_group=glob(*)")  # a group only the user's config dir has
    (sweep / "multirun.yaml").write_text(yaml.safe_dump(node))
    assert progress([sweep])[-1] == (f"sweep {sweep}: 3 jobs finished, 1 running; the total is not known "
                                     "(a glob over config groups posbench's configs/ lack)")
