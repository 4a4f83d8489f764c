"""Training step time of the model presets, relative to model=small, in one process.

    python scripts/benchmark_model_sizes.py [--models xs,small,medium,large] [--encoding rope]
        [--task copy] [--rounds 5] [--steps 4] [--threads 1]

Every preset is built as a real run builds it (Hydra compose, posbench.build.build) and
steps on one fixed batch at N (train.batch_size sequences). Rounds interleave the presets
(small, xs, medium, ... then again), each timing `--steps` AdamW steps with process CPU
time; the table gives the median over rounds, the spread, the ratio to small and what
10,000 steps (the default training) cost at that median.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from posbench.build import build
from posbench.training import make_optimizer, train_step

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
BASELINE = "small"


def prepared(model: str, encoding: str, task: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}", f"encoding={encoding}", f"task={task}"])
    built = build(cfg, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    batch = built.task.train_sample(int(cfg.train.batch_size), built.train_length, built.train_length, generator)
    positions = built.positions.for_batch(batch, generator)  # [1, T]
    optimizer = make_optimizer(built.model, cfg.train)

    def step():
        train_step(built.model, built.model, built.task, batch, positions, optimizer, cfg.train, torch.device("cpu"))

    return step, sum(p.numel() for p in built.model.parameters())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="xs,small,medium,large")
    parser.add_argument("--encoding", default="rope")
    parser.add_argument("--task", default="copy")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per preset and round")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = list(dict.fromkeys([BASELINE, *args.models.split(",")]))
    runs = {model: prepared(model, args.encoding, args.task) for model in models}
    times: dict[str, list[float]] = {model: [] for model in models}
    for step, _ in runs.values():
        step()  # warm-up
    for _ in range(args.rounds):
        for model, (step, _) in runs.items():
            start = time.process_time()
            for _ in range(args.steps):
                step()
            times[model].append((time.process_time() - start) / args.steps)
    base = statistics.median(times[BASELINE])
    print(f"{args.encoding} on {args.task}, {args.threads} thread(s), median of {args.rounds} interleaved rounds "
          "of process CPU time")
    print("| model | parameters | ms / step (min–max) | / small | 10,000 steps |")
    print("|---|---|---|---|---|")
    for model in sorted(models, key=lambda m: runs[m][1]):
        median = statistics.median(times[model])
        print(f"| {model} | {runs[model][1]:,} | {median * 1e3:.0f} ({min(times[model]) * 1e3:.0f}–"
              f"{max(times[model]) * 1e3:.0f}) | {median / base:.2f} | {median * 1e4 / 60:.0f} min |")


if __name__ == "__main__":
    main()
