"""`hyrax undeploy`: stop a deployment that no server owns any more (every gateway attached, or the
one that deployed it gone). Its replicas are detached actors and its controller is restarted by Ray
whenever it dies, so killing the controller does not end a deployment: asking it to tear down does."""
from __future__ import annotations

import argparse
import sys

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.arg_types import non_empty


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("undeploy", help="stop a deployment's replicas and its controller",
                       description="Stop every replica of a deployment on a Ray cluster, and its controller. "
                                   "Gateways still attached to it lose their replicas.")
    p.add_argument("--address", required=True, type=non_empty, help="the Ray cluster the deployment runs on")
    p.add_argument("--deployment", default="hyrax", help="the deployment's name")
    p.set_defaults(func=run)
    return p


def run(a: argparse.Namespace) -> int:
    from hyrax.cluster.placement import namespace
    from hyrax.cluster.ray_cluster import init_ray

    namespace(a.deployment)  # a usable name, before joining anything
    init_ray(a.address)
    import ray

    from hyrax.cluster import controller

    try:
        ctl = controller.find(a.deployment)
        if ctl is None:
            raise HyraxInputError(f"no deployment named {a.deployment!r} runs on this Ray cluster")
        controller.tear_down(ctl)
        print(f"hyrax: deployment {a.deployment!r} stopped", file=sys.stderr)
    finally:
        ray.shutdown()
    return 0
