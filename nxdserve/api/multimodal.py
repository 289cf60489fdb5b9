"""Image content parts of chat messages: where an image may come from, loading it, decoding it, limits.

OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` parts are read from three sources, as vLLM
reads them: ``data:`` URLs (base64), ``file://`` URLs under ``--allowed-local-media-path`` only, and
``http(s)://`` URLs only for hosts the operator lists in ``--allowed-media-domains`` (off by default here:
a server that fetches any URL a client names is an open proxy). Every failure is a 400 that names the
part (``messages[i].content[j]``). File reads, downloads and Pillow's decoding never run on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from nxdserve.api.errors import APIError
from nxdserve.errors import ConfigError

DEFAULT_LIMIT_PER_PROMPT = 999  # vLLM V1's default per modality
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # encoded size: larger uploads are refused before decoding
MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # decoded size: guards against decompression bombs
FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT default
MODALITIES = ("image",)


@dataclass(frozen=True)
class MediaOptions:
    """Where image bytes may come from and how many a prompt may hold (the server's media flags)."""

    allowed_local_media_path: Path | None = None
    allowed_media_domains: tuple[str, ...] = ()
    limit_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": DEFAULT_LIMIT_PER_PROMPT})

    @classmethod
    def from_flags(
        cls, allowed_local_media_path: str | None, allowed_media_domains: Sequence[str] | None,
        limit_mm_per_prompt: dict[str, Any] | None,
    ) -> MediaOptions:  # fmt: skip
        local = None
        if allowed_local_media_path:
            local = Path(allowed_local_media_path).expanduser().resolve()
            if not local.is_dir():
                raise ConfigError(f"--allowed-local-media-path {allowed_local_media_path!r} is not a directory.")
        limits = {"image": DEFAULT_LIMIT_PER_PROMPT}
        for modality, value in (limit_mm_per_prompt or {}).items():
            if modality not in MODALITIES:
                raise ConfigError(
                    f"--limit-mm-per-prompt: modality {modality!r} is not supported; nxdserve takes images only."
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"--limit-mm-per-prompt: {modality} must be a non-negative integer, got {value!r}.")
            limits[modality] = value
        domains = tuple(d.strip().lower() for d in (allowed_media_domains or []) if d.strip())
        return cls(local, domains, limits)


@dataclass(frozen=True)
class ImageInput:
    """One decoded image of a prompt, in prompt order."""

    image: Any  # PIL.Image.Image, RGB, fully loaded
    content_hash: str  # sha256 of the encoded bytes: the key for encoder caches and prefix caching
    where: str  # the part it came from, e.g. "messages[0].content[1]"


def image_parts(messages: Sequence[Any]) -> list[tuple[str, Any]]:
    """(where, part) for every non-text content part, in prompt order."""
    found = []
    for i, msg in enumerate(messages):
        content = msg.content
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.type != "text":
                found.append((f"messages[{i}].content[{j}]", part))
    return found


async def load_chat_images(messages: Sequence[Any], options: MediaOptions) -> list[ImageInput]:
    """Every image of a chat request, loaded and decoded; a 400 naming the part for anything wrong."""
    parts = image_parts(messages)
    limit = options.limit_per_prompt.get("image", DEFAULT_LIMIT_PER_PROMPT)
    images = []
    for n, (where, part) in enumerate(parts, start=1):
        if part.type != "image_url":
            raise APIError(
                f"{where}: unsupported content part type {part.type!r}; nxdserve takes 'text' and 'image_url' parts.",
                param=where,
            )
        if n > limit:
            raise APIError(
                f"{where}: at most {limit} image(s) may be provided in one prompt (--limit-mm-per-prompt).",
                param=where,
            )
        data = await _image_bytes(_image_url(part, where), options, where)
        image = await asyncio.to_thread(decode_image, data, where)
        images.append(ImageInput(image, hashlib.sha256(data).hexdigest(), where))
    return images


def require_image_support(engine: Any, images: Sequence[ImageInput]) -> None:
    """A 400 naming the first image when the served model takes no images (``AsyncEngine.accepts_images``:
    the backend's ``BackendCapabilities.image_inputs``)."""
    if images and not getattr(engine, "accepts_images", False):
        if getattr(getattr(engine, "config", None), "data_parallel_size", 1) > 1:
            why = "image inputs are not served with --data-parallel-size > 1 yet (docs/multimodal.md)"
        else:
            why = "the served model is a text-only model and takes no image inputs"
        raise APIError(f"{images[0].where}: {why}.", param=images[0].where)


def decode_image(data: bytes, where: str) -> Any:
    """Encoded bytes -> a loaded RGB PIL image (runs in a worker thread: decoding is CPU work)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise APIError(
                    f"{where}: the image is {img.width}x{img.height} pixels, more than {MAX_IMAGE_PIXELS} allowed.",
                    param=where,
                )
            img.load()
            return img.convert("RGB")
    except APIError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise APIError(f"{where}: cannot decode the image: {exc}", param=where) from exc


def _image_url(part: Any, where: str) -> str:
    spec = getattr(part, "image_url", None)
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str) or not url:
        raise APIError(f"{where}: an image_url part needs image_url.url (a data:, file: or http(s): URL).", param=where)
    return url


async def _image_bytes(url: str, options: MediaOptions, where: str) -> bytes:
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        return _data_url_bytes(url, where)
    if scheme == "file":
        return await asyncio.to_thread(_local_file_bytes, url, options, where)
    if scheme in ("http", "https"):
        return await _fetch(url, options, where)
    raise APIError(f"{where}: unsupported image URL scheme {scheme!r}; use data:, file: or http(s):.", param=where)


def _data_url_bytes(url: str, where: str) -> bytes:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep or not header.endswith(";base64"):
        raise APIError(f"{where}: a data: URL must be base64 ('data:image/png;base64,...').", param=where)
    if not header.startswith("image/"):
        raise APIError(f"{where}: a data: URL must hold an image/* media type, got {header[:-7]!r}.", param=where)
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
        raise APIError(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes.", param=where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(f"{where}: the data: URL is not valid base64: {exc}", param=where) from exc


def _local_file_bytes(url: str, options: MediaOptions, where: str) -> bytes:
    root = options.allowed_local_media_path
    if root is None:
        raise APIError(f"{where}: file: URLs need the server started with --allowed-local-media-path.", param=where)
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise APIError(f"{where}: file: URLs must name a local path, not host {parsed.netloc!r}.", param=where)
    path = Path(unquote(parsed.path)).resolve()  # resolves symlinks and '..' before the containment check
    if not path.is_relative_to(root):
        raise APIError(f"{where}: {path} is outside --allowed-local-media-path.", param=where)
    if not path.is_file():
        raise APIError(f"{where}: no such file under --allowed-local-media-path: {path}", param=where)
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise APIError(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes.", param=where)
    return path.read_bytes()


async def _fetch(url: str, options: MediaOptions, where: str) -> bytes:
    host = (urlparse(url).hostname or "").lower()
    if host not in options.allowed_media_domains:
        raise APIError(
            f"{where}: this server does not fetch image_url URLs from {host or url!r}; send a data: URL, or start it "
            "with --allowed-media-domains naming the host.",
            param=where,
        )
    import httpx

    chunks: list[bytes] = []
    size = 0
    try:
        # httpx's timeout bounds each read; asyncio.timeout bounds the whole download (a slow drip too).
        async with (
            asyncio.timeout(FETCH_TIMEOUT_S),
            httpx.AsyncClient(timeout=FETCH_TIMEOUT_S) as client,
            client.stream("GET", url) as response,
        ):
            response.raise_for_status()
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_IMAGE_BYTES:
                    raise APIError(f"{where}: the image is larger than {MAX_IMAGE_BYTES} bytes.", param=where)
                chunks.append(chunk)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise APIError(f"{where}: cannot fetch the image: {exc!r}", param=where) from exc
    return b"".join(chunks)
