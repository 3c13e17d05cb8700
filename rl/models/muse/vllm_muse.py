"""Muse Spark Open's text decoder in vLLM (0.26 and 0.30), the rollout side of modeling_muse.py. vLLM's
processes import it through the plugin (rl.models.register_vllm_models), so the driver and the trainer never
load vLLM through it.

Follows vLLM's qwen3_moe.py: parallel linear layers, a fused MoE (`experts`) fed the router logits we
compute, so vLLM's router inside it picks the top-k and the routed-experts capture (R3) records it, and
a load_weights that maps checkpoint names onto the packed layers. What differs from Qwen3-MoE:
- sandwich norm: each block is `x + post_norm(F(norm(x)))`, for attention and for the MoE;
- attention: after the attention op each head's output is RMS-normed, then scaled by
  `sigmoid(g_proj(x))` (one value a head, or a channel with `head_gate: elementwise`); three layers in
  four use a sliding window (`per_layer_sliding_window`, from `config.layer_types`);
- latent MoE: the router reads the full-width token, a pooler squeezes it to `moe_latent_size`, the
  experts work there, an unpooler restores the width.
LoRA reaches attention (q/k/v/o/g), the pooler and unpooler, and the experts (vLLM's fused-MoE LoRA).
NVFP4 compressed-tensors checkpoints load through `quant_config` like any other vLLM model.
"""

# No `from __future__ import annotations`: @support_torch_compile reads forward()'s real type hints.
from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsLoRA, SupportsPP
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    WeightsMapper,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

from rl.core.compat import vllm_fused_moe_factory

logger = init_logger(__name__)

SLIDING = "sliding_attention"
# Checkpoint prefixes of the multimodal encoders (vision tower, audio encoder, their projectors): the
# rollout generates text only, so their weights are skipped. Same rule as modeling_muse.py.
ENCODER_PREFIXES = ("vision", "visual", "audio", "multi_modal", "mm_")


def _is_encoder_weight(name: str) -> bool:
    return name.removeprefix("model.").startswith(ENCODER_PREFIXES)


class MuseSparkAttention(nn.Module):
    def __init__(self, config, layer_idx: int, cache_config=None, quant_config=None, prefix: str = ""):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = config.num_key_value_heads
        assert self.total_num_heads % tp == 0
        self.num_heads = self.total_num_heads // tp
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        hidden = config.hidden_size
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            hidden,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            hidden,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        # Column-parallel over heads: each rank gets the gates of its own heads.
        gate_per_head = 1 if config.head_gate == "headwise" else self.head_dim
        self.g_proj = ColumnParallelLinear(
            hidden,
            self.total_num_heads * gate_per_head,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.g_proj",
        )
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = get_rope(
            self.head_dim, max_position=config.max_position_embeddings, rope_parameters=config.rope_parameters
        )
        sliding = config.layer_types[layer_idx] == SLIDING
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=config.sliding_window if sliding else None,
            prefix=f"{prefix}.attn",
        )

    def _per_head(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x.view(*x.shape[:-1], -1, self.head_dim)).view(x.shape)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, self._per_head(q, self.q_norm), self._per_head(k, self.k_norm))
        out = self._per_head(self.attn(q, k, v), self.o_norm)
        gate, _ = self.g_proj(hidden_states)
        out = out.view(-1, self.num_heads, self.head_dim) * torch.sigmoid(gate).view(
            -1, self.num_heads, gate.shape[-1] // self.num_heads
        )
        out, _ = self.o_proj(out.view(-1, self.q_size))
        return out


class MuseSparkLatentMoE(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        if get_tensor_model_parallel_world_size() > config.num_experts:
            raise ValueError(f"tensor parallel size exceeds the {config.num_experts} experts")
        self.n_routed_experts = config.num_experts
        # The router stays in high precision (NVFP4 checkpoints ignore `mlp.gate`) and reads the full width.
        self.gate = ReplicatedLinear(
            config.hidden_size, config.num_experts, bias=False, quant_config=None, prefix=f"{prefix}.gate"
        )
        self.pooler = ReplicatedLinear(
            config.hidden_size,
            config.moe_latent_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.pooler",
        )
        # No `gate=` here: we hand the experts router logits computed from the full-width token while they
        # run on the pooled one. vLLM's router inside still does softmax + top-k (+ renormalise), and that
        # router is where the routed-experts capture hooks in.
        self.experts = vllm_fused_moe_factory()(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.moe_latent_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
        )
        self.unpooler = ReplicatedLinear(
            config.moe_latent_size,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.unpooler",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits, _ = self.gate(hidden_states)
        latent, _ = self.pooler(hidden_states)
        # The experts' output is already summed over tensor-parallel ranks; the unpooler is replicated.
        out = self.experts(hidden_states=latent, router_logits=router_logits)
        out, _ = self.unpooler(out)
        return out


class MuseSparkDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        layer_idx = extract_layer_index(prefix)
        self.self_attn = MuseSparkAttention(
            config,
            layer_idx,
            vllm_config.cache_config,
            vllm_config.quant_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = MuseSparkLatentMoE(config, vllm_config.quant_config, prefix=f"{prefix}.mlp")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps=eps)
        self.post_attention_layernorm = RMSNorm(h, eps=eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps=eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps=eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's fused add+norm: `norm(x, residual)` returns (norm(x + residual), x + residual). With the
        # post-norms the block sum is `residual + post_norm(F(...))`, kept un-normed in `residual`.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


@support_torch_compile
class MuseSparkModel(nn.Module):
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".q_proj": (".qkv_proj", "q"),
            ".k_proj": (".qkv_proj", "k"),
            ".v_proj": (".qkv_proj", "v"),
        }
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.vocab_size = config.vocab_size
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.embed_tokens",
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: MuseSparkDecoderLayer(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(
            self, ignore_unexpected_suffixes=[".bias", "_bias", ".input_scale", "_input_scale"]
        )
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)


class MuseSparkForCausalLM(nn.Module, SupportsLoRA, SupportsPP):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
    fall_back_to_pt_during_load = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = MuseSparkModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=self.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.moe_layers = [
            layer.mlp.experts for layer in self.model.layers if not isinstance(layer, PPMissingLayer)
        ]
        self.num_moe_layers = len(self.moe_layers)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped = 0
        tied = self.config.tie_word_embeddings  # a tied lm_head is the embedding: nothing to load into it

        def text_only(ws):
            nonlocal skipped
            for name, tensor in ws:
                if _is_encoder_weight(name):
                    skipped += 1
                elif not (tied and name.startswith("lm_head.")):
                    yield name, tensor

        loaded = AutoWeightsLoader(self).load_weights(text_only(weights))
        if skipped:
            logger.info(
                "Muse Spark: text-only rollout model; skipped %d vision/audio encoder weights", skipped
            )
        return loaded
