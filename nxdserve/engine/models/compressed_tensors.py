"""Pre-quantized compressed-tensors checkpoints (llm-compressor's output) served from their own codes.

A checkpoint says so in config.json: ``quantization_config.quant_method == "compressed-tensors"``; vLLM then
picks the method itself, and so do we (``resolve_quantization``). The format is read with the
``compressed-tensors`` library (Neural Magic / vLLM's own): its ``QuantizationConfig`` parses the config, its
``match_name`` applies ``targets`` / ``ignore``, its compressors decompress a module for the dense load and its
``unpack_from_int32`` unpacks ``pack-quantized`` codes. What maps exactly onto a runtime format of ours is
kept quantized (``quant.QuantLinear``):

- int weights, 8 bits, per channel (``int-quantized`` W8A8 / ``pack-quantized`` W8A16): our ``int8`` as is;
- int weights, 4 bits, groups (``pack-quantized`` W4A16, symmetric or with zero points) or per channel: our
  4-bit group format, ``w = (q - zp) * scale`` = ``(q + 8) * scale - (zp + 8) * scale`` with codes ``q + 8``
  in 0..15; a group that is a multiple of 32/64/128 (or a whole row) is split into equal-scale groups;
- int weights, 8 bits, groups: the codes and group scales kept as ``QuantLinear`` kind ``"q8_0"`` (GGUF's
  int8-with-block-scales form, expanded once into the compute dtype: no PyTorch kernel takes them);
- float weights (``float-quantized`` FP8, e4m3) per channel or per tensor: our ``fp8`` (a tensor scale is
  the same scale on every row).

Activation quantization (W8A8 int8, FP8 with dynamic or static input scales) is not applied: the weights are
served weight-only with bf16/fp32 activations, as vLLM does on hardware without the matching kernels (FP8
weight-only through Marlin on GPUs without fp8), and a warning says so. Block-wise FP8, 2/3/5/6/7-bit ints,
FP4 formats, activation-ordered groups (``weight_g_idx``), sparsity and transforms raise a ConfigError that
names them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from nxdserve.engine.models.quant import INT4_GROUPS, QuantLinear, int4_from_codes
from nxdserve.errors import ConfigError

logger = logging.getLogger(__name__)

METHOD = "compressed-tensors"
# HF module suffix in a decoder layer -> (our fused weight, position among its parts)
_PARTS = {
    "self_attn.q_proj": ("qkv_weight", 0), "self_attn.k_proj": ("qkv_weight", 1),
    "self_attn.v_proj": ("qkv_weight", 2), "self_attn.o_proj": ("o_weight", 0),
    "mlp.gate_proj": ("gate_up_weight", 0), "mlp.up_proj": ("gate_up_weight", 1),
    "mlp.down_proj": ("down_weight", 0),
}  # fmt: skip
# The library's compression formats whose codes are read here (quantization only: no sparse / marlin layouts).
_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
# The tensors a compressed module stores besides its codes (local names).
_QPARAMS = ("weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "input_scale", "input_zero_point")


def _v(value: Any) -> str:
    """An enum field of the library's config as its config.json spelling."""
    return str(getattr(value, "value", value))


def checkpoint_quant_method(model_path: Path) -> str | None:
    """``quantization_config.quant_method`` from the checkpoint's config.json (None: not quantized)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    qconfig = json.loads(config_file.read_text()).get("quantization_config")
    if not qconfig:
        return None
    return str(qconfig.get("quant_method", "unknown"))


def resolve_quantization(asked: str | None, model_path: Path) -> str | None:
    """The weight format to serve: ``--quantization`` checked against the checkpoint's own, which wins when
    the flag is absent (as vLLM auto-detects it)."""
    found = checkpoint_quant_method(model_path)
    if found is None:
        if asked == METHOD:
            raise ConfigError(f"--quantization {METHOD}: {model_path} has no compressed-tensors quantization_config "
                              "in its config.json.")  # fmt: skip
        return asked
    if found != METHOD:
        raise ConfigError(f"the checkpoint at {model_path} is quantized with {found!r}; nxdserve serves "
                          f"pre-quantized {METHOD} checkpoints (llm-compressor) and GGUF files, or quantizes a "
                          "dense checkpoint with --quantization int8 / fp8 / int4.")  # fmt: skip
    if asked not in (None, METHOD):
        raise ConfigError(f"--quantization {asked}: the checkpoint at {model_path} is already quantized "
                          f"({METHOD}); drop the flag or pass --quantization {METHOD}.")  # fmt: skip
    return METHOD


@dataclass
class _Module:
    """One quantized HF module's tensors: local name -> (file, full key)."""

    scheme: Any  # compressed_tensors.quantization.QuantizationScheme
    keys: dict[str, tuple[Path, str]] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        for local, (file, key) in self.keys.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                out[local] = f.get_tensor(key)
        return out


class CompressedCheckpoint:
    """A compressed-tensors checkpoint folder: its scheme per module, a dense view for loading and the
    quantized linears."""

    def __init__(self, folder: Path) -> None:
        from compressed_tensors.quantization import QuantizationConfig

        self.folder = Path(folder)
        raw = json.loads((self.folder / "config.json").read_text())["quantization_config"]
        for key in ("sparsity_config", "transform_config"):
            if raw.get(key):
                raise ConfigError(f"{METHOD} checkpoint {self.folder}: {key} is not supported (weights only).")
        if raw.get("kv_cache_scheme"):
            logger.warning("%s: the checkpoint's kv_cache_scheme (KV cache scales) is not used; the KV cache "
                           "follows --kv-cache-dtype", METHOD)  # fmt: skip
        self.config = QuantizationConfig.model_validate(
            {k: v for k, v in raw.items() if k not in ("sparsity_config", "transform_config", "version")}
        )
        if self.config.quantization_status != "compressed":
            raise ConfigError(f"{METHOD} checkpoint {self.folder}: quantization_status is "
                              f"{self.config.quantization_status}, expected compressed.")  # fmt: skip
        self.files = sorted(self.folder.glob("*.safetensors"))
        if not self.files:
            raise ConfigError(f"No .safetensors files in {self.folder}.")
        self.modules: dict[str, _Module] = {}
        self._dense: list[tuple[Path, str]] = []
        self._warned: set[int] = set()  # config groups whose activation quantization was reported
        self._index()

    def scheme_for(self, module: str) -> Any:
        """The config group's scheme whose targets take ``module`` (an HF linear's name), or None."""
        from compressed_tensors.utils.match import match_name

        if any(match_name(module, target) for target in self.config.ignore or []):
            return None
        for scheme in self.config.config_groups.values():
            # class targets: every module here with quantization parameters is a Linear
            if any(target == "Linear" or match_name(module, target) for target in scheme.targets):
                return scheme
        return None

    def _index(self) -> None:
        from safetensors import safe_open

        entries: list[tuple[Path, str]] = []
        for file in self.files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                entries.extend((file, key) for key in f.keys())  # noqa: SIM118 - safe_open is not a mapping
        quantized = {key.removesuffix(".weight_scale") for _, key in entries if key.endswith(".weight_scale")}
        for file, key in entries:
            module, _, local = key.rpartition(".")
            if module in quantized and (local in _QPARAMS or local in ("weight", "weight_packed")):
                if module not in self.modules:
                    scheme = self.scheme_for(module)
                    if scheme is None or scheme.weights is None:
                        raise ConfigError(f"{METHOD}: {module} has quantization parameters but no config group "
                                          "of the checkpoint's quantization_config targets it.")  # fmt: skip
                    self._check_scheme(module, scheme)
                    self.modules[module] = _Module(scheme)
                self.modules[module].keys[local] = (file, key)
            else:
                self._dense.append((file, key))

    def _check_scheme(self, module: str, scheme: Any) -> None:
        fmt = _v(scheme.format or self.config.format)
        if fmt not in _FORMATS:
            raise ConfigError(f"{METHOD}: {module} is stored as {fmt!r}; served formats: {', '.join(_FORMATS)}.")
        w = scheme.weights
        what = f"{METHOD}: {module}'s weights ({w.num_bits}-bit {_v(w.type)}, strategy {_v(w.strategy)})"
        if w.type == "int" and w.num_bits not in (4, 8):
            raise ConfigError(f"{what}: served int widths are 8 (int8) and 4 (4-bit groups).")
        if w.type == "float" and (w.num_bits != 8 or w.strategy not in ("channel", "tensor")):
            raise ConfigError(f"{what}: served float weights are FP8 e4m3 per channel or per tensor "
                              "(not block-wise FP8 or FP4).")  # fmt: skip
        if w.strategy not in ("channel", "group", "tensor"):
            raise ConfigError(f"{what}: served strategies are channel, group and (FP8) tensor.")
        if w.type == "int" and w.strategy == "tensor":
            raise ConfigError(f"{what}: per-tensor int weights are not served; use channel or group.")
        if scheme.input_activations is not None and id(scheme) not in self._warned:
            self._warned.add(id(scheme))
            a = scheme.input_activations
            logger.warning(
                "%s: %s (and the rest of its config group) quantizes activations (%d-bit %s, %s%s); they are not "
                "quantized here: the weights are served weight-only with bf16/fp32 activations (as vLLM does where "
                "the hardware lacks the kernels)",
                METHOD, module, a.num_bits, _v(a.type), _v(a.strategy), ", dynamic" if a.dynamic else ", static",
            )  # fmt: skip

    # -- the dense view (loading) -------------------------------------------------------------------

    def dense_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors as a dense checkpoint holds them: quantized modules decompressed by the library's
        own compressor into ``{module}.weight``. (The model loads this, then ``quantized_linears`` puts the
        codes in place of the dense linears.)"""
        from safetensors import safe_open

        for file in self.files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for owner, key in self._dense:
                    if owner == file:
                        yield key, f.get_tensor(key)
        for name, module in self.modules.items():
            yield f"{name}.weight", self._decompress(module)

    def _decompress(self, module: _Module) -> torch.Tensor:
        from compressed_tensors.compressors import BaseCompressor

        fmt = module.scheme.format or self.config.format
        compressor: Any = BaseCompressor.get_value_from_registry(fmt)
        state = {k: v for k, v in module.tensors().items() if not k.startswith("input_")}
        return compressor.decompress(state, module.scheme)["weight"]

    # -- the quantized linears ------------------------------------------------------------------------

    def quantized_linears(self, num_layers: int) -> dict[str, QuantLinear]:
        """``{"layers.{i}.{attr}" | "lm_head": QuantLinear}`` for every linear the checkpoint holds quantized;
        the parts of a fused weight (q/k/v, gate/up) are joined row-wise and must share one format."""
        parts: dict[str, dict[int, _Codes]] = {}
        out: dict[str, QuantLinear] = {}
        for name, module in self.modules.items():
            codes = self._codes(name, module)
            if name == "lm_head":
                out["lm_head"] = codes.build()
                continue
            pieces = name.split(".")
            local = ".".join(pieces[3:])
            if pieces[:2] != ["model", "layers"] or local not in _PARTS or int(pieces[2]) >= num_layers:
                raise ConfigError(f"{METHOD}: {name} is quantized; served quantized: the decoder layers' "
                                  "q/k/v/o and gate/up/down projections and lm_head.")  # fmt: skip
            attr, position = _PARTS[local]
            parts.setdefault(f"layers.{pieces[2]}.{attr}", {})[position] = codes
        for key, by_position in parts.items():
            wanted = 3 if key.endswith("qkv_weight") else 2 if key.endswith("gate_up_weight") else 1
            if len(by_position) != wanted:
                raise ConfigError(f"{METHOD}: {key} fuses {wanted} projections and only {len(by_position)} "
                                  "of them are quantized; quantize all of them or none.")  # fmt: skip
            out[key] = _Codes.join([by_position[i] for i in sorted(by_position)], key).build()
        return out

    def _codes(self, name: str, module: _Module) -> _Codes:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        w = module.scheme.weights
        t = module.tensors()
        scale = t["weight_scale"].float()
        if "weight_packed" in t:
            shape = torch.Size(t["weight_shape"].tolist())
            q = unpack_from_int32(t["weight_packed"], w.num_bits, shape).to(torch.int32)
        else:
            q = t["weight"]
        n, k = q.shape
        if "weight_g_idx" in t:
            group = w.group_size
            if not torch.equal(t["weight_g_idx"].long(), torch.arange(k) // group):
                raise ConfigError(f"{METHOD}: {name} has activation-ordered groups (actorder, weight_g_idx); "
                                  "served: groups in column order.")  # fmt: skip
        if w.type == "float":  # fp8: a tensor scale is the same scale on every row
            return _Codes("fp8", q, scale.reshape(-1).expand(n).contiguous(), None, 0)
        zp = t.get("weight_zero_point")
        if zp is not None and not w.symmetric:
            if w.strategy in ("group", "channel"):  # packed along dim 0 by the compressor
                zp = unpack_from_int32(zp, w.num_bits, torch.Size((n, scale.shape[-1])), packed_dim=0)
            zp = zp.float().reshape(scale.shape)
        else:
            zp = None
        group = k if w.strategy == "channel" else int(w.group_size)
        if w.num_bits == 8:
            if zp is not None and bool(zp.ne(0).any()):
                raise ConfigError(f"{METHOD}: {name} is asymmetric 8-bit (zero points); served: symmetric int8.")
            if w.strategy == "channel":
                return _Codes("int8", q.to(torch.int8), scale.reshape(n), None, 0)
            return _Codes("q8_0", q.to(torch.int8), scale, None, group)
        return _Codes("int4", q, scale.reshape(n, -1), zp, group)


@dataclass
class _Codes:
    """A module's codes before they become a ``QuantLinear`` (4-bit ones are packed only once fused)."""

    kind: str
    q: torch.Tensor  # (N, K): int8 codes, signed int4 codes (-8..7) or float8_e4m3fn
    scale: torch.Tensor  # (N,) per row; (N, K/group) per group
    zero_point: torch.Tensor | None  # int4: (N, K/group), float
    group: int

    @staticmethod
    def join(parts: list[_Codes], key: str) -> _Codes:
        first = parts[0]
        if len(parts) == 1:
            return first
        if any((p.kind, p.group, p.q.shape[1]) != (first.kind, first.group, first.q.shape[1]) for p in parts):
            raise ConfigError(f"{METHOD}: the projections fused into {key} differ in format; they must share "
                              "one scheme.")  # fmt: skip
        zero_points = [p.zero_point for p in parts]
        zp = None
        if any(z is not None for z in zero_points):
            zp = torch.cat([torch.zeros_like(p.scale) if z is None else z
                            for z, p in zip(zero_points, parts, strict=True)])  # fmt: skip
        return _Codes(first.kind, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), zp,
                      first.group)  # fmt: skip

    def build(self) -> QuantLinear:
        n, k = self.q.shape
        if self.kind in ("int8", "fp8"):
            return QuantLinear(self.kind, n, k, self.q.contiguous(), self.scale.contiguous())
        if self.kind == "q8_0":
            if k % self.group:
                raise ConfigError(f"{METHOD}: 8-bit groups of {self.group} do not divide {k} input columns.")
            return QuantLinear("q8_0", n, k, self.q.contiguous(), self.scale.contiguous(), self.group, k)
        return self._int4()

    def _int4(self) -> QuantLinear:
        k = self.q.shape[1]
        # Our groups must each sit inside one of the checkpoint's: a size dividing theirs (a whole row: any).
        ours = next((g for g in sorted(INT4_GROUPS, reverse=True) if self.group >= k or self.group % g == 0), None)
        if ours is None:
            served = ", ".join(map(str, INT4_GROUPS))
            raise ConfigError(f"{METHOD}: 4-bit groups of {self.group} have no exact layout here (served: groups "
                              f"of {served} or multiples of them, or per channel).")  # fmt: skip
        padded = -(-k // ours) * ours
        theirs = torch.arange(0, padded, ours).clamp_max(k - 1) // self.group  # their group of each of ours
        scale = self.scale[:, theirs]
        zp = torch.zeros_like(scale) if self.zero_point is None else self.zero_point[:, theirs]
        codes = F.pad(self.q.to(torch.int32) + 8, (0, padded - k))  # beyond K: zero codes meet zero activations
        return int4_from_codes(codes, scale, -(zp + 8.0) * scale, ours, k)
