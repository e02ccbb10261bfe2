"""The gateway's watch on its Ray cluster (hyrax/cluster/cluster_watch.py), over real TCP
listeners in the places of the GCS and the raylet: the cluster is gone only when neither
accepts a connection. A GCS that restarts (the raylet still up) is no loss, and the gateway
serves on."""
import asyncio
import socket

from hyrax.cluster.cluster_watch import ClusterEndpoints, ClusterWatch


def _listener() -> tuple[socket.socket, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, f"127.0.0.1:{s.getsockname()[1]}"


def test_the_cluster_is_gone_only_once_neither_its_gcs_nor_this_nodes_raylet_answers():
    gcs, gcs_at = _listener()
    raylet, raylet_at = _listener()
    lost: list[str] = []
    watch = ClusterWatch(ClusterEndpoints(gcs_at, raylet_at), lost.append, interval_s=0.01, rounds=2)
    assert watch.answering()
    gcs.close()  # the GCS restarts: the raylet waits for it, and so does the gateway
    assert watch.answering()
    raylet.close()  # both gone: the node's Ray went with the process that started it
    assert not watch.answering()
    asyncio.run(asyncio.wait_for(watch.run(), 30))
    assert lost == [watch.why()]
    assert gcs_at in lost[0] and "this gateway stops" in lost[0]


def test_without_a_known_raylet_the_gcs_alone_decides():
    gcs, gcs_at = _listener()
    watch = ClusterWatch(ClusterEndpoints(gcs_at, None), lambda why: None)
    assert watch.answering()
    gcs.close()
    assert not watch.answering()
