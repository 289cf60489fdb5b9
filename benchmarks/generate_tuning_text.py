"""Write the self-generated tuning text (``nxdserve/engine/models/data/calibration_generated.txt``, qtune.py).

The dense fp32 default model answers ``--prompts`` prompts of the shipped EAGLE prompt set (shuffled with
``--seed``) at temperature 0.8, top-p 0.95, up to ``--max-tokens`` tokens each, request i seeded with
seed * 1000 + i; each prompt and its answer become one paragraph pair of the text (LLM-QAT's data-free idea:
text the model itself finds likely). The defaults write the shipped file, byte for byte (checked on the 2-core
Xeon with AMX).

    PYTHONPATH=$PWD python benchmarks/generate_tuning_text.py [--prompts 32] [--max-tokens 256] [--seed 1] > out.txt
"""

from __future__ import annotations

import argparse
import random
import sys

from nxdserve.config import EngineConfig
from nxdserve.engine.loader import build_engine_core
from nxdserve.sampling_params import OutputKind, SamplingParams
from nxdserve.speculative.corpus import chat_prompt_ids, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    prompts = load_prompts()
    random.Random(args.seed).shuffle(prompts)
    prompts = prompts[: args.prompts]
    config = EngineConfig(model=None, backend="torch", dtype="float32", max_model_len=1024, max_num_seqs=16)
    core, _ = build_engine_core(config, with_metrics=False)
    tokenizer = core.tokenizer
    index_of: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seed=args.seed * 1000 + i)
        params.output_kind = OutputKind.FINAL_ONLY
        request = core.make_request(chat_prompt_ids(tokenizer, prompt), params)
        core.add_request(request)
        index_of[request.request_id] = i
    answers = [""] * len(prompts)
    while core.has_unfinished:
        for out in core.step():
            if out.finished:
                i = index_of.pop(out.request_id)
                answer = tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True).strip()
                answers[i] = prompts[i].strip() + "\n\n" + answer
    sys.stdout.write("\n\n".join(answers) + "\n")


if __name__ == "__main__":
    main()
