"""Helpers for the tests that run the real `hyrax serve` command in a subprocess."""
from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from e2e_harness import wait_until


def wait_serving(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    """Until `url`/health answers 200; a server that exits first fails with its log's tail."""
    def up():
        if proc.poll() is not None:
            raise AssertionError(f"hyrax serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout, interval=0.5, what=f"{url}/health")
