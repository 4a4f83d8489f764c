"""Experiment loggers. The results files are the source of truth; a logger mirrors them."""
from __future__ import annotations

import math
import os
from pathlib import Path

from posbench.checks import Choice
from posbench.headline import HEADLINE_METRICS, primary_metric, run_headline
from posbench.settings import LOGGERS, WANDB_MODES

# The keys WandbLogger writes, declared once for the logger and the dashboard (posbench.dashboard),
# so a renamed metric cannot leave a panel reading a key no run logs.
TRAIN_STEP = "train/step"  # x-axis of the training metrics
EVAL_LENGTH = "eval/length"  # x-axis of the evaluation metrics
EVAL_KEYS = ("ratio", *HEADLINE_METRICS, "eval_tokens_per_s", "peak_mem_mb")  # logged per length when measured
STATUS = "status"  # summary: ok, diverged, ...
TRAIN_TOKENS_PER_S = "train/tokens_per_s"  # summary: training throughput (RunInfo.train_tokens_per_s)


def train_key(name: str) -> str:
    return f"train/{name}"


def eval_key(name: str) -> str:
    return f"eval/{name}"


def headline_key(name: str) -> str:
    """Summary key of a posbench.headline.Headline field."""
    return f"headline/{name}"


class NullLogger:
    def log_train(self, step: int, metrics: dict) -> None:
        pass

    def log_eval(self, row: dict) -> None:
        pass

    def finish(self, rows: list[dict], curve_png: Path | None, status: str) -> None:
        pass


def wandb_mode(requested: str | None) -> str:
    """The mode to run wandb in: the config's, else WANDB_MODE, else online only with credentials."""
    mode = requested or os.environ.get("WANDB_MODE")
    if mode:  # the environment's may be one of wandb's older names too
        return Choice((*WANDB_MODES, "dryrun", "run"))("logger.mode" if requested else "WANDB_MODE", mode)
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").exists()
    if not has_key:
        print("wandb: no API key found; logging offline (sync later with `wandb sync`)")
    return "online" if has_key else "offline"


class WandbLogger:
    """Runs share a group (a sweep's runs: the sweep; a single run: <encoding>-<task>), are
    tagged with encoding, task, position scheme and N, and carry flat config keys and, at the
    end, the headline metrics (posbench.headline) as summary keys, so the runs table sorts
    and filters by them. Evaluation metrics use eval/length as their x-axis."""

    def __init__(self, config: dict, run_name: str, group: str, tags: list[str], run_dir: Path,
                 project: str = "posbench", entity: str | None = None, mode: str | None = None,
                 dir: str | None = None, run_id: str | None = None):
        import wandb

        self.wandb = wandb
        # a resumed posbench run continues its wandb run (same id)
        self.run = wandb.init(project=project, entity=entity, mode=wandb_mode(mode), name=run_name,
                              group=group, tags=tags, job_type=config.get("task"), config=config,
                              dir=str(dir or run_dir), reinit="finish_previous", id=run_id, resume="allow")
        self.run.define_metric(TRAIN_STEP)
        self.run.define_metric(train_key("*"), step_metric=TRAIN_STEP)
        self.run.define_metric(EVAL_LENGTH)
        self.run.define_metric(eval_key("*"), step_metric=EVAL_LENGTH)

    def log_train(self, step: int, metrics: dict) -> None:
        self.run.log({TRAIN_STEP: step, **{train_key(k): v for k, v in metrics.items()}})

    def log_eval(self, row: dict) -> None:
        self.run.log({EVAL_LENGTH: row["eval_length"],
                      **{eval_key(k): row[k] for k in EVAL_KEYS if row.get(k) is not None}})

    def finish(self, rows: list[dict], curve_png: Path | None, status: str) -> None:
        columns = ["eval_length", *[k for k in EVAL_KEYS if any(r.get(k) is not None for r in rows)]]
        table = self.wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
        metric = primary_metric(rows)
        payload = {eval_key("curve"): table,
                   eval_key("curve_plot"): self.wandb.plot.line(table, "ratio", metric,
                                                                title=f"{metric} vs eval/train length")}
        if curve_png is not None:
            payload[eval_key("curve_png")] = self.wandb.Image(str(curve_png))
        self.run.log(payload)
        self.run.summary.update(headline_summary(rows))
        if rows and rows[0].get("train_tokens_per_s") is not None:  # the config's is logged before training
            self.run.summary[TRAIN_TOKENS_PER_S] = rows[0]["train_tokens_per_s"]
        self.run.summary[STATUS] = status
        self.run.finish(exit_code=0 if status == "ok" else 1)


def headline_summary(rows: list[dict]) -> dict:
    """The run's headline metrics as flat summary keys headline/<name> (NaN as None)."""
    head = run_headline(rows).as_dict()
    head["missing_lengths"] = ",".join(map(str, head["missing_lengths"]))
    return {headline_key(k): None if isinstance(v, float) and math.isnan(v) else v for k, v in head.items()}


def sweep_group() -> str | None:
    """In a --multirun, the name its runs share: <experiment>-<sweep dir name>, or the
    sweep dir name without an experiment; None outside a Hydra multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hydra_cfg = HydraConfig.get()
    return sweep_group_name(hydra_cfg.runtime.choices.get("experiment"), hydra_cfg.sweep.dir)


def sweep_group_name(experiment: str | None, sweep_dir: str | Path) -> str:
    """<experiment>-<sweep dir name>, or the sweep dir name without an experiment."""
    sweep = Path(sweep_dir).name
    return f"{experiment}-{sweep}" if experiment not in (None, "null") else sweep


def run_group(configured: str | None, sweep: str | None, encoding: str, task: str) -> str:
    """A run's wandb group: logger.group if set, else its sweep's (in a --multirun), else <encoding>-<task>."""
    return configured or sweep or f"{encoding}-{task}"


def run_tags(config: dict, extra=()) -> list[str]:
    """A run's wandb tags from its flat config (RunInfo.flat_config): encoding, task, positions=<scheme>,
    N=<train length>, then the extra ones (logger.tags)."""
    return [config["encoding"], config["task"], f"positions={config['positions']}", f"N={config['train_length']}",
            *extra]


def build_logger(cfg, config: dict, run_name: str, run_dir: Path, run_id: str | None = None):
    if Choice(LOGGERS)("logger.name", cfg.name) == "none":
        return NullLogger()
    group = run_group(cfg.group, sweep_group(), config["encoding"], config["task"])
    return WandbLogger(config, run_name, group, run_tags(config, cfg.tags), run_dir, project=cfg.project,
                       entity=cfg.entity, mode=cfg.mode, dir=cfg.dir, run_id=run_id)
