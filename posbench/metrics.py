"""Every metric a task measures, declared once: its row (and logged) key, its label and its direction.

Tasks declare which of these they measure (`tasks.base.Task.metrics`: the synthetic tasks ACCURACY,
WikiText LANGUAGE_MODEL); the headline metrics and their directions (posbench.headline), the figures'
labels (posbench.results.METRIC_LABELS), the row keys every row carries, the loggers' keys (through
posbench.headline) and the run's closing table derive from this table. No torch here: the report reads it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str  # the row's and the logger's key (eval/<name>): never renamed
    label: str  # axis and table label
    higher_is_better: bool


# WikiText's evaluation protocols -> the prefix of their metrics (tasks.wikitext.PROTOCOLS) and the label's note
PROTOCOL_PREFIXES = {"": "", "sliding_": " (sliding window)", "recurrent_": " (segment recurrence)"}


def _language_model(prefix: str, note: str) -> tuple[Metric, ...]:
    return (Metric(f"{prefix}token_acc", f"token accuracy{note}", True),
            Metric(f"{prefix}loss", f"loss{note}", False),
            Metric(f"{prefix}perplexity", f"perplexity{note}", False),
            Metric(f"{prefix}bits_per_byte", f"bits per byte{note}", False))


# In this order: the headline tuples below keep the order the report and its --metric choices always had.
METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("exact_match", "exact-match accuracy", True),
    *[m for prefix, note in PROTOCOL_PREFIXES.items() for m in _language_model(prefix, note)],
)}

# What the tasks measure (their `metrics`): every synthetic task, and a language model on a corpus.
ACCURACY = ("exact_match", "token_acc", "loss")
LANGUAGE_MODEL = tuple(m.name for prefix, note in PROTOCOL_PREFIXES.items() for m in _language_model(prefix, note))
ROW_METRICS = ACCURACY  # every row carries these keys (None where a task does not measure one, or a length failed)

HIGHER_IS_BETTER = tuple(name for name, m in METRICS.items() if m.higher_is_better)
LOWER_IS_BETTER = tuple(name for name, m in METRICS.items() if not m.higher_is_better)
HEADLINE_METRICS = (*HIGHER_IS_BETTER, *LOWER_IS_BETTER)
PRIMARY_METRICS = ("exact_match", "perplexity", "token_acc", "loss")  # a task's headline: the first it measures
LABELS = {name: m.label for name, m in METRICS.items()}
TABLE_METRICS = ("exact_match", "token_acc", "loss", "perplexity", "sliding_perplexity", "recurrent_perplexity",
                 "bits_per_byte")  # a run's closing table, in this order, those measured
