"""The ``nxdserve`` command: ``vllm serve``'s flags, so switching is a change of command name.

nxdserve --model PATH [flags]        serve (``nxdserve serve [PATH] [flags]`` is the same)
nxdserve bench ...                   -> nxdserve.bench.cli:main(argv)
nxdserve train-eagle ...             -> nxdserve.speculative.train_eagle:main(argv)

The flag definitions live in ``nxdserve.cli_args`` (one table: implemented / no effect / refused / not yet);
this module turns parsed flags into an EngineConfig and ServeOptions and checks the combination.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import logging.config
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxdserve.cli_args import API_KEY_ENVS, ServeParser, add_serve_flags, check_flags, log_infos
from nxdserve.cli_args.config_file import expand_config_file
from nxdserve.config import EngineConfig
from nxdserve.cpu_options import add_cpu_arguments, cpu_options_from_args, set_openmp_wait_policy
from nxdserve.engine.dp.args import add_data_parallel_args, apply_data_parallel_args
from nxdserve.errors import ConfigError, NxdServeError
from nxdserve.lora.request import LoRARequest
from nxdserve.tools.flags import add_chat_arguments, chat_config_kwargs

if TYPE_CHECKING:  # the server stack is imported only when serving, so `nxdserve bench` starts fast
    from nxdserve.api.server import ServeOptions

API_KEY_ENV = "NXDSERVE_API_KEY"
SUBCOMMANDS = {
    "bench": ("nxdserve.bench.cli", "main"),
    "train-eagle": ("nxdserve.speculative.train_eagle", "main"),
}
SUBCOMMAND_EXTRAS = {"bench": "bench"}  # the pyproject extra that holds a subcommand's own dependencies
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


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
            default in (None, False, argparse.SUPPRESS, [], "")
            or "default" in text
            or text.startswith("[")
            or action.option_strings == ["-h", "--help"]
        ):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def build_parser() -> ServeParser:
    p = ServeParser(
        prog="nxdserve",
        usage="nxdserve [serve] [MODEL] [--model MODEL] [flags]   (nxdserve bench|train-eagle ...)",
        description="OpenAI-compatible LLM server for AWS Neuron (NxD Inference), with a PyTorch reference\n"
        "backend. Flags follow `vllm serve`: switching from vLLM is a change of command name.\n"
        "Every vLLM flag is accepted; [no effect] ones log why, [refused] and [not yet] ones stop start-up\n"
        "when given a value that would matter (docs/flags.md has the table).\n\n"
        "  nxdserve --model PATH [flags]     serve (also: nxdserve serve PATH [flags])\n"
        "  nxdserve bench ...                benchmark a running server (nxdserve bench --help)\n"
        "  nxdserve train-eagle ...          train an EAGLE draft head",
        formatter_class=_HelpFormatter,
    )
    add_serve_flags(p)
    add_cpu_arguments(p)
    add_chat_arguments(p)  # issue 27: chat template, tool calling, reasoning, structured outputs
    add_data_parallel_args(p)  # data parallel (issue 31): vLLM's --data-parallel-* flags, in nxdserve.engine.dp
    return p


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    spec = validate_speculative_config(args.speculative_config) if args.speculative_config else None
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        served_model_name=list(args.served_model_name or []),
        # vLLM's --device neuron (Neuron's legacy guides) is this project's nxd backend.
        backend="nxd" if args.device == "neuron" and args.backend == "auto" else args.backend,
        dtype=_DTYPE_ALIASES.get(args.dtype, args.dtype),
        device="auto" if args.device == "neuron" else args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_num_partial_prefills=args.max_num_partial_prefills,
        whole_prompt_overflow=args.whole_prompt_overflow,
        max_consecutive_prefill_steps=args.max_consecutive_prefill_steps,
        scheduling_policy=args.scheduling_policy,
        max_waiting=args.max_waiting,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        speculative_config=spec,
        tensor_parallel_size=args.tensor_parallel_size,
        override_neuron_config=_neuron_overrides(args),
        num_threads=args.num_threads,
        revision=args.revision,
        tokenizer_revision=args.tokenizer_revision,
        download_dir=args.download_dir,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        disable_log_stats=args.disable_log_stats,
        cpu=cpu_options_from_args(args),
        **chat_config_kwargs(args),  # issue 27
        quantization=args.quantization,
        quantization_tune_epochs=args.quantization_tune_epochs,
        enable_lora=args.enable_lora,
        max_loras=1 if args.max_loras is None else args.max_loras,
        max_lora_rank=16 if args.max_lora_rank is None else args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        lora_modules=_lora_modules(args),
    )


def _lora_modules(args: argparse.Namespace) -> list[LoRARequest]:
    """--lora-modules as vLLM parses it: ``name=path`` or a JSON object; ids 1, 2, ... in order."""
    modules = []
    for i, item in enumerate(args.lora_modules or [], start=1):
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path, base = spec["name"], spec["path"], spec.get("base_model_name")
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"--lora-modules: {item!r} is not a JSON object with name and path") from exc
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError(f"--lora-modules: {item!r} is neither name=path nor a JSON object")
            base = None
        modules.append(LoRARequest(name, i, path, base))
    if modules and not args.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    return modules


def _neuron_overrides(args: argparse.Namespace) -> dict[str, Any] | None:
    """--override-neuron-config, with vllm-neuron's --additional-config '{"override_neuron_config": ...}'."""
    extra = dict(args.additional_config or {})
    from_additional = extra.pop("override_neuron_config", None)
    if "neuron_config" in extra:
        raise ConfigError(
            "--additional-config: neuron_config is the vLLM Neuron plugin's own namespace (bucketing, ...), "
            "which nxdserve does not read; pass NxD Inference NeuronConfig fields as "
            '\'{"override_neuron_config": {...}}\' or --override-neuron-config.'
        )
    if extra:
        raise ConfigError(
            f"--additional-config: keys {sorted(extra)} are not supported; only override_neuron_config is."
        )
    if from_additional is not None and not isinstance(from_additional, dict):
        raise ConfigError("--additional-config: override_neuron_config must be a JSON object.")
    if from_additional is None:
        return args.override_neuron_config
    return {**from_additional, **(args.override_neuron_config or {})}


def api_keys_from_args(args: argparse.Namespace) -> list[str]:
    """--api-key, else VLLM_API_KEY, else NXDSERVE_API_KEY (the first set wins, as vLLM reads its variable)."""
    if args.api_key:
        return list(args.api_key)
    for name in API_KEY_ENVS:
        if os.environ.get(name):
            return [os.environ[name]]
    return []


def serve_options_from_args(args: argparse.Namespace) -> ServeOptions:
    from nxdserve.api.multimodal import MediaOptions
    from nxdserve.api.server import ServeOptions

    keys = api_keys_from_args(args)
    log_requests = not args.disable_log_requests if args.enable_log_requests is None else args.enable_log_requests
    exclude = [p.strip() for p in (args.disable_access_log_for_endpoints or "").split(",") if p.strip()]
    return ServeOptions(
        host=args.host,
        port=args.port,
        uds=args.uds,
        api_key=keys[0] if len(keys) == 1 else (keys or None),
        served_model_names=list(args.served_model_name or []),
        drain_timeout=args.drain_timeout,
        log_requests=log_requests,
        log_level=args.log_level,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        access_log_exclude=exclude,
        max_log_len=args.max_log_len,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=args.ssl_ciphers,
        allowed_origins=list(args.allowed_origins),
        allowed_methods=list(args.allowed_methods),
        allowed_headers=list(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        root_path=args.root_path or "",
        middleware=list(args.middleware),
        enable_docs=not args.disable_fastapi_docs,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        uvloop=args.uvloop,
        log_config_file=args.log_config_file,
        media=MediaOptions.from_flags(
            args.allowed_local_media_path, args.allowed_media_domains, args.limit_mm_per_prompt
        ),
    )


def check_combination(args: argparse.Namespace) -> list[str]:
    """Refusals that depend on more than one flag; returns extra info lines."""
    if args.pipeline_parallel_size != 1:
        raise ConfigError(
            f"--pipeline-parallel-size {args.pipeline_parallel_size} is not supported: no backend here runs "
            "pipeline stages. Use --tensor-parallel-size on the nxd backend (Neuron) to spread a large model."
        )
    if (args.ssl_keyfile and not args.ssl_certfile) or (args.ssl_certfile and not args.ssl_keyfile):
        raise ConfigError("--ssl-keyfile and --ssl-certfile must be given together.")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "log_config_file"):
        value = getattr(args, name)
        if value and not Path(value).is_file():
            raise ConfigError(f"--{name.replace('_', '-')} {value!r}: no such file.")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port is 0-65535.")
    if args.uds and Path(args.uds).is_dir():
        raise ConfigError(f"--uds {args.uds!r} is a folder; give a socket file path.")
    _check_model_is_local(args)
    infos = []
    if args.quantization == "gguf" and args.model is not None and not str(args.model).endswith(".gguf"):
        raise ConfigError("--quantization gguf: --model must be a .gguf file.")
    if args.generation_config not in ("auto", "vllm") and not Path(args.generation_config).is_dir():
        raise ConfigError(
            f"--generation-config {args.generation_config!r}: expected auto, vllm or a folder holding "
            "generation_config.json."
        )
    if args.enable_log_requests is False and args.disable_log_requests:
        infos.append("--disable-log-requests and --no-enable-log-requests both turn request logging off")
    return infos


def _check_model_is_local(args: argparse.Namespace) -> None:
    """A hub id must already be in a local cache: fail now, naming where it was looked for, not after the
    server stack has started. (Local folders and .gguf files are checked when they load.)"""
    from nxdserve.model_files import looks_like_hub_id, resolve_model

    wanted = ((args.model, args.revision, True), (args.tokenizer, args.tokenizer_revision, False))
    for name, revision, weights in wanted:
        if name is not None and looks_like_hub_id(name) and not Path(name).expanduser().exists():
            resolve_model(name, revision=revision, download_dir=args.download_dir, require_weights=weights)


def normalize_flag_spelling(argv: Sequence[str]) -> list[str]:
    """vLLM accepts ``--gpu_memory_utilization`` for ``--gpu-memory-utilization`` (its docs use both)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def plan(argv: Sequence[str]) -> tuple[EngineConfig, ServeOptions, list[str]]:
    """Parse a serve command line into what the server would run with, without loading anything:
    (engine config, server options, the info lines start-up logs). Raises ConfigError for refused flags;
    argparse's SystemExit for unknown ones."""
    parser = build_parser()
    argv = normalize_flag_spelling(expand_config_file(list(argv), parser._option_string_actions))
    args, extra = parser.parse_known_args(argv)
    if extra:  # `vllm serve`'s optional positional MODEL may come after flags too
        if len(extra) > 1 or extra[0].startswith("-"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.model is not None and args.model != extra[0]:
            raise ConfigError(f"the model is given twice: {extra[0]!r} and --model {args.model!r}")
        args.model = extra[0]
    infos = check_flags(parser.flags, args)
    infos += check_combination(args)
    config = apply_data_parallel_args(engine_config_from_args(args), args)  # data parallel (issue 31)
    return config, serve_options_from_args(args), infos


def _dispatch(name: str, argv: list[str]) -> int:
    module_name, func_name = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            print(f"nxdserve {name}: not available in this installation ({module_name} is missing).",
                  file=sys.stderr)
            return 2
        extra = SUBCOMMAND_EXTRAS.get(name)
        if extra is None:
            raise  # the module exists but one of its own imports is missing: show that
        print(f"nxdserve {name} needs the {exc.name} package: pip install 'nxdserve[{extra}]'", file=sys.stderr)
        return 2
    result = getattr(module, func_name)(argv)
    return int(result or 0)


def _configure_logging(level: str, config_file: str | None = None) -> None:
    if config_file:
        logging.config.dictConfig(json.loads(Path(config_file).read_text()))
        return
    numeric = logging.DEBUG if level == "trace" else getattr(logging, level.upper())
    logging.basicConfig(level=numeric, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    set_openmp_wait_policy()  # before anything loads torch (and its OpenMP runtime)
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in SUBCOMMANDS:
        return _dispatch(args_list[0], args_list[1:])
    if args_list and args_list[0] == "serve":
        args_list = args_list[1:]
        if args_list and not args_list[0].startswith("-"):  # `vllm serve MODEL` form
            args_list = ["--model", args_list[0], *args_list[1:]]
    parser = build_parser()
    try:
        config, opts, infos = plan(args_list)
    except ConfigError as exc:
        parser.error(str(exc))
    _configure_logging(opts.log_level, opts.log_config_file)
    log_infos(infos)

    from nxdserve.api.server import run_server_loop, serve

    try:
        return run_server_loop(lambda: serve(config, opts), use_uvloop=opts.uvloop)
    except NxdServeError as exc:  # a start-up refusal (a flag, a LoRA adapter, ...): one line, no traceback
        logging.getLogger("nxdserve").error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
