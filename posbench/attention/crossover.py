"""`backend=auto` by measurement: the crossover table a GPU measured names the fastest backend for an
encoding at a sequence length, and auto takes it for training (at N) and for each evaluation length.

The table is scripts/gpu_measure.py's encodings.csv, committed under results/gpu/<device>/ with the
device's name (`torch.cuda.get_device_name`, as a folder name); POSBENCH_CROSSOVER names another file.
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
from pathlib import Path

import torch

from posbench.settings import COMPILE_MODES

TABLES = Path(__file__).resolve().parents[2] / "results" / "gpu"
TABLE_FILE = "encodings.csv"
TABLE_ENV = "POSBENCH_CROSSOVER"
MARGIN = 1.05  # another backend replaces the rule's where it is measured this much faster
# train.compile -> the table's mode
MODES = dict(zip(COMPILE_MODES, ("eager", "compiled", "static", "graphs", "capture")))


def device_slug(name: str) -> str:
    """A device's name as a folder: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def table_path(device: torch.device | str | None) -> Path | None:
    """The crossover table for this device: POSBENCH_CROSSOVER, else the committed one of a CUDA device's name."""
    if os.environ.get(TABLE_ENV):
        return Path(os.environ[TABLE_ENV])
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    path = TABLES / device_slug(torch.cuda.get_device_name(torch.device(device))) / TABLE_FILE
    return path if path.is_file() else None


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
