"""The trainer's sections of the config: `trainer:` (the FSDP2 workers, the optimizer, the checkpoints) and
`lora:` (the adapter). The trainer workers take them as they are (`trainer.spec.TrainerSpec`): a new key
is a field here and its use in the trainer; rl/config.py composes them into the run's config.
"""

from dataclasses import dataclass

from rl.core.options import option as _f


@dataclass
class TrainerConfig:
    """The FSDP2 trainer workers and the optimizer."""

    total_steps: int = _f(100, "Training steps (one batch of prompts each).", ge=1)
    num_ranks: int = _f(1, "Trainer processes (one per GPU; gloo processes on CPU).", ge=1)
    lr: float = _f(1.0e-5, "Peak learning rate of the LoRA parameters.", gt=0)
    expert_parallel_size: int = _f(
        1,
        "Expert parallelism (EP): each MoE layer's routed experts (the frozen bank and their LoRA) are split "
        "over groups of this many consecutive trainer ranks, each rank holding num_experts / EP of them and "
        "never gathering the others; tokens travel to their experts by all-to-all. Must divide "
        "`trainer.num_ranks` and the model's expert count, and, on GPUs, a group must lie within one node "
        "(`resources.gpus_per_node`). The experts are FSDP-sharded over the `trainer.num_ranks` / EP ranks "
        "that hold the same ones; everything else over all ranks, as with 1.",
        ge=1,
    )
    lr_schedule: str = _f("constant", "Schedule after warm-up.", ("constant", "cosine"))
    warmup_steps: int = _f(0, "Linear warm-up from 0 to `trainer.lr`, in optimizer steps.", ge=0)
    min_lr_ratio: float = _f(
        0.0, "Final learning rate of the cosine schedule, as a fraction of `trainer.lr`.", ge=0, le=1
    )
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0)
    betas: list[float] = _f([0.9, 0.999], "AdamW betas [beta1, beta2], each in [0, 1).")
    eps: float = _f(1.0e-8, "AdamW epsilon.", gt=0)
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this (0 = no clipping).", ge=0)
    ppo_epochs: int = _f(
        1, "Passes over each batch, the groups dealt into mini-batches in a fresh order each pass.", ge=1
    )
    mini_batch_size: int = _f(
        0,
        "Prompts per optimizer step, each with all its `rollout.n` samples (a group is never split; 0 = the "
        "whole batch: one optimizer step per epoch). Every step after the first trains off the old "
        "log-probs, so the PPO clip engages.",
        ge=0,
    )
    micro_batch_tokens: int = _f(
        16384,
        "Token budget of one forward/backward per rank (sequences are packed "
        "up to it, padded to the longest; 0 = no token budget, `trainer.micro_batch_size` alone).",
        ge=0,
    )
    micro_batch_size: int = _f(
        0,
        "Most sequences in one forward/backward per rank (0 = no count limit); with `micro_batch_tokens` "
        "both limits hold.",
        ge=0,
    )
    activation_checkpointing: bool = _f(
        True,
        "Recompute each decoder layer's activations in backward (compiled layers with "
        "`trainer.activation_memory_budget` > 0 use that instead).",
    )
    compile: bool = _f(
        True,
        "torch.compile each decoder layer on GPU (fuses the element-wise work; the first "
        "step compiles for a minute or two). Ignored on CPU.",
    )
    activation_memory_budget: float = _f(
        0.0,
        "Compiled layers only (GPU, `trainer.compile`): instead of whole-layer checkpointing, the "
        "compiler picks what to recompute, keeping this fraction of the way from each compiled graph's "
        "inputs (0: about what whole-layer checkpointing keeps) to what it keeps without recomputation "
        "(1). 0 = off. Uncompiled layers (CPU, `trainer.compile=false`) ignore it and follow "
        "`trainer.activation_checkpointing`.",
        ge=0,
        le=1,
    )
    base_format: str = _f(
        "auto",
        "How the trainer holds the frozen base weights that an NVFP4 checkpoint (`model.path`) keeps "
        "packed: nvfp4 = packed (FP4 codes, FP8 block scales), sharded and all-gathered so, dequantized "
        "one layer at a time; bf16 = the checkpoint's dequantized twin; auto = nvfp4 for an NVFP4 "
        "checkpoint, else bf16.",
        ("auto", "bf16", "nvfp4"),
    )
    logits_chunk_tokens: int = _f(
        1024,
        "Tokens per LM-head call when computing log-probs and entropy (recomputed in backward): the "
        "[tokens, vocab] fp32 logits never exist whole (0 = one call for the whole micro-batch).",
        ge=0,
    )
    checkpoint_every: int = _f(50, "Save a checkpoint every N steps (0 = only at the end).", ge=0)
    keep_checkpoints: int = _f(
        3,
        "Newest checkpoints that verify kept, the one just written among them; damaged ones are moved to "
        "`checkpoints/damaged/`, not counted (0 = keep all).",
        ge=0,
    )
    max_skipped_steps: int = _f(
        3,
        "Consecutive steps skipped for a non-finite loss or gradient before the run fails (0 = never fail: "
        "every such step is skipped and counted).",
        ge=0,
    )


@dataclass
class LoraConfig:
    """The LoRA adapter: the only trained parameters."""

    rank: int = _f(32, "LoRA rank r.", ge=1)
    alpha: float = _f(64.0, "LoRA alpha; the update is scaled by alpha / r.", gt=0)
    dropout: float = _f(0.0, "Dropout on the LoRA input.", ge=0, lt=1)
    target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        "Module names (last path component) that get an adapter, each exactly as named, in every layer "
        "that has it; a name the model lacks is an error.",
    )
    target_experts: bool = _f(
        True,
        "Adapters on every routed expert's fused projections (gate_up_proj and down_proj); a dense model has "
        "none (nothing to target).",
    )
    target_latent: bool = _f(False, "Adapters on the latent MoE pooler and unpooler (Muse Spark Open).")
    extra: str = _f(
        "",
        "A regular expression: every module whose full name (as in the Hugging Face model, e.g. "
        "`model.layers.0.mlp.shared_expert.up_proj`) it matches in full also gets an adapter ('' = none). "
        "It must match at least one module and no router.",
    )
