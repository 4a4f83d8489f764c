"""What `python -m posbench` shows and leaves behind besides the run's own files."""
from tests.helpers import posbench


def test_run_writes_no_empty_log_file(tmp_path):
    """Hydra's default job logging left an empty <run dir>/__main__.log; the job logs to the console only."""
    result = posbench("debug=smoke", "train.steps=2", "logger=none", f"hydra.run.dir={tmp_path}")
    assert (tmp_path / "results.jsonl").exists() and "eval tok/s" in result.stdout
    assert not list(tmp_path.rglob("*.log"))


def test_help_names_the_program():
    help_text = posbench("--help").stdout  # posbench's own page (configs/hydra/help/posbench.yaml), not Hydra's
    assert help_text.startswith("posbench: ")
    assert "__main__" not in help_text


def test_a_refused_setting_is_one_line_and_the_traceback_is_there_on_request(tmp_path):
    """A setting refused before training prints its message alone, exit status 1; HYDRA_FULL_ERROR=1 shows
    where it was raised."""
    bad = ("encoding=rope", "encoding.start_positions=4", "debug=smoke")
    result = posbench(*bad, f"hydra.run.dir={tmp_path / 'plain'}", check=False, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("refused: rope: encoding.start_positions=4 has no effect with scaling=none; set "
                                     "encoding.scaling=longrope or drop the start positions (0)")
    full = posbench(*bad, f"hydra.run.dir={tmp_path / 'full'}", check=False, timeout=120, env={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode == 1 and "Traceback" in full.stderr and "posbench/encodings/rope.py" in full.stderr
