"""Fault injection: tiny runs killed with SIGKILL and SIGTERM at random steps, in training and
in evaluation, then resumed; the resumed rows equal an uninterrupted run's, and the report
lists the runs left killed and not resumed.

Each run is a real `python -m posbench` process. The kill is real too: a wrapper around
the runner's training step (or evaluation) sends the signal to its own process at the
drawn step (or length), so the point of the kill is exact and the test repeatable.
"""
import json
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import KILLER, posbench, read_rows

pytestmark = pytest.mark.slow  # whole processes, killed and resumed: python -m pytest -m slow

STEPS, CHECKPOINT_EVERY = 60, 16
OVERRIDES = ["debug=smoke", f"train.steps={STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}",
             "eval.ratios=[1,2,3]", "train.log_every=7"]
MEASURED = ("status", "eval_length", "exact_match", "token_acc", "loss", "train_steps", "config_hash", "seed",
            "data_fingerprint")


def tiny_run(run_dir: Path, kill: tuple[str, int, str] | None = None) -> subprocess.CompletedProcess:
    """The tiny run in run_dir, under KILLER when kill = (phase, at, signal name); the caller checks its exit code."""
    entry = ["-c", KILLER, *map(str, kill), "any"] if kill else None
    return posbench(f"hydra.run.dir={run_dir}", *OVERRIDES, entry=entry, check=False)


def measured(run_dir: Path) -> list[tuple]:
    return [tuple(row[key] for key in MEASURED) for row in read_rows(run_dir)]


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[tuple]:
    """An uninterrupted run's rows; the same command again finds it finished and does nothing."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = tiny_run(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = (run_dir / "results.jsonl").read_text()
    again = tiny_run(run_dir)
    assert again.returncode == 0 and "finished (ok): nothing to do" in again.stdout
    assert (run_dir / "results.jsonl").read_text() == rows
    return measured(run_dir)


DRAW = random.Random(20261123)
# (signal, phase, where): a training step in 2..STEPS-1 or an evaluated length 2..3 (1-based, so at
# least one length is measured before the kill). The training cases kill the same run twice: the first kill is
# a run killed once, whose resume is killed in turn.
CASES = [("SIGKILL", "evaluate", [DRAW.randrange(2, 4)]),
         ("SIGTERM", "evaluate", [DRAW.randrange(2, 4)]),
         ("SIGKILL", "train", sorted(DRAW.sample(range(2, STEPS), 2))),
         ("SIGTERM", "train", sorted(DRAW.sample(range(2, STEPS), 2)))]


def case_id(case) -> str:
    signal_name, phase, points = case
    return f"{signal_name}-{phase}-at-{'-'.join(map(str, points))}"


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Every case's run, killed at each of its points (resumed in between): case id -> (its run
    directory, a copy of that directory as the first kill left it)."""
    root = tmp_path_factory.mktemp("killed")
    runs = {}
    for case in CASES:
        signal_name, phase, points = case
        run_dir, copy = root / "runs" / case_id(case), root / "copies" / case_id(case)
        for kill_number, at in enumerate(points):
            result = tiny_run(run_dir, (phase, at, signal_name))
            expected_code = -signal.SIGKILL if signal_name == "SIGKILL" else 128 + signal.SIGTERM
            assert result.returncode == expected_code, result.stderr[-3000:]
            record = status(run_dir)
            assert (run_dir / "run.lock").exists() == (signal_name == "SIGKILL")  # released unless SIGKILLed
            if signal_name == "SIGTERM":  # answered: a checkpoint at the step it stopped, the status says so
                assert record["state"] == "killed" and record["signal"] == "SIGTERM", record
                assert "the same command resumes it" in result.stdout
                if phase == "train":
                    assert record["phase"] == "train" and record["checkpoint_step"] == record["step"]
            else:  # a SIGKILL cannot be answered: the record stays at its last update
                assert record["state"] == "running", record
            if kill_number == 0:
                shutil.copytree(run_dir, copy)
        runs[case_id(case)] = run_dir, copy
    return runs


@pytest.mark.parametrize("case", CASES, ids=list(map(case_id, CASES)))
def test_a_killed_run_resumes_to_the_uninterrupted_rows(uninterrupted, killed_runs, case):
    run_dir, _ = killed_runs[case_id(case)]
    result = tiny_run(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming the run in" in result.stdout
    assert measured(run_dir) == uninterrupted
    record = status(run_dir)
    assert record["state"] == "ok" and record["resumed"] == len(case[2])
    assert len({row["run_id"] for row in read_rows(run_dir)}) == 1  # one run, however many processes it took
    assert not (run_dir / "run.lock").exists()


def test_the_report_lists_the_killed_runs_that_were_not_resumed(killed_runs, tmp_path):
    from posbench.report import write_report

    copies = [copy for _, copy in killed_runs.values()]
    out = write_report([str(copies[0].parent)], tmp_path / "report")
    text = (out / "report.md").read_text()
    section = text.split("## Runs that did not finish every length")[1].split("## Files")[0]
    for run_dir in copies:
        line = next((line for line in section.splitlines() if str(run_dir) in line), None)
        assert line is not None, f"{run_dir} is not listed:\n{section}"
        if run_dir.name.startswith("SIGTERM"):
            assert "killed by SIGTERM at " in line
        else:
            assert "killed (process " in line and " gone) at " in line
        assert ("evaluating length" if "-evaluate-" in run_dir.name else "step ") in line


# python -c LONG_BATCH AT SIGNAL overrides...: posbench whose first evaluation batch at the AT-th length sends
# the process SIGNAL and then runs ten minutes, as one torch call at a long length does (Python runs its signal
# handlers only after such a call: a stop checked between batches would wait for it)
LONG_BATCH = """
import os, signal, sys, time
import posbench.model as model
import posbench.runner as runner
at, name = int(sys.argv[1]), sys.argv[2]
evaluate, forward, lengths = runner.evaluate, model.Transformer.forward, []
def counting(*args, **kwargs):
    lengths.append(1)
    return evaluate(*args, **kwargs)
def long_batch(self, *args, **kwargs):
    if not self.training and len(lengths) == at:
        lengths.append(1)  # once
        os.kill(os.getpid(), getattr(signal, name))
        time.sleep(600)
    return forward(self, *args, **kwargs)
runner.evaluate, model.Transformer.forward = counting, long_batch
sys.argv = ["posbench", *sys.argv[3:]]
import runpy
runpy.run_module("posbench", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("signal_name,at", [("SIGTERM", 2), ("SIGINT", 3), ("SIGUSR2", 2)])
def test_a_stop_inside_a_long_evaluation_batch_is_answered_at_once_and_resumes(uninterrupted, signal_name, at,
                                                                                tmp_path):
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = posbench(f"hydra.run.dir={run_dir}", *OVERRIDES, entry=["-c", LONG_BATCH, str(at), signal_name],
                      check=False, timeout=240)
    assert time.monotonic() - started < 120, "the stop waited for the batch"
    assert result.returncode == 128 + getattr(signal, signal_name), result.stderr[-3000:]
    record = status(run_dir)
    lengths = [row[1] for row in uninterrupted]
    assert record["state"] == "killed" and record["signal"] == signal_name, record
    assert record["phase"] == "evaluate" and record["length"] == lengths[at - 1], record
    assert f"stopped: killed by {signal_name} at evaluating length {lengths[at - 1]}; the same command resumes it" \
        in result.stdout
    assert measured(run_dir) == uninterrupted[:at - 1]  # the lengths measured before the stop stay
    assert not (run_dir / "run.lock").exists()
    resumed = tiny_run(run_dir)
    assert resumed.returncode == 0 and "resuming the run in" in resumed.stdout, resumed.stderr[-3000:]
    assert measured(run_dir) == uninterrupted and status(run_dir)["state"] == "ok"
