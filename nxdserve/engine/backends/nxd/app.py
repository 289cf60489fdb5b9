"""Build, compile (once), load and warm up the NxD application for a model.

Compiling a model for Neuron takes minutes to tens of minutes, so the result is cached on disk under
a key that hashes the whole InferenceConfig (the HF config included), the NxD version and the model
paths; a second start with the same settings only loads. Compilation goes into a temporary sibling
folder that is renamed into place when complete, under a file lock, so concurrent starts compile
once and an interrupted compile is never mistaken for a finished one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nxdserve.config import EngineConfig
from nxdserve.engine.backends.nxd.neuron_config import (
    QWEN2_VL_DEFAULT_IMAGE_SIZE,
    VISION_OVERRIDES_KEY,
    NxdSettings,
    artifact_dir,
    artifact_key,
    check_supported,
    default_neuron_config,
    draft_neuron_config,
    image_to_text_refusals,
    is_image_to_text,
    merge_overrides,
    pick_model_class,
    qwen2_vl_image_grid,
    refuse_image_to_text,
    vision_neuron_config,
)
from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".nxdserve-complete.json"
PROGRESS_INTERVAL_S = 60.0


@dataclass
class LoadedApp:
    app: Any  # the NxD application (NeuronBaseForCausalLM subclass), loaded and warmed up
    settings: NxdSettings
    artifacts: Path
    compiled_now: bool


def nxd_version() -> str:
    try:
        from neuronx_distributed_inference._version import __version__

        return str(__version__)
    except ImportError:  # very old releases have no _version module
        return "unknown"


def build_inference_config(model_path: Path, config: EngineConfig, hf_config: Any) -> tuple[Any, Any]:
    """(application class, InferenceConfig) for the model, defaults merged with the overrides."""
    from neuronx_distributed_inference.models.config import FusedSpecNeuronConfig
    from neuronx_distributed_inference.utils.constants import MODEL_TYPES
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    cls = pick_model_class(hf_config, MODEL_TYPES)
    refuse_image_to_text(cls, hf_config)
    if is_image_to_text(cls, hf_config):
        return cls, _image_to_text_config(cls, model_path, config, hf_config)
    kwargs, draft_overrides = merge_overrides(default_neuron_config(config, model_path), config.override_neuron_config)
    if isinstance(kwargs.get("lora_config"), dict):
        from neuronx_distributed_inference.modules.lora_serving import LoraServingConfig

        kwargs = {**kwargs, "lora_config": LoraServingConfig(**kwargs["lora_config"])}
    if kwargs.get("kv_cache_quant"):
        # What NxD's own inference_demo sets for an fp8 KV cache (the compiler's fp8 casts).
        os.environ.setdefault("XLA_HANDLE_SPECIAL_SCALAR", "1")
        os.environ.setdefault("UNSAFE_FP8FNCAST", "1")
    neuron_config = cls.get_neuron_config_cls()(**kwargs)
    inference_config = cls.get_config_cls()(neuron_config, load_config=load_pretrained_config(str(model_path)))
    if getattr(neuron_config, "enable_fused_speculation", False):
        spec = config.speculative_config or {}
        draft_path = spec.get("model")
        if not draft_path:
            raise ConfigError("Fused speculation on NxD needs a draft model: --speculative-config '{\"model\": ...}'.")
        if kwargs.get("on_device_sampling_config") is None:  # NxD's fused model samples with its on-device sampler
            raise ConfigError(
                "--speculative-config on nxd runs NxD's fused speculation, which samples on device: it cannot be "
                "combined with --override-neuron-config '{\"on_device_sampling_config\": null}'."
            )
        draft_nc = cls.get_neuron_config_cls()(**draft_neuron_config({**kwargs, "lora_config": None}, draft_overrides))
        draft_config = cls.get_config_cls()(draft_nc, load_config=load_pretrained_config(str(draft_path)))
        inference_config.fused_spec_config = FusedSpecNeuronConfig(
            cls._model_cls, draft_config=draft_config, draft_model_path=str(draft_path)
        )
    return cls, inference_config


def _image_to_text_config(cls: Any, model_path: Path, config: EngineConfig, hf_config: Any) -> Any:
    """Qwen2-VL: ``Qwen2VLInferenceConfig(text_neuron_config, vision_neuron_config, load_config=...)`` as NxDI's
    generate_qwen2_vl.py builds it. The text NeuronConfig is the text path's (slots, seq len, tp, on-device
    sampling); ``--override-neuron-config`` applies to it, and its ``vision_neuron_config`` entry to the
    vision encoder's (``default_image_width``/``default_image_height``: the compiled image size)."""
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    image_to_text_refusals(config)
    overrides = dict(config.override_neuron_config or {})
    vision_overrides = dict(overrides.pop(VISION_OVERRIDES_KEY, None) or {})
    text_kwargs, _ = merge_overrides(default_neuron_config(config, model_path), overrides)
    vc = hf_config.vision_config
    width = int(vision_overrides.get("default_image_width", QWEN2_VL_DEFAULT_IMAGE_SIZE[0]))
    height = int(vision_overrides.get("default_image_height", QWEN2_VL_DEFAULT_IMAGE_SIZE[1]))
    _, grid_h, grid_w = qwen2_vl_image_grid(width, height, int(vc.patch_size))
    tokens_per_image = grid_h * grid_w // int(vc.spatial_merge_size) ** 2
    neuron_config_cls = cls.get_config_cls().get_neuron_config_cls()  # Qwen2VLNeuronConfig
    text_nc = neuron_config_cls(**text_kwargs)
    vision_nc = neuron_config_cls(**vision_neuron_config(text_kwargs, vision_overrides, tokens_per_image))
    return cls.get_config_cls()(text_nc, vision_nc, load_config=load_pretrained_config(str(model_path)))


def load_application(model_path: Path, config: EngineConfig, hf_config: Any) -> LoadedApp:
    cls, inference_config = build_inference_config(model_path, config, hf_config)
    version = nxd_version()
    draft = (config.speculative_config or {}).get("model") or ""
    key = artifact_key(inference_config.to_json_string(), f"nxdi={version}", str(model_path), str(draft))
    folder, exact = artifact_dir(model_path, key)
    app = None
    if exact and _has_archive(folder):
        # A folder the user compiled before: its config wins, as in vllm-neuron (overrides are ignored).
        requested = inference_config.neuron_config
        inference_config = cls.get_config_cls().load(str(folder))
        check_supported(inference_config.neuron_config, f"the compiled model in {folder}")
        _check_precompiled(requested, inference_config.neuron_config, folder)
        if config.override_neuron_config:
            logger.warning("NxD: loading pre-compiled artifacts from %s; --override-neuron-config is ignored", folder)
    else:
        app = _compile_once(cls, model_path, inference_config, folder, exact)
    compiled_now = app is not None
    _quantize_once(cls, model_path, inference_config)

    nc = inference_config.neuron_config
    logger.info(
        "NxD %s: %s, tp=%d, batch=%d, max_context_length=%d, max_length=%d, dtype=%s, on-device sampling %s%s",
        version, cls.__name__, nc.tp_degree, nc.batch_size, nc.max_context_length, nc.max_length,
        str(nc.torch_dtype).removeprefix("torch."), "on" if nc.on_device_sampling_config is not None else "off",
        f", fused speculation k={nc.speculation_length}" if nc.enable_fused_speculation else "",
    )
    started = time.monotonic()
    if app is None:
        app = cls(str(model_path), inference_config)
    with _progress("loading and warming up", started):
        app.load(str(folder))
    logger.info("NxD: loaded and warmed up from %s in %.1f s", folder, time.monotonic() - started)
    pad = getattr(inference_config, "pad_token_id", None)
    settings = NxdSettings.from_neuron_config(app.neuron_config, int(pad) if pad is not None else 0)
    return LoadedApp(app, settings, folder, compiled_now)


# NeuronConfig settings the flags decide (--enable-lora, --speculative-config, --kv-cache-dtype, --quantization,
# --tensor-parallel-size, --max-num-seqs, --max-model-len, --dtype) that a pre-compiled folder may hold otherwise
_COMPILED_SETTINGS = ("enable_fused_speculation", "speculation_length", "kv_cache_quant", "quantized",
                      "quantization_dtype", "tp_degree", "batch_size", "max_context_length", "max_length",
                      "torch_dtype")


def _check_precompiled(requested: Any, compiled: Any, folder: Path) -> None:
    """Refuse what the pre-compiled model cannot serve (adapters without a compiled lora_config: every request
    would fail); name each other setting the flags asked differently, since the compiled one runs."""
    if getattr(requested, "lora_config", None) is not None and getattr(compiled, "lora_config", None) is None:
        raise ConfigError(
            f"--enable-lora: the pre-compiled model in {folder} (NEURON_COMPILED_ARTIFACTS) was compiled without "
            "LoRA; compile it with --enable-lora (an empty folder is compiled into), or serve without adapters"
        )
    differ = [f"{key} {getattr(requested, key, None)!r} -> {getattr(compiled, key, None)!r}"
              for key in _COMPILED_SETTINGS if getattr(requested, key, None) != getattr(compiled, key, None)]
    if differ:
        logger.warning("NxD: the pre-compiled model in %s runs with its own settings, not the flags': %s",
                       folder, "; ".join(differ))


def _compile_once(cls: Any, model_path: Path, inference_config: Any, folder: Path, exact: bool) -> Any:
    """Compile into ``folder`` unless a complete compile is there. Returns the compiled application
    (to load next), or None when the artifacts were already there."""
    from filelock import FileLock

    if _is_complete(folder, exact):
        logger.info("NxD: reusing compiled artifacts in %s", folder)
        return None
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / f".{folder.name}.lock")):
        if _is_complete(folder, exact):  # another process compiled it while we waited
            logger.info("NxD: reusing compiled artifacts in %s", folder)
            return None
        started = time.monotonic()
        logger.info(
            "NxD: compiling %s into %s; this takes minutes (tens of minutes for large models or many "
            "buckets) and happens once per configuration",
            cls.__name__, folder,
        )
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            app = cls(str(model_path), inference_config)
            _quantize_once(cls, model_path, inference_config)
            with _progress("compiling", started):
                app.compile(str(tmp))
            (tmp / COMPLETE_MARKER).write_text(json.dumps({"created": time.time(), "model": str(model_path)}))
            if folder.exists():  # a stale or partial folder (or the user's empty $NEURON_COMPILED_ARTIFACTS)
                shutil.rmtree(folder)
            tmp.rename(folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("NxD: compiled in %.1f s", time.monotonic() - started)
    return app


def _quantize_once(cls: Any, model_path: Path, inference_config: Any) -> None:
    """A quantized config needs NxD's quantized checkpoint before compiling and loading: written by the
    application's own ``save_quantized_state_dict`` when it is not there yet (once per model and format),
    into a temporary name renamed into place, so an interrupted write is never loaded."""
    nc = inference_config.neuron_config
    if not getattr(nc, "quantized", False):
        return
    from filelock import FileLock

    target = Path(nc.quantized_checkpoints_path)
    if _has_quantized_checkpoint(target):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if _has_quantized_checkpoint(target):
            return
        started = time.monotonic()
        if target.is_dir():  # NxD writes safetensors into a folder the user named: in place
            with _progress("quantizing", started):
                cls.save_quantized_state_dict(str(model_path), inference_config)
            return
        tmp = target.parent / f".{target.name}.tmp"
        nc.quantized_checkpoints_path = str(tmp)  # NxD writes where the config says
        try:
            with _progress("quantizing", started):
                cls.save_quantized_state_dict(str(model_path), inference_config)
            tmp.rename(target)
        finally:
            nc.quantized_checkpoints_path = str(target)
            if tmp.is_file():
                tmp.unlink()
        logger.info("NxD: wrote the %s %s checkpoint %s in %.1f s", nc.quantization_type, nc.quantization_dtype,
                    target, time.monotonic() - started)  # fmt: skip


def _has_quantized_checkpoint(target: Path) -> bool:
    """A file NxD torch.save'd, or a folder it saved safetensors into."""
    return target.is_file() or (target.is_dir() and any(target.glob("*.safetensors")))


def _has_archive(folder: Path) -> bool:
    """NxD's traced model: ``model.pt``, or for image-to-text applications ``text_model/model.pt`` beside
    ``vision_model/model.pt`` (NeuronBaseForImageToText.compile)."""
    if (folder / "model.pt").is_file():
        return True
    return all((folder / sub / "model.pt").is_file() for sub in ("text_model", "vision_model"))


def _is_complete(folder: Path, exact: bool) -> bool:
    if not _has_archive(folder):
        return False
    return exact or (folder / COMPLETE_MARKER).is_file()


@contextmanager
def _progress(what: str, started: float) -> Iterator[None]:
    """Log a line every minute while a long, silent NxD call runs, so a start never looks hung."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(PROGRESS_INTERVAL_S):
            logger.info("NxD: still %s (%.0f s)", what, time.monotonic() - started)

    thread = threading.Thread(target=beat, name="nxd-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
