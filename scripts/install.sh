#!/usr/bin/env bash
# Install posbench into the active Python. Without a torch already present, or with one older than
# pyproject's floor (2.11: older ones fail the suite, docs/testing.md), take torch==2.13.0 first: the CPU
# wheel where pip's find-links carries it, CUDA from PyPI elsewhere. An existing torch of 2.11 or later
# (a GPU user's own build) is kept.
#   bash scripts/install.sh          # the harness
#   bash scripts/install.sh dev      # + tests, the reference implementations they compare with, wandb-workspaces
#   bash scripts/install.sh wandb    # + wandb-workspaces, for python -m posbench.dashboard
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
found=$(python -c "import torch; print(torch.__version__, torch.__version__ >= '2.11')" 2>/dev/null || true)
if [ "${found#* }" != True ]; then  # none, or older than the floor
    [ -z "$found" ] || echo "install.sh: torch ${found% *} is older than posbench's floor 2.11; installing 2.13.0"
    python -m pip install "torch==2.13.0"
fi
python -m pip install -e ".${extras:+[$extras]}"
