"""`--model org/name[@revision]`: a repo id resolved offline from the local Hugging Face cache.

The cache layout (as huggingface_hub writes it):

    <cache>/models--<org>--<name>/refs/<branch or tag>   text file holding a commit hash
    <cache>/models--<org>--<name>/snapshots/<commit>/     the checkpoint files (links into blobs/)

A revision is a branch or tag with a file under refs/ (default `main`), or a commit hash with
a snapshot. Nothing is downloaded; a repo or revision not in the cache is a one-line error.
"""
from __future__ import annotations

import re
from pathlib import Path

from hyrax.actors.model.errors import HyraxInputError

# org/name or name, optionally @revision (names as the Hub allows them)
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*(?:@[\w./-]+)?$")


def looks_like_repo_id(name: str) -> bool:
    """True for `org/name`, `org/name@rev` and `name@rev`; a bare word is a directory name."""
    return bool(_REPO_ID.match(name)) and ("/" in name or "@" in name) and ".." not in name


def snapshot_dir(ref: str, cache: Path) -> Path:
    """The snapshot directory of `org/name[@revision]` in `cache`."""
    repo_id, _, revision = ref.partition("@")
    revision = revision or "main"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    if not repo.is_dir():
        raise HyraxInputError(f"model {ref!r} is neither a directory nor in the local Hugging Face cache "
                              f"({repo} does not exist; Hyrax does not download: fetch it first, e.g. "
                              f"`huggingface-cli download {repo_id}`)")
    ref_file = repo / "refs" / revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else revision
    snap = repo / "snapshots" / commit
    if not snap.is_dir():
        have = sorted(p.name for p in (repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
        raise HyraxInputError(f"model {ref!r}: revision {revision!r} is not in the local Hugging Face cache "
                              f"{repo} (cached snapshots: {', '.join(have) or 'none'})")
    return snap
