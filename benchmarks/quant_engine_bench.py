"""Engine decode speed per weight format (issue 29): the default model through the torch backend, single
stream and N concurrent, for dense fp32 / bf16 and each ``--quantization``, in the same run. Prints a table
(tok/s, the ratio to the first configuration, and the share of the memory-bandwidth limit: the bytes of weights
one decode step reads over ``--bandwidth-gbs``) and writes JSON.

    PYTHONPATH=$PWD python benchmarks/quant_engine_bench.py [--batches 1 32] [--tokens 48] [--cpu-isa auto]
        [--configs float32 float32/gguf ...] [--cpu-quant-dense-rows N]

Configs are ``dtype`` or ``dtype/quantization``, optionally suffixed ``+i8`` (``CpuOptions.quant_int8_activations``:
the small-row kernels round the activations to int8, csrc/qgemm_i8.c) or ``+bf16w`` (a dense fp32 model's linears
then kept in bf16, ``quant.store_bf16``: what ``--dtype auto`` serves of a dense checkpoint on a CPU without native
bf16; ``float32+bf16w``) and then ``~unfused``
(``--no-cpu-fused-quant-decode``: quantized steps layer by layer); ``--rounds N`` runs the list N times (interleaved
A/B: ``--configs auto auto+i8 auto~unfused --rounds 3``). It runs on any tree whose EngineConfig has ``quantization``
(main's too: run it from /work/main with main's PYTHONPATH for a before/after in the same session).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from nxdserve.cpu_options import CpuOptions, set_openmp_wait_policy

set_openmp_wait_policy()  # before torch loads OpenMP, which reads it once

# isort: split
import torch  # noqa: E402 - after the wait policy

from benchmarks.engine_bench import bench_engine_decode  # noqa: E402 - after the wait policy
from nxdserve import EngineConfig  # noqa: E402 - after the wait policy
from nxdserve.engine.loader import build_engine_core  # noqa: E402 - after the wait policy

# "auto" is the default configuration: no --dtype, no --quantization (the default model's own 4-bit blocks,
# except where the fused AVX512-BF16 / AMX decoder keeps dense bf16: engine/backends/weight_format.py).
CONFIGS = ["float32", "auto", "bfloat16", "float32/gguf", "float32/int8", "float32/int4", "float32/fp8"]


def weight_bytes(model: object, rows: int) -> int:
    """Bytes of the linears (and LM head) one step of ``rows`` rows reads: the codes where the quantized kernel
    serves that many rows, a dense copy's bytes where it does not."""
    from nxdserve.engine.models import quant

    limit = getattr(quant, "dense_rows", None)  # None: a tree without the row switch (main before it)
    # A bf16 model's bound as warm-up measured it (quant_steps.py; absent on trees before it)
    measured = getattr(getattr(model, "fused_decode", None), "quantized_dense_above", None)
    if limit and measured is not None:
        limit = measured
    dense_bytes = 2 if getattr(model, "dtype", None) == torch.bfloat16 else 4  # the dense copies' dtype

    kernel_rows = getattr(quant, "KERNEL_ROWS", None)  # None: a tree that kept dense copies of fp32 calls too
    build_rows = getattr(quant, "kernel_rows", None)  # the build's paired-rows limit (trees since session 22)
    paired = getattr(quant, "_paired_rows", None)  # trees before it
    if build_rows is not None:
        kernel_rows = build_rows() or limit  # 0: portable C, widened above dense_rows
    elif kernel_rows is not None and paired is not None and not paired():
        kernel_rows = limit

    def size(w: object) -> int:
        if isinstance(w, quant.QuantLinear):
            widened = dense_bytes == 4 or getattr(w, "kind", "") == "bf16"
            if kernel_rows is not None and widened and (not limit or rows <= kernel_rows):
                return w.nbytes  # the kernel (paired rows above a few): the codes
            if limit is not None and rows > limit and getattr(quant, "dense_rows", None):
                return w.out_features * w.in_features * (4 if widened else dense_bytes)  # a dense or widened copy
            return w.nbytes
        assert isinstance(w, torch.Tensor)
        return w.numel() * w.element_size()

    total = 0
    for layer in model.layers:  # type: ignore[attr-defined]
        total += sum(size(getattr(layer, attr)) for attr in model.QUANTIZABLE)  # type: ignore[attr-defined]
    head = getattr(model, "lm_head_quant", None) or model.lm_head_weight  # type: ignore[attr-defined]
    return total + size(head)


def resident_bytes(model: object) -> int:
    """Bytes the model's weights hold after the run: each distinct storage reachable from its tensors and its
    quantized linears (their codes, scales, kernel layouts and any dense copies kept on them), counted once."""
    from nxdserve.engine.models import quant

    seen: dict[int, int] = {}

    def visit(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen[storage.data_ptr()] = storage.nbytes()
                visit(vars(obj))  # copies kept on the tensor (gemm.kept: packed / compressed layouts)
        elif isinstance(obj, quant.QuantLinear):
            for value in vars(obj).values():
                visit(value)
        elif isinstance(obj, dict | list | tuple):
            for value in obj.values() if isinstance(obj, dict) else obj:
                visit(value)
        elif hasattr(obj, "tensors"):  # cpu_weight_kernels.QgemmWeight: the layout its struct points into
            visit(obj.tensors)

    for module in model.modules():  # type: ignore[attr-defined]
        visit(vars(module))  # its parameters and buffers dicts, and the linears set on it as attributes
    return sum(seen.values())


def bench_prefill(core: object, tokens: int, rounds: int = 3) -> float:
    """The fastest of ``rounds`` prefills of a ``tokens``-token prompt (one request, one output token), in ms."""
    import time

    from nxdserve.sampling_params import OutputKind, SamplingParams

    prompt = [(17 * i) % 1000 + 100 for i in range(tokens)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, output_kind=OutputKind.FINAL_ONLY)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        core.add_request(core.make_request(prompt, params))  # type: ignore[attr-defined]
        while core.has_unfinished:  # type: ignore[attr-defined]
            core.step()  # type: ignore[attr-defined]
        best = min(best, time.perf_counter() - t0)
    return 1000 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--model", default=None, help="a model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--cpu-isa", default="auto", help="force a kernel path (avx2, generic, none, ...)")
    ap.add_argument("--cpu-quant-dense-rows", type=int, default=None, help="CpuOptions.quant_dense_rows")
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--bandwidth-gbs", type=float, default=24.0, help="the machine's measured memory bandwidth")
    ap.add_argument("--label", default="", help="a name for this tree in the table (before / after)")
    ap.add_argument("--rounds", type=int, default=1, help="run the config list this many times, in turn")
    ap.add_argument("--prefill-tokens", type=int, default=0, help="also time one prefill of this many tokens")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cpu_kw: dict[str, object] = {"isa": args.cpu_isa}
    if args.cpu_quant_dense_rows is not None and "quant_dense_rows" in {f.name for f in fields(CpuOptions)}:
        cpu_kw["quant_dense_rows"] = args.cpu_quant_dense_rows
    rows: list[dict[str, object]] = []
    for spec in [c for _ in range(args.rounds) for c in args.configs]:
        base_spec, _, variant = spec.partition("~")
        base_spec, int8_activations = base_spec.removesuffix("+i8"), base_spec.endswith("+i8")
        base_spec, bf16_weights = base_spec.removesuffix("+bf16w"), base_spec.endswith("+bf16w")
        dtype, _, method = base_spec.partition("/")
        options: dict[str, object] = dict(cpu_kw)
        if variant == "unfused":
            options["fused_quant_decode"] = False
        if int8_activations:
            options["quant_int8_activations"] = True
        config = EngineConfig(model=args.model, backend="torch", device="cpu", dtype=dtype, quantization=method or None,
                              max_model_len=max(256, args.prefill_tokens + 8), max_num_seqs=max(args.batches),
                              cpu=CpuOptions(**options))  # type: ignore[arg-type]
        core, _ = build_engine_core(config, with_metrics=False)
        model = core.backend.model  # type: ignore[attr-defined]
        if bf16_weights:
            from nxdserve.engine.models.quant import store_bf16

            model.quantize_linears(lambda _name, weight: store_bf16(weight))
        prefill = bench_prefill(core, args.prefill_tokens) if args.prefill_tokens else None
        for batch in args.batches:
            result = bench_engine_decode(core, batch, args.tokens)
            nbytes = weight_bytes(model, batch)
            share = nbytes / (args.bandwidth_gbs * 1e9) / (result["step_ms"] / 1e3)
            rows.append({"config": spec, "served": config.quantization or "dense", "batch": batch,
                         "weight_mb": nbytes / 1e6, "bw_share": share, "prefill_ms": prefill, **result})
        for r in rows[-len(args.batches):]:
            r["resident_mb"] = resident_bytes(model) / 1e6
        del core, model
    print(f"{args.label} --cpu-isa {args.cpu_isa}; decode tok/s (ratio to the first config at the same batch); "
          f"bandwidth share = weight bytes per step / {args.bandwidth_gbs:g} GB/s / step time")
    for batch in args.batches:
        base = next(float(r["tok_s"]) for r in rows if r["batch"] == batch)  # type: ignore[arg-type]
        for r in rows:
            if r["batch"] == batch:
                tok_s = float(r["tok_s"])  # type: ignore[arg-type]
                auto = str(r["config"]).startswith("auto")
                label = f"{r['config']} -> {r['served']}" if auto else str(r["config"])
                print(f"batch {batch:>3}  {label:<16} {tok_s:8.1f} tok/s  {tok_s / base:5.2f}x  "
                      f"step {float(r['step_ms']):6.1f} ms  weights {float(r['weight_mb']):6.1f} MB  "  # type: ignore[arg-type]
                      f"bw {100 * float(r['bw_share']):5.1f}%  resident {float(r['resident_mb']):6.1f} MB"  # type: ignore[arg-type]
                      + ("" if r["prefill_ms"] is None else f"  prefill {float(r['prefill_ms']):6.1f} ms"))  # type: ignore[arg-type]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
