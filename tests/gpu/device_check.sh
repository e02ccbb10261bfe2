#!/usr/bin/env bash
# The prepared GPU check (issue 18): the machine, `hyrax doctor` and tests/gpu, each written to
# $OUT (default /tmp/hyrax-gpu-check) as it runs. Run from the repository root on a CUDA host
# whose python3 holds a CUDA build of torch:
#     bash tests/gpu/device_check.sh
# Packages the host lacks (Ray, for the TP = 2 test on a 2-GPU host; vllm-flash-attn for the
# flash checks) can come as wheels in .whl/ (installed into a scratch folder, never over the
# host's own packages); without them those checks say they were skipped and why.
#
# Time: the whole script ends within HYRAX_CHECK_BUDGET_S seconds (default 560: one command of a
# lent machine may run 600). Every step runs under `timeout`; the tests get what the steps before
# them left, less a reserve for the doctor's JSON at the end, and one hung test is stopped after
# GPU_TEST_TIMEOUT_S (the others still run). Stopped for time, pytest is interrupted (SIGINT), so
# it still prints which tests passed, failed or never ran, and writes junit.xml.
# Each step's exit status is printed; the script's own is pytest's (124: out of time).
set -uo pipefail
OUT=${OUT:-/tmp/hyrax-gpu-check}
PY=${PYTHON:-python3}
BUDGET=${HYRAX_CHECK_BUDGET_S:-560}
JSON_RESERVE=${HYRAX_CHECK_JSON_S:-60}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
SECONDS=0

left() {  # seconds of the budget left after keeping $1 back, at least 1
    local n=$((BUDGET - SECONDS - ${1:-0}))
    echo $((n > 1 ? n : 1))
}

step() {  # step LIMIT_S COMMAND...: run it under `timeout` (SIGINT first, then SIGKILL 15 s later)
    local limit=$1
    shift
    timeout -s INT -k 15 "$limit" "$@"
}

if compgen -G ".whl/*.whl" > /dev/null; then
    step "$(left 300)" "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/hyrax-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/hyrax-site"
    echo "carried wheels: exit $?"
fi
{
    step 30 nvidia-smi
    step 60 "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| devices', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
} 2>&1 | tee "$OUT/machine.txt"
step "$(($(left 240) < 150 ? $(left 240) : 150))" "$PY" -m hyrax.cluster.cli doctor 2>&1 | tee "$OUT/doctor.txt"
echo "doctor: exit ${PIPESTATUS[0]} after ${SECONDS}s"
# pyproject's addopts pass --timeout, which pytest refuses without the pytest-timeout plugin: a
# CUDA host without it runs the tests with addopts overridden and no per-test limit (the step's
# own `timeout` still ends them inside the budget)
per_test=(--timeout="${GPU_TEST_TIMEOUT_S:-240}")
if ! "$PY" -c "import pytest_timeout" > /dev/null 2>&1; then
    per_test=(-o "addopts=-m 'not slow' --durations=25")
    echo "pytest-timeout is not installed: tests/gpu runs without a per-test time limit"
fi
step "$(left "$JSON_RESERVE")" "$PY" -m pytest -v -rfEs -p no:cacheprovider "${per_test[@]}" \
    --junitxml="$OUT/junit.xml" tests/gpu 2>&1 | tee "$OUT/gpu-tests.txt"
status=${PIPESTATUS[0]}
echo "tests/gpu: exit $status after ${SECONDS}s"
step "$(left 5)" "$PY" -m hyrax.cluster.cli doctor --json > "$OUT/doctor.json" 2> "$OUT/doctor-json.err"
echo "doctor --json: exit $? after ${SECONDS}s"
exit "$status"
