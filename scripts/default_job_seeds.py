"""Does the default job learn copy at N on any CPU? Runs it for seeds x CPU kernel settings and writes
one row per run: exact match at N and token accuracy at 1.5N (the first length past N).

    python scripts/default_job_seeds.py                            # seeds 0-4 x every kernel setting
    python scripts/default_job_seeds.py --seeds 3 --settings own   # one run
    python scripts/default_job_seeds.py --overrides train.steps=2500 --out other.csv

A kernel setting is an environment variable torch reads at start (ATEN_CPU_CAPABILITY picks the ATen
kernels' instruction set, MKL_CBWR the BLAS code path), so each run is its own process. Each row names its
CPU (the model name and the widest instruction set torch's kernels use there). Rows already in --out for this
CPU are kept and not run again: a stopped call goes on where it stopped. Each run takes about two
minutes on one core (ATEN_CPU_CAPABILITY=default longer: no vector instructions)."""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "own": {},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "ATEN_CPU_CAPABILITY=avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "MKL_CBWR=AVX2": {"MKL_CBWR": "AVX2"},
    "MKL_CBWR=AVX512": {"MKL_CBWR": "AVX512"},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
}
FIELDS = ["cpu", "overrides", "setting", "seed", "exact_match_at_n", "token_acc_past_n", "config_hash", "torch"]


def cpu_name() -> str:
    """This machine's CPU as a row names it: its model name and torch's widest kernels here, e.g. "Intel(R)
    Xeon(R) Processor (AVX512)"."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return f"{names[0] if names else platform.processor() or platform.machine()} " \
           f"({torch.backends.cpu.get_cpu_capability()})"


def run_once(cpu: str, setting: str, seed: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        env = dict(os.environ, **SETTINGS[setting])
        subprocess.run([sys.executable, "-m", "posbench", f"seed={seed}", f"hydra.run.dir={run_dir}",
                        "train.save_checkpoint=false", *overrides], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in Path(run_dir, "results.jsonl").read_text().splitlines()]
    n = rows[0]["train_length"]
    at_n = next(r for r in rows if r["eval_length"] == n)
    past_n = min((r for r in rows if r["eval_length"] > n), key=lambda r: r["eval_length"])
    return {"cpu": cpu, "overrides": " ".join(overrides), "setting": setting, "seed": seed,
            "exact_match_at_n": at_n["exact_match"], "token_acc_past_n": past_n["token_acc"],
            "config_hash": at_n["config_hash"], "torch": at_n["torch"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--overrides", nargs="*", default=[], help="posbench settings for every run")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "reference" / "default_job_seeds.csv")
    args = parser.parse_args(argv)
    done = list(csv.DictReader(args.out.open())) if args.out.exists() else []
    have = {(r["cpu"], r["overrides"], r["setting"], int(r["seed"])) for r in done}
    overrides, cpu = " ".join(args.overrides), cpu_name()
    for seed in args.seeds:  # seed-major: a call stopped early has every setting of its first seeds
        for setting in args.settings:
            if (cpu, overrides, setting, seed) in have:
                continue
            done.append(run_once(cpu, setting, seed, args.overrides))
            with args.out.open("w", newline="") as f:  # after every run: what was measured stays
                writer = csv.DictWriter(f, FIELDS)
                writer.writeheader()
                writer.writerows(done)
            r = done[-1]
            print(f"{setting:28s} seed {seed}: exact match at N {float(r['exact_match_at_n']):.4f}, "
                  f"token accuracy past N {float(r['token_acc_past_n']):.4f}", flush=True)


if __name__ == "__main__":
    main()
