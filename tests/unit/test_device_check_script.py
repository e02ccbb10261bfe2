"""tests/gpu/device_check.sh, run on the CPU with stand-ins for python3 and nvidia-smi: the one
command a lent GPU machine runs must end inside its time budget whatever hangs (a lent machine
stops a command at 600 s, and a killed command returns no output but what it wrote to $OUT),
and leave each step's output in $OUT, the tests' summary included when they ran out of time."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "device_check.sh"

# python3's stand-in: the doctor answers at once, pytest hangs until interrupted and then prints
# its summary as pytest does on SIGINT (exit 2), as a hung CUDA test would leave it
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$*" in
    *"-m pytest"*)
        trap 'echo "!!! KeyboardInterrupt !!!"; echo "1 passed in 9.0s (interrupted)"; exit 2' INT
        echo "tests/gpu/test_a.py::test_one PASSED"
        sleep 1000
        ;;
    *"doctor --json"*) echo '{"name": "versions", "status": "ok", "detail": "stand-in"}' ;;
    *doctor*) echo "ok    versions: stand-in" ;;
    *) echo "python 3.12 | torch stand-in" ;;
esac
"""


def _stand_ins(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python3", FAKE_PYTHON), ("nvidia-smi", "#!/usr/bin/env bash\necho 'NVIDIA H100 stand-in'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_a_hung_test_run_is_interrupted_inside_the_budget_and_every_output_is_kept(tmp_path):
    bin_dir = _stand_ins(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "PYTHON": "python3",
           "HYRAX_CHECK_BUDGET_S": "12", "HYRAX_CHECK_JSON_S": "4"}
    start = time.monotonic()
    try:
        done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the script ran past its 12 s budget by more than 48 s")
    took = time.monotonic() - start
    assert took < 12 + 5, (took, done.stdout[-2000:])
    assert done.returncode == 124, done.stdout[-2000:]  # timeout's status: the tests ran out of time
    assert "NVIDIA H100 stand-in" in (out / "machine.txt").read_text()
    assert "ok    versions: stand-in" in (out / "doctor.txt").read_text()
    tests = (out / "gpu-tests.txt").read_text()
    assert "test_one PASSED" in tests and "(interrupted)" in tests  # the summary pytest prints on SIGINT
    assert '"status": "ok"' in (out / "doctor.json").read_text()  # the JSON run kept its reserve
    assert "tests/gpu: exit 124" in done.stdout


# python3's stand-in for a CUDA host whose python lacks pytest-timeout (pyproject's addopts pass
# --timeout, which pytest then refuses): pytest writes the arguments it got
NO_TIMEOUT_PYTHON = r"""#!/usr/bin/env bash
case "$*" in
    *"import pytest_timeout"*) [ -n "$HAS_TIMEOUT_PLUGIN" ] && exit 0; echo "No module named pytest_timeout" >&2; exit 1 ;;
    *"-m pytest"*) printf '%s\n' "$@" > "$OUT/pytest-args.txt"; echo "1 passed in 0.1s" ;;
    *"doctor --json"*) echo '{}' ;;
    *) echo "stand-in" ;;
esac
"""


@pytest.mark.parametrize("plugin", [True, False], ids=["with pytest-timeout", "without it"])
def test_the_tests_run_whether_or_not_the_host_has_pytest_timeout(tmp_path, plugin):
    """The lent machine's python may lack pytest-timeout (nothing can be installed there but the
    wheels carried in .whl/), and pytest refuses the --timeout of pyproject's addopts without
    it: every GPU test would be lost to a usage error. Without the plugin the script overrides
    addopts and passes no --timeout."""
    bin_dir = _stand_ins(tmp_path)
    (bin_dir / "python3").write_text(NO_TIMEOUT_PYTHON)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "PYTHON": "python3",
           "HYRAX_CHECK_BUDGET_S": "60", "HAS_TIMEOUT_PLUGIN": "1" if plugin else ""}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:]
    args = (out / "pytest-args.txt").read_text().splitlines()
    if plugin:
        assert "--timeout=240" in args and not any(a.startswith("addopts=") for a in args), args
    else:
        assert not any(a.startswith("--timeout") for a in args) and "addopts=-m 'not slow' --durations=25" in args, args
        assert "pytest-timeout is not installed" in done.stdout
