"""The API keys `hyrax serve` requires on /v1/*, given one of three ways: --api-key (on the
command line, or `api-key` in --config), HYRAX_API_KEY, or --api-key-file. The last two keep
the key off the command line, which `ps` shows to every user of the machine until Ray starts
(serve.hide_secrets_in_cmdline rewrites it then). Two ways at once is an error: whether they
would add up or one would win is a guess an operator should not have to make about a
credential. No message here ever shows a key."""
from __future__ import annotations

import os
import stat

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.arg_types import is_bearer_token
from hyrax.env import api_key as env_api_key

KEY_FILE_MAX_BYTES = 64 << 10  # a page of keys; more is the wrong file
KEY_TEXT = "printable ASCII, no space at either end"  # what a client can send as a bearer token


def resolve_api_keys(a) -> tuple[str, ...]:
    """The keys of `a` (parsed `hyrax serve` options) and the environment; () when none is given."""
    env = env_api_key()
    ways = [w for w, given in (("--api-key (or api-key in --config)", bool(a.api_key)),
                               ("HYRAX_API_KEY", env is not None), ("--api-key-file", a.api_key_file is not None))
            if given]
    if len(ways) > 1:
        raise HyraxInputError(f"{', '.join(ways[:-1])} and {ways[-1]} both give API keys; give them one way")
    if env is not None:
        if env == "":  # an exported unset variable or an empty Secret, not a choice of an open API
            raise HyraxInputError("HYRAX_API_KEY is set but empty: give a key, or unset it to serve /v1 without one")
        if not is_bearer_token(env):
            raise HyraxInputError(f"HYRAX_API_KEY must be {KEY_TEXT}")
        return (env,)
    if a.api_key_file is not None:
        return read_key_file(a.api_key_file)
    return tuple(a.api_key)


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys of `path`, one a line. It must be a regular file of this user's that no other
    user can read or write (the admin token file is kept so too): a key others can read is
    anyone's, and one they can write lets them choose it."""
    where = f"--api-key-file {path}"
    try:  # non-blocking: a FIFO opened for reading would wait for a writer forever
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise HyraxInputError(f"cannot read {where}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HyraxInputError(f"{where} is not a regular file")
        if st.st_uid != os.geteuid():  # its owner can make it readable, or change the keys, at any time
            raise HyraxInputError(f"{where} belongs to another user (uid {st.st_uid}); choose a file of your own")
        if st.st_mode & 0o077:
            raise HyraxInputError(f"{where} can be read or written by other users "
                                  f"(mode {stat.S_IMODE(st.st_mode):o}): chmod 600 it")
        raw = os.read(fd, KEY_FILE_MAX_BYTES + 1) if st.st_size <= KEY_FILE_MAX_BYTES else b""
        if st.st_size > KEY_FILE_MAX_BYTES or len(raw) > KEY_FILE_MAX_BYTES:
            raise HyraxInputError(f"{where} is larger than {KEY_FILE_MAX_BYTES >> 10} KiB: not a key file")
    except OSError as e:
        raise HyraxInputError(f"cannot read {where}: {e.strerror}") from None
    finally:
        os.close(fd)
    lines = raw.decode("utf-8", errors="replace").splitlines()
    if not lines:
        raise HyraxInputError(f"{where} holds no key")
    for n, line in enumerate(lines, 1):
        if not line:
            raise HyraxInputError(f"{where} line {n} is empty")
        if not is_bearer_token(line):
            raise HyraxInputError(f"{where} line {n} is not a key ({KEY_TEXT})")
    return tuple(lines)
