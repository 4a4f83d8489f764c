"""Where a compiled run's training time goes: the default job's steps (or any run's, by Hydra overrides) in
each train.compile mode, each step timed alone, split into a length's first step (compilation, a CUDA graph's
recording) and its later ones (replay). Prints a table per mode and writes the steps to --out as CSV.

    python scripts/compile_probe.py [--modes false,graphs] [--steps 300] [--out probe.csv] [override ...]

The steps draw their lengths and batches as the runner's training loop does (posbench.training.train).
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file: import posbench and tasks from this checkout

FIELDS = ["mode", "step", "length", "first_of_length", "seconds"]


def probe(mode: str, steps: int, overrides: list[str]) -> list[dict]:
    import torch

    from posbench import draws
    from posbench.build import build, resolve_device, sync
    from posbench.settings import COMPILE_MODES
    from posbench.training import begin_step, compiled, learning_rate, make_optimizer, set_learning_rate, train_step
    from scripts.benchmark_encodings import compose_cfg

    cfg = compose_cfg([*overrides, f"train.compile={mode}"])
    device = resolve_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    compile_mode = next(m for m in COMPILE_MODES if str(m).lower() == mode)
    built = build(cfg, device)
    model, task = built.model.train(), built.task
    optimizer = make_optimizer(model, cfg.train)
    forward = compiled(model, compile_mode, device, flex=built.backend == "flex")
    generators = {"data": draws.generator(cfg.seed), "length": draws.generator(cfg.seed)}
    seen, rows = set(), []
    for step in range(steps):
        length = built.train_length
        if cfg.train.lengths == "uniform":
            length = int(torch.randint(1, built.train_length + 1, (1,), generator=generators["length"]))
        batch = task.train_sample(cfg.train.batch_size, length, built.train_length, generators["data"])
        set_learning_rate(optimizer, learning_rate(step, cfg.train))
        positions = built.positions.for_batch(batch, generators["data"])  # [1, T]
        batch, positions = draws.to_device(batch, device), draws.move(positions, device)
        sync(device)
        start = time.perf_counter()
        begin_step(compile_mode, device)
        train_step(model, forward, task, batch, positions, optimizer, cfg.train, device)
        sync(device)
        rows.append({"mode": mode, "step": step, "length": length, "first_of_length": length not in seen,
                     "seconds": time.perf_counter() - start})
        seen.add(length)
    return rows


def summary(rows: list[dict]) -> str:
    first = [r["seconds"] for r in rows if r["first_of_length"]]
    later = [r["seconds"] for r in rows if not r["first_of_length"]]
    tail = [r["seconds"] for r in rows[len(rows) // 2:] if not r["first_of_length"]]
    median = statistics.median(later) if later else float("nan")
    late = statistics.median(tail) if tail else float("nan")
    return (f"{rows[0]['mode']:>7} {len(rows):6d} {sum(r['seconds'] for r in rows):8.1f} {len(first):7d} "
            f"{sum(first):8.1f} {median * 1e3:9.2f} {late * 1e3:9.2f} {1 / late if tail else float('nan'):8.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="false,graphs", help="train.compile modes, in turn")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None, help="a CSV of every step")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the run (default: the default job)")
    args = parser.parse_args(argv)
    print(f"{'mode':>7} {'steps':>6} {'total_s':>8} {'lengths':>7} {'first_s':>8} {'later_ms':>9} "
          f"{'late_ms':>9} {'late/s':>8}   (first: a length's first step; later: its other steps' median; "
          f"late: the later half's)", flush=True)
    rows = []
    for mode in args.modes.split(","):
        rows += (found := probe(mode, args.steps, args.overrides))
        print(summary(found), flush=True)
        if args.out:
            with args.out.open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=FIELDS)
                writer.writeheader()
                writer.writerows(rows)


if __name__ == "__main__":
    main()
