"""API documentation: the OpenAPI schema with every status the server answers and the shape
of its bodies, and Swagger UI at /docs served from the installed `swagger-ui-bundle-v2`
package's assets (no CDN: /docs works offline). Without that package /docs is off and
/openapi.json stays."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from hyrax.api.schemas import (
    ChatCompletionResponse, CompletionResponse, ErrorResponse, ModelCard, ModelList,
)

ASSETS = "/docs/assets"
_ERROR_TEXT = {
    400: "Invalid request: a malformed body, an unknown or unsupported field, a value out of range",
    401: "Missing or wrong bearer token (admin routes; /v1 routes when the server has API keys)",
    404: "Unknown model, request or replica",
    409: "The request is not in a state that allows this operation",
    413: "The request body exceeds the server's limit",
    415: "Content-Type declares a charset other than UTF-8 (JSON over HTTP is UTF-8), or a Content-Encoding",
    503: "Not ready or the request queue is full; retry after the `Retry-After` header's seconds",
}
_EXTRA = {  # statuses beyond the ones every route of its kind answers
    ("post", "/v1/completions"): (404, 503),
    ("post", "/v1/chat/completions"): (404, 503),
    ("post", "/v1/tokenize"): (404,), ("post", "/tokenize"): (404,),
    ("post", "/v1/detokenize"): (404,), ("post", "/detokenize"): (404,),
    ("get", "/v1/models/{model}"): (404,),
    ("post", "/admin/retract"): (404,), ("post", "/admin/resume"): (404,),
    ("post", "/admin/migrate"): (404, 409),
    ("post", "/admin/drain"): (404,),
    ("get", "/health"): (503,),
    ("get", "/dashboard/assets/{name}"): (404,),
}
_OK_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionResponse, "/v1/models": ModelList,
    "/v1/models/{model}": ModelCard,
}
_GUARDED = ("/v1/", "/admin/", "/tokenize", "/detokenize")


def error_statuses(method: str, path: str) -> tuple[int, ...]:
    """Every error status an operation answers (besides 405 for a wrong method)."""
    s = set(_EXTRA.get((method, path), ()))
    if path.startswith(_GUARDED):
        s.add(401)
    if method == "post":
        s |= {400, 413, 415}
    return tuple(sorted(s))


def _ref(schema: dict, model: type[BaseModel]) -> dict:
    """Add `model` (and what it refers to) to the schema's components; return a $ref to it."""
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    js = model.model_json_schema(ref_template="#/components/schemas/{model}")
    comps.update(js.pop("$defs", {}))
    comps[model.__name__] = js
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def build_openapi(app: FastAPI) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    error_ref = _ref(schema, ErrorResponse)
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)  # validation errors are 400s here
            for status in error_statuses(method, path):
                r = {"description": _ERROR_TEXT[status], "content": {"application/json": {"schema": error_ref}}}
                if status == 503:
                    r["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
                responses[str(status)] = r
            if path in _OK_BODIES:
                content = {"application/json": {"schema": _ref(schema, _OK_BODIES[path])}}
                if method == "post":
                    content["text/event-stream"] = {"schema": {"type": "string"},
                                                    "description": "with \"stream\": true; ends with data: [DONE]"}
                responses["200"] = {"description": "Successful Response", "content": content}
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    return schema


def _swagger_assets():
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        return None
    return swagger_ui_path if (swagger_ui_path / "swagger-ui-bundle.js").is_file() else None


def install(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi
    assets = _swagger_assets()
    if assets is None:
        return
    from fastapi.staticfiles import StaticFiles

    app.mount(ASSETS, StaticFiles(directory=str(assets)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} API",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")
