"""Multi-node (issue 20): a real Ray cluster of four raylets on this machine (head, A, B, C), the
prefill replica pinned to A and the two decode replicas to B and C by the role resources the
KubeRay worker groups advertise (hyrax_prefill, hyrax_decode), served by one `hyrax serve --address`.

PD outputs across nodes equal the single-process reference token for token; then node C is
removed mid-generation: every request completes, equal to the reference (those on C are rebuilt
on B by recompute from the tokens their gateway had streamed), and A and B are left idle and clean.

One cluster and one deployment for the module; the tests run in file order (the last removes C)."""
from __future__ import annotations

import pytest

from hyrax.testing.multinode import Gateway, HeldCluster, Stream, reference_texts, wait_until

# ~1.5-2 min on 2 cores (four raylets, seven torch processes): opt-in, `pytest -m slow tests/multinode`
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
PROMPTS = ["t567;e03627;b86334;u8890;d97427;a28719;y987;r410?b", "k12;q3;w99;z4?q", "a1;b22;c333;d4444?c",
           "x9;y88;z777?y", "m5;n66;o777;p8888?p", "g1;h2;i3;j4;k5?i"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    return reference_texts(PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cluster = HeldCluster()
    gw = None
    try:
        cluster.add_node("A", num_cpus=1, resources={"hyrax_prefill": 100})
        cluster.add_node("B", num_cpus=1, resources={"hyrax_decode": 100})
        cluster.add_node("C", num_cpus=1, resources={"hyrax_decode": 100})
        gw = Gateway(cluster.address, tmp_path_factory.mktemp("multinode"), "gw", "--deterministic",
                     "--decode-replicas", "2", "--gateway-lease", "2").wait_serving()
        yield cluster, gw
    finally:
        if gw is not None:
            gw.stop()
        cluster.shutdown()


def test_each_replica_is_packed_on_one_node_prefill_on_a_decode_on_b_and_c(served):
    cluster, _ = served
    where = cluster.placement()
    assert where["hyrax/prefill/0"] == ["A"]
    assert sorted(where["hyrax/decode/0"] + where["hyrax/decode/1"]) == ["B", "C"]


def test_pd_across_nodes_equals_the_single_process_reference(served, reference):
    _, gw = served
    streams = [Stream(gw, p, MAX_TOKENS, f"pd-{i}") for i, p in enumerate(PROMPTS)]
    for s in streams:
        s.join()
        assert s.done and s.error is None, (s.request_id, s.error)
    assert {p: s.text for p, s in zip(PROMPTS, streams)} == reference


def test_losing_a_decode_node_mid_generation_loses_no_request_and_leaks_nothing(served, reference):
    cluster, gw = served
    where = cluster.placement()
    survivor = next(name for name in ("hyrax/decode/0", "hyrax/decode/1") if where[name] == ["B"])
    streams = [Stream(gw, p, MAX_TOKENS, f"loss-{i}") for i, p in enumerate(PROMPTS)]
    # every request past prefill and decoding (the router spreads them over both decode replicas)
    wait_until(lambda: all(s.chunks >= 2 for s in streams), 120, interval=0.02, what="every stream decoding")
    cluster.remove_node("C")
    for s in streams:
        s.join()
        assert s.done and s.error is None, (s.request_id, s.error)
    assert {p: s.text for p, s in zip(PROMPTS, streams)} == reference
    clean = cluster.clean(["hyrax/prefill/0/coordinator", f"{survivor}/coordinator"])
    assert clean == {"hyrax/prefill/0/coordinator": True, f"{survivor}/coordinator": True}


def test_the_lost_replica_is_replaced_once_a_node_has_room_and_serves(served, reference):
    """The controller places a new decode replica for the one lost with C as soon as a node with
    room joins (here D); the gateway routes to it, and PD through it equals the reference."""
    cluster, gw = served
    cluster.add_node("D", num_cpus=1, resources={"hyrax_decode": 100})

    def replaced():
        on_d = [name for name, nodes in cluster.placement().items() if nodes == ["D"]]
        listed = {f"{p['role']}/{p['replica']}" for p in gw.admin("pools")["replicas"]}
        return on_d and all(name.removeprefix("hyrax/") in listed for name in on_d) and on_d
    [name] = wait_until(replaced, 240, interval=0.5, what="a new decode replica on D, routed to")
    assert name not in ("hyrax/decode/0", "hyrax/decode/1")  # a new replica, not the lost one's name
    streams = [Stream(gw, p, MAX_TOKENS, f"after-{i}") for i, p in enumerate(PROMPTS)]
    for s in streams:
        s.join()
        assert s.done and s.error is None, (s.request_id, s.error)
    assert {p: s.text for p, s in zip(PROMPTS, streams)} == reference
    assert cluster.clean([f"{name}/coordinator"]) == {f"{name}/coordinator": True}
