"""hydra/launcher=gpus (posbench/gpu_slots.py): K, the runs per GPU, from free memory, the plateau (measured
or provisional) or the user; slots that pin each job to one GPU, with real flocks across processes; a real
sweep through the launcher on the CPU, and on CUDA where a device is present."""
import csv
import re
import select
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from posbench import gpu_slots
from posbench.gpu_slots import PLATEAU_RUNS_PER_GPU, device_slug, gpu_of, measured_plateau, plan, take_slot
from tests.helpers import CONFIGS, ROOT, multirun_config, posbench, read_rows

H200 = "NVIDIA H200"
SWEEP = ["-m", "hydra/launcher=gpus", "debug=smoke", "encoding=nope,alibi"]
RUNS = ["0_debug=smoke,encoding=nope", "1_debug=smoke,encoding=alibi"]


def write_sweep_csv(results, device: str, rows: list[dict]) -> None:
    folder = results / device_slug(device)
    folder.mkdir(parents=True)
    with (folder / "sweep.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["runs", "wall_min", "runs_per_hour", "concurrent"])
        writer.writeheader()
        writer.writerows(rows)


# --- K ---------------------------------------------------------------------------------------------

def test_auto_k_is_free_memory_over_a_run_capped_by_the_provisional_plateau(tmp_path):
    assert plan("auto", [(H200, 140_000)], results=tmp_path, cores=64)[0] == PLATEAU_RUNS_PER_GPU  # the cap
    jobs, message = plan("auto", [(H200, 4_500)], results=tmp_path, cores=64)
    assert jobs == 4 and "4500 MiB free / 1024 MiB a run = 4" in message  # memory bounds it
    assert plan("auto", [(H200, 500)], results=tmp_path, cores=64)[0] == 1  # always one
    assert plan("auto", [(H200, 40_960)], run_mib=4096, results=tmp_path, cores=64)[0] == 10
    assert "provisional" in plan("auto", [(H200, 140_000)], results=tmp_path, cores=64)[1]


def test_k_is_the_same_on_every_gpu_the_smallest_any_takes(tmp_path):
    jobs, message = plan("auto", [(H200, 140_000), (H200, 3_100)], results=tmp_path, cores=64)
    assert jobs == 3 * 2 and "3 runs per GPU" in message and "x 2 GPU(s)" in message


def test_a_set_k_is_taken_as_it_is(tmp_path):
    jobs, message = plan(40, [(H200, 2_000), (H200, 2_000)], results=tmp_path, cores=16)
    assert jobs == 80 and "40 runs per GPU (set)" in message
    assert message.endswith("more than the 16 CPU cores here, which they share")  # said, not changed
    assert "CPU cores" not in plan(8, [(H200, 2_000)], results=tmp_path, cores=16)[1]


def test_auto_k_is_at_most_the_cpu_cores_over_the_gpus(tmp_path):
    """Each run's host thread takes a core: 8 GPUs on 32 cores get 4 runs each, not the plateau's 15."""
    jobs, message = plan("auto", [(H200, 140_000)] * 8, results=tmp_path, cores=32)
    assert jobs == 32 and "at most 4: 32 CPU cores here over 8 GPU(s)" in message
    assert plan("auto", [(H200, 140_000)], results=tmp_path, cores=16)[0] == PLATEAU_RUNS_PER_GPU  # 15 of 16
    assert plan("auto", [(H200, 140_000)] * 4, results=tmp_path, cores=2)[0] == 4  # at least one a GPU
    assert plan("auto", [(H200, 3_100)], results=tmp_path, cores=64)[0] == 3  # memory binds first
    assert gpu_slots.host_cores() >= 1


def test_without_a_gpu_the_sweep_runs_on_the_cpu_one_job_or_the_users(tmp_path):
    jobs, message = plan("auto", [], results=tmp_path)
    assert jobs == 1 and "no CUDA GPU here; the sweep runs on the CPU, 1 job(s) at a time" in message
    assert plan(3, [], results=tmp_path)[0] == 3


@pytest.mark.parametrize("setting,run_mib,match", [
    (0, 1024, r"posbench.gpu_jobs:0: runs per GPU must be auto or an integer >= 1"),
    ("many", 1024, r"'many': runs per GPU must be auto or an integer >= 1"),
    (True, 1024, r"True: runs per GPU must be auto"),
    ("auto", 0, r"auto,0: the MiB a run needs must be an integer >= 1"),
])
def test_bad_settings_are_refused_naming_the_value_and_the_choices(setting, run_mib, match):
    with pytest.raises(ValueError, match=match):
        plan(setting, [(H200, 80_000)], run_mib=run_mib)


def test_a_measured_sweep_csv_replaces_the_cap_with_its_best_concurrent(tmp_path):
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    write_sweep_csv(tmp_path, H200, [
        {"runs": 52, "wall_min": 30, "runs_per_hour": 104.0, "concurrent": 8},
        {"runs": 52, "wall_min": 17, "runs_per_hour": 183.5, "concurrent": 24},
        {"runs": 52, "wall_min": 18, "runs_per_hour": 173.3, "concurrent": 32},
        {"runs": 52, "wall_min": 10, "runs_per_hour": 312.0, "concurrent": "launcher default"},  # not a count
    ])
    assert measured_plateau(H200, tmp_path) == 24
    jobs, message = plan("auto", [(H200, 140_000)], results=tmp_path, cores=64)
    assert jobs == 24 and f"measured: {tmp_path / 'nvidia-h200' / 'sweep.csv'}" in message
    assert plan("auto", [(H200, 10_000)], results=tmp_path, cores=64)[0] == 9  # memory still bounds it
    assert measured_plateau("NVIDIA H100", tmp_path) is None  # another device: the provisional cap


def test_a_sweep_csv_without_a_usable_row_leaves_the_provisional_cap(tmp_path):
    write_sweep_csv(tmp_path, H200, [{"runs": 5, "wall_min": 1, "runs_per_hour": "", "concurrent": 8},
                                     {"runs": 0, "wall_min": 1, "runs_per_hour": 0.0, "concurrent": 13}])  # none done
    assert measured_plateau(H200, tmp_path) is None
    assert plan("auto", [(H200, 140_000)], results=tmp_path, cores=64)[0] == PLATEAU_RUNS_PER_GPU


def test_the_resolver_gives_n_jobs_once_and_says_how(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(gpu_slots, "visible_gpus", lambda: calls.append(1) or [("Test GPU", 80_000)] * 2)
    cfg = OmegaConf.create({"n_jobs": "${posbench.gpu_jobs:3}", "again": "${posbench.gpu_jobs:3}"})
    assert cfg.n_jobs == 6 and cfg.again == 6 and len(calls) == 1  # cached: decided once per config
    assert "3 runs per GPU (set) x 2 GPU(s) (Test GPU) = 6 jobs" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"refused: posbench.gpu_jobs:-2: runs per GPU must be auto"):
        OmegaConf.create({"n_jobs": "${posbench.gpu_jobs:-2}"}).n_jobs


# --- slots -----------------------------------------------------------------------------------------

def test_slots_map_round_robin_so_each_gpu_has_k():
    assert [gpu_of(slot, 2) for slot in range(6)] == [0, 1, 0, 1, 0, 1]  # K=3 on 2 GPUs
    assert [gpu_of(slot, 1) for slot in range(3)] == [0, 0, 0]


def test_slots_in_one_process_are_distinct_and_freed_on_release(tmp_path):
    first, second = take_slot(tmp_path, 2), take_slot(tmp_path, 2)
    assert (first.index, second.index) == (0, 1)
    assert take_slot(tmp_path, 2, wait=False) is None
    first.release()
    again = take_slot(tmp_path, 2, wait=False)
    assert again.index == 0
    again.release()
    second.release()


HOLDER = """
import sys, time
from pathlib import Path
from posbench.gpu_slots import take_slot
print(take_slot(Path(sys.argv[1]), int(sys.argv[2])).index, flush=True)
time.sleep(300)
"""


def read_line(stream, what: str, timeout: float = 90) -> str:
    """The next line of a child's pipe that contains `what`, within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([stream], [], [], left)[0]:
            line = stream.readline()
            if not line:
                break
            if what in line:
                return line
    raise AssertionError(f"no line with {what!r} within {timeout} s")


@pytest.mark.slow
def test_two_processes_take_distinct_slots_and_a_third_waits_for_a_killed_ones(tmp_path):
    """K x GPUs = 2 slots: two holders take 0 and 1; a third waits (it is not refused: a sweep's next job
    runs once a slot is free) and takes the slot of a holder killed with SIGKILL, whose flock the kernel drops."""
    holders = []

    def hold():
        child = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "2"], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        holders.append(child)
        return child

    try:
        first, second = hold(), hold()
        first_slot = int(read_line(first.stdout, ""))
        assert {first_slot, int(read_line(second.stdout, ""))} == {0, 1}
        assert int((tmp_path / f"slot-{first_slot}.lock").read_text()) == first.pid  # the holder, for a person
        third = hold()
        read_line(third.stderr, "all 2 GPU slots in")
        assert not select.select([third.stdout], [], [], 0.5)[0]  # still waiting
        first.kill()
        assert int(read_line(third.stdout, "", timeout=30)) == first_slot
    finally:
        for child in holders:
            child.kill()
            child.wait()


@contextmanager
def as_job(*overrides: str):
    """This process as a job of `python -m posbench -m <overrides>` (HydraConfig as Hydra sets it)."""
    cfg = multirun_config(*overrides)
    cfg.hydra.mode = RunMode.MULTIRUN  # set by Hydra when it runs the sweep
    saved = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = saved


def test_a_job_takes_its_slots_gpu_and_keeps_it_for_its_next_jobs(tmp_path, monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # 2 pretend GPUs
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(gpu_slots, "_held", None)
    other = take_slot(tmp_path / ".gpu_slots", 2)  # another worker holds slot 0
    try:
        with as_job("hydra/launcher=gpus", f"hydra.sweep.dir={tmp_path}", "hydra.launcher.n_jobs=2"):
            assert gpu_slots.sweep_gpu() == torch.device("cuda", 1) and chosen == [1]
            other.release()
            assert gpu_slots.sweep_gpu() == torch.device("cuda", 1)  # the worker's next job: the same slot
    finally:
        gpu_slots._held.release()


def test_no_slot_outside_a_gpus_sweep(tmp_path):
    with as_job("hydra/launcher=joblib", f"hydra.sweep.dir={tmp_path}"):
        assert gpu_slots.sweep_gpu() is None
    assert not (tmp_path / ".gpu_slots").exists()


# A job that pretends to see 2 GPUs and prints the device its slot gives: the real launcher, workers and flocks.
PRETEND_JOB = f"""
import time
import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from posbench import gpu_slots

@hydra.main(version_base="1.3", config_path={str(CONFIGS)!r}, config_name="config")
def job(cfg):
    torch.cuda.device_count = lambda: 2
    torch.cuda.set_device = lambda index: None
    print("JOB", HydraConfig.get().job.num, gpu_slots.sweep_gpu(), flush=True)
    deadline = time.time() + 60
    while (free := gpu_slots.take_slot(gpu_slots._held.folder, 2, wait=False)) and time.time() < deadline:
        free.release()  # the jobs overlap: each waits until both workers hold a slot
        time.sleep(0.1)

job()
"""


@pytest.mark.slow
def test_the_launchers_concurrent_jobs_take_distinct_slots(tmp_path):
    sweep = tmp_path / "sweep"
    result = posbench("-m", "hydra/launcher=gpus", "hydra.launcher.n_jobs=${posbench.gpu_jobs:2}", "seed=0,1,2",
                      f"hydra.sweep.dir={sweep}", entry=["-c", PRETEND_JOB], env={"CUDA_VISIBLE_DEVICES": ""},
                      timeout=120)
    devices = [line.split()[2] for line in result.stdout.splitlines() if line.startswith("JOB ")]
    assert len(devices) == 3 and set(devices) == {"cuda:0", "cuda:1"}  # the third job: a worker's own slot again
    assert sorted(p.name for p in (sweep / ".gpu_slots").iterdir()) == ["slot-0.lock", "slot-1.lock"]


# --- real sweeps -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_sweep_through_the_launcher_runs_on_the_cpu_and_resumes(tmp_path):
    sweep = tmp_path / "sweep"
    cpu_only = {"CUDA_VISIBLE_DEVICES": ""}
    result = posbench(*SWEEP, "threads=1", f"hydra.sweep.dir={sweep}", env=cpu_only, timeout=120)
    output = result.stdout + result.stderr
    assert "no CUDA GPU here; the sweep runs on the CPU, 1 job(s) at a time" in output
    assert "Joblib.Parallel(n_jobs=1" in output and "batch_size=1" in output
    assert sorted(p.name for p in sweep.iterdir() if (p / "results.jsonl").exists()) == RUNS
    assert all(row["device"] == "cpu" for run in RUNS for row in read_rows(sweep / run))
    again = posbench(*SWEEP, "threads=1", f"hydra.sweep.dir={sweep}", env=cpu_only, timeout=120)
    assert (again.stdout + again.stderr).count("finished (ok): nothing to do") == 2  # resumable as before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_two_concurrent_jobs_run_on_the_gpus_of_their_slots(tmp_path):
    sweep = tmp_path / "sweep"
    result = posbench(*SWEEP, "hydra.launcher.n_jobs=${posbench.gpu_jobs:2}", "train.steps=1000",  # they overlap
                      f"hydra.sweep.dir={sweep}", timeout=300)
    output = result.stdout + result.stderr
    gpus = torch.cuda.device_count()
    assert f"2 runs per GPU (set) x {gpus} GPU(s)" in output
    taken = {(int(slot), f"cuda:{gpu}") for slot, gpu in re.findall(r"GPU slot (\d+) of 2: cuda:(\d+)", output)}
    assert taken == {(slot, f"cuda:{gpu_of(slot, gpus)}") for slot in (0, 1)}  # both jobs at once, on their slots
    runs = [f"{run},train.steps=1000" for run in RUNS]  # the run folders name every override Hydra does not exclude
    devices = sorted(read_rows(sweep / run)[0]["device"] for run in runs)
    assert devices == sorted(f"cuda:{gpu_of(slot, gpus)}" for slot in (0, 1))
    assert sorted(p.name for p in (sweep / ".gpu_slots").iterdir()) == ["slot-0.lock", "slot-1.lock"]
