"""`hyrax serve --admin-token-file` pointed at the wrong thing: a one-line error naming the file,
never a traceback, and the token never readable by anyone but its owner. No Ray: these call
resolve_admin_token as `hyrax serve` does once its port is bound."""
from __future__ import annotations

import argparse
import os
import stat

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster import serve


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch):
    monkeypatch.delenv("HYRAX_ADMIN_TOKEN", raising=False)


def resolve(path) -> serve.AdminToken:
    return serve.resolve_admin_token(argparse.Namespace(admin_token_file=str(path), port=18000))


def test_a_token_file_that_is_no_regular_file_is_a_one_line_error():
    """ftruncate on /dev/null raised OSError (EINVAL): a traceback."""
    with pytest.raises(HyraxInputError, match=r"^--admin-token-file /dev/null is not a regular file$"):
        resolve("/dev/null")


def test_a_file_that_takes_no_token_is_a_one_line_error():
    """/proc/self/status passes for a regular file; writing it raised OSError: a traceback."""
    with pytest.raises(HyraxInputError, match=r"^cannot write the admin token to /proc/self/status: "):
        resolve("/proc/self/status")


def test_a_directory_is_a_one_line_error(tmp_path):
    with pytest.raises(HyraxInputError, match="Is a directory"):
        resolve(tmp_path)


def test_the_token_is_written_only_once_the_file_is_private(tmp_path, monkeypatch):
    """An existing file readable by everyone (made with `touch`) got the token first and mode 600
    after: the token sat in a world-readable file, and a reader that opened it then keeps it."""
    path = tmp_path / "token"
    path.write_text("")
    path.chmod(0o644)
    modes = []
    real = os.pwrite

    def pwrite(fd, data, offset):
        modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real(fd, data, offset)

    monkeypatch.setattr(serve.os, "pwrite", pwrite)
    token = resolve(path)
    try:
        assert modes == [0o600]
        assert path.read_text() == token.token + "\n"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        token.release()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_file_another_user_owns_is_refused(tmp_path):
    """Its owner can make it readable again whenever they like; the token went into it."""
    path = tmp_path / "token"
    path.write_text("")
    os.chown(path, 65534, 65534)
    with pytest.raises(HyraxInputError, match=rf"^--admin-token-file {path} belongs to another user \(uid 65534\)"):
        resolve(path)
    assert path.read_text() == ""


def test_an_empty_admin_token_variable_is_an_error_not_a_generated_token(tmp_path, monkeypatch):
    """HYRAX_ADMIN_TOKEN='' (an empty Secret, an unset shell variable exported) silently counted as
    unset: a token was generated into a file the operator never looked at, and nothing said so."""
    monkeypatch.setenv("HYRAX_ADMIN_TOKEN", "")
    with pytest.raises(HyraxInputError, match=r"^HYRAX_ADMIN_TOKEN is set but empty"):
        resolve(tmp_path / "token")
    assert not (tmp_path / "token").exists()
