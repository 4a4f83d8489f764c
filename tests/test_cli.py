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
