"""The torch model of Muse Spark Open's text decoder, as the trainer runs it (transformers conventions).

Block: `x + post_norm(F(norm(x)))` for both the attention and the MoE (sandwich norm). Attention: RMS-normed
queries and keys, RoPE, a sliding window on three layers in four, each head's output RMS-normed and scaled
by a sigmoid gate computed from the block's input. MoE: the router reads the full-width token; a pooler
squeezes the token to the latent width, the top-k experts (SwiGLU) work there, an unpooler restores the
width. Parameter names follow transformers' Qwen3-MoE where they can (`mlp.gate`, fused
`mlp.experts.gate_up_proj` [E, 2I, latent] and `mlp.experts.down_proj` [E, latent, I]), so PEFT's
`target_parameters` and the routing replay treat both models alike. On disk experts are per expert
(`mlp.experts.{e}.{gate,up,down}_proj.weight`): the layout vLLM and NVFP4 checkpoints use.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from rl.models.muse.configuration_muse import SLIDING, MuseSparkConfig

logger = logging.getLogger(__name__)

# Keys of the full (multimodal) checkpoint that this text-only model does not hold: the vision tower and the
# audio encoder with their projectors. The RL recipe does not train them.
ENCODER_KEY_PATTERN = r"^(model\.)?(vision|visual|audio|multi_modal|mm_)[^.]*\."


class MuseSparkRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class MuseSparkAttention(nn.Module):
    def __init__(self, config: MuseSparkConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == SLIDING else None
        h, q_out, kv_out = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            config.num_key_value_heads * self.head_dim,
        )
        self.q_proj = nn.Linear(h, q_out, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, kv_out, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, kv_out, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_out, h, bias=config.attention_bias)
        # One gate value a head (or a channel, "elementwise"), from the same normed input as q/k/v.
        self.g_proj = nn.Linear(h, self.num_heads if config.head_gate == "headwise" else q_out, bias=False)
        self.q_norm = MuseSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = MuseSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_norm = MuseSparkRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )
        out = self.o_norm(out.reshape(*input_shape, self.num_heads, self.head_dim))  # [B, T, heads, d]
        gate = torch.sigmoid(self.g_proj(hidden_states)).view(*input_shape, self.num_heads, -1)
        out = (out * gate).reshape(*input_shape, -1)
        return self.o_proj(out), weights


@use_experts_implementation
class MuseSparkExperts(nn.Module):
    """The layer's experts, SwiGLU at the latent width, held fused like transformers' Qwen3-MoE experts."""

    def __init__(self, config: MuseSparkConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.moe_latent_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim)
        )
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.unique(top_k_index).tolist()
        for e in hit:
            token_idx, slot = torch.where(top_k_index == e)
            gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


class MuseSparkTopKRouter(nn.Module):
    """Softmax over all experts (fp32), top-k, optional renormalisation; outputs (logits, weights, ids).

    Routing replay (R3): set `replay = (ids [N, k] long, valid [N] bool)` (or use `replay_output` from a
    forward hook, as trainer/routing_replay.py does). Replayed rows take the given ids; their weights still
    come from the live logits gathered at those ids, so gradients reach the router.
    """

    def __init__(self, config: MuseSparkConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.hidden_dim = config.hidden_size
        self.weight = nn.Parameter(torch.zeros(self.num_experts, self.hidden_dim))
        self.replay: tuple[torch.Tensor, torch.Tensor] | None = None

    def weights_at(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        top = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, ids)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype)

    def replay_output(self, output: tuple, ids: torch.Tensor, valid: torch.Tensor) -> tuple:
        """The router's `output` with rows where `valid` routed to `ids` instead (R3 adapter signature)."""
        logits, _, live_ids = output
        idx = torch.where(valid[:, None].to(live_ids.device), ids.to(live_ids.device).long(), live_ids)
        return logits, self.weights_at(logits, idx), idx

    def forward(self, hidden_states: torch.Tensor):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        ids = torch.topk(probs, self.top_k, dim=-1).indices
        output = (logits, self.weights_at(logits, ids), ids)
        if self.replay is not None:
            output = self.replay_output(output, *self.replay)
        return output


class MuseSparkLatentMoE(nn.Module):
    def __init__(self, config: MuseSparkConfig):
        super().__init__()
        self.gate = MuseSparkTopKRouter(config)
        self.pooler = nn.Linear(config.hidden_size, config.moe_latent_size, bias=False)
        self.experts = MuseSparkExperts(config)
        self.unpooler = nn.Linear(config.moe_latent_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        _, weights, ids = self.gate(flat)  # the router sees the full-width token, not the pooled one
        # The unpooler is linear and bias-free, so applying it after the weighted expert sum is exact.
        return self.unpooler(self.experts(self.pooler(flat), ids, weights)).reshape(shape)


class MuseSparkDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MuseSparkConfig, layer_idx: int):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = MuseSparkAttention(config, layer_idx)
        self.mlp = MuseSparkLatentMoE(config)
        eps = config.rms_norm_eps
        self.input_layernorm = MuseSparkRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = MuseSparkRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = MuseSparkRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = MuseSparkRMSNorm(config.hidden_size, eps)

    def forward(
        self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs
    ):
        attn, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            **kwargs,
        )
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        moe = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(moe)


class MuseSparkPreTrainedModel(PreTrainedModel):
    config: MuseSparkConfig
    config_class = MuseSparkConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MuseSparkDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _keys_to_ignore_on_load_unexpected = [ENCODER_KEY_PATTERN]
    _can_record_outputs = {
        "router_logits": OutputRecorder(MuseSparkTopKRouter, index=0),
        "hidden_states": MuseSparkDecoderLayer,
        "attentions": MuseSparkAttention,
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, MuseSparkExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, MuseSparkTopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        skipped = _encoder_keys(pretrained_model_name_or_path)
        if skipped:
            logger.warning(
                "Muse Spark: loading the text decoder only; skipping %d vision/audio encoder weights (%s, ...): "
                "the RL recipe does not train them",
                len(skipped),
                skipped[0],
            )
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


def _encoder_keys(path) -> list[str]:
    """Checkpoint keys of a local model directory that belong to the vision/audio encoders."""
    path = Path(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
    if path is None or not path.is_dir():
        return []
    index = path / "model.safetensors.index.json"
    if index.exists():
        keys = list(json.loads(index.read_text())["weight_map"])
    else:
        from safetensors import safe_open

        keys = []
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(f, "pt") as sf:
                keys += list(sf.keys())
    pattern = re.compile(ENCODER_KEY_PATTERN)
    return sorted(k for k in keys if pattern.search(k))


class MuseSparkModel(MuseSparkPreTrainedModel):
    def __init__(self, config: MuseSparkConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [MuseSparkDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = MuseSparkRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> MoeModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (
                torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen
            ).unsqueeze(0)
        mask_mapping = attention_mask
        if not isinstance(mask_mapping, dict):  # generate() may pass the per-type masks already built
            mask_kwargs = dict(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                position_ids=position_ids,
            )
            mask_mapping = {"full_attention": create_causal_mask(**mask_kwargs)}
            if SLIDING in self.config.layer_types:
                mask_mapping[SLIDING] = create_sliding_window_causal_mask(**mask_kwargs)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = layer(
                hidden_states,
                attention_mask=mask_mapping[layer.attention_type],
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                **kwargs,
            )
        return MoeModelOutputWithPast(
            last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values
        )


class MuseSparkForCausalLM(MuseSparkPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MuseSparkConfig):
        super().__init__(config)
        self.model = MuseSparkModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> MoeCausalLMOutputWithPast:
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs) if labels is not None else None
        return MoeCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


__all__ = ["MuseSparkForCausalLM", "MuseSparkModel", "MuseSparkPreTrainedModel", "MuseSparkTopKRouter"]
