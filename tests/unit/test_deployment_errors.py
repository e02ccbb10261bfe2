"""A replica that fails to start becomes one line on the CLI, never a Ray traceback."""
from __future__ import annotations

import ray

from hyrax.actors.model.errors import HyraxInputError, StartupFailure
from hyrax.cluster.deployment import startup_error

RANK_FAILURE = """The actor died because of an error raised in its creation task, ray::hyrax/decode/0/coordinator:RoleCoordinator.__init__() (pid=1, ip=127.0.0.1)
  File "/x/hyrax/actors/coordinator.py", line 74, in _start_ranks
ray.exceptions.RayTaskError(HyraxInputError): ray::RankWorker.setup() (pid=2, ip=127.0.0.1)
  File "/x/hyrax/actors/model/attn_backends.py", line 154, in select_backend
    raise HyraxInputError("the vllm_flash_attn attention backend cannot be used: "
hyrax.actors.model.errors.HyraxInputError: the vllm_flash_attn attention backend cannot be used: it needs CUDA (device is cpu)
"""


def test_a_remote_input_error_is_raised_again_as_itself():
    e = startup_error(ray.exceptions.RayError(RANK_FAILURE))
    assert isinstance(e, HyraxInputError)
    assert str(e) == "the vllm_flash_attn attention backend cannot be used: it needs CUDA (device is cpu)"


def test_any_other_remote_failure_is_its_last_line():
    e = startup_error(ray.exceptions.RayError("Traceback ...\n  File x\nMemoryError: cannot allocate pools\n"))
    assert isinstance(e, StartupFailure)
    assert str(e) == "a replica failed to start: MemoryError: cannot allocate pools"
    assert "\n" not in str(e)


def test_cli_prints_a_startup_failure_as_one_line(monkeypatch, capsys):
    from hyrax.cluster import cli

    def boom(args):
        raise StartupFailure("a replica failed to start: MemoryError: cannot allocate pools")

    parser = cli.build_parser()
    parser._subparsers._group_actions[0].choices["generate"].set_defaults(func=boom)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main(["generate", "--prompt", "x"]) == 1
    assert capsys.readouterr().err.strip() == "hyrax: error: a replica failed to start: MemoryError: cannot allocate pools"


def test_attach_needs_an_address_and_a_usable_deployment_name():
    """`hyrax serve --attach` joins a running cluster's deployment; a local cluster has none."""
    import pytest

    from hyrax.actors.model.errors import HyraxInputError
    from hyrax.cluster.cli import build_parser
    from hyrax.cluster.serve import validate

    parser = build_parser()
    with pytest.raises(HyraxInputError, match="--address"):
        validate(parser.parse_args(["serve", "--attach"]))
    with pytest.raises(HyraxInputError, match="--deployment"):
        validate(parser.parse_args(["serve", "--address", "127.0.0.1:1", "--deployment", "a/b"]))
    ns = parser.parse_args(["serve", "--address", "127.0.0.1:1", "--attach"])
    assert ns.deployment == "hyrax"
    validate(ns)


def test_replica_limits_go_together_and_hold_the_starting_count():
    import pytest

    from hyrax.actors.model.errors import HyraxInputError
    from hyrax.cluster.cli import build_parser
    from hyrax.cluster.serve import validate

    parser = build_parser()
    with pytest.raises(HyraxInputError, match="go together"):
        validate(parser.parse_args(["serve", "--min-replicas", "1"]))
    with pytest.raises(HyraxInputError, match="outside"):
        validate(parser.parse_args(["serve", "--decode-replicas", "3", "--min-replicas", "1", "--max-replicas", "2"]))
    with pytest.raises(HyraxInputError, match="min <= max"):
        validate(parser.parse_args(["serve", "--min-replicas", "2", "--max-replicas", "1"]))
    validate(parser.parse_args(["serve", "--min-replicas", "1", "--max-replicas", "3"]))
