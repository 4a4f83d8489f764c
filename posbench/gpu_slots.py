"""hydra/launcher=gpus: a sweep fills the visible GPUs by itself, K runs at a time on each.

The launcher (configs/hydra/launcher/gpus.yaml) is hydra-joblib-launcher with
n_jobs = ${posbench.gpu_jobs:K}: K runs per GPU x the visible GPUs (`gpu_jobs`, decided once, in
the sweep's own process). K=auto is each GPU's free memory over RUN_MIB a run, capped by the
plateau of runs per GPU past which a sweep goes no faster (`plateau`) and by the CPU cores over the GPUs.

Each job pins itself to one GPU by taking a slot (`take_slot`): one of n_jobs lock files under
<sweep dir>/.gpu_slots/, held by flock. Slot s runs on cuda:(s mod GPUs), so every GPU has K slots.
A joblib worker process takes its slot at its first job and keeps it for the jobs after (one CUDA
context per worker); the kernel drops the lock when the process ends, however it ends, so the
slots of a killed sweep are free when the same command resumes it.
"""
from __future__ import annotations

import csv
import fcntl
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import joblib
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from posbench.attention.crossover import TABLES, device_slug
from posbench.sweeps import SLOT_DIR

LAUNCHER = "gpus"  # configs/hydra/launcher/gpus.yaml
RESULTS = TABLES  # results/gpu/: scripts/gpu_measure.py's --out
POLL_S = 1.0  # while every slot is held: how often to try again

# Provisional: 15 concurrent processes are what filled one H200 by hand with model=small runs
# (~150k parameters, ~50 steps/s each; the rate of one run alone was not measured), not a measured
# plateau. scripts/gpu_measure.py's sweep part writes results/gpu/<device>/sweep.csv (runs, wall_min,
# runs_per_hour, concurrent); where that file exists, its best `concurrent` replaces this cap for
# that device (`measured_plateau`).
PLATEAU_RUNS_PER_GPU = 15
# Provisional too: a CUDA context (~0.5 GiB) and a small run's tensors and allocator cache. Larger
# models need more: '${posbench.gpu_jobs:auto,4096}'.
RUN_MIB = 1024


# --- K: runs per GPU (in the sweep's process, before the jobs start) ------------------------------

def measured_plateau(device_name: str, results: Path = RESULTS) -> int | None:
    """The `concurrent` of the row with the most runs_per_hour in results/gpu/<device>/sweep.csv;
    None without the file or a row whose concurrent is a number of runs and that finished a run."""
    path = results / device_slug(device_name) / "sweep.csv"
    if not path.exists():
        return None
    best = None
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                concurrent, rate = int(row["concurrent"]), float(row["runs_per_hour"])
            except (KeyError, TypeError, ValueError):  # "launcher default", an empty cell
                continue
            if concurrent >= 1 and rate > 0 and (best is None or rate > best[1]):  # 0: no run finished
                best = (concurrent, rate)
    return best[0] if best else None


def plateau(device_name: str, results: Path = RESULTS) -> tuple[int, str]:
    """The cap on K=auto for this device, and where it comes from."""
    measured = measured_plateau(device_name, results)
    if measured:
        return measured, f"measured: {results / device_slug(device_name) / 'sweep.csv'}"
    return PLATEAU_RUNS_PER_GPU, "provisional: posbench.gpu_slots.PLATEAU_RUNS_PER_GPU, not yet measured on this GPU"


def auto_runs_per_gpu(free_mib: int, device_name: str, run_mib: int = RUN_MIB,
                      results: Path = RESULTS) -> tuple[int, str]:
    """K=auto on one GPU: its free memory over run_mib a run, capped by the plateau (at least 1); and why."""
    cap, source = plateau(device_name, results)
    fits = free_mib // run_mib
    return max(1, min(fits, cap)), f"{free_mib} MiB free / {run_mib} MiB a run = {fits}, capped at {cap} ({source})"


def check_settings(runs_per_gpu, run_mib) -> None:
    if runs_per_gpu != "auto" and (isinstance(runs_per_gpu, bool) or not isinstance(runs_per_gpu, int)
                                   or runs_per_gpu < 1):
        raise ValueError(f"posbench.gpu_jobs:{runs_per_gpu!r}: runs per GPU must be auto or an integer >= 1, "
                         "e.g. hydra.launcher.n_jobs='${posbench.gpu_jobs:8}'")
    if isinstance(run_mib, bool) or not isinstance(run_mib, int) or run_mib < 1:
        raise ValueError(f"posbench.gpu_jobs:{runs_per_gpu},{run_mib!r}: the MiB a run needs must be an integer "
                         ">= 1, e.g. '${posbench.gpu_jobs:auto,4096}'")


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity: a batch scheduler's share of the node)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan(runs_per_gpu, gpus: list[tuple[str, int]], run_mib: int = RUN_MIB,
         results: Path = RESULTS, cores: int | None = None) -> tuple[int, str]:
    """n_jobs for hydra/launcher=gpus, and a line saying how it was chosen. gpus: (name, free MiB) of
    each visible GPU. K x the GPUs, K the smallest any GPU takes and, for auto, at most the CPU cores
    (`cores`, default host_cores()) over the GPUs: a small run's eager step is mostly its host thread's work
    (the default job's took 10 ms on an H100, hundreds of kernel launches), so runs past the cores share them.
    Without a GPU the sweep runs on the CPU, runs_per_gpu jobs at a time if it is a number, else one."""
    check_settings(runs_per_gpu, run_mib)
    if not gpus:
        jobs = 1 if runs_per_gpu == "auto" else runs_per_gpu
        return jobs, (f"hydra/launcher=gpus: no CUDA GPU here; the sweep runs on the CPU, {jobs} job(s) at a time "
                      "(for CPU cores: hydra/launcher=joblib hydra.launcher.n_jobs=J threads=T)")
    cores = cores or host_cores()
    cores_per_gpu = max(1, cores // len(gpus))
    if runs_per_gpu == "auto":
        k, why = min((auto_runs_per_gpu(free, name, run_mib, results) for name, free in gpus), key=lambda kw: kw[0])
        how = f"auto: {why}"
        if cores_per_gpu < k:
            k, how = cores_per_gpu, f"{how}; at most {cores_per_gpu}: {cores} CPU cores here over {len(gpus)} GPU(s)"
    else:
        k, how = runs_per_gpu, "set"
    names = ", ".join(sorted({name for name, _ in gpus}))
    crowded = f"; more than the {cores} CPU cores here, which they share" if k * len(gpus) > cores else ""
    return k * len(gpus), (f"hydra/launcher=gpus: {k} runs per GPU ({how}) x {len(gpus)} GPU(s) ({names}) = "
                           f"{k * len(gpus)} jobs at a time, each pinned to one GPU{crowded}")


# Run in a child: mem_get_info makes a CUDA context (~0.5 GiB) on each GPU it reads, which the sweep's
# process would otherwise hold until the sweep ends.
PROBE = ("import json, torch; print(json.dumps([[torch.cuda.get_device_name(i), torch.cuda.mem_get_info(i)[0] >> 20] "
         "for i in range(torch.cuda.device_count())]))")


def visible_gpus() -> list[tuple[str, int]]:
    """(name, free MiB) of each GPU this process sees (CUDA_VISIBLE_DEVICES); [] without CUDA."""
    if not torch.cuda.is_available():
        return []
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"hydra/launcher=gpus: reading the GPUs' free memory failed:\n{done.stderr[-2000:]}")
    return [(name, free) for name, free in json.loads(done.stdout)]


def gpu_jobs(runs_per_gpu="auto", run_mib: int = RUN_MIB) -> int:
    """${posbench.gpu_jobs:K[,MiB a run]}: hydra.launcher.n_jobs of hydra/launcher=gpus."""
    try:
        check_settings(runs_per_gpu, run_mib)
    except ValueError as err:  # its message, not a page of OmegaConf's traceback
        sys.exit(f"refused: {err}")
    jobs, message = plan(runs_per_gpu, visible_gpus(), run_mib)
    print(message, file=sys.stderr)
    return jobs


# use_cache: the sweep's process decides once; Hydra copies the resolved values into each job's config
# (ConfigLoader.load_sweep_config), so a job reads the same n_jobs without measuring the GPUs again.
OmegaConf.register_new_resolver("posbench.gpu_jobs", gpu_jobs, use_cache=True, replace=True)


# --- slots: one GPU per job (in each job's process) ---------------------------------------------

@dataclass
class Slot:
    folder: Path
    index: int
    fd: int  # open, with the flock, until release() or the process ends

    def release(self) -> None:
        os.close(self.fd)


def slot_path(folder: Path, index: int) -> Path:
    return folder / f"slot-{index}.lock"


def take_slot(folder: Path, count: int, wait: bool = True) -> Slot | None:
    """The first free of `count` slots in `folder`. All held (a second sweep command on the same sweep
    dir, or a worker starting while the one it replaces ends): waits for one with wait, else None."""
    folder.mkdir(parents=True, exist_ok=True)
    said = False
    while True:
        for index in range(count):
            fd = os.open(slot_path(folder, index), os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for a person looking
            return Slot(folder, index, fd)
        if not wait:
            return None
        if not said:
            print(f"all {count} GPU slots in {folder} are held; waiting for one", file=sys.stderr, flush=True)
            said = True
        time.sleep(POLL_S)


def gpu_of(slot: int, gpus: int) -> int:
    """The cuda index of a slot: round-robin, so the first jobs spread over the GPUs and each GPU has K slots."""
    return slot % gpus


_held: Slot | None = None  # this process's slot, kept from one job to the next


def sweep_gpu() -> torch.device | None:
    """In a job of hydra/launcher=gpus, cuda:<g> of the slot this process holds (taking one at its first
    job); None in any other run."""
    global _held
    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN or hydra.runtime.choices.get("hydra/launcher") != LAUNCHER:
        return None
    folder = Path(hydra.sweep.dir) / SLOT_DIR
    count = joblib.effective_n_jobs(int(hydra.launcher.n_jobs))
    if _held is None or _held.folder != folder:
        if _held is not None:
            _held.release()
        _held = take_slot(folder, count)
    index = gpu_of(_held.index, torch.cuda.device_count())
    torch.cuda.set_device(index)  # calls that name no device (synchronize, memory stats) use it too
    print(f"GPU slot {_held.index} of {count}: cuda:{index}", file=sys.stderr)
    return torch.device("cuda", index)
