"""The banner's "Ray cluster" line tells how another gateway joins: `hyrax serve` starts its
local cluster with Ray's token authentication on, and a driver joining an explicit address
sends its token only under RAY_AUTH_MODE=token. The line said "(--address for hyrax serve
--attach)", and following it failed after ~20 s of GCS warnings; it now prints the command,
environment included, and that command joins."""
import os
import subprocess
import sys

START = """
import sys
from hyrax.cluster.ray_cluster import attach_command, init_ray
init_ray(None, 1, dashboard=False)
print(attach_command(), flush=True)
sys.stdin.read()  # the cluster lives until the test closes stdin
"""
JOIN = """
import ray
ray.init(address=sys.argv[1], namespace="hyrax", log_to_driver=False)
print("joined", flush=True)
"""


def test_the_banner_names_how_another_gateway_joins_and_that_joins():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    head = subprocess.Popen([sys.executable, "-c", START], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = head.stdout.readline().strip()
        assert line.startswith("RAY_AUTH_MODE=token hyrax serve --address 127.0.0.1:"), line
        assert line.endswith(" --attach"), line
        words = line.split()
        joiner_env = dict(env, **dict(w.split("=", 1) for w in words if "=" in w))
        r = subprocess.run([sys.executable, "-c", "import sys\n" + JOIN, words[words.index("--address") + 1]],
                           capture_output=True, text=True, timeout=60, env=joiner_env, stdin=subprocess.DEVNULL)
        assert r.returncode == 0 and "joined" in r.stdout, r.stderr[-2000:]
    finally:
        head.stdin.close()
        head.wait(timeout=60)
