"""The GPU measurements as one artifact: what posbench gives on one device, written under
results/gpu/<device name>/ for docs/performance.md to read (scripts/docs_tables.py).

    python scripts/gpu_measure.py [--budget-s 460] [--parts encodings,default_job,sweep]
        [--encodings nope,alibi,...] [--tokens 32,256,1024,4096] [--modes eager,capture,graphs]
        [--device auto] [--out results/gpu] [--job-modes eager,capture,graphs] [--sweep-launcher OVERRIDE ...]

- encodings.csv: `encoding, backend, mode, tokens, tokens_per_s, vs_nope` (and auto, batch_size, status) for
  every 1-D encoding on the backend `auto` gives it (auto true), and for those with a bias or a decay (where
  the backend is a choice) on sdpa, flex and eager besides, in each training mode of --modes (train.compile:
  eager, capture and graphs by default: the whole step as a CUDA graph, and the compiled model's), at about 32,
  256, 1,024 and 4,096 tokens
  (8,192 too with a bias or a decay). A backend that cannot train the encoding here is a row with its refusal
  as status. A step is posbench.training.train_step on the copy task at model=small, with about
  TOKENS_PER_STEP tokens a batch, of one model per backend and mode built for the longest length (a compiled
  forward compiles once, as in a run); tokens/s is over the median of the timed steps (8, or as many as fill
  0.5 s, at most 200: `timed_steps`). `tokens` is the sequence the model sees (copy's 2n + 1 for n = tokens // 2).
  vs_nope divides by nope on its own auto backend at the same tokens and mode, measured in this run. One child
  process per encoding.
- default_job.csv: `device, wall_s, train_s, exact_match_at_n, data_fingerprint` of the README's default
  job (`python -m posbench encoding=rope task=copy`) on this device, as it is (compile eager) and with
  train.compile=capture and graphs (--job-modes), with its training steps and tokens per second.
- sweep.csv: `runs, wall_min, runs_per_hour, concurrent` of the frontier study's copy runs of seed 0 (the
  part one call can hold) through the sweep launcher (hydra/launcher=gpus, n_jobs = concurrent), a row per
  concurrency measured (a later call at another one adds its row); `extrapolated_study_min` scales it to the
  whole study (156 runs) by the CPU's measured cost of each task against copy, and says so in `note`.
  `train_steps` (every run's, finished or under way) over the wall time is `train_steps_per_s`: where the
  budget cut the sweep before any run finished, the study is extrapolated from it (a lower bound).
- device.csv: `name, capability` of a CUDA device: a device of the same compute capability reads this folder's
  encodings.csv for the rows its own table lacks (posbench.attention.crossover).

Everything runs within --budget-s (the parts in the order given; nope first among the encodings, then those of
--encodings in its order, or the issue's targets before the rest); what the budget leaves out is written as
rows with status `not measured: budget`, never dropped.
"""
from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file: import posbench and tasks from this checkout

from posbench.attention.crossover import MODES as TABLE_MODES, device_slug  # noqa: E402
from posbench.attention.fla_hooks import fla_missing_hooks  # noqa: E402
from posbench.hooks import BACKEND_NAMES as BACKENDS, FLA, backend_hooks  # noqa: E402

RESULT_MARK = "GPU_MEASURE "  # a child's lines of output the parent reads
BASELINE = "nope"
TARGETS = ("alibi", "sandwich", "fox", "t5", "fire", "kerple", "cope", "dape", "stick_breaking")  # measured first
TOKENS = (32, 256, 1024, 4096)
LONG_TOKENS = 8192  # for the encodings with a bias or a decay
MODES = {name: setting for setting, name in TABLE_MODES.items()}  # the table's mode -> train.compile
TOKENS_PER_STEP = 65536  # a batch of about this many tokens: 64 sequences of 1,025
WARMUP_STEPS, TIMED_STEPS = 3, 8
TIMED_SECONDS, MOST_STEPS = 0.5, 200  # short steps are timed longer: at least this long, at most this many
SLOW_STEP_S = 2.0  # a backend whose step takes longer is not stepped at longer lengths (kerple on flex: 3 s)
ENCODING_FIELDS = ["encoding", "backend", "mode", "tokens", "tokens_per_s", "vs_nope", "auto", "batch_size", "status",
                   "timed_steps"]
DEFAULT_JOB_FIELDS = ["device", "wall_s", "train_s", "exact_match_at_n", "data_fingerprint", "compile",
                      "train_steps_per_s", "train_tokens_per_s", "status"]
SWEEP_FIELDS = ["runs", "wall_min", "runs_per_hour", "concurrent", "train_steps", "train_steps_per_s",
                "extrapolated_study_min", "note"]
# The frontier study's run minutes per task against copy on the CPU (docs/studies.md, seed 2: 3.8 min a
# copy run, 7.5 sparse flip-flop, 5.4 WikiText, 9.6 counting): one seed of all four tasks costs this many
# copy parts; the study is three seeds.
STUDY_COPY_PARTS = 3 * (3.8 + 7.5 + 5.4 + 9.6) / 3.8
STUDY_RUNS = 156
STUDY_RUN_SETS = 3 * 4  # seeds x tasks: a set is one seed's runs of one task (the copy part: 13 runs)


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{os.cpu_count()}-cores"


# ---------------------------------------------------------------- child: one encoding, every backend and mode

def compose_cfg(overrides: list[str]):
    from scripts.benchmark_encodings import compose_cfg as compose

    return compose(overrides)


def sequence_task_length(tokens: int) -> int:
    """Copy's n for a sequence of about `tokens` tokens (it shows 2n + 1 with BOS)."""
    return max(1, tokens // 2)


def built_task_length(encoding: str, length: int) -> int:
    """The copy sequence's tokens at task length `length` (the memory guard judges the longest batch)."""
    from hydra.utils import instantiate

    return instantiate(compose_cfg([f"encoding={encoding}"]).task, _partial_=True)().sequence_length(length)


def child(args: argparse.Namespace) -> None:
    """One model per backend and mode, built for the longest length and stepped at each length in turn: a
    compiled forward compiles once (graphs records a CUDA graph per length), as in a run's training."""
    import torch

    from posbench import draws
    from posbench.build import build, resolve_device, sync
    from posbench.capture import CapturedSteps
    from posbench.training import begin_step, compiled, make_optimizer, train_step

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    token_counts = sorted(map(int, args.tokens.split(",")))
    longest = sequence_task_length(token_counts[-1])
    longest_batch = max(1, args.tokens_per_step // built_task_length(args.encoding, longest))
    for backend in args.backends.split(","):
        for mode in args.modes.split(","):
            rows = [{"encoding": args.encoding, "backend": backend, "mode": mode, "tokens": tokens,
                     "auto": backend == "auto"} for tokens in token_counts]
            try:
                if time.time() > args.deadline:
                    raise TimeoutError
                compile_mode = MODES[mode]
                cfg = compose_cfg([f"encoding={args.encoding}", f"backend={backend}", "model=small",
                                   f"train.length={longest}", f"train.batch_size={longest_batch}",
                                   f"device={args.device}", f"train.compile={str(compile_mode).lower()}"])
                built = build(cfg, device)
                model, task = built.model.train(), built.task
                optimizer = make_optimizer(model, cfg.train)
                forward = compiled(model, compile_mode, device, flex=built.backend == "flex")
                train_one = functools.partial(train_step, model, forward, task, optimizer=optimizer,
                                              cfg_train=cfg.train, device=device,
                                              static_gradients=compile_mode == "capture")
                if compile_mode == "capture":  # a CUDA graph of the whole step per length (posbench.capture)
                    train_one = CapturedSteps(model, optimizer, train_one, device)
                generator = draws.generator(0)
            except Exception as err:  # a backend that refuses the encoding, or no budget left: every length
                for row in rows:
                    print(RESULT_MARK + json.dumps(row | {"status": failure(err)}), flush=True)
                continue
            too_slow = None  # why the longer lengths are skipped
            for row in rows:
                if too_slow:
                    print(RESULT_MARK + json.dumps(row | {"backend": built.backend, "status": too_slow}), flush=True)
                    continue
                length = sequence_task_length(row["tokens"])
                seq = task.sequence_length(length)
                batch_size = max(1, args.tokens_per_step // seq)
                row |= {"backend": built.backend, "tokens": seq, "batch_size": batch_size}
                try:
                    if time.time() > args.deadline:
                        raise TimeoutError
                    seconds, step = [], 0
                    while not timed_enough(seconds):
                        batch = draws.to_device(task.sample(batch_size, length, generator), device)
                        positions = torch.arange(seq, device=device)[None]  # [1, T]
                        sync(device)
                        start = time.perf_counter()
                        begin_step(compile_mode, device)
                        train_one(batch, positions)
                        sync(device)
                        if step >= WARMUP_STEPS:
                            seconds.append(time.perf_counter() - start)
                        step += 1
                    median = statistics.median(seconds)
                    row |= {"status": "ok", "tokens_per_s": batch_size * seq / median, "timed_steps": len(seconds)}
                    if median > SLOW_STEP_S:
                        too_slow = f"not measured: a step took {median:.1f} s at {seq} tokens"
                except Exception as err:  # a compile failure, memory: recorded
                    row |= {"status": failure(err)}
                print(RESULT_MARK + json.dumps(row), flush=True)
            del model, optimizer, forward, built, train_one
            if device.type == "cuda":
                torch.cuda.empty_cache()


def timed_enough(seconds: list[float]) -> bool:
    """TIMED_STEPS timed steps, or as many as fill TIMED_SECONDS (at most MOST_STEPS); one of a slow step."""
    if seconds and seconds[0] > SLOW_STEP_S:
        return True
    return len(seconds) >= TIMED_STEPS and (sum(seconds) >= TIMED_SECONDS or len(seconds) >= MOST_STEPS)


def failure(err: Exception) -> str:
    if isinstance(err, TimeoutError):
        return "not measured: budget"
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"failed: {type(err).__name__}: {message}"[:300]


# ---------------------------------------------------------------- parent: the three parts

def encoding_plan(names: list[str], backends: list[str] | None = None) -> list[tuple[str, list[int], str]]:
    """(encoding, token counts, backends) in measuring order: nope, then `names` as given. Every encoding on
    auto's choice; those with a bias or a decay, the crossover's candidates, on each backend besides (of
    `backends` only, when given)."""
    from posbench.encodings import REGISTRY

    order = [BASELINE, *names]
    candidates = [b for b in BACKENDS if b in backends] if backends else [b for b in BACKENDS if b != FLA]
    plan = []
    for name in dict.fromkeys(order):
        cls = REGISTRY[name]
        hooks = set(cls.hooks) - {"embed"}
        crossover = bool(hooks & {"bias", "decay"})
        runnable = [b for b in candidates
                    if (not fla_missing_hooks(cls) if b == FLA else hooks <= backend_hooks(b))]
        if not crossover:  # one backend of its own besides auto's: fla's kernel for its attention (stick-breaking,
            # PaTH)
            runnable = [b for b in runnable if b == FLA and cls.fla_kernel]
        plan.append((name, list(TOKENS) + ([LONG_TOKENS] if crossover or name == BASELINE else []),
                     ",".join(["auto", *runnable])))
    return plan


def measure_encodings(args, deadline: float, path: Path) -> list[dict]:
    """Every mode in turn (eager first: a budget cut short leaves whole modes), every encoding in it; the file
    is written again after each encoding, so a call stopped from outside keeps what it measured."""
    from posbench.encodings import REGISTRY

    known = [name for name, cls in REGISTRY.items() if cls.position_dims == 1]
    # named: in the caller's order (a short call's most wanted first); all: the targets first
    names = args.encodings.split(",") if args.encodings else [*TARGETS, *(n for n in known if n not in TARGETS)]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"--encodings: unknown {unknown}; choose from {sorted(known)}")
    rows = []
    for mode in args.modes:
        for name, tokens, backends in encoding_plan(names, args.backends.split(",") if args.backends else None):
            tokens = [t for t in tokens if not args.tokens or t in args.tokens]
            command = [sys.executable, str(Path(__file__).resolve()), "--child", "--encoding", name,
                       "--backends", backends, "--modes", mode, "--tokens", ",".join(map(str, tokens)),
                       "--device", args.device, "--deadline", str(deadline), "--threads", str(args.threads),
                       "--tokens-per-step", str(args.tokens_per_step)]
            if time.time() >= deadline:  # no process started only to find the budget spent
                stdout, why = "", "not measured: budget"
            else:
                # a child checks the deadline between lengths; one stuck in a step (a compile) is stopped at the
                # deadline or after CHILD_S, so that it cannot take the next encodings' time
                limit = max(5.0, min(deadline - time.time(), args.child_s))
                try:
                    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=limit)
                    stdout, why = done.stdout, f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"[:300]
                except subprocess.TimeoutExpired as late:
                    stdout, why = late.stdout or "", f"not measured: its process stopped after {limit:.0f} s"
                    stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
            found = [json.loads(line[len(RESULT_MARK):]) for line in stdout.splitlines()
                     if line.startswith(RESULT_MARK)]
            planned = [(backend, t) for backend in backends.split(",") for t in tokens]  # the child's order
            found += [{"encoding": name, "backend": backend, "mode": mode, "tokens": t, "auto": backend == "auto",
                       "status": why} for backend, t in planned[len(found):]]
            rows += found
            add_ratios(rows)
            write_csv(path, ENCODING_FIELDS, rows)
            ok = sum(r["status"] == "ok" for r in found)
            print(f"encodings ({mode}): {name}: {ok} of {len(found)} measured "
                  f"({deadline - time.time():.0f} s of budget left)", file=sys.stderr, flush=True)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """vs_nope: tokens/s over nope's at the same tokens and mode (nope on its auto backend)."""
    base = {(r["mode"], r["tokens"]): r["tokens_per_s"] for r in rows
            if r["encoding"] == BASELINE and r["auto"] and r["status"] == "ok"}
    for row in rows:
        reference = base.get((row["mode"], row["tokens"]))
        row["vs_nope"] = row["tokens_per_s"] / reference if row["status"] == "ok" and reference else None


def measure_default_job(args, out_device: str, deadline: float, env: dict) -> list[dict]:
    """The README's default job on this device, timed whole, in each --job-modes mode (train.compile)."""
    rows = []
    for mode in args.job_modes:
        if time.time() >= deadline:
            rows.append({"device": out_device, "compile": mode, "status": "not measured: budget"})
            continue
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            command = [sys.executable, "-m", "posbench", "encoding=rope", "task=copy", f"device={args.device}",
                       f"train.compile={str(MODES[mode]).lower()}", f"hydra.run.dir={folder}", *args.job_overrides]
            try:
                done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env,
                                      timeout=max(10.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                rows.append({"device": out_device, "compile": mode, "status": "not measured: budget"})
                continue
            wall = time.perf_counter() - start
            if done.returncode:
                rows.append({"device": out_device, "compile": mode,
                             "status": f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"[:300]})
                continue
            results = [json.loads(line) for line in (Path(folder) / "results.jsonl").read_text().splitlines()]
        at_n = next(r for r in results if r["ratio"] == 1)
        rows.append({"device": out_device, "wall_s": round(wall, 1), "train_s": at_n["train_seconds"],
                     "exact_match_at_n": at_n["exact_match"], "data_fingerprint": at_n["data_fingerprint"],
                     "compile": mode, "train_steps_per_s": round(at_n["train_steps"] / at_n["train_seconds"], 1),
                     "train_tokens_per_s": at_n["train_tokens_per_s"], "status": "ok"})
    return rows


def measure_sweep(args, deadline: float, env: dict) -> list[dict]:
    """The frontier study's copy runs of seed 0 through the sweep launcher: its wall time, extrapolated. A sweep
    the budget cuts short is stopped (its whole process group) and its finished runs counted, said in `note`.
    `train_steps` counts every run's steps, finished or under way (each run's status.json, written every
    train.log_every steps), so a window too short for a run to finish still measures the device's rate."""
    concurrent = next((line.split("=", 1)[1] for line in args.sweep_launcher if "n_jobs=" in line), "launcher default")
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        command = [sys.executable, "-m", "posbench", "-m", "experiment=frontier", "seed=0", "frontier_task=copy",
                   f"device={args.device}", f"hydra.sweep.dir={folder}", *args.sweep_launcher, *args.sweep_overrides]
        sweep = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env, start_new_session=True)
        try:
            _, stderr = sweep.communicate(timeout=max(30.0, deadline - time.time()))
            cut = False
        except subprocess.TimeoutExpired:
            os.killpg(sweep.pid, signal.SIGKILL)
            _, stderr = sweep.communicate()
            cut = True
        wall_min = (time.perf_counter() - start) / 60
        if sweep.returncode and not cut:
            raise RuntimeError(f"the sweep failed: {stderr[-2000:]}")
        statuses = [json.loads(path.read_text()) for path in Path(folder).rglob("status.json")]
    runs = sum(status.get("state") == "ok" for status in statuses)
    steps = sum(int(status.get("step") or 0) for status in statuses)
    return [sweep_row(runs, steps, wall_min, cut, concurrent)]


def sweep_row(runs: int, steps: int, wall_min: float, cut: bool, concurrent) -> dict:
    """sweep.csv's row of a sweep that finished `runs` runs and made `steps` training steps in all in wall_min
    minutes (`cut`: stopped by the budget), the study extrapolated from the runs, or from the steps where none
    finished."""
    steps_per_s = steps / (60 * wall_min)
    how = (f"cut by the budget at {wall_min:.1f} min with {runs} runs finished (the others were under way)" if cut
           else f"measured: seed 0's {runs} copy runs")
    if runs:
        study_min = STUDY_RUNS * wall_min / runs if cut else wall_min * STUDY_COPY_PARTS
        how += (f"; the study's {STUDY_RUNS} runs extrapolated " +
                ("at this rate, roughly (copy runs are the study's cheapest; runs under way not counted)" if cut else
                 f"by the CPU's per-task cost against copy (x{STUDY_COPY_PARTS:.1f})"))
    elif steps:  # no run finished: the copy part's training steps at the rate of every run's steps, then as above
        copy_steps = STUDY_RUNS // STUDY_RUN_SETS * study_steps()
        study_min = copy_steps / steps_per_s / 60 * STUDY_COPY_PARTS
        how += (f"; the study's {STUDY_RUNS} runs extrapolated from the {steps} training steps made at once "
                f"({copy_steps} a copy part, x{STUDY_COPY_PARTS:.1f} by the CPU's per-task cost): start-up and "
                "evaluation not counted, a lower bound")
    else:
        study_min = None
    return {"runs": runs, "wall_min": round(wall_min, 3), "runs_per_hour": round(60 * runs / wall_min, 1),
            "concurrent": concurrent, "train_steps": steps, "train_steps_per_s": round(steps_per_s, 1),
            "extrapolated_study_min": None if study_min is None else round(study_min, 1), "note": how}


def study_steps() -> int:
    """train.steps of every run of the frontier study."""
    from omegaconf import OmegaConf

    return int(OmegaConf.load(ROOT / "configs" / "experiment" / "frontier.yaml").train.steps)


def run_env(folder: Path) -> dict:
    """The runs' environment: wandb off, and auto by the crossover table this call measured, where it did."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    if (folder / "encodings.csv").exists():
        env["POSBENCH_CROSSOVER"] = str(folder / "encodings.csv")
    return env


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def write_csv(path: Path, fields: list[str], rows: list[dict]) -> None:
    """The rows, written whole and then renamed into place: a call stopped mid-write leaves the last file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    with part.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(part, path)



def parent(args: argparse.Namespace) -> None:
    import torch

    from posbench.attention.crossover import DEVICE_FILE
    from posbench.build import resolve_device

    began = time.time()
    deadline = began + args.budget_s
    device = resolve_device(args.device)
    folder = Path(args.out) / device_slug(device_name(device))
    if device.type == "cuda":  # what the crossover table was measured on (devices of its capability read it)
        major, minor = torch.cuda.get_device_capability(device)
        write_csv(folder / DEVICE_FILE, ["name", "capability"], [{"name": device_name(device),
                                                                  "capability": f"{major}.{minor}"}])
    weights = {"encodings": 0.5, "default_job": 0.2, "sweep": 0.3}  # the budget's split among the parts asked for
    total = sum(weights[part] for part in args.parts)
    for part in args.parts:
        part_deadline = min(deadline, time.time() + weights[part] / total * args.budget_s)
        if part == "encodings":
            measure_encodings(args, part_deadline, folder / "encodings.csv")
        elif part == "default_job":
            write_csv(folder / "default_job.csv", DEFAULT_JOB_FIELDS,
                      measure_default_job(args, device_name(device), part_deadline, run_env(folder)))
        else:  # one row per concurrency: a later call at another one adds its row
            path = folder / "sweep.csv"
            rows = measure_sweep(args, part_deadline, run_env(folder))
            kept = [r for r in read_csv(path) if r["concurrent"] != str(rows[0]["concurrent"])]
            write_csv(path, SWEEP_FIELDS, kept + rows)
    print(f"done in {time.time() - began:.0f} s: {folder}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="encodings,default_job,sweep")
    parser.add_argument("--budget-s", type=float, default=460.0, help="seconds for all parts together")
    parser.add_argument("--encodings", default="", help="comma-separated; default: every 1-D encoding")
    parser.add_argument("--tokens", default="", help="a subset of 32,256,1024,4096,8192")
    parser.add_argument("--modes", default="eager,capture,graphs", help=f"of {','.join(MODES)} (train.compile)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child-s", type=float, default=120.0, help="at most this long for one encoding's process")
    parser.add_argument("--tokens-per-step", type=int, default=TOKENS_PER_STEP, help="a batch's tokens, about")
    parser.add_argument("--out", default=str(ROOT / "results" / "gpu"))
    parser.add_argument("--sweep-launcher", nargs="*", default=["hydra/launcher=gpus", "hydra.launcher.n_jobs=13"],
                        help="the sweep's launcher overrides (default: the GPU-filling launcher, all 13 runs at once)")
    parser.add_argument("--job-overrides", nargs="*", default=[], help="overrides added to the default job")
    parser.add_argument("--job-modes", default="eager,capture,graphs", help="the default job in these modes (train.compile)")
    parser.add_argument("--sweep-overrides", nargs="*", default=[], help="overrides added to the sweep")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--encoding", help=argparse.SUPPRESS)
    parser.add_argument("--backends", help=f"a bias's or decay's backends besides auto's choice, of "
                        f"{','.join(BACKENDS)} (default: all but fla, an optional extra; each where it runs the "
                        "encoding's hooks)")
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    args.parts = [p for p in args.parts.split(",") if p]
    bad = sorted(set(args.parts) - {"encodings", "default_job", "sweep"})
    if bad:
        raise SystemExit(f"--parts: unknown {bad}; choose from ['default_job', 'encodings', 'sweep']")
    unknown_backends = sorted(set(args.backends.split(",")) - set(BACKENDS)) if args.backends else []
    if unknown_backends:
        raise SystemExit(f"--backends: unknown {unknown_backends}; choose from {list(BACKENDS)}")
    args.modes = [m for m in args.modes.split(",") if m]
    args.tokens = [int(t) for t in args.tokens.split(",") if t] if args.tokens else []
    args.job_modes = [m for m in args.job_modes.split(",") if m]
    if set(args.modes + args.job_modes) - set(MODES):
        raise SystemExit(f"--modes, --job-modes: choose from {list(MODES)}")
    parent(args)


if __name__ == "__main__":
    main()
