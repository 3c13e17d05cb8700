"""`sparkrl quantize SRC DST --scheme nvfp4`: a Hugging Face checkpoint -> its weight-only NVFP4 twin.

The format and the math are trainer/nvfp4.py's (compressed-tensors "nvfp4-pack-quantized", group 16, the
model-free shard-by-shard pathway): every 2D Linear weight is quantized; the routers (`mlp.gate`), norms,
embeddings and lm_head stay in their original precision. Per model family, a few more Linear layers stay
unquantized (its `quantize_ignore`, rl/models/<family>/), named in the checkpoint's `ignore` list so vLLM
builds them unquantized too.

`sparkrl make-random ARCH --out DIR`: a checkpoint of the same format with random weights, drawn in NVFP4
directly (FP4 codes and scales, never a weight in a wider dtype), shard by shard: the benchmark models at
real sizes (Qwen3-30B-A3B, a Muse Spark Open slice at full width) without a BF16 copy in memory or on disk.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SCHEMES = ("nvfp4",)


def quantizer_for(src: str | os.PathLike):
    """The NVFP4 converter of checkpoint `src`: the default ignore list plus its family's."""
    from rl.models import registry
    from trainer.nvfp4 import _NVFP4Quantizer

    family = registry.family(json.loads((Path(src) / "config.json").read_text()).get("model_type") or "")
    return _NVFP4Quantizer(src, list(family.quantize_ignore) if family else [])


# What a hub checkpoint's snapshot needs for quantizing: weights, configs, tokenizer, chat template, custom code.
HUB_FILES = ["*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]


def model_dir(src: str | os.PathLike) -> Path:
    """`src` as a local model directory: the directory itself, or, for a Hugging Face hub id (`owner/name`), its
    snapshot in the local Hugging Face cache, fetched first where the cache lacks files (HF_HUB_OFFLINE=1:
    the cache alone)."""
    from rl.preflight import _looks_local, hub_cache_dir, hub_offline

    path = Path(src).expanduser()
    if path.exists() or _looks_local(str(src)) or str(src).count("/") != 1:
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = hub_offline()
    if not offline:
        print(f"quantize: fetching {src} from the Hugging Face hub into {hub_cache_dir()}", flush=True)
    where = (
        "in the local Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else "on the Hugging Face hub"
    )
    try:
        snapshot = Path(
            snapshot_download(
                str(src), allow_patterns=HUB_FILES, cache_dir=hub_cache_dir(), local_files_only=offline
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise FileNotFoundError(
            f"{src} is neither a local model directory nor a model found {where}: {str(e).splitlines()[0]}"
        ) from None
    if not any(snapshot.glob("*.safetensors")):  # e.g. a cache holding config.json alone, offline
        raise FileNotFoundError(f"{src}: no *.safetensors weights {where} ({snapshot})")
    return snapshot


def quantize(src: str | os.PathLike, dst: str | os.PathLike, scheme: str = "nvfp4") -> Path:
    """Writes the quantized checkpoint (config, tokenizer and all other files copied) to `dst`; `src`: a
    model directory or a Hugging Face hub id (`model_dir`)."""
    from trainer.nvfp4 import _convert_atomically

    if scheme not in SCHEMES:
        raise ValueError(f"quantize: --scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if Path(dst).exists():  # before a download of the source
        raise FileExistsError(f"{dst} exists; not overwriting it")
    return _convert_atomically(model_dir(src), dst, quantizer_for)


def quantized_copy(src: str | os.PathLike, scheme: str = "nvfp4") -> Path:
    """The quantized copy of the model directory `src`, made once beside it (`<src>-<scheme>`) and reused:
    make-tiny's models for the GPU demo (`model.make_tiny.quantize`, `make-tiny --quantize`)."""
    from rl.tiny import build_lock

    src = Path(src)
    dst = src.with_name(f"{src.name}-{scheme}")
    if not (dst / "config.json").exists():
        with build_lock(dst):  # one writer; a second process waits and finds it made
            if not (dst / "config.json").exists():
                quantize(src, dst, scheme)
    return dst


def _run(args: argparse.Namespace) -> int:
    path = quantize(args.src, args.dst, scheme=args.scheme)
    print(f"quantize: {args.src} -> {path} ({args.scheme}, weight-only)")
    return 0


def register(subparsers) -> None:
    """Adds `quantize SRC DST --scheme nvfp4` and `make-random ARCH --out DIR` to the `sparkrl` command's
    subparsers."""
    p = subparsers.add_parser(
        "quantize", help="write a weight-only NVFP4 (compressed-tensors) copy of a checkpoint"
    )
    p.add_argument("src", help="a model directory, or a Hugging Face hub id (fetched into the local cache)")
    p.add_argument("dst", help="directory to write the quantized model to (must not exist)")
    p.add_argument("--scheme", choices=SCHEMES, default="nvfp4")
    p.set_defaults(func=_run)

    p = subparsers.add_parser(
        "make-random",
        help="write a random-weight NVFP4 checkpoint of an architecture, in NVFP4 directly (no BF16 copy)",
    )
    p.add_argument(
        "arch", metavar="ARCH", help=f"{' or '.join(PRESETS)}, or a config.json (or its directory)"
    )
    p.add_argument("--out", required=True, help="directory to write the checkpoint to (must not exist)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the architecture's)")
    p.add_argument(
        "--vocab-size", type=int, default=None, help="vocabulary size (default: the architecture's)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device", default=None, help="where the codes are drawn (default: cuda if present, else cpu)"
    )
    p.add_argument(
        "--config-only",
        action="store_true",
        help="write everything but the tensors: what `sparkrl plan` needs to size a recipe on it",
    )
    p.set_defaults(func=_run_make_random)


# ----------------------------------------------------------------------------------------------------
# `sparkrl make-random ARCH --out DIR`: a random-weight checkpoint written in NVFP4 directly
# ----------------------------------------------------------------------------------------------------

PRESETS = ("qwen3_30b_a3b", "muse_full_width")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 magnitudes by code (bits 0-2); bit 3 is the sign
CLIP_SIGMAS = 3.0  # a Gaussian weight's 3-sigma point lands on the largest FP4 magnitude
BLOCK_SCALE = 256.0  # every block's FP8 scale: a power of two inside E4M3's range, as real block scales are
MAX_SHARD_BYTES = 2 * 2**30


def preset_config(name: str, layers: int | None = None, vocab_size: int | None = None):
    """The transformers config of a preset, or of a config.json (a file or a model directory) for any other
    `name`. `qwen3_30b_a3b`: Qwen/Qwen3-30B-A3B's config.json; `muse_full_width`: Muse Spark Open's decoder
    layer at full width (rl/models/muse: hidden 8192, 96 query and 8 KV heads of 128, 256 experts of 4096 at
    latent 4096), 4 layers unless `layers` says. `layers` and `vocab_size` replace the config's."""
    from rl.models import auto_config, register_auto_classes

    register_auto_classes()
    if name == "qwen3_30b_a3b":
        from transformers import Qwen3MoeConfig

        from rl.models.qwen3_moe import QWEN3_30B_A3B

        config = Qwen3MoeConfig(
            **{k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"},
            hidden_act="silu",
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            norm_topk_prob=True,
            attention_bias=False,
            initializer_range=0.02,
            router_aux_loss_coef=0.001,
            max_window_layers=48,
        )
    elif name == "muse_full_width":
        from rl.models.muse import MuseSparkConfig

        config = MuseSparkConfig(num_hidden_layers=layers or 4)
    elif (Path(name) / "config.json").is_file() or Path(name).name == "config.json":
        config = auto_config(str(Path(name).parent if Path(name).name == "config.json" else name))
    else:
        raise ValueError(
            f"make-random: ARCH must be one of {', '.join(PRESETS)} or a config.json (or the directory "
            f"holding one), got {name!r}"
        )
    if layers and layers != config.num_hidden_layers:
        config.num_hidden_layers = layers
        if getattr(
            config, "attention_cycle", None
        ):  # Muse: the sliding/full cycle, anchored at the last layer
            from rl.models.muse import muse_layer_types

            config.layer_types = muse_layer_types(layers, config.attention_cycle)
        if getattr(config, "max_window_layers", None) is not None:
            config.max_window_layers = layers
    if vocab_size:
        config.vocab_size = vocab_size
    config.dtype = getattr(config, "dtype", None) or "bfloat16"  # a config.json's own, else BF16
    return config


def fp4_code_probs(clip_sigmas: float = CLIP_SIGMAS) -> list[float]:
    """P(code) of the 16 FP4 codes when a Gaussian weight is rounded to the nearest E2M1 value at a block
    scale that puts `clip_sigmas` on 6 (the largest magnitude); -0 (code 8) is never drawn."""
    from statistics import NormalDist

    cdf, k = NormalDist().cdf, 6.0 / clip_sigmas  # k: E2M1 units a sigma
    edges = [0.0, *((a + b) / 2 for a, b in zip(E2M1, E2M1[1:])), float("inf")]
    half = [cdf(hi / k) - cdf(lo / k) for lo, hi in zip(edges, edges[1:])]  # P(lo <= x < hi), x >= 0
    return [2 * half[0], *half[1:], 0.0, *half[1:]]  # +0 takes both sides' zeros


@functools.cache
def packed_byte_table() -> tuple[torch.Tensor, float]:
    """(table, std): 65,536 packed bytes; an entry drawn uniformly holds two codes drawn independently
    from fp4_code_probs (each quantized to 256ths). std: one code's standard deviation in E2M1 units."""
    import torch

    p = fp4_code_probs()
    p = [x / sum(p) for x in p]
    counts = [int(x * 256) for x in p]
    for c in sorted(range(16), key=lambda c: p[c] * 256 - counts[c], reverse=True)[: 256 - sum(counts)]:
        counts[c] += 1  # largest remainders: 256 slots in all
    codes = torch.repeat_interleave(torch.arange(16, dtype=torch.int32), torch.tensor(counts))
    table = (codes[:, None] | (codes[None, :] << 4)).reshape(-1).to(torch.uint8)  # [low, high] -> byte
    std = (sum(n * E2M1[c % 8] ** 2 for c, n in enumerate(counts)) / 256) ** 0.5
    return table, std


def _tensor_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**62


def random_nvfp4(shape, std: float, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """The NVFP4 triple of a random Linear weight [out, in] whose dequantization (FP4 value x block scale /
    global scale, the compressed-tensors convention) has standard deviation `std` and the code frequencies
    of a quantized Gaussian: `weight_packed` uint8 [out, in / 2], `weight_scale` float8_e4m3fn [out, in / 16],
    `weight_global_scale` float32 [1]. No weight in a wider dtype is made."""
    import torch

    from trainer.nvfp4 import GROUP_SIZE

    rows, cols = shape
    table, code_std = packed_byte_table()
    g = torch.Generator(device=device).manual_seed(seed)
    draws = torch.randint(0, 65536, (rows * cols // 2,), generator=g, device=device, dtype=torch.int32)
    packed = table.to(device).index_select(0, draws).view(rows, cols // 2)
    del draws
    scale_byte = torch.tensor([BLOCK_SCALE]).to(torch.float8_e4m3fn).view(torch.uint8).item()
    scale = torch.full((rows, cols // GROUP_SIZE), scale_byte, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return {
        "weight_packed": packed.cpu(),
        "weight_scale": scale.cpu(),
        "weight_global_scale": torch.tensor([code_std * BLOCK_SCALE / std], dtype=torch.float32),
    }


def random_plain(name: str, shape, std: float, seed: int, dtype, device="cpu") -> torch.Tensor:
    """A weight the checkpoint keeps unquantized: norms ones (their init), the rest N(0, std)."""
    import torch

    if name.rpartition(".")[0].endswith("norm"):
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device).mul_(std).to(dtype).cpu()


def checkpoint_layout(config) -> dict[str, torch.Tensor]:
    """Every tensor name of `config`'s checkpoint as save_pretrained writes it (experts per expert), with a
    meta tensor of its shape and dtype (config.dtype, else BF16): the model is built on the meta device, no
    memory spent. Sets `config.architectures` to the model's class."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    from rl.models import register_auto_classes

    register_auto_classes()
    with torch.device("meta"):
        dtype = (
            config.dtype
            if isinstance(config.dtype, torch.dtype)
            else getattr(torch, config.dtype or "bfloat16")
        )
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # The class save_pretrained names in config.json: vLLM picks its model (and that it generates) by it
    config.architectures = [type(model).__name__]
    return dict(revert_weight_conversion(model, model.state_dict()))


def padded_tokenizer(vocab_size: int, seed: int = 0):
    """make-tiny's tokenizer (rl.tiny: a byte-level BPE trained here, offline) with filler tokens
    `<|filler_N|>` up to `vocab_size`, so that every id a model of that vocabulary samples decodes."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from rl.tiny import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, train_tokenizer

    tok = train_tokenizer(seed)
    data = json.loads(tok.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    used = max([*vocab.values(), *(t["id"] for t in data["added_tokens"])]) + 1
    if vocab_size < used:
        raise ValueError(f"make-random: --vocab-size {vocab_size} is below the tokenizer's {used} tokens")
    vocab.update({f"<|filler_{i}|>": i for i in range(used, vocab_size)})
    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)),
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=tok.model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_random(
    arch: str,
    out: str | os.PathLike,
    layers: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    device: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    report=print,
    config_only: bool = False,
) -> Path:
    """Writes a random-weight NVFP4 checkpoint of `arch` (preset_config) to `out`: config.json with the
    quantization_config `sparkrl quantize` writes, the same tensor names, dtypes and shapes, safetensors
    shards of at most about `max_shard_bytes` and their index, generation_config.json and a tokenizer
    (padded_tokenizer). Each quantized weight's triple is drawn directly (random_nvfp4), so peak host
    memory is one shard, not the model. Deterministic for (arch, sizes, seed, device). `config_only`: all
    but the tensors, what `sparkrl plan` reads to size a recipe on the checkpoint before it is written."""
    import torch
    from compressed_tensors.entrypoints.convert.convert_file import write_checkpoint_quantization_config
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from rl.models import registry
    from trainer.nvfp4 import _NVFP4Quantizer

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; not overwriting it")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = preset_config(arch, layers, vocab_size)
    tokenizer = padded_tokenizer(config.vocab_size, seed)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    layout = checkpoint_layout(config)
    family = registry.family(config.model_type)
    quantizer = _NVFP4Quantizer(None, list(family.quantize_ignore) if family else [], names=layout)
    quantizer.validate(layout)
    std = float(getattr(config, "initializer_range", 0.02))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        shards: list[list[str]] = []
        buffer: dict[str, torch.Tensor] = {}
        size = total = 0
        start = time.perf_counter()

        def flush():
            nonlocal buffer, size
            if buffer:
                save_file(buffer, tmp / f"part-{len(shards):05d}.safetensors")
                shards.append(list(buffer))
                buffer, size = {}, 0

        for name, meta in {} if config_only else layout.items():
            module = name.rpartition(".")[0]
            seed_n = _tensor_seed(seed, name)
            if quantizer.targeted(name, meta):
                made = {f"{module}.{k}": v for k, v in random_nvfp4(meta.shape, std, seed_n, device).items()}
            else:
                made = {name: random_plain(name, meta.shape, std, seed_n, meta.dtype, device)}
            for k, v in made.items():
                buffer[k] = v.contiguous()
                size += v.nbytes
            total += sum(v.nbytes for v in made.values())
            if size >= max_shard_bytes:
                flush()
                report(f"make-random: {total / 2**30:.1f} GiB in {time.perf_counter() - start:.0f} s")
        flush()
        weight_map = {}
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.rename(tmp / f"part-{i:05d}.safetensors", tmp / file)
            weight_map.update(dict.fromkeys(names, file))
        if not config_only:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config.save_pretrained(tmp)
        write_checkpoint_quantization_config(tmp, quantizer)
        GenerationConfig(
            eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
        ).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "random_weights.json").write_text(
            json.dumps(
                {
                    "arch": arch,
                    "layers": config.num_hidden_layers,
                    "vocab_size": config.vocab_size,
                    "seed": seed,
                    "device": device,
                    "std": std,
                    "written_by": "sparkrl make-random",
                    "config_only": config_only,
                },
                indent=2,
            )
            + "\n"
        )
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not config_only:
        report(f"make-random: {total / 2**30:.2f} GiB of tensors in {time.perf_counter() - start:.0f} s")
    return out


def _run_make_random(args: argparse.Namespace) -> int:
    path = make_random(
        args.arch,
        args.out,
        layers=args.layers,
        vocab_size=args.vocab_size,
        seed=args.seed,
        device=args.device,
        config_only=args.config_only,
    )
    what = (
        "config, no tensors (for sparkrl plan)"
        if args.config_only
        else "NVFP4 checkpoint with random weights"
    )
    print(f"make-random: {args.arch} {what} at {path}")
    return 0
