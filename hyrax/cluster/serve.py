"""`hyrax serve`: start (or join) Ray, deploy the model's role replicas, serve the gateway."""
from __future__ import annotations

import argparse
import errno
import fcntl
import os
import reprlib
import secrets
import signal
import socket
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from hyrax import heap
from hyrax.actors import cpu_claims
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.demo import default_served_name, resolve_model_path
from hyrax.actors.model.errors import HyraxInputError, StartupFailure
from hyrax.actors.model.sharding import check_tp
from hyrax.cluster.arg_types import (FlagsWinAppend, OneLineParser, bearer_token, is_bearer_token, non_empty,
                                      non_negative_float, positive_float, positive_int, printable_name,
                                      timeout_seconds)
from hyrax.cluster.api_keys import resolve_api_keys
from hyrax.cluster.engine_args import add_engine_args, engine_config_from_args
from hyrax.cluster.local_memory import (available_bytes, check_fits, rank_backup_pool_bytes, rank_pool_bytes,
                                        weight_bytes)
from hyrax.cluster.placement import RoleSpec, cpus_needed, namespace
from hyrax.cluster.ray_cluster import gcs_alive, local_num_cpus
from hyrax.env import admin_token as env_admin_token
from hyrax.env import torch_threads

DEFAULT_TOKEN_FILE = Path.home() / ".hyrax" / "admin_token"
# the autoscaling flags: (lower, upper) bound flags, and the role they scale (None: the last
# role, decode or colocated)
SCALING_FLAGS = (("--min-replicas", "--max-replicas", None), ("--min-prefill-replicas", "--max-prefill-replicas", "prefill"))


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API on a Ray cluster",
                       description="Deploy a hybrid model on Ray and serve the OpenAI and admin APIs.")
    p.add_argument("--config", help="YAML file whose keys are these options' long names (CLI flags win)")
    p.add_argument("--model", default="demo", type=non_empty, help="checkpoint directory, a Hugging Face repo id in the local cache "
                   "(org/name[@revision], never downloaded), or 'demo' (default)")
    p.add_argument("--served-model-name", type=printable_name, default=None,
                   help="name clients use, without control characters (default: 'hyrax-demo', the dir name or the repo id)")
    p.add_argument("--address", default=None, type=non_empty,
                   help="join this Ray cluster (default: start a local one on 127.0.0.1; RAY_ADDRESS set without "
                        "--address is an error, not a local cluster)")
    p.add_argument("--deployment", default="hyrax",
                   help="name of the deployment on the Ray cluster; without --attach, one of that name must not exist yet")
    p.add_argument("--attach", action="store_true",
                   help="serve the existing deployment of that name (deploying it with this command's shape if the "
                        "cluster has none yet) and leave it running on exit; needs --address")
    p.add_argument("--num-cpus", type=positive_int, default=None,
                   help="logical CPUs of a local Ray cluster (default: one per TP rank of the deployment)")
    p.add_argument("--placement-wait", type=non_negative_float, default=0.0,
                   help="seconds to wait for room on a joined cluster (nodes still joining) before failing; "
                        "default 0: a deployment that does not fit fails at once, naming what is missing; "
                        "more than 0 needs --address")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    shape = p.add_argument_group("deployment shape")
    shape.add_argument("--colocated", action="store_true",
                       help="one role that does prefill and decode (default: separate prefill and decode roles)")
    shape.add_argument("--replicas", type=positive_int, default=None,
                       help="replicas of the colocated role (default 1; only with --colocated)")
    shape.add_argument("--tp", type=positive_int, default=None,
                       help="TP size of the colocated role (default 1; only with --colocated)")
    shape.add_argument("--prefill-replicas", type=positive_int, default=None)
    shape.add_argument("--prefill-tp", type=positive_int, default=None)
    shape.add_argument("--decode-replicas", type=positive_int, default=None)
    shape.add_argument("--decode-tp", type=positive_int, default=None)
    for lo, hi, role in SCALING_FLAGS:
        shape.add_argument(lo, type=int, default=None,
                           help=f"autoscale the {role or 'decode (or colocated)'} role between this many replicas and "
                                f"{hi}, on queue depth"
                                + (f", prompts held (more than {PREFILL_HELD_PER_REPLICA:g} a replica),"
                                   if role == "prefill" else "")
                                + " and pool usage; a replica scaled down is drained by live migration")
        shape.add_argument(hi, type=int, default=None, help=f"upper bound of {lo}' autoscaling")
    shape.add_argument("--hung-replica-timeout", type=positive_float, default=15.0,
                       help="seconds a replica may leave the controller's health checks unanswered before it "
                            "counts as hung and is killed and replaced like a dead one (its requests are rebuilt "
                            "on other replicas)")
    gw = p.add_argument_group("gateway")
    gw.add_argument("--admin-token-file", default=None, type=non_empty,
                    help=f"where a generated admin token is written (default {DEFAULT_TOKEN_FILE}; while another "
                         f"running hyrax serve holds that default file, {DEFAULT_TOKEN_FILE.name}.<port> beside it, "
                         f"<port> being --port; a given file that a running server holds is an error; nothing is "
                         f"written when HYRAX_ADMIN_TOKEN is set)")
    gw.add_argument("--api-key", type=bearer_token, action=FlagsWinAppend, default=[],
                    help="require this API key on /v1 (repeatable; keys given here replace those of --config); "
                         "`ps` shows it until Ray starts: HYRAX_API_KEY or --api-key-file keep it off the "
                         "command line (one way at a time)")
    gw.add_argument("--api-key-file", default=None, type=non_empty, metavar="PATH",
                    help="require the API keys of this file on /v1: one key a line, a file of your own that "
                         "no other user can read or write (mode 600 or 400)")
    gw.add_argument("--max-inflight", type=positive_int, default=1024, help="queued + running requests before 503")
    gw.add_argument("--cache-route-margin", type=int, default=4, metavar="N",
                    help="route a new request to the prefill (or colocated) replica with the longest cached "
                         "prefix unless it has more than N requests in flight beyond the least-loaded one "
                         "(default 4; -1 routes by load alone)")
    gw.add_argument("--max-body-mb", type=positive_float, default=4.0)
    gw.add_argument("--grace-period", type=non_negative_float, default=10.0,
                    help="on shutdown, seconds open streams get to finish; then each still open ends "
                         "with finish_reason \"abort\" and [DONE]")
    gw.add_argument("--rank-timeout", type=timeout_seconds, default=60.0,
                    help="seconds before a silent rank counts as failed")
    gw.add_argument("--gateway-lease", type=positive_float, default=10.0,
                    help="seconds a replica keeps this gateway's streams after its last sign of life; a gateway "
                         "that dies has its requests aborted and freed on every replica once it runs out")
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


CONFIG_MAX_BYTES = 1 << 20  # a config file is a page of options; more is the wrong file (weights, /dev/zero)
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


def apply_yaml(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Load --config (if any) as parser defaults, so explicit flags still override it."""
    pre = OneLineParser(prog=parser.prog, add_help=False)
    pre.add_argument("--config", action="append")
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return
    if len(known.config) > 1:  # argparse would keep the last, dropping the others silently
        raise HyraxInputError("--config is given twice; one file holds the options (flags override it)")
    known.config = known.config[0]
    if not known.config:
        raise HyraxInputError("--config needs a file name, got ''")
    try:
        with open(known.config, "rb") as f:
            raw = f.read(CONFIG_MAX_BYTES + 1)
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
    except OSError as e:
        raise HyraxInputError(f"cannot read --config: {e.strerror}") from None
    if len(raw) > CONFIG_MAX_BYTES:
        raise HyraxInputError(f"--config {known.config} is larger than {CONFIG_MAX_BYTES >> 20} MiB: not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HyraxInputError(f"--config is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start}") from None
    actions = {a.dest: a for a in parser._actions}
    defaults, lines = {}, {}
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and not isinstance(node, yaml.MappingNode):
            raise HyraxInputError("--config must be a YAML mapping of option names to values")
        for key_node, value_node in (node.value if node is not None else []):
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                raise HyraxInputError(f"--config: line {line}: a key must be an option name, not a list or mapping")
            k = key_node.value
            dest = k.replace("-", "_")
            if dest not in actions or dest in ("config", "help"):
                raise HyraxInputError(f"--config: unknown option {k!r}"
                                      f"{_negated_switch(actions, dest, loader.construct_object(value_node, True))}")
            if dest in lines:  # a YAML loader keeps the last one, silently
                raise HyraxInputError(f"--config: {k} is given twice (lines {lines[dest]} and {line})")
            lines[dest] = line
            defaults[dest] = _yaml_default(actions[dest], k, _as_written(loader, value_node))
    except yaml.YAMLError as e:
        raise HyraxInputError(f"--config is not valid YAML: {_yaml_problem(e)}") from None
    finally:
        loader.dispose()
    if "api_key" in defaults and mode & 0o077:  # as --api-key-file: a key others can read is anyone's
        raise HyraxInputError(f"--config {known.config} holds api-key but other users can read or write it "
                              f"(mode {mode:o}): chmod 600 it, or give the key with HYRAX_API_KEY or --api-key-file")
    parser.set_defaults(**defaults)


def _as_written(loader: yaml.SafeLoader, node: yaml.Node, seen: dict | None = None):
    """The value of `node`, except that a bare number is its text as written: the option's own
    type reads it as it reads the flag's text. YAML 1.1 reads `010` as 8, `1.10` as 1.1, `0x1F`
    as 31 and `1:30` as 90, which made `deployment: 010` the deployment '8' and `api-key: 0123`
    the key '83'. A node reached again through an alias is the same value again (`seen`), as YAML
    builds it: walked once per reference, nested aliases (billion laughs: 9 levels of 9) took
    9**8 steps, half a minute, before the value was refused."""
    seen = {} if seen is None else seen
    if id(node) in seen:
        return seen[id(node)]
    if isinstance(node, yaml.ScalarNode) and node.style is None and node.tag in _NUMBER_TAGS:
        return node.value
    if isinstance(node, yaml.SequenceNode) and node.tag == "tag:yaml.org,2002:seq":  # a tagged one: constructed
        out: list = []
        seen[id(node)] = out  # before its items: an alias of itself inside is this list
        out.extend(_as_written(loader, n, seen) for n in node.value)
        return out
    return loader.construct_object(node, deep=True)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error on one line, by line and column, without the excerpt of the file that its
    message quotes (the line may hold an API key)."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return str(e).splitlines()[0] if str(e) else type(e).__name__

    def at(mark) -> str:
        return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""

    parts = []
    if e.context:
        parts.append(f"{e.context}{at(e.context_mark)}")
    if e.problem:
        parts.append(f"{e.problem}{at(e.problem_mark)}")
    return ": ".join(parts) or type(e).__name__


def _negated_switch(actions: dict, dest: str, value) -> str:
    """For a key spelled as an on/off switch's `--no-` flag (`no-prefix-cache`), the spelling the
    file takes: the switch's own name with the opposite boolean."""
    name = dest.removeprefix("no_")
    if name == dest or not isinstance(actions.get(name), argparse.BooleanOptionalAction):
        return ""
    return f"; write {name.replace('_', '-')}: {'true' if value is False else 'false'}"


def _yaml_default(action: argparse.Action, key: str, value):
    """`value` (the YAML of --config's `key`) as the parser default it stands for, checked and
    converted as the flag's own value would be: a default set as it is would skip argparse's
    conversion, and `deterministic: "false"` would switch deterministic mode on, `max-running:
    3.7` would reach the engine as a float."""
    if action.nargs == 0:  # an on/off switch
        if not isinstance(value, bool):
            raise HyraxInputError(f"--config: {key} must be true or false, got {_shown(action, value)}")
        return value
    if isinstance(action, argparse._AppendAction):  # a repeatable flag: one value or a list
        if value == []:  # an empty template: without a word, `api-key: []` served /v1 with no key
            raise HyraxInputError(f"--config: {key} is an empty list; leave the key out to give none")
        return [_yaml_scalar(action, key, v) for v in (value if isinstance(value, list) else [value])]
    return _yaml_scalar(action, key, value)


# how an error shows a value of the file: bounded, for a value built of nested aliases (billion
# laughs: shared references when loaded, gigabytes of text when printed in full)
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother = 2, 4, 4, 60, 60


def _shown(action: argparse.Action, value) -> str:
    """`value` for an error message: never a secret's (--api-key), and never long."""
    return "(not shown: a secret)" if action.type is bearer_token else _SHORT.repr(value)


def _yaml_scalar(action: argparse.Action, key: str, value):
    if value is None or isinstance(value, (bool, list, dict)):
        raise HyraxInputError(f"--config: {key} needs one value (a string or a number), got {_shown(action, value)}")
    try:
        out = (action.type or str)(str(value))
    except argparse.ArgumentTypeError as e:  # a ranged type: its message names what it needs
        raise HyraxInputError(f"--config: {key} {e}") from None
    except (ValueError, TypeError):
        kind = getattr(action.type, "__name__", "value")
        raise HyraxInputError(f"--config: {key} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, "
                              f"got {_shown(action, value)}") from None
    if action.choices is not None and out not in action.choices:
        raise HyraxInputError(f"--config: {key} must be one of {', '.join(map(str, action.choices))}, "
                              f"got {_shown(action, value)}")
    return out


def roles_from_args(a, cfg: ModelConfig):
    pd = any(x is not None for x in (a.prefill_replicas, a.prefill_tp, a.decode_replicas, a.decode_tp))
    if pd and a.colocated:
        raise HyraxInputError("--colocated cannot be combined with --prefill-*/--decode-* options")
    given = [f for f, v in (("--replicas", a.replicas), ("--tp", a.tp)) if v is not None]
    if given and not a.colocated:
        raise HyraxInputError(f"{' and '.join(given)}: only with --colocated (the colocated role's shape); without it "
                              f"use --prefill-replicas/--prefill-tp and --decode-replicas/--decode-tp")

    def one(v):  # left out: one replica, TP 1
        return 1 if v is None else v

    if a.colocated:
        roles = [RoleSpec("colocated", one(a.replicas), one(a.tp))]
    else:  # the default shape: one prefill and one decode replica
        roles = [RoleSpec("prefill", one(a.prefill_replicas), one(a.prefill_tp)),
                 RoleSpec("decode", one(a.decode_replicas), one(a.decode_tp))]
    for r in roles:
        check_tp(cfg, r.tp)
    return roles


def bind_gateway(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound before anything else starts: a busy port is a
    one-line error before anything starts, not a failure after Ray and every replica came up."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise HyraxInputError(f"--host {host!r}: {e.strerror}") from None
    # protocol TCP named, not 0: asyncio turns Nagle's algorithm off only on connections whose
    # socket says IPPROTO_TCP, and with it on, each small write of a stream (headers, a chunk a
    # step) waited for the client's delayed ACK of the one before (40 ms on Linux)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart rebinds over TIME_WAIT
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupFailure(f"{host}:{port} is already in use (another hyrax serve?); "
                                 f"stop it or choose another --port") from None
        raise StartupFailure(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


@dataclass
class AdminToken:
    token: str
    where: str  # for the banner; never the token itself
    lock_fd: int | None = None  # the token file, locked for as long as this server runs

    def release(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def _claim(path: Path, given: bool) -> int | None:
    """Open `path` (created 600 if missing) holding an exclusive lock, or None when a running
    server holds it. Nothing is truncated before the lock is ours; the kernel drops the lock
    when this process exits, however it exits. `given`: the path is --admin-token-file's."""
    try:
        if not path.parent.exists():  # a parent that is a file is os.open's 'Not a directory'
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        st = os.fstat(fd)
    except OSError as e:
        raise HyraxInputError(f"cannot write the admin token to {path}: {e.strerror}") from None
    where = f"--admin-token-file {path}" if given else f"the admin token file {path}"
    if not stat.S_ISREG(st.st_mode):  # /dev/null, /proc/...: no place for a token (nor a lock)
        os.close(fd)
        raise HyraxInputError(f"{where} is not a regular file")
    if st.st_uid != os.geteuid():  # its owner can make it readable again at any time
        os.close(fd)
        raise HyraxInputError(f"{where} belongs to another user (uid {st.st_uid}); choose a file of your own")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def resolve_admin_token(a) -> AdminToken:
    """HYRAX_ADMIN_TOKEN, else a fresh token written to the token file. A running server keeps
    its token file locked: an explicit --admin-token-file that is locked is an error, and the
    default file, when locked, leaves it alone and uses <default>.<port> instead."""
    if os.environ.get("HYRAX_ADMIN_TOKEN") == "":  # an empty Secret or exported unset variable, not a choice
        raise HyraxInputError("HYRAX_ADMIN_TOKEN is set but empty: give a token, or unset it to have one generated")
    tok = env_admin_token()
    if tok and not is_bearer_token(tok):  # no client could send it
        raise HyraxInputError("HYRAX_ADMIN_TOKEN must be printable ASCII, no space at either end")
    if tok:
        return AdminToken(tok, "from HYRAX_ADMIN_TOKEN")
    path = Path(a.admin_token_file) if a.admin_token_file else DEFAULT_TOKEN_FILE
    fd = _claim(path, bool(a.admin_token_file))
    if fd is None and a.admin_token_file:
        raise StartupFailure(f"--admin-token-file {path} holds the token of a running hyrax serve; "
                             f"choose another file or set HYRAX_ADMIN_TOKEN")
    if fd is None:
        path = path.with_name(f"{path.name}.{a.port}")
        fd = _claim(path, False)
        if fd is None:  # unreachable while the port is ours, unless it is shared with another host's server
            raise StartupFailure(f"{path} holds the token of a running hyrax serve; set HYRAX_ADMIN_TOKEN")
    tok = secrets.token_urlsafe(32)
    try:  # private before the token goes in: an existing file may have been readable by everyone
        os.ftruncate(fd, 0)
        os.fchmod(fd, 0o600)
        os.pwrite(fd, (tok + "\n").encode(), 0)
    except OSError as e:
        os.close(fd)
        raise HyraxInputError(f"cannot write the admin token to {path}: {e.strerror}") from None
    return AdminToken(tok, f"written to {path} (mode 600)", fd)


PREFILL_HELD_PER_REPLICA = 8.0  # prompts in prefill per replica above which the prefill role adds one


def scale_policies(a, roles: list[RoleSpec]) -> dict:
    """Role -> its autoscaling policy, for every role whose bounds are given."""
    from hyrax.cluster.autoscale import ScalePolicy

    out = {}
    for lo_flag, hi_flag, role_name in SCALING_FLAGS:
        lo, hi = (getattr(a, f.removeprefix("--").replace("-", "_")) for f in (lo_flag, hi_flag))
        if lo is None and hi is None:
            continue
        if lo is None or hi is None:
            raise HyraxInputError(f"{lo_flag} and {hi_flag} go together")
        role = roles[-1] if role_name is None else next((r for r in roles if r.name == role_name), None)
        if role is None:
            raise HyraxInputError(f"{lo_flag} scales the {role_name} role, which a --colocated deployment does not have")
        if not 1 <= lo <= hi:
            raise HyraxInputError(f"{lo_flag} {lo} and {hi_flag} {hi}: need 1 <= min <= max")
        if not lo <= role.replicas <= hi:
            raise HyraxInputError(f"{role.name} starts with {role.replicas} replica(s), outside {lo_flag} "
                                  f"{lo} .. {hi_flag} {hi}")
        # a prefill replica's load is the prompts it holds (it admits them at once)
        out[role.name] = ScalePolicy(lo, hi, up_held_per_replica=PREFILL_HELD_PER_REPLICA if role.name == "prefill"
                                     else None)
    return out


def supervision_from_args(a):
    from hyrax.cluster.supervision import Supervision

    return Supervision(health_timeout_s=min(5.0, a.hung_replica_timeout), hung_after_s=a.hung_replica_timeout)


def validate(a) -> tuple:
    """Everything checked before anything starts."""
    config = engine_config_from_args(a)
    path = resolve_model_path(a.model)
    cfg = ModelConfig.from_dir(path)
    roles = roles_from_args(a, cfg)
    policies = scale_policies(a, roles)
    supervision_from_args(a)
    torch_threads()  # read by every rank: a bad value is an error here, not a replica that dies
    if not 0 < a.port < 65536:
        raise HyraxInputError("--port must be in 1..65535")
    if a.cache_route_margin < -1:
        raise HyraxInputError("--cache-route-margin must be >= 0, or -1 to route by load alone")
    if a.max_body_mb * 2**20 < 1:  # the parser checked > 0; less than a byte would refuse every POST
        raise HyraxInputError(f"--max-body-mb {a.max_body_mb:g} is less than one byte")
    if a.attach and not a.address:
        raise HyraxInputError("--attach serves a deployment on an existing Ray cluster: pass --address too")
    namespace(a.deployment)  # a usable name
    if a.address and a.num_cpus is not None:
        raise HyraxInputError("--num-cpus sizes a local cluster; it cannot be combined with --address")
    if not a.address and a.placement_wait > 0:  # no node joins the local cluster: the wait would do nothing
        raise HyraxInputError("--placement-wait waits for nodes to join a cluster: it needs --address")
    if not a.address and os.environ.get("RAY_ADDRESS"):  # Ray's CLI would join it; a local cluster would not
        raise HyraxInputError(f"RAY_ADDRESS is set ({os.environ['RAY_ADDRESS']!r}) but hyrax serve joins a cluster "
                              f"only with --address: pass --address to join it, or unset RAY_ADDRESS for a local one")
    if not a.address:
        biggest = largest(roles, policies)  # what the autoscaler may grow it to must fit too
        check_fits(biggest, weight_bytes(path), available_bytes(), host_pools(cfg, config, roles),
                   backup_pools(cfg, config, roles),  # more than it holds
                   "the deployment" if biggest == roles else f"the deployment at its largest ({_bounds_given(a)})")
        local_num_cpus(cpus_needed(largest(roles, policies)), a.num_cpus)  # --num-cpus too small for the deployment
    name = default_served_name(a.model) if a.served_model_name is None else a.served_model_name
    return config, path, cfg, roles, name


def host_pools(cfg, config, roles: list[RoleSpec]) -> dict[str, int] | None:
    """One rank's state-pool bytes by role when the ranks keep their pools in host memory (no
    CUDA on this machine); None when they are on GPUs."""
    import torch

    if torch.cuda.is_available():
        return None
    return {r.name: rank_pool_bytes(cfg, config, r.tp) for r in roles}


def backup_pools(cfg, config, roles: list[RoleSpec]) -> dict[str, int]:
    """One rank's host backup pool bytes (--host-pool-mb) by role: in host memory wherever the
    ranks compute."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {r.name: rank_backup_pool_bytes(cfg, config, r.tp, device) for r in roles}


def _bounds_given(a) -> str:
    """The upper autoscaling bounds given, as flags: "--max-replicas 8, --max-prefill-replicas 2"."""
    hi = [(f, getattr(a, f.removeprefix("--").replace("-", "_"))) for _, f, _ in SCALING_FLAGS]
    return ", ".join(f"{f} {n}" for f, n in hi if n is not None)


def largest(roles: list[RoleSpec], policies: dict) -> list[RoleSpec]:
    """The deployment at its largest: every scaling role at its upper bound."""
    return [RoleSpec(r.name, policies[r.name].max_replicas, r.tp) if r.name in policies else r for r in roles]


def run(a: argparse.Namespace) -> int:
    config, path, cfg, roles, name = validate(a)
    api_keys = resolve_api_keys(a)
    sock = bind_gateway(a.host, a.port)  # first: nothing starts (and no token is written) on a busy port
    try:
        if not api_keys and not is_loopback(sock):
            print(f"hyrax: warning: --host {a.host} accepts connections from other machines and no API key is "
                  f"given: the OpenAI routes (/v1, /tokenize, /detokenize) are open to whoever reaches it (/admin "
                  f"still needs the admin token); give HYRAX_API_KEY, --api-key-file or --api-key",
                  file=sys.stderr, flush=True)
        token = resolve_admin_token(a)
        try:
            return _deploy_and_serve(a, sock, token, api_keys, config, path, roles, name)
        finally:
            token.release()
    finally:
        sock.close()


def is_loopback(sock: socket.socket) -> bool:
    """Whether the bound `sock` takes connections from this machine only (127.0.0.0/8, ::1)."""
    import ipaddress

    host = sock.getsockname()[0].partition("%")[0]  # an IPv6 zone id is no part of the address
    addr = ipaddress.ip_address(host)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:  # ::ffff:127.0.0.1
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _deploy_and_serve(a, sock: socket.socket, token: AdminToken, api_keys: tuple[str, ...], config, path, roles,
                      name) -> int:
    from hyrax.cluster.ray_cluster import (attach_command, cluster_address, cluster_endpoints, dashboard_url,
                                           init_ray, prepare_env)

    prepare_env(a.address)  # before the imports below import ray
    hide_secrets_in_cmdline(sys.argv)  # before Ray records the command line as this driver's entrypoint
    from hyrax.api.app import GatewaySettings, create_app
    from hyrax.cluster import controller
    from hyrax.cluster.cluster_watch import ClusterWatch
    from hyrax.cluster.gateway_server import GatewayServer
    from hyrax.cluster.ray_client import GatewayLease, Membership, client_for

    num_cpus = None
    if not a.address:
        num_cpus, note = local_num_cpus(cpus_needed(largest(roles, scale_policies(a, roles))), a.num_cpus)
        if note:
            print(f"hyrax: {note}", file=sys.stderr)
    print(f"hyrax: starting Ray ({'joining ' + a.address if a.address else 'local, 127.0.0.1'}) ...", file=sys.stderr)
    started_ray = init_ray(a.address, num_cpus)
    import ray

    owner = not a.attach  # a server that deployed its replicas tears them down on exit; an attached one never
    ctl, lease = None, None
    gone: list[str] = []  # why the deployment went away under this gateway, once it did
    try:
        ctl = controller.create(a.deployment, str(path), name, roles, config, a.rank_timeout, attach=a.attach,
                                scaling=scale_policies(a, roles), supervision=supervision_from_args(a))
        shape = ', '.join(f'{r.name} x{r.replicas} (tp={r.tp})' for r in roles)
        print(f"hyrax: {'attaching to' if a.attach else 'deploying'} {a.deployment!r}"
              f"{'' if a.attach else ': ' + shape} ...", file=sys.stderr)
        dep = controller.ensure(ctl, wait_for_room_s=a.placement_wait)
        name = dep.served_name
        lease = GatewayLease([r.coordinator for r in dep.replicas], a.gateway_lease).start()
        client = client_for(dep, name, a.max_inflight, lease=lease,
                            cache_route_margin=None if a.cache_route_margin < 0 else a.cache_route_margin)
        app = create_app(client, GatewaySettings(admin_token=token.token, api_keys=api_keys,
                                                 max_body_bytes=int(a.max_body_mb * 2**20)),
                         deployment_events=_events_of(ctl))

        def stop_serving(why: str) -> None:  # the membership task found the deployment torn down
            gone.append(why)
            print(f"hyrax: {why}", file=sys.stderr, flush=True)
            server.should_exit = True  # uvicorn stops as on a signal: open streams end cleanly
        def cluster_lost(why: str) -> None:  # the cluster's GCS and this node's raylet are gone
            if server.should_exit:  # stopping already (a signal to the whole group stopped the cluster too)
                return
            stop_serving(why)
            for b in client.backends:  # the replicas went with the cluster: nothing more comes from them
                b.cut_streams("the Ray cluster serving this request is gone")
            server.hurry = True  # and there is nothing to wait for
        app = _with_task(app, Membership(ctl, client, lease, dep.generation, on_gone=stop_serving,
                                         on_added=keep_off_ranks).run)
        endpoints = cluster_endpoints()
        if endpoints is not None:
            app = _with_task(app, ClusterWatch(endpoints, cluster_lost).run)
        base = gateway_url(a.host, a.port)
        print(f"hyrax: serving {name!r}\n"
              f"  OpenAI API      {base}/v1\n"
              f"  live dashboard  {base}/dashboard\n"
              f"  metrics         {base}/metrics\n"
              f"  Ray dashboard   {dashboard_url() or 'n/a'}\n"
              f"  Ray cluster     {cluster_address() or 'n/a'} (another gateway: {attach_command()})\n"
              f"  admin token     {token.where}", file=sys.stderr, flush=True)
        server = GatewayServer(app, client, a.grace_period, log_level="warning")
        heap.settle()  # what the gateway keeps for its life: later collections skip it (heap.py)
        keep_off_ranks()  # the ranks' CPUs are theirs (cpu_claims.py)
        try:
            server.run(sockets=[sock])  # the socket bound at the start
        except SystemExit as e:  # uvicorn re-raises SIGTERM/SIGINT after draining; Ray maps it to exit
            if e.code not in (None, 0, signal.SIGTERM, signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT):
                raise
        if not server.started:
            raise StartupFailure("the gateway failed to start (see the log above)")
    finally:
        if lease is not None:
            lease.stop()
        cluster_up = gcs_alive() if (ctl is not None and owner) or started_ray or gone else True
        if ctl is not None and owner and cluster_up:
            print("hyrax: stopping replicas ...", file=sys.stderr)
            controller.tear_down(ctl)
        if not cluster_up:  # stopped with us (a signal to the whole process group), or lost: nothing to tear down
            if not gone:  # (a cluster lost said so already)
                print("hyrax: the Ray cluster already stopped; exiting", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1 if gone else 0)  # Ray's exit hook would wait a minute for the GCS
        if started_ray:
            ray.shutdown()
    return 1 if gone else 0


SECRET_FLAGS = ("--api-key",)


def without_secrets(argv: list[str]) -> list[str]:
    """`argv` with the value of every secret option (an abbreviation argparse takes, `--ap`, and
    `--api-key=KEY` included) written as ***."""
    def secret(opt: str) -> bool:
        return len(opt) >= 4 and any(flag.startswith(opt) for flag in SECRET_FLAGS)

    out, hide = [], False
    for arg in argv:
        opt, eq, _ = arg.partition("=")
        out.append("***" if hide else f"{opt}=***" if eq and secret(opt) else arg)
        hide = not hide and not eq and secret(opt)
    return out


def hide_secrets_in_cmdline(argv: list[str]) -> None:
    """Rewrite this process's command line (/proc/self/cmdline, what `ps` shows) without the
    secret options' values: Ray records a driver's command line as its job's entrypoint, shown
    on the Ray dashboard and by `ray list jobs` to whoever reaches the cluster."""
    shown = without_secrets(argv)
    if shown == argv:
        return
    import shlex

    from ray._raylet import setproctitle

    setproctitle(shlex.join([sys.executable, *shown]))


def keep_off_ranks() -> None:
    """Run every thread of this (the gateway's) process off the CPUs ranks on this machine
    claimed (cpu_claims.py): once the deployment is up, and again when replicas are added."""
    cpu_claims.keep_off(cpu_claims.claimed())


def gateway_url(host: str, port: int) -> str:
    """The gateway's base URL for the banner: an IPv6 literal in brackets (RFC 3986), its zone
    id's '%' escaped (RFC 6874)."""
    return f"http://[{host.replace('%', '%25')}]:{port}" if ":" in host else f"http://{host}:{port}"


def _events_of(ctl):
    """`GET /admin/events`' source: the controller's event page, asked through Ray."""
    async def page():
        return await ctl.event_page.remote()
    return page


def _with_task(app, task):
    """`app`, starting `task()` on the server's event loop when the server starts (the gateway's
    membership refresh: replicas the controller adds or retires)."""
    import asyncio

    started = []

    async def wrapped(scope, receive, send):
        if not started:
            started.append(asyncio.ensure_future(task()))
        await app(scope, receive, send)

    return wrapped
