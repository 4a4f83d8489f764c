"""One process per run directory: real `python -m posbench` processes on one directory. A second
live process is refused before it writes anything, naming the first; the lock of a SIGKILLed
process is taken over by the command that resumes its run; the lock is gone once a run ends."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posbench import runner
from posbench.rundir import LOCK_FILE, RunBusy, RunLock, read_status
from tests.helpers import ROOT, compose_cfg, posbench
from tests.test_fault_injection import OVERRIDES, tiny_run

# The run, paused at its first training step until the test creates <ready file>.go.
PAUSED = """
import sys, time
from pathlib import Path
import posbench.training as training
ready = Path(sys.argv[1])
go = ready.with_suffix(".go")
step = training.train_step
def paused(*args, **kwargs):
    if not ready.exists():
        ready.touch()
        deadline = time.monotonic() + 600  # a guard against a hang, not a timing: a loaded machine starts slowly
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return step(*args, **kwargs)
training.train_step = paused  # where training.train looks it up
sys.argv = ["posbench", *sys.argv[2:]]
import runpy
runpy.run_module("posbench", run_name="__main__", alter_sys=True)
"""


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file under the run directory (.hydra/ and the lock included), by relative path."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_second_live_process_is_refused_naming_the_first_and_writes_nothing(tmp_path):
    run_dir, ready = tmp_path / "run", tmp_path / "ready"
    first = subprocess.Popen([sys.executable, "-c", PAUSED, str(ready), f"hydra.run.dir={run_dir}", *OVERRIDES],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "WANDB_MODE": "disabled"})
    try:
        wait_for(ready, first)
        lock = json.loads((run_dir / LOCK_FILE).read_text())
        assert lock["pid"] == first.pid and lock["host"] == socket.gethostname()
        before = snapshot(run_dir)
        assert {".hydra/overrides.yaml", "status.json", LOCK_FILE} <= set(before)
        # the same run (train.checkpoint_every cannot change a result): without the lock it would resume
        second = posbench(f"hydra.run.dir={run_dir}", *OVERRIDES, "train.checkpoint_every=5", check=False)
        assert second.returncode != 0
        assert (f"{run_dir} is in use by process {first.pid} on {socket.gethostname()}, started {lock['started']}"
                in second.stderr), second.stderr[-3000:]
        assert "RunBusy" in second.stderr and "resuming" not in second.stdout
        assert snapshot(run_dir) == before  # .hydra/ and the first process's lock and status included
    finally:
        ready.with_suffix(".go").touch()
        out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert f"rope-copy-N16-s0 ({run_dir}): status ok" in out
    assert read_status(run_dir)["state"] == "ok" and not (run_dir / LOCK_FILE).exists()
    assert "train.checkpoint_every=5" not in (run_dir / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.slow
def test_the_lock_of_a_killed_process_is_taken_over_by_the_resuming_command(tmp_path):
    run_dir = tmp_path / "run"
    killed = tiny_run(run_dir, ("train", 9, "SIGKILL"))
    assert killed.returncode == -9
    lock = json.loads((run_dir / LOCK_FILE).read_text())  # a SIGKILL cannot release it
    with pytest.raises(ProcessLookupError):
        os.kill(lock["pid"], 0)
    result = tiny_run(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"taking over {run_dir / LOCK_FILE} from process {lock['pid']} on {lock['host']} "
            f"(started {lock['started']}): that process is gone") in result.stdout
    assert "resuming the run in" in result.stdout
    record = read_status(run_dir)
    assert record["state"] == "ok" and record["resumed"] == 1 and record["pid"] != lock["pid"]
    assert not (run_dir / LOCK_FILE).exists()


TINY = ("debug=smoke", "train.steps=4", "eval.samples=8", "eval.batch_size=8")


def test_a_held_lock_refuses_a_run_in_the_same_process_and_is_removed_on_release(tmp_path):
    with RunLock(tmp_path) as held:
        record = json.loads(held.path.read_text())
        assert record["pid"] == os.getpid() and held.stale is None
        with pytest.raises(RunBusy, match=f"is in use by process {os.getpid()} on "):
            runner.run(compose_cfg(*TINY), tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]  # the refused run wrote nothing
    assert not list(tmp_path.iterdir())
    runner.run(compose_cfg(*TINY), tmp_path)  # released: the directory takes the run
    assert read_status(tmp_path)["state"] == "ok" and not (tmp_path / LOCK_FILE).exists()


def test_a_lock_naming_a_live_process_of_this_host_refuses_even_unheld(tmp_path):
    """Where flock does not exclude (a filesystem without locks), the record alone refuses."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"pid": sleeper.pid, "host": socket.gethostname(), "started": "2026-01-01T10:00:00"}
        (tmp_path / LOCK_FILE).write_text(json.dumps(record))
        with pytest.raises(RunBusy, match=f"in use by process {sleeper.pid} on .*, started 2026-01-01T10:00:00 "
                                          ".* That process does not hold the lock"):
            runner.run(compose_cfg(*TINY), tmp_path)
        assert json.loads((tmp_path / LOCK_FILE).read_text()) == record
    finally:
        sleeper.kill()
        sleeper.wait()
    runner.run(compose_cfg(*TINY), tmp_path)  # its process gone: taken over
    assert read_status(tmp_path)["state"] == "ok" and not (tmp_path / LOCK_FILE).exists()
