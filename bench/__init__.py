"""Hyrax benchmarks: every suite measures Hyrax and a baseline in the same run and reports
their ratio, so that numbers stay comparable on a noisy, shared machine.

Run them with `hyrax bench [--quick] [--json OUT]` (see bench/README.md). One module per
suite, each exposing `run(profile) -> list[Row]`:

- `serving`       full stack over HTTP vs transformers `generate` on the same weights
- `coordination`  coordinator step time vs model forward time on the ranks
- `retraction`    backup + restore throughput vs a contiguous torch copy; restore vs recompute
- `transfer`      PD export + import throughput vs ray.put + ray.get of one buffer
- `memory`        bytes per request vs the formula; RSS growth under forced retraction
- `prefix`        prefix cache on vs off (TTFT, 0 % hit cost), cache-aware routing, and shared
                  vs unshared prompts over HTTP + Ray
- `soak`, `multinode`, `captured` (not in the default run): chaos, a multi-node cluster, the
                  torch.compile'd decode forward (bench/README.md)
"""
