"""`hyrax serve ARGV` run in a child process up to the point where it would start Ray: what it
checks, prints and rewrites before anything starts, without a cluster. Where Ray would start,
init_ray prints what Ray would record as the driver's entrypoint (its command line, read by
psutil) and stops the command with status 0."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
from hyrax.cluster import cli, ray_cluster

def init_ray(*args, **kwargs):
    from ray._private.utils import get_entrypoint_name
    print("ENTRYPOINT", get_entrypoint_name(), flush=True)
    raise SystemExit(0)

ray_cluster.init_ray = init_ray
sys.exit(cli.main(sys.argv[1:]))
"""
# variables of this process that would change what the child does; tests set them through `env`
CLEARED = ("HYRAX_ADMIN_TOKEN", "HYRAX_API_KEY", "RAY_ADDRESS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_until_ray(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`hyrax serve ARGV` with HOME at `tmp_path` (its admin token file goes there) and `env`
    on top of this process's variables less CLEARED."""
    child_env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    child_env.update(HOME=str(tmp_path), PYTHONPATH=os.getcwd(), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", **(env or {}))
    script = tmp_path / "until_ray.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), "serve", *argv], env=child_env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
