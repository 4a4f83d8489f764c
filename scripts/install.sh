#!/usr/bin/env bash
# Install posbench into the active Python. Without a torch already present, take
# torch==2.13.0 first: the CPU wheel where pip's find-links carries it, CUDA from PyPI
# elsewhere. An existing torch (a GPU user's own build) is kept.
#   bash scripts/install.sh          # the harness
#   bash scripts/install.sh dev      # + tests, the reference implementations they compare with, wandb-workspaces
#   bash scripts/install.sh wandb    # + wandb-workspaces, for python -m posbench.dashboard
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install "torch==2.13.0"
fi
python -m pip install -e ".${extras:+[$extras]}"
