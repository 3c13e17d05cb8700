"""`MuseSparkConfig`: the text decoder of Muse Spark Open (docs/design.md, Models).

The defaults are the announced model: 62 layers, all MoE, 256 experts working at a latent width of 4096
under a hidden width of 8192. Widths the announcement does not state are solved from its parameter counts:
96 query heads and 8 KV heads of 128 give 13.5B attention weights over 62 layers; an expert intermediate
size of 4096 gives 799B expert weights; a vocabulary of 201,088 gives 3.3B embedding + output weights.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from rl.models.muse import MODEL_TYPE

SLIDING, FULL = "sliding_attention", "full_attention"


def muse_layer_types(num_layers: int, cycle: int = 4) -> list[str]:
    """Three sliding-window layers then one full-attention layer, repeated, anchored so the last layer is
    full (counting from the end, not the start, is what makes 62 layers give 16 full ones)."""
    return [FULL if (num_layers - 1 - i) % cycle == 0 else SLIDING for i in range(num_layers)]


@strict
class MuseSparkConfig(PreTrainedConfig):
    r"""
    moe_latent_size (`int`): width the per-layer pooler squeezes each token to; the experts work at it.
    moe_intermediate_size (`int`): each expert's SwiGLU intermediate size.
    num_experts_per_tok (`int`): top-k of the router (42B active of 816B implies 6-8 of 256; default 8).
    norm_topk_prob (`bool`): renormalise the top-k softmax probabilities to sum to one (= softmax over the
        top-k logits).
    head_gate (`str`): "headwise" (one sigmoid gate a head, from a projection of the block's input) or
        "elementwise" (one a channel of each head).
    layer_types (`list[str]`): "sliding_attention" / "full_attention" a layer; computed from
        `attention_cycle` anchored at the last layer when not given.
    sliding_window (`int`): tokens a sliding-window layer attends to (itself included).
    """

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_local_experts": "num_experts"}

    vocab_size: int = 201088
    hidden_size: int = 8192
    num_hidden_layers: int = 62
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int = 128
    head_gate: str = "headwise"
    moe_latent_size: int = 4096
    moe_intermediate_size: int = 4096
    num_experts: int = 256
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    sliding_window: int = 2048
    attention_cycle: int = 4
    layer_types: list[str] | None = None
    max_position_embeddings: int = 1048576
    rope_parameters: RopeParameters | dict | None = None
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = muse_layer_types(self.num_hidden_layers, self.attention_cycle)
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        super().validate_architecture()
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(
                f"MuseSparkConfig: layer_types must hold {self.num_hidden_layers} entries of {SLIDING!r} / "
                f"{FULL!r}, got {self.layer_types}"
            )
        if self.head_gate not in ("headwise", "elementwise"):
            raise ValueError(
                f"MuseSparkConfig: head_gate must be 'headwise' or 'elementwise', got {self.head_gate!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("MuseSparkConfig: num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def num_full_layers(self) -> int:
        return self.layer_types.count(FULL)

    def kv_cache_ratio(self, num_tokens: int) -> float:
        """KV-cache size at `num_tokens` of context relative to a model whose layers are all full attention."""
        window = min(self.sliding_window, num_tokens)
        per_layer = [num_tokens if t == FULL else window for t in self.layer_types]
        return sum(per_layer) / (num_tokens * self.num_hidden_layers)


__all__ = ["MuseSparkConfig", "muse_layer_types"]
