"""`hyrax serve --host 0.0.0.0` (any address beyond this machine) with no API key serves the
OpenAI routes to whoever reaches it: one line on stderr says so at start-up. The admin routes
always need the admin token, so it names the /v1 routes. Each case runs the real command up to
where Ray would start (serve_until_ray)."""
from __future__ import annotations

import pytest

from serve_until_ray import free_port, serve_until_ray


def warnings(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("hyrax: warning:")]


def test_a_host_beyond_loopback_without_a_key_warns_in_one_line(tmp_path):
    out = serve_until_ray(tmp_path, "--colocated", "--host", "0.0.0.0", "--port", str(free_port()))
    assert out.returncode == 0, out.stderr[-2000:]
    said = warnings(out.stderr)
    assert len(said) == 1, out.stderr
    assert "0.0.0.0" in said[0] and "/v1" in said[0] and "admin token" in said[0], said[0]
    assert out.stderr.index(said[0]) < out.stderr.index("starting Ray")  # at start-up, before anything starts


@pytest.mark.parametrize("argv, env", [
    (("--host", "0.0.0.0"), {"HYRAX_API_KEY": "sk-secret"}),
    (("--host", "0.0.0.0", "--api-key", "sk-secret"), {}),
    (("--host", "127.0.0.1"), {}),
    (("--host", "localhost"), {}),
])
def test_no_warning_with_a_key_or_on_loopback(tmp_path, argv, env):
    out = serve_until_ray(tmp_path, "--colocated", *argv, "--port", str(free_port()), env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert warnings(out.stderr) == [], out.stderr


def _ipv6() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("0.0.0.0", False),
    pytest.param("::1", True, marks=pytest.mark.skipif(not _ipv6(), reason="no IPv6")),
    pytest.param("::", False, marks=pytest.mark.skipif(not _ipv6(), reason="no IPv6")),
])
def test_loopback_is_read_from_the_bound_socket(host, loopback):
    from hyrax.cluster.serve import bind_gateway, is_loopback

    sock = bind_gateway(host, 0)
    try:
        assert is_loopback(sock) is loopback
    finally:
        sock.close()
