"""`sparkrl make-tiny`: small Hugging Face models for tests and the CPU demo, built with no hub access.

Each model gets a byte-level BPE tokenizer trained here on text from the synthetic arithmetic source
(digits split one per token, as Qwen's tokenizer does, so arithmetic stays learnable; being byte-level, it
encodes any other text too, tool calls and their JSON included, only in more tokens), a chat template,
and random weights drawn from a seed. Everything is deterministic for (arch, seed, sft): the result is
cached under `<cache>/tiny/<key>` where key hashes those arguments and the source of the builder, and
`--out` receives a copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from rl.core.paths import cache_dir
from rl.data.arith import ArithSpec, make_rows, sft_response
from rl.models import register_auto_classes, registry

# One a model family that has a tiny model (its `tiny` in rl/models/<family>/: config class and sizes).
ARCHES = registry.TINY_ARCHES
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
EOS_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"
# One turn per message; the assistant turn is opened by add_generation_prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}"
)
VOCAB_SIZE = 1024
# The supervised warm-ups: `arith` (rl.tiny_sft) from random weights; `arith_tool` (rl.tiny_tool_sft)
# continues from the `arith` model's weights, a short extra fine-tune on calculator tool-call transcripts.
SFT_MODES = ("arith", "arith_tool")


def model_config(arch: str, vocab_size: int, eos_id: int, pad_id: int):
    """The transformers config of a tiny `arch`: the sizes every tiny model shares, and its family's own
    (sizes chosen so vLLM's CPU kernels accept them)."""
    family = registry.tiny_family(arch)
    if family is None:
        raise ValueError(f"make-tiny: --arch must be one of {', '.join(ARCHES)}, got {arch!r}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        initializer_range=0.05,
    )
    return family.tiny.build_config(common)


def tokenizer_corpus(seed: int, n: int = 4000) -> list[str]:
    """Text the tokenizer is trained on: chat-formatted arithmetic problems and their answers."""
    rng = random.Random(seed)
    texts = []
    for spec in (ArithSpec(), ArithSpec(num_terms=3, max_operand=99, ops="+-*")):
        for row in make_rows(n // 2, seed, spec, split="tokenizer"):
            texts.append(row["prompt"][0]["content"] + "\n" + sft_response(row, rng))
    return texts


def train_tokenizer(seed: int, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer (any UTF-8 text encodes) trained on `tokenizer_corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, model_max_length=1024
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(arch: str, seed: int):
    """(model, tokenizer) with random weights drawn from `seed`; the vocab is padded to a multiple of 64."""
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer(seed)
    config = model_config(
        arch,
        -(-len(tokenizer) // 64) * 64,
        tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model, tokenizer


def cache_key(arch: str, seed: int, sft: str | None) -> str:
    """Hash of the arguments and of the code that builds the model: a code change invalidates the cache."""
    import transformers

    from rl import tiny_sft

    h = hashlib.sha256()
    h.update(json.dumps([arch, seed, sft, transformers.__version__, torch.__version__]).encode())
    for module in (__file__, tiny_sft.__file__, make_rows.__code__.co_filename, *_family_sources(arch)):
        h.update(Path(module).read_bytes())
    if sft == "arith_tool":
        # Only this mode hashes the tool warm-up's code (the `arith` model's key, and so its cache entry,
        # does not move when it changes); the base model it continues from is named by its own key.
        from rl import tiny_tool_sft

        h.update(cache_key(arch, seed, "arith").encode())
        for module in tiny_tool_sft.sources():
            h.update(Path(module).read_bytes())
    return h.hexdigest()[:16]


def _family_sources(arch: str) -> list[Path]:
    """The family's files that make-tiny builds from: its folder's Python files (the arguments, and the
    model's code where transformers lacks it), not its vLLM model."""
    family = registry.tiny_family(arch)
    if family is None:
        return []
    root = registry.MODELS_DIR.parents[1]
    vllm = {root / (t.partition(":")[0].replace(".", "/") + ".py") for t in family.vllm_models.values()}
    return [f for f in sorted(registry.family_dir(family).glob("*.py")) if f not in vllm]


def make_tiny(
    arch: str,
    out: str | Path | None = None,
    seed: int = 0,
    sft: str | None = None,
    quantize: str | None = None,
) -> Path:
    """Build (or take from the cache) a tiny model; copy it to `out` when given. Returns the model dir.

    `sft="arith"` fine-tunes it on noisy arithmetic (rl.tiny_sft) so that its sampled accuracy on
    held-out problems lands between 0.3 and 0.6: the starting point of the CPU demo. `sft="arith_tool"`
    fine-tunes that model further on noisy calculator tool-call transcripts (rl.tiny_tool_sft): the starting
    point of the tool-use demo (docs/environments.md). The families' classes
    are registered with transformers' Auto classes, so the directory loads in this process.
    """
    if arch not in ARCHES:
        raise ValueError(f"make-tiny: --arch must be one of {', '.join(ARCHES)}, got {arch!r}")
    register_auto_classes()
    if sft is not None and sft not in SFT_MODES:
        raise ValueError(f"make-tiny: --sft must be one of {', '.join(SFT_MODES)} or absent, got {sft!r}")
    cached = cache_dir() / "tiny" / f"{arch}-s{seed}{'-' + sft if sft else ''}-{cache_key(arch, seed, sft)}"
    if not (cached / "config.json").exists():
        with build_lock(cached):
            # Another process (a parallel test worker, a second run) may have built it while this one waited.
            if not (cached / "config.json").exists():
                _build_into(cached, arch, seed, sft)
    return cached if out is None else copy_model(cached, out)


@contextlib.contextmanager
def build_lock(target: Path):
    """One builder of `target` at a time on this machine: a second waits, then finds the model built
    (the SFT'd MoE takes minutes of both cores; building it twice at once doubles them)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_into(target: Path, arch: str, seed: int, sft: str | None) -> None:
    report = None
    if sft == "arith_tool":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rl import tiny_tool_sft

        base = make_tiny(arch, seed=seed, sft="arith")
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(base)
        report = tiny_tool_sft.train(model, tokenizer, seed=seed)
    else:
        model, tokenizer = build(arch, seed)
    if sft == "arith":
        from rl import tiny_sft

        report = tiny_sft.train(model, tokenizer, seed=seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if report is not None:
            (tmp / "sft_report.json").write_text(json.dumps(report, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # A concurrent builder may have finished first: both built the same bytes, keep theirs.
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def copy_model(src: Path, dst: str | Path) -> Path:
    """Copies the model directory `src` to `dst` (absent, or an empty directory) through a temporary sibling
    and a rename; returns `dst`. Anything already at `dst`, a model included, is the user's: never replaced."""
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(
            f"make-tiny: --out {dst} exists; not overwriting it (remove it or choose another)"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=dst.parent))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        if dst.exists():
            dst.rmdir()  # empty (checked above)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
