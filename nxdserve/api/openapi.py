"""GET /openapi.json, generated from the pydantic request and response models, so the document
cannot drift from what the handlers accept."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from nxdserve.api import protocol, responses
from nxdserve.api.responses_api import protocol as responses_api

# path -> (method, summary, request model or None, response model or None, streams SSE)
_ENDPOINTS: list[tuple[str, str, str, type[BaseModel] | None, type[BaseModel] | None, bool]] = [
    ("/v1/completions", "post", "Create a completion", protocol.CompletionRequest, responses.CompletionResponse, True),
    (
        "/v1/chat/completions",
        "post",
        "Create a chat completion",
        protocol.ChatCompletionRequest,
        responses.ChatCompletionResponse,
        True,
    ),
    ("/v1/models", "get", "List the served models", None, responses.ModelList, False),
    # Streams OpenAI's typed Responses events (response.created, response.output_text.delta, ...).
    ("/v1/responses", "post", "Create a response", responses_api.ResponsesRequest, responses_api.ResponseObject, False),
    ("/v1/responses/{response_id}", "get", "Retrieve a stored response", None, responses_api.ResponseObject, False),
    ("/v1/responses/{response_id}", "delete", "Delete a stored response", None, None, False),
    (
        "/tokenize",
        "post",
        "Tokenize a prompt or chat messages",
        protocol.TokenizeRequest,
        responses.TokenizeResponse,
        False,
    ),
    ("/detokenize", "post", "Detokenize token ids", protocol.DetokenizeRequest, responses.DetokenizeResponse, False),
    ("/version", "get", "Server version", None, responses.VersionResponse, False),
    ("/health", "get", "200 while the engine loop runs, 503 once it died", None, None, False),
    ("/metrics", "get", "Prometheus metrics (vLLM's names)", None, None, False),
]
_STREAM_CHUNKS: dict[str, type[BaseModel]] = {
    "/v1/completions": responses.CompletionStreamResponse,
    "/v1/chat/completions": responses.ChatCompletionStreamResponse,
}
_REF = "#/components/schemas/{model}"


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


@functools.cache
def openapi_schema(version: str) -> dict[str, Any]:
    models: list[type[BaseModel]] = [responses.ErrorResponse, *_STREAM_CHUNKS.values()]
    for _, _, _, req, resp, _ in _ENDPOINTS:
        models += [m for m in (req, resp) if m is not None]
    requests = {req for _, _, _, req, _, _ in _ENDPOINTS if req is not None}
    inputs = [(m, "validation" if m in requests else "serialization") for m in models]
    _, top = models_json_schema(inputs, ref_template=_REF)  # type: ignore[arg-type]
    error = {"description": "Error", "content": {"application/json": {"schema": _ref(responses.ErrorResponse)}}}
    paths: dict[str, Any] = {}
    for path, method, summary, req, resp, streams in _ENDPOINTS:
        content: dict[str, Any] = {"application/json": {"schema": _ref(resp)}} if resp else {}
        if streams:
            content["text/event-stream"] = {"schema": _ref(_STREAM_CHUNKS[path])}
        op: dict[str, Any] = {
            "summary": summary,
            "responses": {"200": {"description": "OK", "content": content}, "default": error},
        }
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(req)}}}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "nxdserve OpenAI-compatible API", "version": version},
        "paths": paths,
        "components": {
            "schemas": top.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
