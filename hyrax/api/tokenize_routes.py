"""vLLM's /tokenize and /detokenize (also under /v1): the same tokenization and chat template
the generation endpoints use, so a client can count tokens before it sends a request."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from hyrax.api.auth import require_api_key
from hyrax.api.errors import APIError
from hyrax.api.json_body import JSONRoute
from hyrax.api.schemas import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from hyrax.api.text import encode, template_error, render_chat

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=JSONRoute)


def _model(request: Request, name: str | None):
    info = request.app.state.client.model
    if name is not None and name != info.name:
        raise APIError(404, f"model {name!r} does not exist; this server serves {info.name!r}",
                       param="model", code="model_not_found")
    return info


@router.post("/v1/tokenize", response_model=TokenizeResponse)
@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request):
    info = _model(request, body.model)
    if body.messages is not None:
        try:
            text = render_chat(info.chat_template, [m.for_template() for m in body.messages],
                               body.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template error is the checkpoint's problem, reported clearly
            raise APIError(400, template_error(e), param="messages", code="invalid_value") from None
    else:
        text = body.prompt
    ids, = await encode(info.tokenizer, [text])
    return {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, "token_strs": None}


@router.post("/v1/detokenize", response_model=DetokenizeResponse)
@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request):
    info = _model(request, body.model)
    if any(t < 0 or t >= info.vocab_size for t in body.tokens):
        raise APIError(400, f"tokens: token ids must be in [0, {info.vocab_size})", param="tokens",
                       code="invalid_value")
    return {"prompt": info.tokenizer.decode(body.tokens)}
