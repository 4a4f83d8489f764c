"""Headline metrics of an extrapolation curve, one definition for the report and the loggers.

For one run, from its rows (one per evaluated length), with N its training length and kN
its longest evaluated length:

- in-distribution score: the metric at length N (ratio 1);
- OOD score: the mean of the metric over the evaluated lengths in (N, kN];
- extrapolation length: the largest evaluated length L such that the criterion holds at
  *every* evaluated length up to L (not merely the largest length where it holds), and
  L / N. For higher-is-better metrics (exact match, token accuracy) the criterion is
  metric >= threshold (default 0.9) and is checked from the shortest evaluated length, so
  L can fall below N, and is 0 when the shortest length already fails. For lower-is-better
  metrics (perplexity, bits per byte, loss) it is metric <= 1.1 x its value at N, checked
  from N upwards: shorter contexts score worse for lack of context, not of generalisation.

A length that should have been evaluated but was not (a crashed, diverged or partial run)
is left out of the means, marks the run incomplete, and ends the extrapolation chain there:
L is then a lower bound, or NaN when nothing held before the gap (a diverged run).
Over seeds, every score is summarised as mean, sample std (NaN for one seed), min, max and n.

A group whose accuracy at N is below LEARNED_AT_N did not learn its task: the report shows its
scores but does not rank it (`learned`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from posbench.checks import Choice
from posbench.metrics import HEADLINE_METRICS, HIGHER_IS_BETTER, LOWER_IS_BETTER, PRIMARY_METRICS  # noqa: F401

DEFAULT_THRESHOLD = 0.9
RELATIVE_TOLERANCE = 0.10  # lower-is-better metrics: within 10% of the value at N
# The metrics and their directions are declared once, in posbench.metrics; a task's headline is the
# first of PRIMARY_METRICS it measures.
# An accuracy at N (exact match, token accuracy) below this means the task was not learned: the
# score past N then measures under-fitting, not extrapolation, and the report does not rank it.
# 0.9 is the default extrapolation criterion (DEFAULT_THRESHOLD): a group below it fails the
# criterion at its own training length. Kept apart from --threshold, which only sets how far the
# criterion must hold; a ranking should not change with it.
LEARNED_AT_N = 0.9
LEARNED_SLACK = 1e-9  # a mean over seeds of scores at the bar may round below it
SCORES = ("id_score", "ood_score", "extrapolation_length", "extrapolation_ratio")


def lower_is_better(metric: str) -> bool:
    return Choice(HEADLINE_METRICS)("metric", metric) in LOWER_IS_BETTER


def learned(metric: str, id_score: float) -> bool | None:
    """Whether a score at N shows the task learned: an accuracy >= LEARNED_AT_N (NaN, not measured
    at N, is not). None for lower-is-better metrics: perplexity has no bar that holds across tasks."""
    if lower_is_better(metric):
        return None
    return not math.isnan(id_score) and id_score >= LEARNED_AT_N - LEARNED_SLACK


def value(row: dict, metric: str) -> float | None:
    """The row's measured value of metric, or None (not measured, not ok, or NaN)."""
    if row.get("status") != "ok":
        return None
    v = row.get(metric)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return float(v)


def primary_metric(rows: list[dict]) -> str:
    """The metric a task is judged by: exact match where measured, else perplexity, ..."""
    for metric in PRIMARY_METRICS:
        if any(value(r, metric) is not None for r in rows):
            return metric
    return PRIMARY_METRICS[0]


def criterion(metric: str, threshold: float = DEFAULT_THRESHOLD) -> str:
    if lower_is_better(metric):
        return f"{metric} <= {1 + RELATIVE_TOLERANCE:g} x its value at N, at every length from N to L"
    return f"{metric} >= {threshold:g} at every evaluated length up to L"


@dataclass
class Headline:
    metric: str
    train_length: int
    id_score: float  # NaN: N not measured
    ood_score: float  # NaN: no length past N measured
    extrapolation_length: float  # 0: the first length fails; NaN: undecidable (unmeasured before any pass)
    extrapolation_ratio: float
    complete: bool  # every expected length was measured
    missing_lengths: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def run_headline(rows: list[dict], metric: str | None = None, threshold: float = DEFAULT_THRESHOLD,
                 expected_lengths=None) -> Headline:
    """Headline metrics of one run's rows. expected_lengths: the grid the run should have
    covered (default: the lengths it has rows for); lengths absent or unmeasured are flagged."""
    if not rows:
        raise ValueError("run_headline needs at least one row")
    metric = metric or primary_metric(rows)
    lower = lower_is_better(metric)
    train_length = int(rows[0]["train_length"])
    measured = {int(r["eval_length"]): v for r in rows if (v := value(r, metric)) is not None}
    lengths = sorted({int(n) for n in (expected_lengths if expected_lengths is not None
                                       else [r["eval_length"] for r in rows])} | set(measured))
    missing = [n for n in lengths if n not in measured]
    id_score = measured.get(train_length, math.nan)
    past_n = [measured[n] for n in lengths if n > train_length and n in measured]
    ood_score = sum(past_n) / len(past_n) if past_n else math.nan

    if lower:  # relative to the value at N (NaN when N is unmeasured: undecidable)
        chain, limit = [n for n in lengths if n >= train_length], (1 + RELATIVE_TOLERANCE) * id_score
        holds = lambda v: v <= limit  # noqa: E731
    else:
        chain = lengths
        holds = lambda v: v >= threshold  # noqa: E731
    extrapolation = math.nan if lower and math.isnan(id_score) else 0.0
    if not math.isnan(extrapolation):
        for n in chain:
            if n not in measured:  # a gap: L is a lower bound, or unknown if nothing held before it
                extrapolation = extrapolation or math.nan
                break
            if not holds(measured[n]):
                break
            extrapolation = float(n)
    return Headline(metric, train_length, id_score, ood_score, extrapolation, extrapolation / train_length,
                    complete=not missing, missing_lengths=missing)


def spread(values) -> dict:
    """mean, sample std (ddof 1; NaN for fewer than two), min, max and n of the non-NaN values."""
    present = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(present)
    if not n:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    mean = sum(present) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in present) / (n - 1)) if n > 1 else math.nan
    return {"mean": mean, "std": std, "min": min(present), "max": max(present), "n": n}
