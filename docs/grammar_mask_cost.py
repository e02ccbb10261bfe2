"""Per-token cost of the grammar token mask on CPU: xgrammar vs llguidance, with the demo
model's tokenizer (byte-level BPE, 264 ids). The numbers in docs/api.md come from here.

    .venv/bin/python docs/grammar_mask_cost.py [--repeat 5]

Both engines walk the same valid JSON answer token by token (compact separators, no free
whitespace, as Hyrax compiles schemas): at each token, compute the next-token bitmask, then
consume the token. Batch 32 is 32 matchers stepping together; a step's mask for all 32 is
filled one matcher after another (the sampler's loop), and also with each engine's own
batch call (threads).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

DEMO = Path(__file__).resolve().parent.parent / "hyrax" / "models" / "demo"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "kind": {"enum": ["person", "robot", "other"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
    "additionalProperties": False,
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "address": {"city": "London", "zip": "12345"},
          "kind": "person"}


def demo_tokens() -> tuple[list[int], int, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    cfg = json.loads((DEMO / "config.json").read_text())
    ids = tok.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False).ids
    return ids, cfg["vocab_size"], cfg["eos_token_id"][0]


def xgrammar_engine(vocab: int, eos: int):
    import xgrammar as xgr
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    encoded = [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size(with_added_tokens=True))]
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    batch = xgr.BatchGrammarMatcher()

    def compile_():
        return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))

    def matcher(g):
        return xgr.GrammarMatcher(g)

    def fill(ms, mask):
        for k, m in enumerate(ms):
            m.fill_next_token_bitmask(mask, k)

    def fill_batch(ms, mask):
        batch.batch_fill_next_token_bitmask(ms, mask)

    def consume(ms, t):
        for m in ms:
            assert m.accept_token(t)

    return compile_, matcher, fill, fill_batch, consume


def llguidance_engine(vocab: int, eos: int):
    import llguidance as llg
    import llguidance.torch as llt

    tok = llg.LLTokenizer((DEMO / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=eos)
    executor = llg.LLExecutor()

    def compile_():
        return llg.LLMatcher.grammar_from_json_schema(
            SCHEMA, overrides={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})

    def matcher(g):
        m = llg.LLMatcher(tok, g)
        assert not m.is_error(), m.get_error()
        return m

    def fill(ms, mask):
        for k, m in enumerate(ms):
            llt.fill_next_token_bitmask(m, mask, k)

    def fill_batch(ms, mask):
        llt.fill_next_token_bitmask_par(executor, [(m, k) for k, m in enumerate(ms)], mask)

    def consume(ms, t):
        for m in ms:
            assert m.consume_token(t)

    return compile_, matcher, fill, fill_batch, consume


def measure(engine, ids: list[int], vocab: int, batch: int, repeat: int) -> dict:
    compile_, matcher, fill, fill_batch, consume = engine
    t0 = time.perf_counter()
    grammar = compile_()
    compile_s = time.perf_counter() - t0
    mask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    out: dict[str, list[float]] = {"mask": [], "mask_batch_call": [], "consume": []}
    for _ in range(repeat):
        for key, fn in (("mask", fill), ("mask_batch_call", fill_batch)):
            ms = [matcher(grammar) for _ in range(batch)]
            spent_mask = spent_consume = 0.0
            for t in ids:
                a = time.perf_counter()
                fn(ms, mask)
                b = time.perf_counter()
                consume(ms, t)
                spent_mask += b - a
                spent_consume += time.perf_counter() - b
                bit = (int(mask[0, t // 32]) >> (t % 32)) & 1
                assert bit, f"token {t} masked out"
            out[key].append(spent_mask / len(ids))
            if key == "mask":
                out["consume"].append(spent_consume / len(ids))
    return {"compile_ms": compile_s * 1e3, **{k: statistics.median(v) * 1e6 for k, v in out.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    ids, vocab, eos = demo_tokens()
    print(f"demo tokenizer: vocab {vocab}, answer of {len(ids)} tokens; torch threads {torch.get_num_threads()}")
    print("engine      batch  mask us/step  (per request)  batch-call us/step  consume us/step  compile ms")
    for name, make in (("xgrammar", xgrammar_engine), ("llguidance", llguidance_engine)):
        engine = make(vocab, eos)
        for batch in (1, 32):
            r = measure(engine, ids, vocab, batch, args.repeat)
            print(f"{name:<11} {batch:>5}  {r['mask']:>12.1f}  {r['mask'] / batch:>13.1f}  {r['mask_batch_call']:>18.1f}"
                  f"  {r['consume']:>15.1f}  {r['compile_ms']:>10.2f}")


if __name__ == "__main__":
    main()
