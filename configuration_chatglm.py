"""Configuration of ChatGLM2/3 and GLM-4 (one architecture, one config class).

Every field of the original checkpoints' `config.json` is accepted under its original name. Two aliases make the
config readable by code written for modern transformers models: `num_hidden_layers` is `num_layers` and
`vocab_size` is `padded_vocab_size` (ChatGLM3 configs have no `num_hidden_layers`, which the Cache classes read).

GLM-4V (glm-4v-9b) configs add `vision_config` (the EVA2-CLIP tower's sizes, with `image_size`, `patch_size` and
`scaling_factor`), `boi_token_id` and `eoi_token_id`; they are kept as given and written back on save.
"""

import math

from transformers import PretrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

try:  # transformers >= 4.48: the attention kernels registered by name
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as _ATTENTION_REGISTRY
except ImportError:
    _ATTENTION_REGISTRY = None
# transformers 4.44 dropped an unknown config.json value silently (the model ran sdpa, whatever it said), and 4.49
# accepted it too: the value is checked when the config is read, against these and the registry.
KERNELS_WITHOUT_REGISTRY = ("eager", "sdpa", "flash_attention_2")


def known_attention_kernels() -> tuple:
    """The kernel names config.json may give: transformers' own and those registered so far (read now, so that a
    kernel a user registers before loading counts)."""
    if _ATTENTION_REGISTRY is None:
        return KERNELS_WITHOUT_REGISTRY
    keys = getattr(_ATTENTION_REGISTRY, "valid_keys", None)
    registered = keys() if callable(keys) else _ATTENTION_REGISTRY.keys()
    return KERNELS_WITHOUT_REGISTRY + ("flash_attention_3", "flex_attention") + tuple(registered)


def is_known_attention_kernel(name) -> bool:
    if not isinstance(name, str):
        return False
    if "|" in name or "/" in name:  # transformers' own syntax ("paged|sdpa", hub kernels "org/name"): it checks them
        return True
    return name in known_attention_kernels()


# Fields that only the first-generation ChatGLM-6B config has: its weights have other names and shapes, and loading
# them here would leave every layer randomly initialised.
FIRST_GENERATION_FIELDS = ("position_encoding_2d", "inner_hidden_size", "gmask_token_id")
# Size fields of other families (Llama, Qwen2, ...): a config.json with them describes another architecture, whose
# auto_map points at this code by mistake.
OTHER_FAMILY_FIELDS = ("num_key_value_heads", "intermediate_size", "head_dim")
# The sizes a checkpoint's config.json must give: without them the model would be the 6B default.
SIZE_FIELDS = ("num_layers", "padded_vocab_size", "hidden_size", "ffn_hidden_size", "kv_channels",
               "num_attention_heads")
ROPE_RATIO_HINT = (
    "ChatGLM/GLM-4 rotate with the base 10000 * rope_ratio and have no other rotary scaling (glm-4-9b-chat uses "
    "rope_ratio 500, glm-4-9b-chat-1m 10000): set rope_ratio instead"
)


def reject_other_families(fields: dict):
    found = [name for name in FIRST_GENERATION_FIELDS if name in fields]
    if found:
        raise ValueError(
            f"This config has {', '.join(found)}: it is a first-generation ChatGLM-6B checkpoint, whose weights this "
            "code (ChatGLM2/3 and GLM-4) cannot load. Keep that checkpoint's own modeling files."
        )
    model_type = fields.get("model_type", ChatGLMConfig.model_type)
    foreign = [name for name in OTHER_FAMILY_FIELDS if name in fields]
    if model_type != ChatGLMConfig.model_type or foreign:
        raise ValueError(
            f"This config describes a model of model_type {model_type!r}"
            + (f" (with {', '.join(foreign)}, which ChatGLM configs do not have)" if foreign else "")
            + ", not ChatGLM2/3 or GLM-4, whose config.json has num_layers, ffn_hidden_size, kv_channels, "
            "multi_query_group_num and padded_vocab_size. Its auto_map points at ChatGLM's code by mistake: remove "
            "the auto_map entries and load it with its own transformers class."
        )


def reject_rope_fields(fields: dict, rope_ratio):
    """rope_scaling / rope_parameters / rope_theta of other families' configs are not read by this architecture:
    refused rather than silently ignored. What says no more than rope_ratio does is accepted: transformers 5's
    standard field of the default type, `rope_parameters={'rope_type': 'default', 'rope_theta': ...}`, which
    GPTQModel and transformers 5 write on every config (kept, and written back on save; a theta other than
    10000 * rope_ratio is reported once, and the rotary stays rope_ratio's), and a rope_theta equal to 10000 *
    rope_ratio (dropped)."""
    parameters = fields.get("rope_parameters")
    if is_default_rope(parameters):
        report_rope_theta(parameters.get("rope_theta"), rope_ratio)
    for name in ("rope_scaling", "rope_parameters"):
        value = fields.get(name)
        if value is not None and not is_default_rope(value):
            raise ValueError(f"ChatGLMConfig does not implement {name} ({value!r}). {ROPE_RATIO_HINT}, and "
                             f"remove {name} from config.json.")
        if value is None or name == "rope_scaling":  # (5.x reads rope_scaling as rope_parameters)
            fields.pop(name, None)
    theta = fields.pop("rope_theta", None)
    if theta is not None and not (is_number(theta) and is_number(rope_ratio) and theta == 10000 * rope_ratio):
        raise ValueError(f"ChatGLMConfig does not read rope_theta ({theta!r}). {ROPE_RATIO_HINT}: rope_ratio = "
                         "rope_theta / 10000, and remove rope_theta from config.json.")


def is_default_rope(value) -> bool:
    """transformers 5's rope_parameters of the plain rotary: its type and theta, nothing else."""
    return isinstance(value, dict) and value.get("rope_type", value.get("type")) == "default" and \
        set(value) <= {"rope_type", "type", "rope_theta"}


def report_rope_theta(theta, rope_ratio):
    if theta is not None and not (is_number(theta) and is_number(rope_ratio) and theta == 10000 * rope_ratio):
        logger.warning_once(
            f"rope_parameters gives rope_theta={theta!r}, but this model rotates with the base 10000 * rope_ratio = "
            f"{10000 * rope_ratio!r} (rope_ratio={rope_ratio!r}), as the original does: rope_theta is not read. "
            "(GPTQModel and transformers 5 write rope_parameters with their default theta on every config.)"
        )


def is_number(value) -> bool:
    """A finite int or float (JSON's Infinity and NaN are read as floats)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# What each field of this config must hold: (test, description). Checked at construction and again by the model, so
# that a string in config.json ("500", "false") fails naming its field instead of deep inside the model.
BOOLEAN = (lambda v: isinstance(v, bool), "true or false")
FIELD_RULES = {
    **{name: (is_positive_int, "a positive integer")
       for name in SIZE_FIELDS + ("seq_length", "multi_query_group_num")},
    **{name: BOOLEAN for name in (
        "rmsnorm", "apply_residual_connection_post_layernorm", "post_layer_norm", "add_bias_linear", "add_qkv_bias",
        "bias_dropout_fusion", "multi_query_attention", "apply_query_key_layer_scaling", "attention_softmax_in_fp32",
        "fp32_residual_connection", "original_rope", "prefix_projection", "use_cache", "tie_word_embeddings")},
    "hidden_dropout": (lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "attention_dropout": (lambda v: is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "classifier_dropout": (lambda v: v is None or (is_number(v) and 0 <= v < 1), "null or a number in [0, 1)"),
    "layernorm_epsilon": (lambda v: is_number(v) and v > 0, "a finite positive number"),
    "rope_ratio": (lambda v: is_number(v) and v > 0, "a finite positive number"),
    "quantization_bit": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                         "0 or a number of bits"),
    "pre_seq_len": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                    "null or a non-negative integer"),
}


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
        reject_rope_fields(kwargs, rope_ratio)
        # Aliases (attribute_map): checked to agree with their field below.
        aliases = {"num_hidden_layers": ("num_layers", kwargs.pop("num_hidden_layers", None)),
                   "vocab_size": ("padded_vocab_size", kwargs.pop("vocab_size", None))}
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
        self.check_aliases(aliases)

    def check_aliases(self, aliases: dict):
        """GLM-4 configs carry num_hidden_layers too; a disagreement would silently build the wrong size."""
        for alias, (field, value) in aliases.items():
            if value is None:
                continue
            if not is_positive_int(value):
                quoted = " (a string: write the value without quotes in config.json)" if isinstance(value, str) else ""
                raise ValueError(f"ChatGLMConfig.{alias} must be a positive integer, got {value!r}{quoted}.")
            if value != getattr(self, field):
                raise ValueError(
                    f"config.json says {field}={getattr(self, field)} but {alias}={value}; they name the same "
                    f"thing: make them equal (or remove {alias})."
                )

    if not hasattr(PretrainedConfig, "get_text_config"):  # transformers 4.44: PEFT 0.21 asks for it (or crashes)

        def get_text_config(self, decoder=False):
            return self

    @property
    def num_key_value_heads(self) -> int:
        """Heads of keys and values: the multi-query groups, or every head without multi-query attention."""
        return self.multi_query_group_num if self.multi_query_attention else self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """A checkpoint's config.json must give its sizes: without them the model would silently be the 6B default
        (tens of GB in fp32) with none of the checkpoint's weights fitting."""
        reject_other_families(config_dict)
        implementation = config_dict.get("attn_implementation")
        if implementation is not None and not is_known_attention_kernel(implementation):
            raise ValueError(f"config.json: attn_implementation must be one of {', '.join(known_attention_kernels())} "
                             f"with this transformers release, got {implementation!r}. Fix or remove the field.")
        missing = [name for name in SIZE_FIELDS if name not in config_dict and name not in kwargs]
        if missing:
            raise ValueError(
                f"config.json gives no {', '.join(missing)}: a ChatGLM2/3 / GLM-4 config states the model's sizes. "
                "Use the config.json that came with the checkpoint."
            )
        return super().from_dict(config_dict, **kwargs)

    def validate_chatglm(self):
        """Reject field values the model cannot be built from, naming the field. Called again by the model,
        since fields can be changed after the config was made."""
        for name, (valid, expected) in FIELD_RULES.items():
            value = getattr(self, name)
            if not valid(value):
                quoted = " (a string: write the value without quotes in config.json)" if isinstance(value, str) else ""
                raise ValueError(f"ChatGLMConfig.{name} must be {expected}, got {value!r}{quoted}.")
        if self.multi_query_attention and self.num_attention_heads % self.multi_query_group_num:
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
        reject_rope_fields(dict(vars(self)), self.rope_ratio)
        self.validate_vision_fields()

    def validate_vision_fields(self):
        """GLM-4V: vision_config is a dict of the tower's sizes (checked in full when the tower is built), and the
        image token ids are vocabulary ids."""
        vision_config = getattr(self, "vision_config", None)
        if vision_config is None:
            return
        if not isinstance(vision_config, dict):
            raise ValueError(f"ChatGLMConfig.vision_config must be a dict (as in glm-4v-9b's config.json), got "
                             f"{type(vision_config).__name__}.")
        for name in ("boi_token_id", "eoi_token_id"):
            value = getattr(self, name, None)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.padded_vocab_size:
                raise ValueError(f"ChatGLMConfig.{name} must be a token id below padded_vocab_size "
                                 f"({self.padded_vocab_size}) in a config with vision_config, got {value!r}.")
