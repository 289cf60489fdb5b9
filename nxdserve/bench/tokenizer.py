"""Tokenizers for the benchmark: a local Hugging Face one, or the server's own via /tokenize + /detokenize.

Datasets are built token-exact, so the benchmark needs the same tokenizer the server uses. A local one is
fast; the server's is always right. ``resolve_tokenizer`` picks a local candidate when one can be found and,
when the server can tokenize, checks the candidate against it before trusting it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

import httpx

logger = logging.getLogger(__name__)

# Text used to check that a local tokenizer agrees with the server's: words, digits, punctuation, unicode.
_PROBE_TEXT = "The quick brown fox, 1234 jumps over the lazy dog! Ünïcödé — naïve café. def f(x): return x**2"


class BenchTokenizer(Protocol):
    """The few operations the benchmark needs from a tokenizer."""

    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_ids(self) -> frozenset[int]: ...

    def num_special_tokens_to_add(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """A transformers tokenizer loaded from a local directory, tokenizer.json or GGUF file."""

    def __init__(self, tok: Any, name: str) -> None:
        self._tok = tok
        self.name = name
        self._special = frozenset(int(i) for i in tok.all_special_ids)

    @classmethod
    def from_path(cls, path: str) -> HFTokenizer:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if os.path.isfile(path) and path.endswith(".gguf"):
            # transformers rebuilds the tokenizer from the GGUF metadata; no network needed.
            tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
        elif os.path.isfile(path) and path.endswith(".json"):
            tok = PreTrainedTokenizerFast(tokenizer_file=path)
        else:
            # Directory or hub id; local_files_only keeps a missing model from turning into a download attempt.
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(tok, path)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.vocab_size)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special

    def num_special_tokens_to_add(self) -> int:
        return len(self._tok.encode("", add_special_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))


class ServerTokenizer:
    """The server's tokenizer through vLLM's /tokenize and /detokenize endpoints (synchronous HTTP).

    Slower than a local tokenizer (one round trip per call) but exact for whatever model is served.
    """

    def __init__(self, base_url: str, model: str | None, headers: dict[str, str] | None = None) -> None:
        self.name = f"server:{base_url}"
        self._model = model
        self._client = httpx.Client(base_url=base_url, headers=headers or {}, timeout=60.0)
        self._vocab_size: int | None = None
        self._special: frozenset[int] | None = None
        self._num_special: int | None = None

    def close(self) -> None:
        self._client.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._model is not None:
            body = {"model": self._model, **body}
        resp = self._client.post(path, json=body)
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return data

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        data = self._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})
        return [int(t) for t in data["tokens"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._post("/detokenize", {"tokens": [int(i) for i in ids]})["prompt"])

    def num_special_tokens_to_add(self) -> int:
        if self._num_special is None:
            self._num_special = len(self.encode("", add_special_tokens=True))
        return self._num_special

    @property
    def special_ids(self) -> frozenset[int]:
        # The API does not list special tokens; the ones the server adds on its own are the ones that matter
        # (a stray BOS mid-prompt would change the prompt's meaning, not its length).
        if self._special is None:
            self._special = frozenset(self.encode("", add_special_tokens=True))
        return self._special

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            self._vocab_size = self._find_vocab_size()
        return self._vocab_size

    def _find_vocab_size(self) -> int:
        info = self._client.get("/tokenizer_info")
        if info.status_code == 200:
            size = info.json().get("vocab_size")
            if isinstance(size, int) and size > 0:
                return size
        # /detokenize rejects out-of-vocabulary ids with a 4xx, so the vocab size is the first id it rejects.
        lo, hi = 1, 1
        while self._detokenizes(hi) and hi < 1 << 24:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._detokenizes(mid):
                lo = mid
            else:
                hi = mid
        return hi

    def _detokenizes(self, token_id: int) -> bool:
        body: dict[str, Any] = {"tokens": [token_id]}
        if self._model is not None:
            body["model"] = self._model
        return self._client.post("/detokenize", json=body).status_code == 200


def server_can_tokenize(base_url: str, model: str | None, headers: dict[str, str] | None = None) -> bool:
    try:
        tok = ServerTokenizer(base_url, model, headers)
        try:
            tok.encode("hello")
        finally:
            tok.close()
    except (httpx.HTTPError, KeyError, ValueError):
        return False
    return True


def agrees_with_server(local: BenchTokenizer, server: BenchTokenizer) -> bool:
    ids = local.encode(_PROBE_TEXT)
    return ids == server.encode(_PROBE_TEXT) and local.decode(ids) == server.decode(ids)


def default_nxdserve_tokenizer_path() -> str | None:
    """The folder of nxdserve's embedded default model, when its model-resolution module is importable."""
    try:
        from nxdserve.model_files import resolve_model  # imported lazily: optional for a bare load generator
    except ImportError:
        return None
    try:
        # Cheap once the server has prepared the model; the first call converts the packaged GGUF.
        path = resolve_model(None, progress=False)
    except Exception as exc:  # a resolution failure only costs us the local fast path
        logger.debug("nxdserve default model not resolvable: %s", exc)
        return None
    return os.fspath(path) if os.path.exists(path) else None


def resolve_tokenizer(
    explicit: str | None,
    base_url: str,
    model: str | None,
    model_root: str | None,
    headers: dict[str, str] | None = None,
) -> BenchTokenizer:
    """Pick the tokenizer: ``explicit`` path (or "server"), else a verified local candidate, else the server's.

    Candidates, in order: the served model's ``root`` or id when it is a local path (vLLM and nxdserve report
    the model path as root, llama.cpp as id), then nxdserve's default model.
    """
    if explicit == "server":
        return ServerTokenizer(base_url, model, headers)
    if explicit:
        return HFTokenizer.from_path(explicit)
    server_ok = server_can_tokenize(base_url, model, headers)
    local_paths = [p for p in (model_root, model) if p and os.path.exists(p)]
    for path in [*local_paths, None]:
        if path is None:  # the last resort, resolved only when needed: it may convert a model
            path = default_nxdserve_tokenizer_path()
            if path is None:
                break
        try:
            local = HFTokenizer.from_path(path)
        except Exception as exc:  # wrong kind of file, missing tokenizer files: try the next one
            logger.debug("cannot load tokenizer from %s: %s", path, exc)
            continue
        if not server_ok:
            logger.warning("using local tokenizer %s unchecked: the server has no /tokenize to compare with", path)
            return local
        server = ServerTokenizer(base_url, model, headers)
        try:
            if agrees_with_server(local, server):
                return local
        finally:
            server.close()
        logger.warning("local tokenizer %s disagrees with the server's; not using it", path)
    if server_ok:
        return ServerTokenizer(base_url, model, headers)
    raise RuntimeError(
        "No tokenizer available: pass --tokenizer PATH (a model directory, tokenizer.json or .gguf file), "
        "or benchmark a server that implements /tokenize and /detokenize."
    )
