"""The ``nxdserve`` command: ``vllm serve``'s flags, so switching is a change of command name.

nxdserve --model PATH [flags]        serve (``nxdserve serve [PATH] [flags]`` is the same)
nxdserve bench ...                   -> nxdserve.bench.cli:main(argv)
nxdserve train-eagle ...             -> nxdserve.speculative.train_eagle:main(argv)
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from nxdserve.config import EngineConfig
from nxdserve.engine.dp.args import add_data_parallel_args, apply_data_parallel_args
from nxdserve.errors import ConfigError

if TYPE_CHECKING:  # the server stack is imported only when serving, so `nxdserve bench` starts fast
    from nxdserve.api.server import ServeOptions

API_KEY_ENV = "NXDSERVE_API_KEY"
SUBCOMMANDS = {
    "bench": ("nxdserve.bench.cli", "main"),
    "train-eagle": ("nxdserve.speculative.train_eagle", "main"),
}


def _size(text: str) -> int:
    """An integer, or vLLM's human forms: 4k = 4000, 4K = 4096, 1m = 10**6, 1M = 2**20."""
    units = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def validate_speculative_config(spec: dict[str, Any]) -> dict[str, Any]:
    """Check --speculative-config now, so a typo fails at startup rather than at first use."""
    from nxdserve.engine.speculative.config import SpeculativeConfig

    return {**spec, "method": SpeculativeConfig.from_dict(spec).method}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Append "(default: X)" only where a default exists and the help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            default in (None, False, argparse.SUPPRESS)
            or "default" in text
            or action.option_strings == ["-h", "--help"]
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nxdserve",
        description="OpenAI-compatible LLM server for AWS Neuron (NxD Inference), with a PyTorch reference\n"
        "backend. Flags follow `vllm serve`: switching from vLLM is a change of command name.\n\n"
        "  nxdserve --model PATH [flags]     serve (also: nxdserve serve PATH [flags])\n"
        "  nxdserve bench ...                benchmark a running server (nxdserve bench --help)\n"
        "  nxdserve train-eagle ...          train an EAGLE draft head",
        formatter_class=_HelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None, help="HF folder, GGUF file or hub id; default: the embedded model")
    m.add_argument("--tokenizer", default=None, help="tokenizer location if not the model's")
    m.add_argument("--served-model-name", nargs="+", default=None, help="names clients may use; first is reported")
    m.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="weights and compute dtype"
    )
    m.add_argument("--max-model-len", type=_size, default=None, help="context length (default: min(model, 2048))")
    m.add_argument(
        "--generation-config",
        default="auto",
        choices=["auto", "vllm"],
        help="auto: sampling defaults from the model's generation_config.json; vllm: vLLM's defaults",
    )
    m.add_argument("--seed", type=int, default=0, help="engine seed for unseeded requests (default: 0)")
    m.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs / top_logprobs a request may ask")

    b = p.add_argument_group("backend")
    b.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "torch", "nxd"],
        help="auto: nxd where NxD Inference and a Neuron device exist, else torch",
    )
    b.add_argument("--device", default="auto", help="torch backend: auto | cpu | cuda")
    b.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    b.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="NxD tensor parallel degree")
    b.add_argument(
        "--override-neuron-config", type=_json_object, default=None, help="JSON merged into NxD's NeuronConfig"
    )
    b.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}\'',
    )

    s = p.add_argument_group("scheduling")
    s.add_argument("--max-num-seqs", type=int, default=64, help="concurrent sequences (KV slots)")
    s.add_argument(
        "--max-num-batched-tokens",
        type=_size,
        default=None,
        help="tokens per step (default: chunked 512, 128 for the torch backend on CPU; prefill-first max_model_len)",
    )
    s.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="chunked prefill mixed with decodes; --no-enable-chunked-prefill: prefill-first",
    )
    s.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a new prompt reuses the KV a free slot still holds for its first tokens (off by default, unlike vLLM)",
    )
    s.add_argument("--long-prefill-token-threshold", type=int, default=0, help="max chunk per request (0: none)")
    s.add_argument("--max-num-partial-prefills", type=int, default=1, help="concurrent partial prefills")
    s.add_argument(
        "--whole-prompt-overflow",
        type=int,
        default=None,
        help="chunked mode: tokens a step may exceed --max-num-batched-tokens by to run a short prompt whole "
        "instead of splitting it (default: 64 with the CPU default budget of 128, else 0)",
    )
    s.add_argument(
        "--max-consecutive-prefill-steps",
        type=int,
        default=1,
        help="prefill-first: prefill steps in a row while decodes wait",
    )
    s.add_argument("--max-waiting", type=int, default=None, help="queue bound; beyond it requests get 503")

    h = p.add_argument_group("server")
    h.add_argument("--host", default="0.0.0.0", help="address to bind (vLLM's default: all interfaces)")
    h.add_argument("--port", type=int, default=8000, help="port to bind")
    h.add_argument("--api-key", default=None, help=f"require this bearer key on /v1/* (or ${API_KEY_ENV})")
    h.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests may run on after SIGTERM/SIGINT"
    )
    h.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    h.add_argument(
        "--log-level",
        default="info",
        help="log verbosity",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    add_data_parallel_args(p)  # data parallel (issue 31): vLLM's --data-parallel-* flags, in nxdserve.engine.dp
    return p


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    spec = validate_speculative_config(args.speculative_config) if args.speculative_config else None
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        served_model_name=list(args.served_model_name or []),
        backend=args.backend,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        whole_prompt_overflow=args.whole_prompt_overflow,
        max_consecutive_prefill_steps=args.max_consecutive_prefill_steps,
        max_waiting=args.max_waiting,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        generation_config=args.generation_config,
        speculative_config=spec,
        tensor_parallel_size=args.tensor_parallel_size,
        override_neuron_config=args.override_neuron_config,
        num_threads=args.num_threads,
    )


def serve_options_from_args(args: argparse.Namespace) -> ServeOptions:
    from nxdserve.api.server import ServeOptions

    return ServeOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        served_model_names=list(args.served_model_name or []),
        drain_timeout=args.drain_timeout,
        log_requests=not args.disable_log_requests,
        log_level=args.log_level,
    )


def _dispatch(name: str, argv: list[str]) -> int:
    module_name, func_name = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module_name.startswith(exc.name):
            raise  # the module exists but one of its own imports is missing: show that
        print(f"nxdserve {name}: not available in this installation ({module_name} is missing).", file=sys.stderr)
        return 2
    result = getattr(module, func_name)(argv)
    return int(result or 0)


def _configure_logging(level: str) -> None:
    numeric = logging.DEBUG if level == "trace" else getattr(logging, level.upper())
    logging.basicConfig(level=numeric, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in SUBCOMMANDS:
        return _dispatch(args_list[0], args_list[1:])
    if args_list and args_list[0] == "serve":
        args_list = args_list[1:]
        if args_list and not args_list[0].startswith("-"):  # `vllm serve MODEL` form
            args_list = ["--model", args_list[0], *args_list[1:]]
    parser = build_parser()
    args = parser.parse_args(args_list)
    try:
        config = engine_config_from_args(args)
        config = apply_data_parallel_args(config, args)  # data parallel (issue 31)
    except ConfigError as exc:
        parser.error(str(exc))
    _configure_logging(args.log_level)

    from nxdserve.api.server import run_server_loop, serve

    opts = serve_options_from_args(args)
    try:
        return run_server_loop(lambda: serve(config, opts))
    except ConfigError as exc:
        logging.getLogger("nxdserve").error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
