"""What the driver hands the rollout side: the engine (its config section and what the run resolved), sampling
settings and prompts.

Plain dataclasses (no vLLM import) so that the driver can build them without loading vLLM and they cross
Ray process boundaries cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.config import MOE_BACKENDS, SEED_SCOPES, RolloutConfig


@dataclass
class EngineSpec:
    """One vLLM engine: the `rollout:` section as it is (its engine keys map to `vllm.LLM` arguments in
    rollout/worker.py) and what the run resolved around it (the weights, the context length, the seed, LoRA,
    R3, sleep mode)."""

    model_path: str
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    dtype: str = "bfloat16"
    head_dtype: str = "float32"  # the LM head's logits: float32 or model (vLLM's `head_dtype` override)
    max_model_len: int = 0  # 0 = the model's own context length
    seed: int = 0  # rollout.seed resolved (its default interpolates run.seed)
    enable_lora: bool = False
    max_lora_rank: int = 16
    # Expert LoRA shipped in PEFT's stacked 3D layout, which vLLM splits per expert itself (4 tensors per
    # MoE layer instead of 6 per expert; rollout/adapter_layout.py); not a `vllm.LLM` argument alone: it
    # also sets `enable_mixed_moe_lora_format` and each request's `is_3d_lora_weight` (sync.expert_layout).
    lora_experts_stacked: bool = True
    return_routed_experts: bool = False  # R3: capture each token's experts (MoE models only)
    # R3: read each sample's routing once, as it finishes (rollout/vllm_ext.py), not vLLM's per-step stream
    # (not a `vllm.LLM` argument: it picks the engine's scheduler class)
    routing_at_finish: bool = True
    # R3 in a run: each sample's routing is put in the object store of this worker's node and the Sample
    # carries the reference (Sample.routing_ref), not the array; needs the worker to run in Ray
    routing_by_reference: bool = False
    enable_sleep_mode: bool = False  # colocated placement: free the GPU while the trainer runs
    # With sleep mode: what `sparkrl plan` puts beside the KV cache on each TP rank (weights, LoRA slot,
    # activations, runtime); the KV cache is then gpu_memory_utilization x the GPU's memory less this
    # (vLLM's `kv_cache_memory_bytes`, engine_kwargs). Under sleep mode vLLM's own profile counts the sleep
    # allocator's pool wrongly and can take more than gpu_memory_utilization (measured on an H100: 54.4 GiB
    # of KV cache for a 0.55 x 80 GiB budget beside 21 GiB of weights), which the trainer beside it cannot
    # spare. 0: vLLM's profile sizes it.
    non_kv_bytes: int = 0
    # the GPU's memory as resources.gpu_memory_gib says, for an engine whose own process sees no GPU
    gpu_bytes: int = 0
    # LoRA on a Hopper GPU: the single-slice lora_expand kernel's N block (vLLM's 128 gives NaN on sm90);
    # 0 leaves vLLM's configs. Not a `vllm.LLM` argument: vLLM's tuned-config folder (rollout/lora_kernels.py).
    hopper_lora_expand_block_n: int = 32
    trust_remote_code: bool = False
    # data.chat_template_kwargs: the template's variables the prompts were rendered with; multi-turn
    # episodes render the environments' messages and each next generation prompt with them too
    chat_template_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        ro = self.rollout
        if not self.model_path:
            raise ValueError("EngineSpec.model_path is empty")
        if ro.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"rollout.moe_backend must be one of {MOE_BACKENDS}, got {ro.moe_backend!r}")
        if ro.tensor_parallel_size < 1:
            raise ValueError(f"rollout.tensor_parallel_size must be >= 1, got {ro.tensor_parallel_size}")
        if self.hopper_lora_expand_block_n < 0:
            raise ValueError(
                f"EngineSpec.hopper_lora_expand_block_n must be >= 0, got {self.hopper_lora_expand_block_n}"
            )
        if self.max_lora_rank < 1:
            raise ValueError(f"EngineSpec.max_lora_rank must be >= 1, got {self.max_lora_rank}")


@dataclass
class EngineBundles:
    """Where one engine's TP ranks run when vLLM's Ray executor places them (colocated placement, TP > 1):
    one placement-group bundle a rank, all on one node (rl.placement), and the share of each bundle's GPU a
    rank takes (the trainer rank colocated there holds the rest). The engine's own actor is scheduled in
    the first bundle."""

    bundle_indices: list[int]
    gpus_per_rank: float

    def __post_init__(self):
        if len(set(self.bundle_indices)) != len(self.bundle_indices) or not self.bundle_indices:
            raise ValueError(
                f"EngineBundles.bundle_indices must be distinct and not empty: {self.bundle_indices}"
            )
        if not 0 < self.gpus_per_rank <= 1:
            raise ValueError(f"EngineBundles.gpus_per_rank must be in (0, 1], got {self.gpus_per_rank}")


@dataclass
class SamplingSpec:
    """How to sample: `n` responses per prompt. `top_k` <= 0 and `top_p` = 1 mean off."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    # Request i's samples use seeds seed + i * n ... seed + i * n + n - 1 (None: the engine's generator),
    # i its index in the whole batch (a pool's workers each get a share: see `request_seed`).
    seed: int | None = None
    # "sample": the seeds above; "engine": no request seeds, noise from the engine's generator (seeded once
    # at start): one draw per decode step instead of one per request, and no reproducible samples.
    seed_scope: str = "sample"
    stop_token_ids: list[int] | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingSpec.n must be >= 1, got {self.n}")
        if self.temperature <= 0:
            raise ValueError(
                f"SamplingSpec.temperature must be > 0 (log-probs are taken after temperature), got "
                f"{self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSpec.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingSpec.max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed_scope not in SEED_SCOPES:
            raise ValueError(f"SamplingSpec.seed_scope must be one of {SEED_SCOPES}, got {self.seed_scope!r}")

    def request_seed(self, index: int) -> int | None:
        """vLLM's seed for the request at `index` of the whole batch (its n samples take seed .. seed + n - 1)."""
        if self.seed is None or self.seed_scope == "engine":
            return None
        return self.seed + index * self.n


@dataclass
class PromptRequest:
    """One prompt (already tokenized, chat template applied); it yields `SamplingSpec.n` samples."""

    prompt_ids: list[int]
    group: int
    data_source: str = ""
    ground_truth: str = ""
    # The dataset row a multi-turn environment is built from (`rollout.env`): data_source, ground_truth,
    # extra_info, index. None for one-turn rollouts, which do not need it.
    row: dict | None = None

    def __post_init__(self):
        if len(self.prompt_ids) == 0:
            raise ValueError(f"PromptRequest of group {self.group} has no prompt tokens")
