"""Where a whole sweep stands: the jobs its multirun.yaml asks for against the run directories
that finished, and how long the rest takes at the pace so far (`python -m posbench.report
SWEEP --progress`)."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from posbench.results import Skipped, read_yaml
from posbench.rundir import FINAL_STATES

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SWEEP_FILE = "multirun.yaml"  # Hydra writes it to the sweep directory
SLOT_DIR = ".gpu_slots"  # hydra/launcher=gpus: a lock file per job slot (posbench.gpu_slots)


def job_count(multirun: dict) -> int:
    """How many jobs the sweep launches: Hydra's basic sweeper over the config's sweeper params and
    the command line's overrides (globs expanded against posbench's config groups)."""
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra_node = multirun.get("hydra") or {}
    params = (hydra_node.get("sweeper") or {}).get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += (hydra_node.get("overrides") or {}).get("task") or []
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        (jobs,) = BasicSweeper.split_arguments(parser.parse_overrides(arguments), None)
    return len(jobs)


def seconds(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))


def duration_text(value: float) -> str:
    minutes = round(value / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{max(minutes, 1)} min"


def read_multirun(sweep: Path) -> tuple[dict | None, Skipped | None]:
    """The sweep directory's multirun.yaml (None when it has none), or None and why it cannot be used:
    unreadable, not UTF-8, not YAML, not a mapping, or a hydra: section that is not one."""
    file = Path(sweep) / SWEEP_FILE
    try:
        multirun, where, reason = read_yaml(file)
    except (FileNotFoundError, IsADirectoryError):
        return None, None
    if reason is None:
        multirun = multirun or {}
        hydra = multirun.get("hydra") if isinstance(multirun, dict) else None
        if isinstance(multirun, dict) and (hydra is None or isinstance(hydra, dict)):
            return multirun, None
        where, reason = None, ("not a mapping of settings" if not isinstance(multirun, dict)
                               else f"hydra: is a {type(hydra).__name__}, not a mapping of settings")
    return None, Skipped(file, where, reason, whole_file=True)


def sweep_progress(sweep: Path, statuses: list[dict], read: tuple | None = None) -> str | None:
    """One line for a sweep directory (None without its multirun.yaml): jobs finished, running and
    not started of the total, and the time left: the median run of those that finished in one go
    (status.json's started..updated), times the jobs not finished, over the launcher's n_jobs.
    `read`: read_multirun(sweep) where the caller has it. A multirun.yaml that cannot be used is
    skipped: the line counts what finished and names the file (the caller lists it as skipped input)."""
    multirun, problem = read if read is not None else read_multirun(sweep)
    finished = [s for s in statuses if s.get("state") in FINAL_STATES]
    running = sum(s.get("state") == "running" for s in statuses)
    if problem is not None:
        return (f"sweep {sweep}: {len(finished)} jobs finished, {running} running; the total is not known "
                f"(skipped {problem})")
    if multirun is None:
        return None
    try:
        total = job_count(multirun)
    except Exception as err:  # overrides Hydra's parser refuses
        total, reason = 0, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    else:  # a glob over a group that posbench's configs/ lack (the user's --config-dir) expands to nothing
        reason = "a glob over config groups posbench's configs/ lack"
    if not total:
        return f"sweep {sweep}: {len(finished)} jobs finished, {running} running; the total is not known ({reason})"
    try:
        parallel = max(1, int(((multirun.get("hydra") or {}).get("launcher") or {}).get("n_jobs") or 1))
    except (AttributeError, TypeError, ValueError):  # ${posbench.gpu_jobs:...}: its slots, or another layout
        parallel = max(1, len(list((sweep / SLOT_DIR).glob("slot-*.lock"))))
    line = (f"sweep {sweep}: {len(finished)} of {total} jobs finished, {running} running, "
            f"{max(0, total - len(statuses))} not started")
    whole = [seconds(s["updated"]) - seconds(s["started"]) for s in finished
             if not s.get("resumed") and s.get("started") and s.get("updated")]
    if whole and total > len(finished):
        median = statistics.median(whole)
        left = median * (total - len(finished)) / parallel
        line += (f"; median run {duration_text(median)}: about {duration_text(left)} left at {parallel} "
                 f"job{'s' if parallel > 1 else ''} at a time")
    return line
