"""`hyrax admin` turns its arguments into the admin API's requests."""
from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster import admin_cli, cli
from hyrax.cluster.cli import build_parser


def _req(*argv):
    return admin_cli._request(build_parser().parse_args(["admin", *argv]))


class _Answering(BaseHTTPRequestHandler):
    """A stand-in server's handler: `answer(headers) -> (status, body bytes)` says what GET returns."""
    answer = None

    def do_GET(self):
        status, body = type(self).answer(self.headers)
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def _serving(answer):
    """The URL of a local HTTP server whose GETs `answer` answers, for the `with` block."""
    srv = HTTPServer(("127.0.0.1", 0), type("Handler", (_Answering,), {"answer": staticmethod(answer)}))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()


def test_admin_actions_map_to_admin_endpoints():
    assert _req("requests") == ("GET", "/admin/requests", None)
    assert _req("health") == ("GET", "/admin/health", None)
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


@pytest.mark.parametrize("content", [b"first SeCrEt\nsecond\n", b"hunter2 SeCrEt\n", b"\xff\xfeSeCrEt", b"", b"  \n",
                                     "caf\u00e9SeCrEt".encode()])
def test_a_token_file_without_a_token_is_a_one_line_error_that_never_shows_its_contents(tmp_path, capsys, content):
    """It was sent as it was: `cannot reach URL: Illegal header value b'Bearer <the file>'` (or a
    UnicodeDecodeError traceback), echoing what may be another secret."""
    f = tmp_path / "tok"
    f.write_bytes(content)
    assert cli.main(["admin", "--url", "http://127.0.0.1:9", "--token-file", str(f), "requests"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"hyrax: error: --token-file {f} does not hold an admin token (one line of printable ASCII "
                   f"without spaces, as hyrax serve writes it)"]


def test_the_token_file_holds_the_token_hyrax_serve_writes(tmp_path, monkeypatch):
    f = tmp_path / "tok"
    f.write_text("abc-DEF_123\n")
    assert admin_cli._token(build_parser().parse_args(["admin", "--token-file", str(f), "requests"])) == "abc-DEF_123"
    monkeypatch.setenv("HYRAX_ADMIN_TOKEN", "tab\tinside")
    with pytest.raises(HyraxInputError) as e:
        admin_cli._token(build_parser().parse_args(["admin", "requests"]))
    assert str(e.value) == "HYRAX_ADMIN_TOKEN is not an admin token: it must be printable ASCII, no space at either end"


def test_serve_refuses_an_admin_token_no_client_could_send(monkeypatch):
    from hyrax.cluster.serve import resolve_admin_token

    monkeypatch.setenv("HYRAX_ADMIN_TOKEN", "padded ")
    with pytest.raises(HyraxInputError, match="^HYRAX_ADMIN_TOKEN must be printable ASCII, no space at either end$"):
        resolve_admin_token(build_parser().parse_args(["serve"]))


@pytest.mark.parametrize("where, why", [("", "Is a directory"), ("file/tok", "Not a directory")],
                         ids=["a_directory", "below_a_file"])
def test_serve_answers_a_token_file_it_cannot_write_with_one_line(tmp_path, capsys, monkeypatch, where, why):
    """An --admin-token-file that is a directory, or below a file, was an OSError traceback."""
    from hyrax.cluster import serve

    class Socket:
        def close(self):
            pass

        def getsockname(self):  # serve warns about a host other machines reach (is_loopback)
            return ("127.0.0.1", 8000)

    monkeypatch.delenv("HYRAX_ADMIN_TOKEN", raising=False)
    monkeypatch.setattr(serve, "validate", lambda a: (None,) * 5)
    monkeypatch.setattr(serve, "bind_gateway", lambda host, port: Socket())
    monkeypatch.setattr(serve, "_deploy_and_serve", lambda *a: pytest.fail("serve went on past the token"))
    (tmp_path / "file").write_text("")
    path = tmp_path / where
    assert cli.main(["serve", "--admin-token-file", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"hyrax: error: cannot write the admin token to {path}: {why}"]


def test_an_answer_that_is_not_json_is_a_one_line_error(tmp_path, capsys):
    """--url pointing at something else than a hyrax server was a JSONDecodeError traceback."""
    f = tmp_path / "tok"
    f.write_text("abc\n")
    with _serving(lambda headers: (200, b"<html>hello</html>")) as url:
        assert cli.main(["admin", "--url", url, "--token-file", str(f), "requests"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"hyrax: error: {url} answered HTTP 200 without JSON: is it a hyrax server?"]


@pytest.mark.parametrize("status,answer,rc", [
    (200, {"results": {"a": "host_pool"}, "retracted": ["a"], "unknown": []}, 0),
    (200, {"results": {"a": "host_pool", "nope": "unknown_request"}, "retracted": ["a"], "unknown": ["nope"]}, 1),
    (404, {"error": {"message": "unknown request: nope", "type": "not_found_error", "param": "request_ids",
                     "code": "request_not_found"}}, 1),
])
def test_admin_exits_1_when_any_named_request_is_unknown(tmp_path, monkeypatch, capsys, status, answer, rc):
    import httpx

    monkeypatch.setattr(httpx, "request", lambda method, url, **kw: httpx.Response(status, json=answer))
    f = tmp_path / "tok"
    f.write_text("abc\n")
    assert cli.main(["admin", "--token-file", str(f), "retract", "--id", "a", "--id", "nope"]) == rc
    assert capsys.readouterr().out.strip().startswith("{")


@pytest.mark.parametrize("action,answer,rc,note", [
    (["retract", "--all"], {"results": {"a": "ranks_failed", "b": "ranks_failed"}, "retracted": [], "unknown": []},
     1, "hyrax admin: 2 of 2 requests not retracted: ranks_failed a, b"),
    (["resume", "a", "b"], {"results": {"a": "verified", "b": "ranks_failed"}, "resumed": ["a"], "unknown": []},
     1, "hyrax admin: 1 of 2 requests not resumed: ranks_failed b"),
    (["retract", "--count", "2"], {"results": {"a": "recompute", "b": "not_running"}, "retracted": ["a"],
                                   "unknown": []}, 1, "hyrax admin: 1 of 2 requests not retracted: not_running b"),
    (["resume", "a"], {"results": {"a": "queued"}, "resumed": ["a"], "unknown": []}, 0, None),
])
def test_admin_exits_1_when_a_request_was_refused(tmp_path, monkeypatch, capsys, action, answer, rc, note):
    """A retraction or resume that did not happen (a rank failed in it, the request was not running)
    exited 0 like one that did: a script could not tell them apart."""
    import httpx

    monkeypatch.setattr(httpx, "request", lambda method, url, **kw: httpx.Response(200, json=answer))
    f = tmp_path / "tok"
    f.write_text("abc\n")
    assert cli.main(["admin", "--token-file", str(f), *action]) == rc
    out = capsys.readouterr()
    assert out.out.strip().startswith("{")
    assert out.err.strip().splitlines() == ([note] if note else [])


@pytest.mark.parametrize("action,answer,rc,note", [
    (["flush-cache"], {"replicas": [{"role": "colocated", "replica": 0, "reached": False},
                                    {"role": "colocated", "replica": 1, "reached": True, "freed": {"full_kv": 3}}]},
     1, "hyrax admin: 1 of 2 replicas not reached: colocated/0"),
    (["forced-retraction", "3"], {"interval": 3, "replicas": [{"role": "decode", "replica": 1, "reached": True}]},
     0, None),
    (["pools"], {"replicas": [{"role": "colocated", "replica": 0, "tp_size": 1, "components": {}}]}, 0, None),
])
def test_admin_exits_1_when_a_command_for_every_replica_missed_one(tmp_path, monkeypatch, capsys, action, answer,
                                                                    rc, note):
    """A flush or forced-retraction setting a gone replica did not take is not done everywhere."""
    import httpx

    monkeypatch.setattr(httpx, "request", lambda method, url, **kw: httpx.Response(200, json=answer))
    f = tmp_path / "tok"
    f.write_text("abc\n")
    assert cli.main(["admin", "--token-file", str(f), *action]) == rc
    assert capsys.readouterr().err.strip().splitlines() == ([note] if note else [])


def test_a_refused_default_token_names_the_token_file_of_the_server_on_that_port(tmp_path, monkeypatch, capsys):
    """Two servers on one machine: the second writes admin_token.<port> because the first holds
    admin_token. `hyrax admin --url <second>` read admin_token, got a 401 and said nothing more;
    now stderr names the file a server on that port writes."""
    def refuses_other_tokens(headers):
        if headers.get("Authorization") == "Bearer second":
            return 200, b'{"requests": []}'
        return 401, json.dumps({"error": {"message": "admin endpoints need `Authorization: Bearer <admin token>`",
                                          "type": "authentication_error", "param": None,
                                          "code": "invalid_admin_token"}}).encode()

    default = tmp_path / "admin_token"
    default.write_text("first\n")
    monkeypatch.setattr(admin_cli, "DEFAULT_TOKEN_FILE", default)
    monkeypatch.delenv("HYRAX_ADMIN_TOKEN", raising=False)
    with _serving(refuses_other_tokens) as url:
        port = url.rpartition(":")[2]
        theirs = tmp_path / f"admin_token.{port}"
        theirs.write_text("second\n")
        assert cli.main(["admin", "--url", url, "requests"]) == 1
        err = capsys.readouterr().err.splitlines()
        assert err == [f"hyrax admin: {url} refused the admin token of {default}; a server on port {port} writes "
                       f"its token to {theirs} while another holds that file: pass --token-file {theirs}"], err
        assert cli.main(["admin", "--url", url, "--token-file", str(theirs), "requests"]) == 0
        assert capsys.readouterr().err == ""
