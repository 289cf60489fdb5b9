"""The torch backend's CPU switches, as one typed object read once (``EngineConfig.cpu``) and as CLI flags.

Every field's default is what serves best where it applies; the switches exist for A/B measurements and for
machines where a path misbehaves. The torch backend applies them when it is built
(``nxdserve.engine.models.cpu_setup.apply``). This module imports nothing heavy: the CLI reads it before torch.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Literal, get_args

from nxdserve.errors import ConfigError

# "auto": the best variant this CPU runs; "amx" and "avx512bf16" are the same build with the AMX tiles on / off;
# "neon" is aarch64's; "none": no C kernels, the model runs its torch ops.
Isa = Literal["auto", "amx", "avx512bf16", "avx2", "neon", "generic", "none"]
ISA_CHOICES: tuple[str, ...] = get_args(Isa)
# A bf16 model's quantized steps of up to quant_dense_rows tokens (where the fused AVX512-BF16 / AMX forward
# runs): timed at warm-up on the codes and on the dense copies, the faster taken; or one pinned.
SmallSteps = Literal["measure", "codes", "dense"]
SMALL_STEP_CHOICES: tuple[str, ...] = get_args(SmallSteps)


@dataclass(frozen=True)
class CpuOptions:
    isa: Isa = "auto"  # which build of the C kernels runs (see cpu_kernels)
    amx: bool = True  # GEMMs on AMX tiles where the CPU and OS allow (with isa auto)
    gemm: bool = True  # the packed-panel bf16 GEMM (AVX512-BF16 builds); off: oneDNN
    compressed_weights: bool = True  # AMX GEMMs read 12-bit lossless weight copies
    fused_decode: bool = True  # one C call for a bf16 forward's layers (AVX512-BF16 builds)
    fused_quant_decode: bool = True  # one C call for a quantized fp32 forward's layers (fused_qdecode.max_rows)
    greedy_head: bool = True  # greedy tokens from an int8-screened LM head (AVX512-VNNI builds)
    packed_linear: bool = True  # oneDNN weights prepacked once (bf16)
    kv_huge_pages: bool = True  # the KV cache in transparent huge pages (Linux)
    thread_governor: bool = True  # a step on all intra-op threads or one, by the machine's load
    bind_threads: bool = True  # the forward's intra-op threads bound one per CPU
    # Quantized linears: calls of up to this many rows run the C kernel's row path on the codes; more rows of fp32
    # activations its paired rows (to quant.kernel_rows()) or a transient widened copy, more rows of bf16 activations
    # a dense bf16 copy kept (0: the kernel for every call, no copy). Default: the measured crossover (perf_notes.md).
    quant_dense_rows: int = 16
    # Quantized linears' small-row kernel: activations rounded to int8 per 32 columns, integer dot products with
    # the 4-bit / int8 codes (csrc/qgemm_i8.c). Off: results change (the activations' rounding), so opt-in.
    quant_int8_activations: bool = False
    quant_small_steps: SmallSteps = "measure"  # see SmallSteps (engine/models/quant_steps.py)
    # With --dtype auto on a CPU without native bf16 (or a build forced below it), a dense model's linears and LM
    # head are kept in bf16 and multiplied in fp32 by the C kernel: half of the bytes a decode step reads and of the
    # linears' memory (docs/quantization.md, "bf16 weights"). Off: dense fp32, as before.
    bf16_weights: bool = True

    def __post_init__(self) -> None:
        if self.isa not in ISA_CHOICES:
            raise ConfigError(f"cpu isa must be one of {', '.join(ISA_CHOICES)}; got {self.isa!r}.")
        if self.isa == "amx" and not self.amx:
            raise ConfigError("cpu isa 'amx' asks for the AMX tiles, which amx=False turns off.")
        rows = self.quant_dense_rows
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise ConfigError(f"cpu option quant_dense_rows must be an int >= 0; got {rows!r}.")
        if self.quant_small_steps not in SMALL_STEP_CHOICES:
            raise ConfigError(
                f"cpu option quant_small_steps must be one of {', '.join(SMALL_STEP_CHOICES)}; "
                f"got {self.quant_small_steps!r}."
            )
        for f in fields(self):
            typed = f.name in ("isa", "quant_dense_rows", "quant_small_steps")
            if not typed and not isinstance(getattr(self, f.name), bool):
                raise ConfigError(f"cpu option {f.name} must be a bool; got {getattr(self, f.name)!r}.")


# (field, flag, help) of the on/off switches: each is on by default and --no-cpu-X turns it off.
_SWITCHES = (
    ("amx", "--no-cpu-amx", "keep the GEMMs off the AMX tiles (AVX512-BF16 instead)"),
    ("gemm", "--no-cpu-gemm", "bf16 GEMMs through oneDNN instead of the packed-panel kernel"),
    ("compressed_weights", "--no-cpu-compressed-weights", "AMX GEMMs read the plain bf16 weights"),
    ("fused_decode", "--no-cpu-fused-decode", "run bf16 forwards layer by layer instead of one fused call"),
    (
        "fused_quant_decode",
        "--no-cpu-fused-quant-decode",
        "run quantized (4/8-bit) fp32 forwards of a few rows layer by layer instead of one fused call",
    ),
    (
        "bf16_weights",
        "--no-cpu-bf16-weights",
        "with --dtype auto on a CPU without native bf16: dense fp32 weights instead of bf16 ones multiplied in fp32",
    ),
    ("greedy_head", "--no-cpu-greedy-head", "greedy rows take the full LM head and argmax"),
    ("packed_linear", "--no-cpu-packed-linear", "no prepacked oneDNN weights (F.linear)"),
    ("kv_huge_pages", "--no-cpu-kv-huge-pages", "no transparent huge pages for the KV cache"),
    ("thread_governor", "--no-cpu-thread-governor", "every step on all intra-op threads, whatever the load"),
    ("bind_threads", "--no-cpu-bind-threads", "leave the forward's threads unbound"),
)


def add_cpu_arguments(parser: argparse.ArgumentParser) -> None:
    """The "CPU backend" flag group (torch backend on a CPU)."""
    group = parser.add_argument_group("CPU backend", "switches of the torch backend's CPU kernels (A/B, workarounds)")
    group.add_argument(
        "--cpu-isa",
        default="auto",
        choices=ISA_CHOICES,
        help="build of the C kernels: auto = the best this CPU runs; amx / avx512bf16 / avx2 / neon / generic "
        "force one (an error if the CPU cannot run it); none = torch ops only",
    )
    group.add_argument(
        "--cpu-quant-dense-rows",
        type=int,
        default=CpuOptions.quant_dense_rows,
        metavar="N",
        help="quantized linears: steps of up to N rows run the C kernel on the 4/8-bit codes; larger ones its "
        "paired rows (fp32, to 32 rows), a transient widened copy (fp32, more rows) or, in a bf16 model, a dense "
        "bf16 copy kept (0 = the kernel always)",
    )
    group.add_argument(
        "--cpu-quant-int8-activations",
        action="store_true",
        help="quantized linears (4-bit, int8): round the activations of steps of up to --cpu-quant-dense-rows rows "
        "to int8 per 32 columns and take integer dot products (faster; results change slightly, so off by default)",
    )
    group.add_argument(
        "--cpu-quant-small-steps",
        default=CpuOptions.quant_small_steps,
        choices=SMALL_STEP_CHOICES,
        help="a bf16 model's quantized steps of up to --cpu-quant-dense-rows rows (AVX512-BF16 / AMX): measure = "
        "time the codes and the dense copies at start-up and take the faster; codes / dense = pin one",
    )
    for name, flag, text in _SWITCHES:
        group.add_argument(flag, dest=f"cpu_{name}", action="store_false", help=text)


def cpu_options_from_args(args: argparse.Namespace) -> CpuOptions:
    switches = {name: getattr(args, f"cpu_{name}") for name, _, _ in _SWITCHES}
    return CpuOptions(
        isa=args.cpu_isa,
        quant_dense_rows=args.cpu_quant_dense_rows,
        quant_int8_activations=args.cpu_quant_int8_activations,
        quant_small_steps=args.cpu_quant_small_steps,
        **switches,
    )


def set_openmp_wait_policy() -> None:
    """For a process that serves: call before torch loads OpenMP (a variable the user set wins).

    With the default (active) wait policy, each multi-threaded op spins waiting for sibling threads that other
    processes (or our own event-loop thread) have descheduled, which made steps 10-25x slower on small machines.
    But a thread that sleeps at once pays a futex wake-up in each of the ~200 parallel regions of a decode step:
    a short spin first (GOMP_SPINCOUNT, a few tens of microseconds) made batch-1 decode 1.35x faster and batch 32
    1.1x on an idle 2-core VM, and bounds what a spinning thread can waste when its sibling is descheduled.
    ``nxdserve``'s CLI calls it; importing ``nxdserve`` does not (an embedding program owns its environment:
    it calls this first, or sets ``OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000`` itself)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
