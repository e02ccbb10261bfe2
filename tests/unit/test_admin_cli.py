"""`hyrax admin` turns its arguments into the admin API's requests."""
from __future__ import annotations

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster import admin_cli
from hyrax.cluster.cli import build_parser


def _req(*argv):
    return admin_cli._request(build_parser().parse_args(["admin", *argv]))


def test_admin_actions_map_to_admin_endpoints():
    assert _req("requests") == ("GET", "/admin/requests", None)
    assert _req("retract", "--count", "2", "--mode", "host_pool", "--hold") == (
        "POST", "/admin/retract", {"count": 2, "mode": "host_pool", "hold": True})
    assert _req("retract", "--id", "a", "--id", "b") == ("POST", "/admin/retract", {"request_ids": ["a", "b"]})
    assert _req("resume", "a") == ("POST", "/admin/resume", {"request_ids": ["a"]})
    assert _req("forced-retraction", "3") == ("POST", "/admin/forced-retraction", {"interval": 3})
    assert _req("migrate", "a", "--to", "decode/1") == (
        "POST", "/admin/migrate", {"request_id": "a", "to": {"role": "decode", "replica": 1}})
    assert _req("drain", "decode/0") == ("POST", "/admin/drain", {"role": "decode", "replica": 0})
    assert _req("drain", "decode/0", "--undrain") == (  # a drain the CLI starts, the CLI can end
        "POST", "/admin/drain", {"role": "decode", "replica": 0, "undrain": True})


def test_bad_replica_reference_is_a_clear_error():
    with pytest.raises(HyraxInputError, match="ROLE/REPLICA"):
        _req("drain", "decode")
