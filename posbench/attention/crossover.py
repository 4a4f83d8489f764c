"""`backend=auto` by measurement: the crossover table a GPU measured names the fastest backend for an
encoding at a sequence length, and auto takes it for training (at N) and for each evaluation length.

The table is scripts/gpu_measure.py's encodings.csv, committed under results/gpu/<device>/ with the
device's name (`torch.cuda.get_device_name`, as a folder name) beside its device.csv (name, compute capability).
A device reads its own table and, for what that lacks, the tables of devices of the same compute capability (an
H200 the H100's: sm_90, the same kernels; by folder name): a row (encoding, mode, tokens, backend) of the first
table that has it. The run records which tables (`backend_table`). POSBENCH_CROSSOVER names one file instead, or
`none`: auto's rule wherever it runs.
Rows with `auto` false, status ok and a ratio to nope are the candidates: for the encoding and the training mode
(train.compile; evaluation runs uncompiled: `eager`), at the measured token count nearest the length (on a log
scale), the backend with the highest tokens/s against nope's (`vs_nope`: nope measured in the same call, so rows of
other calls and devices compare) among those that can run the encoding here, where it beats the rule's backend by
more than MARGIN (a closer lead is within the noise of one measurement: on an H100, t5's eager at 33 tokens led
sdpa by 0.8%). With no table for the device, or no row for the encoding, auto keeps its rule
(posbench.attention.select).
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
    """The crossover tables auto follows on a device, and whose they are."""
    paths: tuple[Path, ...]  # the device's own first (where it has one), then those of its compute capability
    source: str  # their folders (device slugs) joined by "+", or the file POSBENCH_CROSSOVER names
    same_device: bool  # the first was measured on this device's model


def cuda_identity(device: torch.device | str | None) -> tuple[str, str] | None:
    """A CUDA device's name and compute capability ("9.0"), or None off CUDA."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return torch.cuda.get_device_name(torch.device(device)), f"{major}.{minor}"


@functools.cache
def table_for(name: str, capability: str, tables: Path = TABLES) -> DeviceTable | None:
    """The committed table of the device called `name`, then those of every other device (by folder name) whose
    device.csv gives the same compute capability; None where there is neither."""
    own = tables / device_slug(name) / TABLE_FILE
    paths = [own] if own.is_file() else []
    paths += [folder / TABLE_FILE for folder in sorted(tables.glob("*"))
              if folder != own.parent and (folder / TABLE_FILE).is_file() and measured_capability(folder) == capability]
    if not paths:
        return None
    return DeviceTable(tuple(paths), "+".join(path.parent.name for path in paths), own.is_file())


def measured_capability(folder: Path) -> str | None:
    """The compute capability a table's device.csv records, or None without one."""
    try:
        with (folder / DEVICE_FILE).open(newline="") as handle:
            return next(csv.DictReader(handle), {}).get("capability")
    except FileNotFoundError:
        return None


def device_table(device: torch.device | str | None) -> DeviceTable | None:
    """The crossover tables for this device: POSBENCH_CROSSOVER's file (none: no table), else a CUDA device's
    committed ones (table_for)."""
    named = os.environ.get(TABLE_ENV)
    if named:
        return None if named == NO_TABLE else DeviceTable((Path(named),), named, True)
    identity = cuda_identity(device)
    return table_for(*identity) if identity else None


def has_rows(paths: tuple[Path, ...], encoding: str) -> bool:
    """The tables measured `encoding` in some mode (else auto keeps its rule for it)."""
    return any(name == encoding for name, _ in read_table(paths))


@functools.cache
def read_table(paths: tuple[Path, ...]) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """(encoding, mode) -> tokens -> backend -> tokens/s against nope's, from the measured rows of a backend named
    outright; a row of an earlier file stands over the same row of a later one."""
    table: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for path in paths:
        with Path(path).open(newline="") as handle:
            for row in csv.DictReader(handle):
                if row.get("status") != "ok" or row.get("auto", "False") == "True" or not row.get("vs_nope"):
                    continue
                ratios = table.setdefault((row["encoding"], row["mode"]), {}).setdefault(int(row["tokens"]), {})
                ratios.setdefault(row["backend"], float(row["vs_nope"]))
    return table


def fastest(paths: tuple[Path, ...], encoding: str, compile_mode, tokens: int, candidates: list[str],
            rule: str | None = None) -> str | None:
    """The candidate measured fastest for `encoding` in `compile_mode` at the measured length nearest
    `tokens`, or the `rule`'s backend where none beats it by MARGIN; None where the tables have no row for it."""
    by_length = read_table(tuple(paths)).get((encoding, MODES[compile_mode]), {})
    usable = {n: {b: s for b, s in speeds.items() if b in candidates} for n, speeds in by_length.items()}
    usable = {n: speeds for n, speeds in usable.items() if speeds}
    if not usable:
        return None
    nearest = min(usable, key=lambda n: (abs(math.log(n / tokens)), n))
    speeds = usable[nearest]
    best = max(speeds, key=speeds.get)
    return rule if rule in speeds and speeds[best] <= MARGIN * speeds[rule] else best
