"""Configuration of ChatGLM2/3 and GLM-4 (one architecture, one config class).

Every field of the original checkpoints' `config.json` is accepted under its original name. Two aliases make the
config readable by code written for modern transformers models: `num_hidden_layers` is `num_layers` and
`vocab_size` is `padded_vocab_size` (ChatGLM3 configs have no `num_hidden_layers`, which the Cache classes read).
"""

from transformers import PretrainedConfig


# Fields that only the first-generation ChatGLM-6B config has: its weights have other names and shapes, and loading
# them here would leave every layer randomly initialised.
FIRST_GENERATION_FIELDS = ("position_encoding_2d", "inner_hidden_size", "gmask_token_id")


def reject_other_families(fields: dict):
    found = [name for name in FIRST_GENERATION_FIELDS if name in fields]
    if found:
        raise ValueError(
            f"This config has {', '.join(found)}: it is a first-generation ChatGLM-6B checkpoint, whose weights this "
            "code (ChatGLM2/3 and GLM-4) cannot load. Keep that checkpoint's own modeling files."
        )


class ChatGLMConfig(PretrainedConfig):
    model_type = "chatglm"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"num_hidden_layers": "num_layers", "vocab_size": "padded_vocab_size"}

    def __init__(
        self,
        num_layers=28,
        padded_vocab_size=65024,
        hidden_size=4096,
        ffn_hidden_size=13696,
        kv_channels=128,
        num_attention_heads=32,
        seq_length=2048,
        hidden_dropout=0.0,
        classifier_dropout=None,
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,
        rmsnorm=True,
        apply_residual_connection_post_layernorm=False,
        post_layer_norm=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        bias_dropout_fusion=True,
        multi_query_attention=False,
        multi_query_group_num=1,
        rope_ratio=1,
        apply_query_key_layer_scaling=True,
        attention_softmax_in_fp32=True,
        fp32_residual_connection=False,
        original_rope=True,
        quantization_bit=0,
        pre_seq_len=None,
        prefix_projection=False,
        use_cache=True,
        **kwargs,
    ):
        reject_other_families(kwargs)
        # GLM-4 configs carry both names; a disagreement would silently build the wrong depth.
        num_hidden_layers = kwargs.pop("num_hidden_layers", None)
        if num_hidden_layers is not None and num_hidden_layers != num_layers:
            raise ValueError(
                f"config.json says num_layers={num_layers} but num_hidden_layers={num_hidden_layers}; "
                "they name the same thing: make them equal."
            )
        kwargs.pop("vocab_size", None)  # always equal to padded_vocab_size (see attribute_map)
        kwargs.setdefault("tie_word_embeddings", False)  # the output layer is its own weight in every checkpoint

        self.num_layers = num_layers
        self.padded_vocab_size = padded_vocab_size
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.kv_channels = kv_channels
        self.num_attention_heads = num_attention_heads
        self.seq_length = seq_length
        self.hidden_dropout = hidden_dropout
        self.classifier_dropout = classifier_dropout
        self.attention_dropout = attention_dropout
        self.layernorm_epsilon = layernorm_epsilon
        self.rmsnorm = rmsnorm
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.post_layer_norm = post_layer_norm
        self.add_bias_linear = add_bias_linear
        self.add_qkv_bias = add_qkv_bias
        self.bias_dropout_fusion = bias_dropout_fusion  # kept for round trips; dropout and add are not fused here
        self.multi_query_attention = multi_query_attention
        self.multi_query_group_num = multi_query_group_num
        self.rope_ratio = rope_ratio
        self.apply_query_key_layer_scaling = apply_query_key_layer_scaling
        self.attention_softmax_in_fp32 = attention_softmax_in_fp32
        self.fp32_residual_connection = fp32_residual_connection
        self.original_rope = original_rope
        self.quantization_bit = quantization_bit
        self.pre_seq_len = pre_seq_len
        self.prefix_projection = prefix_projection
        self.use_cache = use_cache
        super().__init__(**kwargs)
        self.validate_chatglm()

    @property
    def num_key_value_heads(self) -> int:
        """Heads of keys and values: the multi-query groups, or every head without multi-query attention."""
        return self.multi_query_group_num if self.multi_query_attention else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    def validate_chatglm(self):
        """Reject field values the model cannot be built from, naming the field. Called again by the model,
        since fields can be changed after the config was made."""

        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ChatGLMConfig.{name} must be a positive integer, got {value!r}.")

        for name in ("num_layers", "padded_vocab_size", "hidden_size", "ffn_hidden_size", "kv_channels",
                     "num_attention_heads", "seq_length"):
            positive_int(name)
        if self.multi_query_attention:
            positive_int("multi_query_group_num")
            if self.num_attention_heads % self.multi_query_group_num:
                raise ValueError(
                    f"ChatGLMConfig.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                    f"multi_query_group_num ({self.multi_query_group_num}): each key/value group serves the same "
                    "number of query heads."
                )
        if self.kv_channels % 4:
            raise ValueError(
                f"ChatGLMConfig.kv_channels ({self.kv_channels}) must be a multiple of 4: rotary embeddings turn "
                "the first half of each head as pairs of channels."
            )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"ChatGLMConfig.{name} must be in [0, 1), got {value!r}.")
        if self.classifier_dropout is not None and not 0.0 <= self.classifier_dropout < 1.0:
            raise ValueError(f"ChatGLMConfig.classifier_dropout must be None or in [0, 1), got {self.classifier_dropout!r}.")
        if not self.layernorm_epsilon > 0:
            raise ValueError(f"ChatGLMConfig.layernorm_epsilon must be positive, got {self.layernorm_epsilon!r}.")
        if not self.rope_ratio > 0:
            raise ValueError(f"ChatGLMConfig.rope_ratio must be positive, got {self.rope_ratio!r}.")
