"""A local deployment that cannot fit in this machine's memory is refused before anything
starts, with both numbers; one that fits, or a machine that reports nothing, passes."""
import subprocess
import sys

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.local_memory import (COORDINATOR_BYTES, GIB, RANK_PROCESS_BYTES, available_bytes, check_fits,
                                        needed_bytes, weight_bytes)
from hyrax.cluster.placement import RoleSpec


def test_bound_counts_every_rank_coordinator_and_replica_weights():
    roles = [RoleSpec("prefill", 2, 2), RoleSpec("decode", 3, 1)]
    w = 100 * 2**20
    assert needed_bytes(roles, w) == 7 * RANK_PROCESS_BYTES + 5 * (COORDINATOR_BYTES + w)


def test_too_big_is_refused_naming_need_and_room():
    roles = [RoleSpec("prefill", 1, 1), RoleSpec("decode", 40, 2)]
    with pytest.raises(HyraxInputError) as e:
        check_fits(roles, 2**20, 8 * GIB)
    msg = str(e.value)
    assert "81 rank processes" in msg and "41 coordinators" in msg and "8.0 GiB available" in msg, msg
    check_fits([RoleSpec("prefill"), RoleSpec("decode")], 2**20, 8 * GIB)  # the default shape fits
    check_fits(roles, 2**20, None)  # nothing known: Ray decides


def test_meminfo_parsing(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   16830604 kB\n")
    assert available_bytes(f) == 16830604 * 1024
    assert available_bytes(tmp_path / "missing") is None


@pytest.mark.skipif(available_bytes() is None, reason="no /proc/meminfo")
def test_cli_refuses_a_deployment_bigger_than_the_machine_before_starting_ray():
    replicas = available_bytes() // RANK_PROCESS_BYTES + 1
    # --num-cpus 1 is refused too (after this check): code without the check fails fast, never serves
    r = subprocess.run([sys.executable, "-m", "hyrax.cluster.cli", "serve", "--num-cpus", "1",
                        "--decode-replicas", str(replicas)],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hyrax: error: the deployment needs at least"), r.stderr
    assert "starting Ray" not in r.stderr


def test_pools_count_per_rank_and_name_the_flags():
    roles = [RoleSpec("prefill", 1, 1), RoleSpec("decode", 2, 2)]
    pools = {"prefill": GIB, "decode": 2 * GIB}
    assert needed_bytes(roles, 0, pools) - needed_bytes(roles, 0) == 1 * GIB + 4 * 2 * GIB
    with pytest.raises(HyraxInputError) as e:
        check_fits(roles, 0, 8 * GIB, pools)
    assert "9.00 GiB of state pools" in str(e.value) and "--mamba-slots" in str(e.value), str(e.value)


def test_a_rank_pool_bytes_match_the_pools_a_rank_allocates():
    """The check's pool bytes are the bytes an engine's pools hold, prefix-cache checkpoints too."""
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.pools import allocate_device_pools, pool_sizes_for
    from hyrax.actors.model.config import ModelConfig
    from hyrax.actors.model.state import derive_components
    from hyrax.cluster.local_memory import rank_pool_bytes
    from hyrax.cluster.serve import resolve_model_path

    cfg = ModelConfig.from_dir(resolve_model_path("demo"))
    config = EngineConfig(kv_capacity_tokens=512, mamba_slots=5)
    comps = derive_components(cfg)
    pools = allocate_device_pools(comps, pool_sizes_for(comps, config))
    assert rank_pool_bytes(cfg, config, 1) == sum(t.numel() * t.element_size() for t in pools.values())
    assert any(".checkpoint" in name or "checkpoint" in name for name in pools)  # the cache's pools are in


@pytest.mark.skipif(available_bytes() is None, reason="no /proc/meminfo")
def test_cli_refuses_pools_bigger_than_the_machine_before_starting_ray():
    """--mamba-slots 100000 on the demo model passed the check (pools were left out), and the
    ranks zero-filling ~10 GB each ran the machine out of memory, killed and restarted in a loop."""
    r = subprocess.run([sys.executable, "-m", "hyrax.cluster.cli", "serve", "--num-cpus", "1",
                        "--mamba-slots", "100000"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "GiB of state pools" in lines[0], r.stderr
    assert "starting Ray" not in r.stderr


def test_weight_bytes_count_only_the_files_the_loader_reads(tmp_path):
    """A stale copy beside model.safetensors is never loaded (loader.weight_files), so it must not
    count either: a lower bound that counts it refuses deployments that fit."""
    (tmp_path / "model.safetensors").write_bytes(b"w" * 1000)
    (tmp_path / "old-model.safetensors").write_bytes(b"s" * 5000)
    assert weight_bytes(tmp_path) == 1000
