"""--data-parallel-size 2 on the nxd backend (the emulator in each engine process): the front end refuses what
on-device sampling cannot do before a stream opens, and reports the prefill-first scheduling the engines run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nxdserve.config import EngineConfig
from nxdserve.engine.dp import create_engine
from nxdserve.errors import InvalidRequestError
from nxdserve.sampling_params import SamplingParams
from tests.helpers.tiny_model import tiny_model_path
from tests.nxd.conftest import EMULATOR_ROOT

pytestmark = pytest.mark.anyio
REPO = Path(__file__).resolve().parents[2]


async def test_front_end_checks_and_scheduling_match_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine processes start fresh: the emulator reaches them by PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EMULATOR_ROOT), str(REPO)]))
    config = EngineConfig(model=str(tiny_model_path("llama")), backend="nxd", dtype="float32", max_model_len=256,
                          max_num_seqs=2, data_parallel_size=2)
    assert config.enable_chunked_prefill  # asked for; the nxd engines fall back to prefill-first
    engine = create_engine(config)
    await engine.start()
    try:
        assert engine.config.scheduling_mode == "prefill-first"
        assert engine.config.max_num_batched_tokens is not None and engine.config.max_num_batched_tokens >= 256
        for params, param in [(SamplingParams(logprobs=1), "logprobs"), (SamplingParams(prompt_logprobs=1),
                              "prompt_logprobs"), (SamplingParams(min_p=0.1), "min_p")]:
            with pytest.raises(InvalidRequestError) as info:  # raised by add_request: no stream exists
                engine.add_request([5, 6, 7], params)
            assert info.value.param == param
        outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    finally:
        await engine.shutdown(drain_timeout=0)
