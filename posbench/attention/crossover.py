"""`backend=auto` by measurement: the crossover table a GPU measured names the fastest backend for an
encoding at a sequence length, and auto takes it for training (at N) and for each evaluation length.

The table is scripts/gpu_measure.py's encodings.csv, committed under results/gpu/<device>/ with the
device's name (`torch.cuda.get_device_name`, as a folder name) beside its device.csv (name, compute capability).
A device with no table of its own takes the table of a device of the same compute capability (an H200 the
H100's: sm_90, the same kernels; the first such folder by name), and the run records which (`backend_table`).
POSBENCH_CROSSOVER names another file, or `none`: auto's rule wherever it runs.
Rows with `auto` false and status ok are the candidates: for the encoding and the training mode
(train.compile; evaluation runs uncompiled: `eager`), at the measured token count nearest the length
(on a log scale), the backend with the most tokens/s among those that can run the encoding here, where it
beats the rule's backend by more than MARGIN (a closer lead is within the noise of one measurement: on an
H100, t5's eager at 33 tokens led sdpa by 0.8%). With no table for the device, or no row for the encoding,
auto keeps its rule (posbench.attention.select).
"""
from __future__ import annotations

import csv
import functools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from posbench.settings import COMPILE_MODES

TABLES = Path(__file__).resolve().parents[2] / "results" / "gpu"
TABLE_FILE = "encodings.csv"
DEVICE_FILE = "device.csv"  # name, capability ("9.0"): what a table was measured on
TABLE_ENV = "POSBENCH_CROSSOVER"
NO_TABLE = "none"  # POSBENCH_CROSSOVER=none: auto keeps its rule
MARGIN = 1.05  # another backend replaces the rule's where it is measured this much faster
# train.compile -> the table's mode
MODES = dict(zip(COMPILE_MODES, ("eager", "compiled", "static", "graphs", "capture")))


def device_slug(name: str) -> str:
    """A device's name as a folder: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@dataclass(frozen=True)
class DeviceTable:
    """The crossover table auto follows on a device, and whose it is."""
    path: Path
    source: str  # the table's folder (a device slug), or the file POSBENCH_CROSSOVER names
    same_device: bool  # measured on this device's model; False: on another of its compute capability


def cuda_identity(device: torch.device | str | None) -> tuple[str, str] | None:
    """A CUDA device's name and compute capability ("9.0"), or None off CUDA."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return torch.cuda.get_device_name(torch.device(device)), f"{major}.{minor}"


@functools.cache
def table_for(name: str, capability: str, tables: Path = TABLES) -> DeviceTable | None:
    """The committed table of the device called `name`, else of the first device (by folder name) whose
    device.csv gives the same compute capability, else None."""
    own = tables / device_slug(name) / TABLE_FILE
    if own.is_file():
        return DeviceTable(own, own.parent.name, True)
    for folder in sorted(path for path in tables.glob("*") if (path / TABLE_FILE).is_file()):
        if measured_capability(folder) == capability:
            return DeviceTable(folder / TABLE_FILE, folder.name, False)
    return None


def measured_capability(folder: Path) -> str | None:
    """The compute capability a table's device.csv records, or None without one."""
    try:
        with (folder / DEVICE_FILE).open(newline="") as handle:
            return next(csv.DictReader(handle), {}).get("capability")
    except FileNotFoundError:
        return None


def device_table(device: torch.device | str | None) -> DeviceTable | None:
    """The crossover table for this device: POSBENCH_CROSSOVER's file (none: no table), else a CUDA device's
    committed one (table_for)."""
    named = os.environ.get(TABLE_ENV)
    if named:
        return None if named == NO_TABLE else DeviceTable(Path(named), named, True)
    identity = cuda_identity(device)
    return table_for(*identity) if identity else None


def has_rows(path: Path, encoding: str) -> bool:
    """The table measured `encoding` in some mode (else auto keeps its rule for it)."""
    return any(name == encoding for name, _ in read_table(path))


@functools.cache
def read_table(path: Path) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """(encoding, mode) -> tokens -> backend -> tokens/s, from the measured rows of a backend named outright."""
    table: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    with Path(path).open(newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("status") != "ok" or row.get("auto", "False") == "True":
                continue
            speeds = table.setdefault((row["encoding"], row["mode"]), {}).setdefault(int(row["tokens"]), {})
            speeds[row["backend"]] = float(row["tokens_per_s"])
    return table


def fastest(path: Path, encoding: str, compile_mode, tokens: int, candidates: list[str],
            rule: str | None = None) -> str | None:
    """The candidate measured fastest for `encoding` in `compile_mode` at the measured length nearest
    `tokens`, or the `rule`'s backend where none beats it by MARGIN; None where the table has no row for it."""
    by_length = read_table(path).get((encoding, MODES[compile_mode]), {})
    usable = {n: {b: s for b, s in speeds.items() if b in candidates} for n, speeds in by_length.items()}
    usable = {n: speeds for n, speeds in usable.items() if speeds}
    if not usable:
        return None
    nearest = min(usable, key=lambda n: (abs(math.log(n / tokens)), n))
    speeds = usable[nearest]
    best = max(speeds, key=speeds.get)
    return rule if rule in speeds and speeds[best] <= MARGIN * speeds[rule] else best
