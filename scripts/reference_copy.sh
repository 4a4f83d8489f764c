#!/usr/bin/env bash
# Rebuild the reference results of docs/studies.md (then python scripts/docs_tables.py):
# the six core encodings on copy and sort with the general training defaults (one seed; copy's
# own shorter defaults, configs/task_train/copy.yaml, came later and are pinned off), two
# single-thread jobs at a time, then the report.
#   bash scripts/reference_copy.sh [extra overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/reference/core_copy_sort
rm -rf "$out"
python -m posbench --multirun hydra/launcher=joblib hydra.launcher.n_jobs=2 threads=1 \
    encoding=nope,sinusoidal,learned,rope,alibi,t5 task=copy,sort \
    train.steps=10000 train.lr=1e-3 train.min_lr_ratio=0.1 "hydra.sweep.dir=$out" "$@"
python -m posbench.report "$out"
