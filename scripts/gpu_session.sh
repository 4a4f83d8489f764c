#!/usr/bin/env bash
# One device call for the GPU issue: posbench's CUDA checks, then scripts/gpu_measure.py, whose files come
# back under $OUT. The GPU machine has torch but not Hydra, and no network: carry the wheels, fetched here.
#   here:   bash scripts/gpu_session.sh fetch       # the wheels into .whl/ (ignored through .git/info/exclude)
#   there:  the device tool's run with carry [".whl"], timeout_s 590, command: bash scripts/gpu_session.sh run
#           (GPU_PARTS, GPU_SESSION_S and the parts' GPU_*_S pick a shorter call's work)
# Then copy $OUT's results_gpu_<device>_*.csv to results/gpu/<device>/ and commit them with the device's name;
# rows of a later call join the committed ones (its own nope: a `call` column tells them apart), as do the kernels
# part's (results_gpu_kernels_<device>_encodings.csv, with its nope), and the folder's README says what each call
# ran.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 hydra-joblib-launcher==1.2.0 fla-core==0.6.0 einops==0.8.1)  # fla: backend=fla
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
    rm -rf /tmp/gpu /tmp/gpu_kernels  # a warm machine keeps /tmp: $OUT gets this call's measurements only
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.csv"
    python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/nvidia_smi.csv"
    python3 -c "import numpy, triton; print('triton', triton.__version__, 'numpy', numpy.__version__)" \
        | tee -a "$OUT/nvidia_smi.csv"
    # the registers and spills of posbench's kernels under this machine's Triton (the tiles were chosen under 3.6
    # and 3.9 without a GPU), about 10 s
    timeout 30 python3 scripts/kernel_resources.py > "$OUT/kernel_resources.md" 2>&1
    # each step within what is left of ${GPU_SESSION_S:-570} s, most telling first; every file is copied to
    # $OUT as soon as it is written, so a call cut short keeps what it measured
    left() { echo $(( ${GPU_SESSION_S:-570} - SECONDS )); }
    within() { local s=$(( $(left) < $1 ? $(left) : $1 )); echo $(( s > 1 ? s : 1 )); }  # a part's seconds, never
        # past the session's (at least 1: timeout 0 would wait forever)
    keep() { for file in /tmp/gpu*/*/*.csv; do [ -e "$file" ] || continue  # results_<part folder>_<device>_<file>
        local device_dir; device_dir=$(dirname "$file")
        cp "$file" "$OUT/results_$(basename "$(dirname "$device_dir")")_$(basename "$device_dir")_$(basename "$file")"
        done; }
    measure() { local budget=$1 folder=$2; shift 2
        (( $(left) > budget + 20 )) || budget=$(( $(left) - 20 ))
        (( budget > 10 )) || return 0
        timeout $(( budget + 30 )) python3 scripts/gpu_measure.py --budget-s "$budget" --out "$folder" "$@" \
            2>&1 | tee -a "$OUT/measure.log"; keep; }
    # GPU_PARTS, in order (default: job startup tests kernels encodings costs, about 560 s, the issue's unmeasured
    # targets first; a second call: GPU_PARTS="sweep reference"; a third, the bias methods' kernels at every length:
    # GPU_PARTS=encodings GPU_ENCODINGS=nope,t5,fire,sandwich,kerple GPU_ENCODINGS_S=500; probe and profile on
    # request)
    for part in ${GPU_PARTS:-job startup tests kernels encodings costs}; do
        case "$part" in
        job)  # the README's default job (GPU_JOB_MODES: eager and graphs were measured on an H100 on 2026-11-27;
            # capture, which compiles nothing, not yet): capture, then eager on the same device, the target's
            # baseline (3x eager's steps/s), where the part's time holds it (eager took 46 s on the H100)
            measure "${GPU_JOB_S:-100}" /tmp/gpu --parts default_job --job-modes "${GPU_JOB_MODES:-capture,eager}" ;;
        probe)  # where a graph-captured default job's time goes: each step timed, compile and replay apart
            TORCH_LOGS="recompiles,perf_hints" timeout "${GPU_PROBE_S:-90}" python3 scripts/compile_probe.py \
                --modes false,graphs --steps 400 --out "$OUT/compile_probe.csv" > "$OUT/compile_probe.log" 2>&1
            tail -n 4 "$OUT/compile_probe.log" ;;
        profile)  # where the slow rows' steps go (GPU_PROFILE: encoding:tokens ...), each within GPU_PROFILE_S
            for target in ${GPU_PROFILE:-fire:4096 kerple:1024 t5:8192}; do
                timeout "${GPU_PROFILE_S:-40}" python3 scripts/profile_step.py --encoding "${target%%:*}" \
                    --tokens "${target##*:}" > "$OUT/profile_${target%%:*}_${target##*:}.txt" 2>&1
            done ;;
        startup)  # the default job's time outside training (46 s wall against 35 s of training on an H100): the same
            # command untrained, timed whole, with Python's import times
            ( TIMEFORMAT="startup: %R s wall, %U s user"; time timeout "$(within "${GPU_STARTUP_S:-50}")" \
                python3 -X importtime -m posbench encoding=rope task=copy train.steps=0 "hydra.run.dir=$(mktemp -d)" \
                > "$OUT/startup.log" 2> "$OUT/startup_imports.log" ) 2>&1 | tee -a "$OUT/startup.log" ;;
        costs)  # where the bias and decay methods' attention time goes (the cause of each shortfall against nope):
            # one call's parts, each timed against nope's kernel, the eager methods' too (scripts/attention_costs.py)
            costs_s=$(within "${GPU_COSTS_S:-80}"); (( costs_s > 40 )) || continue
            timeout "$costs_s" python3 scripts/attention_costs.py --budget-s $(( costs_s - 30 )) \
                --out "$OUT/attention_costs.csv" 2>&1 | tee "$OUT/attention_costs.log" | tail -n 5 ;;
        tests)  # the CUDA checks of capture and the compile modes (never reached in 2026-11-27's calls: first now), the
            # crossover tables this device reads (an H200 the H100's), the launcher's pinning, the data path and device
            # memory; 8 workers (pyproject's addopts cap them at 4)
            POSBENCH_FAILURE_LOG="$OUT/test_failures.log" timeout "$(within "${GPU_TESTS_S:-130}")" \
                python3 -m pytest -v -p no:randomly -n 8 --maxprocesses=8 -p no:cacheprovider \
                tests/test_cuda.py::test_the_captured_step_trains_on_cuda_to_the_uncompiled_losses \
                tests/test_cuda.py::test_auto_on_this_device_reads_its_tables_by_name_and_compute_capability \
                tests/test_cuda.py::test_sdpa_with_the_decay_padded_to_a_multiple_of_8_gives_the_cpu_reference \
                tests/test_cuda.py::test_fla_gives_the_cpu_reference \
                tests/test_cuda.py::test_posbenchs_kernels_give_the_cpu_reference \
                tests/test_cuda.py::test_a_compiled_mode_trains_on_cuda_to_the_uncompiled_losses \
                tests/test_gpu_slots.py::test_two_concurrent_jobs_run_on_the_gpus_of_their_slots \
                tests/test_cuda.py::test_a_seeds_gpu_run_trains_and_evaluates_on_the_cpu_runs_sequences \
                tests/test_cuda.py::test_a_run_on_cuda_records_device_memory 2>&1 | tee "$OUT/tests.log" ;;
        kernels)  # the Triton kernels at 1,024 tokens, against auto's backend and nope in the same call: the eager
            # frontier methods' (0.5x nope): CoPE's and DAPE's (posbench's), stick-breaking's (fla-core's); FIRE's
            # and the relative bias's for t5 (posbench's; 0.7x)
            measure "${GPU_KERNELS_S:-90}" /tmp/gpu_kernels --parts encodings \
                --encodings nope,cope,dape,stick_breaking,fire,t5 --tokens 1024 --modes eager --backends fla ;;
        encodings)  # the issue's targets against nope (GPU_ENCODINGS; GPU_MEASURE_ARGS replaces the modes and backends).
            # Default: the rows not measured on an H100 on 2026-11-27 (kerple on sdpa, cope, dape, stick-breaking), and
            # alibi's and fox's sdpa rows again (their decay padded to heads of 24 since); fla for them, stick-breaking
            # and PaTH; eager
            measure "${GPU_ENCODINGS_S:-110}" /tmp/gpu --parts encodings \
                --encodings "${GPU_ENCODINGS:-nope,alibi,fox,kerple,cope,dape,stick_breaking,path}" \
                ${GPU_MEASURE_ARGS:---modes eager --backends sdpa,fla} ;;
        reference)  # issue 38's encodings on CUDA's backends against the CPU's float64 model (never run on a GPU)
            POSBENCH_FAILURE_LOG="$OUT/reference_failures.log" timeout "${GPU_REFERENCE_S:-70}" python3 -m pytest -q \
                -p no:randomly -n 8 --maxprocesses=8 -p no:cacheprovider \
                tests/test_cuda.py::test_the_cuda_backend_gives_the_cpu_reference \
                -k "grape or pope or fope or scale_invariant or gated or selective or tape or cable or drope or string" \
                2>&1 | tail -n 30 > "$OUT/reference.log" ;;
        sweep)  # the sweep launcher on the frontier study's copy runs
            measure "${GPU_SWEEP_S:-150}" /tmp/gpu --parts sweep ;;
        *) echo "GPU_PARTS: unknown part $part (job, startup, costs, probe, profile, tests, reference, kernels," \
               "encodings, sweep)" >&2 ;;
        esac
    done
    ;;
*)
    echo "usage: bash scripts/gpu_session.sh fetch|run" >&2
    exit 2
    ;;
esac
