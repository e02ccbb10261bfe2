"""The prefix cache through the gateway: a repeated long prompt hits (same text, fewer tokens
prefilled), `/admin/pools` shows what the cache holds, `/metrics` counts query and hit tokens,
and `POST /admin/flush-cache` (admin token only) gives every cached unit back."""
from __future__ import annotations


from e2e_harness import ADMIN, HTTP, MODEL, assert_error

PROMPT = ("The hyrax is a small, thickset herbivorous mammal. " * 12).strip()


def _complete(url: str) -> dict:
    r = HTTP.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _metric(url: str, name: str) -> float:
    text = HTTP.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _cached(url: str) -> int:
    pools = HTTP.get(f"{url}/admin/pools", headers=ADMIN, timeout=30).json()["replicas"]
    return sum(c.get("cached", 0) for rep in pools for c in rep["components"].values())


def test_a_repeated_prompt_hits_and_a_flush_gives_everything_back(local):
    url = local.url
    HTTP.post(f"{url}/admin/flush-cache", headers=ADMIN, timeout=30)
    hits_before = _metric(url, "hyrax_prefix_cache_hit_tokens_total")
    first = _complete(url)
    assert _cached(url) > 0
    second = _complete(url)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    hit = _metric(url, "hyrax_prefix_cache_hit_tokens_total") - hits_before
    assert prompt_tokens // 2 <= hit < prompt_tokens, (hit, prompt_tokens)
    assert _metric(url, "hyrax_prefix_cache_query_tokens_total") >= 2 * prompt_tokens
    assert_error(HTTP.post(f"{url}/admin/flush-cache", timeout=30), 401, code="invalid_admin_token")
    assert_error(HTTP.post(f"{url}/admin/flush-cache", headers=ADMIN, json={"everything": True}, timeout=30), 400)
    assert _cached(url) > 0  # the refused flushes changed nothing
    r = HTTP.post(f"{url}/admin/flush-cache", headers=ADMIN, timeout=30)
    assert r.status_code == 200 and sum(sum(rep["freed"].values()) for rep in r.json()["replicas"]) > 0
    assert _cached(url) == 0
