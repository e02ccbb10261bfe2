"""`hyrax serve`: start (or join) Ray, deploy the model's role replicas, serve the gateway."""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
from pathlib import Path

import yaml

from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.demo import resolve_model_path
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.sharding import check_tp
from hyrax.cluster.engine_args import add_engine_args, engine_config_from_args
from hyrax.env import admin_token as env_admin_token

DEFAULT_TOKEN_FILE = Path.home() / ".hyrax" / "admin_token"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API on a Ray cluster",
                       description="Deploy a hybrid model on Ray and serve the OpenAI and admin APIs.")
    p.add_argument("--config", help="YAML file whose keys are these options' long names (CLI flags win)")
    p.add_argument("--model", default="demo", help="checkpoint directory, or 'demo' (default)")
    p.add_argument("--served-model-name", default=None, help="name clients use (default: 'hyrax-demo' or the dir name)")
    p.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one on 127.0.0.1)")
    p.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of a local Ray cluster")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    shape = p.add_argument_group("deployment shape")
    shape.add_argument("--colocated", action="store_true",
                       help="one role that does prefill and decode (default: separate prefill and decode roles)")
    shape.add_argument("--replicas", type=int, default=1, help="replicas of the colocated role")
    shape.add_argument("--tp", type=int, default=1, help="TP size of the colocated role")
    shape.add_argument("--prefill-replicas", type=int, default=None)
    shape.add_argument("--prefill-tp", type=int, default=None)
    shape.add_argument("--decode-replicas", type=int, default=None)
    shape.add_argument("--decode-tp", type=int, default=None)
    gw = p.add_argument_group("gateway")
    gw.add_argument("--admin-token-file", default=None,
                    help=f"where a generated admin token is written (default {DEFAULT_TOKEN_FILE})")
    gw.add_argument("--api-key", action="append", default=[], help="require this API key on /v1 (repeatable)")
    gw.add_argument("--max-inflight", type=int, default=1024, help="queued + running requests before 503")
    gw.add_argument("--max-body-mb", type=float, default=4.0)
    gw.add_argument("--grace-period", type=float, default=10.0, help="seconds to drain streams on shutdown")
    gw.add_argument("--rank-timeout", type=float, default=60.0, help="seconds before a silent rank counts as failed")
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


def apply_yaml(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Load --config (if any) as parser defaults, so explicit flags still override it."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return
    try:
        data = yaml.safe_load(Path(known.config).read_text()) or {}
    except OSError as e:
        raise HyraxInputError(f"cannot read --config: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise HyraxInputError(f"--config is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise HyraxInputError("--config must be a YAML mapping of option names to values")
    dests = {a.dest for a in parser._actions}
    defaults = {}
    for k, v in data.items():
        dest = str(k).replace("-", "_")
        if dest not in dests or dest in ("config", "help"):
            raise HyraxInputError(f"--config: unknown option {k!r}")
        defaults[dest] = v
    parser.set_defaults(**defaults)


def roles_from_args(a, cfg: ModelConfig):
    from hyrax.cluster.deployment import RoleSpec

    pd = any(x is not None for x in (a.prefill_replicas, a.prefill_tp, a.decode_replicas, a.decode_tp))
    if pd and a.colocated:
        raise HyraxInputError("--colocated cannot be combined with --prefill-*/--decode-* options")
    if a.colocated:
        roles = [RoleSpec("colocated", a.replicas, a.tp)]
    else:  # the default shape: one prefill and one decode replica
        roles = [RoleSpec("prefill", a.prefill_replicas or 1, a.prefill_tp or 1),
                 RoleSpec("decode", a.decode_replicas or 1, a.decode_tp or 1)]
    for r in roles:
        check_tp(cfg, r.tp)
    return roles


def resolve_admin_token(a) -> tuple[str, str]:
    tok = env_admin_token()
    if tok:
        return tok, "from HYRAX_ADMIN_TOKEN"
    path = Path(a.admin_token_file) if a.admin_token_file else DEFAULT_TOKEN_FILE
    tok = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(tok + "\n")
    os.chmod(path, 0o600)
    return tok, f"written to {path} (mode 600)"


def validate(a) -> tuple:
    """Everything checked before anything starts."""
    config = engine_config_from_args(a)
    path = resolve_model_path(a.model)
    cfg = ModelConfig.from_dir(path)
    roles = roles_from_args(a, cfg)
    if not 0 < a.port < 65536:
        raise HyraxInputError("--port must be in 1..65535")
    if a.max_inflight < 1:
        raise HyraxInputError("--max-inflight must be >= 1")
    name = a.served_model_name or ("hyrax-demo" if a.model == "demo" else Path(path).resolve().name)
    return config, path, cfg, roles, name


def run(a: argparse.Namespace) -> int:
    config, path, cfg, roles, name = validate(a)
    import uvicorn

    from hyrax.api.app import GatewaySettings, create_app
    from hyrax.cluster.deployment import Deployment
    from hyrax.cluster.ray_client import client_for
    from hyrax.cluster.ray_cluster import dashboard_url, init_ray

    token, where = resolve_admin_token(a)
    print(f"hyrax: starting Ray ({'joining ' + a.address if a.address else 'local, 127.0.0.1'}) ...", file=sys.stderr)
    started_ray = init_ray(a.address, a.num_cpus)
    import ray

    dep = Deployment(str(path), roles, config, rank_timeout_s=a.rank_timeout)
    try:
        print(f"hyrax: deploying {', '.join(f'{r.name} x{r.replicas} (tp={r.tp})' for r in roles)} ...", file=sys.stderr)
        dep.start()
        client = client_for(dep, name, a.max_inflight)
        app = create_app(client, GatewaySettings(admin_token=token, api_keys=tuple(a.api_key),
                                                 max_body_bytes=int(a.max_body_mb * 2**20)))
        base = f"http://{a.host}:{a.port}"
        print(f"hyrax: serving {name!r}\n"
              f"  OpenAI API      {base}/v1\n"
              f"  live dashboard  {base}/dashboard\n"
              f"  metrics         {base}/metrics\n"
              f"  Ray dashboard   {dashboard_url() or 'n/a'}\n"
              f"  admin token     {where}", file=sys.stderr, flush=True)
        try:
            uvicorn.run(app, host=a.host, port=a.port, log_level="warning",
                        timeout_graceful_shutdown=int(a.grace_period))
        except SystemExit as e:  # uvicorn re-raises SIGTERM/SIGINT after draining; Ray maps it to exit
            if e.code not in (None, 0, signal.SIGTERM, signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT):
                raise
    finally:
        print("hyrax: stopping replicas ...", file=sys.stderr)
        dep.shutdown()
        if started_ray:
            ray.shutdown()
    return 0
