"""`python -m posbench.report DIR [DIR ...] [--out OUT]`: every row of runs/sweeps -> one table + figure."""
from __future__ import annotations

import argparse
from pathlib import Path

from posbench.results import METRIC_LABELS, collect, plot_comparison


def summarize(frame):
    """One row per (task, encoding): seeds, accuracy at N and at the longest length, cost."""
    ok = frame[frame["status"] == "ok"]
    at_n = ok[ok["ratio"] == 1.0].groupby(["task", "encoding"])["exact_match"].mean().rename("exact_at_N")
    longest = ok[ok["ratio"] == ok.groupby("task")["ratio"].transform("max")]
    at_k = longest.groupby(["task", "encoding"])["token_acc"].mean().rename("token_acc_at_kN")
    runs = frame.drop_duplicates("run_id").groupby(["task", "encoding"])
    cost = runs.agg(seeds=("seed", "nunique"), train_steps=("train_steps", "mean"),
                    train_seconds=("train_seconds", "mean"), train_tokens_per_s=("train_tokens_per_s", "mean"))
    return cost.join([at_n, at_k]).reset_index()


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m posbench.report", description=__doc__)
    parser.add_argument("paths", nargs="+", help="run or sweep directories (searched for results.jsonl)")
    parser.add_argument("--out", help="output directory (default: the first path)")
    parser.add_argument("--metric", default="exact_match", choices=sorted(METRIC_LABELS), help="metric plotted")
    args = parser.parse_args(argv)
    frame = collect(args.paths)
    out = Path(args.out or args.paths[0])
    out.mkdir(parents=True, exist_ok=True)
    frame = frame.sort_values(["task", "encoding", "seed", "eval_length"])
    frame.to_csv(out / "results.csv", index=False)
    plot_comparison(frame, out / f"comparison_{args.metric}.png", args.metric)
    summary = summarize(frame)
    summary.to_csv(out / "summary.csv", index=False)
    print("per (task, encoding), mean over seeds:\n")
    print(summary.round(3).to_string(index=False), "\n")
    pivot = frame.pivot_table(index=["task", "encoding"], columns="eval_length", values=args.metric, aggfunc="mean")
    print(f"{args.metric} (mean over seeds) by evaluation length; {frame['source'].nunique()} runs\n")
    print(pivot.round(3).to_string())
    bad = frame[frame["status"] != "ok"]
    if len(bad):
        print("\nrows not measured:")
        print(bad[["source", "eval_length", "status"]].to_string(index=False))
    print(f"\nwrote results.csv, summary.csv and comparison_{args.metric}.png to {out}")
    return out


if __name__ == "__main__":
    main()
