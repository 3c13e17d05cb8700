"""What a trainer worker is given: the run's `trainer:` and `lora:` sections as they are (trainer/config.py),
the loss's knobs (rl.core.algo.AlgoConfig, resolved once from `algorithm:`), and the facts the driver
resolved for this run. A small dataclass that crosses Ray process boundaries; the worker never sees the
rest of the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl.core.algo import AlgoConfig
from trainer.config import LoraConfig, TrainerConfig

DTYPES = ("bfloat16", "float32")
BASE_FORMATS = ("bf16", "nvfp4")


@dataclass
class TrainerSpec:
    model_path: str
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    dtype: str = "bfloat16"  # compute dtype of the frozen base weights; LoRA weights are always fp32
    head_dtype: str = "float32"  # the LM head's logits: float32 (unrounded) or model (rounded to dtype)
    # `trainer.base_format` resolved against the checkpoint: how the frozen base weights that an NVFP4
    # checkpoint holds packed live in the trainer (trainer/nvfp4_tensor.py): nvfp4 = packed, dequantized
    # per layer after FSDP's all-gather; bf16 = the checkpoint's dequantized twin
    base_format: str = "bf16"
    max_seq_len: int = 4096  # prompt + response; a longer sample is an error
    # the rollout's sampling distribution: log-probs and entropy are those of logits / temperature over the
    # top_p nucleus, what the sampler drew from (vLLM's processed log-probs; trainer/logprobs.py)
    temperature: float = 1.0
    top_p: float = 1.0
    trust_remote_code: bool = False  # model code shipped with the checkpoint (transformers)
    # the learning-rate schedule's length: trainer.total_steps times the optimizer steps a batch makes
    optimizer_steps: int = 100
    r3: bool = True
    # with r3: also score each batch with live routing and report r3/live_k3_kl (one more no-grad forward)
    r3_live_kl: bool = False
    # older adapter versions each rank keeps (its shards) to score a batch with the version that generated
    # it: rollout.max_staleness (trainer/versions.py)
    keep_versions: int = 0
    seed: int = 0
    # PEFT's meaning: True = B starts at 0 (a no-op adapter); False = B random too (tests: gradients reach A)
    init_lora_weights: bool = True

    @property
    def micro_batch_tokens(self) -> int:
        """Padded tokens per forward/backward (0 = no limit): `trainer.micro_batch_tokens`, raised to
        max_seq_len so that the longest allowed sample fits in one."""
        budget = self.trainer.micro_batch_tokens
        return max(budget, self.max_seq_len) if budget else 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainerSpec.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.base_format not in BASE_FORMATS:
            raise ValueError(
                f"TrainerSpec.base_format must be one of {BASE_FORMATS}, got {self.base_format!r}"
            )
        if self.keep_versions < 0:
            raise ValueError(f"TrainerSpec.keep_versions must be >= 0, got {self.keep_versions}")
        if not self.temperature > 0:
            raise ValueError(f"TrainerSpec.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"TrainerSpec.top_p must be in (0, 1], got {self.top_p}")
        if self.max_seq_len < 2:
            raise ValueError(f"TrainerSpec.max_seq_len must be >= 2, got {self.max_seq_len}")
