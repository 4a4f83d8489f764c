"""A paper's numbers beside posbench's: the `published` block of an experiment and its comparison.

An experiment that follows a paper's protocol states the numbers it should reproduce:

    published:
      source: Kazemnejad et al. (NeurIPS 2023), ...
      metric: exact_match        # a row metric (posbench.headline.HEADLINE_METRICS)
      lengths: [21, 40]          # the evaluation lengths averaged, both ends included
      results:
        - match: {task.variant: cmc}   # resolved-config keys (and `task`, the task's name) a run must have
          values: {nope: 0.305, t5: 0.420}   # per encoding name
        - match: {task.variant: rsc}
          metric: exact_match    # metric and lengths may be set per entry
          values: {nope: 0.986}

The block never changes a result (posbench.runinfo.NOT_RESULT_KEYS); the report computes, per group
of runs an entry matches, the mean over each run's evaluated lengths in the range of the metric,
then mean, std, min, max over the runs, and shows them beside the published value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from posbench.checks import Choice, Integer, Real, shown
from posbench.headline import HEADLINE_METRICS

KEY = "published"


@dataclass(frozen=True)
class Reference:
    """One entry: the published value of `metric` averaged over lengths lo..hi for each encoding,
    for the runs whose config has every `match` setting."""

    source: str
    metric: str
    lengths: tuple[int, int]
    match: dict
    values: dict[str, float]
    note: str = ""

    def applies(self, task: str, flat_config: dict) -> bool:
        return all(task == value if key == "task" else key in flat_config and flat_config[key] == value
                   for key, value in self.match.items())

    def setting(self) -> str:
        """The match as shown in a table: task=copy, task.variant=cmc."""
        return ", ".join(f"{key}={value}" for key, value in self.match.items()) or "every run"

    def span(self) -> str:
        lo, hi = self.lengths
        return str(lo) if lo == hi else f"{lo}–{hi}"


def _plain(node):
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def _text(key: str, value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key}={shown(value)}: must be a non-empty string")
    return value


_metric = Choice(HEADLINE_METRICS)  # a row metric


def _lengths(key: str, value) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{key}={shown(value)}: must be [first, last], the evaluation lengths averaged "
                         "(both included; [L, L] for one length)")
    lo, hi = (Integer(1)(f"{key}[{i}]", item) for i, item in enumerate(value))
    if lo > hi:
        raise ValueError(f"{key}={shown(value)}: the first length must not exceed the last")
    return lo, hi


def _mapping(key: str, value, what: str) -> dict:
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{key}={shown(value)}: must be a non-empty mapping of {what}")
    return value


def parse(block) -> list[Reference]:
    """The entries of a `published` block ([] for null); every malformed part refused with its key."""
    block = _plain(block)
    if block is None:
        return []
    block = _mapping(KEY, block, "source, metric, lengths and results")
    unknown = set(block) - {"source", "metric", "lengths", "results"}
    if unknown:
        raise ValueError(f"{KEY}: unknown keys {sorted(unknown)}; valid: source, metric, lengths, results")
    source = _text(f"{KEY}.source", block.get("source"))
    results = block.get("results")
    if not isinstance(results, list) or not results:
        raise ValueError(f"{KEY}.results={shown(results)}: must be a non-empty list of entries "
                         "(match, values; optionally metric, lengths, note)")
    references = []
    for i, entry in enumerate(results):
        where = f"{KEY}.results[{i}]"
        entry = _mapping(where, entry, "match, values, metric, lengths, note")
        unknown = set(entry) - {"match", "values", "metric", "lengths", "note"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; valid: match, values, metric, lengths, note")
        metric = entry.get("metric", block.get("metric"))
        lengths = entry.get("lengths", block.get("lengths"))
        if metric is None or lengths is None:
            raise ValueError(f"{where}: no metric or lengths; set them in the entry or for the whole block")
        values = _mapping(f"{where}.values", entry.get("values"), "encoding name -> published number")
        match = entry.get("match") or {}
        if not isinstance(match, dict):
            raise ValueError(f"{where}.match={shown(match)}: must be a mapping of config key -> value")
        references.append(Reference(
            source=source, metric=_metric(f"{where}.metric", metric), lengths=_lengths(f"{where}.lengths", lengths),
            match=match, note=_text(f"{where}.note", entry["note"]) if "note" in entry else "",
            values={str(name): Real()(f"{where}.values.{name}", v) for name, v in values.items()}))
    return references


def measured(rows: list[dict], reference: Reference) -> tuple[float, list[int]]:
    """A run's number for a reference: the mean of the metric over its ok rows at lengths in the
    range (nan when it has none), and those lengths."""
    lo, hi = reference.lengths
    used = sorted((int(r["eval_length"]), r[reference.metric]) for r in rows
                  if r["status"] == "ok" and lo <= r["eval_length"] <= hi
                  and r.get(reference.metric) is not None and not math.isnan(r[reference.metric]))
    if not used:
        return math.nan, []
    return sum(v for _, v in used) / len(used), [n for n, _ in used]
