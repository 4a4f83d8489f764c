"""Every failure ends `failed` with its error, never `running` (which the report would read as
killed): a full disk in training and in evaluation, a curve.png that cannot be written, a bad
logger.mode, a wandb that cannot start. Rows already measured stay, and the same command resumes.
A refused command leaves an existing run's files byte for byte; an untrained evaluation says so."""
import errno
import os
import tempfile

import PIL.Image
import pytest

from posbench import rundir, runner, training
from posbench.rundir import LOCK_FILE, describe, read_status
from tests.helpers import compose_cfg, posbench, read_rows

TINY = ("debug=smoke", "train.steps=12", "eval.samples=8", "eval.batch_size=8")
NO_SPACE = "No space left on device"


def tiny(*overrides: str):
    return compose_cfg(*TINY, *overrides)


def snapshot(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


class FullDisk:
    """rundir's tempfile module, with no room for a new file once `full` is set."""

    def __init__(self):
        self.full = False

    def mkstemp(self, *args, **kwargs):
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return tempfile.mkstemp(*args, **kwargs)


# where the run looks each one up: training.train calls train_step, runner.run_built calls evaluate
LOOKED_UP_IN = {"train_step": training, "evaluate": runner}


def fill_disk_at(monkeypatch, name: str, call: int) -> FullDisk:
    """The disk fills at the call-th call of <name> (train_step or evaluate)."""
    module = LOOKED_UP_IN[name]
    disk, original, calls = FullDisk(), getattr(module, name), []
    monkeypatch.setattr(rundir, "tempfile", disk)

    def filling(*args, **kwargs):
        calls.append(1)
        disk.full = disk.full or len(calls) == call
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, filling)
    return disk


def test_a_full_disk_in_evaluation_fails_keeps_the_measured_row_and_resumes(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    disk = fill_disk_at(monkeypatch, "evaluate", 2)  # length 16 written; the row of 32 finds the disk full
    with pytest.raises(OSError, match=NO_SPACE):
        runner.run(tiny(), run_dir)
    status = read_status(run_dir)  # recorded in place: no room for a new file
    assert status["state"] == "failed" and NO_SPACE in status["error"] and status["length"] == 32
    assert describe(status).startswith(f"failed at evaluating length 32: OSError: [Errno {errno.ENOSPC}]")
    assert not (run_dir / LOCK_FILE).exists()  # released on failure
    measured = read_rows(run_dir)
    assert [(r["eval_length"], r["status"]) for r in measured] == [(16, "ok")]
    disk.full = False  # space freed: the same command evaluates what is missing
    rows = runner.run(tiny(), run_dir)
    assert [(r["eval_length"], r["status"]) for r in rows] == [(16, "ok"), (32, "ok")]
    assert rows[0] == measured[0] and read_status(run_dir)["state"] == "ok"


def test_a_full_disk_in_training_fails_with_the_error_and_resumes(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    disk = fill_disk_at(monkeypatch, "train_step", 7)  # the checkpoint after step 8 finds the disk full
    with pytest.raises(OSError, match=NO_SPACE):
        runner.run(tiny("train.checkpoint_every=4"), run_dir)
    status = read_status(run_dir)
    assert status["state"] == "failed" and status["error"] == f"OSError: [Errno {errno.ENOSPC}] {NO_SPACE}"
    assert status["phase"] == "train" and status["checkpoint_step"] == 4
    assert "could not write the failed rows" in capsys.readouterr().err
    assert not (run_dir / "results.jsonl").exists()
    disk.full = False
    assert [r["status"] for r in runner.run(tiny("train.checkpoint_every=4"), run_dir)] == ["ok", "ok"]
    assert read_status(run_dir)["state"] == "ok"


def test_a_curve_that_cannot_be_written_fails_the_run_and_the_rows_stay(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    save = PIL.Image.Image.save

    def refused(self, path, *args, **kwargs):  # the PNG's write to its file (posbench.results.save_png)
        if not isinstance(path, (str, os.PathLike)):
            return save(self, path, *args, **kwargs)  # matplotlib's own rendering into memory
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(PIL.Image.Image, "save", refused)
    with pytest.raises(OSError, match=NO_SPACE):
        runner.run(tiny(), run_dir)
    status = read_status(run_dir)
    assert status["state"] == "failed" and status["phase"] == "figures" and "curve.png" in status["error"]
    assert describe(status).startswith("failed at figures: OSError: ")
    measured = read_rows(run_dir)
    assert [r["status"] for r in measured] == ["ok", "ok"]
    monkeypatch.setattr(PIL.Image.Image, "save", save)
    assert runner.run(tiny(), run_dir) == measured  # nothing measured again: only the figures
    assert read_status(run_dir)["state"] == "ok" and (run_dir / "curve.png").exists()


def test_a_bad_logger_mode_fails_the_run_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="logger.mode='loud'"):
        runner.run(tiny("logger=wandb", "logger.mode=loud"), run_dir)
    status = read_status(run_dir)
    assert status["state"] == "failed" and "logger.mode='loud'" in status["error"]


def test_a_wandb_that_cannot_start_fails_the_run_with_its_error(tmp_path, monkeypatch):
    import wandb

    def unreachable(*args, **kwargs):
        raise wandb.errors.CommError("api.wandb.ai is unreachable (injected)")

    monkeypatch.setattr(wandb, "init", unreachable)
    run_dir = tmp_path / "run"
    with pytest.raises(wandb.errors.CommError):
        runner.run(tiny("logger=wandb", "logger.mode=offline"), run_dir)
    status = read_status(run_dir)
    assert status["state"] == "failed" and status["error"] == "CommError: api.wandb.ai is unreachable (injected)"
    assert describe(status).startswith("failed at build: CommError")


def test_a_refused_command_leaves_the_runs_files_byte_for_byte(tmp_path):
    """Hydra's .hydra/ included: the runner writes it once a command is accepted."""
    posbench(f"hydra.run.dir={tmp_path}", "debug=smoke", "train.steps=4")
    before = snapshot(tmp_path)
    assert {".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "results.jsonl"} <= set(before)
    refused = posbench(f"hydra.run.dir={tmp_path}", "debug=smoke", "train.steps=4", "train.lr=0.03", check=False)
    assert refused.returncode != 0 and "one directory holds one run" in refused.stderr
    assert snapshot(tmp_path) == before


def test_a_resume_refused_by_its_settings_leaves_the_runs_files_byte_for_byte(tmp_path, monkeypatch):
    original = training.train_step

    def failing(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(training, "train_step", failing)
    with pytest.raises(RuntimeError):
        runner.run(tiny(), tmp_path)
    monkeypatch.setattr(training, "train_step", original)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="threads=0"):  # the same run (threads cannot change a result)
        runner.run(tiny("threads=0"), tmp_path)
    assert snapshot(tmp_path) == before


def test_an_untrained_evaluation_warns_and_its_rows_say_so(tmp_path, capsys):
    rows = runner.run(tiny("train.steps=0"), tmp_path / "untrained")
    out, err = capsys.readouterr()
    assert "warning: train.steps=0 without train.init_from evaluates a freshly initialised model" in err
    assert "status ok (untrained: train.steps=0 without train.init_from)" in out
    assert [r["untrained"] for r in rows] == [True, True]
    assert [r["untrained"] for r in runner.run(tiny(), tmp_path / "trained")] == [False, False]
    evaluated = runner.run(tiny("train.steps=0", f"train.init_from={tmp_path / 'trained'}"), tmp_path / "evaluated")
    assert [r["untrained"] for r in evaluated] == [False, False] and "warning" not in capsys.readouterr().err


def test_the_closing_table_names_its_run_and_comes_in_one_write(tmp_path, capsys, monkeypatch):
    writes = []
    monkeypatch.setattr("builtins.print", lambda *args, **kwargs: writes.append(" ".join(map(str, args))))
    runner.run(tiny(), tmp_path)
    table = writes[-1].splitlines()
    assert table[1].startswith(f"rope-copy-N16-s0 ({tmp_path}): status ok; 12 training steps in ")
    assert table[2].split() == ["length", "ratio", "exact_match", "token_acc", "loss", "eval", "tok/s"]
    assert [line.split()[0] for line in table[4:]] == ["16", "32"]
