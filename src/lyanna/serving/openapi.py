"""The server's contract in ``/openapi.json``: request bodies, error responses and content types
that FastAPI cannot infer here, and the limits of this one app.

FastAPI documents a request body only when it parses the body itself; the completion handlers
read theirs (``body.py``: a byte limit before parsing, a depth limit, OpenAI-shaped 400s), so the
request models are declared here. The schema is also made exact for the app that serves it: the
model it serves, its decoding methods and the completion tokens its context window allows.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .responses import ChatCompletionChunk, TextCompletionChunk
from .schema import ChatRequest, CompletionRequest, ErrorResponse

_COMPONENTS = "#/components/schemas/"
_ERRORS = {
    401: "No API key, or not one this server accepts (code ``invalid_api_key``): send ``Authorization: Bearer <key>``",
    400: "The body is not JSON, not an object, nested too deeply, or a field is invalid (``param`` names it); "
         "or the prompt and max_tokens do not fit the context window (code ``context_length_exceeded``)",
    404: "No such model here (code ``model_not_found``)",
    413: "The body is larger than the server's limit (lyanna serve --max-body-bytes)",
    429: "The queue is full; retry after ``Retry-After`` seconds",
    500: "An internal error, or the generation failed",
    503: "The server is shutting down (code ``server_shutting_down``)",
    504: "The request ran past its deadline (lyanna serve --request-timeout; code ``timeout``)",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "required": True,
                                "schema": {"type": "integer"}}}
_AUTHENTICATE = {"WWW-Authenticate": {"description": "The scheme to authenticate with: Bearer", "required": True,
                                      "schema": {"type": "string"}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error responses ``statuses`` for a route's ``responses``, in OpenAI's error shape. Their
    content is spelled out as JSON: a ``model`` would take the route's media type (text for
    ``/metrics``)."""
    content = {"application/json": {"schema": {"$ref": _COMPONENTS + ErrorResponse.__name__}}}
    headers = {429: _RETRY_AFTER, 401: _AUTHENTICATE}
    return {status: {"description": _ERRORS[status], "content": content,
                     **({"headers": headers[status]} if status in headers else {})} for status in statuses}


def _event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a streamed completion (without OpenAPI 3.2's ``itemSchema``, an
    event stream's schema describes each event): its data is a ``chunk`` or an error as JSON, or
    the closing ``[DONE]``."""
    payload = {"anyOf": [{"$ref": _COMPONENTS + chunk.__name__}, {"$ref": _COMPONENTS + ErrorResponse.__name__}]}
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
    return {"type": "object", "properties": {"data": data}, "required": ["data"]}


def completion_route(request: type[BaseModel], answer: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    """A completion route's OpenAPI arguments: its body is ``request``, its 200 an ``answer``, or
    server-sent events of ``chunk``s when the request streams."""
    body = {"required": True, "content": {"application/json": {"schema": {"$ref": _COMPONENTS + request.__name__}}}}
    ok = {"model": answer, "description": "The completion; server-sent events when stream is true",
          "content": {"text/event-stream": {"schema": _event(chunk)}}}
    return {"response_model": None, "openapi_extra": {"requestBody": body},
            "responses": {200: ok, **errors(400, 404, 413, 429, 500, 503, 504)}}


def _nullable_enum(values: list[Any]) -> dict[str, Any]:
    return {"anyOf": [{"enum": values}, {"type": "null"}], "default": None}


def component_schemas(served: str, methods: list[str], context: int) -> dict[str, Any]:
    """The JSON schemas FastAPI does not add to the components section: the request models, for a
    server of ``served`` with decoding ``methods`` and a context window of ``context`` tokens, the
    stream's chunks and the error shape."""
    _, top = models_json_schema([(ChatRequest, "validation"), (CompletionRequest, "validation"),
                                 (ChatCompletionChunk, "serialization"), (TextCompletionChunk, "serialization"),
                                 (ErrorResponse, "serialization")], ref_template=_COMPONENTS + "{model}")
    schemas = top["$defs"]
    for name in ("ChatRequest", "CompletionRequest"):
        fields = schemas[name]["properties"]
        fields["model"] = {**_nullable_enum([served]), "description": "The served model (GET /v1/models)"}
        fields["lyanna_method"] = {**_nullable_enum(methods), "description": fields["lyanna_method"]["description"]}
        for limit in ("max_tokens", "max_completion_tokens"):
            # a prompt has at least one token; the prompt and the completion must fit the window
            fields[limit]["anyOf"][0]["maximum"] = context - 1
    return schemas


def _without_fastapi_validation_errors(schema: dict[str, Any]) -> None:
    """FastAPI documents a 422 for every route with parameters; this server answers invalid
    requests with OpenAI's 400, and a path parameter (a string) cannot fail validation."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)


_BEARER = {"type": "http", "scheme": "bearer", "description": "One of the server's API keys (lyanna serve --api-key)"}


def _secure(schema: dict[str, Any], protected: set[str]) -> None:
    """Declare the bearer key on every operation whose path starts with one of ``protected``, and
    the 401 it answers without one."""
    if not protected:
        return
    schema["components"]["securitySchemes"] = {"apiKey": _BEARER}
    for path, operations in schema["paths"].items():
        if any(path.startswith(prefix) for prefix in protected):
            for operation in operations.values():
                operation["security"] = [{"apiKey": []}]
                operation["responses"].update({str(k): v for k, v in errors(401).items()})


def install_openapi(app: FastAPI, served: str, methods: list[str], context: int, protected: set[str] = frozenset()) -> None:
    """Make ``app.openapi()`` build the full contract (once; FastAPI caches it on the app);
    ``protected``: the path prefixes that require an API key."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _without_fastapi_validation_errors(schema)
            schema["components"]["schemas"].update(component_schemas(served, methods, context))
            model_id = schema["paths"]["/v1/models/{model_id}"]["get"]["parameters"][0]
            model_id["schema"] = {"type": "string", "enum": [served], "description": "The served model; others get 404"}
            _secure(schema, set(protected))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the schema
