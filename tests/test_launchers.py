"""Launcher configs compose as a --multirun composes them; a real joblib sweep and its report;
the synthetic suite names every encoding and synthetic task."""
import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from tests.helpers import (ROOT, assert_runs_compose_to_their_hashes, multirun_config, options, posbench, read_rows,
                           sweep_values)

CORPUS_TASKS = {"wikitext"}  # not synthetic: left out of the suite
GRID_TASKS = {"life", "grid_flip", "grid_row_count", "grid_nearest"}  # experiment=grid_extrapolation's


LAUNCHERS = {
    "slurm": ("SlurmLauncher", {"partition": "gpu", "gpus_per_node": 2, "timeout_min": 30, "array_parallelism": 8,
                                "cpus_per_task": 6, "mem_gb": 32}),
    "local": ("LocalLauncher", {"gpus_per_node": 0, "cpus_per_task": 2, "mem_gb": 8, "timeout_min": 5}),
    "joblib": ("JoblibLauncher", {"n_jobs": 2}),
    "gpus": ("JoblibLauncher", {"n_jobs": 4, "batch_size": "1"}),  # n_jobs=K x GPUs: tests/test_gpu_slots.py
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_launcher_composes_with_its_documented_keys(launcher):
    target, settings = LAUNCHERS[launcher]
    cfg = multirun_config(f"hydra/launcher={launcher}", "debug=smoke", "encoding=nope,alibi",
                          *(f"hydra.launcher.{key}={value}" for key, value in settings.items()))
    assert cfg.hydra.launcher._target_.endswith(target)
    assert {key: cfg.hydra.launcher[key] for key in settings} == settings
    assert cfg.train.steps == 20  # the experiment still applies


def test_launcher_files_are_ours_or_plugins():
    assert set(options("hydra/launcher")) == {"slurm", "local", "gpus"}


def test_slurm_defaults_resolve_on_the_command_line():
    result = posbench("--cfg", "hydra", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", timeout=120)
    for line in ("partition: gpu", "gpus_per_node: 1", "timeout_min: 60", "array_parallelism: 32",
                 "cpus_per_task: 4", "mem_gb: 16", "SlurmLauncher"):
        assert line in result.stdout


def encodings_of_dims(dims: int) -> list[str]:
    from posbench.encodings import REGISTRY

    return sorted(name for name in options("encoding") if REGISTRY[name].position_dims == dims)


def test_synthetic_suite_sweeps_every_encoding_task_and_three_seeds():
    """Every 1-D encoding on every synthetic sequence task (2-D encodings and grid tasks: the next test)."""
    cfg = multirun_config("experiment=synthetic_suite")
    params = cfg.hydra.sweeper.params
    synthetic = sorted(set(options("task")) - CORPUS_TASKS - GRID_TASKS)
    assert sweep_values(params, "encoding") == encodings_of_dims(1), \
        "configs/experiment/synthetic_suite.yaml's glob must take every configs/encoding option of a 1-D encoding"
    assert sweep_values(params, "task") == synthetic, \
        f"configs/experiment/synthetic_suite.yaml's glob must take the synthetic tasks: {','.join(synthetic)}"
    assert params.seed == "0,1,2"
    overrides = OverridesParser.create().parse_overrides(
        [f"{key}={','.join(sweep_values(params, key))}" for key in params])
    (jobs,) = BasicSweeper.split_arguments(overrides, None)
    assert len(jobs) == len(encodings_of_dims(1)) * len(synthetic) * 3
    assert list(cfg.eval.ratios) == [0.5, 1, 1.5, 2, 3, 4]
    addition = multirun_config("experiment=synthetic_suite", "task=addition")
    assert addition.train.length == addition.task.default_length == 8  # N: the task's own


def test_grid_extrapolation_sweeps_every_2d_encoding_and_three_1d_ones_on_the_grid_tasks():
    from tasks import REGISTRY

    cfg = multirun_config("experiment=grid_extrapolation")
    params = cfg.hydra.sweeper.params
    assert sweep_values(params, "encoding") == sorted(encodings_of_dims(2) + ["rope", "alibi", "nope"]), \
        "configs/experiment/grid_extrapolation.yaml's glob must take every 2-D encoding, plus rope, alibi and nope"
    assert set(sweep_values(params, "task")) == GRID_TASKS == {n for n, c in REGISTRY.items() if c.position_dims == 2}
    assert params.seed == "0,1,2" and list(cfg.eval.ratios) == [0.5, 1, 1.5, 2, 3, 4]
    job = multirun_config("experiment=grid_extrapolation", "task=grid_nearest", "encoding=t5_2d")
    assert job.model.causal is False and job.train.length == job.task.default_length == 8  # the task's defaults
    assert job.train.steps == multirun_config("task=grid_nearest").train.steps


def test_debug_smoke_composes_alone_and_after_an_experiment():
    cfg = multirun_config("debug=smoke", "encoding=nope,alibi")
    assert cfg.model.d_model == 16 and cfg.train.steps == 20 and list(cfg.eval.ratios) == [1, 2]
    grid = multirun_config("experiment=grid_extrapolation", "debug=smoke")
    assert grid.train.steps == 20 and grid.model.d_model == 16 and list(grid.eval.ratios) == [1, 2]
    assert grid.hydra.sweeper.params.task == multirun_config("experiment=grid_extrapolation").hydra.sweeper.params.task


@pytest.mark.slow
def test_joblib_sweep_runs_in_parallel_and_the_report_reads_it(tmp_path):
    sweep = tmp_path / "sweep"
    result = posbench("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "threads=1", "debug=smoke",
                      "encoding=nope,alibi", f"hydra.sweep.dir={sweep}")
    assert "Joblib.Parallel(n_jobs=2" in result.stdout + result.stderr
    runs = sorted(p.name for p in sweep.iterdir() if (p / "results.jsonl").exists())
    assert runs == ["0_debug=smoke,encoding=nope", "1_debug=smoke,encoding=alibi"]
    report = posbench(str(sweep), module="posbench.report", timeout=120)
    for name in ("results.csv", "summary.csv", "headline.csv", "report.md", "report.html",
                 "comparison_exact_match.png", "ood_heatmap.png", "cost.png", "ranking.png"):
        assert (sweep / name).stat().st_size > 500, name
    assert "| copy | alibi |" in report.stdout and "| copy | nope |" in report.stdout


@pytest.mark.slow
def test_a_preempted_submitit_job_requeues_and_resumes_by_itself(tmp_path):
    """submitit's preemption signal (SIGUSR2) to the job mid-training: the runner saves a checkpoint
    at the step it stopped, hands the signal to submitit, which requeues the job (Hydra's submitit
    launcher defines checkpoint()); the requeued job resumes, and its rows equal an uninterrupted run's."""
    import json
    import signal
    import time

    overrides = ["debug=smoke", "train.steps=600", "train.batch_size=4", "encoding=rope"]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    sweep = tmp_path / "sweep"
    job = subprocess.Popen([sys.executable, "-m", "posbench", "-m", "hydra/launcher=local", *overrides,
                            f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    signalled, deadline = None, time.time() + 120
    while signalled is None and time.time() < deadline and job.poll() is None:
        for path in sweep.rglob("status.json"):
            record = json.loads(path.read_text())
            if record.get("phase") == "train" and record.get("step", 0) >= 50:
                os.kill(record["pid"], signal.SIGUSR2)
                signalled = path.parent
        time.sleep(0.05)
    output, _ = job.communicate(timeout=300)
    assert signalled is not None, f"the job never reached step 50 in training:\n{output[-3000:]}"
    assert job.returncode == 0, output[-3000:]
    record = json.loads((signalled / "status.json").read_text())
    assert record["state"] == "ok" and record["resumed"] == 1, record
    log = "".join(p.read_text() for p in (sweep / ".submitit").rglob("*_log.err"))
    assert "Caught signal SIGUSR2" in log and "this job is preempted" in log

    direct = tmp_path / "direct"
    posbench(*overrides, f"hydra.run.dir={direct}")
    keys = ("eval_length", "exact_match", "token_acc", "loss", "train_steps", "config_hash")
    rows = [[tuple(row[k] for k in keys) for row in read_rows(d)] for d in (signalled, direct)]
    assert rows[0] == rows[1]


def test_committed_scale_study_runs_of_either_machine_compose_to_the_hash_of_their_rows():
    """The medium size was run partly on a GPU (device=auto): its runs join the CPU runs' groups
    only while the configuration they compose to today hashes as their rows say."""
    runs = sorted((ROOT / "results" / "reference" / "scale_study" / "medium").glob("*experiment=scale_study*"))
    rows = assert_runs_compose_to_their_hashes(runs)
    assert {row["device"] for row in rows} == {"cpu", "cuda"} and len(runs) >= 13 + 34


def test_scale_study_sweeps_six_encodings_three_tasks_three_sizes_three_seeds():
    cfg = multirun_config("experiment=scale_study")
    params = cfg.hydra.sweeper.params
    assert sweep_values(params, "study_task") == ["cmc", "rsc", "sort"]
    assert sweep_values(params, "model") == ["medium", "small", "xs"]
    assert sweep_values(params, "encoding") == sorted(["nope", "sinusoidal", "learned", "rope", "alibi", "t5"])
    overrides = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])
    (jobs,) = BasicSweeper.split_arguments(overrides, None)
    assert len(jobs) == 6 * 3 * 3 * 3
    # sizes, then seeds, are the outer loops: a study cut short leaves whole slices behind
    assert [job[0] for job in jobs[::54]] == ["model=xs", "model=small", "model=medium"]
    assert [job[1] for job in jobs[:54:18]] == ["seed=0", "seed=1", "seed=2"]
    for study_task, target, variant in (("cmc", "copy", "cmc"), ("rsc", "copy", "rsc"), ("sort", "sort", None)):
        job = multirun_config("experiment=scale_study", f"study_task={study_task}", "model=medium")
        assert job.task._target_ == f"tasks.{target}.{target.capitalize()}" and job.task.get("variant") == variant
        assert job.model.d_model == 128 and job.train.length == 16 and job.threads == 1


@pytest.mark.parametrize("launcher", [[], ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]])
def test_a_refused_point_is_recorded_and_the_sweep_goes_on(launcher, tmp_path):
    result = posbench("-m", "debug=smoke", "train.grad_clip=-1,1", *launcher, f"hydra.sweep.dir={tmp_path}")
    assert "refused (debug=smoke,train.grad_clip=-1): train.grad_clip=-1: must be > 0" in result.stderr
    statuses = {path.parent.name: json.loads(path.read_text()) for path in tmp_path.rglob("status.json")}
    assert len(statuses) == 2, statuses
    (refused,) = [s for s in statuses.values() if s["state"] == "failed"]
    assert refused["phase"] == "build" and "train.grad_clip" in refused["error"]
    assert [s["state"] for s in statuses.values()].count("ok") == 1
    assert len(list(tmp_path.rglob("results.jsonl"))) == 1


def test_quickstart_sweeps_four_encodings_on_copy_with_the_stop():
    cfg = multirun_config("experiment=quickstart")
    assert sweep_values(cfg.hydra.sweeper.params, "encoding") == sorted(["nope", "rope", "alibi", "t5"])
    assert cfg.hydra.sweep.dir == "results/sweeps/quickstart"  # the README's report command names it
    job = multirun_config("experiment=quickstart", "encoding=rope")
    assert job.task._target_ == "tasks.copy.Copy" and job.task.variant == "rsc" and job.task.eos
    assert (job.train.length, job.train.steps, job.train.lr) == (16, 1000, 1e-3)


def test_the_committed_quickstart_learns_and_the_report_ranks_it(tmp_path):
    """results/reference/quickstart: the sweep as the README runs it; its runs compose to their rows' hash
    today, each is learned at N, and the report ranks all four (NoPE first: it counts past N)."""
    runs = sorted((ROOT / "results" / "reference" / "quickstart").glob("*experiment=quickstart*"))
    assert len(runs) == 4
    assert_runs_compose_to_their_hashes(runs)
    from posbench.report import write_report

    write_report([ROOT / "results" / "reference" / "quickstart"], out=tmp_path)
    headline = pd.read_csv(tmp_path / "headline.csv").sort_values("rank_in_task")
    assert sorted(headline["encoding"]) == ["alibi", "nope", "rope", "t5"]
    assert headline["learned"].all() and (headline["id_score_mean"] >= 0.9).all(), headline
    assert headline["rank_in_task"].notna().all() and headline.iloc[0]["encoding"] == "nope", headline
