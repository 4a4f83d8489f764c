"""python -m posbench.figures: the per-run figures, not tracked in git, drawn again from a committed
reference run's rows alone."""
import shutil

from posbench.figures import main
from tests.helpers import ROOT

REFERENCE = ROOT / "results" / "reference"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def copied_run(pattern: str, to):
    """One committed reference run directory, copied without its figures."""
    source = sorted(REFERENCE.glob(pattern))[0]
    run_dir = to / source.parent.name / source.name
    shutil.copytree(source, run_dir, ignore=shutil.ignore_patterns("*.png"))
    return run_dir


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, path


def test_redraws_the_curve_and_the_tasks_figure_from_the_rows(tmp_path, capsys):
    run_dir = copied_run("report_sweep/*seed=0,task=associative_recall", tmp_path)
    assert not list(run_dir.glob("*.png"))
    assert main([str(tmp_path)]) == 0  # a sweep directory: every run directory under it
    assert_png(run_dir / "curve.png")
    assert_png(run_dir / "depth.png")  # the retrieval task's own figure, from its config.yaml
    assert "wrote 2 figures in 1 run directories" in capsys.readouterr().out


def test_a_task_that_cannot_be_built_still_gets_its_curve(tmp_path, capsys):
    run_dir = copied_run("lm_memory/*", tmp_path)
    config = run_dir / "config.yaml"
    config.write_text("\n".join(f"  data_dir: {tmp_path / 'absent'}" if line.startswith("  data_dir:") else line
                                for line in config.read_text().splitlines()))
    assert main([str(run_dir / "results.jsonl")]) == 0
    assert_png(run_dir / "curve.png")
    assert not (run_dir / "loss_by_position.png").exists()
    assert "the task's figures skipped" in capsys.readouterr().err
