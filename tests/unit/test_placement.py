"""Placement arithmetic, checked before anything starts: what a deployment reserves, whether a
cluster has room for it (and which replicas would not fit), and how big a local cluster is."""
from __future__ import annotations

import os

import pytest


def test_check_names_every_replica_that_would_not_fit():
    from hyrax.actors.model.errors import StartupFailure
    from hyrax.cluster.placement import check_fits

    groups = [("prefill/0", [{"CPU": 1}] * 2), ("decode/0", [{"CPU": 1}]), ("decode/1", [{"CPU": 1}])]
    check_fits(groups, [{"CPU": 2.0}, {"CPU": 2.0}])  # PACK lets prefill/0 span the two nodes
    with pytest.raises(StartupFailure) as err:
        check_fits(groups, [{"CPU": 2.0}])
    assert str(err.value) == (
        "cannot place the deployment: it needs 4 CPU in bundles of 1, one per rank (prefill/0: 2, decode/0: 1, "
        "decode/1: 1); the cluster has 2 CPU free, so decode/0, decode/1 would wait forever")
    gpu = [("decode/0", [{"CPU": 1, "GPU": 1}] * 2)]
    with pytest.raises(StartupFailure, match="no node has a whole bundle free"):
        check_fits(gpu, [{"CPU": 8.0, "GPU": 0.0}, {"CPU": 0.0, "GPU": 4.0}])


def test_local_cluster_is_sized_to_the_deployment_with_a_note_beyond_the_cores(monkeypatch):
    from hyrax.cluster.placement import RoleSpec, cpus_needed
    from hyrax.cluster.ray_cluster import local_num_cpus

    roles = [RoleSpec("prefill", 1, 2), RoleSpec("decode", 2, 1)]
    assert cpus_needed(roles) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    num, note = local_num_cpus(cpus_needed(roles), None)
    assert num == 4 and "4 logical CPUs" in note and "2 cores" in note
    assert local_num_cpus(cpus_needed(roles), 6)[0] == 6  # --num-cpus may ask for more
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert local_num_cpus(cpus_needed(roles), None) == (4, None)
