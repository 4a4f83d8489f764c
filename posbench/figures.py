"""`python -m posbench.figures DIR [DIR ...]`: draws again the figures of every run directory (one
holding results.jsonl) under the given run or sweep directories, from its committed rows alone: the
run's curve.png and its task's own figures (e.g. loss_by_position.png), as the runner draws them when
a run ends. The reference studies' per-run figures are not tracked in git; this command redraws them.

The task is built from the run's config.yaml to draw its figures; where it cannot be built (its data
not on this machine, say), the task's figures are skipped with a warning and curve.png is still drawn.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from posbench.results import find_run_files, plot_run, read_rows


def run_task(run_dir: Path):
    """The run's task, built from its config.yaml as the runner builds it (posbench.build)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    return instantiate(OmegaConf.load(run_dir / "config.yaml").task, _partial_=True)()


def redraw(run_dir: Path) -> list[Path]:
    """Draws the run's curve.png and its task's figures from its results.jsonl; returns the files written."""
    rows = read_rows(run_dir / "results.jsonl")
    if not rows:
        print(f"{run_dir}: no rows, no figures", file=sys.stderr)
        return []
    curve = run_dir / "curve.png"
    plot_run(rows, curve)
    try:
        task = run_task(run_dir)
    except Exception as err:  # noqa: BLE001 (any failure to build the task only costs its figures)
        print(f"{run_dir}: the task's figures skipped; its task could not be built: {err}", file=sys.stderr)
        return [curve]
    return [curve, *task.write_figures(rows, run_dir)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posbench.figures", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run or sweep directories (or results.jsonl files)")
    args = parser.parse_args(argv)
    row_files, _ = find_run_files(args.paths)
    written = [path for file in row_files for path in redraw(file.parent)]
    print(f"wrote {len(written)} figures in {len(row_files)} run directories")
    return 0


if __name__ == "__main__":
    sys.exit(main())
