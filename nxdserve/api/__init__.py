"""OpenAI-compatible HTTP API over an AsyncEngine: ``create_app(engine)`` gives the Starlette app,
``nxdserve.api.server`` runs it on uvicorn with a bounded drain on SIGTERM/SIGINT."""

from nxdserve.api.app import create_app

__all__ = ["create_app"]
