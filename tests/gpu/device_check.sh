#!/usr/bin/env bash
# The prepared GPU check (issue 18): the machine, `hyrax doctor` (text and --json) and tests/gpu,
# each written to $OUT (default /tmp/hyrax-gpu-check) as it runs. Run from the repository root on
# a CUDA host whose python3 holds a CUDA build of torch:
#     bash tests/gpu/device_check.sh
# Packages the host lacks (Ray, for the TP = 2 test on a 2-GPU host; vllm-flash-attn for the
# flash checks) can come as wheels in .whl/ (installed into a scratch folder, never over the
# host's own packages); without them those checks say they were skipped and why. Each step's exit
# status is printed; the script's own is pytest's.
set -uo pipefail
OUT=${OUT:-/tmp/hyrax-gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/hyrax-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/hyrax-site"
    echo "carried wheels: exit $?"
fi
{
    nvidia-smi
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| devices', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
} 2>&1 | tee "$OUT/machine.txt"
"$PY" -m hyrax.cluster.cli doctor 2>&1 | tee "$OUT/doctor.txt"
echo "doctor: exit ${PIPESTATUS[0]}"
"$PY" -m hyrax.cluster.cli doctor --json > "$OUT/doctor.json" 2> "$OUT/doctor-json.err"
timeout "${GPU_TESTS_TIMEOUT_S:-420}" "$PY" -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu-tests.txt"
status=${PIPESTATUS[0]}
echo "tests/gpu: exit $status"
exit "$status"
