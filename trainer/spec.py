"""What a trainer worker needs to know, as small dataclasses that cross Ray process boundaries.

The driver fills these from the resolved config (`rl.config`); the trainer never reads the config tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl.core.algo import AlgoConfig

DTYPES = ("bfloat16", "float32")
BASE_FORMATS = ("bf16", "nvfp4")
SCHEDULES = ("constant", "cosine")


@dataclass
class LoraSpec:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # Module names (last path component), each one adapted wherever the model has it; every name must exist
    modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    experts: bool = True  # the fused routed experts (PEFT target_parameters)
    latent: bool = False  # latent MoE pooler/unpooler (Muse; ignored by models that have none)
    extra: str = ""  # regex, matched in full (re.fullmatch) against full module names; "" = none
    # PEFT's meaning: True = B starts at 0 (a no-op adapter); False = B random too (tests: gradients reach A)
    init_lora_weights: bool = True


@dataclass
class OptimSpec:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    total_steps: int = 100
    schedule: str = "constant"
    min_lr_ratio: float = 0.0  # cosine only: the final lr as a fraction of lr
    grad_clip: float = 1.0  # 0 = measure the norm, do not clip


@dataclass
class TrainerSpec:
    model_path: str
    dtype: str = "bfloat16"  # compute dtype of the frozen base weights; LoRA weights are always fp32
    lora: LoraSpec = field(default_factory=LoraSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    mini_batch_size: int = 0  # prompts (whole groups) per optimizer step; 0 = the whole batch
    ppo_epochs: int = 1  # passes over each batch
    micro_batch_size: int = 0  # samples per forward/backward (0 = no limit)
    micro_batch_tokens: int = 0  # padded tokens per forward/backward (0 = no limit)
    max_seq_len: int = 4096  # prompt + response; a longer sample is an error
    r3: bool = True
    # with r3: also score each batch with live routing and report r3/live_k3_kl (one more no-grad forward)
    r3_live_kl: bool = False
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile each decoder layer (CUDA only: the worker ignores it on CPU)
    # > 0 with compile: the partitioner recomputes within this budget instead of whole-layer checkpointing
    activation_memory_budget: float = 0.0
    # LM-head rows per chunk when computing log-probs and entropy (trainer/logprobs.py); 0 = all at once
    logits_chunk_tokens: int = 1024
    # how the frozen base weights that an NVFP4 checkpoint holds packed live in the trainer
    # (trainer/nvfp4_tensor.py): nvfp4 = packed, dequantized per layer after FSDP's all-gather;
    # bf16 = the checkpoint's dequantized twin
    base_format: str = "bf16"
    # older adapter versions each rank keeps (its shards) to score a batch with the version that generated
    # it: rollout.max_staleness (trainer/versions.py)
    keep_versions: int = 0
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainerSpec.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.base_format not in BASE_FORMATS:
            raise ValueError(
                f"TrainerSpec.base_format must be one of {BASE_FORMATS}, got {self.base_format!r}"
            )
        if self.keep_versions < 0:
            raise ValueError(f"TrainerSpec.keep_versions must be >= 0, got {self.keep_versions}")
        if self.logits_chunk_tokens < 0:
            raise ValueError(f"TrainerSpec.logits_chunk_tokens must be >= 0, got {self.logits_chunk_tokens}")
        if self.optim.schedule not in SCHEDULES:
            raise ValueError(
                f"TrainerSpec.optim.schedule must be one of {SCHEDULES}, got {self.optim.schedule!r}"
            )
        if self.mini_batch_size < 0 or self.ppo_epochs < 1:
            raise ValueError(
                f"TrainerSpec: mini_batch_size must be >= 0 and ppo_epochs >= 1, got {self.mini_batch_size}, "
                f"{self.ppo_epochs}"
            )
        if self.micro_batch_size < 0 or self.micro_batch_tokens < 0:
            raise ValueError("TrainerSpec.micro_batch_size and micro_batch_tokens must be >= 0")
        if not 0.0 <= self.activation_memory_budget <= 1.0:
            raise ValueError(
                f"TrainerSpec.activation_memory_budget must be in [0, 1], got {self.activation_memory_budget}"
            )
        if self.max_seq_len < 2:
            raise ValueError(f"TrainerSpec.max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.micro_batch_tokens and self.micro_batch_tokens < self.max_seq_len:
            raise ValueError(
                f"TrainerSpec.micro_batch_tokens ({self.micro_batch_tokens}) is below max_seq_len "
                f"({self.max_seq_len}): the longest allowed sample would not fit in a micro-batch"
            )
