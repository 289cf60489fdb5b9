"""The Starlette application: routes, middleware and exception handlers around one AsyncEngine."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nxdserve.api.chat import create_chat_completion, render_prompt
from nxdserve.api.completions import create_completion
from nxdserve.api.engine_protocol import EngineClient
from nxdserve.api.errors import APIError, handle_exception
from nxdserve.api.lora import RUNTIME_ROUTES as LORA_RUNTIME_ROUTES
from nxdserve.api.lora import adapter_cards
from nxdserve.api.lora import runtime_updates_allowed as runtime_lora_updates_allowed
from nxdserve.api.middleware import APIKeyMiddleware, RequestIdMiddleware, load_user_middleware
from nxdserve.api.multimodal import ImageInput, MediaOptions, load_chat_images, require_image_support
from nxdserve.api.openapi import openapi_schema
from nxdserve.api.params import check_token_ids, refuse_extra_fields
from nxdserve.api.protocol import DetokenizeRequest, TokenizeRequest
from nxdserve.api.responses import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ModelPermission,
    TokenizeResponse,
    VersionResponse,
)
from nxdserve.api.responses_api import RESPONSES_ROUTES, ResponseStore
from nxdserve.api.state import ServerState, get_state, parse
from nxdserve.engine.prompts import ProcessedPrompt
from nxdserve.errors import NxdServeError
from nxdserve.tools.flags import check_chat_template_flags

if TYPE_CHECKING:
    from nxdserve.api.server import ServeOptions

logger = logging.getLogger(__name__)


def _version() -> str:
    from nxdserve import __version__

    return __version__


async def health(request: Request) -> Response:
    return Response(status_code=200 if get_state(request).engine.is_healthy else 503)


async def metrics(request: Request) -> Response:
    engine = get_state(request).engine
    # The engine sets its gauges after each step; aborts that leave it idle take no step, so the
    # gauges would keep showing the aborted requests. Refresh them from the live state per scrape.
    with contextlib.suppress(Exception):
        stats = engine.stats()
        engine.metrics.record_step(stats.num_running, stats.num_waiting, stats.kv_cache_usage, 0, 0)
    return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def version(request: Request) -> Response:
    return JSONResponse(VersionResponse(version=_version()).model_dump())


async def list_models(request: Request) -> Response:
    state = get_state(request)
    engine = state.engine
    cards = [
        ModelCard(
            id=name,
            root=str(engine.model_path),
            max_model_len=int(engine.max_model_len),
            permission=[ModelPermission()],
        )
        for name in state.served_model_names
    ]
    cards += adapter_cards(state)
    return JSONResponse(ModelList(data=cards).model_dump(mode="json"))


async def tokenize(request: Request) -> Response:
    state = get_state(request)
    req = await parse(request, TokenizeRequest)
    refuse_extra_fields(req)
    state.resolve_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError("Exactly one of `prompt` or `messages` must be given.", param="prompt")
    images: list[ImageInput] = []
    if req.messages is not None:
        check_chat_template_flags(req.add_generation_prompt, req.continue_final_message)
        images = await load_chat_images(req.messages, state.media)  # checked as a chat request's are
        require_image_support(state.engine, images)
        text = render_prompt(state.engine, req)
        add_special = bool(req.add_special_tokens)  # vLLM: False for chat unless asked
    else:
        text = req.prompt or ""
        add_special = req.add_special_tokens is None or req.add_special_tokens
    if images:  # the processor's expansion: the count a chat request's usage reports
        processed = await state.engine.process_prompt(
            {"prompt": text, "multi_modal_data": {"image": [image.image for image in images]}}, add_special
        )
        assert isinstance(processed, ProcessedPrompt)
        tokens = list(processed.token_ids)
    else:
        tokens = list(state.tokenizer.encode(text, add_special_tokens=add_special))
    token_strs = state.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
    resp = TokenizeResponse(
        count=len(tokens), max_model_len=int(state.engine.max_model_len), tokens=tokens, token_strs=token_strs
    )
    return JSONResponse(resp.model_dump())


async def detokenize(request: Request) -> Response:
    state = get_state(request)
    req = await parse(request, DetokenizeRequest)
    refuse_extra_fields(req)
    state.resolve_model(req.model)
    check_token_ids(req.tokens, int(state.engine.vocab_size), param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens)).model_dump())


async def openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema(_version()))


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 for unknown routes, in our envelope."""
    assert isinstance(exc, HTTPException)
    return APIError(str(exc.detail), status=exc.status_code).response()


ROUTES = [
    Route("/v1/completions", create_completion, methods=["POST"]),
    Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    *RESPONSES_ROUTES,
]
DOCS_ROUTES = [Route("/openapi.json", openapi, methods=["GET"])]


def create_app(
    engine: EngineClient,
    served_model_names: list[str] | None = None,
    api_key: str | list[str] | None = None,
    log_requests: bool = False,
    opts: ServeOptions | None = None,
) -> Starlette:
    """The ASGI app over a started AsyncEngine. ``served_model_names`` defaults to the engine's
    configured names; the first name is the one responses report. ``opts``: CORS, --middleware,
    --max-log-len and --disable-fastapi-docs (None: the defaults)."""
    names = list(served_model_names or engine.config.served_model_name or [])
    if not names:
        # As vLLM: the --model argument as given; for the embedded model, its folder name. Both
        # match the model_name label the engine puts on its metrics.
        names = [engine.config.model or Path(str(engine.model_path)).name]
    # Outermost first: CORS answers preflights and decorates every response (401s included, so a browser
    # sees the real error); the user's middleware wraps everything of ours, as vLLM adds it last.
    middleware = [
        Middleware(
            CORSMiddleware,
            allow_origins=opts.allowed_origins if opts else ["*"],
            allow_methods=opts.allowed_methods if opts else ["*"],
            allow_headers=opts.allowed_headers if opts else ["*"],
            allow_credentials=opts.allow_credentials if opts else False,
        ),
        *(load_user_middleware(path) for path in (opts.middleware if opts else [])),
        Middleware(RequestIdMiddleware),
    ]
    if api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=api_key))
    app = Starlette(
        routes=ROUTES
        + (DOCS_ROUTES if opts is None or opts.enable_docs else [])
        + (LORA_RUNTIME_ROUTES if runtime_lora_updates_allowed() else []),
        middleware=middleware,
        # Known failures go to ExceptionMiddleware (answered, not re-raised); ``Exception`` goes to
        # ServerErrorMiddleware, which answers a 500 in the envelope and re-raises so it is logged.
        exception_handlers={
            HTTPException: _http_exception,
            APIError: handle_exception,
            NxdServeError: handle_exception,
            ValidationError: handle_exception,
            Exception: handle_exception,
        },
    )
    app.state.nxdserve = ServerState(
        engine=engine,
        served_model_names=names,
        api_key=api_key,
        log_requests=log_requests,
        max_log_len=opts.max_log_len if opts else None,
        responses=ResponseStore(),
        media=opts.media if opts else MediaOptions(),
    )
    return app
