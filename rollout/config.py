"""The rollout side's section of the config, `rollout:` (the vLLM engines, their sampling, their placement).

The engines take it as it is (`rollout.spec.EngineSpec.rollout`): a new engine key is a field here and its use
in rollout/; rl/config.py composes it into the run's config. The driver reads the keys that shape a step
(`n`, `max_staleness`, `placement`, `num_workers`) from the same section.
"""

from dataclasses import dataclass
from typing import Any

from rl.core.options import option as _f

MOE_BACKENDS = ("auto", "marlin")
TOOL_PARSERS = ("json_tool_call", "none")
SEED_SCOPES = ("sample", "engine")


@dataclass
class RolloutConfig:
    """The vLLM rollout workers."""

    n: int = _f(8, "Samples per prompt (the GRPO group size).", ge=1)
    temperature: float = _f(
        1.0,
        "Sampling temperature; the trainer's log-probs and entropy are of the same tempered distribution.",
        gt=0,
    )
    top_p: float = _f(
        1.0,
        "Nucleus sampling threshold (1.0 = off); below 1 the trainer renormalises its log-probs over the same "
        "nucleus (a sort of the vocabulary per token in each log-prob and update pass).",
        gt=0,
        le=1,
    )
    max_prompt_len: int = _f(
        2048, "Longest prompt in tokens; longer prompts are dropped from the data.", ge=1
    )
    max_response_len: int = _f(4096, "Most tokens generated for one response.", ge=1)
    num_workers: int = _f(1, "Rollout engines (vLLM instances).", ge=1)
    tensor_parallel_size: int = _f(1, "GPUs per rollout engine.", ge=1)
    gpu_memory_utilization: float = _f(
        0.5,
        "Fraction of each GPU's memory vLLM may take (weights and KV cache). Colocated on GPUs, the KV cache "
        "is this fraction less what `sparkrl plan` counts beside it (vLLM's own profile misjudges it in "
        "sleep mode); `engine_args: {kv_cache_memory_bytes: N}` sets it outright.",
        gt=0,
        le=1,
    )
    max_model_len: int = _f(
        0,
        "vLLM context length (0 = max_prompt_len + the longer of max_response_len and "
        "`eval.max_response_len`).",
        ge=0,
    )
    enforce_eager: bool = _f(False, "Disable CUDA graphs (faster start, slower decode).")
    max_num_seqs: int = _f(256, "Most sequences a vLLM engine decodes at once.", ge=1)
    seed: int = _f("${run.seed}", "Sampling seed.")
    seed_scope: str = _f(
        "sample",
        "sample: a seed per sample, reproducible whatever the batching, a resumed run included (vLLM draws "
        "seeded noise one request at a time: the largest host cost of a big decode batch); engine: the "
        "engine's generator, one draw per step, samples not reproducible.",
        SEED_SCOPES,
    )
    cpu_kvcache_gb: float = _f(
        0.0, "KV cache size in GiB on the vLLM CPU backend (0 = vLLM's default).", ge=0
    )
    placement: str = _f(
        "colocated",
        "Share GPUs with the trainer (colocated) or use GPUs of their own (split).",
        ("colocated", "split"),
    )
    max_staleness: int = _f(
        0,
        "Adapter versions a batch may lag the update it trains (0 = synchronous). k > 0: the next k batches "
        "are generated while the trainer updates, batch j by adapter j-1-k; the trainer scores each with "
        "its generating version for the on-policy check (split placement on GPUs). The lag is weighed by "
        "algorithm.rollout_correction (mode auto: TIS cap 2 and MIS bounds [0.5, 2] unless caps are named; "
        "without a correction the CPU demo stopped learning, docs/benchmarks.md).",
        ge=0,
    )
    enable_prefix_caching: bool = _f(
        True,
        "Reuse the KV cache of a shared prompt across its n samples, and of an episode's earlier turns "
        "(rollout.env): each turn's context extends the last. Whole KV blocks only: on CPU, where vLLM's block "
        "is 128 tokens, `rollout.engine_args: {block_size: 32}` lets shorter turns be reused.",
    )
    moe_backend: str = _f(
        "auto",
        "MoE kernel for quantized experts (marlin: weight-only FP4 on Hopper).",
        MOE_BACKENDS,
    )
    env: str = _f(
        "",
        "Multi-turn episodes: your environment class by import path, `path/to/file.py:Name` (relative to the "
        "recipe's directory), built per episode from the prompt's row; empty = one turn (docs/environments.md).",
    )
    env_kwargs: dict[str, Any] = _f({}, "Keyword arguments passed to every environment `rollout.env` builds.")
    tool_parser: str = _f(
        "json_tool_call",
        'How tool calls are read from an assistant turn: json_tool_call (`<tool_call>{"name": ..., '
        '"arguments": {...}}</tool_call>`, Qwen / Hermes style), none (the environment reads the text).',
        TOOL_PARSERS,
    )
    max_turns: int = _f(1, "Most assistant turns of an episode (with `rollout.env`).", ge=1)
    max_total_tokens: int = _f(
        0,
        "Most tokens of an episode: its prompt, every generated turn and the environment's messages (0 = "
        "max_prompt_len + max_response_len, the trainer's sequence bound); each turn also generates at most "
        "max_response_len tokens.",
        ge=0,
    )
    env_workers: int = _f(8, "Threads a rollout worker runs environment steps in, at once.", ge=1)
    env_timeout_s: float = _f(
        60.0,
        "Longest one environment step may run, from when it begins (not from its wait for one of "
        "rollout.env_workers); a step past it ends its episode, its thread left to finish (0 = no limit).",
        ge=0,
    )
    engine_args: dict[str, Any] = _f(
        {},
        "Further `vllm.LLM` keyword arguments, passed as they are and over the ones sparkrl sets, e.g. "
        "`{compilation_config: {cudagraph_mode: FULL_DECODE_ONLY}}` or `{max_num_batched_tokens: 8192}`.",
    )


def engine_setting(ro: RolloutConfig, key: str, default: Any = None) -> Any:
    """A vLLM setting as the engine gets it: `rollout.engine_args`' value over the `rollout:` key of that
    name (rollout.worker.engine_kwargs passes engine_args last), else `default`."""
    return ro.engine_args[key] if key in ro.engine_args else getattr(ro, key, default)
