"""The lossless and max-length matrix on the default model (SmolLM2-135M, fp32): slow, run with
``pytest -m slow``. The fast suite covers the same mechanics on tiny models (test_speculative.py)."""

from __future__ import annotations

from typing import Any

import pytest

from nxdserve.engine.core import EngineCore
from tests.engine.test_speculative import MODES, K, greedy, method_config, token_ids
from tests.helpers.engine import PROMPTS, make_core, run_to_completion, tokenize

pytestmark = pytest.mark.slow
MAX_LEN = 96
_cores: dict[tuple[str | None, str], EngineCore] = {}


def core_for(method: str | None, mode: str) -> EngineCore:
    if (method, mode) not in _cores:
        spec: Any = None if method is None else method_config(method, None)
        _cores[(method, mode)] = make_core(max_model_len=MAX_LEN, speculative_config=spec, **MODES[mode])
    return _cores[(method, mode)]


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle-random", "self-draft"])
def test_default_model_lossless_and_bounded(method: str) -> None:
    for mode in MODES:
        plain, spec = core_for(None, mode), core_for(method, mode)
        prompts = tokenize(plain, PROMPTS) + tokenize(plain, ["1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"])
        expected = token_ids(run_to_completion(plain, prompts, greedy(24)))
        assert token_ids(run_to_completion(spec, prompts, greedy(24))) == expected, mode
        for i in (0, 16):
            assert token_ids(run_to_completion(spec, [prompts[i]], greedy(24))) == [expected[i]], (mode, i)
        base = [t for p in prompts for t in p]
        late = [base[n : 2 * n] for n in range(MAX_LEN - 2 * K - 2, MAX_LEN)]
        want = token_ids(run_to_completion(plain, late, greedy(None)))
        outs = run_to_completion(spec, late, greedy(None))
        assert token_ids(outs) == want, mode
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert all(len(p) + len(o.outputs[0].token_ids) == MAX_LEN for p, o in zip(late, outs, strict=True))
    _cores.pop((method, "chunked"), None)
    _cores.pop((method, "prefill-first"), None)
