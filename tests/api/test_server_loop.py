"""The server's event loop and HTTP parser: uvloop and httptools where installed (both are dependencies here),
asyncio's loop when ``NXDSERVE_UVLOOP=0``."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
import uvloop

from nxdserve.api import server
from nxdserve.api.server import ServeOptions, event_loop_factory, run_server_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_server_runs_on_uvloop_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NXDSERVE_UVLOOP", raising=False)
    assert event_loop_factory() is uvloop.new_event_loop
    assert run_server_loop(_loop_module).startswith("uvloop")
    monkeypatch.setenv("NXDSERVE_UVLOOP", "0")
    assert event_loop_factory() is None
    assert run_server_loop(_loop_module).startswith("asyncio")


def test_uvicorn_parses_http_with_httptools() -> None:
    async def app(scope: dict, receive: object, send: object) -> None:  # never called
        raise AssertionError

    config = server._uvicorn_config(app, ServeOptions(host="127.0.0.1", port=0))
    config.load()
    assert isinstance(config, uvicorn.Config)
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
