"""`sparkrl plan RECIPE [key=value ...]`: memory per GPU for the rollout engines and the trainer, before
anything is submitted; whether it fits, and what to change when it does not; then the step's time by phase
(rl/plan_time.py, `time_block`).

    cfg = load_config("recipes/qwen3_30b_a3b_dapo_lora.yaml")
    p = make_plan(cfg)                 # Plan: every figure in bytes, with the model facts it used
    print(format_plan(p))

Model facts come from a local `config.json` (model.path, else model.rollout_path, else the Hugging Face
cache), from `make-tiny`'s own config, or from the built-in facts of the model families
(rl/models/<family>/, `planner`: Muse Spark Open, Qwen3-30B-A3B).

The model (figures per GPU; GiB = 2**30 bytes):
- Rollout (one vLLM engine over rollout.tensor_parallel_size GPUs): weights in their stored format
  (NVFP4 = 0.5 byte a parameter + one FP8 scale per 16, routers/embeddings/output in BF16), divided over
  TP; one LoRA slot at vLLM's rank (lora.rank rounded up to vLLM's sizes) in the model dtype, A whole and
  B split for column-parallel layers (q/k/v, gate/up, pooler), A split and B whole for row-parallel ones
  (o, down, unpooler); activations of a 16,384-token batch; 1 GiB runtime (+1 GiB of CUDA graphs). The
  KV cache gets what is left of gpu_memory_utilization x GPU: 2 x KV heads on the GPU x head_dim x dtype
  bytes a token a layer, with sliding-window layers holding min(context, window) tokens.
- Trainer (FSDP2 over trainer.num_ranks): the frozen base sharded over the ranks, as trainer.base_format
  holds it: bf16, every weight in model.dtype; nvfp4, what the checkpoint stores in NVFP4 (the Linear
  layers: ~4.5 bits a weight) kept packed and the rest (router, norms, embeddings) in model.dtype. LoRA
  parameters, gradients and AdamW moments in float32, sharded (experts as the trainer holds them:
  gate_up fused, one A for both). Gathered: two decoder layers at once (the one computing and the next,
  prefetched) plus the embeddings and output; with the nvfp4 base the two layers arrive packed and the
  computing one is dequantized into a model.dtype buffer of its own, its largest weight's scales beside it in
  BF16 and FP32 while it dequantizes (one rank gathers nothing, but FSDP2 copies the computing layer's packed
  bytes all the same). Activations of one micro-batch (each
  layer's input kept under activation checkpointing; with trainer.activation_memory_budget B on compiled GPU
  layers, the compiled graphs' inputs plus B of the rest that no checkpointing would keep; one layer's
  working set; the LM head's logits of one trainer.logits_chunk_tokens chunk in model.dtype plus their fp32
  copy and log-softmax, recomputed in backward, and with rollout.top_p < 1 the nucleus' sort); 1 GiB
  runtime.
- Placement (rl.placement, the same rules the run reserves its GPUs by): split, each engine on TP GPUs of
  its own; colocated, each GPU holds one trainer rank and one TP rank of an engine, the TP ranks of an
  engine on one node. The trainer's sharded state stays resident while vLLM runs within its fraction of
  the GPU; vLLM sleeps (weights to host, KV dropped, on every TP rank) while the trainer runs, keeping its
  runtime.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from rl.core import model_info
from rl.core.model_info import quantization_kind
from rl.models import registry
from rollout.config import engine_setting

GiB = 2**30
NVFP4_BYTES = 0.5 + 1 / 16  # FP4 values plus one FP8 scale per 16 (the per-tensor global scale is negligible)
# dequantizing: each block of 16 weights' scale as BF16 and the FP32 effective scale (block / global)
DEQUANT_SCALE_BYTES = (2 + 4) / 16
VLLM_BATCHED_TOKENS = 16384  # vLLM's max_num_batched_tokens for the LLM class on a large GPU
RUNTIME_BYTES = 1 * GiB  # CUDA context, allocator slack, NCCL buffers: per process on a GPU
CUDA_GRAPH_BYTES = 1 * GiB
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
LONG_CONTEXT = 1_048_576  # shown beside the recipe's context for models with sliding-window layers
DEFAULT_LOGITS_CHUNK = 4096  # the chunk the hint suggests (the large recipes' trainer.logits_chunk_tokens)
MIN_LOGITS_CHUNK = 1024  # the smallest chunk the advice halves down to
QUANTIZED_GROUPS = ("attention", "experts", "latent", "shared_experts", "dense_mlp")  # Linear layers


@dataclass
class ModelShape:
    """What the planner needs to know about a model. `params`: parameter count per group (attention,
    experts, router, latent, shared_experts, dense_mlp, embeddings, norms); computed from the shape unless
    given (the built-in Muse facts)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    num_experts: int = 0  # 0: a dense model
    top_k: int = 0
    expert_inter: int = 0
    dense_inter: int = 0
    num_dense_layers: int = 0  # layers with a dense MLP (all of them in a dense model)
    shared_expert_inter: int = 0
    latent: int = 0  # latent MoE width: experts work at this width (Muse)
    head_gate: int = 0  # outputs of the per-layer attention gate projection (Muse: one a head)
    window: int = 0
    window_layers: int = 0
    max_context: int = 0
    tie_embeddings: bool = False
    quantization: str | None = None  # of the checkpoint the facts came from: "nvfp4", another, or None
    params: dict[str, float] = field(default_factory=dict)
    source: str = ""
    assumptions: list[str] = field(default_factory=list)

    def __post_init__(self):
        if not self.params:
            self.params = self._count()

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    @property
    def expert_width(self) -> int:
        return self.latent or self.hidden

    def _count(self) -> dict[str, float]:
        h, L, d = self.hidden, self.num_layers, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        out = {
            "attention": L * (2 * h * q + 2 * h * kv + h * self.head_gate),
            "experts": self.moe_layers * self.num_experts * 3 * self.expert_width * self.expert_inter,
            "router": self.moe_layers * h * self.num_experts,
            "latent": self.moe_layers * 2 * h * self.latent,
            "shared_experts": self.moe_layers * 3 * h * self.shared_expert_inter,
            "dense_mlp": self.num_dense_layers * 3 * h * self.dense_inter,
            "embeddings": self.vocab * h * (1 if self.tie_embeddings else 2),
            "norms": L * (2 * h + 2 * d) + h,
        }
        return {k: v for k, v in out.items() if v}

    @property
    def total_params(self) -> float:
        return sum(self.params.values())

    def largest_layer_params(self) -> float:
        """Parameters of the largest decoder layer (what FSDP2 gathers at once)."""
        p, L = self.params, self.num_layers
        shared = (p.get("attention", 0) + p.get("norms", 0)) / L
        moe = sum(p.get(k, 0) for k in ("experts", "router", "latent", "shared_experts"))
        moe = moe / self.moe_layers if self.moe_layers else 0
        dense = p.get("dense_mlp", 0) / self.num_dense_layers if self.num_dense_layers else 0
        return shared + max(moe, dense)

    def largest_layer_quantized_params(self) -> float:
        """Of largest_layer_params, those an NVFP4 checkpoint stores in NVFP4 (QUANTIZED_GROUPS)."""
        p, L = self.params, self.num_layers
        shared = p.get("attention", 0) / L
        moe = sum(p.get(k, 0) for k in ("experts", "latent", "shared_experts"))
        moe = moe / self.moe_layers if self.moe_layers else 0
        dense = p.get("dense_mlp", 0) / self.num_dense_layers if self.num_dense_layers else 0
        full_moe = moe + (p.get("router", 0) / self.moe_layers if self.moe_layers else 0)
        return shared + (moe if full_moe >= dense else dense)

    def largest_quantized_weight(self, ep: int = 1) -> float:
        """Parameters of the largest single weight an NVFP4 checkpoint stores in NVFP4, as the trainer holds
        it: a MoE layer's fused gate_up bank (two of the experts' three projections, num_experts / ep of
        them), a dense MLP's projection, or a layer's query or output projection (at most half its
        attention); the latent projections likewise."""
        p, L = self.params, self.num_layers
        per_moe = lambda k: p.get(k, 0) / self.moe_layers if self.moe_layers else 0.0  # noqa: E731
        dense = p.get("dense_mlp", 0) / self.num_dense_layers / 3 if self.num_dense_layers else 0.0
        return max(
            per_moe("experts") * 2 / 3 / ep,
            per_moe("shared_experts") * 2 / 3,
            per_moe("latent") / 2,
            dense,
            p.get("attention", 0) / L / 2,
        )

    def layer_tokens(self, context: int) -> int:
        """KV entries one sequence of `context` tokens holds, summed over the layers."""
        full = self.num_layers - self.window_layers
        return self.window_layers * min(context, self.window) + full * context

    def kv_ratio(self, context: int) -> float:
        """KV cache of a `context`-token sequence relative to every layer attending to all of it."""
        return self.layer_tokens(context) / (self.num_layers * context)


# ----------------------------------------------------------------------------------------------------
# Model facts
# ----------------------------------------------------------------------------------------------------


def shape_from_hf(config: dict, name: str, source: str) -> ModelShape:
    """A ModelShape from a Hugging Face config.json (Qwen3-MoE, Mixtral, DeepSeek-style and dense models);
    a family's own keys (Muse's latent width and head gate) as its `planner.config_fields` reads them."""
    c = config.get("text_config") or config
    family = registry.family_of(config)
    own = family.planner.config_fields if family else None
    try:
        layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
        vocab = c["vocab_size"]
    except KeyError as e:
        raise ValueError(f"{source}: config.json has no {e.args[0]}; cannot plan for this model") from None
    experts = model_info.num_experts(c)
    dense = set()
    if experts:
        dense |= set(c.get("mlp_only_layers") or [])
        step = c.get("decoder_sparse_step") or 1
        dense |= {i for i in range(layers) if (i + 1) % step}
        dense |= set(range(c.get("first_k_dense_replace") or 0))
    shared = c.get("shared_expert_intermediate_size") or (c.get("n_shared_experts") or 0) * (
        c.get("moe_intermediate_size") or 0
    )
    types = c.get("layer_types") or []
    window = c.get("sliding_window") or 0
    if types:
        window_layers = sum(t == "sliding_attention" for t in types)
    elif window and c.get("use_sliding_window", True):
        window_layers = layers  # Mistral-style: every layer
    else:
        window_layers = 0
    if not window_layers:
        window = 0
    return ModelShape(
        name=name,
        num_layers=layers,
        hidden=hidden,
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or hidden // heads,
        vocab=vocab,
        num_experts=experts,
        top_k=c.get("num_experts_per_tok") or 0,
        expert_inter=(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0) if experts else 0,
        dense_inter=c.get("intermediate_size") or 0,
        num_dense_layers=len(dense) if experts else layers,
        shared_expert_inter=shared,
        window=window,
        window_layers=window_layers,
        max_context=c.get("max_position_embeddings") or 0,
        # transformers' default when the key is absent
        tie_embeddings=bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", True))),
        quantization=quantization_kind(config.get("quantization_config") or c.get("quantization_config")),
        source=source,
        **(own(c) if own else {}),
    )


def _local_config(path: str) -> Path | None:
    """config.json of a local directory, or of a hub id in the Hugging Face cache (no download)."""
    if not path:
        return None
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(path, "config.json")
    except Exception:  # not a valid hub id, or no huggingface_hub
        return None
    return Path(hit) if isinstance(hit, str) else None


def builtin_shape(path: str) -> ModelShape | None:
    """The built-in facts of the model `path` names (its family's `planner.builtin`), or None."""
    low = path.lower()
    for model in registry.builtin_models():
        if model.match in low:
            if model.config is not None:
                return shape_from_hf(dict(model.config), model.name, model.source)
            return ModelShape(name=model.name, source=model.source, **copy.deepcopy(dict(model.shape)))
    return None


def model_shape(cfg) -> ModelShape:
    m = cfg.model
    if m.make_tiny.arch:
        from rl.tiny import VOCAB_SIZE, model_config
        from trainer.nvfp4 import FORMAT as NVFP4_FORMAT

        hf = model_config(m.make_tiny.arch, VOCAB_SIZE, eos_id=1, pad_id=0).to_dict()
        if m.make_tiny.quantize:  # what `sparkrl quantize` writes into the copy's config.json
            hf["quantization_config"] = {"quant_method": "compressed-tensors", "format": NVFP4_FORMAT}
        return shape_from_hf(hf, f"make-tiny {m.make_tiny.arch}", "make-tiny's config (rl/tiny.py)")
    for path in (m.path, m.rollout_path):
        found = _local_config(path)
        if found is None:
            continue
        config = json.loads(found.read_text())
        return shape_from_hf(config, Path(path).name or path, str(found))
    for path in (m.path, m.rollout_path):
        shape = builtin_shape(path) if path else None
        if shape is not None:
            return shape
    known = ", ".join(b.name for b in registry.builtin_models())
    raise ValueError(
        f"plan: cannot tell the shape of model.path {m.path!r}: no config.json there or in the "
        f"Hugging Face cache, and not a built-in model ({known}). Point "
        "model.path at a directory with config.json, or fetch only that file, e.g. "
        f"`huggingface-cli download {m.path} config.json`"
    )


def _stored_format(cfg, path: str, shape: ModelShape | None) -> tuple[str, str]:
    """(format, why): 'nvfp4' (or another quant_method) or the model dtype, for the checkpoint at `path`;
    `shape`: the model facts to fall back on when `path` has no local config.json."""
    found = _local_config(path) if path else None
    if found is not None:
        kind = quantization_kind(json.loads(found.read_text()).get("quantization_config"))
        if kind is not None:
            return kind, f"quantization_config in {found}"
        return cfg.model.dtype, f"{found} has no quantization_config"
    if shape is not None and shape.quantization:
        return shape.quantization, "quantization_config of the model's config"
    if "nvfp4" in path.lower():
        return "nvfp4", f"'nvfp4' in the name {path!r} (no local config.json)"
    return cfg.model.dtype, "model.dtype (no quantization found)"


def rollout_format(cfg, shape: ModelShape) -> tuple[str, str]:
    """(format, why): 'nvfp4' or the model dtype, for the weights vLLM loads."""
    return _stored_format(cfg, cfg.model.rollout_path or cfg.model.path, shape)


def trainer_base_format(cfg) -> tuple[str, str]:
    """(format, why): 'nvfp4' or 'bf16' (model.dtype), how the trainer holds the frozen base
    (trainer.base_format; auto: nvfp4 when model.path is an NVFP4 checkpoint)."""
    fmt = cfg.trainer.base_format
    if fmt != "auto":
        return fmt, f"trainer.base_format={fmt}"
    if cfg.model.make_tiny.arch:
        quantize = cfg.model.make_tiny.quantize
        return (
            "nvfp4" if quantize else "bf16"
        ), f"trainer.base_format=auto: model.make_tiny.quantize={quantize!r}"
    # model.path's own config or name: the model facts may be the rollout weights'
    kind, why = _stored_format(cfg, cfg.model.path, None)
    return ("nvfp4" if kind == "nvfp4" else "bf16"), f"trainer.base_format=auto: {why}"


def stored_bytes(params: dict[str, float], fmt: str, dtype_bytes: int) -> float:
    """Bytes of weights stored as `fmt`: NVFP4 for QUANTIZED_GROUPS and `dtype_bytes` for the rest, or
    `fmt` (a dtype name) throughout."""
    if fmt == "nvfp4":
        return sum(v * (NVFP4_BYTES if k in QUANTIZED_GROUPS else dtype_bytes) for k, v in params.items())
    return sum(params.values()) * DTYPE_BYTES.get(fmt, dtype_bytes)


# ----------------------------------------------------------------------------------------------------
# LoRA sizes
# ----------------------------------------------------------------------------------------------------


def vllm_lora_rank(rank: int) -> int:
    return model_info.vllm_lora_rank(rank) or rank


def _lora_modules(cfg, s: ModelShape) -> list[tuple[str, int, int, int, str]]:
    """(name, count, in, out, split) of every adapted matrix kind; split says how vLLM lays it over TP:
    'col' (output split), 'row' (input split) or 'kv' (output split by KV heads, replicated below one)."""
    lo, L = cfg.lora, s.num_layers
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    known = {
        "q_proj": (L, s.hidden, q, "col"),
        "k_proj": (L, s.hidden, kv, "kv"),
        "v_proj": (L, s.hidden, kv, "kv"),
        "o_proj": (L, q, s.hidden, "row"),
    }
    if s.num_dense_layers and s.dense_inter:  # dense MLP layers (a dense model, or an MoE's dense layers)
        n, i = s.num_dense_layers, s.dense_inter
        known.update(
            {
                "gate_proj": (n, s.hidden, i, "col"),
                "up_proj": (n, s.hidden, i, "col"),
                "down_proj": (n, i, s.hidden, "row"),
            }
        )
    out = [(m, *known[m]) for m in lo.target_modules if m in known]
    if lo.target_experts and s.num_experts:
        n, he, ie = s.moe_layers * s.num_experts, s.expert_width, s.expert_inter
        out += [
            ("experts.gate", n, he, ie, "col"),
            ("experts.up", n, he, ie, "col"),
            ("experts.down", n, ie, he, "row"),
        ]
    if lo.target_latent and s.latent:
        out += [
            ("pooler", s.moe_layers, s.hidden, s.latent, "col"),
            ("unpooler", s.moe_layers, s.latent, s.hidden, "row"),
        ]
    return out


def untargeted_modules(cfg, s: ModelShape) -> list[str]:
    """lora.target_modules names the planner does not know for this model (not counted)."""
    counted = {m for m, *_ in _lora_modules(cfg, s)}
    return [m for m in cfg.lora.target_modules if m not in counted]


def trainer_lora_params(cfg, s: ModelShape, experts_only: bool = False) -> int:
    """LoRA parameters as the trainer holds them: r x (in + out) per matrix, except the fused experts'
    gate_up_proj [E, 2I, H], whose one A serves gate and up (PEFT target_parameters). `experts_only`: the
    routed experts' alone."""
    r, total = cfg.lora.rank, 0
    for name, count, fan_in, fan_out, _ in _lora_modules(cfg, s):
        if experts_only and not name.startswith("experts."):
            continue
        if name == "experts.up":
            total += count * r * fan_out  # its B only: A is gate's
        else:
            total += count * r * (fan_in + fan_out)
    return total


def rollout_lora_params(cfg, s: ModelShape, tp: int) -> float:
    """Elements of one vLLM LoRA slot on one GPU, at vLLM's rank: column-parallel layers keep A whole and
    split B's output over TP; row-parallel ones split A's input and keep B whole."""
    r = vllm_lora_rank(cfg.lora.rank)
    total = 0.0
    for _, count, fan_in, fan_out, split in _lora_modules(cfg, s):
        if split == "col":
            total += count * r * (fan_in + fan_out / tp)
        elif split == "kv":
            total += count * r * (fan_in + math.ceil(s.num_kv_heads / tp) * s.head_dim)
        else:
            total += count * r * (fan_in / tp + fan_out)
    return total


# ----------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------


def _show(value) -> str:
    """A value as a key=value override writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass
class Change:
    """A change the plan suggests: `text` as printed; `sets`, the keys it sets (dotted key -> value), which
    the planner applies and re-plans before printing it; `quantized`: model.path becomes its NVFP4 twin
    (`sparkrl quantize`), and `step` says how."""

    text: str
    sets: dict = field(default_factory=dict)
    quantized: bool = False
    step: str = ""

    @property
    def command(self) -> str:
        keys = " ".join(f"{k}={_show(v)}" for k, v in self.sets.items())
        return ", then ".join(x for x in (self.step, keys) if x) if self.step else keys


@dataclass
class Plan:
    shape: ModelShape
    gpu_bytes: float
    num_gpus: int
    placement: str
    # rollout, per GPU
    rollout_format: str
    rollout_format_why: str
    tp: int
    engines: int
    context: int
    batched_tokens: int  # vLLM's max_num_batched_tokens: a forward's tokens, what its activations hold
    r_weights: float
    r_lora: float
    r_activations: float
    r_runtime: float
    r_budget: float
    kv_per_seq: float
    kv_room: float
    seqs_wanted: int
    # trainer, per GPU
    ranks: int
    t_weights: float
    t_lora_state: float
    t_gathered: float
    t_activations: float
    t_runtime: float
    micro_tokens: int
    lora_params_trainer: int
    lora_params_rollout_gpu: float
    lora_rank: int
    t_logits: float = 0.0
    base_format: str = "bf16"
    base_format_why: str = ""
    base_label: str = ""  # what the trainer holds the base as: "nvfp4, packed" or model.dtype
    logits_tokens: int = 0  # tokens a chunk of the LM head covers
    placement_ok: bool = True
    placement_why: str = ""
    weight_bytes: int = 2  # bytes of model.dtype
    lora_params_experts: int = (
        0  # of lora_params_trainer, the routed experts' (expert parallelism splits them)
    )
    t_base_bytes: dict[str, float] = field(
        default_factory=dict
    )  # the whole base as the trainer holds it, by group
    untargeted: list[str] = field(default_factory=list)
    verdicts: list[tuple[str, bool, str]] = field(default_factory=list)
    # bytes a GPU left over by each memory check (negative: over)
    headroom: dict[str, float] = field(default_factory=dict)
    suggestions: list[str] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)  # what _judge proposes, before re-planning
    notes: list[str] = field(default_factory=list)  # what the plan says with no change to apply
    kv_target: float = 0.0  # the gpu_memory_utilization at which vLLM holds every sequence at once

    def decode_read_bytes(self, wave: int) -> float:
        """Bytes an engine GPU reads a decode step of `wave` sequences (rl/plan_time.py): its weights and LoRA
        slot, the routed experts only where the wave's tokens route (each token top_k of num_experts, taken
        as uniform)."""
        s = self.shape
        everything = self.r_weights + self.r_lora
        if not s.num_experts or not s.params.get("experts"):
            return everything
        experts = stored_bytes({"experts": s.params["experts"]}, self.rollout_format, self.weight_bytes)
        touched = 1 - (1 - s.top_k / s.num_experts) ** max(wave, 1)
        return everything - experts / self.tp * (1 - touched)

    @property
    def r_beside_kv(self) -> float:
        """What vLLM holds on a GPU besides its KV cache: weights, the LoRA slot, activations, runtime."""
        return self.r_weights + self.r_lora + self.r_activations + self.r_runtime

    @property
    def r_total_min(self) -> float:
        """What vLLM needs within its budget to hold one full-length sequence."""
        return self.r_beside_kv + self.kv_per_seq

    @property
    def seqs_fit(self) -> int:
        return max(0, int(self.kv_room // self.kv_per_seq)) if self.kv_per_seq else 0

    @property
    def t_resident(self) -> float:
        return self.t_weights + self.t_lora_state + self.t_runtime

    @property
    def t_peak(self) -> float:
        return self.t_resident + self.t_gathered + self.t_activations

    @property
    def fits(self) -> bool:
        return all(ok for _, ok, _ in self.verdicts)

    @property
    def margin(self) -> float | None:
        """The least headroom of the memory checks (bytes a GPU); None on CPU."""
        return min(self.headroom.values()) if self.headroom else None


def _kv_bytes_per_token_layer(s: ModelShape, tp: int, dtype_bytes: int) -> int:
    return 2 * math.ceil(s.num_kv_heads / tp) * s.head_dim * dtype_bytes


def _layer_working_set(s: ModelShape, tokens: int, abytes: int, tp: int = 1) -> float:
    """Activations of one decoder layer: ~6 hidden-width tensors (input, norms, attention output,
    residual), q/k/v and attention output, the routed copies of each token with gate/up/product, and the
    latent pooled/unpooled tensors."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    if s.num_experts:
        mlp = s.top_k * (s.expert_width + 3 * s.expert_inter / tp) + 2 * s.latent
    else:
        mlp = 3 * s.dense_inter / tp
    return tokens * abytes * (6 * s.hidden + (2 * q + 2 * kv) / tp + mlp)


def _logits_bytes(tokens: int, vocab: float, abytes: int, nucleus: bool = False) -> float:
    """The trainer's response logits in the compute dtype, their fp32 copy and fp32 log-softmax; nucleus
    (rollout.top_p < 1, trainer/logprobs.py): 12 bytes a logit more, the sort's peak (its fp32 values and
    int64 order; measured over a chunk's forward and backward: 13 bytes a logit without it, 25 with)."""
    return tokens * vocab * (abytes + 4 + 4 + (12 if nucleus else 0))


def memory_budget(cfg) -> float:
    """trainer.activation_memory_budget where it applies: compiled layers, which the trainer has on GPU only
    (trainer/worker.py); 0 elsewhere."""
    compiled = cfg.trainer.compile and cfg.resources.num_gpus > 0
    return cfg.trainer.activation_memory_budget if compiled else 0.0


def _budget_floor(s: ModelShape, tokens: int, abytes: int) -> float:
    """What the partitioner keeps at any budget: the inputs of each compiled graph, one per decoder layer
    (trainer/lora_experts.py keeps the MoE block in it): the layer input."""
    return tokens * abytes * s.num_layers * s.hidden


def logits_tokens(cfg, tokens: int) -> int:
    """Tokens whose logits exist at once: one trainer.logits_chunk_tokens chunk (0: the whole micro-batch)."""
    chunk = cfg.trainer.logits_chunk_tokens
    return min(chunk, tokens) if chunk else tokens


def trainer_gathered(s: ModelShape, base_format: str, ranks: int, wbytes: int, ep: int = 1) -> float:
    """What FSDP2 holds unsharded at once: two decoder layers (the computing one and the prefetched next)
    and the embeddings/output. An nvfp4 base all-gathers its NVFP4 weights packed and dequantizes the
    computing layer's into a model.dtype buffer; dequantizing a weight makes its FP32 effective scales and
    BF16 block scales beside it (trainer/nvfp4_tensor.py). One rank gathers nothing, yet FSDP2's one-rank
    path copies each weight's gather input (the packed bytes, trainer/nvfp4_tensor.py `_row_bytes`) into an
    unsharded buffer (torch's `FSDPParamGroup.wait_for_unshard`): the computing layer packed, and the input
    of the largest weight alive through its copy. With expert parallelism (`ep` > 1) a layer holds
    num_experts / ep of its experts. Measured on one H100 (docs/benchmarks.md, Muse Spark Open at full
    width): the one-rank terms are the 14.4 GiB the trainer's peak held beyond the rest of the plan."""
    layer, packed = s.largest_layer_params(), s.largest_layer_quantized_params()
    if ep > 1 and s.moe_layers:
        others = s.params.get("experts", 0) / s.moe_layers * (1 - 1 / ep)
        layer, packed = layer - others, packed - others
    dense = s.params.get("embeddings", 0) * wbytes
    if base_format != "nvfp4":
        return 0.0 if ranks == 1 else 2 * layer * wbytes + dense
    largest = s.largest_quantized_weight(ep)
    dequantized = packed * wbytes + largest * DEQUANT_SCALE_BYTES
    gathered_layer = packed * NVFP4_BYTES + (layer - packed) * wbytes
    if ranks == 1:
        return gathered_layer + largest * NVFP4_BYTES + dequantized
    return 2 * gathered_layer + dequantized + dense


def trainer_activations(cfg, s: ModelShape, tokens: int, abytes: int) -> float:
    work = _layer_working_set(s, tokens, abytes)
    every = (s.num_layers - 1) * work  # all but the computing layer's, which `work` counts
    budget = memory_budget(cfg)
    if budget:
        # torch's scale: from the graphs' inputs (0) to all the partitioner keeps unconstrained (1), which
        # is taken to be no checkpointing
        floor = _budget_floor(s, tokens, abytes)
        kept = floor + budget * max(every - floor, 0.0)
    elif cfg.trainer.activation_checkpointing:
        kept = s.num_layers * tokens * s.hidden * abytes  # each layer's input, recomputed in backward
    else:
        kept = every
    return kept + work + _logits_bytes(logits_tokens(cfg, tokens), s.vocab, abytes, cfg.rollout.top_p < 1)


def colocated_engine_plan(cfg) -> Plan | None:
    """The plan a colocated engine's KV cache is sized from on GPUs (rl.setup.engine_spec; the preflight's
    check), or None where vLLM's own profile sizes it: no sleep mode (CPU, split placement), a KV size of
    one's own in `rollout.engine_args`, a model the planner cannot size, or weights in a format it does not
    count byte for byte (only NVFP4 and model.dtype)."""
    ro = cfg.rollout
    if not cfg.resources.num_gpus or ro.placement != "colocated" or "kv_cache_memory_bytes" in ro.engine_args:
        return None
    try:
        p = make_plan(cfg, advise=False)
    except ValueError:
        return None
    return p if p.rollout_format in ("nvfp4", cfg.model.dtype) else None


def make_plan(cfg, gpu_gib: float | None = None, quantized: bool = False, advise: bool = True) -> Plan:
    """The plan of `cfg` on GPUs of `gpu_gib` GiB (default resources.gpu_memory_gib). `quantized`: as if
    model.path were its NVFP4 twin (`sparkrl quantize`); `advise`: re-plan each suggested change and keep
    those that fit (p.suggestions)."""
    s = model_shape(cfg)
    ro, tr, res = cfg.rollout, cfg.trainer, cfg.resources
    G = (gpu_gib or res.gpu_memory_gib) * GiB
    wbytes = DTYPE_BYTES[cfg.model.dtype]
    if quantized and not cfg.model.rollout_path:
        fmt, why = "nvfp4", "model.path quantized (`sparkrl quantize`)"
    else:
        fmt, why = rollout_format(cfg, s)
    tp = ro.tensor_parallel_size

    # ---- rollout ----
    p = s.params
    stored = stored_bytes(p, fmt, wbytes)
    context = engine_setting(ro, "max_model_len") or ro.max_prompt_len + max(
        ro.max_response_len, cfg.eval.max_response_len
    )
    lora_gpu = rollout_lora_params(cfg, s, tp) if cfg.sync.mode == "adapter" else 0.0
    on_gpu = res.num_gpus > 0
    # On CPU there is no CUDA context, and vLLM's KV cache is a fixed size of its own (cpu_kvcache_gb).
    eager = engine_setting(ro, "enforce_eager")
    runtime = (RUNTIME_BYTES + (0 if eager else CUDA_GRAPH_BYTES)) if on_gpu else 0
    batched = engine_setting(ro, "max_num_batched_tokens", VLLM_BATCHED_TOKENS)
    seqs = engine_setting(ro, "max_num_seqs")
    r_act = (
        _layer_working_set(s, batched, wbytes, tp) + seqs * s.vocab / tp * 4
    )  # the sampler's fp32 logits, one row a sequence
    r_weights, r_lora = stored / tp, lora_gpu * wbytes
    if on_gpu:
        budget = engine_setting(ro, "gpu_memory_utilization") * G
    else:
        budget = r_weights + r_lora + r_act + ro.cpu_kvcache_gb * GiB  # 0: vLLM sizes it from host memory
    kv_seq = _kv_bytes_per_token_layer(s, tp, wbytes) * s.layer_tokens(context)
    kv_room = budget - r_weights - r_lora - r_act - runtime
    wanted = min(seqs, math.ceil(cfg.data.train_batch_size * ro.n / ro.num_workers))

    # ---- trainer ----
    ranks = tr.num_ranks
    lora_t = trainer_lora_params(cfg, s)
    state_bytes = 4 * DTYPE_BYTES["float32"]  # parameter, gradient, AdamW m and v: fp32 LoRA masters
    base, base_why = trainer_base_format(cfg)
    if quantized and cfg.trainer.base_format == "auto":
        base, base_why = "nvfp4", "trainer.base_format=auto: model.path quantized (`sparkrl quantize`)"
    tokens = tr.micro_batch_tokens or tr.micro_batch_size * (ro.max_prompt_len + ro.max_response_len)
    placement_ok, placement_why = _placement_verdict(cfg)

    plan = Plan(
        shape=s,
        gpu_bytes=G,
        num_gpus=res.num_gpus,
        placement=ro.placement,
        rollout_format=fmt,
        rollout_format_why=why,
        tp=tp,
        engines=ro.num_workers,
        context=context,
        batched_tokens=batched,
        r_weights=r_weights,
        r_lora=r_lora,
        r_activations=r_act,
        r_runtime=runtime,
        r_budget=budget,
        kv_per_seq=kv_seq,
        kv_room=kv_room,
        seqs_wanted=wanted,
        ranks=ranks,
        t_weights=stored_bytes(p, "nvfp4" if base == "nvfp4" else cfg.model.dtype, wbytes) / ranks,
        t_lora_state=lora_t * state_bytes / ranks,
        t_gathered=trainer_gathered(s, base, ranks, wbytes, tr.expert_parallel_size),
        t_activations=trainer_activations(cfg, s, tokens, wbytes),
        t_runtime=RUNTIME_BYTES if on_gpu else 0,
        micro_tokens=tokens,
        lora_params_trainer=lora_t,
        lora_params_rollout_gpu=lora_gpu,
        lora_rank=vllm_lora_rank(cfg.lora.rank),
        untargeted=untargeted_modules(cfg, s),
        t_logits=_logits_bytes(logits_tokens(cfg, tokens), s.vocab, wbytes, cfg.rollout.top_p < 1),
        base_format=base,
        base_format_why=base_why,
        base_label="nvfp4, packed" if base == "nvfp4" else cfg.model.dtype,
        logits_tokens=logits_tokens(cfg, tokens),
        placement_ok=placement_ok,
        placement_why=placement_why,
        weight_bytes=wbytes,
        lora_params_experts=trainer_lora_params(cfg, s, experts_only=True),
        t_base_bytes={
            k: stored_bytes({k: v}, "nvfp4" if base == "nvfp4" else cfg.model.dtype, wbytes)
            for k, v in p.items()
        },
    )
    if on_gpu:
        _judge(plan, cfg)
        if advise:
            _advise(plan, cfg, quantized)
    return plan


def _placement_verdict(cfg) -> tuple[bool, str]:
    """Whether rl.placement lays the recipe out, and how (or why not): the rules the run reserves GPUs by."""
    from rl.placement import plan_placement

    try:
        bundles, place = plan_placement(cfg)
    except ValueError as e:
        return False, str(e)
    if not bundles:
        return True, "CPU run: no placement group"
    engines = "; ".join(f"engine {i} on bundles {_ranges(b)}" for i, b in enumerate(place.rollout_bundles))
    if cfg.rollout.placement == "split":
        how = f"{cfg.trainer.num_ranks} trainer GPUs, then one bundle of {cfg.rollout.tensor_parallel_size} GPUs an engine"
    else:
        how = f"{len(bundles)} GPUs, each shared by a trainer rank and an engine's TP rank"
    return True, f"{len(bundles)} bundles: {how}; {engines}"


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)) else str(ids)


def _up(x: float, step: float = 0.01) -> float:
    return math.ceil(x / step - 1e-9) * step


def _judge(p: Plan, cfg) -> None:
    """Fill p.verdicts, p.notes and p.changes (each change as it would be applied; `_advise` re-plans them)."""
    G, ro = p.gpu_bytes, cfg.rollout
    gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    u_need = p.r_total_min / G
    u_all = (p.r_total_min - p.kv_per_seq + p.seqs_wanted * p.kv_per_seq) / G
    need_ranks: list[tuple[int, str]] = []  # (trainer ranks, why) for each check more ranks would pass
    changes, p.changes = [], []
    p.verdicts.append(("placement", p.placement_ok, p.placement_why))

    ok = p.kv_room >= p.kv_per_seq
    p.headroom["rollout"] = p.kv_room - p.kv_per_seq
    p.verdicts.append(
        (
            "rollout",
            ok,
            f"needs {gib(p.r_total_min)} for one {p.context:,}-token sequence "
            f"within its {gib(p.r_budget)} (gpu_memory_utilization "
            f"{engine_setting(ro, 'gpu_memory_utilization'):g})",
        )
    )
    if not ok:
        if u_need <= 0.95:
            changes.append(
                Change(
                    f"rollout.gpu_memory_utilization={_up(u_need):.2f} (at least) gives vLLM room for one "
                    "full-length sequence",
                    {"rollout.gpu_memory_utilization": round(_up(u_need), 2)},
                )
            )
        changes.append(
            Change(
                f"rollout.tensor_parallel_size={ro.tensor_parallel_size * 2} halves the weights each GPU holds",
                {"rollout.tensor_parallel_size": ro.tensor_parallel_size * 2},
            )
        )
    elif p.seqs_fit < p.seqs_wanted:
        p.notes.append(
            f"the KV room holds {p.seqs_fit} of the {p.seqs_wanted} sequences an engine runs at once; "
            "vLLM queues the rest (slower rollouts)"
        )
        p.kv_target = min(_up(u_all), 0.95)

    if p.placement == "colocated":
        during_rollout = p.t_resident + p.r_budget
        ok = during_rollout <= G
        p.headroom["colocated, rollout phase"] = G - during_rollout
        p.verdicts.append(
            (
                "colocated, rollout phase",
                ok,
                f"trainer's resident {gib(p.t_resident)} + vLLM's {gib(p.r_budget)} = "
                f"{gib(during_rollout)} of {gib(G)}",
            )
        )
        if not ok:
            room = math.floor((G - p.t_resident) / G * 100) / 100
            if room >= u_need:
                changes.append(
                    Change(
                        f"rollout.gpu_memory_utilization={room:.2f} (at most) leaves the trainer's resident "
                        "state its room",
                        {"rollout.gpu_memory_utilization": room},
                    )
                )
            _resident_changes(p, cfg, changes)
            sharded = (p.t_weights + p.t_lora_state) * p.ranks
            free = G - p.r_budget - p.t_runtime
            if free > 0:
                need_ranks.append((math.ceil(sharded / free), "beside vLLM's budget"))
            changes.append(
                Change(
                    "rollout.placement=split gives the engines GPUs of their own",
                    {"rollout.placement": "split"},
                )
            )
        sleeping = RUNTIME_BYTES
        ok = p.t_peak + sleeping <= G
        p.headroom["colocated, training phase"] = G - p.t_peak - sleeping
        p.verdicts.append(
            (
                "colocated, training phase",
                ok,
                f"trainer peak {gib(p.t_peak)} + vLLM asleep {gib(sleeping)} of {gib(G)}",
            )
        )
    else:
        sleeping = 0.0
        ok = p.t_peak <= G
        p.headroom["trainer"] = G - p.t_peak
        p.verdicts.append(("trainer", ok, f"peak {gib(p.t_peak)} of {gib(G)}"))
    if not ok:
        _training_hints(p, cfg, sleeping, need_ranks, changes)
    if need_ranks and cfg.resources.num_gpus > 1:  # one GPU: what fits on it, not more GPUs
        changes.append(
            _ranks_change(cfg, max(n for n, _ in need_ranks), " and ".join(w for _, w in need_ranks))
        )
    # One GPU: the NVFP4 base first, then the memory fractions, then the rest
    seen = set()
    for c in sorted(changes, key=lambda c: 0 if c.quantized or "trainer.base_format" in c.sets else 1):
        if c.command not in seen:
            seen.add(c.command)
            p.changes.append(c)


def _resident_changes(p: Plan, cfg, changes: list[Change]) -> None:
    """What shrinks the trainer's resident state (base weights, LoRA state) on the GPUs it has: the NVFP4
    base, fewer LoRA targets, a lower LoRA rank."""
    gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    wbytes = DTYPE_BYTES[cfg.model.dtype]
    if p.base_format != "nvfp4":
        packed = stored_bytes(p.shape.params, "nvfp4", wbytes) / p.ranks
        gathered = trainer_gathered(p.shape, "nvfp4", p.ranks, wbytes)
        figures = (
            f"base {gib(packed)} instead of {gib(p.t_weights)}, gathered {gib(gathered)} instead of "
            f"{gib(p.t_gathered)}"
        )
        if _stored_format(cfg, cfg.model.path, None)[0] == "nvfp4":
            changes.append(
                Change(
                    f"trainer.base_format=nvfp4 keeps model.path's NVFP4 weights packed: {figures}",
                    {"trainer.base_format": "nvfp4"},
                )
            )
        elif cfg.model.path and not cfg.model.make_tiny.arch:
            sets = {} if cfg.trainer.base_format == "auto" else {"trainer.base_format": "nvfp4"}
            step = f"`sparkrl quantize {cfg.model.path} DIR`, model.path=DIR"
            change = Change("", sets, quantized=True, step=step)
            change.text = (
                f"{change.command}: the NVFP4 twin keeps the trainer's base packed and the rollout's weights "
                f"at 4.5 bits a weight: {figures}"
            )
            changes.append(change)
    lo, s = cfg.lora, p.shape
    if lo.target_experts and s.num_experts:
        changes.append(
            Change(
                "lora.target_experts=false leaves the experts without adapters (attention only)",
                {"lora.target_experts": False},
            )
        )
    if lo.target_latent and s.latent:
        changes.append(
            Change(
                "lora.target_latent=false leaves the pooler and unpooler without adapters",
                {"lora.target_latent": False},
            )
        )
    if lo.rank >= 16:
        changes.append(
            Change(
                f"lora.rank={lo.rank // 2} halves the LoRA state ({gib(p.t_lora_state)} now; lora.alpha stays, "
                "so the update's scale alpha / r doubles)",
                {"lora.rank": lo.rank // 2},
            )
        )


def _training_hints(p: Plan, cfg, sleeping: float, need_ranks: list[tuple[int, str]], changes) -> None:
    """The trainer's peak is over: a shorter micro-batch or chunk shrinks the activations, which do not shard;
    the NVFP4 base and fewer LoRA targets shrink the resident state; more ranks thin the sharded state."""
    G, tr = p.gpu_bytes, cfg.trainer
    gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    sharded = (p.t_weights + p.t_lora_state) * p.ranks
    fixed = p.t_gathered + p.t_activations + p.t_runtime + sleeping  # per GPU whatever the rank count
    if fixed < G:
        need_ranks.append((math.ceil(sharded / (G - fixed)), "for the training phase"))
    wbytes = DTYPE_BYTES[cfg.model.dtype]
    # the default chunk, else half the one in use (a chunk is one pass of the head: a smaller one only adds passes)
    chunk = DEFAULT_LOGITS_CHUNK if p.logits_tokens > DEFAULT_LOGITS_CHUNK else p.logits_tokens // 2
    if chunk >= MIN_LOGITS_CHUNK:
        chunked = _logits_bytes(chunk, p.shape.vocab, wbytes, cfg.rollout.top_p < 1)
        changes.append(
            Change(
                f"trainer.logits_chunk_tokens={chunk} cuts the LM head's logits from "
                f"{gib(p.t_logits)} to {gib(chunked)}",
                {"trainer.logits_chunk_tokens": chunk},
            )
        )
    longest = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    per_token = p.t_activations / p.micro_tokens if p.micro_tokens else 0.0
    if tr.micro_batch_tokens and per_token and p.micro_tokens > longest:
        room = G - (p.t_peak - p.t_activations) - sleeping
        t_fit = _micro_tokens_fit(cfg, p.shape, room, longest, p.micro_tokens)
        if longest <= t_fit < p.micro_tokens:
            changes.append(
                Change(
                    f"trainer.micro_batch_tokens={t_fit} (at most) fits the activations "
                    f"({gib(p.t_activations)} at {p.micro_tokens:,} tokens)",
                    {"trainer.micro_batch_tokens": t_fit},
                )
            )
        else:
            changes.append(
                Change(
                    f"trainer.micro_batch_tokens={longest} (one whole sequence, the least allowed) cuts the "
                    f"activations from {gib(p.t_activations)} to {gib(per_token * longest)}",
                    {"trainer.micro_batch_tokens": longest},
                )
            )
    budget = memory_budget(cfg)
    if budget:
        changes.append(
            Change(
                "trainer.activation_memory_budget=0 with trainer.activation_checkpointing=true keeps only each "
                "layer's input",
                {"trainer.activation_memory_budget": 0.0, "trainer.activation_checkpointing": True},
            )
        )
    elif not tr.activation_checkpointing:
        changes.append(
            Change(
                "trainer.activation_checkpointing=true keeps each layer's input, not all its activations",
                {"trainer.activation_checkpointing": True},
            )
        )
    _resident_changes(p, cfg, changes)
    if fixed >= G:
        p.notes.append(
            f"the gathered layers, activations and runtime alone take {gib(fixed)} a GPU: "
            "more ranks cannot help; shorten trainer.micro_batch_tokens"
        )


def _micro_tokens_fit(cfg, s: ModelShape, room: float, least: int, most: int) -> int:
    """The largest trainer.micro_batch_tokens in [least, most) whose activations fit `room` bytes, rounded down
    to a multiple of 512 where that stays at least `least`; 0 when even `least` does not fit."""
    act = lambda t: trainer_activations(cfg, s, t, DTYPE_BYTES[cfg.model.dtype])  # noqa: E731
    if act(least) > room:
        return 0
    lo, hi = least, most  # act(lo) fits; hi: not known to
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if act(mid) <= room else (lo, mid)
    return max(lo // 512 * 512, least)


def _round_ranks(cfg, ranks: int) -> int:
    """Past one node, whole nodes."""
    per_node = cfg.resources.gpus_per_node
    return math.ceil(ranks / per_node) * per_node if ranks > per_node else ranks


def _ranks_change(cfg, ranks: int, why: str) -> Change:
    ranks = _round_ranks(cfg, ranks)
    nodes = max(math.ceil(ranks / cfg.resources.gpus_per_node), cfg.resources.nodes)
    gpus = max(ranks, cfg.resources.num_gpus)
    sets = {"trainer.num_ranks": ranks, "resources.num_gpus": gpus, "resources.nodes": nodes}
    keys = " ".join(f"{k}={v}" for k, v in sets.items())
    return Change(f"{keys} (sharded trainer state, {why})", sets)


# ----------------------------------------------------------------------------------------------------
# Advice: every suggested change re-planned
# ----------------------------------------------------------------------------------------------------


def apply_change(cfg, change: Change):
    """A copy of `cfg` with the change's keys set, or None when the config refuses it (rl.config.validate)."""
    from rl.config import validate

    new = copy.deepcopy(cfg)
    for key, value in change.sets.items():
        *parents, leaf = key.split(".")
        obj = new
        for name in parents:
            obj = getattr(obj, name)
        setattr(obj, leaf, value)
    return None if validate(new) else new


def replan(cfg, changes: list[Change], gpu_gib: float) -> Plan | None:
    """The plan of `cfg` with `changes` applied in order, or None when the config refuses one of them."""
    quantized = False
    for change in changes:
        cfg = apply_change(cfg, change)
        if cfg is None:
            return None
        quantized = quantized or change.quantized
    return make_plan(cfg, gpu_gib, quantized=quantized, advise=False)


def _advise(p: Plan, cfg, quantized: bool) -> None:
    """p.suggestions: each change whose re-plan fits (the config and the placement accept it, and every memory
    check passes), with its margin; when none fits alone, the first combination found that does (each step the
    first change, in p.changes' order, that widens the margin); then the notes."""
    gpu_gib = p.gpu_bytes / GiB
    base = [Change("", {}, quantized=True)] if quantized else []
    out = []
    for change in p.changes:
        q = replan(cfg, [*base, change], gpu_gib)
        if q is not None and q.fits:
            out.append(f"{change.text} (re-planned: fits, margin {q.margin / GiB:.1f} GiB)")
    if not p.fits and not out:
        chosen, current = [], p
        for _ in range(6):
            step = None
            for change in current.changes:
                # a key set again replaces the earlier value
                kept = [c for c in chosen if not set(c.sets) & set(change.sets)]
                q = replan(cfg, [*base, *kept, change], gpu_gib)
                if q is None or not q.placement_ok:
                    continue
                if q.fits or q.margin > current.margin:
                    step = (change, q)
                    break
            if step is None:
                break
            chosen = [c for c in chosen if not set(c.sets) & set(step[0].sets)] + [step[0]]
            current = step[1]
            if current.fits:
                together = "; ".join(c.command for c in chosen)
                out.append(f"together: {together} (re-planned: fits, margin {current.margin / GiB:.1f} GiB)")
                break
    if p.fits and p.kv_target > cfg.rollout.gpu_memory_utilization:
        # the largest gpu_memory_utilization up to what holds every sequence that still fits
        u = p.kv_target
        while u > cfg.rollout.gpu_memory_utilization + 1e-9:
            q = replan(cfg, [*base, Change("", {"rollout.gpu_memory_utilization": round(u, 2)})], gpu_gib)
            if q is not None and q.fits:
                held = "holds them all" if q.seqs_fit >= q.seqs_wanted else f"holds {q.seqs_fit}"
                p.notes[-1] += (
                    f"; rollout.gpu_memory_utilization={u:.2f} {held} (re-planned: fits, margin {q.margin / GiB:.1f} GiB)"
                )
                break
            u = round(u - 0.01, 2)
    p.suggestions = out + p.notes


# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------


def _b(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,.0f}"


def format_plan(p: Plan, recipe: str = "") -> str:
    s = p.shape
    g = lambda b: f"{b / GiB:9.2f} GiB"  # noqa: E731
    lines = []
    where = f"{p.num_gpus} GPUs x {p.gpu_bytes / GiB:g} GiB, {p.placement}" if p.num_gpus else "CPU run"
    lines.append(f"plan {recipe} ({where})".replace("  ", " "))
    unit = "GPU" if p.num_gpus else "process"
    lines.append(f"model: {s.name} ({s.source})")
    moe = (
        f", {s.num_experts} experts (top-{s.top_k}) of width {s.expert_width} x {s.expert_inter}"
        if s.num_experts
        else f", MLP {s.dense_inter}"
    )
    win = f"; {s.window_layers} sliding-window layers of {s.window:,} tokens" if s.window_layers else ""
    latent = f", latent {s.latent}" if s.latent else ""
    lines.append(
        f"  {s.num_layers} layers, hidden {s.hidden}{moe}{latent}; {s.num_heads} heads, "
        f"{s.num_kv_heads} KV heads x {s.head_dim}{win}; vocab {s.vocab:,}"
    )
    lines.append(
        "  parameters: "
        + ", ".join(f"{k} {_b(v)}" for k, v in s.params.items())
        + f"; total {_b(s.total_params)}"
    )
    for a in s.assumptions:
        lines.append(f"  assumed: {a}")
    if p.untargeted:
        names = ", ".join(p.untargeted)
        lines.append(f"  not counted: lora.target_modules {names} (no such layer known here)")

    lines.append(
        f"rollout per {unit} ({p.engines} engine(s) x TP {p.tp}; weights {p.rollout_format}: "
        f"{p.rollout_format_why})"
    )
    lines.append(f"  weights      {g(p.r_weights)}")
    lora_note = (
        f"1 adapter at vLLM rank {p.lora_rank}: {_b(p.lora_params_rollout_gpu)} elements"
        if p.r_lora
        else "none (sync.mode merged: vLLM runs without LoRA)"
    )
    lines.append(f"  LoRA slot    {g(p.r_lora)}   {lora_note}")
    lines.append(f"  activations  {g(p.r_activations)}   {p.batched_tokens:,} batched tokens")
    lines.append(f"  runtime      {g(p.r_runtime)}")
    kv_known = p.num_gpus or p.kv_room > 0
    if p.num_gpus:
        where = f"what is left of {p.r_budget / GiB:.2f} GiB (gpu_memory_utilization x GPU)"
    else:
        where = (
            "rollout.cpu_kvcache_gb"
            if kv_known
            else "rollout.cpu_kvcache_gb = 0: vLLM sizes it from host memory"
        )
    lines.append(f"  KV cache     {g(max(p.kv_room, 0))}   {where}")
    ratio = f"{s.kv_ratio(p.context):.3f} of all-full attention" if s.window_layers else "all layers full"
    room = f"room for {p.seqs_fit} at once, " if kv_known else ""
    lines.append(
        f"    a {p.context:,}-token sequence: {p.kv_per_seq / 2**20:,.1f} MiB ({ratio}); "
        f"{room}{p.seqs_wanted} wanted per engine"
    )
    long = s.max_context or LONG_CONTEXT
    if s.window_layers and long > p.context:
        lines.append(
            f"    at {long:,} tokens the KV cache is {s.kv_ratio(long):.4f} of all-full attention "
            f"({s.window_layers} layers hold {s.window:,} tokens, {s.num_layers - s.window_layers} "
            "hold all)"
        )

    lines.append(f"trainer per {unit} (FSDP2 over {p.ranks} rank(s); micro-batch {p.micro_tokens:,} tokens)")
    lines.append(f"  weights      {g(p.t_weights)}   base as {p.base_label} ({p.base_format_why}), sharded")
    lines.append(
        f"  LoRA state   {g(p.t_lora_state)}   {_b(p.lora_params_trainer)} LoRA parameters + "
        "gradients + AdamW m, v; sharded"
    )
    if p.base_format != "nvfp4":
        what = f"two decoder layers ({_b(s.largest_layer_params())} each) + embeddings/output"
    elif p.ranks == 1:
        what = (
            f"the computing decoder layer ({_b(s.largest_layer_params())}) packed (FSDP's one-rank copy) "
            "and dequantized"
        )
    else:
        what = (
            f"two decoder layers packed, the computing one dequantized ({_b(s.largest_layer_params())} "
            "each) + embeddings/output"
        )
    lines.append(f"  gathered     {g(p.t_gathered)}   {what}")
    lines.append(
        f"  activations  {g(p.t_activations)}   of which the LM head's logits {p.t_logits / GiB:.2f} GiB "
        f"({p.logits_tokens:,} tokens at once)"
    )
    lines.append(f"  runtime      {g(p.t_runtime)}")
    lines.append(f"  peak         {g(p.t_peak)}")

    if not p.num_gpus:
        lines.append("verdict: CPU run (resources.num_gpus = 0): figures are per process, no GPU check")
        return "\n".join(lines)
    lines.append("verdict: " + ("FITS" if p.fits else "DOES NOT FIT"))
    for name, ok, why in p.verdicts:
        lines.append(f"  {'ok  ' if ok else 'OVER'} {name}: {why}")
    margin = p.margin
    if margin is not None:
        lines.append(f"  margin: {margin / GiB:.1f} GiB a GPU at the tightest check")
    if p.suggestions:
        lines.append("what to change:")
        lines += [f"  - {x}" for x in p.suggestions]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from rl.config import load_config

    cfg = load_config(args.recipe, args.overrides)
    p = make_plan(cfg)
    print(format_plan(p, args.recipe))
    print(time_block(cfg, p, args.prompt_len, args.response_len))
    return 0 if p.fits or not p.num_gpus else 1


def time_block(cfg, p: Plan, prompt_len: float = 0, response_len: float = 0) -> str:
    """The step-time estimate (rl/plan_time.py) and, for a MoE model on trainer ranks spanning GPUs, the step
    at expert-parallel sizes 1, resources.gpus_per_node and trainer.num_ranks."""
    from rl import plan_time

    lines = plan_time.format_time(plan_time.estimate_step(cfg, p, prompt_len, response_len))
    tr, res = cfg.trainer, cfg.resources
    if p.shape.num_experts and res.num_gpus and tr.num_ranks > 1:
        sizes = sorted({1, min(res.gpus_per_node, tr.num_ranks), tr.num_ranks})
        plans = lambda c: make_plan(c, advise=False)  # noqa: E731
        lines += plan_time.format_compare(plan_time.compare_ep(cfg, plans, sizes, prompt_len, response_len))
    return "\n".join(lines)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="memory per GPU for rollout and trainer, whether the recipe fits; the step's time by phase",
        description="Estimate memory per GPU for the recipe's rollout engines and trainer ranks (weights in "
        "their stored format, KV cache with sliding-window layers at their window, LoRA, "
        "optimizer state, activations), say whether it fits and what to change; then the step's time by phase "
        "from rl/rates.yaml's rates (rl/plan_time.py). Exit code 1 when it does not fit.",
    )
    p.add_argument("recipe", metavar="RECIPE")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="config overrides, e.g. rollout.max_model_len=1048576 or resources.gpu_memory_gib=288 (the GPU's "
        "memory; default 140, an H200)",
    )
    p.add_argument(
        "--prompt-len",
        type=float,
        default=0,
        help="expected prompt tokens for the step time (default rollout.max_prompt_len, the bound)",
    )
    p.add_argument(
        "--response-len",
        type=float,
        default=0,
        help="expected response tokens for the step time (default rollout.max_response_len, the bound)",
    )
    p.set_defaults(func=main)
    return p
