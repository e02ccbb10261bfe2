"""A multi-node Ray cluster on this machine, held by this process
(`python -m hyrax.testing.cluster_holder`; hyrax.testing.multinode.HeldCluster drives it).

The test process stays out of Ray (the integration suite's session cluster may already be
initialised in it): it starts this script, reads the head's address from its first line, and
sends it commands on stdin, one JSON object a line; each answer is one JSON line after MARK.

  {"op": "add", "name": "B", "num_cpus": 2, "resources": {"node_B": 1}}  -> {"ok": true, "node_id": ...}
  {"op": "remove", "name": "B"}                                        -> {"ok": true}
  {"op": "placement"}                 -> {"groups": {placement group name: [node name per bundle]}}
  {"op": "clean", "actors": [name, ...], "namespace": "hyrax"}
                                      -> {"clean": {name: true | "why not"}}: idle, nothing allocated,
                                         pool invariants hold (the replica's own checks)
  {"op": "quit"}, or stdin closing (the test process died)            -> the cluster is shut down

Ray's own multi-node test cluster (ray.cluster_utils.Cluster): one raylet per node, each with its
own resources, all on 127.0.0.1."""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

MARK = "@hyrax-holder "


_answers = None  # the stdout this process was started with (main() moves everything else to stderr)


def answer(obj) -> None:
    _answers.write(MARK + json.dumps(obj) + "\n")
    _answers.flush()


def placement(nodes: dict) -> dict:
    names = {n.node_id: name for name, n in nodes.items()}
    out = {}
    for pg in ray.util.placement_group_table().values():
        if pg["state"] != "REMOVED" and pg.get("name"):
            out[pg["name"]] = [names.get(nid, "head" if nid else None)
                               for _, nid in sorted(pg["bundles_to_node_id"].items())]
    return out


def clean(actors: list[str], namespace: str) -> dict:
    out = {}
    for name in actors:
        try:
            a = ray.get_actor(name, namespace=namespace)
            ray.get(a.check_invariants.remote(), timeout=30)
            out[name] = True if ray.get(a.is_idle_clean.remote(), timeout=30) else "holds requests or pool units"
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return out


def main() -> None:
    # Answers go to the stdout this process was started with; everything else (Ray's own
    # messages, at the Python or the C++ level) goes to stderr, so nothing can split an answer.
    global _answers
    _answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                           "resources": {"node_head": 1}})
    nodes = {}
    ray.init(address=cluster.address, namespace="hyrax", log_to_driver=False)
    answer({"address": cluster.address})
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
                answer({"ok": True, "node_id": node.node_id})
            elif cmd["op"] == "remove":
                cluster.remove_node(nodes.pop(cmd["name"]), allow_graceful=False)
                answer({"ok": True})
            elif cmd["op"] == "placement":
                answer({"groups": placement(nodes)})
            elif cmd["op"] == "clean":
                answer({"clean": clean(cmd["actors"], cmd.get("namespace", "hyrax"))})
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
