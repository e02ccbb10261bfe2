"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Depends, Request, Response

from hyrax.api.auth import require_api_key
from hyrax.api.call_id import call_id as call_id_of
from hyrax.api.errors import REQUEST_ID_HEADER, APIError, error_body, internal_error
from hyrax.api.client import Reservation, Unavailable
from hyrax.api.context_limit import ContextExceeded, completion_budget
from hyrax.api.json_body import JSONRoute
from hyrax.api.generation import Choice, ClientGone, ClosingStreamingResponse, run_choices, until_disconnected
from hyrax.api.schemas import ChatRequest, CompletionRequest, _Sampling
from hyrax.api.structured import checked_grammar
from hyrax.api.text import TextStream, encode, fewest_tokens, render_chat, template_error
from hyrax.api.text_offset import feed_with_offset
from hyrax.api.tool_parser import ToolCallParser
from hyrax.api.tools import checked_tools

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=JSONRoute)
CHAT_DEFAULT_MAX_TOKENS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's


def _check_model(request: Request, model: str) -> None:
    name = request.app.state.client.model.name
    if model != name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {name!r}",
                       param="model", code="model_not_found")


def _check_choices(request: Request, n: int) -> None:
    """A 400 for a call of more choices than the server admits at once, asked before its prompts
    are read: a body of 800,000 one-token prompts took minutes to tokenize and turn into choices."""
    try:
        request.app.state.client.check_choices(n)
    except ValueError as e:
        raise APIError(400, str(e), param="n", code="too_many_choices") from None


def _admit(request: Request, choices: list) -> Reservation:
    """Admission counts choices (prompts x n), not HTTP requests."""
    _check_choices(request, len(choices))
    if not request.app.state.ready:
        why = "; ".join(request.app.state.health.public_reasons)  # the last health poll's, as /health says them
        raise APIError(503, f"replicas are not ready{': ' + why if why else ''}", code="unavailable",
                       headers={"Retry-After": "5"})
    try:
        return request.app.state.client.reserve(len(choices))
    except Unavailable as e:
        raise APIError(503, str(e), code="unavailable", headers={"Retry-After": "1"}) from None


def _prompt_count(body: CompletionRequest) -> int:
    """How many prompts the body has (a list is all strings, all ids or all id lists)."""
    p = body.prompt
    return 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)


def _refuse_early(tok, texts: list, max_tokens: int | None, default_max: int, context: int, param: str) -> None:
    """The context's 400 for a text whose token count is over what the context allows by a bound
    alone (text.fewest_tokens): milliseconds for a 4 MB text, where counting exactly takes seconds."""
    for text in texts:
        bound = fewest_tokens(tok, text)
        if bound:
            _budget(bound, max_tokens, default_max, context, param, at_least=True)


async def _prompts(body: CompletionRequest, tok, vocab: int, context: int) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str) or (p and all(isinstance(x, str) for x in p)):
        texts = [p] if isinstance(p, str) else list(p)
        _refuse_early(tok, texts, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, context, "prompt")
        out = await encode(tok, texts)
    elif p and all(isinstance(x, int) for x in p):
        out = [list(p)]
    elif p and all(isinstance(x, list) for x in p):
        out = [list(x) for x in p]
    else:
        raise APIError(400, "prompt must be a non-empty string, list of strings, or token id list(s)", param="prompt",
                       code="invalid_value")
    for ids in out:
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
    return out


def _penalty_params(body: _Sampling, vocab: int) -> dict:
    """Token-level sampling fields as SamplingParams takes them; token ids checked against the vocabulary."""
    bias = tuple(sorted((int(k), v) for k, v in (body.logit_bias or {}).items()))
    for name, ids in (("logit_bias", [t for t, _ in bias]), ("stop_token_ids", body.stop_token_ids or [])):
        if any(t < 0 or t >= vocab for t in ids):
            raise APIError(400, f"{name}: token ids must be in [0, {vocab})", param=name, code="invalid_value")
    return {"presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty, "logit_bias": bias, "min_tokens": body.min_tokens,
            "min_p": body.min_p, "stop_token_ids": tuple(body.stop_token_ids or ())}


def _budget(prompt_tokens: int, max_tokens: int | None, default_max: int | None, context: int, prompt_param: str,
            at_least: bool = False) -> int:
    """context_limit.completion_budget, its refusal as a 400 naming the field that does not fit."""
    try:
        return completion_budget(prompt_tokens, max_tokens, default_max, context, at_least=at_least)
    except ContextExceeded as e:
        raise APIError(400, str(e), param=prompt_param if e.over == "prompt" else "max_tokens",
                       code="context_length_exceeded") from None


def _choices(request: Request, body: _Sampling, call_id: str, prompts: list[list[int]], max_tokens: int | None,
             default_max: int | None, logprobs: int | None = None, grammar=None,
             prompt_param: str = "prompt") -> list[Choice]:
    """`prompt_param`: the field the prompt came from (chat: messages), which a prompt over the context names."""
    info = request.app.state.client.model
    if grammar is not None and (body.ignore_eos or body.min_tokens):
        raise APIError(400, "structured output and tool calls end the answer with EOS when the grammar is complete: "
                            "they cannot be combined with ignore_eos or min_tokens",
                       param="ignore_eos" if body.ignore_eos else "min_tokens", code="invalid_value")
    out, nonce = [], uuid.uuid4().hex[:8]
    for pi, ids in enumerate(prompts):
        mt = _budget(len(ids), max_tokens, default_max, info.max_model_len, prompt_param)
        if body.min_tokens > mt:
            raise APIError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({mt})", param="min_tokens",
                           code="invalid_value")
        for k in range(body.n):
            params = {
                "max_tokens": mt, "temperature": body.temperature, "top_p": body.top_p,
                "top_k": max(body.top_k, 0), "seed": None if body.seed is None else body.seed + k,
                "stop": body.stop_list(), "ignore_eos": body.ignore_eos, "logprobs": logprobs,
                **_penalty_params(body, info.vocab_size),
            }
            if grammar is not None:
                params["grammar"] = grammar
            index = pi * body.n + k
            out.append(Choice(index, ids, params, TextStream.after_prompt(info.tokenizer.decode, ids, body.stop_list()),
                              request_id=f"{call_id}-{index}-{nonce}"))
    return out


def _usage(choices: list[Choice], n: int) -> dict:
    prompt = sum(len(c.prompt_ids) for c in choices if c.index % n == 0)  # each prompt once, as OpenAI does
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(c: Choice, tok, start: int, end: int, text: TextStream) -> dict:
    """OpenAI completions format for tokens [start, end) of a choice. `text`: a stream without
    stop strings fed the choice's tokens before `start` (fed these here). A token's text_offset
    is where its text starts in the completion's (text_offset.py: a token inside a character,
    which decodes alone to U+FFFD, starts where that character does). top_logprobs holds the
    top N and the sampled token where it is not among them (as OpenAI and vLLM: up to N + 1,
    one with N = 0); tokens that decode to the same text share one key, with the most likely
    one's logprob."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp in zip(c.token_ids[start:end], c.logprobs[start:end]):
        out["tokens"].append(tok.token_text(t))
        out["token_logprobs"].append(lp["logprob"])
        top: dict[str, float] = {}
        for a, v in [*lp["top"], [t, lp["logprob"]]]:  # most likely first (the sampled token: in the top or below it)
            top.setdefault(tok.token_text(a), v)
        out["top_logprobs"].append(top)
        out["text_offset"].append(feed_with_offset(text, tok, t))
    return out


def _chat_logprobs(c: Choice, tok, start: int, end: int) -> dict:
    """OpenAI chat format for tokens [start, end) of a choice: `bytes` are the token's own
    (a token inside a character reads U+FFFD alone, and its bytes put the character back)."""
    def entry(t: int, v: float) -> dict:
        return {"token": tok.token_text(t), "logprob": v, "bytes": list(tok.token_bytes(t))}

    return {"content": [dict(entry(t, lp["logprob"]), top_logprobs=[entry(a, v) for a, v in lp["top"]])
                        for t, lp in zip(c.token_ids[start:end], c.logprobs[start:end])]}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _choice_error(c: Choice) -> APIError:
    """The error a choice ended in: 503 for a replica that failed (its message), 500 for one
    that could not admit the request (a bug: its message, which holds the exception's text,
    goes to the log under the choice's request id, which starts with the call's), else the
    input's fault (its message)."""
    if c.error_status == 503:
        return APIError(503, c.error, code="unavailable", headers={"Retry-After": "1"})
    if c.error_status >= 500:
        return internal_error(c.request_id, c.error)
    return APIError(c.error_status, c.error, code="invalid_value")


def _stream_error(c: Choice) -> str:
    """A stream's error event for a choice that ended in an error after its stream began: the
    message after its finish_reason "error" chunk (OpenAI's client raises it)."""
    e = _choice_error(c)
    return _sse(error_body(e.status, e.message, e.code))


def _client_left() -> APIError:
    """The answer to a call whose client disconnected before it was ready (nobody reads it)."""
    return APIError(499, "the client disconnected", code="client_disconnected")


async def _collect(request: Request, choices: list[Choice], reservation: Reservation) -> None:
    """Run every choice to its end; a client that disconnects meanwhile aborts them all."""
    async def run():
        async for c, _, finished in run_choices(request.app.state.client, choices, request.app.state.metrics,
                                                reservation):
            if finished and c.error and not c.token_ids:
                raise _choice_error(c)

    try:
        await until_disconnected(request, run())
    except ClientGone:  # nobody reads this answer; its choices are aborted already
        raise _client_left() from None
    finally:
        reservation.release_all()


async def _under_way(request: Request, choices: list[Choice], reservation: Reservation):
    """A streamed call's events, once the call is under way: its choices run until the first
    event that is not a choice ending in an error before any token. Until then no response has
    begun, so a call whose every choice ended that way is answered with the first one's error and
    its status, as a non-streaming call is (a 503 with Retry-After when every replica refused it),
    rather than with a 200 stream that holds only an error event. A client that disconnects
    meanwhile aborts them all."""
    events = run_choices(request.app.state.client, choices, request.app.state.metrics, reservation)
    head: list[tuple[Choice, str, bool]] = []

    async def until_under_way() -> bool:
        failed = 0
        async for c, delta, finished in events:
            head.append((c, delta, finished))
            if not (finished and c.error and not c.token_ids):
                return True
            failed += 1
            if failed == len(choices):
                return False
        return False

    under_way = False
    try:
        under_way = await until_disconnected(request, until_under_way())
    except ClientGone:  # nobody reads this answer; its choices are aborted already
        raise _client_left() from None
    finally:
        if not under_way:
            await events.aclose()
            reservation.release_all()
    if not under_way:
        raise _choice_error(min((c for c, _, _ in head), key=lambda c: c.index))

    async def stream():
        try:
            for event in head:
                yield event
            async for event in events:
                yield event
        finally:
            await events.aclose()
    return stream()


def _card(request: Request) -> dict:
    info = request.app.state.client.model
    return {"id": info.name, "object": "model", "created": request.app.state.started, "owned_by": "hyrax",
            "max_model_len": info.max_model_len}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [_card(request)]}


@router.get("/v1/models/{model:path}")
async def model(model: str, request: Request):
    """OpenAI's retrieve-model route; a model id may have slashes (org/name)."""
    _check_model(request, model)
    return _card(request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, response: Response,
                      call_id: str = Depends(call_id_of)):
    _check_model(request, body.model)
    if body.logprobs is not None and body.echo:
        raise APIError(400, "echo together with logprobs (prompt logprobs) is not supported", param="echo",
                       code="unsupported_parameter")
    _check_choices(request, _prompt_count(body) * body.n)
    info = request.app.state.client.model
    prompts = await _prompts(body, info.tokenizer, info.vocab_size, info.max_model_len)
    grammar = await checked_grammar(body)
    choices = _choices(request, body, call_id, prompts, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, body.logprobs,
                       grammar)
    reservation = _admit(request, choices)
    rid, created = f"cmpl-{call_id}", int(time.time())
    headers = {REQUEST_ID_HEADER: call_id}
    echo = {c.index: info.tokenizer.decode(c.prompt_ids) if body.echo else "" for c in choices}

    want_lp = body.logprobs is not None

    def chunk(c, text, finish, lp=None):
        return {"id": rid, "object": "text_completion", "created": created, "model": info.name,
                "choices": [{"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}]}

    if body.stream:
        under_way = await _under_way(request, choices, reservation)

        async def events():
            # per choice: logprob entries sent, and the text of their tokens (where the next one
            # starts, from the start of the completion, as in the whole answer)
            sent_echo = set()
            sent_lp = {c.index: (0, TextStream.after_prompt(info.tokenizer.decode, c.prompt_ids)) for c in choices}
            async for c, delta, finished in under_way:
                if c.index not in sent_echo:
                    delta, _ = echo[c.index] + delta, sent_echo.add(c.index)
                if delta or finished:
                    lp = None
                    if want_lp:
                        (n0, text), n1 = sent_lp[c.index], len(c.logprobs)
                        lp = _completion_logprobs(c, info.tokenizer, n0, n1, text)
                        sent_lp[c.index] = n1, text
                    yield _sse(chunk(c, delta, c.finish_reason if finished else None, lp))
                if finished and c.error:
                    yield _stream_error(c)
            if body.stream_options and body.stream_options.include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": info.name,
                            "choices": [], "usage": _usage(choices, body.n)})
            yield "data: [DONE]\n\n"
        return ClosingStreamingResponse(events(), on_close=reservation.release_all, media_type="text/event-stream",
                                        headers=headers)

    await _collect(request, choices, reservation)
    response.headers.update(headers)
    texts = {c.index: echo[c.index] + c.text.emitted for c in choices}
    return {"id": rid, "object": "text_completion", "created": created, "model": info.name,
            "choices": [{"index": c.index, "text": texts[c.index],
                         "logprobs": _completion_logprobs(
                             c, info.tokenizer, 0, len(c.logprobs),
                             TextStream.after_prompt(info.tokenizer.decode, c.prompt_ids)) if want_lp else None,
                         "finish_reason": c.finish_reason} for c in sorted(choices, key=lambda c: c.index)],
            "usage": _usage(choices, body.n)}


def _chat_max_tokens(body: ChatRequest) -> int | None:
    """max_completion_tokens (OpenAI's current name) or max_tokens (its older one); both only
    when they agree."""
    given = {v for v in (body.max_tokens, body.max_completion_tokens) if v is not None}
    if len(given) > 1:
        raise APIError(400, f"max_tokens ({body.max_tokens}) and max_completion_tokens ({body.max_completion_tokens}) "
                            "disagree; give one of them", param="max_tokens", code="invalid_value")
    return given.pop() if given else None


@router.post("/v1/chat/completions")
async def chat(body: ChatRequest, request: Request, response: Response, call_id: str = Depends(call_id_of)):
    _check_model(request, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs", code="invalid_value")
    want_lp = bool(body.logprobs)
    info = request.app.state.client.model
    tools = await checked_tools(body, info.chat_template, info.tokenizer)
    grammar = await checked_grammar(body)
    if tools.parses and grammar is not None:
        raise APIError(400, "a forced tool call already constrains the answer: drop response_format or "
                            "structured_outputs" if tools.forced else
                            "tool_choice 'auto' lets the model write calls in its own syntax, which response_format "
                            "or structured_outputs would rule out: drop them, or force the call (tool_choice "
                            "'required' or a named function)", param="tool_choice", code="invalid_value")
    try:
        prompt = render_chat(info.chat_template, [m.for_template() for m in body.messages], tools=tools.tools)
    except Exception as e:  # noqa: BLE001 - a template error is the checkpoint's problem, reported clearly
        raise APIError(400, template_error(e), param="messages", code="invalid_value") from None
    max_tokens = _chat_max_tokens(body)
    _refuse_early(info.tokenizer, [prompt], max_tokens, CHAT_DEFAULT_MAX_TOKENS, info.max_model_len, "messages")
    ids, = await encode(info.tokenizer, [prompt])
    choices = _choices(request, body, call_id, [ids], max_tokens, CHAT_DEFAULT_MAX_TOKENS,
                       (body.top_logprobs or 0) if want_lp else None, tools.grammar or grammar, prompt_param="messages")
    parsers = {c.index: tools.parser() for c in choices} if tools.parses else {}

    def finish_reason(c):  # an answer that made calls and ended by itself ends as OpenAI's do
        made = c.index in parsers and parsers[c.index].made_calls
        return "tool_calls" if made and c.finish_reason == "stop" else c.finish_reason
    reservation = _admit(request, choices)
    rid, created = f"chatcmpl-{call_id}", int(time.time())
    headers = {REQUEST_ID_HEADER: call_id}

    def chunk(c, delta, finish, lp=None):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": info.name,
                "choices": [{"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    if body.stream:
        under_way = await _under_way(request, choices, reservation)

        async def events():
            started, sent_lp = set(), {c.index: 0 for c in choices}

            def logprobs_since_last(c):
                if not want_lp:
                    return None
                n0, n1 = sent_lp[c.index], len(c.logprobs)
                sent_lp[c.index] = n1
                return _chat_logprobs(c, info.tokenizer, n0, n1)
            async for c, delta, finished in under_way:
                if c.index not in started:
                    started.add(c.index)
                    yield _sse(chunk(c, {"role": "assistant", "content": None if tools.forced else ""}, None))
                parts = []
                if parsers:  # the answer read back as content and tool calls
                    delta, parts = parsers[c.index].feed(delta)
                    if finished:
                        more_text, more_parts = parsers[c.index].finish()
                        delta, parts = delta + more_text, parts + more_parts
                if delta:
                    yield _sse(chunk(c, {"content": delta}, None, logprobs_since_last(c)))
                if parts:
                    yield _sse(chunk(c, {"tool_calls": parts}, None, logprobs_since_last(c)))
                if finished:  # with the logprobs of tokens that showed no text (EOS, a stop string's)
                    rest = logprobs_since_last(c) if len(c.logprobs) > sent_lp[c.index] else None
                    yield _sse(chunk(c, {}, finish_reason(c), rest))
                    if c.error:
                        yield _stream_error(c)
            if body.stream_options and body.stream_options.include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": info.name,
                            "choices": [], "usage": _usage(choices, body.n)})
            yield "data: [DONE]\n\n"
        return ClosingStreamingResponse(events(), on_close=reservation.release_all, media_type="text/event-stream",
                                        headers=headers)

    await _collect(request, choices, reservation)
    response.headers.update(headers)
    return {"id": rid, "object": "chat.completion", "created": created, "model": info.name,
            "choices": [{"index": c.index, "message": _message(c, parsers.get(c.index)),
                         "logprobs": _chat_logprobs(c, info.tokenizer, 0, len(c.logprobs)) if want_lp else None,
                         "finish_reason": finish_reason(c)}
                        for c in sorted(choices, key=lambda c: c.index)],
            "usage": _usage(choices, body.n)}


def _message(c: Choice, parser: ToolCallParser | None) -> dict:
    if parser is None:
        return {"role": "assistant", "content": c.text.emitted}
    parser.feed(c.text.emitted)
    parser.finish()
    return parser.message()
