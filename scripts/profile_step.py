"""Where one training step's time goes: torch.profiler over a few steps of an encoding at a length, the ops with
the most self time (device time on CUDA, CPU time elsewhere), as a table. For the slow rows of
results/gpu/<device>/encodings.csv: the same step as scripts/gpu_measure.py (posbench.training.train_step on
copy at model=small, about --tokens-per-step tokens a batch).

    python scripts/profile_step.py --encoding fire --tokens 4096 [--backend auto] [--compile false]
        [--device auto] [--steps 3] [--rows 20] [override ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file: import posbench and tasks from this checkout

WARMUP_STEPS = 3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoding", required=True)
    parser.add_argument("--tokens", type=int, default=1024, help="about this many tokens a sequence")
    parser.add_argument("--tokens-per-step", type=int, default=65536)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--compile", default="false", help="train.compile")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=3, help="steps profiled, after 3 unprofiled")
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides of the run")
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from posbench import draws
    from posbench.build import build, resolve_device, sync
    from posbench.settings import COMPILE_MODES
    from posbench.training import begin_step, compiled, make_optimizer, train_step
    from scripts.benchmark_encodings import compose_cfg
    from scripts.gpu_measure import built_task_length, sequence_task_length

    torch.set_num_threads(1)
    length = sequence_task_length(args.tokens)
    device = resolve_device(args.device)
    batch_size = max(1, args.tokens_per_step // built_task_length(args.encoding, length))
    cfg = compose_cfg([f"encoding={args.encoding}", f"backend={args.backend}", "model=small", f"train.length={length}",
                       f"train.batch_size={batch_size}", f"device={args.device}", f"train.compile={args.compile}",
                       *args.overrides])
    compile_mode = next(m for m in COMPILE_MODES if str(m).lower() == args.compile)
    built = build(cfg, device)
    model, task = built.model.train(), built.task
    optimizer = make_optimizer(model, cfg.train)
    forward = compiled(model, compile_mode, device, flex=built.backend == "flex")
    generator = draws.generator(0)
    seq = task.sequence_length(length)
    positions = torch.arange(seq, device=device)[None]  # [1, T]

    def step() -> None:
        batch = draws.to_device(task.sample(batch_size, length, generator), device)
        begin_step(compile_mode, device)
        train_step(model, forward, task, batch, positions, optimizer, cfg.train, device)

    for _ in range(WARMUP_STEPS):
        step()
    sync(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        sync(device)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"{args.encoding} on {built.backend}, train.compile={args.compile}, {seq} tokens x {batch_size} "
          f"sequences, {args.steps} steps on {device}; sorted by {sort}")
    print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))


if __name__ == "__main__":
    main()
