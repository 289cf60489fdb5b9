"""Image content parts: sources, decoding, limits and the 400s that name the part (nxdserve.api.multimodal)."""

from __future__ import annotations

import base64
import hashlib
import io
import types
from pathlib import Path
from typing import Any

import httpx
import pytest

from nxdserve.api import multimodal
from nxdserve.api.errors import APIError
from nxdserve.api.multimodal import MediaOptions, load_chat_images, require_image_support
from nxdserve.api.protocol import ChatMessage
from nxdserve.errors import ConfigError
from tests.api.conftest import MODEL_NAME

pytestmark = pytest.mark.anyio


def png_bytes(width: int = 8, height: int = 6, color: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def user(*parts: dict[str, Any]) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=[{"type": "text", "text": "Describe"}, *parts])]  # type: ignore[list-item]


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


async def rejected(messages: list[ChatMessage], options: MediaOptions | None = None) -> APIError:
    with pytest.raises(APIError) as info:
        await load_chat_images(messages, options or MediaOptions())
    assert info.value.status == 400
    return info.value


async def test_data_urls_decode_in_prompt_order_with_content_hashes() -> None:
    red, blue = png_bytes(color=(255, 0, 0)), png_bytes(4, 4, (0, 0, 255))
    images = await load_chat_images(user(image_part(data_url(red)), image_part(data_url(blue))), MediaOptions())
    assert [img.where for img in images] == ["messages[0].content[1]", "messages[0].content[2]"]
    assert images[0].image.size == (8, 6) and images[0].image.mode == "RGB"
    assert images[0].image.getpixel((0, 0)) == (255, 0, 0) and images[1].image.getpixel((0, 0)) == (0, 0, 255)
    assert images[0].content_hash == hashlib.sha256(red).hexdigest() != images[1].content_hash


async def test_jpeg_and_webp_decode_too() -> None:
    from PIL import Image

    for fmt, mime in (("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (0, 128, 0)).save(buf, format=fmt)
        (image,) = await load_chat_images(user(image_part(data_url(buf.getvalue(), mime))), MediaOptions())
        assert image.image.size == (16, 16)


async def test_bad_images_are_400s_naming_the_part() -> None:
    broken = await rejected(user(image_part(data_url(b"not an image at all"))))
    assert broken.param == "messages[0].content[1]" and "cannot decode" in broken.message
    not_base64 = await rejected(user(image_part("data:image/png;base64,@@@")))
    assert not_base64.param == "messages[0].content[1]" and "base64" in not_base64.message
    wrong_type = await rejected(user(image_part(data_url(b"hello", "text/plain"))))
    assert "image/*" in wrong_type.message
    no_url = await rejected(user({"type": "image_url", "image_url": {}}))
    assert "image_url.url" in no_url.message
    audio = await rejected(user({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}))
    assert audio.param == "messages[0].content[1]" and "'input_audio'" in audio.message
    scheme = await rejected(user(image_part("ftp://host/a.png")))
    assert "scheme 'ftp'" in scheme.message


async def test_oversized_images_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multimodal, "MAX_IMAGE_PIXELS", 100)
    too_many_pixels = await rejected(user(image_part(data_url(png_bytes(20, 20)))))
    assert "20x20 pixels" in too_many_pixels.message
    monkeypatch.setattr(multimodal, "MAX_IMAGE_BYTES", 64)
    too_large = await rejected(user(image_part(data_url(png_bytes()))))
    assert "larger than 64 bytes" in too_large.message


async def test_limit_per_prompt_names_the_first_image_over_it() -> None:
    url = data_url(png_bytes())
    options = MediaOptions.from_flags(None, None, {"image": 1})
    two = user(image_part(url), image_part(url))
    err = await rejected(two, options)
    assert err.param == "messages[0].content[2]" and "at most 1 image" in err.message
    assert len(await load_chat_images(two, MediaOptions())) == 2  # vLLM's default allows many


async def test_local_files_only_under_the_allowed_folder(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes(3, 5))
    (tmp_path / "secret.png").write_bytes(png_bytes())
    url = (allowed / "cat.png").as_uri()
    off = await rejected(user(image_part(url)))
    assert "--allowed-local-media-path" in off.message
    options = MediaOptions.from_flags(str(allowed), None, None)
    (image,) = await load_chat_images(user(image_part(url)), options)
    assert image.image.size == (3, 5)
    escape = await rejected(user(image_part(f"file://{allowed}/../secret.png")), options)
    assert "outside --allowed-local-media-path" in escape.message
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    link = await rejected(user(image_part((allowed / "link.png").as_uri())), options)
    assert "outside" in link.message
    missing = await rejected(user(image_part((allowed / "nope.png").as_uri())), options)
    assert "no such file" in missing.message


async def test_http_urls_are_fetched_only_from_allowed_domains(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = await rejected(user(image_part("https://example.com/a.png")))
    assert "'example.com'" in refused.message and "--allowed-media-domains" in refused.message
    served = png_bytes(2, 2)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=served))
    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(transport=transport, **kw))
    options = MediaOptions.from_flags(None, ["Example.com"], None)
    (image,) = await load_chat_images(user(image_part("https://example.com/a.png")), options)
    assert image.image.size == (2, 2) and image.content_hash == hashlib.sha256(served).hexdigest()
    other = await rejected(user(image_part("https://elsewhere.org/a.png")), options)
    assert "'elsewhere.org'" in other.message


def test_media_flags_are_checked_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a directory"):
        MediaOptions.from_flags(str(tmp_path / "missing"), None, None)
    with pytest.raises(ConfigError, match="modality 'video'"):
        MediaOptions.from_flags(None, None, {"video": 1})
    with pytest.raises(ConfigError, match="non-negative integer"):
        MediaOptions.from_flags(None, None, {"image": -1})


def test_a_text_model_refuses_images_naming_the_first() -> None:
    class TextEngine:
        pass

    require_image_support(TextEngine(), [])  # no images: nothing to refuse
    image = multimodal.ImageInput(image=None, content_hash="h", where="messages[1].content[0]")
    with pytest.raises(APIError, match="text-only model") as info:
        require_image_support(TextEngine(), [image])
    assert info.value.param == "messages[1].content[0]"

    class DataParallel:  # its engines run in other processes: images are not sent there yet
        config = types.SimpleNamespace(data_parallel_size=2)

    with pytest.raises(APIError, match="--data-parallel-size"):
        require_image_support(DataParallel(), [image])


async def test_server_answers_image_parts_with_400s_and_keeps_serving(http: httpx.AsyncClient) -> None:
    def body(*parts: dict[str, Any]) -> dict[str, Any]:
        content = [{"type": "text", "text": "Describe"}, *parts]
        return {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}

    valid = await http.post("/v1/chat/completions", json=body(image_part(data_url(png_bytes()))))
    assert valid.status_code == 400
    error = valid.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "text-only" in error["message"]
    broken = await http.post("/v1/chat/completions", json=body(image_part(data_url(b"\x89PNG broken"))))
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages[0].content[1]"
    # /tokenize checks a chat's images as a chat request does
    counted = await http.post("/tokenize", json={"model": MODEL_NAME, "messages": body(
        image_part(data_url(png_bytes())))["messages"]})
    assert counted.status_code == 400 and counted.json()["error"]["param"] == "messages[0].content[1]"
    text = await http.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert text.status_code == 200 and text.json()["choices"][0]["message"]["content"]
