"""Joining a Ray cluster that is not there fails at once with one line (Ray itself retries a
missing GCS for minutes), and Ray's own start-up errors become StartupFailure lines."""
import socket
import subprocess
import sys

import pytest

from hyrax.actors.model.errors import StartupFailure
from hyrax.cluster.ray_cluster import check_reachable


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def test_check_reachable_refuses_a_closed_port_and_passes_a_listener():
    port = _closed_port()
    with pytest.raises(StartupFailure, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_reachable(f"127.0.0.1:{s.getsockname()[1]}")
    for other in ("auto", "ray://127.0.0.1:1"):  # Ray's to resolve
        check_reachable(other)


def test_serve_joining_nothing_fails_in_seconds_with_one_error_line():
    port = _closed_port()
    r = subprocess.run([sys.executable, "-m", "hyrax.cluster.cli", "serve", "--address", f"127.0.0.1:{port}",
                        "--port", str(_closed_port())],
                       capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("hyrax: error:")]
    assert len(errors) == 1 and "no Ray cluster answers" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("mode,hinted", [(None, True), ("disabled", True), ("token", False)])
def test_a_failed_join_names_ray_token_authentication_unless_it_is_on(monkeypatch, mode, hinted):
    """Ray turns token authentication on for a local `hyrax serve`'s cluster, and for `ray start
    --head` wherever ~/.ray/auth_token exists, but a driver joining an explicit address sends no
    token unless RAY_AUTH_MODE=token: the join then fails after ~20 s of GCS warnings with only
    "Failed to connect to Ray cluster". The error says what to set."""
    import ray

    from hyrax.cluster import ray_cluster

    def refused(**kw):
        raise ConnectionError(f"Failed to connect to Ray cluster at {kw['address']}")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.setattr(ray_cluster, "check_reachable", lambda address: None)
    if mode is None:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", mode)
    with pytest.raises(StartupFailure) as e:
        ray_cluster.init_ray(address="127.0.0.1:6379")
    msg = str(e.value)
    assert msg.startswith("joining the Ray cluster at 127.0.0.1:6379 failed: Failed to connect"), msg
    assert ("RAY_AUTH_MODE=token" in msg) == hinted, msg
