"""benchmarks/quant_peers.py: the bytes each format reads per decode step, what a server log says it loaded,
and the bandwidth share; benchmarks/bandwidth.py's probe."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from nxdserve.engine.models.quant import quantize_int4, quantize_int8

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


qp = _load("quant_peers")
bw = _load("bandwidth")

TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


def test_shape_lists_every_decoder_linear() -> None:
    shape = qp.ModelShape.from_config(TINY)
    assert shape.head_dim == 16
    lin = shape.linears()
    assert len(lin) == 14
    # q, k, v, o, gate, up, down
    assert lin[:7] == [(64, 64), (32, 64), (32, 64), (64, 64), (96, 64), (96, 64), (64, 96)]


def test_dense_bytes_are_params_times_dtype_size() -> None:
    shape = qp.ModelShape.from_config(TINY)
    params = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 96 * 64) + 100 * 64 + (2 * 2 + 1) * 64
    assert qp.nxdserve_weight_bytes(shape, "float32", None) == 4 * params
    assert qp.nxdserve_weight_bytes(shape, "bfloat16", None) == 2 * params
    # fp8 codes are read by the kernel at one row; a 32-row step reads the dense copy
    assert qp.nxdserve_weight_bytes(shape, "float32", "fp8") < 2 * params
    assert qp.nxdserve_weight_bytes(shape, "float32", "fp8", rows=32) == 4 * params
    assert qp.vllm_weight_bytes(shape, "bfloat16", None) == 2 * params


def test_int8_and_int4_bytes_match_what_the_kernel_reads() -> None:
    import torch

    w = torch.randn(48, 96)
    for kind, q in (("int8", quantize_int8(w)), ("int4", quantize_int4(w, 32)), ("int4", quantize_int4(w, 64))):
        layout = q._kernel_layout()
        assert layout is not None
        read = sum(t.numel() * t.element_size() for t in layout[:3] if t is not None)
        assert qp.linear_bytes(kind, 48, 96, 4) == read
        assert qp.linear_bytes(kind, 48, 96, 4, rows=32) == 48 * 96 * 4  # the dense copy


def test_quantized_formats_keep_the_head_dense_except_gguf_and_4_bit_fp32() -> None:
    shape = qp.ModelShape.from_config(TINY)
    head_fp32, head_q8_0 = 100 * 64 * 4, qp.linear_bytes("q8_0", 100, 64, 4)
    int4 = qp.nxdserve_weight_bytes(shape, "float32", "int4")
    linears = sum(qp.linear_bytes("int4", n, k, 4) for n, k in shape.linears())
    assert int4 == linears + head_q8_0 + 5 * 64 * 4  # an fp32 model's 4-bit head is Q8_0 (quant.lm_head_format)
    rtn = qp.nxdserve_weight_bytes(shape, "float32", "rtn")
    assert rtn == linears + head_fp32 + 5 * 64 * 4  # vLLM's rtn keeps it dense
    int4_bf16 = qp.nxdserve_weight_bytes(shape, "bfloat16", "int4")
    assert int4_bf16 == sum(qp.linear_bytes("int4", n, k, 2) for n, k in shape.linears()) + 100 * 64 * 2 + 5 * 64 * 2
    assert qp.nxdserve_weight_bytes(shape, "float32", "int8") == (
        sum(qp.linear_bytes("int8", n, k, 4) for n, k in shape.linears()) + head_fp32 + 5 * 64 * 4
    )
    gguf_int4_head = qp.nxdserve_weight_bytes(shape, "float32", "gguf", head_kind="int4")
    assert gguf_int4_head == linears + qp.linear_bytes("int4", 100, 64, 4) + 5 * 64 * 4
    assert qp.nxdserve_weight_bytes(shape, "float32", "gguf", head_kind="q8_0") == int4
    assert qp.nxdserve_weight_bytes(shape, "float32", "int4-g64") == int4  # scales are kept per 32 either way
    with pytest.raises(ValueError, match="awq"):
        qp.nxdserve_weight_bytes(shape, "float32", "awq")


def _write_gguf(path: Path, tied: bool) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((64, 64), dtype=np.float16))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((100, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_bytes_count_the_head_once(tmp_path: Path) -> None:
    tied, untied = tmp_path / "tied.gguf", tmp_path / "untied.gguf"
    _write_gguf(tied, tied=True)
    _write_gguf(untied, tied=False)
    assert qp.gguf_weight_bytes(tied) == 100 * 64 * 4 + 64 * 64 * 2  # token_embd is the head
    assert qp.gguf_weight_bytes(untied) == 100 * 64 * 2 + 64 * 64 * 2  # output is; embd rows are looked up


def test_logs_say_what_was_loaded_and_why_a_start_failed() -> None:
    log = (
        "INFO nxdserve.engine.backends.torch_backend: CPU kernels: avx2 (--cpu-isa auto)\n"
        "INFO nxdserve.engine.backends.torch_backend: torch backend: llama on cpu in bfloat16, 32 slots x 256\n"
        'INFO nxdserve.server: effective configuration: {"dtype": "bfloat16", "quantization": "int8"}\n'
    )
    assert qp.nxdserve_loaded(log) == {
        "dtype": "bfloat16", "quantization": "int8", "isa": "avx2", "dense_above": qp.QUANT_DENSE_ROWS
    }  # fmt: skip
    assert qp.nxdserve_loaded("") == {
        "dtype": None, "quantization": None, "isa": None, "dense_above": qp.QUANT_DENSE_ROWS
    }  # fmt: skip
    # the warm-up's choice of a bf16 model's small quantized steps (quant_steps.py) decides their bytes
    dense = "torch_backend: quantized steps of up to 16 rows: dense bf16 copies (codes vs dense: 1 rows 13 vs 8 ms)"
    assert qp.nxdserve_loaded(dense)["dense_above"] == 0
    assert qp.nxdserve_loaded("quantized steps of up to 16 rows: codes up to 4 rows, then dense")["dense_above"] == 4
    shape = qp.ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100)
    on_codes = qp.nxdserve_weight_bytes(shape, "bfloat16", "int8", rows=1)
    on_copies = qp.nxdserve_weight_bytes(shape, "bfloat16", "int8", rows=1, dense_above=0)
    assert on_copies == qp.nxdserve_weight_bytes(shape, "bfloat16", None) > on_codes
    applied = 'torch_backend: weights: --quantization gguf\neffective configuration: {"quantization": null}\n'
    assert qp.nxdserve_loaded(applied)["quantization"] == "gguf"
    vllm_log = (
        "WARNING failed to increase ulimit with error ... OSError: [Errno 24] Too many open files\n"
        "(Worker pid=1) ERROR RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s)\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert "static_scaled_fp8_quant" in qp.start_failure(vllm_log)
    assert qp.vllm_loaded("model_config=... dtype=torch.bfloat16, quantization=None,") == ("bfloat16", None)


def test_bandwidth_share_is_bytes_per_step_over_bandwidth() -> None:
    gbps, share = qp.step_share(500_000_000, 100.0, 10.0)  # 0.5 GB every 0.1 s = 5 GB/s of 10
    assert gbps == pytest.approx(5.0)
    assert share == pytest.approx(0.5)
    assert qp.step_share(500_000_000, None, 10.0) == (None, None)
    assert qp.step_share(None, 100.0, 10.0) == (None, None)


def test_configs_per_isa_and_filter(tmp_path: Path) -> None:
    args = argparse.Namespace(cpu_isa="auto,avx2", configs="all", gguf_dir=str(tmp_path))
    names = [c.name for c in qp.all_configs(args, tmp_path / "M.Q4_1.gguf")]
    assert "nx-int4@avx2" in names and "nx-int4@auto" in names and "vllm-bf16" in names and "llama-f32" in names
    args.configs = "nx-gguf@avx2,llama-q8_0"
    picked = qp.all_configs(args, tmp_path / "M.Q4_1.gguf")
    assert [c.name for c in picked] == ["nx-gguf@avx2", "llama-q8_0"]
    assert picked[0].flags[-2:] == ["--cpu-isa", "avx2"]
    assert picked[1].gguf == tmp_path / "M.q8_0.gguf"
    # a forced AVX2 row holds PyTorch's kernels, oneDNN and MKL to AVX2 too (an AVX2 machine's bf16 cost), in its env
    held = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert picked[0].env == held
    launch = argparse.Namespace(threads=2, max_model_len=512, gguf=None)
    assert qp.server_spec(picked[0], launch, "/m", ["b"]).env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    args.configs = "nx-gguf@auto"
    (auto,) = qp.all_configs(args, tmp_path / "M.Q4_1.gguf")
    assert auto.env == {} and "ONEDNN_MAX_CPU_ISA" not in qp.server_spec(auto, launch, "/m", ["b"]).env
    args.configs = "nx-int3"
    with pytest.raises(SystemExit, match="nx-int3"):
        qp.all_configs(args, tmp_path / "M.Q4_1.gguf")


def test_bandwidth_probe_measures_positive_rates() -> None:
    row = bw.measure(1, mib=8, repeats=1)
    assert row.threads == 1 and row.read_gbps > 0 and row.copy_gbps > 0 and row.gemv_gbps > 0
    assert row.best_read_gbps == max(row.read_gbps, row.gemv_gbps)
    assert "read GB/s" in bw.format_table([row])


def test_targets_and_failed_requests_show_in_the_report() -> None:
    results = {
        "b": {"nx-default": {"output_throughput": 30.0, "failed": 0}, "vllm-bf16": {"output_throughput": 10.0}},
        "a": {"nx-int8": {"output_throughput": 50.0}, "nx-bf16": {"output_throughput": 60.0}},
    }
    lines = qp.target_lines(results, ["auto"])
    assert any("nx-default / vllm-bf16" in ln and "3.00x" in ln and ln.endswith("met") for ln in lines)
    assert any("nx-int8 / nx-bf16" in ln and ln.endswith("NOT met") for ln in lines)
    m = qp.row_metrics({"output_throughput": 2.0, "median_tpot_ms": 400.0, "failed": 1}, 100_000_000, 10.0)
    row = {"name": "llama-q4_1", "loaded": "Q4_1", "weight_bytes": 100_000_000, "workloads": {"b": m}}
    table = qp.format_table([row], {"b": {"llama-q4_1": {"output_throughput": 2.0}}}, ["b"], "vllm-bf16")
    assert "(1 failed)" in table and "2%" in table  # 0.1 GB / 0.4 s = 0.25 GB/s of 10
