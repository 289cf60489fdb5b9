"""OpenAI's Responses API (``/v1/responses``) over the engine: text and function tools, stored responses."""

from __future__ import annotations

from starlette.routing import Route

from nxdserve.api.responses_api.handlers import create_response, delete_response, retrieve_response
from nxdserve.api.responses_api.store import ResponseStore

RESPONSES_ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
]

__all__ = ["RESPONSES_ROUTES", "ResponseStore"]
