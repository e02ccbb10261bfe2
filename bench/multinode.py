"""Suite multinode (opt-in, `--suite multinode`): a multi-node Ray cluster on this machine
(hyrax.testing.multinode: one raylet per node), one `hyrax serve --address` gateway.

Nodes: A (1 CPU, `hyrax_prefill`) and D1..D3 (1 CPU each, `hyrax_decode`), so the prefill
replica lands on A and each decode replica on its own node.

- Scaling: decode throughput (generated tokens per second over HTTP, concurrent streams) with 1,
  2 and 3 decode replicas, each shape a fresh deployment on the same cluster. Efficiency = throughput(N) /
  (N x throughput(1)). Informational: every raylet of this cluster shares the machine's cores,
  so on a 2-core machine it measures the system's overhead, not the hardware's scaling.
- Node loss: 2 decode replicas, streams decoding on both; the node of one decode replica is
  removed. Time from the removal to the moment the last stream that stalled receives a token
  again (its request rebuilt on the other replica by recompute), and whether every stream then
  completed equal to its text without the loss.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench.common import Profile, progress
from bench.report import Row, ratio

PROMPTS = ["t567;e03627;b86334;u8890;d97427;a28719;y987;r410?b", "k12;q3;w99;z4?q", "a1;b22;c333;d4444?c",
           "x9;y88;z777?y", "m5;n66;o777;p8888?p", "g1;h2;i3;j4;k5?i"]


def _sizes(profile: Profile) -> tuple[int, int]:
    """(streams per measurement, max_tokens per stream)."""
    return {"full": (12, 96), "quick": (6, 48)}.get(profile.name, (2, 8))


def _throughput(gw, n_streams: int, max_tokens: int) -> float:
    from hyrax.testing.multinode import Stream

    t0 = time.monotonic()
    streams = [Stream(gw, PROMPTS[i % len(PROMPTS)], max_tokens, f"bench-{time.monotonic_ns()}-{i}")
               for i in range(n_streams)]
    for s in streams:
        s.join(600)
        if not s.done:
            raise RuntimeError(f"stream {s.request_id} failed: {s.error}")
    return n_streams * max_tokens / (time.monotonic() - t0)


def _node_loss(cluster, gw, n_streams: int, max_tokens: int) -> tuple[float | None, bool]:
    """Seconds from removing the node of decode/1 to the last stalled stream's next token, and
    whether every stream completed with the text it has without the loss."""
    from hyrax.testing.multinode import Stream, wait_until

    expected = {p: gw.complete(p, max_tokens) for p in PROMPTS}
    where = cluster.placement()
    lost = where["hyrax/decode/1"][0]
    streams = [Stream(gw, PROMPTS[i % len(PROMPTS)], max_tokens, f"loss-{time.monotonic_ns()}-{i}")
               for i in range(n_streams)]
    wait_until(lambda: all(s.chunks >= 2 for s in streams), 300, interval=0.02, what="every stream decoding")
    t0 = time.monotonic()
    cluster.remove_node(lost)
    for s in streams:
        s.join(600)
    resumed = [min((t for t in s.chunk_times if t > t0), default=None) for s in streams]
    if any(t is None for t in resumed):
        return None, False
    exact = all(s.done and s.text == expected[PROMPTS[i % len(PROMPTS)]] for i, s in enumerate(streams))
    return max(resumed) - t0, exact


def run(profile: Profile) -> list[Row]:
    from hyrax.testing.multinode import Gateway, HeldCluster

    n_streams, max_tokens = _sizes(profile)
    rows: list[Row] = []
    logs = Path(tempfile.mkdtemp(prefix="hyrax-bench-multinode-"))
    tput: dict[int, float] = {}
    cluster = HeldCluster()
    try:
        cluster.add_node("A", num_cpus=1, resources={"hyrax_prefill": 100})
        for k in range(1, 4):
            cluster.add_node(f"D{k}", num_cpus=1, resources={"hyrax_decode": 100})
        for n in (1, 3, 2):  # one deployment after the other (each gateway tears its own down); loss last
            progress(f"multinode: {n} decode replica(s)")
            gw = Gateway(cluster.address, logs, f"gw{n}", "--deterministic", "--decode-replicas", str(n),
                         "--gateway-lease", "2").wait_serving(600)
            try:
                _throughput(gw, 2, 4)  # warm-up: first prefill and decode steps on every replica
                tput[n] = _throughput(gw, n_streams, max_tokens)
                if n == 2:
                    progress("multinode: node loss")
                    seconds, exact = _node_loss(cluster, gw, n_streams, max_tokens)
                    rows.append(Row("multinode: node loss -> last of its requests running again (s)", seconds,
                                    None, None))
                    rows.append(Row("multinode: node loss, every stream completed as without it (1 = yes)",
                                    float(exact), 1.0, ratio(float(exact), 1.0), "== 1"))
            finally:
                gw.stop()
    finally:
        cluster.shutdown()
    for n in (1, 2, 3):
        rows.append(Row(f"multinode: decode throughput, {n} decode replica(s) (tok/s) vs {n} x 1 replica",
                        tput[n], n * tput[1], ratio(tput[n], n * tput[1])))
    return rows
