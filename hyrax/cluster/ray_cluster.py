"""Start or join a Ray cluster. A local cluster stays on 127.0.0.1."""
from __future__ import annotations

import os


def init_ray(address: str | None = None, num_cpus: int | None = None, dashboard: bool = True,
             quiet: bool = True) -> bool:
    """Join `address`, or start a local single-node cluster. Returns True if started here."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # must precede `import ray`
    # Ray starts workers at niceness 15; rank actors are the serving hot path, not background work
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, namespace="hyrax", log_to_driver=not quiet)
        return False
    ray.init(num_cpus=num_cpus, namespace="hyrax", include_dashboard=dashboard,
             dashboard_host="127.0.0.1", log_to_driver=not quiet)
    return True


def dashboard_url() -> str | None:
    import ray

    try:
        url = ray.get_runtime_context().worker.node.address_info.get("webui_url")
    except Exception:  # noqa: BLE001 - best effort, only for printing
        return None
    return f"http://{url}" if url and not url.startswith("http") else url
