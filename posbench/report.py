"""`python -m posbench.report DIR [DIR ...] [--out OUT]`: every row of runs/sweeps -> one table + figure."""
from __future__ import annotations

import argparse
from pathlib import Path

from posbench.results import METRICS, collect, plot_comparison


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m posbench.report", description=__doc__)
    parser.add_argument("paths", nargs="+", help="run or sweep directories (searched for results.jsonl)")
    parser.add_argument("--out", help="output directory (default: the first path)")
    parser.add_argument("--metric", default="exact_match", choices=METRICS, help="metric plotted")
    args = parser.parse_args(argv)
    frame = collect(args.paths)
    out = Path(args.out or args.paths[0])
    out.mkdir(parents=True, exist_ok=True)
    frame = frame.sort_values(["task", "encoding", "seed", "eval_length"])
    frame.to_csv(out / "results.csv", index=False)
    plot_comparison(frame, out / f"comparison_{args.metric}.png", args.metric)
    pivot = frame.pivot_table(index=["task", "encoding"], columns="eval_length", values=args.metric, aggfunc="mean")
    print(f"{args.metric} (mean over seeds) by evaluation length; {frame['source'].nunique()} runs\n")
    print(pivot.round(3).to_string())
    bad = frame[frame["status"] != "ok"]
    if len(bad):
        print("\nrows not measured:")
        print(bad[["source", "eval_length", "status"]].to_string(index=False))
    print(f"\nwrote {out / 'results.csv'} and {out / f'comparison_{args.metric}.png'}")
    return out


if __name__ == "__main__":
    main()
