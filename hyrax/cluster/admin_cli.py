"""`hyrax admin`: a small client for the admin API (retract, resume, migrate, inspect)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.arg_types import is_bearer_token, non_empty, non_negative_int, positive_int

DEFAULT_TOKEN_FILE = Path.home() / ".hyrax" / "admin_token"


def add_parser(sub) -> None:
    p = sub.add_parser("admin", help="call the admin API of a running server",
                       description="Inspect and control a running Hyrax server through its admin API.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="gateway base URL")
    p.add_argument("--token-file", default=None, type=non_empty,
                   help=f"file holding the admin token (default: $HYRAX_ADMIN_TOKEN, else {DEFAULT_TOKEN_FILE}); "
                        f"a server started while another held that file wrote {DEFAULT_TOKEN_FILE.name}.<port> "
                        f"beside it (<port>: its --port; its banner names the file): pass that file here")
    acts = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    acts.add_parser("requests", help="list requests with state and indices (a retracted one: its backup, with checksums)")
    acts.add_parser("pools", help="pool usage per replica and component")
    acts.add_parser("health", help="each replica's state with its own health answer (last error, stuck reason)")
    acts.add_parser("events", help="the deployment controller's event log: replicas lost, hung, down, replaced, "
                                   "added, retired (newest last)")
    r = acts.add_parser("retract", help="retract requests")
    sel = r.add_mutually_exclusive_group(required=True)
    sel.add_argument("--id", action="append", dest="ids", help="request id (repeatable)")
    sel.add_argument("--count", type=positive_int)
    sel.add_argument("--all", action="store_true")
    r.add_argument("--mode", choices=["cpu_tensor", "host_pool", "recompute"])
    r.add_argument("--hold", action="store_true", help="keep them retracted until resumed")
    s = acts.add_parser("resume", help="resume held requests")
    s.add_argument("ids", nargs="+")
    f = acts.add_parser("forced-retraction", help="retract one request every N steps (0 = off)")
    f.add_argument("interval", type=non_negative_int)
    acts.add_parser("flush-cache", help="evict every cached prompt prefix no request is using")
    m = acts.add_parser("migrate", help="move a running request to another replica")
    m.add_argument("id")
    m.add_argument("--to", default=None, metavar="ROLE/REPLICA", help="e.g. decode/1 (default: least loaded)")
    d = acts.add_parser("drain", help="migrate everything off a replica and stop admitting to it")
    d.add_argument("replica", metavar="ROLE/REPLICA")
    d.add_argument("--undrain", action="store_true", help="admit to the replica again (ends a drain)")
    p.set_defaults(func=run)


def _token(a) -> str:
    """The admin token, checked before it goes into a header: what is not one (a wrong file) is an
    error naming where it came from, never showing it (it may be another secret)."""
    if a.token_file:
        path = Path(a.token_file)
    elif os.environ.get("HYRAX_ADMIN_TOKEN"):
        tok = os.environ["HYRAX_ADMIN_TOKEN"]
        if not is_bearer_token(tok):
            raise HyraxInputError("HYRAX_ADMIN_TOKEN is not an admin token: it must be printable ASCII, no space at "
                                  "either end")
        return tok
    else:
        path = DEFAULT_TOKEN_FILE
    try:
        tok = path.read_bytes().strip().decode("ascii", errors="replace")  # the line hyrax serve wrote
    except OSError:
        raise HyraxInputError(f"no admin token: set HYRAX_ADMIN_TOKEN or pass --token-file ({path} unreadable)") from None
    if not is_bearer_token(tok) or " " in tok:  # hyrax serve writes one word
        where = f"--token-file {path}" if a.token_file else f"the token file {path}"
        raise HyraxInputError(f"{where} does not hold an admin token (one line of printable ASCII without spaces, "
                              f"as hyrax serve writes it)")
    return tok


def _replica(text: str) -> dict:
    role, _, idx = text.partition("/")
    if not idx.isdigit():
        raise HyraxInputError(f"expected ROLE/REPLICA such as decode/0, got {text!r}")
    return {"role": role, "replica": int(idx)}


def _request(a) -> tuple[str, str, dict | None]:
    if a.action == "requests":
        return "GET", "/admin/requests", None
    if a.action == "pools":
        return "GET", "/admin/pools", None
    if a.action in ("health", "events"):
        return "GET", f"/admin/{a.action}", None
    if a.action == "retract":
        body = {"request_ids": a.ids} if a.ids else {"count": a.count} if a.count is not None else {"all": True}
        body.update({k: v for k, v in (("mode", a.mode), ("hold", a.hold or None)) if v})
        return "POST", "/admin/retract", body
    if a.action == "resume":
        return "POST", "/admin/resume", {"request_ids": a.ids}
    if a.action == "forced-retraction":
        return "POST", "/admin/forced-retraction", {"interval": a.interval}
    if a.action == "flush-cache":
        return "POST", "/admin/flush-cache", None
    if a.action == "migrate":
        body = {"request_id": a.id}
        if a.to:
            body["to"] = _replica(a.to)
        return "POST", "/admin/migrate", body
    return "POST", "/admin/drain", _replica(a.replica) | ({"undrain": True} if a.undrain else {})


def run(a: argparse.Namespace) -> int:
    import httpx

    method, path, body = _request(a)
    try:
        r = httpx.request(method, a.url.rstrip("/") + path, json=body, timeout=30,
                          headers={"Authorization": f"Bearer {_token(a)}"})
    except httpx.HTTPError as e:
        raise HyraxInputError(f"cannot reach {a.url}: {e}") from None
    try:
        answer = r.json()
    except ValueError:  # not the admin API answering
        raise HyraxInputError(f"{a.url} answered HTTP {r.status_code} without JSON: is it a hyrax server?") from None
    print(json.dumps(answer, indent=2))
    unknown = isinstance(answer, dict) and answer.get("unknown")  # retract/resume ids no replica knows
    refused = _refused(answer) or (_other_servers_token(a, r.url.port) if r.status_code == 401 else None)
    if refused:
        print(refused, file=sys.stderr)
    return 0 if r.is_success and not unknown and not refused else 1


def _other_servers_token(a, port: int | None) -> str | None:
    """For a 401 to the default token file's token: one line naming <default>.<port>, where a
    server started while another held the default file wrote its token, when that file is
    there. None otherwise (the token was chosen, or no such file)."""
    if a.token_file or os.environ.get("HYRAX_ADMIN_TOKEN") or port is None:
        return None
    theirs = DEFAULT_TOKEN_FILE.with_name(f"{DEFAULT_TOKEN_FILE.name}.{port}")
    if not theirs.is_file():
        return None
    return (f"hyrax admin: {a.url} refused the admin token of {DEFAULT_TOKEN_FILE}; a server on port {port} writes "
            f"its token to {theirs} while another holds that file: pass --token-file {theirs}")


def _refused(answer) -> str | None:
    """For a retract or resume answer: one line naming the requests it did not move, by outcome
    (a rank failed in the call, a request that was not running, ...); for a command sent to every
    replica (flush-cache, forced-retraction): one naming the replicas it did not reach (gone).
    None when it did all it was asked."""
    if isinstance(answer, dict) and isinstance(answer.get("replicas"), list):
        missed = [f"{r.get('role')}/{r.get('replica')}" for r in answer["replicas"]
                  if isinstance(r, dict) and r.get("reached") is False]
        if missed:
            return f"hyrax admin: {len(missed)} of {len(answer['replicas'])} replicas not reached: {', '.join(missed)}"
    if not isinstance(answer, dict) or not isinstance(answer.get("results"), dict):
        return None
    done = next((k for k in ("retracted", "resumed") if k in answer), None)
    if done is None:
        return None
    moved = set(answer[done])
    by_outcome: dict[str, list[str]] = {}
    for rid, outcome in answer["results"].items():
        if rid not in moved:
            by_outcome.setdefault(str(outcome), []).append(rid)
    if not by_outcome:
        return None
    left = sum(map(len, by_outcome.values()))
    why = "; ".join(f"{o} {', '.join(ids)}" for o, ids in sorted(by_outcome.items()))
    return f"hyrax admin: {left} of {len(answer['results'])} requests not {done}: {why}"
