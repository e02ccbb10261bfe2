"""Helpers for the tests that run the real `hyrax serve` command in a subprocess: waiting for it
to serve is shared with the multi-node tests (hyrax/testing/multinode.py)."""
from __future__ import annotations

from hyrax.testing.multinode import wait_serving  # noqa: F401 - re-exported to the e2e tests
