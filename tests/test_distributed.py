"""Data parallelism (posbench.distributed): real `torchrun --nproc_per_node=2 -m posbench` runs on CPU
(gloo). Their rows equal one process's at the same global batch; a run stopped on one rank and killed
on another resumes to the uninterrupted rows; a refused command is refused by every rank at once,
whichever rank finds the fault. Each torchrun costs seconds of start-up (three interpreters importing
torch), so the file starts eight in all, the uninterrupted run once per session for every xdist worker."""
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from posbench import distributed, runner
from tasks.wikitext import WindowBatch
from tests.helpers import KILLER, ROOT, compose_cfg, read_rows

pytestmark = pytest.mark.slow  # torchrun processes, stopped and resumed: python -m pytest -m slow

OVERRIDES = ["debug=smoke", "device=cpu", "train.checkpoint_every=8", "train.log_every=3"]  # gloo, GPU or not
MEASURED = ("status", "eval_length", "exact_match", "token_acc", "train_steps", "config_hash", "seed", "samples",
            "data_fingerprint")


def torchrun(run_dir: Path, *overrides: str, kill: tuple | None = None, timeout: int = 240):
    """`torchrun --standalone --nproc_per_node=2 -m posbench` (or KILLER with kill = (phase, rank, at,
    signal name)) -> (the completed process, each rank's stderr, seconds taken)."""
    logs = Path(tempfile.mkdtemp(dir=run_dir.parent, prefix=f"{run_dir.name}-logs-"))  # this command's only
    target = ["-m", "posbench"]
    if kill:
        script = run_dir.parent / "killer.py"
        script.write_text(KILLER)
        phase, rank, at, name = kill
        target = [str(script), phase, str(at), name, str(rank)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               f"--log-dir={logs}", "--redirects=3", *target, f"hydra.run.dir={run_dir}", *overrides]
    began = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "WANDB_MODE": "disabled"})
    seconds = time.monotonic() - began
    stderr = {int(path.parent.name): path.read_text() for path in sorted(logs.rglob("stderr.log"))}
    return result, stderr, seconds


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def measured(rows: list[dict]) -> list[tuple]:
    return [tuple(row[key] for key in MEASURED) for row in rows]


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory) -> Path:
    """The uninterrupted two-process run, made once per session: xdist's workers share it (the first
    runs it holding a lock, another waits for it) rather than each paying for its own."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's, above the workers' own
    run_dir = shared / "ddp-uninterrupted"
    with open(shared / "ddp-uninterrupted.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not run_dir.exists():
            result, stderr, _ = torchrun(run_dir, *OVERRIDES)
            assert result.returncode == 0, "\n".join(stderr.values())[-3000:]
    assert status(run_dir)["state"] == "ok"
    return run_dir


def test_two_processes_give_the_rows_of_one_at_the_same_global_batch(uninterrupted, tmp_path):
    one = runner.run(compose_cfg(*OVERRIDES), tmp_path / "one")
    two = read_rows(uninterrupted)
    assert [r["world_size"] for r in one] == [1, 1] and [r["world_size"] for r in two] == [2, 2]
    assert measured(two) == measured(one)  # exact match and token accuracy equal, the config hash too
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert two[0]["train_steps"] == 20 and all(r["status"] == "ok" for r in two)
    # rank 0 alone wrote the directory: the files of a one-process run (this one ran outside Hydra: no .hydra/)
    files = sorted(p.name for p in uninterrupted.iterdir())
    assert files == sorted([".hydra", *(p.name for p in (tmp_path / "one").iterdir())])


def test_a_run_stopped_on_one_rank_and_killed_on_another_resumes_to_the_uninterrupted_rows(uninterrupted,
                                                                                          tmp_path):
    run_dir = tmp_path / "run"
    # SIGTERM reaches rank 1 alone, in its 6th step; the ranks' vote on it arrives a step later (StopVote):
    # both stop after step 7, and rank 0 saves it
    result, _, _ = torchrun(run_dir, *OVERRIDES, kill=("train", 1, 6, "SIGTERM"))
    assert result.returncode != 0
    record = status(run_dir)
    assert record["state"] == "killed" and record["signal"] == "SIGTERM", record
    assert record["step"] == record["checkpoint_step"] == 7, record
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["progress"]["step"] == 7
    # resumed, then SIGKILL on rank 0 while it evaluates the second length: the first length's row stays
    result, _, _ = torchrun(run_dir, *OVERRIDES, kill=("evaluate", 0, 2, "SIGKILL"))
    assert result.returncode != 0
    assert [row["eval_length"] for row in read_rows(run_dir)] == [16]
    assert status(run_dir)["resumed"] == 1
    # resumed again (taking over the lock of the killed rank 0): the uninterrupted rows, loss included
    result, stderr, _ = torchrun(run_dir, *OVERRIDES)
    assert result.returncode == 0, "\n".join(stderr.values())[-3000:]
    rows, expected = read_rows(run_dir), read_rows(uninterrupted)
    assert measured(rows) == measured(expected)
    assert [r["loss"] for r in rows] == [r["loss"] for r in expected]
    assert status(run_dir)["state"] == "ok" and status(run_dir)["resumed"] == 2


def test_a_sigterm_to_one_rank_in_evaluation_stops_both_and_the_resumed_run_gives_the_uninterrupted_rows(
        uninterrupted, tmp_path):
    run_dir = tmp_path / "run"
    # SIGTERM reaches rank 1 alone, as it starts the second length: the ranks' vote stops both within it
    result, stderr, seconds = torchrun(run_dir, *OVERRIDES, kill=("evaluate", 1, 2, "SIGTERM"))
    assert result.returncode != 0
    record = status(run_dir)
    assert record["state"] == "killed" and record["signal"] == "SIGTERM", record
    assert [row["eval_length"] for row in read_rows(run_dir)] == [16]  # the first length's row is kept
    result, stderr, _ = torchrun(run_dir, *OVERRIDES)
    assert result.returncode == 0, "\n".join(stderr.values())[-3000:]
    assert measured(read_rows(run_dir)) == measured(read_rows(uninterrupted))
    assert status(run_dir)["state"] == "ok" and status(run_dir)["resumed"] == 1


@pytest.mark.parametrize("case", ["every rank", "rank 0"])
def test_a_refused_command_is_refused_by_every_rank_promptly(case, tmp_path):
    run_dir = tmp_path / "run"
    if case == "every rank":  # a setting each rank checks itself
        overrides, words = [*OVERRIDES, "train.batch_size=15"], "train.batch_size=15 is the global batch"
    else:  # a directory holding another run: only rank 0 claims it, the others learn of it
        run_dir.mkdir()
        (run_dir / "results.jsonl").write_text("")
        overrides, words = OVERRIDES, "one directory holds one run"
    result, stderr, seconds = torchrun(run_dir, *overrides, timeout=120)
    assert result.returncode != 0
    assert sorted(stderr) == [0, 1]
    for rank, text in stderr.items():
        assert words in text, f"rank {rank}:\n{text[-2000:]}"
    assert seconds < 90  # start-up only: no rank waited on a collective
    if case == "every rank":  # a fresh directory: rank 0 records the refusal there, and nothing else
        assert sorted(p.name for p in run_dir.iterdir()) == ["status.json"]
        assert words in status(run_dir)["error"]
    else:  # the other run's directory is left as it was
        assert sorted(p.name for p in run_dir.iterdir()) == ["results.jsonl"]


def test_more_processes_than_gpus_is_refused_before_nccl_starts(monkeypatch):
    """NCCL refuses two processes on one GPU only after its own time-out: each rank says so at once."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"started 2 processes on this machine, which has 1 GPU\(s\).*"
                                         r"--nproc_per_node=1, or device=cpu"):
        distributed.start("auto")
    assert not torch.distributed.is_initialized()


def test_one_process_is_world_size_one_and_every_helper_leaves_the_run_as_it_was():
    assert distributed.size() == 1 and distributed.is_main()
    batch = object()
    assert distributed.shard(batch) is batch
    total, count = torch.tensor(3.0), torch.tensor(7)
    assert torch.equal(distributed.global_mean(total, count), total / count)
    sums = {"loss_sum": total, "tokens": count}
    assert distributed.all_sum(sums) is sums
    distributed.check_batch_size(15)
    assert distributed.from_main(lambda: 5) == distributed.agreed(lambda: 5) == 5
    with pytest.raises(KeyError):
        distributed.agreed(lambda: {}["missing"])


@pytest.mark.parametrize("rows, rank_rows", [(5, [3, 2]), (1, [1, 0])])
def test_a_rank_keeps_its_rows_of_every_batch_field(monkeypatch, rows, rank_rows):
    """Every tensor laid out by row is split (a subclass's own fields too), the rest kept; one row (a
    recurrent segment) is rank 0's alone."""
    batch = WindowBatch(inputs=torch.arange(rows * 4).view(rows, 4), targets=torch.zeros(rows, 4, dtype=torch.long),
                        loss_mask=torch.ones(rows, 4, dtype=torch.bool), protocol="sliding",
                        stream_index=torch.arange(rows * 4).view(rows, 4), byte_counts=None)
    monkeypatch.setattr(distributed, "size", lambda: 2)
    shards = []
    for rank in (0, 1):
        monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
        shards.append(distributed.shard(batch))
    assert [len(shard.inputs) for shard in shards] == rank_rows
    for name in ("inputs", "targets", "loss_mask", "stream_index"):
        assert torch.equal(torch.cat([getattr(shard, name) for shard in shards]), getattr(batch, name))
    assert all(type(shard) is WindowBatch and shard.protocol == "sliding" for shard in shards)


def test_ranks_after_the_first_draw_dropout_from_streams_of_their_own_per_step(monkeypatch):
    def draws(rank: int, step: int) -> torch.Tensor:
        monkeypatch.setattr(distributed, "rank", lambda: rank)
        torch.manual_seed(0)
        distributed.seed_rank_stream(seed=0, step=step)
        return torch.rand(4)

    with torch.random.fork_rng():  # the other tests' global stream stays as it was
        torch.manual_seed(0)
        one_process = torch.rand(4)
        assert torch.equal(draws(0, 3), one_process)  # rank 0 keeps the one-process stream
        assert torch.equal(draws(1, 3), draws(1, 3))  # a step draws the same however the run got there (resumed)
        assert not torch.equal(draws(1, 3), one_process) and not torch.equal(draws(1, 3), draws(1, 4))
        assert not torch.equal(draws(1, 3), draws(2, 3))


def test_every_rank_runs_in_rank_0s_directory_and_drops_the_empty_one_hydra_named_a_second_later(monkeypatch,
                                                                                                 tmp_path):
    main_dir, late_dir = tmp_path / "12-00-00_rope-copy", tmp_path / "12-00-01_rope-copy"
    late_dir.mkdir()  # Hydra makes its output directory before the run starts
    monkeypatch.setattr(distributed, "broadcast", lambda value: str(main_dir))
    assert runner.shared_run_dir(late_dir) == main_dir
    assert not late_dir.exists()
