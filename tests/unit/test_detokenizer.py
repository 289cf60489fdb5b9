"""Incremental detokenization: held-back text reaches the final output."""

from __future__ import annotations

from pathlib import Path

import pytest

from nxdserve.engine.detokenizer import IncrementalDetokenizer
from tests.helpers.tiny_model import copy_default_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    folder: Path = tmp_path_factory.mktemp("tok")
    copy_default_tokenizer(folder)
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_tokens_that_are_the_replacement_character_are_not_lost(tokenizer) -> None:  # type: ignore[no-untyped-def]
    replacement = tokenizer.encode("\ufffd", add_special_tokens=False).ids
    prompt = tokenizer.encode("Hello there", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    detok.add(replacement * 5)
    assert detok.text == ""  # the stream cannot tell them from a character split over tokens
    assert detok.flush() == 5 and detok.text == "\ufffd" * 5
    assert detok.flush() == 0  # idempotent


def test_flush_adds_nothing_to_complete_text_and_keeps_multibyte_characters(tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer.encode("Say:", add_special_tokens=False).ids
    text = " caf\u00e9 \U0001f600 ok"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    for token_id in ids:  # one token at a time, as decoding produces them
        detok.add([token_id])
    assert detok.text == text
    assert detok.flush() == 0 and detok.text == text
