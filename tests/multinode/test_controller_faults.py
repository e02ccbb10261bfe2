"""The deployment's controller and a hung replica (issue 20): a real multi-node Ray cluster on this
machine (head, A with the prefill replica, B and C with a decode replica each), two `hyrax serve`
gateways on the deployment (the one that deployed it and one attached), and a Ray driver for what
only a process in the cluster can do (kill the controller, freeze a replica's process).

- The controller is killed mid-generation, once through Ray (`ray.kill`, Ray may restart it) and
  once by SIGKILL of its process: Ray restarts it, it takes back the replicas it had (the same
  actors, nothing placed anew), every request of both gateways completes equal to the
  single-process reference, and nothing leaks.
- A decode replica's coordinator hangs (its process frozen: alive to Ray, answering nothing):
  the controller's health check times out, it is killed and replaced, and its requests are
  rebuilt on the other decode replica, equal to the reference.

- `hyrax undeploy` ends it all for good: the detached replicas and the controller Ray would
  otherwise restart.

One cluster and one deployment for the module; the tests run in file order."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hyrax.testing.multinode import HYRAX, Driver, Gateway, HeldCluster, Stream, env, reference_texts, wait_until

# ~4 min on 2 cores (four raylets, seven torch processes, three gateways): opt-in,
# `pytest -m slow tests/multinode`
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
PROMPTS = ["t567;e03627;b86334;u8890;d97427;a28719;y987;r410?b", "k12;q3;w99;z4?q", "a1;b22;c333;d4444?c",
           "x9;y88;z777?y"]
MAX_TOKENS = 80
COORDINATORS = ["hyrax/prefill/0/coordinator", "hyrax/decode/0/coordinator", "hyrax/decode/1/coordinator"]


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return reference_texts(PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cluster, gateways, driver = HeldCluster(), [], None
    try:
        cluster.add_node("A", num_cpus=1, resources={"hyrax_prefill": 100})
        cluster.add_node("B", num_cpus=1, resources={"hyrax_decode": 100})
        cluster.add_node("C", num_cpus=1, resources={"hyrax_decode": 100})
        logs = tmp_path_factory.mktemp("controller")
        shape = ["--deterministic", "--gateway-lease", "2"]
        gateways.append(Gateway(cluster.address, logs, "gw1", *shape, "--decode-replicas", "2").wait_serving())
        gateways.append(Gateway(cluster.address, logs, "gw2", "--attach", *shape).wait_serving())
        driver = Driver(cluster.address)
        yield cluster, gateways, driver
    finally:
        for g in gateways:
            g.stop()
        if driver is not None:
            driver.shutdown()
        cluster.shutdown()


def run_both(gateways, tag: str) -> list[Stream]:
    return [Stream(gw, p, MAX_TOKENS, f"{tag}-{k}-{i}") for k, gw in enumerate(gateways) for i, p in enumerate(PROMPTS)]


def finish(streams: list[Stream], reference: dict[str, str]) -> None:
    for s in streams:
        s.join(150)
        assert s.done and s.error is None, (s.request_id, s.error)
    assert [s.text for s in streams] == [reference[p] for _ in range(len(streams) // len(PROMPTS)) for p in PROMPTS]


def assert_nothing_leaks(cluster, gateways, coordinators: list[str]) -> None:
    assert cluster.clean(coordinators) == {c: True for c in coordinators}
    for gw in gateways:
        assert gw.admin("requests")["requests"] == []
        assert all(c["used"] == 0 and c.get("host_used", 0) == 0
                   for p in gw.admin("pools")["replicas"] for c in p["components"].values())
    groups = {c.removesuffix("/coordinator") for c in coordinators}
    assert set(cluster.placement()) == groups  # no placement group left behind, none placed anew


@pytest.mark.parametrize("how", ["ray", "sigkill"])
def test_a_killed_controller_restarts_and_takes_back_the_same_replicas_mid_generation(served, reference, how):
    cluster, gateways, driver = served
    before = driver.actors()
    assert set(COORDINATORS) <= set(before) and "controller" in before
    old_pid = driver.pid("controller")
    streams = run_both(gateways, how)
    wait_until(lambda: all(s.chunks >= 2 for s in streams), 120, interval=0.02, what="every stream decoding")
    driver.kill("controller", how=how)
    assert not all(s.done for s in streams), "every stream ended before the controller died: lengthen them"
    finish(streams, reference)

    # Ray restarted the controller (a new process, the same actor); it took back every replica:
    # the same coordinator and rank actors, nothing placed anew, nothing stopped
    wait_until(lambda: driver.pid("controller") not in (None, old_pid), 60, interval=0.5,
               what="the controller restarted")
    assert driver.actors() == before
    assert any(e.startswith("restarted: took back 3 replicas") for e in driver.events())
    assert_nothing_leaks(cluster, gateways, COORDINATORS)
    # the restarted controller serves its gateways: they route to the same replicas
    for gw in gateways:
        assert sorted(f"{p['role']}/{p['replica']}" for p in gw.admin("pools")["replicas"]) == \
            ["decode/0", "decode/1", "prefill/0"]


def test_a_hung_decode_replica_is_replaced_and_its_requests_rebuilt_elsewhere(served, reference):
    cluster, gateways, driver = served
    where = cluster.placement()
    hung = next(g for g in ("hyrax/decode/0", "hyrax/decode/1") if where[g] == ["C"])
    survivor = next(g for g in ("hyrax/decode/0", "hyrax/decode/1") if g != hung)
    streams = run_both(gateways, "hang")
    wait_until(lambda: all(s.chunks >= 2 for s in streams), 120, interval=0.02, what="every stream decoding")
    pid = driver.hang(f"{hung}/coordinator")
    # the streams it held stall until the controller's health check gives up on it; then they are
    # rebuilt on the other decode replica from the tokens already streamed
    finish(streams, reference)
    assert any(e.startswith(f"hung {hung.removeprefix('hyrax/')}") for e in driver.events()), driver.events()

    def replaced():  # a new decode replica where the hung one was; gateways route to it
        groups = cluster.placement()
        new = [g for g in groups if g.startswith("hyrax/decode/") and g not in (hung, survivor)]
        listed = [sorted(f"{p['role']}/{p['replica']}" for p in gw.admin("pools")["replicas"]) for gw in gateways]
        return (hung not in groups and len(new) == 1 and groups[new[0]] == ["C"]
                and all(ls == sorted(["prefill/0", survivor.removeprefix("hyrax/"), new[0].removeprefix("hyrax/")])
                        for ls in listed) and new[0])
    new = wait_until(replaced, 120, interval=0.5, what="the hung replica replaced, on C, and routed to")
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), 60, interval=0.5, what="the hung process to be gone")
    assert_nothing_leaks(cluster, gateways, ["hyrax/prefill/0/coordinator", f"{survivor}/coordinator",
                                             f"{new}/coordinator"])
    streams = run_both(gateways, "after")
    finish(streams, reference)


def test_undeploy_stops_every_replica_and_the_controller_for_good(served):
    cluster, _, driver = served
    r = subprocess.run([str(HYRAX), "undeploy", "--address", cluster.address], env=env(), capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    wait_until(lambda: driver.actors() == {} and cluster.placement() == {}, 60, interval=0.5,
               what="no actor and no placement group of the deployment left")
