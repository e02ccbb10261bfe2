"""`hyrax serve` flags and environment as a careless operator gives them: each mistake is a
one-line error before anything starts. No Ray: these parse and validate only."""
from __future__ import annotations

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster import cli, serve


def parse(*argv: str):
    return cli.build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("value", ["1e16", "1e300"])
def test_a_rank_timeout_ray_cannot_take_is_refused(value, capsys):
    """Ray turns a timeout into int64 milliseconds: `ray.get(ref, timeout=1e16)` raises
    OverflowError (measured, ray 2.x), so every rank call of every replica failed."""
    with pytest.raises(SystemExit) as e:
        parse("--rank-timeout", value)
    assert e.value.code == 2
    assert f"argument --rank-timeout: must be a finite number in (0, 1e+09], got '{value}'" in capsys.readouterr().err


def test_a_rank_timeout_of_years_is_still_accepted():
    assert parse("--rank-timeout", "1e9").rank_timeout == 1e9


def test_an_empty_model_is_refused_not_the_current_directory(capsys):
    """`--model ''` (an unset variable) served whatever checkpoint the current directory held."""
    with pytest.raises(SystemExit) as e:
        parse("--model", "")
    assert e.value.code == 2
    assert "argument --model: must be non-empty, got ''" in capsys.readouterr().err


@pytest.mark.parametrize("host, url", [
    ("127.0.0.1", "http://127.0.0.1:8000"),
    ("::1", "http://[::1]:8000"),
    ("fe80::1%eth0", "http://[fe80::1%25eth0]:8000"),
    ("localhost", "http://localhost:8000"),
])
def test_the_banner_urls_of_an_ipv6_host_are_bracketed(host, url):
    """The banner printed http://::1:8000/v1 for --host ::1, a URL no client parses."""
    assert serve.gateway_url(host, 8000) == url


@pytest.mark.parametrize("value, says", [
    ("abc", "HYRAX_TORCH_THREADS must be an integer, got 'abc'"),
    ("0", "HYRAX_TORCH_THREADS must be >= 1, got 0"),
    ("-2", "HYRAX_TORCH_THREADS must be >= 1, got -2"),
])
def test_a_malformed_torch_threads_variable_is_refused_before_anything_starts(monkeypatch, value, says):
    """It was read only inside each rank actor, after Ray and the replicas had started: the
    ranks died (SystemExit, or torch's RuntimeError for 0) and the deployment failed."""
    monkeypatch.setenv("HYRAX_TORCH_THREADS", value)
    with pytest.raises(HyraxInputError, match=f"^{says}$"):
        serve.validate(parse("--colocated"))


def test_hyrax_generate_answers_a_zero_torch_threads_variable_in_one_line(monkeypatch, capsys):
    """0 reached torch.set_num_threads, whose RuntimeError was a traceback."""
    monkeypatch.setenv("HYRAX_TORCH_THREADS", "0")
    assert cli.main(["generate", "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["hyrax: error: HYRAX_TORCH_THREADS must be >= 1, got 0"]


def test_two_config_files_are_an_error_not_the_last_one_alone(tmp_path, capsys):
    """`--config base.yaml --config site.yaml` read site.yaml only: base.yaml was silently dropped."""
    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text("max-running: 4\n")
    # a model that does not exist: were the files accepted, serve would stop there, before anything starts
    assert cli.main(["serve", "--config", str(tmp_path / "a.yaml"), "--config", str(tmp_path / "b.yaml"),
                     "--model", str(tmp_path / "no-model")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "hyrax: error: --config is given twice; one file holds the options (flags override it)"]


def test_a_placement_wait_on_a_local_cluster_is_an_error_not_ignored():
    """Nodes join only a cluster given by --address; on the local one the wait did nothing."""
    with pytest.raises(HyraxInputError, match=r"^--placement-wait waits for nodes to join a cluster: it needs --address"):
        serve.validate(parse("--colocated", "--placement-wait", "30"))
    serve.validate(parse("--colocated", "--placement-wait", "0"))  # the default, given: fine


def test_ray_address_in_the_environment_is_an_error_not_a_local_cluster(monkeypatch):
    """RAY_ADDRESS (set for Ray's own CLI) was ignored: hyrax serve started a local cluster of its
    own while the operator meant to join theirs."""
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    with pytest.raises(HyraxInputError, match=r"^RAY_ADDRESS is set \('10.0.0.5:6379'\) but hyrax serve joins a "
                                              r"cluster only with --address"):
        serve.validate(parse("--colocated"))
    serve.validate(parse("--colocated", "--address", "10.0.0.5:6379", "--attach"))


def test_api_keys_never_reach_rays_job_table_or_ps(tmp_path):
    """Ray records a driver's whole command line (psutil) as its job's entrypoint: `hyrax serve
    --api-key KEY` put the key in the GCS job table, on the Ray dashboard's Jobs page and in `ray
    list jobs` (the gateway pod of k8s/ passed its key so). The command line is rewritten first.
    (An abbreviation, `--api-k KEY`, is ambiguous since --api-key-file: argparse refuses it.)"""
    from serve_until_ray import free_port, serve_until_ray

    port = free_port()
    out = serve_until_ray(tmp_path, "--colocated", "--port", str(port),
                          "--api-key", "sk-first-secret", "--api-key=sk-second-secret")
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("ENTRYPOINT"))
    assert "secret" not in line, line
    assert "--port" in line and str(port) in line  # the rest is as given


@pytest.mark.parametrize("argv, shown", [
    (["hyrax", "serve", "--api-key", "k1", "--port", "1"], ["hyrax", "serve", "--api-key", "***", "--port", "1"]),
    (["hyrax", "serve", "--api-key=k1", "--api-k", "k2"], ["hyrax", "serve", "--api-key=***", "--api-k", "***"]),
    (["hyrax", "serve", "--address", "h:1", "--attach"], ["hyrax", "serve", "--address", "h:1", "--attach"]),
])
def test_without_secrets(argv, shown):
    assert serve.without_secrets(argv) == shown


@pytest.mark.parametrize("name", ["two\nlines", "tab\there", "bell\x07", "del\x7f"])
def test_a_served_name_with_a_control_character_is_refused(name, capsys):
    """It was accepted: the banner's line and every log line and error naming the model split
    (or carried a terminal control), and no client types such a `model`."""
    with pytest.raises(SystemExit) as e:
        parse("--served-model-name", name)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --served-model-name: must be non-empty and without control characters, got" in err
    assert len(err.strip().splitlines()) == 1


def test_a_served_name_with_spaces_inside_or_unicode_is_fine():
    assert parse("--served-model-name", "my model ü").served_model_name == "my model ü"
