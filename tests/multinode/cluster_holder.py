"""A multi-node Ray cluster on this machine, held by this process (run as a script).

The test process stays out of Ray (the integration suite's session cluster may already be
initialised in it): it starts this script, reads the head's address from its first line, and
sends it commands on stdin, one JSON object a line; each answer is one JSON line.

  {"op": "add", "name": "B", "num_cpus": 2, "resources": {"node_B": 1}}  -> {"ok": true, "node_id": ...}
  {"op": "remove", "name": "B"}                                        -> {"ok": true}
  {"op": "quit"}, or stdin closing (the test process died)            -> the cluster is shut down

Ray's own multi-node test cluster (ray.cluster_utils.Cluster): one raylet per node, each with its
own resources, all on 127.0.0.1."""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from ray.cluster_utils import Cluster  # noqa: E402


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                           "resources": {"node_head": 1}})
    nodes = {}
    print(json.dumps({"address": cluster.address}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "add":
                node = cluster.add_node(num_cpus=cmd.get("num_cpus", 1),
                                        resources={**cmd.get("resources", {}), f"node_{cmd['name']}": 1})
                cluster.wait_for_nodes()
                nodes[cmd["name"]] = node
                print(json.dumps({"ok": True, "node_id": node.node_id}), flush=True)
            elif cmd["op"] == "remove":
                cluster.remove_node(nodes.pop(cmd["name"]), allow_graceful=False)
                print(json.dumps({"ok": True}), flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
