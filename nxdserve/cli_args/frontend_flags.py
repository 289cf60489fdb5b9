"""The OpenAI server's flags (vLLM's FrontendArgs), and the request-logging switches."""

from __future__ import annotations

import argparse
import ssl

from nxdserve.cli_args.registry import ServeParser
from nxdserve.cli_args.types import json_list, size

BOOL = argparse.BooleanOptionalAction
LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]
API_KEY_ENVS = ("VLLM_API_KEY", "NXDSERVE_API_KEY")


def add_frontend_flags(p: ServeParser) -> None:
    g = p.flag_group("Frontend", "The HTTP server")
    g.add("--config", default=None, note="YAML file of flags (keys are flag names); the command line wins")
    g.add("--host", default="0.0.0.0", note="address to bind (vLLM's default: all interfaces)")
    g.add("--port", type=int, default=8000, note="port to bind")
    g.add("--uds", default=None, note="serve on this Unix domain socket instead of host:port")
    g.add("--uvicorn-log-level", default=None, choices=LOG_LEVELS, note="uvicorn's log level (default: --log-level)")
    g.add("--disable-uvicorn-access-log", action=BOOL, default=False, note="no uvicorn access log lines")
    g.add("--disable-access-log-for-endpoints", default=None,
          note='comma-separated paths without access log lines, e.g. "/health,/metrics"')
    g.add("--allow-credentials", action=BOOL, default=False, note="CORS: allow credentials")
    g.add("--allowed-origins", type=json_list, default=["*"], note='CORS origins, a JSON list, e.g. \'["*"]\'')
    g.add("--allowed-methods", type=json_list, default=["*"], note="CORS methods, a JSON list")
    g.add("--allowed-headers", type=json_list, default=["*"], note="CORS headers, a JSON list")
    g.add("--api-key", nargs="+", default=None,
          note=f"require one of these bearer keys on /v1/* (or ${API_KEY_ENVS[0]}, ${API_KEY_ENVS[1]})")
    g.add("--lora-modules", nargs="+", default=None,
          note='LoRA adapters served at start: name=path, or JSON {"name","path","base_model_name"} (--enable-lora)')
    g.refused("--response-role", default="assistant", note="responses use the role 'assistant'")
    g.add("--ssl-keyfile", default=None, note="TLS private key file (PEM)")
    g.add("--ssl-certfile", default=None, note="TLS certificate chain file (PEM)")
    g.add("--ssl-ca-certs", default=None, note="CA certificates to verify clients with")
    g.refused("--enable-ssl-refresh", action=BOOL, default=False, note="restart the server to load new certificates")
    g.add("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
          note="client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)")
    g.add("--ssl-ciphers", default=None, note="TLS 1.2 cipher suites (OpenSSL syntax)")
    g.add("--root-path", default=None, note="path prefix a reverse proxy strips before forwarding (ASGI root_path)")
    g.add("--middleware", action="append", default=[],
          note="import path of an ASGI middleware class (added with its app) or an async function "
          "(request, call_next) -> response; repeatable")  # fmt: skip
    g.refused("--return-tokens-as-token-ids", action=BOOL, default=False,
              note="ask for it per request (return_tokens_as_token_ids)")
    g.no_effect("--disable-frontend-multiprocessing", action=BOOL, default=False,
                note="the server and the engine share one process")
    g.no_effect("--enable-request-id-headers", action=BOOL, default=False,
                note="an X-Request-Id header sent by the client is always echoed")
    g.refused("--tool-server", default=None, note="no built-in tool servers")
    g.add("--log-config-file", default=None, note="a JSON logging.config dictConfig for nxdserve and uvicorn")
    g.add("--max-log-len", type=size, default=None, note="prompt characters (or token ids) per request log line")
    g.add("--disable-fastapi-docs", action=BOOL, default=False, note="do not serve /openapi.json")
    g.no_effect("--enable-prompt-tokens-details", action=BOOL, default=False,
                note="no prefix-cache hit counts per request yet")
    g.no_effect("--enable-server-load-tracking", action=BOOL, default=False, note="see /metrics for the load")
    g.no_effect("--enable-force-include-usage", action=BOOL, default=False,
                note="non-streamed responses always carry usage; streams add it with stream_options")
    g.no_effect("--enable-tokenizer-info-endpoint", action=BOOL, default=False, note="no /tokenizer_info endpoint")
    g.no_effect("--enable-log-outputs", action=BOOL, default=False, note="generated text is not logged")
    g.add("--h11-max-incomplete-event-size", type=int, default=None, note="h11: largest incomplete request event")
    g.no_effect("--h11-max-header-count", type=int, default=None, note="uvicorn has no header-count setting")
    g.no_effect("--log-error-stack", action=BOOL, default=False, note="a 500's stack trace is always logged")
    g.add("--enable-log-requests", action=BOOL, default=None,
          note="log each request (prompt up to --max-log-len); nxdserve logs them unless turned off")
    g.add("--disable-log-requests", action="store_true", note="do not log each request (vLLM's older spelling)")
    g.add("--log-level", default="info", choices=LOG_LEVELS, note="nxdserve's log verbosity")
    g.add("--drain-timeout", type=float, default=30.0,
          note="seconds in-flight requests may run on after SIGTERM/SIGINT")
    g.add("--uvloop", action=BOOL, default=None,
          note="serve on uvloop's event loop (default: where installed; NXDSERVE_UVLOOP=0 also turns it off)")
