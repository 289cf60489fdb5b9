"""Grammar compilation with llguidance, an LRU cache keyed by the normalised spec, and a time limit.

Why llguidance (benchmarks/structured_bench.py, batch 32, 2 CPU threads): it makes a JSON-schema matcher in
~4 ms against xgrammar's 13-35 ms first compile, and fills a 32-row mask in 0.25-0.3 ms on both a 49k and a 152k
vocabulary, where xgrammar took 0.2 ms and 1.6 ms; it also rolls back and copies matchers, which verification of
drafts needs, and its wheel is small (xgrammar's pulls triton). A compiled grammar is kept as a template matcher;
each request gets a ``deep_copy`` of it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import llguidance

from nxdserve.engine.structured.spec import StructuredOutputsParams
from nxdserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_TIMEOUT_S = 10.0


class GrammarCompiler:
    """Thread-safe. ``compile`` may run in any thread; ``compile_async`` runs it in the compiler's own thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # the cache (held briefly: the event loop takes it)
        self._tokenizer_lock = threading.Lock()  # building the tokenizer (seconds: never on the event loop)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None
        self.num_compiled = 0  # cache misses, for tests and metrics

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~2 s for a 49k vocabulary): off the event loop, in whichever thread compiles."""
        with self._tokenizer_lock:
            if self._lltokenizer is None:
                import llguidance.hf

                self._lltokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            return self._lltokenizer

    def cached(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher | None:
        with self._lock:
            template = self._cache.get(spec.key())
            if template is not None:
                self._cache.move_to_end(spec.key())
            return template

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The spec's template matcher (from the cache, else compiled). Raises InvalidRequestError naming
        ``spec.param`` for a schema, regex or grammar that does not compile."""
        template = self.cached(spec)
        if template is not None:
            return template
        grammar = self._grammar(spec)
        tokenizer = self.lltokenizer
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequestError(f"Invalid {spec.kind} for structured outputs: {error.strip()}",
                                      param=spec.param)
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidRequestError(f"Invalid {spec.kind} for structured outputs: {template.get_error()}",
                                      param=spec.param)
        with self._lock:
            self.num_compiled += 1
            self._cache[spec.key()] = template
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template

    async def compile_async(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """``compile`` off the event loop, within ``timeout_s`` (past it: a 400 naming the parameter; the compile
        finishes in the background and lands in the cache)."""
        template = self.cached(spec)
        if template is not None:
            return template
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nxdserve-grammar")
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._executor, self.compile, spec), self.timeout_s)
        except TimeoutError as exc:
            raise InvalidRequestError(
                f"Compiling the {spec.kind} constraint took longer than {self.timeout_s:g} s.", param=spec.param
            ) from exc

    def new_matcher(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one request."""
        return self.compile(spec).deep_copy()

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of ``bad_words``: each word as is and, where that gives a different first token of
        the same length, with a leading space."""
        out: list[list[int]] = []
        for word in words:
            plain = list(self._hf_tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                continue
            out.append(plain)
            spaced = list(self._hf_tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        return out

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # -- spec -> llguidance grammar text ------------------------------------------------------------
    def _grammar(self, spec: StructuredOutputsParams) -> str:
        try:
            if spec.kind in ("json", "json_object"):
                defaults: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
                if spec.whitespace_pattern is not None:
                    defaults["whitespace_pattern"] = spec.whitespace_pattern
                if spec.disable_additional_properties:
                    defaults["additionalProperties"] = False
                # llguidance's JsonCompileOptions stub omits keys its Rust side reads (additionalProperties).
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    spec.schema_text(), defaults=defaults  # type: ignore[arg-type]
                )
                return str(grammar)
            if spec.kind == "regex":
                return str(llguidance.grammar_from("regex", ascii_classes(str(spec.regex))))
            if spec.kind == "choice":
                return str(llguidance.grammar_from("choice", json.dumps(spec.choice)))
            if spec.kind == "grammar":
                return str(llguidance.grammar_from("grammar", str(spec.grammar)))
            return _structural_tag_grammar(spec.structural_tag)
        except InvalidRequestError:
            raise
        except Exception as exc:  # llguidance raises ValueError / RuntimeError with the reason
            raise InvalidRequestError(f"Invalid {spec.kind} for structured outputs: {exc}", param=spec.param) from exc


# The classes as ECMAScript (and JSON Schema's ``pattern``, and xgrammar, vLLM's default backend) read them;
# llguidance's regex reads them as Unicode classes, so ``\d`` would allow digits such as U+0663. A class also
# works nested inside a bracket expression (``[a\d]`` -> ``[a[0-9]]``).
_ASCII_CLASSES = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}


def ascii_classes(regex: str) -> str:
    r"""``regex`` with ``\d``, ``\D``, ``\w`` and ``\W`` as their ASCII classes (escaped backslashes kept)."""
    out: list[str] = []
    i = 0
    while i < len(regex):
        if regex[i] == "\\" and i + 1 < len(regex):
            pair = regex[i: i + 2]
            out.append(_ASCII_CLASSES.get(pair[1], pair))
            i += 2
        else:
            out.append(regex[i])
            i += 1
    return "".join(out)


def _structural_tag_grammar(raw: str | dict[str, Any] | None) -> str:
    """vLLM's structural_tag ({"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers"}):
    free text in which each ``begin`` ... ``end`` holds JSON matching its schema."""
    tag = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
    structures = tag.get("structures")
    triggers = tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError("structural_tag needs non-empty 'structures' and 'triggers' lists")
    tags = []
    for s in structures:
        begin = s["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger is a prefix of begin {begin!r}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=s.get("schema") or {"type": "object"},
                                         end=s["end"]))
    # Triggers are text here (e.g. "<function="), not special tokens of the vocabulary.
    return str(llguidance.StructTag.to_grammar(tags, assume_special=False))
