"""Structured output: what a request asks its answer to match (`GrammarSpec`), and rank 0's
grammar matchers (`GrammarMasks`), which turn it into a token mask each step.

A matcher's state is a pure function of (spec, output tokens): rank 0 keeps one matcher per
request with the outputs it has consumed, and when one is missing or disagrees with the
plan (a restored, retracted, imported or migrated request, a restarted rank) it builds one
and replays the request's outputs, which every plan entry that samples carries
(`GrammarStep`). So the grammar moves with the request for free, in every retraction mode,
PD hand-off and migration, and a restored request continues the same grammar.

The engine is xgrammar (docs/api.md says why); it is imported on first use only.
"""
from __future__ import annotations

import enum
import functools
import json
import logging
import os
import queue
import re
import threading
from array import array
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Sequence

import torch

from hyrax.actors.engine.schema_keywords import check_schema
from hyrax.actors.engine.schema_numbers import out_of_range
from hyrax.actors.model.errors import HyraxInputError

log = logging.getLogger(__name__)


class GrammarKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # source: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; source unused
    REGEX = "regex"  # source: the pattern
    CHOICE = "choice"  # source: a JSON list of the allowed answers


@dataclass(frozen=True)
class GrammarSpec:
    """What the answer must match. `strict` (JSON schema only): no properties or items the
    schema does not name (xgrammar's strict mode); off, JSON Schema's own defaults apply."""

    kind: GrammarKind
    source: str = ""
    strict: bool = True

    def __post_init__(self):
        object.__setattr__(self, "kind", GrammarKind(self.kind))

    @classmethod
    def json_schema(cls, schema: dict, strict: bool = True) -> GrammarSpec:
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema), strict)  # key order kept: it orders the answer

    @classmethod
    def choice(cls, options: Sequence[str]) -> GrammarSpec:
        return cls(GrammarKind.CHOICE, json.dumps(list(options)))

    def check(self) -> None:
        """Parse the grammar without a tokenizer; HyraxInputError names what is wrong. The
        gateway and the engine both check: a spec that passed once is remembered."""
        _check(self)

    def _check(self) -> None:
        if self.kind == GrammarKind.JSON_SCHEMA:
            schema = json.loads(self.source)
            why = out_of_range(schema)  # numbers xgrammar cannot read: refused in our words, not its internals
            if why is not None:
                raise HyraxInputError(f"invalid json_schema: {why}")
            check_schema(schema, self._strict)  # xgrammar drops keywords it does not implement
        if self.kind == GrammarKind.CHOICE:
            options = json.loads(self.source)
            if not options or not all(isinstance(o, str) and o for o in options):
                raise HyraxInputError("choice must be a non-empty list of non-empty strings")
        try:
            _compile_check(self._grammar())
        except RuntimeError as e:  # xgrammar reports a bad schema or pattern as RuntimeError
            raise HyraxInputError(f"invalid {self.kind.value}: {_first_line(e)}") from None

    def _grammar(self):
        import xgrammar as xgr

        if self.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
            return xgr.Grammar.from_json_schema(self._schema, any_whitespace=False, strict_mode=self._strict)
        if self.kind == GrammarKind.REGEX:
            return xgr.Grammar.from_regex(self.source)
        return xgr.Grammar.from_ebnf(self._choice_ebnf)

    @property
    def _schema(self) -> str:
        return '{"type": "object"}' if self.kind == GrammarKind.JSON_OBJECT else self.source

    @property
    def _strict(self) -> bool:
        return self.strict and self.kind == GrammarKind.JSON_SCHEMA

    @property
    def _choice_ebnf(self) -> str:
        # JSON string literals are valid EBNF string literals (quotes, backslashes, \uXXXX), but
        # xgrammar reads a \ud83d\ude00 pair as two lone surrogates: characters outside the BMP
        # are written as themselves
        return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in json.loads(self.source))

    def compile(self, compiler):
        """xgrammar CompiledGrammar for `compiler`'s tokenizer (the compiler caches by source)."""
        if self.kind in (GrammarKind.JSON_SCHEMA, GrammarKind.JSON_OBJECT):
            return compiler.compile_json_schema(self._schema, any_whitespace=False, strict_mode=self._strict)
        if self.kind == GrammarKind.REGEX:
            return compiler.compile_regex(self.source)
        return compiler.compile_grammar(self._choice_ebnf)


@functools.lru_cache(maxsize=256)
def _check(spec: GrammarSpec) -> None:
    spec._check()


def _compile_check(grammar) -> None:
    """Compile `grammar` with an empty vocabulary: some schemas xgrammar parses fail only when
    compiled (a negative minLength), and on rank 0 that would fail the step of every request
    batched with it. Milliseconds for an ordinary schema: the cost grows with the vocabulary."""
    import xgrammar as xgr

    xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False).compile_grammar(grammar)


def _first_line(e: Exception) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    text = lines[0] if lines else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)  # xgrammar's "[time] file.cc:line: " prefix


@dataclass(frozen=True)
class GrammarStep:
    """A sampling entry's grammar, with the request's outputs before this draw (int32; a
    negative last id is the token of the step in flight, which rank 0 sampled itself)."""

    spec: GrammarSpec
    outputs: array

    @classmethod
    def of(cls, spec: GrammarSpec | None, ids: Sequence[int], draw: int) -> GrammarStep | None:
        """`ids`: prompt + outputs; the last `draw` of them are the outputs."""
        return None if spec is None else cls(spec, array("i", ids[len(ids) - draw:]))


def tokenizer_info(tokenizer_dir: str | Path | None, vocab_size: int, eos: Sequence[int]):
    """xgrammar's view of the checkpoint's tokenizer, sized to the model's logits. Special
    tokens other than EOS decode to nothing, so no grammar ever allows them (xgrammar would
    otherwise treat `<|pad|>` as five characters of text). Without tokenizer.json: Hyrax's
    byte fallback (ids 0..255 are bytes)."""
    import xgrammar as xgr

    path = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir is not None else None
    if path is None or not path.is_file():
        vocab = [bytes([i]) for i in range(min(vocab_size, 256))] + [b""] * max(vocab_size - 256, 0)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(eos))
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    detected = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=str(path)),
                                                  vocab_size=vocab_size, stop_token_ids=list(eos))
    tok = Tokenizer.from_file(str(path))
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    encoded = ["" if i in special else (tok.id_to_token(i) or "") for i in range(vocab_size)]
    return xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=list(eos),
                             add_prefix_space=detected.add_prefix_space)


class _Matcher:
    def __init__(self, spec: GrammarSpec, matcher):
        self.spec = spec
        self.m = matcher
        self.consumed: list[int] = []
        self.broken = False  # a replayed token was refused: only EOS is allowed from here

    def accept(self, tok: int) -> None:
        if not self.broken and not self.m.is_terminated() and not self.m.accept_token(tok):
            self.broken = True
            log.warning("grammar refused token %d after %d tokens; ending the answer", tok, len(self.consumed))
        self.consumed.append(tok)


COMPILE_NICE = 5  # the compile thread's niceness: where it shares a CPU with the rank's steps, the steps go first


COMPILES_AT_ONCE = 4  # compiles rank 0 runs side by side (more wait their turn)


class _Workers:
    """Daemon threads running submitted calls, at most `size` at once, started as calls
    arrive: a compile still running when the process ends does not hold up its exit (a
    ThreadPoolExecutor's threads are joined at exit), and one long compile (a huge schema:
    minutes) does not hold up the grammars asked for after it, as a single thread did.
    Measured on one CPU shared with a ~15 ms step loop (800-property schema): at the steps'
    own priority the steps took 28 ms and the compile 1.5 s; at niceness 5, 16 ms and 2.9 s."""

    def __init__(self, name: str, size: int = COMPILES_AT_ONCE, nice: int = COMPILE_NICE):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._name, self._size, self._nice = name, size, nice
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for a call
        self._queued = 0  # calls no thread has taken yet

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        with self._lock:
            self._queued += 1
            if self._queued > self._idle and self._threads < self._size:
                self._threads += 1
                self._idle += 1  # waiting for a call from the moment it starts
                threading.Thread(target=self._run, name=f"{self._name}-{self._threads}", daemon=True).start()
        self._queue.put((f, fn, args))
        return f

    def _run(self) -> None:
        try:  # Linux: a thread is a task of its own, with its own niceness
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        except (AttributeError, OSError) as e:
            log.info("grammar compiles run at the steps' priority: %s", e)
        while True:
            f, fn, args = self._queue.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            try:
                if f.set_running_or_notify_cancel():
                    try:
                        f.set_result(fn(*args))
                    except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
                        f.set_exception(e)
            finally:
                with self._lock:
                    self._idle += 1


def compile_threads(cpus: int | None = None) -> int:
    """Threads one grammar compile may use on rank 0: it runs beside the rank's steps, which keep
    a CPU (xgrammar's default, 8, took both cores of a 2-core machine from the steps)."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(8, cpus // 2 - 1))


COMPILED_KEPT = 1024  # compiled grammars rank 0 keeps (least recently used go; grammar_gate.KEEP)
COMPILER_CACHE_BYTES = 512 * 2**20  # xgrammar's own cache of compiled grammars, bounded


class GrammarMasks:
    """Rank 0's grammar matchers, one per request id, each with the outputs it has consumed, and
    the grammars it compiles for them in a thread of its own (`prepare`; grammar_gate.py)."""

    def __init__(self, tokenizer_dir: str | Path | None, vocab_size: int, eos: Sequence[int]):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos = tuple(eos)
        self.matchers: dict[str, _Matcher] = {}
        self.rebuilt = 0  # matchers built after the first step of a request (restores, imports, restarts)
        self._compiled: OrderedDict[GrammarSpec, Future] = OrderedDict()  # spec -> its compile (LRU)
        self._unreported: list[GrammarSpec] = []  # compiles asked for whose end no result has reported
        self.compiled_in_step = 0  # grammars compiled inside a step (never asked for, or let go of)

    @cached_property
    def _compiler(self):
        import xgrammar as xgr

        return xgr.GrammarCompiler(tokenizer_info(self.tokenizer_dir, self.vocab_size, self.eos),
                                   max_threads=compile_threads(), cache_limit_bytes=COMPILER_CACHE_BYTES)

    @cached_property
    def _thread(self) -> _Workers:
        return _Workers("hyrax-grammar")

    def prepare(self, specs: Sequence[GrammarSpec]) -> None:
        """Start compiling `specs` in the background (each once while kept)."""
        compiler = self._compiler  # made here, on the step's thread, before the pool's thread reads it
        for spec in specs:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
            else:
                self._compiled[spec] = self._thread.submit(spec.compile, compiler)
            self._unreported.append(spec)
        self._trim()

    def settled(self) -> tuple[tuple[GrammarSpec, ...], tuple[tuple[GrammarSpec, str], ...]]:
        """Compiles asked for that ended since the last call: (compiled, (failed, why))."""
        if not self._unreported:
            return (), ()
        ready, failed, rest = [], [], []
        for spec in self._unreported:
            f = self._compiled.get(spec)
            if f is None:  # let go of before it was reported: compiled again inside its step
                ready.append(spec)
            elif not f.done():
                rest.append(spec)
            elif f.exception() is not None:
                failed.append((spec, _first_line(f.exception())))
            else:
                ready.append(spec)
        self._unreported = rest
        return tuple(ready), tuple(failed)

    def _compiled_grammar(self, spec: GrammarSpec):
        """`spec` compiled: waits for its background compile, or compiles it here if never asked."""
        f = self._compiled.get(spec)
        if f is None:
            self.compiled_in_step += 1
            f = self._compiled[spec] = Future()
            try:
                f.set_result(spec.compile(self._compiler))
            except Exception as e:  # noqa: BLE001 - kept as the compile's answer, and raised as before
                f.set_exception(e)
            self._trim()
        self._compiled.move_to_end(spec)
        return f.result()

    def _trim(self) -> None:
        """Keep COMPILED_KEPT grammars: the least recently used compiled ones go; one still
        compiling stays (its request waits for it), whatever its place."""
        excess = len(self._compiled) - COMPILED_KEPT
        if excess > 0:
            for spec in [s for s, f in self._compiled.items() if f.done()][:excess]:
                del self._compiled[spec]

    @cached_property
    def _batch(self):
        import xgrammar as xgr

        return xgr.BatchGrammarMatcher(max_threads=1)

    def _matcher(self, rid: str, step: GrammarStep, outputs: list[int]) -> _Matcher:
        """The request's matcher, having consumed exactly `outputs` (built and replayed if needed)."""
        m = self.matchers.get(rid)
        n = len(outputs)
        ok = (m is not None and m.spec == step.spec and len(m.consumed) <= n
              and (not m.consumed or m.consumed[-1] == outputs[len(m.consumed) - 1]))
        if not ok:
            import xgrammar as xgr

            m = _Matcher(step.spec, xgr.GrammarMatcher(self._compiled_grammar(step.spec)))
            self.matchers[rid] = m
            self.rebuilt += n > 0
        for tok in outputs[len(m.consumed):]:
            m.accept(tok)
        return m

    def allowed(self, rids: Sequence[str], steps: Sequence[GrammarStep | None],
                last_token: dict[str, int]) -> torch.Tensor | None:
        """(R, V) bool: the tokens each row's grammar allows next (all, for rows without one);
        None when no row has a grammar. `last_token` fills in the in-flight token."""
        rows = [k for k, s in enumerate(steps) if s is not None]
        if not rows:
            return None
        V = self.vocab_size
        bitmask = torch.full((len(steps), (V + 31) // 32), -1, dtype=torch.int32)
        live, live_rows, eos_only = [], [], []
        for k in rows:
            outputs = list(steps[k].outputs)
            if outputs and outputs[-1] < 0:
                outputs[-1] = last_token[rids[k]]
            m = self._matcher(rids[k], steps[k], outputs)
            if m.broken or m.m.is_terminated():
                eos_only.append(k)
            else:
                live.append(m.m)
                live_rows.append(k)
        if live:
            self._batch.batch_fill_next_token_bitmask(live, bitmask, live_rows)
        bits = torch.arange(32, dtype=torch.int32)
        out = ((bitmask.unsqueeze(-1) >> bits) & 1).view(len(steps), -1)[:, :V].bool()  # (R, V)
        for k in eos_only:
            out[k] = False
            out[k, list(self.eos)] = True
        return out

    def advance(self, rids: Sequence[str], steps: Sequence[GrammarStep | None], tokens: Sequence[int]) -> None:
        """Feed each grammar row's sampled token to its matcher."""
        for rid, s, tok in zip(rids, steps, tokens):
            if s is not None:
                self.matchers[rid].accept(tok)

    def forget(self, rid: str) -> None:
        self.matchers.pop(rid, None)
