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
    assert refusal("--decode-replicas", str(replicas)).startswith("hyrax: error: the deployment needs at least")


def refusal(*flags: str) -> str:
    """The one line `hyrax serve --num-cpus 1 FLAGS` answers, refused before Ray starts (--num-cpus
    1 is refused too, after the memory check: code without the check fails fast, never serves)."""
    r = subprocess.run([sys.executable, "-m", "hyrax.cluster.cli", "serve", "--num-cpus", "1", *flags],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "starting Ray" not in r.stderr, r.stderr
    return lines[0]


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
    line = refusal("--mamba-slots", "100000")
    assert "GiB of state pools" in line, line


def test_weight_bytes_count_only_the_files_the_loader_reads(tmp_path):
    """A stale copy beside model.safetensors is never loaded (loader.weight_files), so it must not
    count either: a lower bound that counts it refuses deployments that fit."""
    (tmp_path / "model.safetensors").write_bytes(b"w" * 1000)
    (tmp_path / "old-model.safetensors").write_bytes(b"s" * 5000)
    assert weight_bytes(tmp_path) == 1000


def test_host_backup_pools_count_per_rank_and_name_the_option():
    """--host-pool-mb (each rank's host pool for retracted state) was left out of the bound."""
    roles = [RoleSpec("prefill", 1, 1), RoleSpec("decode", 2, 2)]
    backups = {"prefill": GIB, "decode": 2 * GIB}
    assert needed_bytes(roles, 0, backups=backups) - needed_bytes(roles, 0) == 1 * GIB + 4 * 2 * GIB
    with pytest.raises(HyraxInputError) as e:
        check_fits(roles, 0, 8 * GIB, backups=backups)
    msg = str(e.value)
    assert "9.00 GiB of host backup pools" in msg and "lower --host-pool-mb" in msg and "\n" not in msg, msg
    check_fits(roles, 0, 8 * GIB, backups={"prefill": 0, "decode": 0})  # without them it fits


@pytest.mark.parametrize("tp", [1, 2])
def test_a_rank_backup_pool_is_the_option_in_whole_rows(tp):
    """The bytes a rank's host pool holds (pools.host_pool_rows: the budget shared among the
    components, whole rows each): --host-pool-mb, less under a row of each component."""
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.model.config import ModelConfig
    from hyrax.actors.model.sharding import TP
    from hyrax.actors.model.state import derive_components
    from hyrax.cluster.local_memory import rank_backup_pool_bytes
    from hyrax.cluster.serve import resolve_model_path

    cfg = ModelConfig.from_dir(resolve_model_path("demo"))
    config = EngineConfig(host_pool_mb=100.0)
    row_bytes = sum(c.row_bytes for c in derive_components(cfg, TP(0, tp)))
    got = rank_backup_pool_bytes(cfg, config, tp, "cpu")
    assert 100 * 2**20 - row_bytes < got <= 100 * 2**20
    assert rank_backup_pool_bytes(cfg, EngineConfig(host_pool_mb=0.0), tp, "cpu") == 0


@pytest.mark.skipif(available_bytes() is None, reason="no /proc/meminfo")
def test_cli_refuses_a_host_pool_bigger_than_the_machine_before_starting_ray():
    """Two ranks with a host pool of the machine's available memory each passed the check."""
    mb = available_bytes() // 2**20
    line = refusal("--host-pool-mb", str(mb))
    assert line.startswith("hyrax: error: the deployment needs at least"), line
    assert "GiB of host backup pools (--host-pool-mb" in line and "lower --host-pool-mb" in line, line


@pytest.mark.skipif(available_bytes() is None, reason="no /proc/meminfo")
def test_cli_refuses_an_autoscaling_bound_bigger_than_the_machine_before_starting_ray():
    """The CPU check counts a scaling role at --max-replicas; the memory check counted only the
    replicas it starts with, so a bound the machine cannot hold passed it (Ray's memory monitor
    would kill the workers once the autoscaler reached it)."""
    replicas = available_bytes() // RANK_PROCESS_BYTES + 1
    line = refusal("--min-replicas", "1", "--max-replicas", str(replicas))
    assert line.startswith(f"hyrax: error: the deployment at its largest (--max-replicas {replicas}) needs at "
                           f"least"), line
