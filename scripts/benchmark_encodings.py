"""Training speed and peak memory of every registered encoding, relative to nope.

    python scripts/benchmark_encodings.py [--encodings nope,rope,...] [--lengths 16,128]
        [--steps 5] [--warmup 2] [--batch-size 64] [--threads 1] [--device auto]
        [--override model=tiny ...] [--out bench.csv]
    python scripts/benchmark_encodings.py --methods nope,rope,ssmax,... (the frontier study's methods)

Each (encoding, length) runs in a fresh child process (this script with --child): the
Hydra config is composed as in a real run with `encoding=<name>` (with --methods,
`+frontier_method=<name>`: a configs/frontier_method option) and `train.length=<length>`,
the model comes from `posbench.build.build` (so backend=auto, the model size and the
encoding's dims are the real ones), then warm-up and timed AdamW training steps run on
`task.sample(batch, length)` batches at exactly that length, positions arange(T). Speed is
the batch's tokens over the median timed step. Memory, in MiB over a baseline: `peak` from
right after the model is built through all steps (so it includes one-time runtime set-up and
the AdamW state), `step` over the timed steps only, from the state after warm-up. On CPU it is
the process's resident-set high-water mark (Linux VmHWM, reset to the current RSS at each
baseline), on CUDA torch.cuda.max_memory_allocated. Ratios divide by nope at the same length,
measured in the same run. The markdown table goes to stdout, progress to stderr.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
RESULT_MARK = "BENCH_RESULT "  # the child's one line of output the parent reads
BASELINE = "nope"
MEMORY_METHODS = {
    "rss_hwm": "`peak` = growth of the process's resident-set high-water mark (Linux VmHWM) over the RSS "
               "right after the model is built, through warm-up and timed steps (includes one-time runtime "
               "initialisation and the AdamW state); `step` = the same over the timed steps only, the "
               "high-water mark reset after warm-up (freed heap returned to the OS first with malloc_trim)",
    "process_peak_rss": "`peak` = growth of getrusage ru_maxrss from after the model is built to after the steps "
                 "(no reset possible here, so no `step` column)",
    "cuda_max_allocated": "`peak` = torch.cuda.max_memory_allocated over warm-up and timed steps minus the "
                          "memory allocated after the model is built; `step` = the same over the timed steps "
                          "only, counted from the memory allocated after warm-up",
}
CSV_FIELDS = ["encoding", "backend", "length", "tokens", "batch_size", "tokens_per_s", "tokens_per_s_vs_nope",
              "step_ms_median", "peak_mem_mb", "peak_mem_vs_nope", "step_mem_mb", "step_mem_vs_nope", "mem_kind",
              "device", "threads", "steps", "warmup", "status"]

sys.path.insert(0, str(ROOT))  # run as a file: import posbench and tasks from this checkout


def compose_cfg(overrides: list[str]):
    """The config a `python -m posbench <overrides>` run would get."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # resolves ${hydra:...} as in a real run
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def parse_list(text: str, kind, flag: str) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"{flag}={text!r}: expected a comma-separated list of {kind.__name__}") from None
    if not values:
        raise SystemExit(f"{flag}={text!r}: empty list")
    return values


# ---------------------------------------------------------------- child: one (encoding, length)

def child(args: argparse.Namespace) -> None:
    import torch

    from posbench import draws
    from posbench.build import build, resolve_device, sync
    from posbench.memory import PeakMemory
    from posbench.training import make_optimizer, train_step

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    chosen = f"+frontier_method={args.encoding}" if args.method else f"encoding={args.encoding}"
    cfg = compose_cfg([chosen, f"train.length={args.length}", f"device={args.device}", *args.override])
    built = build(cfg, device)
    model, task = built.model, built.task
    batch_size = args.batch_size or int(cfg.train.batch_size)
    model.train()
    optimizer = make_optimizer(model, cfg.train)
    data_gen = draws.generator(int(cfg.seed))

    def step() -> tuple[torch.Tensor, int]:
        """posbench.training.train_step, the runner's own, on a batch at exactly this length."""
        batch = draws.to_device(task.sample(batch_size, args.length, data_gen), device)
        pos = torch.arange(batch.inputs.shape[1], device=device)[None]  # [1, T] sequential positions
        loss, _ = train_step(model, model, task, batch, pos, optimizer, cfg.train, device)
        return loss.detach(), batch.inputs.shape[1]

    memory = PeakMemory(device)
    memory.start()
    built_mb = memory.base
    warm_peak_mb = built_mb
    for _ in range(args.warmup):
        step()
    if memory.resettable:
        warm_peak_mb = memory.peak()
        memory.start()  # the timed steps' own working memory, one-time initialisation excluded
    step_seconds = []
    for _ in range(args.steps):
        sync(device)
        start = time.perf_counter()
        loss, tokens = step()
        sync(device)
        step_seconds.append(time.perf_counter() - start)
    if not math.isfinite(loss.item()):
        raise RuntimeError(f"loss is {loss.item()} after {args.warmup + args.steps} steps")
    timed_peak_mb = memory.peak()
    peak_mb = max(warm_peak_mb, timed_peak_mb) - built_mb
    step_mem_mb = timed_peak_mb - memory.base if memory.resettable else None

    median = statistics.median(step_seconds)
    result = {"encoding": args.encoding if args.method else built.encoding.name, "backend": built.backend,
              "length": args.length, "tokens": tokens,
              "batch_size": batch_size, "tokens_per_s": batch_size * tokens / median,
              "step_ms_median": 1000 * median, "peak_mem_mb": peak_mb, "step_mem_mb": step_mem_mb,
              "mem_kind": memory.kind,
              "device": str(device), "threads": torch.get_num_threads(), "steps": args.steps,
              "warmup": args.warmup, "status": "ok"}
    print(RESULT_MARK + json.dumps(result), flush=True)


# ---------------------------------------------------------------- parent: every row, the table

def run_child(args: argparse.Namespace, encoding: str, length: int) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--encoding", encoding,
               "--length", str(length), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--device", args.device, "--threads", str(args.threads)]
    if args.batch_size:
        command += ["--batch-size", str(args.batch_size)]
    if args.methods:
        command.append("--method")
    for override in args.override:
        command += ["--override", override]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    error = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    print(f"  {encoding} length {length} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
    return {"encoding": encoding, "length": length, "status": f"failed: {error}"[:300]}


RATIOS = {"tokens_per_s": "tokens_per_s_vs_nope", "peak_mem_mb": "peak_mem_vs_nope",
          "step_mem_mb": "step_mem_vs_nope"}


def add_ratios(rows: list[dict]) -> None:
    """Divide by nope at the same length; None where either side is missing or zero."""
    reference = {r["length"]: r for r in rows if r["encoding"] == BASELINE and r["status"] == "ok"}
    for row in rows:
        base = reference.get(row["length"], {})
        for key, ratio in RATIOS.items():
            ok = row["status"] == "ok" and row.get(key) is not None and (base.get(key) or 0) > 0
            row[ratio] = row[key] / base[key] if ok else None


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown_table(rows: list[dict], args: argparse.Namespace) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    first = ok[0] if ok else {}
    methods = sorted({r["mem_kind"] for r in ok})
    caption = (
        f"Training speed and memory per encoding; {args.setting} "
        f"({first.get('device', args.device)}, {first.get('threads', '?')} thread(s), batch "
        f"{first.get('batch_size', '?')}). One step = sample + forward + backward + grad clip + AdamW, "
        f"positions arange(T); tokens/s = batch x tokens / median of {args.steps} timed steps after "
        f"{args.warmup} warm-up steps. `length` is the task length n; `tokens` = T, what the model sees. "
        f"Each row runs in a fresh process; memory is in MiB: "
        + "; ".join(MEMORY_METHODS[m] for m in methods)
        + ". Ratios divide by nope at the same length, measured in this run.")
    header = ["encoding", "backend", "length", "tokens", "tokens/s", "tokens/s vs nope", "step ms",
              "peak MiB", "peak vs nope", "step MiB", "step vs nope"]
    lines = [caption, "", "| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    for r in rows:
        if r["status"] != "ok":
            cells = [r["encoding"], "—", str(r["length"]), r["status"].replace("|", "/")] + ["—"] * 7
        else:
            cells = [r["encoding"], r["backend"], str(r["length"]), str(r["tokens"]), f"{r['tokens_per_s']:,.0f}",
                     fmt(r["tokens_per_s_vs_nope"], ".2f"), f"{r['step_ms_median']:.1f}",
                     f"{r['peak_mem_mb']:.1f}", fmt(r["peak_mem_vs_nope"], ".2f"),
                     fmt(r["step_mem_mb"], ".1f"), fmt(r["step_mem_vs_nope"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> None:
    from posbench.encodings import REGISTRY

    if args.methods and args.encodings:
        raise SystemExit("--encodings and --methods: give one of them")
    if args.methods:
        encodings, flag = parse_list(args.methods, str, "--methods"), "--methods"
        known = sorted(path.stem for path in (CONFIGS / "frontier_method").glob("*.yaml"))
    else:
        sequence_encodings = [name for name, cls in REGISTRY.items() if cls.position_dims == 1]  # 2-D: grids
        encodings = parse_list(args.encodings, str, "--encodings") if args.encodings else sequence_encodings
        flag, known = "--encodings", sorted(REGISTRY)
    unknown = [name for name in encodings if name not in known]
    if unknown:
        raise SystemExit(f"{flag}: unknown {unknown}; choose from {known}")
    encodings = [BASELINE] + [name for name in dict.fromkeys(encodings) if name != BASELINE]
    cfg = compose_cfg(list(args.override))
    args.setting = (f"{cfg.task._target_.rsplit('.', 1)[-1].lower()} task, model d_model={cfg.model.d_model} "
                    f"n_layers={cfg.model.n_layers} n_heads={cfg.model.n_heads}")
    if args.lengths:
        lengths = parse_list(args.lengths, int, "--lengths")
    else:
        lengths = [int(cfg.train.length), 8 * int(cfg.train.length)]  # N and 8N
    if min(lengths) < 1:
        raise SystemExit(f"--lengths={args.lengths}: lengths must be >= 1")

    rows, began, total = [], time.perf_counter(), len(encodings) * len(lengths)
    for encoding in encodings:
        for length in lengths:
            started = time.perf_counter()
            row = run_child(args, encoding, length)
            rows.append(row)
            summary = (f"{row['tokens_per_s']:,.0f} tok/s, {row['peak_mem_mb']:.1f} MiB, {row['backend']}"
                       if row["status"] == "ok" else row["status"])
            print(f"[{len(rows)}/{total}] {encoding} length {length}: {summary} "
                  f"({time.perf_counter() - started:.1f} s, {time.perf_counter() - began:.0f} s total)",
                  file=sys.stderr, flush=True)
    add_ratios(rows)
    print(markdown_table(rows, args))
    if args.out:
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.out}", file=sys.stderr)
    failed = [f"{r['encoding']}@{r['length']}" for r in rows if r["status"] != "ok"]
    if failed:
        raise SystemExit(f"{len(failed)} row(s) failed: {', '.join(failed)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encodings", help="comma-separated registry names (default: all); nope is always added")
    parser.add_argument("--methods", help="comma-separated configs/frontier_method options, in place of "
                                          "--encodings; nope is always added")
    parser.add_argument("--lengths", help="comma-separated task lengths (default: N and 8N, N = train.length)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps; the median is reported")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the config's train.batch_size")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads per row (default 1: steady on a shared CPU; 0 keeps torch's)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--override", action="append", default=[],
                        help="an extra Hydra override for every row, e.g. model=tiny or task=sort (repeatable)")
    parser.add_argument("--out", help="also write the rows to this CSV file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--encoding", help=argparse.SUPPRESS)
    parser.add_argument("--method", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")
    main()
