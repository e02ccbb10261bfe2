"""`hyrax serve` checks what it can before anything starts: a busy port and a local cluster
too small for the deployment are one-line errors in seconds, before Ray starts; the admin
token file is written only once the port is ours, and never over a running server's.

None of these tests starts Ray.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_harness import free_port

HYRAX = Path(sys.executable).with_name("hyrax")


def _serve(args: list[str], home: Path, timeout: float = 60.0) -> tuple[int | None, str, float]:
    """Run `hyrax serve ARGS` with HOME=home and no admin token in the environment. Returns
    (exit code or None if it was still running after `timeout`, stderr, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYRAX_ADMIN_TOKEN", "RAY_ADDRESS")}
    env["HOME"] = str(home)
    t0 = time.monotonic()
    proc = subprocess.Popen([str(HYRAX), "serve", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    finally:
        try:  # whatever it started (a Ray cluster, on the old code) goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if code is None:
            _, err = proc.communicate()
    return code, err, time.monotonic() - t0


@pytest.fixture
def home(tmp_path) -> Path:
    """A HOME whose default token file belongs to a server already running."""
    (tmp_path / ".hyrax").mkdir()
    (tmp_path / ".hyrax" / "admin_token").write_text("token-of-the-running-server\n")
    return tmp_path


def test_busy_port_is_one_line_error_before_ray_starts_and_keeps_the_token_file(home):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code, err, seconds = _serve(["--port", str(port)], home)
    assert code not in (None, 0), f"exit {code} after {seconds:.0f}s:\n{err[-2000:]}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hyrax: error:"), err[-2000:]
    assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0]
    assert seconds < 30  # imports only (torch: ~3 s on an idle core); no Ray, no deployment
    assert (home / ".hyrax" / "admin_token").read_text() == "token-of-the-running-server\n"
    assert sorted(p.name for p in (home / ".hyrax").iterdir()) == ["admin_token"]


def test_local_cluster_too_small_for_the_deployment_is_one_line_error_before_ray(home):
    code, err, seconds = _serve(["--port", str(free_port()), "--prefill-tp", "2", "--decode-replicas", "2",
                                 "--num-cpus", "2"], home)
    assert code not in (None, 0), f"exit {code} after {seconds:.0f}s:\n{err[-2000:]}"
    lines = err.strip().splitlines()
    assert lines == ["hyrax: error: --num-cpus 2 is less than the 4 CPU the deployment needs (one per TP rank); "
                     "raise it or leave it out"], err[-2000:]
    assert seconds < 30


def test_second_server_never_overwrites_a_running_servers_token_file(tmp_path, monkeypatch):
    from hyrax.actors.model.errors import StartupFailure
    from hyrax.cluster import serve

    monkeypatch.delenv("HYRAX_ADMIN_TOKEN", raising=False)
    default = tmp_path / ".hyrax" / "admin_token"
    monkeypatch.setattr(serve, "DEFAULT_TOKEN_FILE", default)
    first = serve.resolve_admin_token(argparse.Namespace(admin_token_file=None, port=8000))
    try:
        assert default.read_text() == first.token + "\n"
        assert (default.stat().st_mode & 0o777) == 0o600
        # a second server (another port) while the first runs: the default file stays the first's
        second = serve.resolve_admin_token(argparse.Namespace(admin_token_file=None, port=8001))
        try:
            assert default.read_text() == first.token + "\n"
            mine = default.with_name("admin_token.8001")
            assert mine.read_text() == second.token + "\n" and second.token != first.token
            assert str(mine) in second.where
        finally:
            second.release()
        # an explicit --admin-token-file held by a running server is an error, and left alone
        with pytest.raises(StartupFailure, match="running hyrax serve"):
            serve.resolve_admin_token(argparse.Namespace(admin_token_file=str(default), port=8002))
        assert default.read_text() == first.token + "\n"
    finally:
        first.release()
    # once the first server is gone, its file is free for the next one
    third = serve.resolve_admin_token(argparse.Namespace(admin_token_file=None, port=8000))
    third.release()
    assert default.read_text() == third.token + "\n"
