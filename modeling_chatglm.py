"""ChatGLM2/3 and GLM-4: one decoder-only architecture, drop-in for the original remote code.

Class names, module attributes and state-dict keys are the original checkpoints'. Copied alone over an original
checkpoint folder, this file loads, runs, generates and chats (it reads only the original configuration classes'
fields); each optional capability is a companion file loaded on demand (`COMPANION_FILES`), and without
checks_chatglm.py the load and input checks are skipped, said once. Every move of a tensor to another device goes
through `device_boundary(...)`, none through accelerate's hooks.

Sections: compatibility shims; config and sizes; devices; KV cache; module contracts; rotary embedding; attention;
MLP, norms; block and stack; base model; companion files; the P-tuning v2 and GLM-4V seams; chat; heads.

Where to change what:
  attention kernel       `attention_function`, `build_attention_mask`; `_supports_*` on ChatGLMPreTrainedModel
  KV cache, devices      `cache_for_forward`, `new_static_cache`, `kv_cache.update`; `device_boundary`, `placed_inputs`
  transformers release   Compatibility shims: one flag or function per change, naming the release
  THUDM checkpoint       `CHECKPOINT_VARIANTS`, here and in tokenization_chatglm.py; a golden case in tests/conftest.py
  config field, checks   `check_supported`, `complete_original_config`; configuration_chatglm.py, checks_chatglm.py
  optional capabilities  their companion files; here their seams `enter_prefix`, `enter_vision`, `linear_layer`
  chat                   `ChatMixin`, `chat_format`, `parse_tool_call`; the templates: tokenization_chatglm.py
  loss, logits, generate Heads: `ChatGLMForConditionalGeneration`
  the original's names   the class that had them (testdata/surface); ChatGLM2's chat signatures: `ChatForm`
  calls between modules  Module contracts: `LayerInputs`, `forward_replaced` (testdata/surface/*-calls.json)
"""
import ast
import copy
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import types
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cache, partial
from pathlib import Path
from typing import NamedTuple, Optional, Tuple, Union

import torch
import torch.fx
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.generation import GenerationConfig, GenerationMixin, LogitsProcessor, LogitsProcessorList
from transformers.modeling_outputs import (BaseModelOutputWithPast, CausalLMOutputWithPast,
                                           SequenceClassifierOutputWithPast)
from transformers.utils import logging

from .configuration_chatglm import ChatGLMConfig

logger = logging.get_logger(__name__)


# ======================================================================================================================
# Compatibility shims: transformers 4.44.2 ... 5.x, torch 2.4 ...; each names the releases that need it
# ======================================================================================================================


def version_at_least(version: str, release: str) -> bool:
    """Dev builds included. Not `packaging`: transformers' remote-code check asks for every package imported."""
    installed = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", version).groups())
    return installed >= tuple(int(part) for part in release.split("."))


def transformers_at_least(release: str) -> bool:
    """By version, never by a parameter's name: 5.24 renamed the one that told 4.46 from 4.45 here."""
    return version_at_least(transformers.__version__, release)


def torch_at_least(release: str) -> bool:
    return version_at_least(torch.__version__, release)


try:  # the attention-function registry appeared in 4.48
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError:
    ALL_ATTENTION_FUNCTIONS = None

try:  # transformers' own sdpa kernel (4.48+): until 5.x added `pack_gqa` it expanded the key/value groups to every
    # head at every step (4.49, 4.53) or at every masked step (4.57, 5.0): a copy of each layer's cache per step.
    from transformers.integrations import sdpa_attention as _transformers_sdpa
except ImportError:
    _transformers_sdpa = None
_TRANSFORMERS_SDPA_EXPANDS_GROUPS = _transformers_sdpa is not None and not hasattr(_transformers_sdpa, "pack_gqa")

try:  # the shared loss functions appeared in 4.46; their causal-LM loss takes `shift_labels` since 4.50
    from transformers.loss.loss_utils import ForCausalLMLoss as causal_lm_loss
except ImportError:
    causal_lm_loss = None


if causal_lm_loss is None or "shift_labels" not in inspect.signature(causal_lm_loss).parameters:

    def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                       **kwargs):
        """transformers < 4.50: what its later ForCausalLMLoss computes."""
        logits = logits.float()
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index,
                               reduction=reduction)  # the caller put the targets on the logits' device
        return loss / num_items_in_batch if num_items_in_batch is not None else loss


try:  # 4.52: blocks that checkpoint themselves when gradient checkpointing is on
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:

    class GradientCheckpointingLayer(nn.Module):
        """transformers < 4.52. Tensors that need gradients come positionally (reentrant checkpointing sees those)."""

        gradient_checkpointing = False

        def __call__(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training:
                return self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)
            return super().__call__(*args, **kwargs)


# 5.0 reads `_tied_weights_keys` as {tied: source} and ties only through it; earlier releases read a list.
_TIED_KEYS_ARE_A_MAPPING = hasattr(PreTrainedModel, "get_expanded_tied_weights_keys")


def tied_weights_keys(output_key: str, input_key: str):
    return {output_key: input_key} if _TIED_KEYS_ARE_A_MAPPING else [output_key]


try:  # 5.0: init functions that skip tensors already loaded from a checkpoint
    from transformers import initialization as weight_init
except ImportError:
    weight_init = nn.init


# 4.46 to 4.52 register no auto class for remote code (save_pretrained wrote no code files): the heads name theirs.

# 4.56 added DynamicCache(config=...), and 5.0 builds its layers from the config.
_DYNAMIC_CACHE_TAKES_CONFIG = "config" in inspect.signature(DynamicCache.__init__).parameters

# 5.x's entry point; gradient_checkpointing_enable() is its deprecated alias there, which the model does not override.
_HAS_ACTIVATION_CHECKPOINTING = hasattr(PreTrainedModel, "activation_checkpointing_enable")

# 4.44 and 4.45 have no generic GenerationMixin.prepare_inputs_for_generation (the 4.44 one only raises).
_HAS_GENERIC_PREPARE_INPUTS = transformers_at_least("4.46")

# 4.44 applies the sampling warpers apart, after the processors, to logits in the model's dtype; 4.45+ to fp32 ones.
_WARPERS_APART = not transformers_at_least("4.45")


def release_logits_processors(model, config, device, **kwargs) -> LogitsProcessorList:
    processors = model._get_logits_processor(generation_config=config, device=device, **kwargs)
    if _WARPERS_APART and config.do_sample:
        processors.extend(model._get_logits_warper(config, device=device))
    return processors


# 4.51 moves each step's logits to generate()'s ids; 4.44 to 4.50 need the ids beside the logits (and warn there).
_GENERATE_MOVES_LOGITS = transformers_at_least("4.51")
_DEVICE_TYPE_WARNING = r"You are calling \.generate\(\) with the `input_ids` being on a device type different"


def generation_device(model: nn.Module) -> torch.device:
    """model.device (4.51+; the embedding's execution device where offloaded to `meta`), or the logits' device."""
    if not _GENERATE_MOVES_LOGITS:
        return execution_device(model.transformer.output_layer) or model.device
    if model.device.type == "meta":
        return execution_device(model.transformer.embedding) or model.device
    return model.device


@contextmanager
def quiet_device_type_check(model: nn.Module, device: torch.device):
    """4.44 to 4.50 with the ids on the logits' device: generate()'s device-type warning is wrong, and silenced."""
    if _GENERATE_MOVES_LOGITS or device.type == model.device.type:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEVICE_TYPE_WARNING, category=UserWarning)
        yield


# 5.24 renamed the KV cache `cache` (`past_key_values` logs a deprecation): outputs and calls use the release's name.
CACHE_NAME = "cache" if transformers_at_least("5.24") else "past_key_values"


def caller_cache(past_key_values, cache):
    if cache is None:
        return past_key_values
    if CACHE_NAME != "cache":
        raise TypeError(f"cache= is the name transformers 5.24 gave the KV cache; transformers "
                        f"{transformers.__version__} passes it as past_key_values: use that name.")
    if past_key_values is not None:
        raise ValueError("Both past_key_values and cache were given: they are the same argument (transformers 5.24 "
                         "renamed past_key_values to cache). Pass the cache once, under either name.")
    return cache


def cache_output(cache) -> dict:
    return {CACHE_NAME: cache}


def returned_cache(outputs):
    return getattr(outputs, CACHE_NAME)


# The static cache's length: `get_max_length` on 4.44, `get_max_cache_shape` on 4.46 to 4.57 (which deprecate the
# other), `get_max_length` on 5.x (5.16+ deprecate the other). A deprecation logs, which breaks a compiled graph.
_MAX_LENGTH_QUERY = (
    "get_max_length"
    if hasattr(Cache, "get_max_length") and (transformers_at_least("5.0") or not hasattr(Cache, "get_max_cache_shape"))
    else "get_max_cache_shape")

# torch 2.5 added scaled_dot_product_attention(enable_gqa=True); on torch 2.4 an unmasked prompt expands the groups.
_SDPA_HAS_GQA = torch_at_least("2.5")

# torch 2.4 has is_fx_tracing alone; later releases' is_fx_tracing warns at each call (it answers for torch.export too).
fx_symbolic_tracing = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", None) or \
    torch.fx._symbolic_trace.is_fx_tracing

# torch 2.4's dynamo guards bound methods by equality; later releases guard a method's function by identity.
_DYNAMO_COMPARES_FUNCTIONS = torch_at_least("2.5")


def is_compiling() -> bool:
    return torch.compiler.is_compiling()  # torch >= 2.3


def is_tracing() -> bool:
    """torch.compile, jit.trace (OpenVINO) or fx (llm-compressor): what reads values steps aside (a trace freezes)."""
    return is_compiling() or torch.jit.is_tracing() or fx_symbolic_tracing()


# torch 2.4's rms_norm in a half type rounds twice where the original rounds once; later fused kernels round once
# (torch 2.13 CPU, measured): a half-precision RMSNorm is then one call, not four. Told by behaviour, per device type.
_RMS_NORM_ROUNDS_ONCE = {}


def rms_norm_rounds_once(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether F.rms_norm gives the original's numbers bit for bit, on a small sample (False while tracing)."""
    key = (device.type, dtype)
    if key not in _RMS_NORM_ROUNDS_ONCE:
        if is_tracing() or device.type == "meta":
            return False
        generator = torch.Generator().manual_seed(0)  # leaves the caller's random state alone
        x = (torch.randn(16, 256, generator=generator) * 3).to(device, dtype)
        weight = (torch.rand(256, generator=generator) + 0.5).to(device, dtype)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        original = (weight * (x * torch.rsqrt(variance + 1e-5))).to(dtype)
        _RMS_NORM_ROUNDS_ONCE[key] = torch.equal(F.rms_norm(x, (256,), weight, 1e-5), original)
    return _RMS_NORM_ROUNDS_ONCE[key]


def static_cache_mask_before_4_53(attention_mask, sequence_length, target_length, cache_position, config,
                                  **kwargs):
    """transformers 4.46 to 4.52 ask the model for a static cache's full-length mask (one compiled decode graph)."""
    return build_attention_mask(attention_implementation(config, False), attention_mask, cache_position[None],
                                target_length, batch_size=attention_mask.shape[0], preallocated=True)


def prepare_inputs_before_4_46(input_ids, past_key_values, attention_mask, position_ids, inputs_embeds,
                               cache_position=None, use_cache=True, config=None, **kwargs):
    """transformers 4.44 / 4.45 have no generic input preparation: this is what later releases do."""
    past_key_values = as_cache(past_key_values)  # the forward returns the legacy format it was given (PEFT's)
    past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
    first_step = past_length == 0
    if cache_position is None:
        cache_position = torch.arange(past_length, input_ids.shape[1], device=input_ids.device)
    if not first_step:  # (with inputs_embeds, input_ids hold only the generated tokens)
        input_ids = input_ids[:, -cache_position.shape[0]:]
    new_tokens = cache_position.shape[0]
    # Fresh copies of the slices: a slice keeps its parent's strides, which a compiled step guards on.
    if inputs_embeds is not None and first_step:
        model_inputs = {"inputs_embeds": inputs_embeds}
    else:
        model_inputs = {"input_ids": input_ids.clone(memory_format=torch.contiguous_format)}
    static_length = max_cache_length(past_key_values) if past_key_values is not None else None
    if first_step and type(past_key_values) is DynamicCache:  # generate()'s empty cache: PEFT < 0.13 injects its
        past_key_values = None  # prefix-tuning key/values only where it is handed None
    if static_length and attention_mask is not None and attention_mask.dim() == 2:
        if position_ids is None:  # the padding mask is about to become 4D: positions from it first
            position_ids = ChatGLMModel.default_position_ids(attention_mask, None, new_tokens)
        attention_mask = static_cache_mask_before_4_53(attention_mask, new_tokens, static_length, cache_position,
                                                       config)
    if position_ids is not None:
        model_inputs["position_ids"] = position_ids[:, -new_tokens:].clone(memory_format=torch.contiguous_format)
    model_inputs.update(past_key_values=past_key_values, attention_mask=attention_mask, use_cache=use_cache)
    model_inputs.update({k: v for k, v in kwargs.items()
                         if k in ("output_attentions", "output_hidden_states", "images")})
    return model_inputs


# ======================================================================================================================
# Config and sizes
# ======================================================================================================================


def complete_original_config(config):
    """What an original configuration class lacks and transformers reads: `num_key_value_heads`, `head_dim`
    (StaticCache), `num_hidden_layers` (Cache, 4.56+), `use_cache` (5.0+); `rope_ratio` tells OpenVINO the layout."""
    derived = {"num_hidden_layers": config.num_layers, "num_key_value_heads": num_key_value_heads(config),
               "head_dim": config.kv_channels, "use_cache": True, "rope_ratio": 1}
    for name, value in derived.items():
        if not hasattr(config, name):
            setattr(config, name, value)


def num_key_value_heads(config) -> int:
    return config.multi_query_group_num if config.multi_query_attention else config.num_attention_heads


@dataclass(frozen=True)
class AttentionSizes:
    """Head counts of one attention layer (a rank's under tensor parallelism)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    multi_query: bool  # fused qkv layout: [all q | all k | all v] if True, else [q_h | k_h | v_h] per head

    @classmethod
    def from_config(cls, config: ChatGLMConfig) -> "AttentionSizes":
        return cls(config.num_attention_heads, num_key_value_heads(config), config.kv_channels,
                   bool(config.multi_query_attention))

    @property
    def groups(self) -> int:  # query heads per key/value head
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_features(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def shard(self, num_heads: int, num_kv_heads: int) -> "AttentionSizes":
        return replace(self, num_heads=num_heads, num_kv_heads=num_kv_heads)


def block_parameter_count(config: ChatGLMConfig) -> int:  # (norms and biases negligible)
    sizes = AttentionSizes.from_config(config)
    return (sizes.qkv_features * config.hidden_size + sizes.num_heads * sizes.head_dim * config.hidden_size
            + 3 * config.ffn_hidden_size * config.hidden_size)


def parameter_count(config: ChatGLMConfig) -> int:
    return 2 * config.padded_vocab_size * config.hidden_size + config.num_layers * block_parameter_count(config)


# ---- THUDM checkpoint variants: the same literal is in tokenization_chatglm.py (each file works copied alone) ----
#   rotary     "base": base 10000 * rope_ratio; "positions": positions / rope_ratio (chatglm2-6b-32k's own code)
#   tokenizer  "chatglm2" (5 control tokens, build_prompt), "chatglm3" (role tokens), "glm4" (ChatGLM4Tokenizer)
#   chat       "rounds" (ChatGLM2's build_prompt), "roles" (ChatGLM3's build_chat_input), "template" (GLM-4's)
#   fields     config.json values only this checkpoint has: evidence when its name (the row's key) is lost
CHECKPOINT_VARIANTS = {
    "chatglm2-6b": dict(rotary="base", tokenizer="chatglm2", chat="rounds", fields={}),
    "chatglm2-6b-32k": dict(rotary="positions", tokenizer="chatglm2", chat="rounds", fields={"rope_ratio": 16}),
    "chatglm2-6b-int4": dict(rotary="base", tokenizer="chatglm2", chat="rounds", fields={}),
    "codegeex2-6b": dict(rotary="base", tokenizer="chatglm2", chat="rounds", fields={}),
    "chatglm3-6b": dict(rotary="base", tokenizer="chatglm3", chat="roles", fields={}),
    "chatglm3-6b-base": dict(rotary="base", tokenizer="chatglm3", chat="roles", fields={}),
    "chatglm3-6b-32k": dict(rotary="base", tokenizer="chatglm3", chat="roles", fields={}),
    "chatglm3-6b-128k": dict(rotary="base", tokenizer="chatglm3", chat="roles", fields={}),
    "glm-4-9b": dict(rotary="base", tokenizer="glm4", chat="template", fields={}),
    "glm-4-9b-chat": dict(rotary="base", tokenizer="glm4", chat="template", fields={}),
    "glm-4-9b-chat-1m": dict(rotary="base", tokenizer="glm4", chat="template", fields={}),
    "codegeex4-all-9b": dict(rotary="base", tokenizer="glm4", chat="template", fields={}),
    "glm-4v-9b": dict(rotary="base", tokenizer="glm4", chat="template", fields={}),
}


def variant_named(name) -> Optional[str]:
    """The longest row name in the name's last part (a Hub id's model, a folder, `models--THUDM--<model>`), or None."""
    if not isinstance(name, str) or not name:
        return None
    parts = [part for part in re.split(r"[\\/]", name.lower()) if part]
    cache = [part.split("--")[-1] for part in parts if part.startswith("models--")]
    last = cache[-1] if cache else (parts[-1] if parts else "")
    found = [row for row in CHECKPOINT_VARIANTS if row in last]
    return max(found, key=len) if found else None


def variant_of_fields(config: dict) -> Optional[str]:
    """The row whose own config.json values `config` has (rows without such values are never found this way)."""
    found = [row for row, columns in CHECKPOINT_VARIANTS.items()
             if columns["fields"] and all(config.get(k) == v for k, v in columns["fields"].items())]
    return found[0] if len(found) == 1 else None


def config_file_fields(config) -> dict:
    """config.json as the local checkpoint folder holds it (its `_name_or_path` is lost once loaded), else {}."""
    folder = getattr(config, "_name_or_path", None)
    path = os.path.join(folder, "config.json") if isinstance(folder, str) and folder else None
    if path is None or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def checkpoint_variant(config) -> Optional[str]:
    """`chatglm_variant`, else the row the names or the fields say, or None; contradicting evidence is warned of."""
    chosen = getattr(config, "chatglm_variant", None)
    if chosen is not None:
        if chosen not in CHECKPOINT_VARIANTS:
            raise ValueError(f"config.chatglm_variant={chosen!r} is not a THUDM checkpoint this code knows: use one of "
                             f"{', '.join(CHECKPOINT_VARIANTS)}, or remove it to read the checkpoint's names.")
        return chosen
    stored = config_file_fields(config)
    named = [(where, row) for where, row in (
        ("config.json's _name_or_path", variant_named(stored.get("_name_or_path"))),
        ("the name loaded from", variant_named(getattr(config, "_name_or_path", None)))) if row]
    by_fields = variant_of_fields({name: getattr(config, name, None)
                                   for columns in CHECKPOINT_VARIANTS.values() for name in columns["fields"]})
    chosen = named[0][1] if named else by_fields
    evidence = named + ([("its fields " + json.dumps(CHECKPOINT_VARIANTS[by_fields]["fields"]), by_fields)]
                        if by_fields else [])
    disagreeing = [(where, row) for where, row in evidence
                   if CHECKPOINT_VARIANTS[row]["rotary"] != CHECKPOINT_VARIANTS[chosen]["rotary"]]
    if disagreeing or (chosen is not None and not named and CHECKPOINT_VARIANTS[chosen]["rotary"] != "base"):
        logger.warning_once(  # once: from_pretrained builds the model more than once (device-map and dtype checks)
            f"This checkpoint is taken as {chosen} (rotary: {CHECKPOINT_VARIANTS[chosen]['rotary']}) from "
            f"{'; '.join(f'{where}: {row}' for where, row in evidence)}. The rotary embedding of these checkpoints "
            "differs: if that is not the checkpoint, set \"chatglm_variant\" in config.json to the right one of "
            f"{', '.join(CHECKPOINT_VARIANTS)}.")
    return chosen


def weight_storage(config) -> str:
    """"float", or "int4" / "int8" for a pre-quantized checkpoint (config.quantization_bit)."""
    bits = getattr(config, "quantization_bit", 0) or 0
    return f"int{bits}" if bits else "float"


def linear_layer(config):
    if weight_storage(config) == "float":
        return nn.Linear
    return import_companion("quantization_chatglm", config).quantized_linear(config.quantization_bit)


# Fields every ChatGLM2/3 and GLM-4 configuration class defines; the others this file reads have defaults.
REQUIRED_CONFIG_FIELDS = (
    "num_layers", "padded_vocab_size", "hidden_size", "ffn_hidden_size", "kv_channels", "num_attention_heads",
    "hidden_dropout", "attention_dropout", "layernorm_epsilon", "rmsnorm", "apply_residual_connection_post_layernorm",
    "post_layer_norm", "add_bias_linear", "add_qkv_bias", "multi_query_attention", "multi_query_group_num",
    "apply_query_key_layer_scaling", "attention_softmax_in_fp32", "fp32_residual_connection",
)


def check_supported(config: ChatGLMConfig):
    missing = [name for name in REQUIRED_CONFIG_FIELDS if not hasattr(config, name)]
    if missing:
        raise ValueError(
            f"The config lacks {', '.join(missing)}, which this modeling_chatglm.py reads: its configuration class "
            f"({type(config).__module__}) is not a ChatGLM2/3 or GLM-4 one, or is older than this file. Copy this "
            "repository's configuration_chatglm.py into the checkpoint folder too.")
    checks = load_checks(config)
    validate = getattr(config, "validate_chatglm", None)  # ours checks every field; the original class checks nothing
    if callable(validate):
        validate()
    elif checks is not None:
        checks.validate_config(config)
    complete_original_config(config)
    if weight_storage(config) not in ("float", "int4", "int8"):
        raise ValueError(f"config.quantization_bit={config.quantization_bit}: checkpoints quantized by the original "
                         "code store 4 or 8 bits (0: float weights). Fix quantization_bit in config.json to the width "
                         "the weights were saved with.")
    if checks is not None:
        checks.check_fits_in_memory(config, parameter_count(config))


def check_inputs(model, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values):
    if is_tracing():  # torch.fx hands proxies, not tensors (llm-compressor's default pipeline)
        return
    checks = load_checks(model.config)
    if checks is not None:
        capacity = max_cache_length(past_key_values) if isinstance(past_key_values, Cache) else None
        checks.check_inputs(model, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, capacity)


def check_attention_mask_values(attention_mask):
    checks = load_checks()
    if checks is not None:
        checks.check_attention_mask_values(attention_mask)


def check_token_ids(input_ids: torch.Tensor, vocab_size: int):
    checks = load_checks()
    if checks is not None:
        checks.check_token_ids(input_ids, vocab_size)


# ======================================================================================================================
# Devices
# ======================================================================================================================


def device_boundary(tensor: Optional[torch.Tensor], device: Optional[torch.device]) -> Optional[torch.Tensor]:
    """Every crossing of a tensor to another device in this file goes through here (None: stay). A torch.fx proxy
    (llm-compressor's trace) has no device of its own: it stays, as the original's tensors do (the device hooks of
    accelerate move them)."""
    if tensor is None or device is None or not isinstance(tensor, torch.Tensor) or tensor.device == device:
        return tensor
    return tensor.to(device)


def execution_device(module: nn.Module) -> Optional[torch.device]:
    """Its weights' device or accelerate's execution device; None without tensors (torch.ao's dynamic quantization)."""
    hook = module.__dict__.get("_hf_hook")  # accelerate sets it as a plain attribute
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    tensor = first_tensor(module, "_parameters")
    tensor = tensor if tensor is not None else first_tensor(module, "_buffers")
    return None if tensor is None else tensor.device


def first_tensor(module: nn.Module, kind: str) -> Optional[torch.Tensor]:
    """The first of parameters() or buffers() without their generators' 20 µs (several calls a layer per step)."""
    for tensor in getattr(module, kind).values():
        if tensor is not None:
            return tensor
    for child in module._modules.values():
        found = None if child is None else first_tensor(child, kind)
        if found is not None:
            return found
    return None


def balanced_device_map(config: ChatGLMConfig, devices) -> dict:
    """A device map for `devices` (e.g. ["cuda:0", "cuda:1"]) balancing the parameter count, each block whole."""
    vision = getattr(config, "vision_config", None) and import_companion("visual", config).parameter_count(config)
    return import_companion("checks_chatglm", config).balanced_device_map(config, devices,
                                                                           block_parameter_count(config), vision or 0)


# ======================================================================================================================
# KV cache
# ======================================================================================================================
# transformers' Cache classes as they are. A cache may lead with a P-tuning v2 prefix, and hold GLM-4V's image rows.


def dynamic_cache_kwargs(config: ChatGLMConfig) -> dict:
    return {"config": config} if _DYNAMIC_CACHE_TAKES_CONFIG else {}


def new_dynamic_cache(config: ChatGLMConfig) -> DynamicCache:
    return DynamicCache(**dynamic_cache_kwargs(config))


def new_static_cache(config: ChatGLMConfig, batch_size: int, max_cache_len: int, dtype: torch.dtype,
                     layer_devices: list) -> StaticCache:
    """4.44-4.55 allocate it up front (4.47+ per layer with `layer_device_map`); 4.56+ where the keys arrive."""
    accepted = inspect.signature(StaticCache.__init__).parameters
    batch_name = "max_batch_size" if "max_batch_size" in accepted else "batch_size"
    optional = {batch_name: batch_size, "dtype": dtype, "device": layer_devices[0]}
    if len(set(layer_devices)) > 1:
        optional["layer_device_map"] = dict(enumerate(layer_devices))
    return StaticCache(config=config, max_cache_len=max_cache_len,
                       **{name: value for name, value in optional.items() if name in accepted})


def as_cache(past_key_values) -> Optional[Cache]:
    """A Cache, or None, as given; legacy (key, value) tuples converted where transformers still can (< 5.0)."""
    if not isinstance(past_key_values, (tuple, list)):
        return past_key_values
    if not hasattr(DynamicCache, "from_legacy_cache"):
        raise TypeError(
            f"past_key_values as a tuple of tensors is not supported with transformers {transformers.__version__}: "
            "pass the Cache object a previous call returned (or a transformers DynamicCache).")
    return DynamicCache.from_legacy_cache(past_key_values)


def cached_length_of(past_key_values) -> int:
    if not past_key_values:
        return 0
    if isinstance(past_key_values, Cache):
        return past_key_values.get_seq_length()
    return past_key_values[0][0].shape[-2]


def cache_for_forward(past_key_values, config: ChatGLMConfig, use_cache: bool) -> Tuple[Optional[Cache], bool]:
    """The cache, and whether the caller gave tuples. One given with use_cache=False is still read, as elsewhere."""
    cache = as_cache(past_key_values)
    if cache is None and use_cache:
        cache = new_dynamic_cache(config)
    return cache, isinstance(past_key_values, (tuple, list))


def cache_to_return(cache: Optional[Cache], use_cache: bool, legacy: bool):
    if not use_cache:
        return None
    return cache.to_legacy_cache() if legacy else cache


def max_cache_length(cache: Cache) -> Optional[int]:  # None for a cache that grows
    if isinstance(cache, DynamicCache):
        return None
    length = getattr(cache, _MAX_LENGTH_QUERY)()
    return int(length) if length is not None and length > 0 else None


def cache_is_empty(cache: Cache) -> bool:
    length = cache.get_seq_length()
    return length == 0 if isinstance(length, int) else not bool(length)  # a tensor from static caches before 5.x


# ======================================================================================================================
# Module contracts
# ======================================================================================================================


# Each module keeps the original's call (docs/serving-and-tools.md tabulates them). This file's forward hands over
# cheaper values in the same slots, told apart by their form, never by whether anything watches: a LayerInputs as
# rotary_pos_emb beside the kernel's own mask, keys and values per group with a KernelInputs as core_attention's mask,
# position ids to rotary_pos_emb(). Every module also answers the original's call with the original's values, which
# cross only into a module a tool replaced (`forward_replaced`). Only tensors, tuples, strings and None travel, which
# tools that capture and replay a layer's arguments keep (GPTQModel, AutoRound).


class LayerInputs(NamedTuple):
    cos: torch.Tensor  # [batch or 1, 1, seq, head_dim] in the compute dtype (head_tables)
    sin: torch.Tensor
    cache_position: torch.Tensor  # [seq]: the cache slots of the new tokens
    implementation: str  # the kernel of this forward (attention_implementation)
    kernel_kwargs: tuple  # ((name, value), ...): extra arguments for the kernel (attention backends, packed rows)
    attentions: Optional[list]  # with output_attentions: one slot per layer, written by its core_attention


class KernelInputs(NamedTuple):
    mask: Optional[torch.Tensor]
    implementation: str
    kernel_kwargs: tuple
    attentions: Optional[list]


def forward_replaced(module: nn.Module) -> bool:
    """Whether a tool replaced this file's forward. Compared with the class's `_own_forward`, not this file's globals
    (transformers 4.44 to 4.4x execute this file again at every load); under accelerate's hook, what it wrapped."""
    own = getattr(module, "_own_forward", None)
    if own is None:
        return True
    forward = module.__dict__["_old_forward"] if "_hf_hook" in module.__dict__ else module.forward
    if not isinstance(forward, types.MethodType):  # a function set on the instance
        return True
    return forward.__func__ is not own.__func__ if _DYNAMO_COMPARES_FUNCTIONS else forward != own


# ======================================================================================================================
# Rotary position embedding
# ======================================================================================================================


class RotaryEmbedding(nn.Module):
    """Half of each head's channels turn in pairs, base 10000 * rope_ratio (chatglm2-6b-32k: positions / rope_ratio).
    Called with an int, the original's table; with position ids, only their rows (`cos_sin`)."""

    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.rotary_channels = config.kv_channels // 2
        self.head_dim = config.kv_channels
        rope_ratio = getattr(config, "rope_ratio", 1)  # chatglm3-6b's original config has no rope_ratio
        self.rope_ratio = rope_ratio
        variant = checkpoint_variant(config)
        divides_positions = variant is not None and CHECKPOINT_VARIANTS[variant]["rotary"] == "positions"
        self.base = 10000.0 * (1 if divides_positions else rope_ratio)
        self.position_divisor = float(rope_ratio) if divides_positions else 1.0
        # The state-dict key, whose values nothing reads; it marks the rotary table's device.
        self.register_buffer("inv_freq", self.checkpoint_inv_freq(), persistent=True)
        self._register_load_state_dict_pre_hook(own_loaded_inv_freq, with_module=True)

    def checkpoint_inv_freq(self) -> torch.Tensor:
        return self.theta(None, base=10000)

    def own_loaded_buffer(self):
        """transformers >= 4.53 keep this buffer as a view of the checkpoint's memory map: its shard stays resident."""
        if self.inv_freq.device.type == "cpu":
            self.inv_freq = self.inv_freq.clone()

    def forward(self, max_seq_len, offset: int = 0):
        """An int: the original's table in inv_freq's dtype (`offset` unread, as there); position ids: `cos_sin`."""
        if isinstance(max_seq_len, torch.Tensor):
            return self.cos_sin(max_seq_len)
        return self.forward_impl(max_seq_len, self.dim, dtype=self.inv_freq.dtype, device=self.inv_freq.device)

    _own_forward = forward  # the forward this class computes with (forward_replaced)

    def cos_sin(self, position_ids: torch.Tensor, dtype: Optional[torch.dtype] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The original table's rows of `position_ids` [batch, seq], as the layers take them (`head_tables`)."""
        theta = self.theta(position_ids.device)
        positions = position_ids[..., None].float()
        if self.position_divisor != 1.0:  # position interpolation (chatglm2-6b-32k)
            positions = positions / self.position_divisor
        angles = positions * theta
        return head_tables(angles.cos(), angles.sin(), self.head_dim, dtype)

    def theta(self, device: Optional[torch.device], base: Optional[float] = None) -> torch.Tensor:
        steps = torch.arange(0, self.rotary_channels, 2, dtype=torch.float32, device=device)
        return 1.0 / ((base or self.base) ** (steps / self.rotary_channels))

    # The original's names; `forward_impl` computes its table, its half-precision rounding kept.
    dim = property(lambda self: self.rotary_channels)
    original_impl = True

    def forward_impl(self, seq_len: int, n_elem: int, dtype: torch.dtype, device: torch.device, base: int = 10000):
        steps = torch.arange(0, n_elem, 2, dtype=torch.float, device=device)
        root = self.base if base == 10000 else base * self.base / 10000.0  # (the same float as cos_sin's)
        theta = 1.0 / (root ** (steps / n_elem))
        positions = torch.arange(seq_len, dtype=torch.float, device=device) / self.position_divisor
        angles = torch.outer(positions, theta).float()
        cache = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
        if dtype in (torch.float16, torch.bfloat16, torch.int8):  # an int8 model's table is fp16, as in the original
            cache = cache.bfloat16() if dtype == torch.bfloat16 else cache.half()
        return cache


def own_loaded_inv_freq(module, state_dict, prefix, *args):
    """4.x: copied as it arrives, its shard is not kept resident while the others load (a peak above native Glm's)."""
    key = prefix + "inv_freq"
    if isinstance(state_dict.get(key), torch.Tensor) and state_dict[key].device.type == "cpu":
        state_dict[key] = state_dict[key].clone()


def head_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int, dtype: Optional[torch.dtype] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [batch, seq, pairs] over a head's width [batch, 1, seq, head_dim], repeated per pair, sin signed
    (-, +), passing channels cos 1, sin 0: made once a forward, they turn a layer's heads in four operators."""
    passing = head_dim - 2 * cos.shape[-1]
    cos = F.pad(cos.repeat_interleave(2, dim=-1), (0, passing), value=1.0)[:, None]
    sin = F.pad(torch.stack((-sin, sin), dim=-1).flatten(-2), (0, passing))[:, None]
    return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(x0 cos - x1 sin, x1 cos + x0 sin) per pair of x [batch, heads, seq, head_dim]: the original's arithmetic."""
    return x * cos + x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin


# ======================================================================================================================
# Attention
# ======================================================================================================================


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    batch, kv_heads, seq, dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, groups, seq, dim).reshape(batch, kv_heads * groups, seq, dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """The original's arithmetic: layer scaling keeps fp16 scores from overflowing, and forces the fp32 softmax."""
    config = module.config
    groups = query.shape[1] // key.shape[1]  # 1 where the caller repeated them (the original's call of core_attention)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    coeff = module.layer_number if config.apply_query_key_layer_scaling else 1
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling / coeff)
    if config.attention_softmax_in_fp32 or config.apply_query_key_layer_scaling:
        scores = scores.float()
    scores = scores * coeff
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = F.softmax(scores, dim=-1).to(value.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def sdpa_grouped_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA keeping the key/value groups, so no decode step copies the cache; a masked prompt (CUDA's fused kernels
    take a mask or groups, not both) and torch < 2.5 expand them once (as query rows they would need a larger mask)."""
    batch, heads, query_length, dim = query.shape
    groups = heads // key.shape[1]  # 1 where the caller repeated them (the original's call of core_attention)
    if groups > 1 and query_length == 1:
        out = F.scaled_dot_product_attention(
            query.reshape(batch, heads // groups, groups, dim), key, value, attn_mask=attention_mask,
            dropout_p=dropout, scale=scaling,
        ).reshape(batch, heads, 1, dim)
    else:
        grouped = attention_mask is None and groups > 1 and _SDPA_HAS_GQA
        if not grouped:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            is_causal=attention_mask is None and query_length > 1, **({"enable_gqa": True} if grouped else {}))
    return out.transpose(1, 2).contiguous(), None


def attention_function(implementation: str):
    """Ours for eager, and for sdpa where transformers has none (< 4.48) or its own expands groups (no `pack_gqa`)."""
    if implementation in (None, "eager"):
        return eager_attention_forward
    if ALL_ATTENTION_FUNCTIONS is None:
        if implementation == "sdpa":
            return sdpa_grouped_attention_forward
        raise ValueError(f"attn_implementation={implementation!r} needs transformers >= 4.48 with this model; "
                         f"{transformers.__version__} is installed. Use 'sdpa' or 'eager', or upgrade transformers.")
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # 5.x
        kernel = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    else:
        kernel = ALL_ATTENTION_FUNCTIONS[implementation]
    if _TRANSFORMERS_SDPA_EXPANDS_GROUPS and kernel is _transformers_sdpa.sdpa_attention_forward:
        return sdpa_grouped_attention_forward  # (a kernel registered over "sdpa" by the user is kept)
    return kernel


def attention_implementation(config: ChatGLMConfig, output_attentions: bool) -> str:
    """The configured kernel, or eager when attention weights are asked for (as transformers' models fall back)."""
    implementation = config._attn_implementation or "eager"
    if not output_attentions or implementation == "eager":
        return implementation
    if not is_tracing():  # (logging breaks a compiled graph)
        logger.warning_once("output_attentions=True: the attention weights are computed by the eager kernel for those "
                            f"calls instead of {implementation!r} (slower, more memory). Load with "
                            "attn_implementation='eager' to make it the default.")
    return "eager"


def packed_sequence_ids(position_ids: Optional[torch.Tensor], attention_mask, past_length) -> Optional[torch.Tensor]:
    """Padding-free batches (TRL packing) restart positions per sequence: each token's sequence number, or None."""
    if position_ids is None or not (isinstance(past_length, int) and past_length == 0) or position_ids.shape[-1] < 2:
        return None
    if attention_mask is not None and attention_mask.dim() == 4:
        return None
    steps = torch.diff(position_ids, dim=-1, prepend=position_ids[..., :1] - 1)
    restarts = (steps != 1) & ~((steps == 0) & (position_ids > 0))  # GLM-4V's image rows share one position
    sequence_ids = restarts.cumsum(-1)
    if not is_tracing() and not bool(sequence_ids[..., -1].any()):
        return None
    return sequence_ids


def flash_varlen_kwargs(sequence_ids: torch.Tensor, position_ids: torch.Tensor, batch_size: int) -> dict:
    """Packed rows as the flash kernels take them (read when the mask is None, >= 4.48): cu_seq_lens, the longest."""
    sequence_ids = sequence_ids.expand(batch_size, -1)
    starts = F.pad(sequence_ids[:, 1:] != sequence_ids[:, :-1], (1, 0), value=True).flatten()
    boundaries = F.pad(starts.nonzero().flatten(), (0, 1), value=starts.numel()).to(torch.int32)
    longest = int((boundaries[1:] - boundaries[:-1]).max())
    return dict(cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=longest, max_length_k=longest,
                position_ids=position_ids.expand(batch_size, -1))


def build_attention_mask(implementation, attention_mask, query_positions, key_length, *, batch_size,
                         preallocated=False, sequence_ids=None, prefix=0):
    """None (causal), flash's 2-D padding mask, or a boolean mask True where a query may look (a 4D mask given passes
    through). query_positions [1, new]: cache slots; sequence_ids: packed rows, each seeing the `prefix` slots too."""
    if attention_mask is not None and attention_mask.dim() == 4:
        if implementation == "eager" and attention_mask.dtype == torch.bool:
            # A query that sees no key (generate()'s static-cache masks are made for sdpa, which gives it zeros) sees
            # every key: eager's softmax over nothing is NaN, which would reach real tokens at the next layer.
            return attention_mask | ~attention_mask.any(dim=-1, keepdim=True)
        return attention_mask
    query_length = query_positions.shape[-1]
    # Without padding, causality alone is the mask when the keys end with the queries, or when a prompt fills an
    # empty static cache (one host sync per prompt). Value-dependent shortcuts step aside while tracing.
    if preallocated:
        prefill, decode = query_length > 1 and not is_tracing() and int(query_positions[0, 0]) == 0, False
    else:
        prefill, decode = query_length == key_length, query_length == 1
    if attention_mask is not None and prefill and not is_tracing() and bool(attention_mask.all()):
        attention_mask = None  # one host sync per prompt buys the fused causal kernels (none per decode step)
    key_positions = torch.arange(key_length, device=query_positions.device)
    if implementation.startswith("flash"):
        if sequence_ids is not None and prefix:
            raise ValueError("Packed sequences with a P-tuning v2 prefix need attn_implementation 'sdpa' or 'eager' "
                             "(the flash kernels' packed layout has no slots that every sequence sees).")
        if attention_mask is None and preallocated:  # only the written slots
            attention_mask = (key_positions[None] <= query_positions[:, -1:]).expand(batch_size, -1)
        if attention_mask is not None and attention_mask.shape[-1] < key_length:
            attention_mask = F.pad(attention_mask, (0, key_length - attention_mask.shape[-1]), value=0)
        return attention_mask
    if attention_mask is None and sequence_ids is None and (decode or (prefill and implementation == "sdpa")):
        return None
    if decode:  # every key precedes the token: the padding is the mask (a row of padding alone sees every key)
        allowed = (attention_mask != 0)[:, None, None, :]
        return allowed | ~allowed.any(dim=-1, keepdim=True)
    mask = key_positions[None, None, :] <= query_positions[:, :, None]
    if sequence_ids is not None:  # the prefix slots, then the keys of the query's own sequence
        key_ids = F.pad(sequence_ids, (prefix, key_length - prefix - sequence_ids.shape[-1]), value=-1)
        mask = mask & ((sequence_ids[:, :, None] == key_ids[:, None, :]) | (key_positions < prefix)[None, None, :])
    if attention_mask is not None:
        padding = attention_mask.bool()
        if padding.shape[-1] < key_length:  # a static cache's slots beyond the mask are unwritten
            padding = F.pad(padding, (0, key_length - padding.shape[-1]), value=False)
        mask = mask & padding[:, None, :]
    mask = mask | ~mask.any(dim=-1, keepdim=True)  # a padding query sees every key: its softmax stays finite
    return mask[:, None]


def placed_inputs(value, device: Optional[torch.device]):
    """A layer's inputs with their tensors on `device`. Plain loops: torch 2.4's dynamo traces no such comprehension."""
    if isinstance(value, torch.Tensor) or value is None:
        return device_boundary(value, device)
    if not isinstance(value, tuple):
        return value
    items = []
    for item in value:
        items.append(placed_inputs(item, device))
    return type(value)(*items) if hasattr(value, "_fields") else tuple(items)


def as_original_call(hidden_states, attention_mask, rotary_pos_emb):
    """(attention_mask, rotary_pos_emb) in the original's form, for a module whose forward a tool replaced."""
    if not isinstance(rotary_pos_emb, tuple):
        return attention_mask, rotary_pos_emb
    cos, sin, cache_position = rotary_pos_emb[:3]
    turning = cos.shape[-1] // 2  # the first half of a head's channels turns
    rows = torch.stack((cos[:, 0, :, 0:turning:2], sin[:, 0, :, 1:turning:2]), dim=-1)
    return original_mask(attention_mask, cache_position, None, hidden_states.shape[0]), rows


def original_mask(mask, cache_position: torch.Tensor, key_length: Optional[int], batch_size: int):
    """The original's mask from the kernel's; with `key_length` never None (a core_attention may not take None)."""
    if mask is not None and mask.dim() == 4:
        return ~mask if mask.dtype == torch.bool else mask < 0  # a custom additive mask hides with negative values
    if mask is None and key_length is None:
        return None
    keys = mask.shape[-1] if mask is not None else key_length
    allowed = (torch.arange(keys, device=cache_position.device) <= cache_position[:, None])[None, None]
    if mask is not None:  # flash's padding mask; a padded query sees every key, as in the original's prompt
        padding = device_boundary(mask, allowed.device) != 0
        allowed = (allowed & padding[:, None, None, :]) | ~padding[:, None, -cache_position.shape[0]:, None]
    return ~allowed.expand(batch_size, 1, -1, -1)


def kernel_mask(original, new: int, keys: int, device, implementation: str):
    if original is not None:
        return ~original if original.dtype == torch.bool else original
    if new == 1 or (new == keys and implementation == "sdpa"):
        return None
    return torch.ones(new, keys, dtype=torch.bool, device=device).tril_(keys - new)


def check_batch_first(hidden_states, attention_mask, rotary_pos_emb):
    """ChatGLM2/3's originals were sequence-first: their tensors would be read wrongly without a word."""
    batch, seq = hidden_states.shape[:2]
    fits = rotary_pos_emb.dim() == 4 and rotary_pos_emb.shape[1] == seq and rotary_pos_emb.shape[0] in (1, batch)
    if attention_mask is not None:
        fits = fits and attention_mask.shape[0] in (1, batch) and attention_mask.shape[-2] == seq
    if not fits:
        got = [None if t is None else list(t.shape) for t in (hidden_states, rotary_pos_emb, attention_mask)]
        raise ValueError(
            "This layer takes the original's tensors in GLM-4's batch-first layout: hidden_states [batch, seq, "
            "hidden], rotary_pos_emb [batch or 1, seq, rotary_dim / 2, 2] (rotary_pos_emb(seq_length)[position_ids]), "
            f"attention_mask None or [batch, 1, seq, keys], True where a query must not look; got {got} (in that "
            "order). ChatGLM2/3's originals were sequence-first ([seq, batch, ...]): transpose, or call the model.")


class CoreAttention(nn.Module):
    """The kernel's call (OpenVINO's export replaces it); kernels get it as `module`. Named as in GLM-4's original."""

    def __init__(self, config: ChatGLMConfig, layer_number: int):
        super().__init__()
        self.config = config
        self.layer_number = max(1, layer_number)
        self.layer_idx = layer_number - 1
        self.sizes = AttentionSizes.from_config(config)  # SelfAttention keeps them per rank (tensor parallelism)
        self.is_causal = True
        self.apply_query_key_layer_scaling = config.apply_query_key_layer_scaling
        self.attention_softmax_in_fp32 = config.attention_softmax_in_fp32 or config.apply_query_key_layer_scaling
        self.coeff = self.layer_number if self.apply_query_key_layer_scaling else None  # the original's; unread
        self.norm_factor = self.sizes.head_dim ** 0.5 * (self.coeff or 1)
        self.scaling = self.sizes.head_dim ** -0.5
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    num_key_value_groups = property(lambda self: self.sizes.groups)  # read by transformers' attention functions
    num_attention_heads_per_partition = property(lambda self: self.sizes.num_heads)
    hidden_size_per_attention_head = property(lambda self: self.sizes.head_dim)
    hidden_size_per_partition = property(lambda self: self.sizes.num_heads * self.sizes.head_dim)

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        if isinstance(attention_mask, tuple):  # this file's call (KernelInputs)
            mask, implementation, kernel_kwargs, attentions = attention_mask
            kernel = attention_function(implementation)
        else:  # the original's: our kernels (they take repeated heads as groups of one); flash takes no 4-D mask
            eager = self.config._attn_implementation in (None, "eager")
            kernel = eager_attention_forward if eager else sdpa_grouped_attention_forward
            mask = kernel_mask(attention_mask, query_layer.shape[-2], key_layer.shape[-2], query_layer.device,
                               "eager" if eager else "sdpa")
            kernel_kwargs, attentions = (), None
        dropout = self.attention_dropout.p if self.training else 0.0
        out, weights = kernel(self, query_layer, key_layer, value_layer, mask,
                              **{**dict(kernel_kwargs), "dropout": dropout, "scaling": self.scaling})
        if attentions is not None:
            attentions[self.layer_idx] = weights
        return out.flatten(2)

    _own_forward = forward  # the forward this class computes with (forward_replaced)


class SdpaAttention(CoreAttention):
    """core_attention under attn_implementation="sdpa"."""


class FlashAttention2(CoreAttention):
    """core_attention under a flash attention implementation."""


def core_attention_class(config) -> type:
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation == "sdpa":
        return SdpaAttention
    return FlashAttention2 if implementation.startswith("flash") else CoreAttention


class SelfAttention(nn.Module):
    """kv_cache: a Cache, written into and returned; or the original's None (returns a tensor [1, 2, batch,
    kv_heads, seq, dim]) or (keys, values) of the earlier tokens (returns the longer pair)."""

    def __init__(self, config: ChatGLMConfig, layer_number: int):
        super().__init__()
        self.config = config
        self.layer_number = max(1, layer_number)
        self.layer_idx = layer_number - 1
        self.core_attention = core_attention_class(config)(config, layer_number)
        self.sizes = AttentionSizes.from_config(config)
        self.is_causal = True
        linear = linear_layer(config)
        self.query_key_value = linear(
            config.hidden_size, self.sizes.qkv_features, bias=config.add_bias_linear or config.add_qkv_bias)
        self.dense = linear(self.sizes.num_heads * self.sizes.head_dim, config.hidden_size, bias=config.add_bias_linear)

    @property
    def sizes(self) -> AttentionSizes:
        """A rank's head counts under tensor parallelism, handed on to our core_attention (its kernels read them)."""
        return self._sizes

    @sizes.setter
    def sizes(self, sizes: AttentionSizes):
        self._sizes = sizes
        if isinstance(self._modules.get("core_attention"), CoreAttention):
            self.core_attention.sizes = sizes

    num_key_value_groups = property(lambda self: self.sizes.groups)
    scaling = property(lambda self: self.sizes.head_dim ** -0.5)
    num_attention_heads_per_partition = property(lambda self: self.sizes.num_heads)  # the original's, per rank
    hidden_size_per_attention_head = property(lambda self: self.sizes.head_dim)
    num_multi_query_groups_per_partition = property(lambda self: self.sizes.num_kv_heads)
    projection_size = property(lambda self: self.sizes.num_heads * self.sizes.head_dim)
    qkv_hidden_size = property(lambda self: self.sizes.qkv_features)
    multi_query_attention = property(lambda self: self.sizes.multi_query)

    def rotated_heads(self, mixed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Query and key turned (one slice where grouped); key and value copied: views would keep the projection."""
        s = self.sizes
        if not s.multi_query:  # [q | k | v] per head
            query, key, value = mixed.unflatten(-1, (s.num_heads, 3 * s.head_dim)).transpose(1, 2).split(
                s.head_dim, dim=-1)
            return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value.contiguous()
        heads, value = mixed.split([(s.num_heads + s.num_kv_heads) * s.head_dim, s.num_kv_heads * s.head_dim], dim=-1)
        # [batch, seq, heads, dim]: the tables' head axis moves beside the heads
        heads = apply_rotary(heads.unflatten(-1, (-1, s.head_dim)), cos.transpose(1, 2), sin.transpose(1, 2))
        query, key = heads.transpose(1, 2).split([s.num_heads, s.num_kv_heads], dim=1)
        return query, key.contiguous(), value.unflatten(-1, (-1, s.head_dim)).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        if not isinstance(rotary_pos_emb, tuple):  # the original's call
            attention_mask, rotary_pos_emb = self.from_original(hidden_states, attention_mask, rotary_pos_emb, kv_cache)
        cos, sin, cache_position, implementation, kernel_kwargs, attentions = rotary_pos_emb
        query, key, value = self.rotated_heads(self.query_key_value(hidden_states), cos, sin)
        key, value, kv_cache = self.cached(key, value, kv_cache, use_cache, cache_position)
        if forward_replaced(self.core_attention):  # a tool's function of the original's contract
            groups = query.shape[1] // key.shape[1]
            context = self.core_attention(query, repeat_kv(key, groups), repeat_kv(value, groups), original_mask(
                attention_mask, cache_position, key.shape[-2], query.shape[0]))
        else:
            context = self.core_attention(query, key, value,
                                          KernelInputs(attention_mask, implementation, kernel_kwargs, attentions))
        return self.dense(context), kv_cache

    _own_forward = forward  # the forward this class computes with (forward_replaced)

    def cached(self, key, value, kv_cache, use_cache: bool, cache_position):
        if isinstance(kv_cache, Cache):  # (cache_position: static caches before 5.0)
            key, value = kv_cache.update(key, value, self.layer_idx, {"cache_position": cache_position})
            return key, value, (kv_cache if use_cache else None)
        if kv_cache is not None:
            key, value = torch.cat((kv_cache[0], key), dim=2), torch.cat((kv_cache[1], value), dim=2)
            return key, value, ((key, value) if use_cache else None)
        return key, value, (torch.stack((key, value))[None] if use_cache else None)

    def from_original(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache):
        new = hidden_states.shape[1]
        if rotary_pos_emb is None:  # the original rotates nothing then: cos 1, sin 0
            rotary_pos_emb = F.pad(hidden_states.new_ones(1, new, self.sizes.head_dim // 4, 1), (0, 1))
        check_batch_first(hidden_states, attention_mask, rotary_pos_emb)
        past = 0 if kv_cache is None else kv_cache[0].shape[-2] if isinstance(kv_cache, tuple) else \
            kv_cache.get_seq_length(self.layer_idx)
        rows = rotary_pos_emb.float()
        cos, sin = head_tables(rows[..., 0], rows[..., 1], self.sizes.head_dim, hidden_states.dtype)
        implementation = "eager" if self.config._attn_implementation in (None, "eager") else "sdpa"  # 4-D masks
        mask = kernel_mask(attention_mask, new, past + new, hidden_states.device, implementation)
        return mask, LayerInputs(cos, sin, torch.arange(past, past + new, device=hidden_states.device),
                                 implementation, (), None)


# ======================================================================================================================
# MLP, norms
# ======================================================================================================================


class MLP(nn.Module):
    """SwiGLU: dense_h_to_4h holds [gate | up]."""

    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        linear = linear_layer(config)
        self.add_bias = config.add_bias_linear
        self.dense_h_to_4h = linear(config.hidden_size, 2 * config.ffn_hidden_size, bias=config.add_bias_linear)
        self.dense_4h_to_h = linear(config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear)

    @staticmethod
    def activation_func(x):
        """The original's name: a patch of it reaches forward, as there."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, hidden_states):
        return self.dense_4h_to_h(self.activation_func(self.dense_h_to_4h(hidden_states)))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states):
        # The original's arithmetic: normalised and weighted in fp32, rounded once; one call where torch's is the same.
        dtype = hidden_states.dtype
        if self.weight.dtype == dtype and (dtype == torch.float32 or rms_norm_rounds_once(hidden_states.device, dtype)):
            return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.eps)
        normalized = F.rms_norm(hidden_states.float(), self.weight.shape, None, self.eps)
        return (self.weight * normalized).to(hidden_states.dtype)


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, also for an fp32 residual stream over half-precision weights."""

    def forward(self, hidden_states):
        weight = self.weight.to(hidden_states.dtype)
        bias = None if self.bias is None else self.bias.to(hidden_states.dtype)
        return F.layer_norm(hidden_states, self.normalized_shape, weight, bias, self.eps)


def make_norm(config: ChatGLMConfig) -> nn.Module:
    if config.rmsnorm:
        return RMSNorm(config.hidden_size, config.layernorm_epsilon)
    return LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


# ======================================================================================================================
# Block and stack
# ======================================================================================================================


class GLMBlock(GradientCheckpointingLayer):
    """Under gradient checkpointing the cache comes as `kv_cache`, a name no release's checkpointing drops."""

    def __init__(self, config: ChatGLMConfig, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.apply_residual_connection_post_layernorm = config.apply_residual_connection_post_layernorm
        self.fp32_residual_connection = config.fp32_residual_connection
        self.hidden_dropout = config.hidden_dropout
        self.input_layernorm = make_norm(config)
        self.self_attention = SelfAttention(config, layer_number)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = MLP(config)

    def norm(self, norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """With fp32_residual_connection, the fp32 stream normed into the sublayer's dtype."""
        out = norm(hidden_states)
        return out.to(norm.weight.dtype) if self.fp32_residual_connection else out

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        normed = self.norm(self.input_layernorm, hidden_states)
        residual = normed if self.apply_residual_connection_post_layernorm else hidden_states
        if forward_replaced(self.self_attention):
            attention_mask, rotary_pos_emb = as_original_call(normed, attention_mask, rotary_pos_emb)
        # (rebound to the sum at once: not kept alive through the MLP)
        hidden_states, kv_cache = self.self_attention(normed, attention_mask, rotary_pos_emb, kv_cache=kv_cache,
                                                      use_cache=use_cache)
        hidden_states = residual + self.dropout(hidden_states)

        normed = self.norm(self.post_attention_layernorm, hidden_states)
        residual = normed if self.apply_residual_connection_post_layernorm else hidden_states
        hidden_states = residual + self.dropout(self.mlp(normed))
        return hidden_states, kv_cache

    def dropout(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0:  # no operator in inference
            return hidden_states
        return F.dropout(hidden_states, p=self.hidden_dropout, training=True)


# transformers 5.x wraps a GradientCheckpointingLayer's forward as the class is made: the wrapper is the class's own.
GLMBlock._own_forward = GLMBlock.forward


class GLMTransformer(nn.Module):
    """The original's `encoder` and calls (GPTQModel replaces its forward); hidden states end with the final norm's."""

    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.num_layers = config.num_layers
        self.post_layer_norm = config.post_layer_norm
        self.fp32_residual_connection = config.fp32_residual_connection
        self.gradient_checkpointing = False  # the original's flag; each layer checkpoints itself
        self.layers = nn.ModuleList([GLMBlock(config, number + 1) for number in range(config.num_layers)])
        self.final_layernorm = make_norm(config) if config.post_layer_norm else None

    def _get_layer(self, layer_number: int) -> GLMBlock:
        return self.layers[layer_number]

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_caches=None, use_cache=True,
                output_hidden_states=False):
        presents = () if use_cache else None
        all_hidden_states = () if output_hidden_states else None
        placed = None  # the device the mask and rotary inputs are on: copied once per device that holds layers
        for index in range(self.num_layers):
            layer = self._get_layer(index)
            device = execution_device(layer)
            hidden_states = device_boundary(hidden_states, device)
            if index == 0 or device != placed:
                attention_mask, rotary_pos_emb = placed_inputs(attention_mask, device), placed_inputs(rotary_pos_emb,
                                                                                                       device)
                placed = device
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            mask, rotary = attention_mask, rotary_pos_emb
            if forward_replaced(layer):
                mask, rotary = as_original_call(hidden_states, mask, rotary)
            kv_cache = kv_caches[index] if kv_caches else None
            hidden_states, kv_cache = layer(hidden_states, mask, rotary, kv_cache=kv_cache, use_cache=use_cache)
            if use_cache:
                presents = gathered_presents(presents, kv_cache)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(device_boundary(hidden_states, execution_device(self.final_layernorm)))
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        weights = rotary_pos_emb[5] if isinstance(rotary_pos_emb, tuple) else None
        return hidden_states, presents, all_hidden_states, None if weights is None else tuple(weights)

    _own_forward = forward  # the forward this class computes with (forward_replaced)


def gathered_presents(presents, kv_cache):
    """As the original gathers them: tensors concatenated, anything else one item a layer."""
    if not isinstance(kv_cache, torch.Tensor):
        return presents + (kv_cache,)
    if isinstance(presents, tuple):  # the first layer's
        return kv_cache
    return torch.cat((presents, device_boundary(kv_cache, presents.device)))


# ======================================================================================================================
# Base model
# ======================================================================================================================


class ChatGLMPreTrainedModel(PreTrainedModel):
    config_class = ChatGLMConfig
    base_model_prefix = "transformer"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GLMBlock", "TransformerLayer"]  # TransformerLayer: GLM-4V's vision blocks
    _skip_keys_device_placement = ["past_key_values", "cache"]  # the cache's layers stay where they are (5.24 name)
    is_loaded_in_4bit = is_loaded_in_8bit = is_quantized = False  # transformers' quantizers set them
    _supports_sdpa = True
    _supports_flash_attn_2 = True  # 4.x name
    _supports_flash_attn = True  # 5.x name
    _supports_cache_class = True  # 4.x: generate() hands us Cache objects
    _supports_static_cache = True
    _supports_attention_backend = True  # registered kernels get the forward's extra arguments; 4D masks honoured
    _can_compile_fullgraph = True  # static-cache decode compiles as one graph (tests/test_compile.py)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' from_pretrained with the load checks (docs/load-checks.md; `check_finite_weights=False`
        skips NaN/inf). With tp_plan="auto", tp_size, device_mesh or distributed_config: our tensor-parallel plan."""
        source = pretrained_model_name_or_path
        check_finite = kwargs.pop("check_finite_weights", True)
        checks = load_checks(checkpoint=None if source is None else str(source),
                             **{name: kwargs[name] for name in HUB_KWARGS if name in kwargs})
        if any(kwargs.get(name) is not None for name in ("tp_plan", "tp_size", "device_mesh", "distributed_config")):
            config = cls._config_for(source, kwargs)
            parallel = import_companion("parallel_chatglm", config, checkpoint=str(source))
            parallel.check_shardable(config)  # before torchrun's environment is asked for

            def load_checked(*args, **load_kwargs):  # every rank checks the whole weights it read, before sharding
                loaded = super(ChatGLMPreTrainedModel, cls).from_pretrained(*args, **load_kwargs)
                if check_finite and checks is not None:
                    checks.check_finite_weights(loaded[0] if isinstance(loaded, tuple) else loaded, source)
                return loaded

            return parallel.from_pretrained_tensor_parallel(load_checked, source, *model_args, **kwargs)
        config = cache(lambda: cls._config_for(source, kwargs))  # read once, where a check needs it
        device_map = kwargs.get("device_map")
        if checks is not None and isinstance(device_map, dict):
            checks.check_devices_exist(device_map)
            with torch.device("meta"):
                checks.check_device_map(cls(config()), device_map)
        if source is not None and os.path.isdir(os.fspath(source)) and (
                kwargs.get("pre_seq_len") or getattr(config(), "pre_seq_len", None)):
            ptuning(config()).check_prefix_checkpoint(source, config(), kwargs)
        with_info = kwargs.pop("output_loading_info", False)
        checked = checks is not None and checks.check_stored_dtypes(source, kwargs, lambda: cls(config()), config)
        try:
            model, info = super().from_pretrained(source, *model_args, output_loading_info=True, **kwargs)
        except Exception:
            if checks is not None and not checked:  # downloaded by this call: a storage the config contradicts is named
                checks.check_stored_dtypes(source, kwargs, lambda: cls(config()), config)
            raise
        if checks is not None:
            if not checked:
                checks.check_stored_dtypes(source, kwargs, model)
            checks.check_loaded(model, info, source, finite=check_finite)
        if model.base_model.prefix_encoder is not None:  # the prefix alone trains, and a random one is said
            ptuning(model.config).settle_loaded_prefix(model, info)
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.own_loaded_buffer()
        if _TIED_KEYS_ARE_A_MAPPING and getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()  # 5.x leaves two stored matrices untied, with a warning; 4.x ties them, as here
        if weight_storage(model.config) != "float":
            model.use_quantized_kernel("auto")
        return (model, info) if with_info else model

    if _HAS_ACTIVATION_CHECKPOINTING:

        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, *args, **kwargs):
            """transformers' activation checkpointing (gradient_checkpointing_enable() is its alias)."""
            super().activation_checkpointing_enable(
                prefix_checkpointing_kwargs(self, activation_checkpointing_kwargs), *args, **kwargs)

    else:

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, *args, **kwargs):
            """transformers' gradient checkpointing."""
            super().gradient_checkpointing_enable(
                prefix_checkpointing_kwargs(self, gradient_checkpointing_kwargs), *args, **kwargs)

    def load_prefix_encoder(self, path) -> str:
        """Load a P-tuning v2 prefix: a ptuning trainer's, save_prefix_encoder's or PEFT's. Returns the file read."""
        encoder = require_prefix(self)
        return ptuning(self.config).load_prefix_file(encoder, path)

    def save_prefix_encoder(self, save_directory) -> str:
        """Write the P-tuning v2 prefix alone, as the ChatGLM2/3 ptuning trainer did. Returns the file written."""
        encoder = require_prefix(self)
        return ptuning(self.config).save_prefix_file(encoder, save_directory)

    @classmethod
    def _config_for(cls, pretrained_model_name_or_path, kwargs) -> ChatGLMConfig:
        """The config passed, else the checkpoint's, read with this class's config class."""
        config = kwargs.get("config")
        if isinstance(config, transformers.PretrainedConfig):  # 5.x: AutoConfig's class is another module's copy
            return config
        config = cls.config_class.from_pretrained(
            pretrained_model_name_or_path, **{k: kwargs[k] for k in ("revision", *HUB_KWARGS) if k in kwargs})
        config._name_or_path = str(pretrained_model_name_or_path)  # where GLM-4V's check model finds visual.py
        return config

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, and the companion files beside the code files."""
        variant = checkpoint_variant(self.config)
        if variant is not None and CHECKPOINT_VARIANTS[variant]["rotary"] != "base":
            self.config.chatglm_variant = variant  # the names that told the reading are not saved
        super().save_pretrained(save_directory, *args, **kwargs)
        if self._auto_class is None or not kwargs.get("is_main_process", True):
            return
        for name in COMPANION_FILES:
            found, target = find_companion(name, self.config), Path(save_directory) / f"{name}.py"
            if found is not None and not (target.exists() and target.samefile(found)):
                shutil.copyfile(found, target)

    def use_quantized_kernel(self, kernel: str = "packed") -> int:
        """A pre-quantized model's kernel: "packed" (bf16, for decode), "exact" (the original's) or "auto"."""
        return import_companion("quantization_chatglm", self.config).use_model_kernel(self, kernel)

    def use_cpu_packed_weights(self, enable: bool = True) -> int:
        """Opt-in CPU decode paths (quantization_chatglm.py says when they pay); False drops them. Returns the count."""
        return import_companion("quantization_chatglm", self.config).use_cpu_packed_weights(self, enable)

    def tensor_parallel(self, mesh_or_size=None):
        """Shard in place over a 1-D DeviceMesh or `mesh_or_size` ranks (default: all); every rank calls it."""
        return import_companion("parallel_chatglm", self.config).tensor_parallel(self, mesh_or_size)

    # The original's mask and position helpers, for code that calls them: this model's forward builds its own.
    def get_masks(self, input_ids, past_key_values, padding_mask=None):
        """The original's mask [batch, 1, seq, past + seq], True where a query must not look."""
        batch_size, seq_length = input_ids.shape[:2]  # GLM-4V's original passes the embeddings here
        past_length, device = cached_length_of(past_key_values), input_ids.device
        allowed = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).tril_()
        if past_length:
            allowed = torch.cat((allowed.new_ones(seq_length, past_length), allowed), dim=-1)
        allowed = allowed.expand(batch_size, -1, -1)
        if padding_mask is not None:
            padding = device_boundary(padding_mask, device) != 0
            allowed = allowed & padding[:, None, :]
            if not past_length:
                allowed = allowed | ~padding[:, :, None]
        return ~allowed[:, None]

    def get_position_ids(self, input_ids, device):
        """Positions 0 .. seq - 1 for every row (the original's; this model's forward counts left padding out)."""
        batch_size, seq_length = input_ids.shape
        return torch.arange(seq_length, dtype=torch.long, device=device).unsqueeze(0).repeat(batch_size, 1)

    get_multimodal_position_ids = get_position_ids  # GLM-4V's original name for the same positions

    def _init_weights(self, module):
        """Random weights for models built from a config (the original left them uninitialised)."""
        std = getattr(self.config, "initializer_range", 0.02)
        if hasattr(module, "weight_scale"):  # a pre-quantized layer (quantization_chatglm.py): int8 codes, no draw
            weight_init.zeros_(module.weight)
            weight_init.ones_(module.weight_scale)
            if module.bias is not None:
                weight_init.zeros_(module.bias)
        elif isinstance(module, (nn.Linear, nn.Embedding, nn.Conv2d)):
            weight_init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                weight_init.zeros_(module.bias)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            weight_init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                weight_init.zeros_(module.bias)
        elif isinstance(module, RotaryEmbedding):
            if hasattr(weight_init, "copy_"):
                weight_init.copy_(module.inv_freq, module.checkpoint_inv_freq())
            else:
                module.inv_freq.data.copy_(module.checkpoint_inv_freq())
        else:  # parameters a module holds itself: GLM-4V's class, begin- and end-of-image rows
            for param in module.parameters(recurse=False):
                weight_init.normal_(param, mean=0.0, std=std)


class Embedding(nn.Module):
    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.fp32_residual_connection = config.fp32_residual_connection

    def forward(self, input_ids):
        embeddings = self.word_embeddings(input_ids)
        return embeddings.float() if self.fp32_residual_connection else embeddings


class ChatGLMModel(ChatGLMPreTrainedModel):
    # The output layer is the base model's (the original's layout); tied only with config.tie_word_embeddings.
    _tied_weights_keys = tied_weights_keys("output_layer.weight", "embedding.word_embeddings.weight")

    def __init__(self, config: ChatGLMConfig, empty_init=True, device=None):  # (empty_init: the original's, unused)
        super().__init__(config)
        check_supported(config)
        # The original's size attributes (P-tuning and export scripts read them).
        self.num_layers, self.kv_channels, self.seq_length = config.num_layers, config.kv_channels, config.seq_length
        self.multi_query_group_num = config.multi_query_group_num
        self.pre_seq_len = getattr(config, "pre_seq_len", None)
        self.prefix_projection = getattr(config, "prefix_projection", False)
        self.embedding = Embedding(config)
        self.rotary_pos_emb = RotaryEmbedding(config)
        self.encoder = GLMTransformer(config)
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.prefix_encoder = prefix_encoder(config)  # P-tuning v2 (ptuning_chatglm.py), None without pre_seq_len
        self.vision = vision_tower(config) if getattr(config, "vision_config", None) else None  # GLM-4V (visual.py)
        if self.prefix_encoder is not None:
            ptuning(config).train_prefix_only(self)
        self.post_init()
        if device is not None:
            self.to(device)

    _prepare_4d_causal_attention_mask_with_cache_position = staticmethod(static_cache_mask_before_4_53)  # 4.46-4.52

    def get_input_embeddings(self):
        return self.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.embedding.word_embeddings = value

    def get_prompt(self, batch_size, device, dtype=torch.float16):
        """The P-tuning v2 prefix as legacy past_key_values (GLM-4's layout); the forward adds it itself."""
        encoder = require_prefix(self)
        key_values = encoder.key_values(batch_size, dtype, execution_device(encoder))
        return tuple(device_boundary(torch.stack(pair), torch.device(device)) for pair in key_values)

    def quantize(self, weight_bit_width: int, storage: str = "library"):
        """The original's base-model call (see ChatMixin.quantize)."""
        import_companion("quantization_chatglm", self.config).quantize(self, weight_bit_width, storage)
        return self

    def forward(self, input_ids: Optional[torch.LongTensor] = None, position_ids: Optional[torch.LongTensor] = None,
                attention_mask: Optional[torch.Tensor] = None, past_key_values=None,
                inputs_embeds: Optional[torch.Tensor] = None, use_cache: Optional[bool] = None,
                output_attentions: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None, images: Optional[torch.Tensor] = None,
                cache: Optional[Cache] = None, **kwargs):
        """`images` (GLM-4V): pixels [batch, 3, S, S], one a sequence, spliced in at <|begin_of_image|>. `cache`:
        5.24's name for `past_key_values`. Other keyword arguments go to the attention kernel."""
        past_key_values = caller_cache(past_key_values, cache)
        # self.config, not a local name: llm-compressor's rewrite keeps a config in a local as a graph value
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else self.config.output_hidden_states)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        check_inputs(self, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values)
        use_cache = self.cache_in_use(use_cache)
        device = execution_device(self.embedding) or (input_ids if input_ids is not None else inputs_embeds).device
        input_ids, inputs_embeds, attention_mask, position_ids = (
            device_boundary(tensor, device) for tensor in (input_ids, inputs_embeds, attention_mask, position_ids))
        cache, legacy = cache_for_forward(past_key_values, self.config, use_cache)
        past_length = cache.get_seq_length() if cache is not None else 0

        inputs_embeds = self.embed(input_ids, inputs_embeds, attention_mask, past_length)
        # The seams of the optional capabilities: GLM-4V's image rows, then P-tuning v2's prefix slots.
        inputs_embeds, position_ids, attention_mask = enter_vision(
            self, input_ids, inputs_embeds, images, position_ids, attention_mask, cache, past_length)
        prefix = enter_prefix(self, cache, past_length, inputs_embeds.shape[0], inputs_embeds.shape[1])
        mask, layer_inputs = self.layer_inputs(prefix, position_ids, attention_mask, inputs_embeds,
                                               attention_implementation(self.config, output_attentions), kwargs,
                                               output_attentions)
        # The original's call of its encoder, with this file's values (Module contracts).
        rotary = layer_inputs
        if forward_replaced(self.encoder):  # a tool's encoder forward (GPTQModel's), written to the original
            mask, rotary = as_original_call(inputs_embeds, mask, layer_inputs)
        kv_caches = None if prefix.cache is None else (prefix.cache,) * self.encoder.num_layers
        hidden_states, _, all_hidden_states, all_attentions = self.encoder(
            inputs_embeds, mask, rotary_pos_emb=rotary, kv_caches=kv_caches, use_cache=use_cache,
            output_hidden_states=output_hidden_states)
        if self.config.fp32_residual_connection:
            hidden_states = hidden_states.to(self.compute_dtype)
        outputs = BaseModelOutputWithPast(
            last_hidden_state=hidden_states, **cache_output(cache_to_return(cache, use_cache, legacy)),
            hidden_states=all_hidden_states, attentions=all_attentions)
        if not return_dict:  # (a statement: llm-compressor's rewrite would make the expression a value of its graph)
            return outputs.to_tuple()
        return outputs

    def cache_in_use(self, use_cache: Optional[bool]) -> bool:
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if self.training and use_cache and any(layer.gradient_checkpointing for layer in self.encoder.layers):
            return False  # checkpointed layers run twice; a cache would be filled twice
        return use_cache

    def embed(self, input_ids, inputs_embeds, attention_mask, past_length):
        """Values are checked where it costs no device sync per decode step: on the CPU, or the prompt."""
        values_checked = not is_tracing() and (
            (input_ids if input_ids is not None else inputs_embeds).device.type == "cpu"
            or (isinstance(past_length, int) and past_length == 0))
        if values_checked:
            check_attention_mask_values(attention_mask)
        if inputs_embeds is not None:
            return inputs_embeds
        if values_checked:
            check_token_ids(input_ids, self.config.padded_vocab_size)
        return self.embedding(input_ids)

    def layer_inputs(self, prefix: "PrefixEntry", position_ids, attention_mask, inputs_embeds, implementation: str,
                     kernel_kwargs: dict, output_attentions: bool = False
                     ) -> Tuple[Optional[torch.Tensor], LayerInputs]:
        """Query positions are cache slots (after a prefix); position ids and a 2-D mask count tokens only."""
        batch_size, query_length = inputs_embeds.shape[:2]
        query_positions = (torch.arange(query_length, device=inputs_embeds.device) + prefix.past_slots)[None]
        past_tokens = prefix.past_slots - prefix.slots
        sequence_ids = packed_sequence_ids(position_ids, attention_mask, past_tokens)  # given positions only
        if position_ids is None:
            position_ids = self.default_position_ids(attention_mask, query_positions - prefix.slots, query_length)
        cos, sin = self.rotary_tables(position_ids)
        cache_slots = max_cache_length(prefix.cache) if prefix.cache is not None else None
        key_length = cache_slots or prefix.past_slots + query_length
        mask = build_attention_mask(implementation, prefix.extend_mask(attention_mask), query_positions, key_length,
                                    batch_size=batch_size, preallocated=cache_slots is not None,
                                    sequence_ids=sequence_ids, prefix=prefix.slots)
        kernel_kwargs = {name: value for name, value in kernel_kwargs.items() if name != "cache_position"}
        if sequence_ids is not None and mask is None and implementation.startswith("flash"):
            kernel_kwargs.update(flash_varlen_kwargs(sequence_ids, position_ids, batch_size))
        attentions = [None] * self.encoder.num_layers if output_attentions else None
        return mask, LayerInputs(cos, sin, query_positions[0], implementation, tuple(kernel_kwargs.items()),
                                 attentions)

    def rotary_tables(self, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The layers' cos/sin for these positions; a replaced rotary_pos_emb is called as the original calls it."""
        rotary = self.rotary_pos_emb
        position_ids = device_boundary(position_ids, execution_device(rotary))
        if forward_replaced(rotary):
            rows = rotary(self.seq_length)[position_ids].float()
            return head_tables(rows[..., 0], rows[..., 1], rotary.head_dim, self.compute_dtype)
        cos, sin = rotary(position_ids)
        return cos.to(self.compute_dtype), sin.to(self.compute_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The embedding's dtype: a quantizer may have replaced any Linear by one without a float `weight`."""
        return self.embedding.word_embeddings.weight.dtype

    @staticmethod
    def default_position_ids(attention_mask, query_positions, query_length):
        """Positions count real tokens only: a left-padded sequence gets the positions it has alone."""
        if attention_mask is None or attention_mask.dim() != 2:
            return query_positions
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -query_length:]


# ======================================================================================================================
# Companion files: code of optional capabilities, loaded on demand
# ======================================================================================================================


def code_source(config, checkpoint=None) -> Tuple[Optional[str], Optional[str]]:
    """The repository an `auto_map` entry names, else the checkpoint; and a Hub download's commit."""
    source = None
    for reference in (getattr(config, "auto_map", None) or {}).values():
        reference = reference[0] if isinstance(reference, (list, tuple)) else reference
        if isinstance(reference, str) and "--" in reference:
            source = reference.split("--")[0]
            break
    source = source or checkpoint or getattr(config, "_name_or_path", None) or None
    commit = (__package__ or "").rsplit(".", 1)[-1]
    return source, commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None


COMPANION_FILES = ("parallel_chatglm", "visual", "quantization_chatglm", "ptuning_chatglm", "checks_chatglm")
_MISSING_COMPANIONS = set()  # optional ones not found: looked for once a process
CHECKS_MODULE = f"{__package__}.checks_chatglm"


def find_companion(name: str, config=None, checkpoint=None, **hub_kwargs) -> Optional[Path]:
    """Beside this module, else where it came from: transformers' modules cache holds only the files seen imported."""
    beside = Path(__file__).with_name(f"{name}.py")
    if beside.exists():
        return beside
    source, revision = code_source(config, checkpoint)
    if not source:
        return None
    from transformers.utils import cached_file
    try:
        found = cached_file(source, f"{name}.py", revision=revision, _raise_exceptions_for_missing_entries=False,
                            **hub_kwargs)
    except (OSError, ValueError):
        return None
    return Path(found) if found else None


HUB_KWARGS = ("cache_dir", "token", "local_files_only")  # where from_pretrained finds a Hub checkpoint's files


def import_companion(name: str, config=None, checkpoint=None, required: bool = True, **hub_kwargs):
    """Imported where found, writing nothing into the (maybe read-only) modules cache. Not relative: transformers
    would require the file beside this one even for an import in a function."""
    module_name = f"{__package__}.{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    found = find_companion(name, config, checkpoint, **hub_kwargs)
    if found is None:
        if not required:
            _MISSING_COMPANIONS.add(module_name)
            return None
        source = code_source(config, checkpoint)[0]
        raise ImportError(
            f"This needs {name}.py beside modeling_chatglm.py{f' (looked in {source})' if source else ''}: copy "
            "it from the maintained ChatGLM / GLM-4 repository into the checkpoint folder along with "
            "modeling_chatglm.py, or install all its files with tools/install_into_checkpoint.py.")
    spec = importlib.util.spec_from_file_location(module_name, found)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_checks(config=None, checkpoint=None, **hub_kwargs):
    """checks_chatglm.py, or None where it is missing (said once). Every forward asks: one dictionary lookup."""
    checks = sys.modules.get(CHECKS_MODULE)
    if checks is not None or CHECKS_MODULE in _MISSING_COMPANIONS:
        return checks
    checks = import_companion("checks_chatglm", config, checkpoint, required=False, **hub_kwargs)
    if checks is None:
        logger.warning("checks_chatglm.py is not beside modeling_chatglm.py: the checks of the config's sizes, "
                       "device maps and weight files (docs/load-checks.md) are skipped. Copy it into the "
                       "checkpoint folder, or install all the files with tools/install_into_checkpoint.py.")
    return checks


# ======================================================================================================================
# P-tuning v2 prefix: the seam (the prefix itself is ptuning_chatglm.py's)
# ======================================================================================================================


def ptuning(config):
    return import_companion("ptuning_chatglm", config)


def prefix_encoder(config) -> Optional[nn.Module]:
    if getattr(config, "pre_seq_len", None) in (None, 0):
        return None
    module = ptuning(config)
    callbacks = module.LanguageModelCallbacks(
        device_boundary=device_boundary, execution_device=execution_device, cache_is_empty=cache_is_empty,
        max_cache_length=max_cache_length, dynamic_cache_kwargs=dynamic_cache_kwargs, new_static_cache=new_static_cache,
        cache_output=cache_output)
    return module.PrefixEncoder(config, callbacks)


def require_prefix(model: nn.Module) -> nn.Module:
    encoder = getattr(model.base_model, "prefix_encoder", None)
    if encoder is None:
        raise ValueError(
            "This model has no P-tuning v2 prefix (config.pre_seq_len is not set). Load it with the prefix length it "
            "was trained with, e.g. AutoConfig.from_pretrained(base, trust_remote_code=True, pre_seq_len=128) and "
            "from_pretrained(base, config=config, trust_remote_code=True).")
    return encoder


def prefix_length(model: nn.Module) -> int:
    encoder = getattr(model.base_model, "prefix_encoder", None)
    return encoder.pre_seq_len if encoder is not None else 0


@dataclass(frozen=True)
class PrefixEntry:
    """The layers' cache, the prefix's `slots` (0: the identity), the slots cached before this step."""

    cache: Optional[Cache]
    slots: int
    past_slots: Union[int, torch.Tensor]

    def extend_mask(self, attention_mask):
        """A 2-D mask covers the tokens; every query also sees the prefix."""
        if not self.slots or attention_mask is None or attention_mask.dim() != 2:
            return attention_mask
        return torch.cat([attention_mask.new_ones(attention_mask.shape[0], self.slots), attention_mask], -1)


def enter_prefix(model: "ChatGLMModel", cache: Optional[Cache], past_length, batch_size: int, query_length: int
                 ) -> PrefixEntry:
    """The seam: the prefix's slots written first into the cache; the identity without a prefix."""
    if model.prefix_encoder is None:
        return PrefixEntry(cache, 0, past_length)
    return PrefixEntry(*ptuning(model.config).enter_prefix(model, cache, past_length, batch_size, query_length))


def prefix_checkpointing_kwargs(model: nn.Module, kwargs: Optional[dict]) -> Optional[dict]:
    """torch.utils.checkpoint's arguments: non-reentrant with a prefix."""
    return ptuning(model.config).checkpointing_kwargs(kwargs) if prefix_length(model) else kwargs


# ======================================================================================================================
# GLM-4V vision
# ======================================================================================================================


def vision_tower(config) -> nn.Module:
    """This repository's visual.py (not glm-4v-9b's own), handed what it needs of this file."""
    visual = import_companion("visual", config)
    if not hasattr(visual, "LanguageModelCallbacks"):
        raise ImportError(
            f"{visual.__file__} is not this repository's visual.py, or is an older one (glm-4v-9b's original has the "
            "same name): copy visual.py from the maintained ChatGLM / GLM-4 repository into the checkpoint folder "
            "along with modeling_chatglm.py (tools/install_into_checkpoint.py installs every file), and delete the "
            "stale copy if it sits in the transformers modules cache.")
    callbacks = visual.LanguageModelCallbacks(
        device_boundary=device_boundary, execution_device=execution_device,
        default_position_ids=ChatGLMModel.default_position_ids)
    return visual.EVA2CLIPModel(config, callbacks)


def enter_vision(model: "ChatGLMModel", input_ids, inputs_embeds, images, position_ids, attention_mask, cache,
                 past_length):
    """The seam: image rows in, the mask and positions mapped to rows; unchanged for a text model."""
    if model.vision is not None:
        return model.vision.splice(input_ids, inputs_embeds, images, position_ids, attention_mask, cache, past_length)
    if images is not None:
        raise ValueError("images were given, but this model has no vision tower (its config has no vision_config): "
                         "load a GLM-4V checkpoint such as glm-4v-9b.")
    return inputs_embeds, position_ids, attention_mask


# ======================================================================================================================
# Chat helpers: the chat API of ChatGLM3 and GLM-4, and ChatGLM2's; `chat_format` picks the format.
# ======================================================================================================================


CHAT_ROLES = ("system", "user", "assistant", "observation")


class InvalidScoreLogitsProcessor(LogitsProcessor):
    """The originals' guard in chat(): NaN or +inf scores (fp16 overflow) become a valid distribution."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if torch.isnan(scores).any() or torch.isposinf(scores).any():
            scores.zero_()
            scores[..., 5] = 5e4
        return scores


def with_text_content(message: dict, index: int) -> dict:
    """OpenAI-style content parts joined: a GLM template would write a list into the prompt as its repr."""
    parts = message.get("content")
    if not isinstance(parts, (list, tuple)):
        return message
    for number, part in enumerate(parts):
        where = f"history[{index}]['content'][{number}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"{where} is a {kind!r} part; chat() takes text parts only ({{'type': 'text', 'text': ...}}). "
                "GLM-4V (glm-4v-9b) takes an image as the message's 'image' (a PIL image), not as a content part.")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where} is a text part without a str 'text': {part!r:.100}.")
    message["content"] = "".join(part["text"] for part in parts)
    return message


def rendered_chat(tokenizer, messages: list, add_generation_prompt: bool):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                         return_tensors="pt", return_dict=True)


def new_turn_inputs(tokenizer, history: list, inputs: dict) -> dict:
    """`inputs` after the history rendered alone, assuming nothing of the template (the images: in the cache)."""
    inputs.pop("images", None)
    if not history:
        return inputs
    held = rendered_chat(tokenizer, history, False)["input_ids"][0]
    whole = inputs["input_ids"][0]
    same = torch.eq(whole[:len(held)], held[:len(whole)])
    if len(held) >= len(whole) or not bool(same.all()):
        parted = int((~same).nonzero()[0, 0]) if not bool(same.all()) else min(len(held), len(whole))
        raise ValueError("stream_chat(past_key_values=...) continues a cache that holds `history`, but this "
                         "tokenizer's chat template renders `history` followed by the new message differently from "
                         f"`history` alone (from id {parted} on), so the new message's ids cannot be placed after the "
                         "cache. Pass past_key_values=None: the whole conversation is then sent.")
    return {name: value[:, len(held):] for name, value in inputs.items()}


def checked_pairs(history) -> list:
    if history is None:
        return []
    if not isinstance(history, (list, tuple)):
        raise ValueError(f"history must be a list of (query, response) pairs, got {type(history).__name__}.")
    for index, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ValueError(f"history[{index}] must be a (query, response) pair of str (ChatGLM2's format, as its "
                             f"chat() returns it), got {pair!r:.100}. Role messages are ChatGLM3's format, which a "
                             "ChatGLM2 tokenizer cannot encode.")
    return list(history)


def chatglm2_inputs(tokenizer, query: str, history: list):
    """ChatGLM2's build_inputs: `tokenizer.build_prompt`'s rounds after [gMASK] sop."""
    build_prompt = getattr(tokenizer, "build_prompt", None)
    if build_prompt is None:
        raise ValueError(f"ChatGLM2's prompt comes from tokenizer.build_prompt, which {type(tokenizer).__name__} does "
                         "not have: pass the ChatGLM2 checkpoint's tokenizer.")
    return tokenizer([build_prompt(query, history=history)], return_tensors="pt")


def chatglm2_stream_inputs(tokenizer, query: str, history: list):
    """ChatGLM2's build_stream_inputs: the next round without [gMASK] sop and SentencePiece's leading "▁"."""
    if not history:
        return chatglm2_inputs(tokenizer, query, history)
    ids = tokenizer.encode(f"\n\n[Round {len(history) + 1}]\n\n问：{query}\n\n答：", add_special_tokens=False)[1:]
    return tokenizer.pad({"input_ids": [ids]}, return_tensors="pt")


class RoleChat:
    """ChatGLM3's chat, and GLM-4's through its template: role messages; answers and tool calls by process_response."""

    @staticmethod
    def checked_history(history) -> list:
        """A copy of a history of {"role", "content"[, "metadata", "tools"]} dicts (ChatGLM3's format)."""
        if history is None:
            return []
        if not isinstance(history, (list, tuple)):
            raise ValueError(f"history must be a list of messages, got {type(history).__name__}.")
        for index, message in enumerate(history):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(
                    f"history[{index}] must be a dict with 'role' and 'content' (ChatGLM3's format, as chat() returns "
                    f"it), got {message!r}. (query, response) pairs are ChatGLM2's format: for a ChatGLM2 checkpoint "
                    "load its tokenizer as ChatGLM2's, AutoTokenizer.from_pretrained(..., chatglm_family='chatglm2').")
            if message["role"] not in CHAT_ROLES:
                raise ValueError(f"history[{index}] has role {message['role']!r}; the roles are "
                                 f"{', '.join(CHAT_ROLES)}.")
        return [with_text_content(dict(message), index) for message in history]

    @staticmethod
    def inputs(tokenizer, query: str, history: list, role: str, continuing: bool = False):
        """Inputs up to the answer; `continuing` (a cache holds the history): only the ids that follow it."""
        if role not in CHAT_ROLES:
            raise ValueError(f"role={role!r} is not a chat role; the roles are {', '.join(CHAT_ROLES)}.")
        if not isinstance(query, str):
            raise ValueError(f"query must be a str, got {type(query).__name__}.")
        if hasattr(tokenizer, "build_chat_input"):
            if not continuing:
                return dict(tokenizer.build_chat_input(query, history=history, role=role))
            prefix = len(tokenizer.get_prefix_tokens())  # [gMASK] sop, then a block per message: the cache holds them
            return {name: value[:, prefix:] for name, value in tokenizer.build_chat_input(query, role=role).items()}
        inputs = dict(rendered_chat(tokenizer, history + [{"role": role, "content": query}], True))
        return new_turn_inputs(tokenizer, history, inputs) if continuing else inputs

    @staticmethod
    def stop_ids(tokenizer) -> list:
        return [tokenizer.eos_token_id, tokenizer.get_command("<|user|>"), tokenizer.get_command("<|observation|>")]

    @staticmethod
    def reply(model, text: str, history: list, query: str, role: str):
        return model.process_response(text, history + [{"role": role, "content": query}])


class ChatGLM2Chat:
    """ChatGLM2's chat: (query, response) pairs, build_prompt's rounds."""

    checked_history = staticmethod(checked_pairs)

    @staticmethod
    def inputs(tokenizer, query: str, history: list, role: str, continuing: bool = False) -> dict:
        if role != "user":
            raise ValueError(f"role={role!r}: ChatGLM2's chat has no roles (each round is a user query and the "
                             "answer); leave role at 'user'.")
        if not isinstance(query, str):
            raise ValueError(f"query must be a str, got {type(query).__name__}.")
        build = chatglm2_stream_inputs if continuing else chatglm2_inputs
        return dict(build(tokenizer, query, history))

    @staticmethod
    def stop_ids(tokenizer) -> list:
        return [tokenizer.eos_token_id]

    @staticmethod
    def reply(model, text: str, history: list, query: str, role: str):
        response = model.process_response(text)
        return response, history + [(query, response)]


def chat_format(tokenizer):
    """The one choice of chat format: ChatGLM2's for a ChatGLM2 tokenizer (ours or the original), else roles."""
    family = getattr(tokenizer, "chatglm_family", None)
    original = family is None and hasattr(tokenizer, "build_prompt") and not hasattr(tokenizer, "build_chat_input")
    return ChatGLM2Chat if family == "chatglm2" or original else RoleChat


def parse_tool_call(content: str) -> Optional[dict]:
    """A tool call's arguments, read without the original's `eval` of model output: ChatGLM3's
    ```` ```python\\ntool_call(name=value, ...)\\n``` ```` block, or GLM-4's JSON object; else None."""
    text = content.strip()
    if text.startswith("{"):
        try:
            arguments = json.loads(text)
        except ValueError:
            return None
        return arguments if isinstance(arguments, dict) else None
    code = "\n".join(content.split("\n")[1:-1]).strip()  # inside the ``` fence
    try:
        call = ast.parse(code, mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "tool_call"
                and not call.args and all(keyword.arg for keyword in call.keywords)):
            return None
        return {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    except (SyntaxError, ValueError):
        return None


class ChatForm:
    """A chat method with the parameters of the checkpoint's original (ChatGLM2's have no `role`)."""

    def __init__(self, with_roles, in_rounds):
        self.with_roles, self.in_rounds = with_roles, in_rounds

    def __get__(self, model, owner=None):
        if model is None:
            return self.with_roles
        function = self.in_rounds if getattr(model, "chat_form", "roles") == "rounds" else self.with_roles
        return function.__get__(model, owner)


class ChatMixin:
    """`model.chat(tokenizer, "你好", history=[])` and friends, as chatglm3-6b's (or chatglm2-6b's) code has them."""

    def process_response_with_roles(self, output: str, history: Optional[list] = None):
        """ChatGLM3: (content, history) of a decoded answer; content: the text, or a tool call's {"name",
        "parameters"} where tools were declared (else {"name", "content"}). Without a history: ChatGLM2's call."""
        if history is None:
            return self.process_response_in_rounds(output)
        content = ""
        history = copy.deepcopy(history)
        for response in output.split("<|assistant|>"):
            metadata, content = response.split("\n", maxsplit=1) if "\n" in response else ("", response)
            if not metadata.strip():
                content = content.strip()
                history.append({"role": "assistant", "metadata": metadata, "content": content})
                content = content.replace("[[训练时间]]", "2023年")  # ChatGLM3's training-date placeholder
                continue
            history.append({"role": "assistant", "metadata": metadata, "content": content})
            has_tools = bool(history) and history[0].get("role") == "system" and "tools" in history[0]
            parameters = parse_tool_call(content) if has_tools else None
            key, value = ("content", content) if parameters is None else ("parameters", parameters)
            content = {"name": metadata.strip(), key: value}
        return content, history

    def process_response_in_rounds(self, response: str) -> str:
        return response.strip().replace("[[训练时间]]", "2023年")

    @torch.inference_mode()
    def chat_with_roles(self, tokenizer, query: str, history: Optional[list] = None, role: str = "user",
                        max_length: int = 8192, num_beams=1, do_sample=True, top_p=0.8, temperature=0.8,
                        logits_processor=None, **kwargs):
        """One chat turn; returns (response, history). The caller's history list is not modified."""
        chat = chat_format(tokenizer)
        history = chat.checked_history(history)
        inputs = chat.inputs(tokenizer, query, history, role)
        stop_ids = chat.stop_ids(tokenizer)
        outputs = self.generate(
            **inputs, max_length=max_length, num_beams=num_beams, do_sample=do_sample, top_p=top_p,
            temperature=temperature, logits_processor=guarded(logits_processor), eos_token_id=stop_ids, **kwargs)
        response = tokenizer.decode(answer_ids(outputs[0], inputs["input_ids"].shape[1], stop_ids))
        return chat.reply(self, response, history, query, role)

    def chat_in_rounds(self, tokenizer, query: str, history: Optional[list] = None, max_length: int = 8192,
                       num_beams=1, do_sample=True, top_p=0.8, temperature=0.8, logits_processor=None, **kwargs):
        """chat() with ChatGLM2's parameters (no `role`; one passed by name is refused by the chat format)."""
        return self.chat_with_roles(tokenizer, query, history, kwargs.pop("role", "user"), max_length, num_beams,
                                    do_sample, top_p, temperature, logits_processor, **kwargs)

    @torch.inference_mode()
    def stream_chat_with_roles(self, tokenizer, query: str, history: Optional[list] = None, role: str = "user",
                               past_key_values=None, max_length: int = 8192, do_sample=True, top_p=0.8,
                               temperature=0.8, logits_processor=None, return_past_key_values=False, **kwargs):
        """chat() yielding (response, history) as the answer grows, and the cache with `return_past_key_values`:
        passed back with that history, it continues the conversation (ChatGLM2's original dropped the history)."""
        chat = chat_format(tokenizer)
        history = chat.checked_history(history)
        inputs = chat.inputs(tokenizer, query, history, role, continuing=past_key_values is not None)
        if past_key_values is not None:
            past_key_values = as_cache(past_key_values)
            past_length = self.cached_tokens(past_key_values)
            inputs.pop("position_ids", None)  # the new turn continues after the cache: positions follow the mask
            mask = inputs["attention_mask"]
            inputs["attention_mask"] = torch.cat([mask.new_ones(mask.shape[0], past_length), mask], dim=1)
        stop_ids = chat.stop_ids(tokenizer)
        prompt_length = inputs["input_ids"].shape[1]
        response, shown = "", None
        for ids, past_key_values in self.stream_generate(
            **inputs, past_key_values=past_key_values, eos_token_id=stop_ids, return_past_key_values=True,
            max_length=max_length, do_sample=do_sample, top_p=top_p, temperature=temperature,
            logits_processor=guarded(logits_processor), **kwargs):
            text = tokenizer.decode(answer_ids(ids[0], prompt_length, stop_ids))
            if text and not text.endswith("\ufffd"):  # a character still incomplete waits for its next bytes
                response, new_history = chat.reply(self, text, history, query, role)
                shown = text
                yield (response, new_history, past_key_values) if return_past_key_values else (response, new_history)
        if shown != text:  # the last text, even if it ends in U+FFFD
            response, new_history = chat.reply(self, text, history, query, role)
            yield (response, new_history, past_key_values) if return_past_key_values else (response, new_history)

    def stream_chat_in_rounds(self, tokenizer, query: str, history: Optional[list] = None, past_key_values=None,
                              max_length: int = 8192, do_sample=True, top_p=0.8, temperature=0.8,
                              logits_processor=None, return_past_key_values=False, **kwargs):
        """stream_chat() with ChatGLM2's parameters (no `role`; one passed by name is refused by the chat format)."""
        return self.stream_chat_with_roles(tokenizer, query, history, kwargs.pop("role", "user"), past_key_values,
                                           max_length, do_sample, top_p, temperature, logits_processor,
                                           return_past_key_values, **kwargs)

    chat = ChatForm(chat_with_roles, chat_in_rounds)
    stream_chat = ChatForm(stream_chat_with_roles, stream_chat_in_rounds)
    process_response = ChatForm(process_response_with_roles, process_response_in_rounds)

    def build_inputs(self, tokenizer, query: str, history: Optional[list] = None):
        """chatglm2-6b's: the model inputs for `history` ((query, response) pairs) and `query`."""
        return self.on_input_device(chatglm2_inputs(tokenizer, query, checked_pairs(history)))

    def build_stream_inputs(self, tokenizer, query: str, history: Optional[list] = None):
        """chatglm2-6b's: the next round's inputs for a cache holding `history`."""
        return self.on_input_device(chatglm2_stream_inputs(tokenizer, query, checked_pairs(history)))

    def on_input_device(self, inputs):
        device = execution_device(self.transformer.embedding)
        for name, value in inputs.items():
            inputs[name] = device_boundary(value, device)
        return inputs

    @torch.inference_mode()
    def stream_generate(self, input_ids, generation_config=None, logits_processor=None, stopping_criteria=None,
                        prefix_allowed_tokens_fn=None, return_past_key_values=False, **kwargs):
        """Yields the ids so far (and the cache with `return_past_key_values`) after each token, with generate()'s
        processors and stopping criteria; a setting that needs another search (`num_beams > 1`) is refused."""
        config, model_inputs = self._prepare_generation_config(generation_config, **kwargs)
        check_streamable(config)
        attention_mask, position_ids, past_key_values, tokenizer = (
            model_inputs.pop(name, None) for name in ("attention_mask", "position_ids", "past_key_values", "tokenizer"))
        if model_inputs:
            raise ValueError(f"stream_generate() got unexpected arguments: {', '.join(sorted(model_inputs))}.")
        device = execution_device(self.transformer.output_layer) or input_ids.device
        input_ids = device_boundary(input_ids, device)
        attention_mask = device_boundary(attention_mask, device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if past_key_values is not None and attention_mask.shape[1] == input_ids.shape[1]:  # the mask covers the cache
            attention_mask = F.pad(attention_mask, (self.cached_tokens(past_key_values), 0), value=1)
        if config.max_new_tokens is not None:
            config.max_length = input_ids.shape[1] + config.max_new_tokens
        if input_ids.shape[1] >= config.max_length:  # the original's warning; it generated one token all the same
            logger.warning(f"Input length of input_ids is {input_ids.shape[1]}, but `max_length` is set to "
                           f"{config.max_length}: one token is generated. Raise max_length, or set max_new_tokens.")
        self._prepare_special_tokens(config, True, device=device)
        processors = release_logits_processors(
            self, config, device, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, logits_processor=logits_processor or [],
            model_kwargs={"attention_mask": attention_mask[:, -input_ids.shape[1]:], "use_cache": True})
        stopping_criteria = self._get_stopping_criteria(config, stopping_criteria or [], tokenizer=tokenizer)
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=device)
        step_ids = input_ids
        while unfinished.any():
            outputs = self(input_ids=step_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=past_key_values, use_cache=True, logits_to_keep=1)
            past_key_values = returned_cache(outputs)
            logits = outputs.logits[:, -1, :]
            scores = processors(input_ids, logits if _WARPERS_APART else logits.float())
            next_tokens = torch.multinomial(F.softmax(scores, dim=-1), num_samples=1).squeeze(1) if config.do_sample \
                else scores.argmax(dim=-1)  # generate()'s choice: the same random numbers give the same tokens
            if config._pad_token_tensor is not None:  # finished rows keep padding
                next_tokens = torch.where(unfinished, next_tokens, config._pad_token_tensor)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
            step_ids, position_ids = next_tokens[:, None], None  # positions now follow the attention mask
            unfinished &= ~stopping_criteria(input_ids, scores)
            yield (input_ids, past_key_values) if return_past_key_values else input_ids

    def cached_tokens(self, cache) -> int:
        """Tokens a cache holds, without a P-tuning v2 prefix's slots (which a non-empty cache leads with)."""
        length = cache.get_seq_length()
        return length if isinstance(length, int) and length == 0 else length - prefix_length(self)

    def quantize(self, bits: int, empty_init=False, device=None, storage: str = "library", **kwargs):
        """The original's `model.quantize(bits)`: the blocks' linear layers through torchao (else optimum-quanto), or
        with storage="original" as the original stored them. `empty_init`, `device`: unused. Returns the model."""
        self.transformer.quantize(bits, storage)
        self.quantized = self.quantized or bits != 0
        return self

    def quantize_output_layer(self, bits: int = 8):
        """Opt-in: the output layer as 8- or 4-bit codes for decode (quantization_chatglm.py says when it pays)."""
        import_companion("quantization_chatglm", self.config).quantize_output_layer(self.transformer, bits)
        return self


def guarded(logits_processor) -> LogitsProcessorList:
    processors = LogitsProcessorList(logits_processor or [])
    processors.append(InvalidScoreLogitsProcessor())
    return processors


def answer_ids(ids: torch.Tensor, prompt_length: int, stop_ids: list) -> list:
    answer = ids[prompt_length:].tolist()
    return answer[:-1] if answer and answer[-1] in stop_ids else answer


# Settings that make generate() search otherwise than a token at a time, or return more than one sequence a row.
UNSTREAMABLE = ("num_beams", "num_beam_groups", "penalty_alpha", "constraints", "force_words_ids", "dola_layers",
                "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "num_return_sequences",
                "return_dict_in_generate")


def check_streamable(config):
    named = [f"{name}={getattr(config, name)!r}" for name in UNSTREAMABLE
             if getattr(config, name, None) not in (None, False, 0, 1)]
    if config.get_generation_mode() not in ("greedy_search", "sample") or (config.num_return_sequences or 1) > 1 \
            or config.return_dict_in_generate:
        raise ValueError(f"stream_chat() / stream_generate() cannot apply {', '.join(named)}: they yield one "
                         "sequence as it grows, a token at a time (greedy, or sampled with do_sample=True). Use "
                         "chat() / generate() for it.")


# ======================================================================================================================
# Heads
# ======================================================================================================================


def head_outputs(output_class, loss, logits, outputs, return_dict: bool):
    """A head's ModelOutput, or with return_dict=False its values without the None ones."""
    if return_dict:
        return output_class(loss=loss, logits=logits, **cache_output(returned_cache(outputs)),
                            hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    values = (loss, logits, returned_cache(outputs), outputs.hidden_states, outputs.attentions)
    return tuple(v for v in values if v is not None)


def warn_beyond_seq_length(config, max_new_tokens, generation_config):
    if max_new_tokens is None:
        max_new_tokens = getattr(generation_config, "max_new_tokens", None)
    seq_length = getattr(config, "seq_length", None)
    if isinstance(max_new_tokens, int) and isinstance(seq_length, int) and max_new_tokens > seq_length:
        logger.warning_once(
            f"max_new_tokens={max_new_tokens} is beyond this model's seq_length={seq_length} (config.json), the "
            "longest context it was trained for: text generated past it degrades. Lower max_new_tokens.")


def settings_aliased_by_a_tool(config) -> bool:
    """Whether the generation settings on the model config are all aliases of its fields (GPTQModel maps
    `max_length` to `seq_length`): transformers 5 raises on any, when no generation_config is passed."""
    settings = getattr(config, "_get_generation_parameters", lambda: {})()
    aliases = getattr(config, "attribute_map", None) or {}
    return bool(settings) and all(name in aliases for name in settings)


# 5.x's GenerationConfig() leaves every setting unset, and generate() fills them as when none is passed.
_GENERATION_CONFIG_FILLED_LIKE_NONE = GenerationConfig().max_length is None


class ChatGLMForConditionalGeneration(ChatMixin, ChatGLMPreTrainedModel, GenerationMixin):
    loss_type = "ForCausalLM"
    _tied_weights_keys = tied_weights_keys("transformer.output_layer.weight",
                                           "transformer.embedding.word_embeddings.weight")
    _auto_class = "AutoModelForCausalLM"  # see the compatibility layer

    def __init__(self, config: ChatGLMConfig, empty_init=True, device=None):
        super().__init__(config)
        self.transformer = ChatGLMModel(config, empty_init=empty_init, device=device)
        self.max_sequence_length = getattr(config, "max_length", 20)  # the original's (5.x configs lack max_length)
        self.quantized = weight_storage(config) != "float"
        variant = checkpoint_variant(config)  # ChatGLM2's chat methods have no `role`
        self.chat_form = "rounds" if variant and CHECKPOINT_VARIANTS[variant]["chat"] == "rounds" else "roles"
        self.post_init()

    def get_output_embeddings(self):
        return self.transformer.output_layer

    def set_output_embeddings(self, new_embeddings):
        self.transformer.output_layer = new_embeddings

    def forward(self, input_ids: Optional[torch.LongTensor] = None, position_ids: Optional[torch.LongTensor] = None,
                attention_mask: Optional[torch.Tensor] = None, past_key_values=None,
                inputs_embeds: Optional[torch.Tensor] = None, labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None, return_dict: Optional[bool] = None,
                return_last_logit: Optional[bool] = False, logits_to_keep: Union[int, torch.Tensor] = 0,
                images: Optional[torch.Tensor] = None, cache: Optional[Cache] = None, **loss_kwargs):
        """`labels` or `shift_labels`: transformers' fp32 causal-LM loss (the 4.46-4.48 Trainer passes its
        num_items_in_batch only to `**loss_kwargs`). `images` (GLM-4V): a logits row per image row."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        loss_args = {name: loss_kwargs.pop(name) for name in ("num_items_in_batch", "shift_labels", "ignore_index")
                     if name in loss_kwargs}
        outputs = self.transformer(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
            past_key_values=caller_cache(past_key_values, cache), inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            images=images, **loss_kwargs)
        hidden_states = outputs.last_hidden_state
        logits_to_keep = 1 if return_last_logit else logits_to_keep
        if not isinstance(logits_to_keep, int):
            hidden_states = hidden_states[:, logits_to_keep]
        elif logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        output_layer = self.transformer.output_layer
        logits = output_layer(device_boundary(hidden_states, execution_device(output_layer)))

        loss = None
        if images is not None:  # GLM-4V: token-layout targets to the logits' rows (-100 on the image)
            labels = self.transformer.vision.labels_in_rows(input_ids, labels)
            if loss_args.get("shift_labels") is not None:
                loss_args["shift_labels"] = self.transformer.vision.labels_in_rows(
                    input_ids, loss_args["shift_labels"], shifted=True)
        if labels is not None or loss_args.get("shift_labels") is not None:
            loss = self.lm_loss(logits, labels, **loss_args)
        return head_outputs(CausalLMOutputWithPast, loss, logits, outputs, return_dict)

    def lm_loss(self, logits, labels, shift_labels=None, ignore_index=-100, num_items_in_batch=None):
        """transformers' causal-LM loss, with the targets and the item count on the logits' device."""
        vocab_size, checks = self.config.padded_vocab_size, load_checks(self.config)
        for name, targets in (("labels", labels), ("shift_labels", shift_labels)):
            if checks is not None:
                checks.check_targets(name, targets, logits)
        labels, shift_labels = device_boundary(labels, logits.device), device_boundary(shift_labels, logits.device)
        nothing_scored = checks is not None and not is_tracing() and checks.check_target_values(
            labels, shift_labels, vocab_size, ignore_index)  # (values: read with a host sync)
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = device_boundary(num_items_in_batch, logits.device)
        loss = causal_lm_loss(logits, labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                              ignore_index=ignore_index, shift_labels=shift_labels)
        if nothing_scored and bool(loss.isnan()):  # a host sync only when no position has a target
            checks.warn_nothing_scored(ignore_index)
        return loss

    def generate(self, inputs=None, *args, **kwargs):
        """transformers' generate() with its ids on `generation_device`, wherever the caller left them."""
        if args:  # generate(ids, generation_config, logits_processor, ...): named as transformers' generate names them
            names = [parameter.name for parameter in inspect.signature(GenerationMixin.generate).parameters.values()
                     if parameter.kind is parameter.POSITIONAL_OR_KEYWORD][2:]  # after self, inputs
            if len(args) > len(names):
                raise TypeError(f"generate() takes at most {len(names)} positional arguments after inputs")
            kwargs.update(zip(names, args))
        device = generation_device(self)
        if isinstance(inputs, torch.Tensor):
            inputs = device_boundary(inputs, device)
        for name in ("input_ids", "attention_mask", "position_ids", "inputs_embeds"):
            if isinstance(kwargs.get(name), torch.Tensor):
                kwargs[name] = device_boundary(kwargs[name], device)
        if prefix_length(self):  # P-tuning v2: a static cache with room for the prefix
            kwargs = ptuning(self.config).reserve_static_cache_room(self, inputs, kwargs)
        warn_beyond_seq_length(self.config, kwargs.get("max_new_tokens"),
                               kwargs.get("generation_config") or self.generation_config)
        if kwargs.get("generation_config") is None and _GENERATION_CONFIG_FILLED_LIKE_NONE \
                and settings_aliased_by_a_tool(self.config):  # (a tool's alias is no setting)
            kwargs["generation_config"] = GenerationConfig()
        with quiet_device_type_check(self, device):
            return super().generate(inputs, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      position_ids=None, inputs_embeds=None, **kwargs):
        """The cache returned as `past_key_values` on every release, where PEFT (0.12 to 0.21) puts its prefix."""
        past_key_values = caller_cache(past_key_values, kwargs.pop("cache", None))
        checks = load_checks(self.config)
        if inputs_embeds is None and checks is not None:  # (from the ids' length: no host sync)
            checks.check_cache_room(max_cache_length(past_key_values) if isinstance(past_key_values, Cache) else None,
                                    input_ids.shape[-1] + prefix_length(self),
                                    f"the {input_ids.shape[-1]} tokens of the sequence so far")
        if position_ids is not None and inputs_embeds is None and position_ids.shape[-1] < input_ids.shape[-1]:
            # The prompt's positions (the GLM tokenizers return them) continued, as 5.x does itself.
            steps = torch.arange(1, input_ids.shape[-1] - position_ids.shape[-1] + 1, device=position_ids.device,
                                 dtype=position_ids.dtype)
            position_ids = torch.cat([position_ids, position_ids[..., -1:] + steps], dim=-1)
        if _HAS_GENERIC_PREPARE_INPUTS:
            model_inputs = super().prepare_inputs_for_generation(
                input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
                **cache_output(past_key_values), **kwargs)
            model_inputs["past_key_values"] = model_inputs.pop(CACHE_NAME, None)
        else:
            model_inputs = prepare_inputs_before_4_46(
                input_ids, past_key_values, attention_mask, position_ids, inputs_embeds, config=self.config, **kwargs)
        if prefix_length(self) and (attention_mask is None or attention_mask.dim() == 2):
            # A static cache's 4-D mask (4.53+, ours before 4.46) is blind to the prefix: the model builds its own.
            model_inputs["attention_mask"] = attention_mask
        return model_inputs


class ChatGLMForSequenceClassification(ChatGLMPreTrainedModel):
    _auto_class = "AutoModelForSequenceClassification"  # see the compatibility layer

    def __init__(self, config: ChatGLMConfig, empty_init=True, device=None):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = ChatGLMModel(config, empty_init=empty_init, device=device)
        self.classifier_head = nn.Linear(config.hidden_size, config.num_labels, bias=True)
        dropout = getattr(config, "classifier_dropout", None)  # not in ChatGLM2's configuration class
        self.dropout = nn.Dropout(dropout) if dropout is not None else None
        self.post_init()

    def forward(self, input_ids: Optional[torch.LongTensor] = None, position_ids: Optional[torch.LongTensor] = None,
                attention_mask: Optional[torch.Tensor] = None, full_attention_mask: Optional[torch.Tensor] = None,
                past_key_values=None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None, use_cache: Optional[bool] = None,
                output_attentions: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None, cache: Optional[Cache] = None, **kwargs):
        """Classifies each sequence from its last real token. `full_attention_mask`: the original's, ignored."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.transformer(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
            past_key_values=caller_cache(past_key_values, cache), inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            **kwargs)
        head_device = execution_device(self.classifier_head) or outputs.last_hidden_state.device  # labels follow
        hidden_states = device_boundary(outputs.last_hidden_state, head_device)
        if attention_mask is not None:
            mask = device_boundary(attention_mask, head_device).long()
            last = (mask * torch.arange(mask.shape[-1], device=head_device)).argmax(-1)
        else:
            last = torch.full((hidden_states.shape[0],), hidden_states.shape[1] - 1, device=head_device)
        pooled = hidden_states[torch.arange(hidden_states.shape[0], device=head_device), last]
        if self.dropout is not None:
            pooled = self.dropout(pooled)
        logits = self.classifier_head(pooled)

        loss = None
        if labels is not None:
            loss = self.classification_loss(logits.float(), device_boundary(labels, logits.device))
        return head_outputs(SequenceClassifierOutputWithPast, loss, logits, outputs, return_dict)

    def classification_loss(self, logits, labels):
        problem_type = self.config.problem_type
        if problem_type is None:
            if self.num_labels == 1:
                problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                problem_type = "single_label_classification"
            else:
                problem_type = "multi_label_classification"
        if problem_type == "regression":
            return F.mse_loss(logits.squeeze(-1), labels.float().reshape(logits.shape[0]))
        if problem_type == "single_label_classification":
            return F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits, labels.float())
