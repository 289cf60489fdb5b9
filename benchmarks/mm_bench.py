"""Image requests benchmark: 8 concurrent chat-style requests with one 448x448 image each against the same prompts
without their images, same run, on the engine core (torch backend).

    python benchmarks/mm_bench.py                         # the default small random Qwen2-VL, bf16 on CPU
    python benchmarks/mm_bench.py --vision-depth 32 --vision-dim 1280 --out mm_bench.json   # Qwen2-VL-2B's tower
    python benchmarks/mm_bench.py --family mllama --dtype float32   # a random Mllama (4 self + 1 cross layer)

With --family mllama the model is a random Llama 3.2 Vision of the same widths: 224-pixel tiles (up to 4), so a
448x448 image is 2x2 tiles of 257 vision tokens that the cross-attention layer reads; the prompt keeps one
<|image|> token.

The model is a random Qwen2-VL built here from a transformers config (nothing is downloaded): by default a
decoder of hidden 256 x 4 layers and a vision tower of embed_dim 256 x 4 blocks (Qwen2-VL-2B's is 1280 x 32:
--vision-dim/--vision-depth), patch 14, 2x2 merge. The image processor keeps 448x448 as it is: 1024 patches,
256 image tokens per request. Reported per workload (medians over --repeats, interleaved): TTFT (mean over the 8
requests, all submitted at once), output tok/s (generated tokens over the run's wall time), and for the image
workload the processor's time per image (before submission, off the engine thread in serving) and the vision
encoder's share of the steps that admitted images and of the whole run. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from nxdserve.config import EngineConfig
from nxdserve.engine.core import EngineCore
from nxdserve.engine.loader import build_engine_core
from nxdserve.engine.mm_inputs import ImagePromptProcessor
from nxdserve.sampling_params import OutputKind, SamplingParams
from tests.helpers.tiny_vlm import build_tiny_mllama, build_tiny_qwen2_vl, random_image

NUM_REQUESTS = 8
IMAGE_SIDE = 448
PAD = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTIONS = [
    "What is in this picture?",
    "Describe the colours you see.",
    "Is there any text in the image?",
    "Count the objects in the scene.",
]


def build_model(folder: Path, args: argparse.Namespace) -> Path:
    if args.family == "mllama":  # 224-pixel tiles, up to 4: a 448x448 image is 2x2 tiles of 16x16 patches
        return build_tiny_mllama(
            folder,
            text={"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 5, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "max_position_embeddings": 1024, "cross_attention_layers": [2]},
            vision={"hidden_size": args.vision_dim, "num_hidden_layers": args.vision_depth, "num_global_layers": 1,
                    "attention_heads": max(1, args.vision_dim // 64), "intermediate_size": 4 * args.vision_dim},
            tile=224, max_tiles=4,
        )  # fmt: skip
    heads = 16 if args.vision_dim == 1280 else max(1, args.vision_dim // 64)  # Qwen2-VL-2B: 16 heads of 80
    return build_tiny_qwen2_vl(
        folder,
        text={"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 1024,
              "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}},  # head_dim 64, as Qwen2-VL splits 128
        vision={"depth": args.vision_depth, "embed_dim": args.vision_dim, "num_heads": heads},
        max_pixels=IMAGE_SIDE * IMAGE_SIDE,
    )  # fmt: skip


def prompts(
    core: EngineCore, processor: ImagePromptProcessor, with_images: bool, pad: str = PAD
) -> tuple[list[Any], float]:
    """(prompt token ids and image inputs per request, processor seconds per image)."""
    out, spent = [], 0.0
    for i in range(NUM_REQUESTS):
        question = QUESTIONS[i % len(QUESTIONS)]
        text = f"<|im_start|>user{pad if with_images else ''}{question}<|im_end|><|im_start|>assistant"
        ids = list(core.tokenizer.encode(text))
        if not with_images:
            out.append((ids, None))
            continue
        started = time.perf_counter()
        ids, mm = processor.process(ids, [random_image(IMAGE_SIDE, IMAGE_SIDE, seed=i)])
        spent += time.perf_counter() - started
        out.append((ids, mm))
    return out, spent / NUM_REQUESTS if with_images else 0.0


def run_once(core: EngineCore, batch: list[Any], max_tokens: int) -> dict[str, float]:
    backend: Any = core.backend
    submitted = time.perf_counter()
    first: dict[str, float] = {}
    for ids, mm in batch:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        params.output_kind = OutputKind.DELTA
        request = core.make_request(ids, params)
        request.mm_inputs = mm
        core.add_request(request)
    generated = 0
    encode_steps: list[float] = []
    encode_total = 0.0
    while core.has_unfinished:
        encoded_before, step_started = backend.image_encode_s, time.perf_counter()
        outputs = core.step()
        now = time.perf_counter()
        encoded = backend.image_encode_s - encoded_before
        if encoded:
            encode_steps.append(encoded / (now - step_started))
            encode_total += encoded
        for out in outputs:
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            generated += n
            if n and out.request_id not in first:
                first[out.request_id] = now - submitted
    wall = time.perf_counter() - submitted
    return {
        "ttft_s": statistics.mean(first.values()),
        "output_tok_s": generated / wall,
        "encoder_share_of_admitting_steps": statistics.mean(encode_steps) if encode_steps else 0.0,
        "encoder_share_of_run": encode_total / wall,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vision-depth", type=int, default=4)
    parser.add_argument("--vision-dim", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--family", choices=("qwen2_vl", "mllama"), default="qwen2_vl")
    parser.add_argument("--out", default="mm_bench.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / args.family, args)
        config = EngineConfig(model=str(path), backend="torch", dtype=args.dtype, max_model_len=512,
                              max_num_seqs=NUM_REQUESTS)  # fmt: skip
        core, files = build_engine_core(config, with_metrics=False)
        processor = ImagePromptProcessor(path, int(files.hf_config.image_token_id))
        pad = "<|image|>" if args.family == "mllama" else PAD
        workloads = {"text": prompts(core, processor, False, pad), "image": prompts(core, processor, True, pad)}
        run_once(core, workloads["image"][0], 2)  # warm-up: the encoder's first GEMMs of each shape
        results: dict[str, list[dict[str, float]]] = {name: [] for name in workloads}
        for _ in range(args.repeats):
            for name, (batch, _) in workloads.items():  # interleaved: background load hits both alike
                results[name].append(run_once(core, batch, args.max_tokens))
    summary: dict[str, Any] = {
        "model": {"family": args.family, "vision": f"embed_dim {args.vision_dim} x {args.vision_depth}",
                  "decoder": "hidden 256 x 4 layers" + (" + 1 cross-attention" if args.family == "mllama" else ""),
                  "dtype": args.dtype, "image": f"{IMAGE_SIDE}x{IMAGE_SIDE}",
                  # Qwen2-VL: image tokens in the prompt; Mllama: vision tokens its cross-attention reads
                  "image_tokens": 4 * 257 if args.family == "mllama" else 256},
        "requests": NUM_REQUESTS, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "processor_s_per_image": workloads["image"][1],
    }  # fmt: skip
    for name, runs in results.items():
        summary[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    text, image = summary["text"], summary["image"]
    summary["ratios_image_over_text"] = {
        "ttft": image["ttft_s"] / text["ttft_s"],
        "output_tok_s": image["output_tok_s"] / text["output_tok_s"],
    }
    print(f"{'workload':<8} {'TTFT ms':>9} {'out tok/s':>10} {'enc share (admit steps)':>24} {'enc share (run)':>16}")
    for name in ("text", "image"):
        r = summary[name]
        print(f"{name:<8} {1000 * r['ttft_s']:>9.1f} {r['output_tok_s']:>10.1f} "
              f"{r['encoder_share_of_admitting_steps']:>24.2f} {r['encoder_share_of_run']:>16.2f}")  # fmt: skip
    ratios = summary["ratios_image_over_text"]
    print(f"image/text: TTFT x{ratios['ttft']:.2f}, output tok/s x{ratios['output_tok_s']:.2f}; "
          f"processor {1000 * summary['processor_s_per_image']:.1f} ms per image")  # fmt: skip
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
