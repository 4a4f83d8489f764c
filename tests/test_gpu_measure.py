"""scripts/gpu_measure.py, the GPU artifact's script, run for real on the CPU at a tiny size: its three files,
their columns, nope's ratio, a backend that refuses recorded as such, and the budget leaving rows marked."""
import csv
import importlib.util
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "gpu_measure.py"


def run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path), *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def read(tmp_path, name: str) -> list[dict]:
    (folder,) = tmp_path.iterdir()  # results/gpu/<device name>/
    with (folder / name).open() as handle:
        return list(csv.DictReader(handle))


def docs_tables(monkeypatch, gpu_dir):
    """scripts/docs_tables.py reading the GPU files from gpu_dir."""
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "GPU", gpu_dir)
    return module


@pytest.mark.slow
def test_encodings_on_every_backend_with_nope_in_the_same_run(tmp_path, monkeypatch):
    run(tmp_path, "--parts", "encodings", "--encodings", "alibi", "--tokens", "32", "--modes", "eager",
        "--tokens-per-step", "256", "--budget-s", "300")
    rows = read(tmp_path, "encodings.csv")
    assert list(rows[0]) == ["encoding", "backend", "mode", "tokens", "tokens_per_s", "vs_nope", "auto",
                             "batch_size", "status", "timed_steps"]
    assert [(r["encoding"], r["backend"], r["auto"]) for r in rows] == [
        ("nope", "sdpa", "True"), ("alibi", "sdpa", "True"), ("alibi", "sdpa", "False"), ("alibi", "flex", "False"),
        ("alibi", "eager", "False")]  # auto's choice named, then every backend
    by_backend = {(r["encoding"], r["backend"]): r for r in rows if r["auto"] == "False" or r["encoding"] == "nope"}
    assert float(by_backend["nope", "sdpa"]["vs_nope"]) == 1.0
    for backend in ("sdpa", "eager"):
        row = by_backend["alibi", backend]
        assert row["status"] == "ok" and row["tokens"] == "33" and row["batch_size"] == str(256 // 33)
        assert 8 <= int(row["timed_steps"]) <= 200  # at least 8, more while they fill less than 0.5 s
        nope = float(by_backend["nope", "sdpa"]["tokens_per_s"])
        assert float(row["vs_nope"]) == pytest.approx(float(row["tokens_per_s"]) / nope)
    assert by_backend["alibi", "flex"]["status"].startswith("failed: ValueError: backend=flex trains on CUDA only")
    table = docs_tables(monkeypatch, tmp_path).gpu_encodings()  # docs/performance.md's, from this file
    (device,) = [p.name for p in tmp_path.iterdir()]
    assert f"`{device}`, training `eager`" in table and "| 33 tokens |" in table
    alibi_auto = next(r for r in rows if r["encoding"] == "alibi" and r["auto"] == "True")
    assert f"| alibi | sdpa | {float(alibi_auto['vs_nope']):.2f}" in table


def test_a_spent_budget_leaves_every_row_marked_not_measured(tmp_path):
    run(tmp_path, "--parts", "encodings", "--encodings", "t5", "--tokens", "32,8192", "--modes", "eager,compiled",
        "--budget-s", "0")
    rows = read(tmp_path, "encodings.csv")
    assert len(rows) == 2 * 2 + 4 * 2 * 2  # nope on auto, t5 on auto and 3 backends; 2 modes x 2 lengths
    assert {r["status"] for r in rows} == {"not measured: budget"}


@pytest.mark.slow
def test_the_default_job_and_the_sweep_parts(tmp_path, monkeypatch):
    run(tmp_path, "--parts", "default_job,sweep", "--job-overrides", "debug=smoke", "--job-modes", "eager",
        "--sweep-overrides", "debug=smoke", "frontier_method=nope,alibi",
        "--sweep-launcher", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    (job,) = read(tmp_path, "default_job.csv")
    assert job["device"].startswith("cpu") and float(job["wall_s"]) > float(job["train_s"]) > 0
    assert 0 <= float(job["exact_match_at_n"]) <= 1 and len(job["data_fingerprint"]) == 16
    assert job["compile"] == "eager" and job["status"] == "ok" and float(job["train_steps_per_s"]) > 0
    (sweep,) = read(tmp_path, "sweep.csv")
    assert sweep["runs"] == "2" and sweep["concurrent"] == "2"
    assert int(sweep["train_steps"]) == 2 * 20 and float(sweep["train_steps_per_s"]) > 0  # debug=smoke: 20 steps
    assert float(sweep["runs_per_hour"]) == pytest.approx(120 / float(sweep["wall_min"]), rel=0.02)  # wall_min rounded
    assert "extrapolated" in sweep["note"]
    tables = docs_tables(monkeypatch, tmp_path)
    assert f"| {job['device']} | eager | {float(job['wall_s']):.1f} |" in tables.gpu_default_job()
    assert "| 2 | 2 |" in tables.gpu_sweep()
    run(tmp_path, "--parts", "sweep", "--sweep-overrides", "debug=smoke", "frontier_method=nope",
        "--sweep-launcher", "hydra/launcher=joblib", "hydra.launcher.n_jobs=1")
    assert [row["concurrent"] for row in read(tmp_path, "sweep.csv")] == ["2", "1"]  # a row per concurrency


@pytest.mark.slow
def test_an_encodings_process_past_its_time_is_stopped_and_its_rows_say_so(tmp_path):
    """--child-s bounds one encoding's process (at least 5 s): a stuck compile cannot take the later encodings'
    time. 4,097 tokens in batches of 65,536 take far longer than 5 s on a CPU."""
    run(tmp_path, "--parts", "encodings", "--encodings", "nope", "--tokens", "32,4096", "--modes", "eager",
        "--child-s", "1", "--budget-s", "300")
    rows = read(tmp_path, "encodings.csv")
    assert [r["tokens"] for r in rows][-1] == "4096"  # the planned length, never measured
    assert rows[-1]["status"] == "not measured: its process stopped after 5 s"
    assert all(r["status"] in ("ok", rows[-1]["status"]) for r in rows)


def test_a_step_is_timed_eight_times_or_for_half_a_second_and_once_where_it_is_slow():
    spec = importlib.util.spec_from_file_location("gpu_measure", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.timed_enough([0.01] * 7) and not module.timed_enough([0.01] * 8)  # 0.08 s: not yet
    assert module.timed_enough([0.1] * 8) and module.timed_enough([0.001] * module.MOST_STEPS)
    assert module.timed_enough([module.SLOW_STEP_S + 0.1])  # one step of a slow backend is its measurement


def test_the_plan_measures_a_bias_or_decay_on_the_named_backends_only():
    spec = importlib.util.spec_from_file_location("gpu_measure", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    every = {name: backends for name, _, backends in module.encoding_plan(["cope", "alibi"])}
    assert every == {"nope": "auto", "alibi": "auto,sdpa,flex,eager", "cope": "auto"}  # nope first, targets next
    named = {name: backends for name, _, backends in module.encoding_plan(
        ["cope", "alibi", "t5", "fire", "stick_breaking", "path"], ["sdpa", "fla"])}
    assert named == {"nope": "auto", "alibi": "auto,sdpa,fla", "t5": "auto,sdpa,fla", "fire": "auto,sdpa,fla",
                     "cope": "auto,fla", "stick_breaking": "auto,fla",
                     "path": "auto,fla"}  # fla: a decay, a bias of i - j or FIRE's, or a kernel
    refused = subprocess.run([sys.executable, str(SCRIPT), "--backends", "sdpa,triton"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "--backends: unknown ['triton']" in refused.stderr


def test_a_cuda_devices_folder_records_its_name_and_compute_capability(tmp_path, monkeypatch):
    """device.csv, written first on CUDA (before any part runs): what a device of the same capability reads to
    follow this folder's crossover table (posbench.attention.crossover.table_for)."""
    import torch

    from posbench import build
    from posbench.attention import crossover

    spec = importlib.util.spec_from_file_location("gpu_measure", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(build, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    module.main(["--parts", "", "--out", str(tmp_path)])
    assert read(tmp_path, crossover.DEVICE_FILE) == [{"name": "NVIDIA H200", "capability": "9.0"}]
    found = crossover.table_for("NVIDIA H200", "9.0", tmp_path)
    assert found is None  # a device folder without encodings.csv is no table
    (tmp_path / "nvidia-h200" / crossover.TABLE_FILE).write_text("encoding,backend,mode,tokens,tokens_per_s\n")
    assert crossover.table_for("NVIDIA H200 NVL", "9.0", tmp_path).source == "nvidia-h200"


def test_a_sweep_cut_before_any_run_finished_is_extrapolated_from_every_runs_steps():
    """13 runs at once made 26,000 steps in 2 minutes (no run done): 216.7 steps/s; the copy part's 13 x 4,000
    steps take 4 minutes at that rate; the study is that times the CPU's per-task factor, a lower bound."""
    from scripts.gpu_measure import STUDY_COPY_PARTS, sweep_row

    row = sweep_row(0, 26_000, 2.0, True, "13")
    assert row["runs"] == 0 and row["runs_per_hour"] == 0 and row["train_steps_per_s"] == 216.7
    assert row["extrapolated_study_min"] == pytest.approx(4.0 * STUDY_COPY_PARTS, abs=0.05)
    assert "26000 training steps" in row["note"] and "a lower bound" in row["note"]
    finished = sweep_row(13, 52_000, 4.0, True, "13")  # runs done: extrapolated from them, as before
    assert finished["extrapolated_study_min"] == pytest.approx(156 * 4.0 / 13) and "at this rate" in finished["note"]
    assert sweep_row(0, 0, 1.0, True, "13")["extrapolated_study_min"] is None  # nothing to go on
