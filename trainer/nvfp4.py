"""NVFP4 (compressed-tensors "nvfp4-pack-quantized", weight-only, group 16) checkpoints, both ways.

Both directions run compressed-tensors' model-free pathway (`convert_checkpoint`): one safetensors shard
at a time, so peak host memory stays near one shard. The quantization math is compressed-tensors' own
(`generate_gparam`, `calculate_qparams`, `NVFP4PackedCompressor`), as llm-compressor uses it; the
dequantization is its `CompressedTensorsDequantizer`. Per quantized module on disk: `weight_packed` uint8
[out, in / 2], `weight_scale` float8_e4m3fn [out, in / 16], `weight_global_scale` float32 [1];
dequantized weight = fp4 value * float(weight_scale) / weight_global_scale.

Projections that vLLM fuses into one weight (q/k/v into `qkv_proj`, gate/up into `gate_up_proj` and the
experts' `w13`) are quantized with one global scale per fused group, as llm-compressor does: vLLM keeps a
single global scale per fused weight, so per-projection scales would dequantize all but one projection of
the group with the wrong scale (seen on the H200 as a 0.06 log-prob gap through NVFP4 expert LoRA).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

FORMAT = "nvfp4-pack-quantized"
GROUP_SIZE = 16
# Routers stay in high precision (vLLM's NVFP4 MoE checkpoints do the same); embeddings are not Linear.
IGNORE = ["lm_head", "re:.*mlp.gate$"]
_SKIP_MODULES = ("embed_tokens", "lm_head")
# Sibling projections that vLLM loads into one fused weight with one global scale.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_siblings(weight_name: str, weight_names) -> list[str]:
    """The other weights of weight_name's fused group that are present in weight_names (itself first)."""
    module, _, param = weight_name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    for group in FUSED_GROUPS:
        if leaf in group:
            present = [f"{parent}.{p}.{param}" for p in group]
            return [n for n in present if n == weight_name or n in weight_names]
    return [weight_name]


def nvfp4_scheme():
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    return QuantizationScheme(targets=["Linear"], format=CompressionFormat(FORMAT), **NVFP4A16)


def is_nvfp4_checkpoint(path: str | os.PathLike) -> bool:
    config = Path(path) / "config.json"
    if not config.exists():
        return False
    q = json.loads(config.read_text()).get("quantization_config") or {}
    return q.get("quant_method") == "compressed-tensors" and q.get("format") == FORMAT


class _NVFP4Quantizer:
    """compressed-tensors `Converter`: every 2D Linear `weight` (not ignored) -> the NVFP4 triple.

    `src`: the checkpoint it converts (every weight name is needed up front: a fused group may span
    shards); `extra_ignore`: compressed-tensors patterns kept unquantized on top of IGNORE, and listed in
    the written config so that vLLM builds those layers unquantized too; `names`: the weight names, in place
    of reading them from `src` (a checkpoint written without a source, rl.quantize's make-random)."""

    def __init__(self, src: str | os.PathLike | None, extra_ignore=(), names=None):
        from compressed_tensors.utils.match import match_name
        from compressed_tensors.utils.safetensors_load import get_checkpoint_files, get_weight_map

        self.scheme = nvfp4_scheme()
        self._match = match_name
        self.ignore = [*IGNORE, *extra_ignore]
        if names is None:
            names = get_weight_map(get_checkpoint_files(str(src)))
        self._names = frozenset(names)

    def targeted(self, name: str, t: torch.Tensor) -> bool:
        """Whether weight `name` (a tensor, or a meta tensor of its shape) is stored as the NVFP4 triple."""
        return self._targeted(name, t)

    def _targeted(self, name: str, t: torch.Tensor) -> bool:
        module, _, param = name.rpartition(".")
        return (
            param == "weight"
            and t.dim() == 2
            and t.is_floating_point()
            and not module.endswith("norm")
            and not module.endswith(_SKIP_MODULES)
            and not any(self._match(module, ign) for ign in self.ignore)
        )

    def validate(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if self._targeted(name, t) and t.shape[1] % GROUP_SIZE:
                raise ValueError(
                    f"NVFP4: {name} has {t.shape[1]} input features, not a multiple of {GROUP_SIZE}"
                )

    def process(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from compressed_tensors.compressors import NVFP4PackedCompressor
        from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

        # One global scale per fused group (get_dependencies put the whole group in this batch), from the
        # group's overall range, so that every member dequantizes right with vLLM's single scale.
        global_scales: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if self._targeted(name, t) and name not in global_scales:
                group = fused_siblings(name, tensors)
                lo = torch.stack([tensors[n].float().min() for n in group]).min()
                hi = torch.stack([tensors[n].float().max() for n in group]).max()
                shared = generate_gparam(lo, hi)
                global_scales.update(dict.fromkeys(group, shared))

        out = {}
        args = self.scheme.weights
        for name, t in tensors.items():
            if not self._targeted(name, t):
                out[name] = t
                continue
            module = name.rpartition(".")[0]
            w = t.float()
            global_scale = global_scales[name].clone()  # safetensors refuses tensors that share memory
            groups = w.reshape(w.shape[0], -1, GROUP_SIZE)
            scale, zero_point = calculate_qparams(
                groups.amin(-1), groups.amax(-1), args, global_scale=global_scale
            )
            packed = NVFP4PackedCompressor.compress(
                {
                    "weight": w,
                    "weight_scale": scale,
                    "weight_global_scale": global_scale,
                    "weight_zero_point": zero_point,
                },
                self.scheme,
            )
            for k, v in packed.items():
                out[f"{module}.{k}"] = v.contiguous()
        return out

    def create_config(self):
        from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

        return QuantizationConfig(
            config_groups={"group_0": self.scheme},
            format=FORMAT,
            quantization_status=QuantizationStatus.COMPRESSED,
            ignore=list(self.ignore),
        )

    def get_dependencies(self, weight_name: str) -> set[str]:
        # The group's first present member carries the others (they may sit in other shards); the others
        # declare nothing, so compressed-tensors processes each group exactly once.
        group = fused_siblings(weight_name, self._names)
        return set(group[1:]) if group[0] == weight_name else set()


def _convert_atomically(src: str | os.PathLike, dst: str | os.PathLike, make_converter) -> Path:
    """Runs compressed-tensors' shard-by-shard conversion (`make_converter(src)`) into a temporary sibling
    of dst, then renames."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"{src} is not a model directory (no config.json)")
    if dst.exists():
        raise FileExistsError(f"{dst} exists; not overwriting it")
    converter = make_converter(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=dst.parent))
    try:
        convert_checkpoint(src, tmp, converter)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def quantize_nvfp4(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """A Hugging Face checkpoint -> its NVFP4 weight-only twin at dst (vLLM loads it)."""
    return _convert_atomically(src, dst, _NVFP4Quantizer)


def dequantize_nvfp4(
    src: str | os.PathLike, dst: str | os.PathLike, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """An NVFP4 compressed-tensors checkpoint -> a plain Hugging Face checkpoint in `dtype` at dst."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    if not is_nvfp4_checkpoint(src):
        raise ValueError(
            f"{src}: config.json has no compressed-tensors quantization_config of format {FORMAT!r}"
        )
    return _convert_atomically(src, dst, lambda path: CompressedTensorsDequantizer(path, dtype=dtype))
