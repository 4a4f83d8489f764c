"""The command line: one run end to end. Build (task, encoding, model) from a config, train at N,
evaluate length by length.

Each evaluated length becomes one result row, written to the run directory at once; the
run's status.json says where it stands, and the same command pointed at the same directory
resumes an unfinished run (posbench.rundir: the lock, status, atomic files, checkpoints, signals).
The library it runs lies in posbench.build (the run built from its config), posbench.training
(train at N), posbench.evaluation (one length) and posbench.rundir (the run directory).
"""
from __future__ import annotations

import inspect
import signal
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm.auto import tqdm

from posbench import distributed, settings
from posbench.build import Built, build_checked, git_commit, resolve_device
from posbench.checks import shown
from posbench.evaluation import UNMEASURED, evaluate
from posbench.guard import translate_oom
from posbench.memory import live_objects_frozen
from posbench.loggers import NullLogger, build_logger
from posbench.metrics import TABLE_METRICS
from posbench.results import ROW_FILE, RowWriter, plot_run
from posbench.rundir import (
    CHECKPOINT_FILE,
    FINAL_STATES,
    LOCK_FILE,
    RunBusy,
    RunLock,
    Status,
    StopRequest,
    StopSignals,
    atomic_write,
    describe,
    foreign_entries,
    load_checkpoint,
    read_status,
)
from posbench.runinfo import RunInfo, config_hash, group_config
from posbench.training import Checkpointer, TrainProgress, bar_interval, train
from posbench.validate import check_config

HYDRA_SUBDIR = ".hydra"  # where the runner writes Hydra's record of an accepted command


class Refused(ValueError):
    """A command refused before training: a bad setting, or a directory that is not this run's; the
    refusal's own message. The command line prints it as one line (posbench.__main__); HYDRA_FULL_ERROR=1
    raises the original error, with its traceback."""

    def __init__(self, original: ValueError):
        super().__init__(str(original))
        self.original = original


def error_text(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


def run_identity(resolved: dict) -> str:
    """The hash that tells this run from another in the same directory: its group, seed and init_from."""
    return config_hash({**group_config(resolved), "seed": resolved.get("seed"),
                        "init_from": resolved.get("train", {}).get("init_from")})


def claim(run_dir: Path, identity: str, resume_setting) -> dict | None:
    """One run per directory. -> the status record of this run to continue, or None to start afresh.
    Refuses a directory that holds another run's rows or checkpoint."""
    status = read_status(run_dir)
    holds = [name for name in (ROW_FILE, CHECKPOINT_FILE) if (run_dir / name).exists()]
    if status is not None and status.get("identity") == identity:
        if resume_setting is False:
            raise ValueError(f"{run_dir} holds this run already ({describe(status)}); train.resume=false refuses "
                             "to continue it: choose another hydra.run.dir, or train.resume=auto to continue it")
        return status
    if status is None:  # a run writes only into an empty directory or its own
        foreign = sorted(path.name for path in run_dir.iterdir() if path.name != LOCK_FILE)
        if foreign and not holds:
            shown_names = ", ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
            raise ValueError(f"hydra.run.dir={run_dir} holds files that are not a posbench run's ({shown_names}); "
                             "a run writes only into an empty directory or its own: choose another hydra.run.dir")
    if holds:
        owner = f"run {status.get('run_name')} (identity {status.get('identity')})" if status else "another run"
        raise ValueError(f"{run_dir} holds {', '.join(holds)} of {owner}, not of this configuration (identity "
                         f"{identity}); one directory holds one run: choose another hydra.run.dir, or repeat that "
                         "run's own settings to resume it")
    if resume_setting is True:
        raise ValueError(f"train.resume=true but {run_dir} holds no run to resume; give the run directory of the "
                         "run to continue (hydra.run.dir=...) with its settings, or train.resume=auto")
    return None


def run(cfg: DictConfig, run_dir: str | Path) -> list[dict]:
    """Train and evaluate one configuration; returns its rows, also in run_dir/results.jsonl.

    One process at a time per run directory (rundir.RunLock). The same command pointed at the
    same run directory continues an unfinished run: training from its last checkpoint,
    evaluation at the first length without a row. The command is checked and built before its
    directory is looked at, so a bad setting is named as such; a refused command (a bad setting, the
    directory busy or holding another run) leaves a directory holding a run as it was, and records the
    refusal in one that would have taken the run; any later error is recorded as `failed` with the error.

    Data-parallel (torchrun: posbench.distributed), rank 0 is that one process: it holds the lock,
    claims the directory and writes every file, while the other ranks train and evaluate beside it
    and write nothing there. A refusal on any rank is raised on every rank before training."""
    distributed.start(cfg.get("device"))
    run_dir = shared_run_dir(Path(run_dir))
    main = distributed.is_main()
    identity = None
    try:  # the command checked and built first: a bad setting is named, not taken for another run's config
        resolved = resolved_config(cfg)
        identity = run_identity(resolved)
        device, built = distributed.agreed(lambda: prepare(cfg))
    except Exception as err:
        if main:
            record_refusal(run_dir, identity, err)
        if isinstance(err, ValueError):
            raise Refused(err) from None
        raise
    locks: list[RunLock] = []  # rank 0's
    with ExitStack() as held:
        def claim_directory() -> tuple[dict | None, str]:
            check_entries(run_dir)
            lock = held.enter_context(RunLock(run_dir))
            locks.append(lock)
            if lock.stale:
                print(f"taking over {lock.path} from process {lock.stale.get('pid')} on {lock.stale.get('host')} "
                      f"(started {lock.stale.get('started')}): that process is gone")
            previous = claim(run_dir, identity, cfg.train.get("resume", "auto"))
            return previous, previous["run_id"] if previous else uuid.uuid4().hex[:12]

        try:
            previous, run_id = distributed.from_main(claim_directory)
        except ValueError as err:
            raise Refused(err) from None
        if previous is not None:
            if previous.get("state") in FINAL_STATES:
                if main:
                    print(f"{run_dir} holds this run, finished ({previous['state']}): nothing to do")
                return RowWriter(run_dir).rows
            if main:
                print(f"resuming the run in {run_dir}: {describe(previous)}")
        status = Status(run_dir, writes=main, run_id=run_id, identity=identity,
                        resumed=previous.get("resumed", 0) + 1 if previous else 0)
        built.guard.batch_sizes = distributed.smallest(built.guard.batch_sizes)  # one batching on every rank
        if main:
            for message in built.guard.messages:
                print(f"memory: {message}", file=sys.stderr)
            if built.untrained:
                print("warning: train.steps=0 without train.init_from evaluates a freshly initialised model; its "
                      "rows carry untrained=true", file=sys.stderr)

        def record_stop(signum: int) -> None:
            status.update(state="killed", signal=signal.Signals(signum).name)
            if main:
                print(f"\nstopped: {describe(status.record)}; the same command resumes it", flush=True)

        def stop_now(signum: int) -> None:  # inside an evaluation: the process ends once this returns
            record_stop(signum)
            for lock in locks:
                lock.__exit__(None, None, None)

        # data-parallel: no rank ends alone inside an evaluation (its peers would fail in a collective);
        # the ranks' vote at each batch stops them together
        stop = StopSignals(stop_now if distributed.size() == 1 else None)
        with stop.active():
            try:
                rows = run_built(cfg, built, device, run_dir, resolved, status, stop)
            except StopRequest as request:
                record_stop(request.signum)
            except Exception as err:  # a full disk, a figure, the logger: failed, with the error
                status.fail(error_text(err))
                raise
    signum = distributed.any_signal(stop.signum)  # data-parallel: every rank, once rank 0 let the directory go
    if signum is not None:  # stopped, or complete when it came after the last safe point: the signal
        stop.forward(signum)  # is handed on with the lock released (submitit may requeue the job at once)
    return rows


def resolved_config(cfg: DictConfig) -> dict:
    """The config with its interpolations resolved; a missing key or a failed interpolation is named."""
    settings.check_present(cfg)
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:
        raise ValueError(f"{err.full_key}: {err.msg}") from None


def check_entries(run_dir: Path) -> None:
    """The run directory is a directory, and posbench's own files in it are regular files."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"hydra.run.dir={run_dir} is a file, not a directory: choose another hydra.run.dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    odd = foreign_entries(run_dir)
    if odd:
        raise ValueError(f"{run_dir} holds {', '.join(odd)} but not as a regular file (a directory, a FIFO, "
                         "...), where posbench keeps its own files: remove it or choose another hydra.run.dir")


def record_refusal(run_dir: Path, identity: str | None, err: Exception) -> None:
    """A refused command's error as the status of a directory that would have taken its run (a sweep's
    point: the report lists it). A directory holding a run, this one's or another's, or in use by
    another process, stays as it was."""
    try:
        check_entries(run_dir)
        with RunLock(run_dir):
            if claim(run_dir, identity, "auto") is None:
                Status(run_dir, run_id=uuid.uuid4().hex[:12], identity=identity, resumed=0).fail(error_text(err))
    except (ValueError, OSError, RunBusy):  # not this command's directory to write: the refusal says it all
        pass


def shared_run_dir(run_dir: Path) -> Path:
    """Rank 0's run directory on every rank. Hydra names it by the time (${now:...}) in each process,
    and a rank may read the clock a second after rank 0: the empty directory Hydra made it goes."""
    chosen = Path(distributed.broadcast(str(run_dir)))
    if chosen != run_dir and run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()
    return chosen


def prepare(cfg: DictConfig) -> tuple[torch.device, Built]:
    """The process set up (threads, denormals) and the run built; writes nothing."""
    check_config(cfg)  # threads and device are applied before build: refuse bad ones first
    check_parameter_mappings(cfg)
    distributed.check_batch_size(cfg.train.batch_size)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    # CPU: probabilities below 1e-38 (logits ~90 under the row's top, as alibi's far keys) read as 0;
    # kept denormal, they slowed the fused attention backward 2x (alibi, fox) and weighed nothing
    torch.set_flush_denormal(True)
    device = distributed.local_device(resolve_device(cfg.device))
    return device, build_checked(cfg, device)


def check_parameter_mappings(cfg: DictConfig) -> None:
    """An encoding or task parameter that holds other parameters (base_params, part_params: named *_params or
    annotated as a dict) is a mapping or null; anything else is named here, not met as dict()'s own error."""
    for section in settings.PARAMETER_SECTIONS:
        node = cfg.get(section)
        if node is None or "_target_" not in node:
            continue
        for name, parameter in inspect.signature(get_object(node._target_)).parameters.items():
            value = node.get(name)
            if (name.endswith("_params") or "dict" in str(parameter.annotation)) and name in node \
                    and value is not None and not isinstance(value, DictConfig):
                raise ValueError(f"{section}.{name}={shown(value)}: must be a mapping of parameters (name: value), "
                                 f"e.g. {section}.{name}={{name: value}}, or null (the defaults)")


def write_hydra_record(cfg: DictConfig, run_dir: Path) -> None:
    """Hydra's record of the command (.hydra/config.yaml, hydra.yaml, overrides.yaml), in a Hydra job
    whose output directory this is. Hydra writes none itself (hydra.output_subdir: null): it would
    write them before the command is checked, so a refused command would rewrite an existing run's."""
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.instance().cfg  # {"hydra": ...}
    output_dir = OmegaConf.select(hydra_cfg, "hydra.runtime.output_dir", default=None)
    if output_dir is None or Path(output_dir).resolve() != run_dir.resolve():
        return
    folder = run_dir / HYDRA_SUBDIR
    folder.mkdir(exist_ok=True)
    atomic_write(folder / "config.yaml", OmegaConf.to_yaml(cfg))
    atomic_write(folder / "hydra.yaml", OmegaConf.to_yaml(hydra_cfg))
    atomic_write(folder / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))


def write_failed_rows(writer: RowWriter, rows: list[dict]) -> None:
    """Rows that say where the run failed; the status records the failure even where a full disk refuses them."""
    try:
        for row in rows:
            writer.write(row)
    except OSError as err:
        print(f"warning: could not write the failed rows to {writer.path}: {error_text(err)}", file=sys.stderr)


def run_built(cfg: DictConfig, built: Built, device: torch.device, run_dir: Path, resolved: dict, status: Status,
              stop: StopSignals) -> list[dict]:
    main = distributed.is_main()  # the one process that writes run_dir
    info = run_info(cfg, built, device, status.record["run_id"], resolved)
    writer = RowWriter(run_dir, keep=lambda row: row.get("run_id") == info.run_id and row.get("status") == "ok",
                       writes=main)
    status.update(config_hash=info.config_hash, run_name=info.run_name, steps=int(cfg.train.steps),
                  lengths=built.lengths, lengths_done=[r["eval_length"] for r in writer.rows])
    if main:
        write_hydra_record(cfg, run_dir)
        atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    checkpointer = Checkpointer(run_dir, resolved, built.init_steps)
    resumable = distributed.broadcast(checkpointer.path.exists())  # every rank loads what rank 0 resumes from
    saved = distributed.agreed(lambda: load_checkpoint(checkpointer.path, device)) if resumable else None
    if saved is not None and run_identity(saved["config"]) != status.record["identity"]:
        raise ValueError(f"{checkpointer.path} belongs to another run; remove it or choose another hydra.run.dir")
    logger = distributed.agreed(lambda: build_logger(cfg.logger, info.flat_config(resolved), info.run_name, run_dir,
                                                     info.run_id) if main else NullLogger())
    if main:
        print(f"{info.run_name}: {info.n_params:,} parameters on {device}"
              + (f" x {info.world_size} processes" if info.world_size > 1 else "")
              + f"; evaluating lengths {built.lengths}; writing {run_dir}")
        if built.backend_table is not None:
            print(f"backend=auto: {built.backend} for training, by the crossover measurements of {built.backend_table}"
                  + (f" (this device: {torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    try:
        if saved is not None and "optimizer" not in saved:  # training had ended: evaluate what is missing
            built.model.load_state_dict(saved["model"])
            trained = TrainProgress(**{"data_digest": None, **saved["progress"]})  # older checkpoints: unknown
        else:
            trained = train(built, cfg, device, logger, checkpointer, stop, status, saved)
            if trained.status == "ok" and trained.step:
                checkpointer.save(built.model, trained)  # the trained model, kept for the evaluation to resume
    except Exception as err:
        info.train_steps = status.record.get("step", 0)
        write_failed_rows(writer, [length_row(info, built, cfg, length) | failed_fields(err)
                                   for length in built.lengths])
        raise
    info.train_steps, info.train_seconds = trained.step, round(trained.seconds, 2)
    info.train_tokens_per_s = trained.tokens_per_s()
    done = {row["eval_length"]: row for row in distributed.broadcast(writer.rows)}  # rank 0's rows: its file's
    rows = []
    with live_objects_frozen():  # each length's memory measurement collects garbage: of the evaluation's alone
        for length in tqdm(built.lengths, desc="evaluate", dynamic_ncols=True, mininterval=bar_interval(),
                           disable=not main):
            if length in done:
                rows.append(done[length])
                continue
            status.update(phase="evaluate", length=length)
            row = length_row(info, built, cfg, length)
            if trained.status == "diverged":
                row |= {"status": "diverged", **UNMEASURED}
            else:
                try:
                    cfg_eval = built.guard.eval_config(cfg.eval, length)
                    # a stop inside drops this length's partial sums (the same command evaluates it again)
                    with translate_oom(length, int(cfg_eval.batch_size)), stop.interruptible():
                        row |= {"status": "ok", **evaluate(built, length, cfg_eval, device, cfg.train.precision, stop,
                                                             trained.data_digest,
                                                             built.guard.draw_batch(cfg.eval, length))}
                except Exception as err:
                    write_failed_rows(writer, [row | failed_fields(err)])
                    raise
            writer.write(row)
            logger.log_eval(row)
            rows.append(row)
            status.update(lengths_done=[r["eval_length"] for r in rows])
    status.update(phase="figures", length=None)
    if main:
        if not cfg.train.save_checkpoint:
            checkpointer.path.unlink(missing_ok=True)
        curve = run_dir / "curve.png"
        plot_run(rows, curve)
        built.task.write_figures(rows, run_dir)
        logger.finish(rows, curve, trained.status)
    status.update(state=trained.status, phase="done")
    if main:
        print(closing_table(info, run_dir, rows, trained), flush=True)
    return rows


def failed_fields(err: Exception) -> dict:
    return {"status": f"failed: {error_text(err)}"[:500], **UNMEASURED}


def run_info(cfg: DictConfig, built: Built, device: torch.device, run_id: str, resolved: dict) -> RunInfo:
    init = None
    if built.init_config is not None:  # grouped by what the checkpoint is, not where it lies
        init = {"config_hash": config_hash(group_config(built.init_config)), "seed": built.init_config.get("seed"),
                "steps": built.init_steps}
    config = group_config(resolved, init)
    if built.guard is not None and built.guard.draw_sizes:  # other sequences than eval.batch_size draws
        config = {**config, "eval": {**config["eval"], "drawn_batch_size": dict(sorted(built.guard.draw_sizes.items()))}}
    return RunInfo(
        run_id=run_id, config_hash=config_hash(config),
        run_name=cfg.run_name or f"{built.encoding.name}-{built.task.name}-N{built.train_length}-s{cfg.seed}",
        encoding=built.encoding.name, encoding_params=built.encoding.params(), task=built.task.name,
        task_params=built.task.params(), model=OmegaConf.to_container(cfg.model),
        n_params=sum(p.numel() for p in built.model.parameters()), backend=built.backend,
        backend_table=built.backend_table, seed=int(cfg.seed),
        train_length=built.train_length, train_sequence_length=built.task.sequence_length(built.train_length),
        train_lengths=cfg.train.lengths, positions=built.positions.scheme, max_position=built.positions.max_position,
        device=str(device), world_size=distributed.size(), torch=torch.__version__, git_commit=git_commit(),
        init_from=built.init_from, init_steps=built.init_steps, untrained=built.untrained, config=config)


def length_row(info: RunInfo, built: Built, cfg: DictConfig, length: int) -> dict:
    return {**info.row(), "eval_length": length, "eval_sequence_length": built.task.sequence_length(length),
            "ratio": length / built.train_length, "samples": int(cfg.eval.samples),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def closing_table(info: RunInfo, run_dir: Path, rows: list[dict], trained: TrainProgress) -> str:
    """The run's closing summary, headed by its name and directory: printed in one write, so the tables
    of parallel jobs (a joblib sweep) neither interleave nor lose their run."""
    speed = trained.tokens_per_s()
    lines = [f"\n{info.run_name} ({run_dir}): status {trained.status}"
             + (" (untrained: train.steps=0 without train.init_from)" if info.untrained else "")
             + f"; {trained.step} training steps in {trained.seconds:.0f} s"
             + (f"; train {speed:,.0f} tokens/s" if speed else "")]
    measured = [r for r in rows if r["status"] == "ok"]
    metrics = [m for m in TABLE_METRICS if measured and measured[0].get(m) is not None]
    header = f"{'length':>7} {'ratio':>6} " + " ".join(f"{m:>11}" for m in metrics) + f" {'eval tok/s':>11}"
    lines += [header, "-" * len(header)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['eval_length']:>7} {r['ratio']:>6.2f} {r['status']}")
            continue
        values = " ".join(f"{r[m]:>11.4f}" for m in metrics)
        lines.append(f"{r['eval_length']:>7} {r['ratio']:>6.2f} {values} {r['eval_tokens_per_s']:>11,.0f}")
    return "\n".join(lines)
