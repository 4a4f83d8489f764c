#!/usr/bin/env bash
# One device call for the GPU issue: posbench's CUDA checks, then scripts/gpu_measure.py, whose files come
# back under $OUT. The GPU machine has torch but not Hydra, and no network: carry the wheels, fetched here.
#   here:   bash scripts/gpu_session.sh fetch       # the wheels into .whl/ (ignored through .git/info/exclude)
#   there:  the device tool's run with carry [".whl"], timeout_s 590, command: bash scripts/gpu_session.sh run
# Then copy $OUT's results_gpu_<device>_*.csv to results/gpu/<device>/ and commit them with the device's name.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 hydra-joblib-launcher==1.2.0)
case "${1:-}" in
fetch)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    mkdir -p .whl
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform any -d .whl "${WHEELS[@]}" || exit 1
    python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3 || exit 1  # pure Python, no wheel on PyPI
    ls .whl
    ;;
run)
    : "${OUT:?run on the device machine, where OUT is set}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.csv"
    python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/nvidia_smi.csv"
    # the CUDA checks of the data path, the compile modes and the launcher's pinning (about 2 minutes)
    timeout 160 python3 -m pytest -q -p no:randomly -n 8 -p no:cacheprovider tests/test_gpu_slots.py \
        tests/test_cuda.py -k "cpu_runs_sequences or compiled_mode or records_device_memory or gpus_of_their_slots" \
        2>&1 | tee "$OUT/tests.log"
    # the artifact (docs/performance.md reads it): encodings, the default job, the sweep
    timeout 400 python3 scripts/gpu_measure.py --budget-s 380 --out /tmp/gpu 2>&1 | tee "$OUT/measure.log"
    for file in /tmp/gpu/*/*.csv; do
        device=$(basename "$(dirname "$file")")
        cp "$file" "$OUT/results_gpu_${device}_$(basename "$file")"
    done
    ;;
*)
    echo "usage: bash scripts/gpu_session.sh fetch|run" >&2
    exit 2
    ;;
esac
