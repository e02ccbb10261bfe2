"""`--model org/name[@revision]` resolves offline from the local Hugging Face cache, laid out as
huggingface_hub writes it (refs/<branch>, snapshots/<commit>/ linking into blobs/), found through
HF_HUB_CACHE or HF_HOME; a directory still wins, and a repo or revision that is not cached is a
one-line error that says Hyrax does not download."""
from __future__ import annotations

import json

import pytest

from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.demo import DEMO_DIR, default_served_name, resolve_model_path
from test_config_errors import raises_input_error

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


def fake_cache(root, repo_id: str = "tiny-org/tiny-hybrid") -> None:
    """The demo checkpoint cached as `repo_id`: files are blobs, snapshots link to them."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)  # huggingface_hub writes no trailing newline
    (repo / "refs" / "v0").write_text(OLD + "\n")
    for commit in (COMMIT, OLD):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in DEMO_DIR.iterdir():
            blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
            data = f.read_bytes()
            if f.name == "config.json" and commit == OLD:  # tell the revisions apart
                data = json.dumps({**json.loads(data), "max_position_embeddings": 1024}).encode()
            blob.write_bytes(data)
            (snap / f.name).symlink_to(f"../../blobs/{blob.name}")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "home" / "hub"
    fake_cache(cache)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return cache


def test_repo_id_resolves_to_the_main_snapshot_and_loads(hub):
    path = resolve_model_path("tiny-org/tiny-hybrid")
    assert path == hub / "models--tiny-org--tiny-hybrid" / "snapshots" / COMMIT
    assert ModelConfig.from_dir(path) == ModelConfig.from_dir(DEMO_DIR)
    assert default_served_name("tiny-org/tiny-hybrid") == "tiny-org/tiny-hybrid"


def test_revision_by_tag_or_commit(hub):
    by_tag = resolve_model_path("tiny-org/tiny-hybrid@v0")
    assert by_tag.name == OLD and ModelConfig.from_dir(by_tag).max_position_embeddings == 1024
    assert resolve_model_path(f"tiny-org/tiny-hybrid@{COMMIT}").name == COMMIT
    assert default_served_name("tiny-org/tiny-hybrid@v0") == "tiny-org/tiny-hybrid"


def test_hf_hub_cache_wins_over_hf_home(hub, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    fake_cache(other, "acme/other")
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert resolve_model_path("acme/other").parent.parent == other / "models--acme--other"
    raises_input_error(lambda: resolve_model_path("tiny-org/tiny-hybrid"), "'tiny-org/tiny-hybrid'", str(other))


def test_a_directory_of_that_name_wins_over_the_cache(hub, tmp_path):
    local = tmp_path / "tiny-org" / "tiny-hybrid"
    local.mkdir(parents=True)
    assert resolve_model_path("tiny-org/tiny-hybrid") == local.relative_to(tmp_path)
    assert default_served_name("tiny-org/tiny-hybrid") == "tiny-hybrid"


@pytest.mark.parametrize("ref,fragments", [
    ("nobody/absent", ("'nobody/absent'", "nor in the local Hugging Face cache", "does not download")),
    ("tiny-org/tiny-hybrid@dev", ("revision 'dev'", COMMIT, OLD)),
])
def test_an_uncached_repo_or_revision_is_a_one_line_error(hub, ref, fragments):
    raises_input_error(lambda: resolve_model_path(ref), *fragments)


def test_a_missing_plain_path_is_still_refused_as_a_directory(hub):
    raises_input_error(lambda: ModelConfig.from_dir(resolve_model_path("no_such_dir")), "'no_such_dir'", "directory")


def test_hyrax_generate_runs_a_cached_repo_id_and_names_an_absent_one_in_one_line(hub, capsys):
    from hyrax.cluster import cli

    assert cli.main(["generate", "--model", "tiny-org/tiny-hybrid", "--prompt-ids", "1,2,3", "--max-tokens", "2"]) == 0
    capsys.readouterr()
    assert cli.main(["generate", "--model", "nobody/absent", "--prompt-ids", "1,2,3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hyrax: error: model 'nobody/absent'" in err
