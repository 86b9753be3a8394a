"""ChatGLM2/3 and GLM-4: one decoder-only architecture, drop-in for the original remote code.

Class names, module attribute names and state-dict keys are the original checkpoints' (`transformer.embedding.
word_embeddings`, `transformer.encoder.layers.N.self_attention.query_key_value`, `transformer.output_layer`, ...), so a
checkpoint saved by the original code loads with no missing or unexpected key. This file also works copied alone over
an original checkpoint folder (it reads only the fields the original configuration classes define).

Sections, in order: compatibility shims (each naming the transformers releases that need it); config, sizes and
checks; devices; KV cache; rotary embedding; attention (kernels, their dispatch, the mask builder, SelfAttention); MLP
and norms; block and stack; base model; companion files; P-tuning v2 prefix and GLM-4V vision, each entering the base
model's forward at one seam (`enter_prefix`, `enter_vision`); chat and quantize (a mixin the causal-LM head inherits);
heads. Every place where a tensor moves to another device goes through `device_boundary(...)`: search for that name to
list them all. No boundary relies on accelerate's hooks moving a tensor.

Where to change what (section: names):
  a new attention kernel        Attention: `attention_function` (dispatch), `build_attention_mask` (the mask it
                                takes); its `_supports_*` flag on ChatGLMPreTrainedModel
  the KV cache                  KV cache: `cache_for_forward`, `new_static_cache`, `cached_length` (checks); layers
                                write only through `kv_cache.update` in SelfAttention
  the KV cache across devices   each layer's keys stay on its device (SelfAttention's update); Devices:
                                `device_boundary`, and `LayerInputs` (Attention) copies per-layer inputs per device
  a device map, or its checks   Devices: `balanced_device_map`, `check_device_map`, `check_devices_exist`
  a new transformers release    Compatibility shims: one flag or function per change, naming the release
  a new THUDM checkpoint        Config, sizes and checks: one row of `CHECKPOINT_VARIANTS` (rotary reading,
                                tokenizer family, weight storage, chat format, identifying fields), the same row in
                                tokenization_chatglm.py's copy (each file must work copied alone, so the table is
                                kept twice and tests/test_variants.py checks the copies are equal), and its golden
                                case in tests/conftest.py's GOLDEN_CASES; which row a config is: `checkpoint_variant`
  what this file reads of it    `rotary_reading` (RotaryEmbedding), `weight_storage` (quantization_bit)
  a new config field or check   Config, sizes and checks: `check_supported`, `complete_original_config`, and
                                configuration_chatglm.py (its fields and validation)
  checks of a loaded checkpoint Config, sizes and checks: `check_loaded_weights` (keys), `check_stored_dtypes`
                                (integer storage, file damage), `check_finite_weights` (NaN, inf); what calls
                                them: ChatGLMPreTrainedModel.from_pretrained
  P-tuning v2 prefixes          P-tuning v2 prefix: `enter_prefix` (the seam), `PrefixEncoder`
  GLM-4V images                 visual.py: `EVA2CLIPModel.splice` (the seam); here `vision_tower`, `enter_vision`
  a chat-template fix           tokenization_chatglm.py (this file only calls the tokenizer); chat() itself:
                                Chat, `ChatMixin`, `chat_inputs`, `parse_tool_call`
  a chat format (ChatGLM2's)    Chat: `chat_format` (the one choice, from the tokenizer), `RoleChat`,
                                `ChatGLM2Chat`
  loss, logits, generate()      Heads: `ChatGLMForConditionalGeneration`
  tensor parallelism            parallel_chatglm.py
  pre-quantized weights (int4)  Config, sizes and checks: `linear_layer` (the one choice); quantization_chatglm.py
                                (its two kernels, exact and packed: `QuantizedLinear.use_kernel`, chosen after loading
                                by `use_quantized_kernel`)
  a name the original objects   the class that has it (`CoreAttention` holds the attention's); ChatGLM2-only
  had                           signatures: `ChatForm` (Chat); tests/test_surface.py reads testdata/surface
  a call between modules        the original's contracts (testdata/surface/*-calls.json, tests/test_contracts.py):
                                GLMTransformer (encoder), GLMBlock, SelfAttention, CoreAttention, RotaryEmbedding
                                say what travels in each argument; Module contracts: `LayerInputs` carries this
                                file's own values, `forward_replaced` decides where a module a tool replaced gets the
                                original's instead
"""

import ast
import copy
import importlib
import inspect
import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
import transformers
from torch import nn
try:  # (is_tracing) torch releases with is_fx_symbolic_tracing (2.13, 2.15) log a warning at is_fx_tracing's first
    # call in a process: the first forward of every program
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing as is_fx_tracing
except ImportError:  # torch 2.4: no such warning
    from torch.fx._symbolic_trace import is_fx_tracing
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.generation import (
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.utils import logging

from .configuration_chatglm import ChatGLMConfig

logger = logging.get_logger(__name__)


# ======================================================================================================================
# Compatibility shims: transformers 4.44.2 ... 5.x, torch 2.4 ... Each names the releases that need it; nothing else
# lives here.
# ======================================================================================================================


def version_at_least(version: str, release: str) -> bool:
    """Whether `version` is the "major.minor" `release` or later, its development builds included. (Read without
    `packaging`: transformers' remote-code check asks for every package a file imports.)"""
    installed = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", version).groups())
    return installed >= tuple(int(part) for part in release.split("."))


def transformers_at_least(release: str) -> bool:
    """Whether the installed transformers is `release` or later. Releases are told apart by version, not by the name
    of a parameter: 5.24 renamed the one that told 4.46 from 4.45 here."""
    return version_at_least(transformers.__version__, release)


def torch_at_least(release: str) -> bool:
    """Whether the installed torch is `release` or later."""
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
        """transformers < 4.50: the computation of its later ForCausalLMLoss. fp32; `labels` shifted left (the last
        position gets `ignore_index`) unless `shift_labels` come already shifted (sequence / context parallelism);
        summed and divided by `num_items_in_batch` when the Trainer gives it, else the mean."""
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
        """transformers < 4.52: the same contract. `gradient_checkpointing_enable()` sets `gradient_checkpointing`
        and `_gradient_checkpointing_func` on every module that has the attribute; tensors that need gradients are
        passed positionally (reentrant checkpointing sees only those)."""

        gradient_checkpointing = False

        def __call__(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training:
                return self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)
            return super().__call__(*args, **kwargs)


# 5.0 reads `_tied_weights_keys` as {tied key: source key} (and ties only through it); earlier versions read a list of
# the tied keys and tie the output embeddings to the input ones through get_output_embeddings().
_TIED_KEYS_ARE_A_MAPPING = hasattr(PreTrainedModel, "get_expanded_tied_weights_keys")


def tied_weights_keys(output_key: str, input_key: str):
    """`_tied_weights_keys` in the form the installed transformers reads; used when config.tie_word_embeddings."""
    return {output_key: input_key} if _TIED_KEYS_ARE_A_MAPPING else [output_key]


try:  # 5.0: init functions that skip tensors already loaded from a checkpoint
    from transformers import initialization as weight_init
except ImportError:
    weight_init = nn.init


# 4.46 to 4.52 do not register a remote-code model class for its auto class when they load it, so save_pretrained
# wrote no code files beside the weights: the heads name theirs (`_auto_class`), as other versions set it.

# 4.56 added DynamicCache(config=...), and 5.0 builds its layers from the config.
_DYNAMIC_CACHE_TAKES_CONFIG = "config" in inspect.signature(DynamicCache.__init__).parameters


# 5.x's Trainer calls activation_checkpointing_enable(activation_checkpointing_kwargs, every_n_layers, offload), with
# gradient_checkpointing_enable() a deprecated alias of it; earlier releases have gradient_checkpointing_enable only.
# The model overrides whichever is the entry point, so the Trainer never reaches the alias (and its warning).
_HAS_ACTIVATION_CHECKPOINTING = hasattr(PreTrainedModel, "activation_checkpointing_enable")


# 4.44 and 4.45 have no generic GenerationMixin.prepare_inputs_for_generation (the 4.44 one only raises).
_HAS_GENERIC_PREPARE_INPUTS = transformers_at_least("4.46")


# 4.51 moved each step's logits to the device of generate()'s ids itself; 4.44 to 4.50 use
# them where the output layer leaves them, so their ids must sit there too. Every release warns when the prompt's
# device type differs from model.device's (the embedding's), 5.23+ not for a prompt on the CPU.
_GENERATE_MOVES_LOGITS = transformers_at_least("4.51")
_DEVICE_TYPE_WARNING = r"You are calling \.generate\(\) with the `input_ids` being on a device type different"


def generation_device(model: nn.Module) -> torch.device:
    """Where generate() keeps its ids, mask and new tokens: model.device, the device its check compares the prompt
    with (4.51+; where the embedding's weights are offloaded, on `meta`, the device it computes on), or the logits'
    device (4.44 to 4.50)."""
    if not _GENERATE_MOVES_LOGITS:
        return execution_device(model.transformer.output_layer) or model.device
    if model.device.type == "meta":
        return execution_device(model.transformer.embedding) or model.device
    return model.device


@contextmanager
def quiet_device_type_check(model: nn.Module, device: torch.device):
    """4.44 to 4.50, ids on the logits' device (generation_device) of another type than model.device: generate()'s
    warning about the prompt's device type is wrong for this model, and is not shown. Nothing is silenced elsewhere."""
    if _GENERATE_MOVES_LOGITS or device.type == model.device.type:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DEVICE_TYPE_WARNING, category=UserWarning)
        yield


# 5.24 renamed the KV-cache argument and output field: generate() passes `cache=` to the forward and reads
# `outputs.cache`; `past_key_values` is deprecated there (removal planned for 5.40 / 6.0), and reading or writing it
# logs a deprecation. Earlier releases know `past_key_values` only. The forwards take either name where the release
# has both (never the two at once), and every output and call of this file uses the release's name.
CACHE_NAME = "cache" if transformers_at_least("5.24") else "past_key_values"


def caller_cache(past_key_values, cache):
    """The cache a caller passed to a forward, as `past_key_values` (every release) or `cache` (5.24+)."""
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
    """The output field that holds the returned cache, under the release's name (for ModelOutput classes)."""
    return {CACHE_NAME: cache}


def returned_cache(outputs):
    """The cache a forward returned (a ModelOutput), read under the release's name."""
    return getattr(outputs, CACHE_NAME)


# The static cache's length is `get_max_length` on 4.44, `get_max_cache_shape` on 4.46 to 5.x (4.46 to 4.57 log a
# deprecation for `get_max_length`), and `get_max_length` again once 5.x restored it (5.16+ deprecate
# `get_max_cache_shape`). A deprecated call logs, and logging inside a compiled graph breaks it.
_MAX_LENGTH_QUERY = (
    "get_max_length"
    if hasattr(Cache, "get_max_length") and (transformers_at_least("5.0") or not hasattr(Cache, "get_max_cache_shape"))
    else "get_max_cache_shape"
)


# torch 2.5 added scaled_dot_product_attention(enable_gqa=True): key/value groups attend without being expanded.
# torch 2.4 (GLM-4's own requirements name torch>=2.4.0) has no such argument: an unmasked prompt expands them once.
_SDPA_HAS_GQA = torch_at_least("2.5")


def is_compiling() -> bool:
    """torch.compiler.is_compiling (torch >= 2.3; False where torch lacks it)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def is_tracing() -> bool:
    """Whether torch.compile, torch.jit.trace (OpenVINO's export) or torch.fx (llm-compressor) is tracing: checks and
    shortcuts that read values step aside, as a trace would freeze them or cannot read them."""
    return is_compiling() or torch.jit.is_tracing() or is_fx_tracing()


# torch 2.4's rms_norm is composite: in a half type it rounds the normalised value to the input's dtype and then
# multiplies by the weight, two roundings where the original rounds once. Later releases' fused kernel multiplies in
# fp32 and rounds once (torch 2.13 on CPU, measured), which lets a bf16/fp16 RMSNorm be one call instead of four.
# Told by behaviour, once per device type and dtype, as the device's kernel decides it.
_RMS_NORM_ROUNDS_ONCE = {}


def rms_norm_rounds_once(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether F.rms_norm(x, shape, weight) with x and weight in the half type `dtype` gives the original's numbers
    bit for bit on `device`'s type (compared on a small sample; never tried while compiling: False there)."""
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
    """transformers 4.46 to 4.52 ask the base model for a static cache's mask, of a fixed shape so that a compiled
    decode step is the same graph at every position (4.53+ build it themselves; 4.44/4.45 see
    prepare_inputs_before_4_46)."""
    return build_attention_mask(attention_implementation(config, False), attention_mask, cache_position[None],
                                target_length, batch_size=attention_mask.shape[0], preallocated=True)


def prepare_inputs_before_4_46(input_ids, past_key_values, attention_mask, position_ids, inputs_embeds,
                               cache_position=None, use_cache=True, config=None, **kwargs):
    """transformers 4.44 / 4.45, whose GenerationMixin has no generic input preparation: keep the tokens the cache
    has not seen, given by `cache_position`, and the prompt embeddings on the first step only. A static cache gets its
    mask at full length, so that a compiled decode step sees the same shapes at every position (as later versions
    do)."""
    past_key_values = as_cache(past_key_values)  # the forward returns the legacy format it was given (PEFT's)
    past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
    first_step = past_length == 0
    if cache_position is None:
        cache_position = torch.arange(past_length, input_ids.shape[1], device=input_ids.device)
    if not first_step:
        # With inputs_embeds, input_ids hold only the generated tokens: take the newest ones.
        input_ids = input_ids[:, -cache_position.shape[0]:]
    new_tokens = cache_position.shape[0]
    # Fresh copies of the slices: a slice keeps its parent's strides, which a compiled step guards on.
    if inputs_embeds is not None and first_step:
        model_inputs = {"inputs_embeds": inputs_embeds}
    else:
        model_inputs = {"input_ids": input_ids.clone(memory_format=torch.contiguous_format)}
    static_length = max_cache_length(past_key_values) if past_key_values is not None else None
    if first_step and type(past_key_values) is DynamicCache:
        # The empty cache generate() made: passed as None, the forward makes its own. PEFT before 0.13 (the PEFT of
        # these releases) injects its prefix-tuning key/values only where the cache it is handed is None.
        past_key_values = None
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
# Config, sizes and checks
# ======================================================================================================================


# Files a user copies one at a time. modeling_chatglm.py may be copied alone over an original checkpoint folder that
# keeps the original configuration_chatglm.py (every transformers release reads it), so this file reads only the fields
# the original configuration classes define, and completes what transformers' Cache classes read.


def complete_original_config(config):
    """Fill in what the original configuration classes lack and transformers reads: `num_key_value_heads` and
    `head_dim` (StaticCache), ChatGLM3's `num_hidden_layers` (the Cache classes from 4.56 on), and GLM-4's
    `use_cache` (PretrainedConfig stopped defining it in 5.0). Ours defines them all. ChatGLM2/3's classes have no
    `rope_ratio`: 1, the reading RotaryEmbedding makes of its absence; tools tell the batch-first GLM-4 layout,
    which every family has here, by that field (optimum-intel's OpenVINO export)."""
    derived = {"num_hidden_layers": config.num_layers, "num_key_value_heads": num_key_value_heads(config),
               "head_dim": config.kv_channels, "use_cache": True, "rope_ratio": 1}
    for name, value in derived.items():
        if not hasattr(config, name):
            setattr(config, name, value)


def num_key_value_heads(config) -> int:
    """Heads of keys and values: the multi-query groups, or every head without multi-query attention."""
    return config.multi_query_group_num if config.multi_query_attention else config.num_attention_heads


@dataclass(frozen=True)
class AttentionSizes:
    """Head counts of one attention layer. Tensor parallelism gives each rank its own (smaller) sizes."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    multi_query: bool  # fused qkv layout: [all q | all k | all v] if True, else [q_h | k_h | v_h] per head

    @classmethod
    def from_config(cls, config: ChatGLMConfig) -> "AttentionSizes":
        return cls(config.num_attention_heads, num_key_value_heads(config), config.kv_channels,
                   bool(config.multi_query_attention))

    @property
    def groups(self) -> int:
        """Query heads served by each key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def qkv_features(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def shard(self, num_heads: int, num_kv_heads: int) -> "AttentionSizes":
        return replace(self, num_heads=num_heads, num_kv_heads=num_kv_heads)


def block_parameter_count(config: ChatGLMConfig) -> int:
    """Weights of one GLMBlock's linear layers (norms and biases are negligible)."""
    sizes = AttentionSizes.from_config(config)
    return (sizes.qkv_features * config.hidden_size + sizes.num_heads * sizes.head_dim * config.hidden_size
            + 3 * config.ffn_hidden_size * config.hidden_size)


def parameter_count(config: ChatGLMConfig) -> int:
    """Weights of the whole model from its sizes alone: embedding, blocks, output layer."""
    return 2 * config.padded_vocab_size * config.hidden_size + config.num_layers * block_parameter_count(config)


def validate_config(config: ChatGLMConfig):
    """Our configuration class checks every field (type and value); the original one, which a user may keep beside
    this file, checks nothing: then the fields the model is built from are checked here."""
    validate = getattr(config, "validate_chatglm", None)
    if callable(validate):
        validate()
        return
    for name in ("num_layers", "padded_vocab_size", "hidden_size", "ffn_hidden_size", "kv_channels",
                 "num_attention_heads", "multi_query_group_num"):
        value = getattr(config, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"config.{name} must be a positive integer, got {value!r} (check config.json).")
    model_type = getattr(config, "model_type", "chatglm")
    if model_type != "chatglm" or hasattr(config, "intermediate_size"):
        raise ValueError(
            f"This config describes another model family (model_type {model_type!r}), not ChatGLM2/3 or GLM-4: its "
            "auto_map points at ChatGLM's code by mistake. Load it with its own class."
        )
    rope_fields = {name: getattr(config, name, None) for name in ("rope_scaling", "rope_parameters", "rope_theta")}
    # transformers 5's rope_parameters of the default type (GPTQModel writes it on every config; 5.x reads
    # rope_scaling as the same field) says nothing rope_ratio does not: its theta is not read.
    parameters = rope_fields["rope_parameters"]
    if isinstance(parameters, dict) and parameters.get("rope_type", parameters.get("type")) == "default" and \
            set(parameters) <= {"rope_type", "type", "rope_theta"}:
        rope_fields = {name: value for name, value in rope_fields.items() if value is not parameters}
        theta, base = parameters.get("rope_theta"), 10000 * getattr(config, "rope_ratio", 1)
        if theta is not None and theta != base:
            logger.warning_once(f"rope_parameters gives rope_theta={theta!r}, but this model rotates with the base "
                                f"10000 * rope_ratio = {base!r}, as the original does: rope_theta is not read.")
    if any(value is not None for value in rope_fields.values()):
        raise ValueError(
            f"config has {', '.join(n for n, v in rope_fields.items() if v is not None)}, which ChatGLM/GLM-4 do not "
            "read: their rotary base is 10000 * rope_ratio. Set rope_ratio instead and remove those fields."
        )


def host_memory_bytes() -> Optional[int]:
    """Physical memory plus swap of this machine (Linux / macOS), or None where it cannot be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            total += sum(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("SwapTotal:"))
    except OSError:
        pass
    return total


def memory_for_weights(device: torch.device) -> Optional[int]:
    """Bytes that weights created on `device` can occupy at most. Weights built on `meta` (from_pretrained) are
    placed later on any accelerator, the CPU or disk, so all of those count. None: unknown, no check."""
    host = host_memory_bytes()
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    if device.type == "meta" and host is not None:
        accelerators = sum(torch.cuda.get_device_properties(i).total_memory
                           for i in range(torch.cuda.device_count())) if torch.cuda.is_available() else 0
        return host + accelerators + shutil.disk_usage(os.getcwd()).free
    return None


def parameter_creation_device() -> torch.device:
    """Where new parameters go now: the default device, a `with torch.device(...)` block, or `meta` under
    accelerate's init_empty_weights (which moves each registered parameter)."""
    probe = nn.Module()
    probe.register_parameter("probe", nn.Parameter(torch.empty(0)))
    return probe.probe.device


def check_fits_in_memory(config: ChatGLMConfig):
    """Refuse sizes whose weights cannot fit where they would be created, before any is allocated: otherwise a
    config with num_layers 1e9 hangs building modules, and one with absurd sizes dies in an out-of-memory error."""
    device = parameter_creation_device()
    capacity = memory_for_weights(device)
    dtype = torch.get_default_dtype()
    needed = parameter_count(config) * torch.empty(0, dtype=dtype, device="meta").element_size()
    if capacity is not None and needed > capacity:
        raise ValueError(
            f"This config describes a model of {parameter_count(config) / 1e9:,.1f}B parameters "
            f"({needed / 2 ** 30:,.0f} GiB in {dtype}), more than the {capacity / 2 ** 30:,.0f} GiB available for "
            f"weights on {device}: check num_layers ({config.num_layers}), hidden_size, ffn_hidden_size and "
            "padded_vocab_size in config.json, or load with device_map / a smaller dtype."
        )


# ---- THUDM checkpoint variants -----------------------------------------------------------------------------------
# What differs per released checkpoint, one row each. The same literal is in tokenization_chatglm.py (each file must
# work copied alone, so neither imports it from the other; tests/test_variants.py checks the two are equal). This file
# reads `rotary` (and `weights` through `weight_storage`), the tokenizer reads `tokenizer` and `chat`. Columns:
#   rotary     how rope_ratio is read: "base" rotates with the base 10000 * rope_ratio (ChatGLM3, GLM-4),
#              "positions" divides the positions by rope_ratio with the base 10000 (chatglm2-6b-32k's own code)
#   tokenizer  "chatglm2" (5 control tokens, build_prompt), "chatglm3" (role tokens), "glm4" (ChatGLM4Tokenizer)
#   weights    the storage as released: "float", or "int4" / "int8" (config.json's quantization_bit)
#   chat       "rounds" (ChatGLM2's build_prompt), "roles" (ChatGLM3's build_chat_input), "template" (GLM-4's)
#   fields     config.json values that only this checkpoint has (evidence when its name is lost); the name itself,
#              the row's key, is evidence in config.json's _name_or_path and tokenizer_config.json's name_or_path
# Adding a checkpoint: one row here and in tokenization_chatglm.py, and its golden case (tests/conftest.py).
CHECKPOINT_VARIANTS = {
    "chatglm2-6b": dict(rotary="base", tokenizer="chatglm2", weights="float", chat="rounds", fields={}),
    "chatglm2-6b-32k": dict(rotary="positions", tokenizer="chatglm2", weights="float", chat="rounds",
                            fields={"rope_ratio": 16}),
    "chatglm2-6b-int4": dict(rotary="base", tokenizer="chatglm2", weights="int4", chat="rounds", fields={}),
    "codegeex2-6b": dict(rotary="base", tokenizer="chatglm2", weights="float", chat="rounds", fields={}),
    "chatglm3-6b": dict(rotary="base", tokenizer="chatglm3", weights="float", chat="roles", fields={}),
    "chatglm3-6b-base": dict(rotary="base", tokenizer="chatglm3", weights="float", chat="roles", fields={}),
    "chatglm3-6b-32k": dict(rotary="base", tokenizer="chatglm3", weights="float", chat="roles", fields={}),
    "chatglm3-6b-128k": dict(rotary="base", tokenizer="chatglm3", weights="float", chat="roles", fields={}),
    "glm-4-9b": dict(rotary="base", tokenizer="glm4", weights="float", chat="template", fields={}),
    "glm-4-9b-chat": dict(rotary="base", tokenizer="glm4", weights="float", chat="template", fields={}),
    "glm-4-9b-chat-1m": dict(rotary="base", tokenizer="glm4", weights="float", chat="template", fields={}),
    "codegeex4-all-9b": dict(rotary="base", tokenizer="glm4", weights="float", chat="template", fields={}),
    "glm-4v-9b": dict(rotary="base", tokenizer="glm4", weights="float", chat="template", fields={}),
}


def variant_named(name) -> Optional[str]:
    """The row a checkpoint name says: the longest row name found in its last part (a Hub id's model, a folder, or
    a Hub cache folder `models--THUDM--<model>`), in any case. None: no row is named."""
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
    """config.json as the checkpoint folder holds it (from_pretrained sets `_name_or_path` to the folder, which
    drops the name config.json gives), or {} when the config does not come from a local folder."""
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
    """Which THUDM checkpoint `config` describes (a CHECKPOINT_VARIANTS row), or None: `chatglm_variant` when set
    (written by save_pretrained where it matters, or by hand), else the names (config.json's `_name_or_path`, the
    folder or Hub id loaded from), else the fields only one checkpoint has. Evidence that contradicts the choice
    is named in a warning."""
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
            f"{', '.join(CHECKPOINT_VARIANTS)}."
        )
    return chosen


def rotary_reading(config) -> str:
    """How this checkpoint's rope_ratio is read ("base" or "positions", see CHECKPOINT_VARIANTS). A "positions"
    checkpoint keeps the fact in config.chatglm_variant, so that save_pretrained (which drops the names) keeps it."""
    variant = checkpoint_variant(config)
    reading = CHECKPOINT_VARIANTS[variant]["rotary"] if variant else "base"
    if reading != "base":
        config.chatglm_variant = variant
    return reading


def weight_storage(config) -> str:
    """How the weights are stored: "float", or "int4" / "int8" for a pre-quantized checkpoint (quantization_bit)."""
    bits = getattr(config, "quantization_bit", 0) or 0
    return f"int{bits}" if bits else "float"


def linear_layer(config):
    """The constructor of the blocks' linear layers: nn.Linear, or for a pre-quantized checkpoint the int8-stored
    QuantizedLinear of the companion file quantization_chatglm.py (imported only for such a checkpoint)."""
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
            "repository's configuration_chatglm.py into the checkpoint folder too."
        )
    validate_config(config)
    complete_original_config(config)
    if weight_storage(config) not in ("float", "int4", "int8"):
        raise ValueError(
            f"config.quantization_bit={config.quantization_bit}: checkpoints quantized by the original code store 4 "
            "or 8 bits (0: float weights). Fix quantization_bit in config.json to the width the weights were saved with."
        )
    prefix_slots(config)  # a P-tuning v2 prefix length is valid (see that section)
    check_fits_in_memory(config)


def check_token_ids(input_ids: torch.Tensor, vocab_size: int):
    bad = (input_ids < 0) | (input_ids >= vocab_size)
    if bool(bad.any()):
        raise ValueError(
            f"input_ids holds token id {int(input_ids[bad][0])} outside this model's vocabulary [0, {vocab_size}) "
            f"(padded_vocab_size). The tokenizer does not match the checkpoint, or the ids were built by hand: "
            "GLM-4 tokenizers give ids below 151552, ChatGLM2/3 tokenizers ids below 65024."
        )


def check_attention_mask_values(attention_mask):
    """A 2-D mask holds 1 (token) and 0 (padding), with a token in every row: a 2 was attended like a 1, and a row
    of zeros attended to nothing, both giving logits without meaning and no error."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return
    ones = attention_mask == 1
    valid = ones | (attention_mask == 0)
    if not bool(valid.all()):
        raise ValueError(f"attention_mask must hold only 1 (token) and 0 (padding); it holds "
                         f"{attention_mask[~valid][0].item()!r}. Pass the tokenizer's attention_mask, or a bool mask.")
    empty = ~ones.any(-1)
    if bool(empty.any()):
        raise ValueError(f"attention_mask row {int(empty.nonzero()[0, 0])} is all 0: every sequence needs at least "
                         "one token to attend. Drop empty sequences from the batch.")


def check_inputs(model, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values):
    """Shapes and dtypes of the base model's inputs, each error naming the argument and the shape it must have. Reads
    shapes only (no host sync); token id values are checked separately (check_token_ids). Not while tracing: torch.fx
    hands proxies, not tensors (llm-compressor's default pipeline)."""
    if is_tracing():
        return

    def refuse(name, tensor, expected):
        got = f"shape {list(tensor.shape)}, dtype {tensor.dtype}" if isinstance(tensor, torch.Tensor) else repr(tensor)
        raise ValueError(f"{name} must be {expected}; got {got}.")

    def is_integer(t):
        return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)

    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of input_ids and inputs_embeds.")
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or not is_integer(input_ids):
            refuse("input_ids", input_ids, "an integer tensor [batch, sequence] (one row per sequence: add a batch "
                   "dimension with input_ids[None], or use the tokenizer's return_tensors='pt')")
        name, tokens = "input_ids", input_ids
    else:
        hidden = model.config.hidden_size
        if not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3 \
                or inputs_embeds.shape[-1] != hidden or not inputs_embeds.is_floating_point():
            refuse("inputs_embeds", inputs_embeds, f"a floating tensor [batch, sequence, {hidden}] (hidden_size)")
        name, tokens = "inputs_embeds", inputs_embeds
    batch, length = tokens.shape[:2]
    if batch == 0 or length == 0:
        raise ValueError(f"{name} holds no tokens (shape {list(tokens.shape)}): pass at least one token per sequence "
                         "(a prompt cannot be empty; the GLM tokenizers start every prompt with [gMASK] <sop>).")

    past = cached_length(past_key_values, model, batch)
    if isinstance(past, int):
        check_cache_room(past_key_values, past + length, f"{past} cached and {length} new")
    tokens = past - cached_prefix(model, past)  # a 2-D mask covers the tokens, not a P-tuning v2 prefix
    if attention_mask is not None:
        columns = f"{tokens} + {length}" if isinstance(past, int) else "the cached and the new tokens"
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.is_complex():
            refuse("attention_mask", attention_mask, f"a tensor [{batch}, {columns}] of 1 (token) and 0 (padding)")
        if attention_mask.dim() == 4:
            if attention_mask.shape[0] != batch or attention_mask.shape[2] != length \
                    or (isinstance(past, int) and attention_mask.shape[3] < past + length) \
                    or not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point()):
                refuse("attention_mask", attention_mask, f"a custom 4D mask [{batch}, 1, {length}, {columns}] of bool "
                       "(True: attend) or float (0 or -inf, added to the scores)")
        elif attention_mask.dim() != 2 or attention_mask.shape[0] != batch or (
                isinstance(past, int) and attention_mask.shape[1] != tokens + length
                and getattr(model, "vision", None) is None):  # GLM-4V: columns per token or per row (its seam checks)
            refuse("attention_mask", attention_mask, f"[batch, cached + new tokens] = [{batch}, {columns}] (or a "
                   "custom 4D mask)" + ("; the model adds the P-tuning v2 prefix's columns itself"
                                        if prefix_length(model) else ""))
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 \
                or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length \
                or not is_integer(position_ids):
            refuse("position_ids", position_ids, f"an integer tensor [{batch}, {length}] (batch, new tokens)")


def check_one_float_width(model: nn.Module):
    """transformers 4.44 with dtype "auto" and no torch_dtype in config.json took the first weight's dtype for some
    layers and float32 for others: a float64 weight loaded, and the forward failed on mixed dtypes."""
    wide = [name for name, param in model.named_parameters() if param.dtype == torch.float64]
    if wide and len(wide) < sum(1 for param in model.parameters() if param.is_floating_point()):
        raise ValueError(f"{len(wide)} weights loaded as float64 ({', '.join(wide[:3])}{', ...' if len(wide) > 3 else ''})"
                         " and the others in another dtype: the checkpoint stores float64 tensors. Pass "
                         "torch_dtype=torch.bfloat16 (or float32) to from_pretrained (`dtype=` on transformers >= 4.56).")


def check_loaded_weights(model: nn.Module, loading_info: dict, source):
    """Refuse a checkpoint that holds few of the model's weights (another family's keys, or first-generation
    ChatGLM-6B ones under a ChatGLM2/3 config): the model would otherwise run with random weights, with only
    transformers' load report saying so."""
    expected = set(model.state_dict())
    # transformers 4.44 reports them without the "transformer." prefix when no checkpoint key has it.
    prefixed = {f"{model.base_model_prefix}.{key}" for key in loading_info.get("missing_keys") or ()}
    missing = expected & (set(loading_info.get("missing_keys") or ()) | prefixed)
    if 2 * len(missing) <= len(expected):
        return
    found = sorted(loading_info.get("unexpected_keys") or ())
    raise ValueError(
        f"{source} holds {len(expected) - len(missing)} of the {len(expected)} weights of {type(model).__name__}: it "
        "is not a ChatGLM2/3 / GLM-4 checkpoint (first-generation ChatGLM-6B and other families name their weights "
        f"differently). Expected keys such as {sorted(missing)[:4]}; found {found[:4] or 'none of them'}"
        f"{' (and %d more)' % (len(found) - 4) if len(found) > 4 else ''}. Load it with the code it came with."
    )


def held_float_values(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The floating values of a weight that this process holds, or None: a meta tensor (offloaded by a device map,
    or not loaded) holds none, integer storage (int8/int4 codes) is not floating, and a quantization library's tensor
    subclass packs its own storage. A DTensor (tensor parallelism) is checked by its local shard."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    if tensor.is_meta or not tensor.is_floating_point() or type(tensor) not in (torch.Tensor, nn.Parameter):
        return None
    return tensor


def summable(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16) if values.element_size() == 1 else values  # float8 has no sum/isfinite kernel


def check_finite_weights(model: nn.Module, source):
    """Refuse weights holding NaN or inf (a bad merge or conversion, a damaged download): every logit would be NaN,
    with no message. One sum per tensor and one host sync per device: a sum is finite unless a value is not (or
    legitimate values overflow it, which the exact count then clears)."""
    held = [(name, held_float_values(tensor)) for name, tensor in [*model.named_parameters(), *model.named_buffers()]]
    held = [(name, values) for name, values in held if values is not None]
    sums = {}
    for _, values in held:
        sums.setdefault(values.device, []).append(summable(values).sum())
    if all(bool(torch.stack(device_sums).isfinite().all()) for device_sums in sums.values()):
        return
    for name, values in held:
        bad = values.numel() - int(torch.isfinite(summable(values)).sum())
        if bad:
            raise ValueError(
                f"{source}: the weight {name} holds {bad} NaN or inf value{'s' if bad > 1 else ''} (of "
                f"{values.numel()}); every output would be NaN. The checkpoint is damaged (an interrupted download, "
                "a bad merge or conversion): download or convert it again. check_finite_weights=False skips this "
                "check."
            )


# The weight files from_pretrained reads, in the order it looks for them (a sharded checkpoint's index names its shards).
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def damaged_file_error(path, problem: str) -> ValueError:
    return ValueError(f"{path} is damaged or incomplete: {problem}. Download it again (an interrupted download or a "
                      "full disk leaves such a file), or save the checkpoint again.")


def index_shards(index_file: str, wanted=lambda key: True) -> list:
    """The shard file names a sharded checkpoint's index (`*.index.json`) gives for the wanted keys, sorted."""
    try:
        with open(index_file, "rb") as index:
            weight_map = json.loads(index.read())["weight_map"]
        return sorted({shard for key, shard in weight_map.items() if wanted(key)})
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise damaged_file_error(index_file, "it is not a JSON object with a 'weight_map' table") from None


# safetensors' own limit on a header's size; a length field beyond it (or beyond the file) is damage, not a header.
SAFETENSORS_MAX_HEADER = 100_000_000


def read_safetensors_header(path: str) -> dict:
    """The JSON header of a .safetensors file ({name: {"dtype", "shape", "data_offsets"}}, and "__metadata__"),
    checked against the file's size before anything is allocated: a damaged or cut file fails naming itself instead
    of a bare JSONDecodeError, OverflowError or MemoryError."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        if size < 8:
            raise damaged_file_error(path, f"it holds {size} bytes, fewer than the 8 of a safetensors header length")
        length = int.from_bytes(handle.read(8), "little")
        if length > min(size - 8, SAFETENSORS_MAX_HEADER):
            raise damaged_file_error(path, f"its header length field says {length} bytes, and the file holds "
                                           f"{size - 8} after it")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
        entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
        data_end = max((int(entry["data_offsets"][1]) for entry in entries.values()), default=0)
        if not all(isinstance(entry["dtype"], str) for entry in entries.values()):
            raise TypeError
    except (ValueError, UnicodeDecodeError, AttributeError, KeyError, TypeError, IndexError):
        raise damaged_file_error(path, "its header is not a safetensors header (JSON naming each tensor's dtype, "
                                       "shape and data offsets)") from None
    if data_end > size - 8 - length:
        raise damaged_file_error(path, f"its header places tensor data up to byte {data_end} of the data, and the "
                                       f"file holds {size - 8 - length} bytes of data")
    return header


def with_variant(name: str, variant: Optional[str]) -> str:
    """transformers' file name of a variant: "model.safetensors" -> "model.fp16.safetensors"."""
    if not variant:
        return name
    parts = name.split(".")
    return ".".join(parts[:-1] + [variant, parts[-1]])


def local_checkpoint_file(source, name: str, kwargs: dict) -> Optional[str]:
    """`name` of checkpoint `source` (a folder, or a hub id in the local Hugging Face cache) on this machine, or None."""
    subfolder = kwargs.get("subfolder") or ""
    if os.path.isdir(os.fspath(source)):
        path = os.path.join(os.fspath(source), subfolder, name)
        return path if os.path.isfile(path) else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(str(source), f"{subfolder}/{name}" if subfolder else name,
                                       cache_dir=kwargs.get("cache_dir"), revision=kwargs.get("revision"))
    except Exception:  # not a hub id (a file path, a malformed name): transformers reports it
        return None
    return found if isinstance(found, str) else None


def stored_weight_files(source, kwargs: dict) -> Optional[list]:
    """The weight files from_pretrained(source, **kwargs) reads, if all are on this machine already."""
    if source is None or kwargs.get("gguf_file") or kwargs.get("state_dict") is not None:
        return None
    for name in MODEL_FILES:
        if name.startswith("model.safetensors") and kwargs.get("use_safetensors") is False:
            continue
        found = local_checkpoint_file(source, with_variant(name, kwargs.get("variant")), kwargs)
        if found is None:
            continue
        if not found.endswith(".index.json"):
            return [found]
        files = [local_checkpoint_file(source, shard, kwargs) for shard in index_shards(found)]
        return files if all(files) else None
    return None


def non_float_tensors(files: list) -> list:
    """(name, dtype, file) of each stored tensor that is not floating, read from the safetensors headers or a torch
    file's records (memory-mapped): no tensor value is read."""
    found = []
    for file in files:
        if file.endswith(".safetensors"):
            header = read_safetensors_header(file)
            names = {"BOOL": "bool", "I": "int", "U": "uint", "C": "complex"}
            found += [(name, names.get(entry["dtype"]) or names.get(entry["dtype"][0], "") + entry["dtype"][1:], file)
                      for name, entry in header.items()
                      if name != "__metadata__" and not entry["dtype"].startswith(("F", "BF"))]
            continue
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (not zip) torch file cannot be memory-mapped: transformers' checks apply
            continue
        found += [(name, str(tensor.dtype).replace("torch.", ""), file) for name, tensor in state.items()
                  if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point()]
    return found


def check_stored_dtypes(source, kwargs: dict, model) -> bool:
    """Refuse a checkpoint that stores one of the model's float weights as an integer or bool tensor: transformers
    casts it to float without a word (4.44 without low_cpu_mem_usage fails on the copy, naming neither dtype nor
    file), and the logits are far off. Reads the files' headers only; `model` is the loaded model, or a callable
    building one on the meta device, called only if a stored tensor is not floating. Returns whether the files were
    on this machine to check (a hub checkpoint is downloaded by from_pretrained itself)."""
    files = stored_weight_files(source, kwargs)
    if files is None:
        return False
    stored = non_float_tensors(files)
    if not stored or kwargs.get("quantization_config") is not None:
        return True
    if not isinstance(model, nn.Module):
        with torch.device("meta"):
            model = model()
    if getattr(model.config, "quantization_config", None) is not None:  # quantized weights are stored as integers
        return True
    expected = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    prefix = model.base_model_prefix + "."
    for name, dtype, file in stored:
        for key in (name, name[len(prefix):] if name.startswith(prefix) else prefix + name):
            if key in expected and expected[key].is_floating_point:
                raise ValueError(
                    f"{name} is stored as {dtype} in {file}; this model's weight is floating point ({expected[key]}), "
                    f"and loading would cast the {dtype} values to it without a word, giving wrong logits. The "
                    "checkpoint was saved or edited wrong: save the weights as float (bfloat16, float16 or float32)."
                )
    return True


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
    """Where `module` computes: the device of its weights, or accelerate's execution device when its weights are
    offloaded (then they live on `meta` between calls). None for a module that holds no tensor of its own (a layer
    replaced by torch.ao's dynamic quantization keeps packed weights only): it computes where its input is, and
    `device_boundary(x, None)` leaves x where it is."""
    hook = module.__dict__.get("_hf_hook")  # accelerate sets it as a plain attribute
    if getattr(hook, "execution_device", None) is not None:
        return torch.device(hook.execution_device)
    tensor = first_tensor(module, "_parameters")
    tensor = tensor if tensor is not None else first_tensor(module, "_buffers")
    return None if tensor is None else tensor.device


def first_tensor(module: nn.Module, kind: str) -> Optional[torch.Tensor]:
    """The first parameter (kind "_parameters") or buffer ("_buffers") of `module` and its submodules, in the order
    of module.parameters() / buffers() but without their generators, which cost 20 µs a call (several calls a layer
    per decode step)."""
    for tensor in getattr(module, kind).values():
        if tensor is not None:
            return tensor
    for child in module._modules.values():
        found = None if child is None else first_tensor(child, kind)
        if found is not None:
            return found
    return None


def balanced_device_map(config: ChatGLMConfig, devices) -> dict:
    """An explicit device map for `devices` (e.g. ["cuda:0", "cuda:1"]): embedding and rotary table on the first,
    final norm and output layer on the last, the blocks in contiguous runs that balance the parameter count.
    The successor of ChatGLM3's `load_model_on_gpus`, whose maps missed modules."""
    if isinstance(devices, (str, bytes, int, torch.device)) or not isinstance(devices, Iterable):
        # A string is iterable: "cuda:0" mapped the layers to 'c', 'u', 'd', ...
        raise TypeError(f"balanced_device_map: devices must be a list of devices, e.g. [{devices!r}], got "
                        f"{type(devices).__name__} {devices!r}.")
    devices = list(devices)
    if not devices:
        raise ValueError("balanced_device_map needs at least one device")
    vocab_weights = config.padded_vocab_size * config.hidden_size
    block = block_parameter_count(config)
    pieces = ([("transformer.embedding", vocab_weights)]
              + [(f"transformer.encoder.layers.{i}", block) for i in range(config.num_layers)]
              + [("transformer.output_layer", vocab_weights)])
    if getattr(config, "vision_config", None):  # GLM-4V: the vision tower computes first
        pieces = [("transformer.vision", import_companion("visual", config).parameter_count(config))] + pieces
    share = sum(size for _, size in pieces) / len(devices)
    device_map, start = {}, 0
    for name, size in pieces:
        device_map[name] = devices[min(len(devices) - 1, int((start + size / 2) // share))]
        start += size
    device_map["transformer.rotary_pos_emb"] = device_map["transformer.embedding"]
    if prefix_slots(config):
        device_map["transformer.prefix_encoder"] = device_map["transformer.embedding"]
    device_map["transformer.encoder.final_layernorm"] = device_map["transformer.output_layer"]
    return device_map


def check_devices_exist(device_map: dict):
    """Every device a device map names exists on this machine (transformers < 4.46 found out only after reading the
    weights). "cpu", "disk" and "meta" always do; an int is an index on the accelerator."""
    for entry, device in device_map.items():
        if isinstance(device, str) and device in ("cpu", "disk", "meta"):
            continue
        where = f"device_map[{entry!r}] = {device!r}"
        if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
            raise ValueError(f"{where} is not a device: use a device string such as 'cuda:0', an index, or 'cpu'.")
        try:
            device = torch.device(device) if not isinstance(device, int) else device
        except (RuntimeError, TypeError, ValueError) as err:
            raise ValueError(f"{where} is not a device ({err}): use e.g. 'cuda:0', 0 or 'cpu'.") from None
        if isinstance(device, int):
            accelerator = getattr(torch, "accelerator", None)
            available = accelerator.device_count() if accelerator is not None else torch.cuda.device_count()
            index, kind = device, "accelerator"
        elif device.type in ("cpu", "meta"):
            continue
        else:
            backend = getattr(torch, device.type, None)
            count = getattr(backend, "device_count", None)
            available = count() if callable(count) else None
            index, kind = device.index or 0, device.type
        if available is not None and not 0 <= index < available:
            have = f"indices 0 to {available - 1}" if available else "none"
            raise ValueError(f"{where}: no such device; this machine's {kind} devices: {have}. Use one of those "
                             "or 'cpu'.")


def check_device_map(model: nn.Module, device_map: dict):
    """Refuse a device map that leaves a parameter or buffer unplaced, names a module the model lacks (for example
    the first-generation ChatGLM-6B's names), or splits a block; before any weight is read."""
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]

    def covers(entry, name):
        return entry == "" or name == entry or name.startswith(entry + ".")

    def placement(name):  # the most specific entry wins, as in accelerate
        entries = [entry for entry in device_map if covers(entry, name)]
        return str(device_map[max(entries, key=len)]) if entries else None

    placed = {name: placement(name) for name in names}
    missing = [name for name, device in placed.items() if device is None]
    unknown = [entry for entry in device_map if not any(covers(entry, name) for name in names)]
    block_devices = {}
    for name, device in placed.items():
        for blocks in ("transformer.encoder.layers.", "transformer.vision.transformer.layers."):  # GLM-4V's vision
            if name.startswith(blocks) and device is not None:
                block_devices.setdefault(blocks + name[len(blocks):].split(".")[0], set()).add(device)
    split = [block for block, devices in block_devices.items() if len(devices) > 1]
    if not (missing or unknown or split):
        return
    problems = []
    if missing:
        problems.append(f"it places no device for {len(missing)} parameters and buffers: "
                        + ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else ""))
    if unknown:
        problems.append("it names modules this model does not have: " + ", ".join(unknown[:8])
                        + (", ..." if len(unknown) > 8 else ""))
    if split:
        problems.append("it splits blocks across entries (each GLMBlock, and each vision block of GLM-4V, must sit on "
                        "one device): " + ", ".join(split))
    raise ValueError(
        "device_map does not fit this ChatGLM2/3 / GLM-4 model: " + "; ".join(problems) + ". Use "
        "device_map='auto' (or 'balanced', 'sequential' with max_memory), or build a complete map with "
        "balanced_device_map(config, devices) from modeling_chatglm."
    )


# ======================================================================================================================
# KV cache
# ======================================================================================================================
# transformers' Cache classes, used as they are: every constructor and adapter this file needs is here. Layer l's keys
# and values stay on layer l's device (the Cache classes place them where they arrive). A cache may lead with slots no
# token covers (a P-tuning v2 prefix), and a GLM-4V cache holds image rows: both are counted here, not in the model.


def dynamic_cache_kwargs(config: ChatGLMConfig) -> dict:
    return {"config": config} if _DYNAMIC_CACHE_TAKES_CONFIG else {}


def new_dynamic_cache(config: ChatGLMConfig) -> DynamicCache:
    return DynamicCache(**dynamic_cache_kwargs(config))


def new_static_cache(config: ChatGLMConfig, batch_size: int, max_cache_len: int, dtype: torch.dtype,
                     layer_devices: list) -> StaticCache:
    """A StaticCache built by hand. 4.44-4.55 allocate it up front (batch size, dtype, a device; 4.47-4.55 put each
    layer on its own with `layer_device_map`); 4.56+ allocate each layer lazily where its first keys arrive."""
    accepted = inspect.signature(StaticCache.__init__).parameters
    batch_name = "max_batch_size" if "max_batch_size" in accepted else "batch_size"
    optional = {batch_name: batch_size, "dtype": dtype, "device": layer_devices[0]}
    if len(set(layer_devices)) > 1:
        optional["layer_device_map"] = dict(enumerate(layer_devices))
    return StaticCache(config=config, max_cache_len=max_cache_len,
                       **{name: value for name, value in optional.items() if name in accepted})


def as_cache(past_key_values) -> Optional[Cache]:
    """past_key_values as a Cache: a legacy tuple of (key, value) per layer, each [batch, kv_heads, seq, head_dim],
    converted where transformers still converts them (< 5.0); a Cache, or None, as given."""
    if not isinstance(past_key_values, (tuple, list)):
        return past_key_values
    if not hasattr(DynamicCache, "from_legacy_cache"):
        raise TypeError(
            f"past_key_values as a tuple of tensors is not supported with transformers {transformers.__version__}: "
            "pass the Cache object a previous call returned (or a transformers DynamicCache)."
        )
    return DynamicCache.from_legacy_cache(past_key_values)


def cached_length_of(past_key_values) -> int:
    """Tokens a cache holds: a Cache, a legacy tuple of (key, value) [batch, kv_heads, seq, dim] per layer, or None."""
    if not past_key_values:
        return 0
    if isinstance(past_key_values, Cache):
        return past_key_values.get_seq_length()
    return past_key_values[0][0].shape[-2]


def cache_for_forward(past_key_values, config: ChatGLMConfig, use_cache: bool) -> Tuple[Optional[Cache], bool]:
    """The cache a forward reads and writes, and whether the caller gave legacy tuples (it gets tuples back). A cache
    given with use_cache=False is still read, as the original and transformers' models do; only a cache this call
    would create is skipped."""
    cache = as_cache(past_key_values)
    if cache is None and use_cache:
        cache = new_dynamic_cache(config)
    return cache, isinstance(past_key_values, (tuple, list))


def cache_to_return(cache: Optional[Cache], use_cache: bool, legacy: bool):
    """What a forward returns as past_key_values: nothing without use_cache, tuples to a caller who gave tuples."""
    if not use_cache:
        return None
    return cache.to_legacy_cache() if legacy else cache


def max_cache_length(cache: Cache) -> Optional[int]:
    """Preallocated length of a static cache, None for a cache that grows."""
    if isinstance(cache, DynamicCache):
        return None
    length = getattr(cache, _MAX_LENGTH_QUERY)()
    return int(length) if length is not None and length > 0 else None


def cache_is_empty(cache: Cache) -> bool:
    length = cache.get_seq_length()
    return length == 0 if isinstance(length, int) else not bool(length)  # a tensor from static caches before 5.x


def cache_argument_error(problem: str) -> ValueError:
    """An error about the cache the caller passed, naming the argument: the one place that spells its name."""
    return ValueError(f"past_key_values {problem}")


def check_cache_room(cache, needed: int, what: str):
    """A static cache holds max_cache_len slots; a step needing more would fail further on, unclearly (on the 4-D
    mask generate() sized for the cache, or in the cache's index copy). Checked first: by the forward where the
    cached length is an int (a static cache on an accelerator counts its slots in a tensor, and reading it costs a
    host sync), and by generate() from the length of its ids."""
    capacity = max_cache_length(cache) if isinstance(cache, Cache) else None
    if capacity is None or needed <= capacity:
        return
    raise cache_argument_error(
        f"is a static cache of {capacity} tokens (max_cache_len={capacity}); this step needs {needed} ({what}). "
        "Create it with max_cache_len of at least the prompt plus max_new_tokens (plus pre_seq_len with a P-tuning "
        "v2 prefix)."
    )


def first_layer_keys(cache: Cache) -> Optional[torch.Tensor]:
    """Layer 0's keys [batch, kv_heads, slots, head_dim] as `cache` holds them, None while it holds none (a new cache;
    4.56+ static caches allocate on the first update). 4.56+ keep them on `cache.layers`, earlier releases in
    `cache.key_cache` (static caches allocated up front, with their batch size)."""
    if hasattr(cache, "layers"):
        keys = getattr(cache.layers[0], "keys", None) if len(cache.layers) else None
    else:
        stored = getattr(cache, "key_cache", None)
        keys = stored[0] if stored else None
    return keys if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None


def check_cache_shape(cache: Cache, model, batch: int):
    """A cache of another batch size or of another model's key/value heads fails in the first layer's torch.cat
    ("Sizes of tensors must match"); generate() does not expand a cache it is given for num_beams or
    num_return_sequences. Reads layer 0's shape only."""
    keys = first_layer_keys(cache)
    sizes = model.encoder.layers[0].self_attention.sizes
    if keys is None or (keys.shape[0], keys.shape[1], keys.shape[3]) == (batch, sizes.num_kv_heads, sizes.head_dim):
        return
    raise cache_argument_error(
        f"holds keys of shape {list(keys.shape)} (batch, key/value heads, cached tokens, head dim); this model with "
        f"an input of batch {batch} needs [{batch}, {sizes.num_kv_heads}, cached tokens, {sizes.head_dim}] "
        "(multi_query_group_num key/value heads of kv_channels). Pass the cache this model returned for these "
        "sequences (expanded to the batch generate() runs), or a new DynamicCache()."
    )


def cached_length(past_key_values, model, batch: int):
    """Tokens held by `past_key_values`, after checking its type and layout: as many layers as the model, each
    [batch, kv_heads, cached, head_dim] (a Cache's first layer; every pair of a legacy tuple). An int, or a tensor
    where a static cache counts its written slots on an accelerator (reading it would cost a host sync)."""
    if past_key_values is None:
        return 0
    if isinstance(past_key_values, Cache):
        layers = len(model.encoder.layers)
        filled = len(past_key_values) if isinstance(past_key_values, DynamicCache) else layers
        if 0 < filled < layers:  # a cache of another model (transformers < 4.47 took it, and failed in attention)
            raise cache_argument_error(f"holds {filled} layers; this model has {layers} (num_layers). Pass the "
                                       "cache this model returned, or a new DynamicCache().")
        check_cache_shape(past_key_values, model, batch)
        length = past_key_values.get_seq_length()
        if isinstance(length, torch.Tensor) and length.device.type == "cpu" and not is_tracing():
            return int(length)
        return length
    sizes = model.encoder.layers[0].self_attention.sizes
    layers = len(model.encoder.layers)
    expected = (f"a transformers Cache (DynamicCache, StaticCache), or a tuple of {layers} (key, value) pairs, each "
                f"a floating tensor [{batch}, {sizes.num_kv_heads}, cached tokens, {sizes.head_dim}]")
    if not isinstance(past_key_values, (tuple, list)) or len(past_key_values) != layers:
        got = f"a {type(past_key_values).__name__}" + (f" of {len(past_key_values)}"
                                                       if isinstance(past_key_values, (tuple, list)) else "")
        raise cache_argument_error(f"must be {expected}; got {got}.")
    first = past_key_values[0][0] if len(past_key_values[0]) == 2 else None
    for pair in past_key_values:
        if len(pair) != 2 or any(not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point()
                                 or t.shape[1] != sizes.num_kv_heads
                                 or t.shape[3] != sizes.head_dim or t.shape[0] != batch
                                 or t.shape[:3] != first.shape[:3] for t in pair):
            shapes = [list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in pair]
            raise cache_argument_error(f"must be {expected}; got a layer with {shapes}.")
    return first.shape[2]


class PrefixOnlyCache(DynamicCache):
    """The prefix for a forward that keeps no cache (use_cache=False, gradient checkpointing): each layer attends to
    its prefix followed by the new keys, and nothing is stored, so a checkpointed layer that runs again sees the same
    keys. Gradients reach the prefix encoder through the concatenation."""

    def __init__(self, config: ChatGLMConfig, key_values: list):
        super().__init__(**dynamic_cache_kwargs(config))
        self.prefix = key_values

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        key, value = self.prefix[layer_idx]
        return torch.cat([key, key_states], dim=-2), torch.cat([value, value_states], dim=-2)

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self.prefix[layer_idx][0].shape[-2]


def reserve_static_cache_room(model: nn.Module, inputs: Optional[torch.Tensor], kwargs: dict, leading_slots: int
                              ) -> dict:
    """generate(cache_implementation="static") sizes its cache for the prompt and the new tokens only; with
    `leading_slots` (a P-tuning v2 prefix) the static cache is built here, that much larger, and handed to generate."""
    if not leading_slots or any(kwargs.get(name) is not None for name in ("past_key_values", "cache")):
        return kwargs
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{name: value for name, value in kwargs.items() if hasattr(config, name)})
    if config.cache_implementation != "static" or config.use_cache is False:
        return kwargs
    prompt = next(t for t in (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if t is not None)
    batch_size, length = prompt.shape[:2]
    new_tokens = config.max_new_tokens if config.max_new_tokens is not None else max(config.max_length - length, 0)
    transformer = model.base_model
    cache = new_static_cache(
        model.config, batch_size * max(config.num_beams or 1, config.num_return_sequences or 1),
        leading_slots + length + new_tokens, transformer.compute_dtype,
        [execution_device(layer) for layer in transformer.encoder.layers],
    )
    config.cache_implementation = None
    kwargs = {name: value for name, value in kwargs.items() if name != "cache_implementation"}
    return dict(kwargs, **cache_output(cache), generation_config=config)


# GLM-4V: how many rows its images added to the sequence a cache holds (an image's N + 2 rows replace its 3 tokens),
# written by the step that spliced the image in and read by later steps. Kept on the cache object itself: the one thing
# that lives exactly as long as those rows and is copied with them (copy.deepcopy of a prompt cache, beam reordering).
IMAGE_ROWS_ATTRIBUTE = "chatglm_image_rows_added"


def image_rows_in_cache(cache: Optional[Cache]) -> Optional[int]:
    """Rows images added to `cache`'s sequence; None where no step has recorded it."""
    return getattr(cache, IMAGE_ROWS_ATTRIBUTE, None)


def record_image_rows(cache: Cache, rows: int):
    setattr(cache, IMAGE_ROWS_ATTRIBUTE, rows)


# ======================================================================================================================
# Module contracts
# ======================================================================================================================


# Each module keeps the original's call: forward(hidden_states, attention_mask, rotary_pos_emb, kv_cache, use_cache)
# for the encoder (kv_caches), its layers and their self_attention; forward(query, key, value, attention_mask) for
# core_attention; rotary_pos_emb(seq_length). The original hands over the rotary rows ([batch, seq, dim / 2, (cos,
# sin)], one tensor), a boolean mask True where a query must NOT look (None: causal, or one new token), keys and values
# repeated to every query head. This file's forward hands over cheaper values in the same slots, told apart by their
# form, never by whether anything watches (hooks only read, and see these):
#   rotary_pos_emb   LayerInputs, a tuple: the rotary tables and what the kernel takes besides the mask
#   attention_mask   beside a LayerInputs: the kernel's own mask (build_attention_mask: None, True where a query MAY
#                    look, an additive float mask, or flash's 2-D padding mask)
#   core_attention   keys and values per group; its attention_mask a KernelInputs tuple (the kernel's mask and the rest)
#   rotary_pos_emb() called with the position ids [batch, seq]: (cos, sin) for those rows alone
# Every module computes with either form: a layer called as the original calls it, with the original's tensors,
# returns the original's result in the original's formats (GLM-4's batch-first layout). The original's values cross
# only a boundary where a tool has put another forward in place (`forward_replaced`): its forward was written to the
# original. What a layer is called with is tensors, tuples, a string and None (with output_attentions, a list that
# collects the weights), which tools that capture a layer's arguments and replay them keep (GPTQModel, AutoRound); a
# plain tuple of the same items is read the same way.


class LayerInputs(NamedTuple):
    """`rotary_pos_emb` as this file's forward hands it to the encoder and every layer."""

    cos: torch.Tensor  # [batch or 1, 1, seq, head_dim] in the compute dtype (head_tables)
    sin: torch.Tensor
    cache_position: torch.Tensor  # [seq]: the cache slots of the new tokens
    implementation: str  # the kernel of this forward (attention_implementation)
    kernel_kwargs: tuple  # ((name, value), ...): extra arguments for the kernel (attention backends, packed rows)
    attentions: Optional[list]  # with output_attentions: one slot per layer, written by its core_attention


class KernelInputs(NamedTuple):
    """core_attention's `attention_mask` as SelfAttention hands it: the kernel's mask and what else it takes."""

    mask: Optional[torch.Tensor]
    implementation: str
    kernel_kwargs: tuple
    attentions: Optional[list]


def takes_our_values(forward):
    """Marks a forward of this file as computing with the values this file hands over (see above)."""
    forward.takes_our_values = True
    return forward


def forward_replaced(module: nn.Module) -> bool:
    """Whether a tool has put another forward in place of this file's, on the instance, on its class, or as a module
    of its own class: then the module is called with the original's values. Read from the forward itself (a marker,
    not identity with this file's functions: transformers 4.44 to 4.4x execute this file again at every load, and a
    model loaded before keeps the functions it was built with). Hooks do not count: they only read. accelerate's
    device hook wraps the forward it found, which decides."""
    forward = module.__dict__.get("_old_forward") if "_hf_hook" in module.__dict__ else None
    forward = forward if forward is not None else module.__dict__.get("forward", type(module).forward)
    return not getattr(getattr(forward, "__func__", forward), "takes_our_values", False)


# ======================================================================================================================
# Rotary position embedding
# ======================================================================================================================


class RotaryEmbedding(nn.Module):
    """GLM's rotary embedding: the first half of each head's channels turns, as interleaved pairs, with the base
    10000 * rope_ratio; chatglm2-6b-32k divides the positions by rope_ratio instead (`rotary_reading`). Every
    rotary table of the model (cached steps, static cache, device maps, tensor parallelism, P-tuning) is this
    module's.

    Its `forward(max_seq_len, offset=0)` is the original's: the table of positions 0 .. max_seq_len - 1
    [max_seq_len, dim / 2, (cos, sin)]. This file's forward calls it with the position ids [batch, seq] in
    `max_seq_len`'s place, and gets the rows it rotates with as the layers take them (`cos_sin`): no table of
    seq_length rows per forward. A forward a tool put in its place is called as the original calls it."""

    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.rotary_channels = config.kv_channels // 2
        self.head_dim = config.kv_channels
        rope_ratio = getattr(config, "rope_ratio", 1)  # chatglm3-6b's original config has no rope_ratio
        self.rope_ratio = rope_ratio
        divides_positions = rotary_reading(config) == "positions"
        self.base = 10000.0 * (1 if divides_positions else rope_ratio)
        self.position_divisor = float(rope_ratio) if divides_positions else 1.0
        # Checkpoints store `inv_freq` (always with base 10000); the original never reads its values and neither do
        # we: it keeps the state-dict key and marks the device the rotary table is computed on.
        self.register_buffer("inv_freq", self.checkpoint_inv_freq(), persistent=True)
        self._register_load_state_dict_pre_hook(own_loaded_inv_freq, with_module=True)

    def checkpoint_inv_freq(self) -> torch.Tensor:
        steps = torch.arange(0, self.rotary_channels, 2, dtype=torch.float32)
        return 1.0 / (10000 ** (steps / self.rotary_channels))

    def own_loaded_buffer(self):
        """Loading casts the weights to the requested dtype but (transformers >= 4.53) keeps this fp32 buffer as the
        checkpoint gave it: a view into the file's memory map, which keeps the whole shard mapped and resident.
        Called after loading (5.x assigns it without load_state_dict): 32 floats of its own instead."""
        if self.inv_freq.device.type == "cpu":
            self.inv_freq = self.inv_freq.clone()

    @takes_our_values
    def forward(self, max_seq_len, offset: int = 0):
        """The original's call (an int): its table, in inv_freq's dtype, on its device (`offset` is accepted and, as
        in the original, not read). Position ids [batch, seq] instead: `cos_sin` of them, in fp32."""
        if isinstance(max_seq_len, torch.Tensor):
            return self.cos_sin(max_seq_len)
        return self.forward_impl(max_seq_len, self.dim, dtype=self.inv_freq.dtype, device=self.inv_freq.device)

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The rows of `position_ids` [batch, seq] of the original's table, as the layers rotate with them
        (`head_tables`): computed for those positions alone."""
        theta = self.theta(position_ids.device)
        positions = position_ids[..., None].float()
        if self.position_divisor != 1.0:  # position interpolation (chatglm2-6b-32k)
            positions = positions / self.position_divisor
        angles = positions * theta
        return head_tables(angles.cos(), angles.sin(), self.head_dim, dtype)

    def theta(self, device: torch.device) -> torch.Tensor:
        steps = torch.arange(0, self.rotary_channels, 2, dtype=torch.float32, device=device)
        return 1.0 / (self.base ** (steps / self.rotary_channels))

    # The original's names: `dim` (rotated channels per head), `original_impl`, and its table of positions 0 ..
    # seq_len - 1 as `forward_impl` computes it ([seq_len, n_elem / 2, (cos, sin)], half precision kept).
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
    """load_state_dict pre-hook of RotaryEmbedding (4.x loads each tensor through it): the checkpoint's `inv_freq`
    is copied as it arrives, so that the shard holding it is not kept mapped, and resident, while the other shards
    load (the load of an fp32 checkpoint as bf16 otherwise peaked that shard's size above native Glm's)."""
    key = prefix + "inv_freq"
    if isinstance(state_dict.get(key), torch.Tensor) and state_dict[key].device.type == "cpu":
        state_dict[key] = state_dict[key].clone()


def head_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int, dtype: torch.dtype
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [batch, seq, pairs] (one angle per turning pair) over a head's whole width: [batch, 1, seq,
    head_dim]. On the turning channels each value repeats for its pair, sin with the pair's signs (-, +); the other
    channels pass (cos 1, sin 0). Made once per forward, so that each layer turns its queries and keys in four
    operators (SelfAttention.rotated_heads)."""
    passing = head_dim - 2 * cos.shape[-1]
    cos = F.pad(cos.repeat_interleave(2, dim=-1), (0, passing), value=1.0)
    sin = F.pad(torch.stack((-sin, sin), dim=-1).flatten(-2), (0, passing))
    return cos[:, None].to(dtype), sin[:, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn the pairs (x0, x1) of x [batch, heads, seq, head_dim] on RotaryEmbedding's tables: (x0 cos - x1 sin,
    x1 cos + x0 sin), the original's products and sums (the sign rides on sin), the passing channels as they are."""
    return x * cos + x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin


# ======================================================================================================================
# Attention
# ======================================================================================================================


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[batch, kv_heads, seq, dim] -> [batch, kv_heads * groups, seq, dim], each key/value head serving its queries."""
    if groups == 1:
        return x
    batch, kv_heads, seq, dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, groups, seq, dim).reshape(batch, kv_heads * groups, seq, dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention as the original's CoreAttention computes it. With `apply_query_key_layer_scaling` the scores are
    computed divided by the layer number and multiplied back after the upcast, so fp16 products cannot overflow;
    the layer scaling forces the fp32 softmax, as in the original."""
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
    """SDPA with the key/value groups kept as groups, so that no decode step copies the cache: one new token's query
    heads attend as rows of their group (a mask broadcasts over them), an unmasked prompt uses torch's `enable_gqa`.
    A masked prompt expands the groups once (CUDA's fused kernels take a mask or groups, not both), as transformers
    does, and so does an unmasked prompt on torch < 2.5 (folding the groups into the query rows instead would need an
    explicit causal mask of groups x prompt x keys, larger than the copy, and would lose the fused causal kernels)."""
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
            is_causal=attention_mask is None and query_length > 1, **({"enable_gqa": True} if grouped else {}),
        )
    return out.transpose(1, 2).contiguous(), None


def attention_function(implementation: str):
    """The attention kernel for `config._attn_implementation`: our eager one (it honours the original's fp32
    softmax and query-key layer scaling), else transformers' registry; for sdpa our grouped kernel where
    transformers has none (before 4.48) or its own expands the key/value groups (before 5.x's `pack_gqa`)."""
    if implementation in (None, "eager"):
        return eager_attention_forward
    if ALL_ATTENTION_FUNCTIONS is None:
        if implementation == "sdpa":
            return sdpa_grouped_attention_forward
        raise ValueError(
            f"attn_implementation={implementation!r} needs transformers >= 4.48 with this model; "
            f"{transformers.__version__} is installed. Use 'sdpa' or 'eager', or upgrade transformers."
        )
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # 5.x
        kernel = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    else:
        kernel = ALL_ATTENTION_FUNCTIONS[implementation]
    if _TRANSFORMERS_SDPA_EXPANDS_GROUPS and kernel is _transformers_sdpa.sdpa_attention_forward:
        return sdpa_grouped_attention_forward  # (a kernel registered over "sdpa" by the user is kept)
    return kernel


def attention_implementation(config: ChatGLMConfig, output_attentions: bool) -> str:
    """The kernel of one forward: the configured one, or eager when attention weights are asked for (the fused and
    flash kernels do not compute them; transformers' models fall back the same way)."""
    implementation = config._attn_implementation or "eager"
    if not output_attentions or implementation == "eager":
        return implementation
    if not is_tracing():  # (logging breaks a compiled graph)
        logger.warning_once(
            f"output_attentions=True: the attention weights are computed by the eager kernel for those calls "
            f"instead of {implementation!r} (slower, more memory). Load with attn_implementation='eager' to make it "
            "the default."
        )
    return "eager"


def packed_sequence_ids(position_ids: Optional[torch.Tensor], attention_mask, past_length) -> Optional[torch.Tensor]:
    """Padding-free batches (DataCollatorWithFlattening, TRL packing) hold several sequences in one row, each
    starting again at position 0. Returns, per token, the number of its sequence within the row ([batch or 1, new]),
    or None when every row is one sequence. Only a prompt without a custom 4D mask can be packed; the check costs
    one host sync per prompt (none per decode step)."""
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
    """The flash kernels' own description of packed rows: the boundaries of every sequence in the flattened batch
    (cu_seq_lens) and the longest one. transformers' flash path reads them when the mask is None (>= 4.48)."""
    sequence_ids = sequence_ids.expand(batch_size, -1)
    starts = F.pad(sequence_ids[:, 1:] != sequence_ids[:, :-1], (1, 0), value=True).flatten()
    boundaries = F.pad(starts.nonzero().flatten(), (0, 1), value=starts.numel()).to(torch.int32)
    longest = int((boundaries[1:] - boundaries[:-1]).max())
    return dict(cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=longest, max_length_k=longest,
                position_ids=position_ids.expand(batch_size, -1))


def build_attention_mask(implementation, attention_mask, query_positions, key_length, *, batch_size,
                         preallocated=False, sequence_ids=None, prefix=0):
    """The mask the attention kernels take.

    attention_mask: None, a [batch, past + new] padding mask (1 = token, 0 = padding), or a 4D mask (a custom one,
    or one generate() prepared for a static cache: passed through). query_positions: [1, new], each query's slot in
    the cache; preallocated: the cache has key_length slots, those beyond the last query unwritten (static caches).
    sequence_ids: packed rows (packed_sequence_ids), each token attending only within its own sequence and to the
    `prefix` slots (a P-tuning v2 prefix) that lead the cache.
    Returns None (plain causal), a 2D [batch, key_length] padding mask for the flash kernels (they apply causality
    and packing themselves), or a boolean [batch, 1, new, key_length] mask, True where a query may attend. A decode
    step costs no operator here; nothing of the original's mask is built (`original_mask`).
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        if implementation == "eager" and attention_mask.dtype == torch.bool:
            # A padding query that sees no key (generate()'s static-cache masks are made for the configured sdpa):
            # every key, as in our own masks. The eager softmax over nothing is NaN, which the padding's values would
            # carry into real tokens at the next layer (sdpa's kernel gives such rows zeros itself).
            return attention_mask | ~attention_mask.any(dim=-1, keepdim=True)
        return attention_mask
    query_length = query_positions.shape[-1]
    # Without padding, causality alone is the mask when the keys end with the queries (a prompt, one token on a cache
    # that grows) or when a prompt fills an empty preallocated cache (its unwritten slots lie beyond every query;
    # reading the first position costs one host sync per prompt). Other steps on a static cache mask its unwritten
    # slots. Value-dependent shortcuts step aside while compiling or tracing (a trace would freeze them).
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
    if decode:  # one new token on a cache that grows: every key precedes it, the padding alone is the mask; a row
        # of padding alone sees every key
        allowed = (attention_mask != 0)[:, None, None, :]
        return allowed | ~allowed.any(dim=-1, keepdim=True)
    mask = key_positions[None, None, :] <= query_positions[:, :, None]
    if sequence_ids is not None:  # a prompt: every query sees the prefix slots, then the keys of its own sequence
        # (a static cache's slots after the prompt are unwritten)
        key_ids = F.pad(sequence_ids, (prefix, key_length - prefix - sequence_ids.shape[-1]), value=-1)
        mask = mask & ((sequence_ids[:, :, None] == key_ids[:, None, :]) | (key_positions < prefix)[None, None, :])
    if attention_mask is not None:
        padding = attention_mask.bool()
        if padding.shape[-1] < key_length:  # a static cache's slots beyond the mask are unwritten
            padding = F.pad(padding, (0, key_length - padding.shape[-1]), value=False)
        mask = mask & padding[:, None, :]
    # A padding query sees no key at all; let it see every key so that its softmax stays finite (its output is
    # never used by a real token).
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask[:, None]


def original_attention_mask(padding_mask, batch_size: int, query_length: int, past_length, device) -> torch.Tensor:
    """The original's attention mask (its get_masks): [batch, 1, new, past + new], True where a query must NOT
    look: causal, every cached slot visible, keys at padding (0 in the 2-D `padding_mask`, past included) hidden,
    and in a prompt each padded query row sees every key. Boolean operators only."""
    allowed = torch.ones(query_length, query_length, dtype=torch.bool, device=device).tril_()
    if past_length:
        allowed = torch.cat((allowed.new_ones(query_length, past_length), allowed), dim=-1)
    allowed = allowed.expand(batch_size, -1, -1)
    if padding_mask is not None:
        padding = padding_mask.to(device) != 0
        allowed = allowed & padding[:, None, :]
        if not past_length:
            allowed = allowed | ~padding[:, :, None]
    return ~allowed[:, None]


def placed_inputs(value, device: Optional[torch.device]):
    """A layer's inputs on `device` (device_boundary): tuples rebuilt with their tensors moved, anything else (the
    attentions list every layer writes into, strings) the same object. Plain loops: torch 2.4's dynamo traces no
    comprehension that reads `device`."""
    if isinstance(value, torch.Tensor) or value is None:
        return device_boundary(value, device)
    if not isinstance(value, tuple):
        return value
    items = []
    for item in value:
        items.append(placed_inputs(item, device))
    return type(value)(*items) if hasattr(value, "_fields") else tuple(items)


def as_original_call(hidden_states, attention_mask, rotary_pos_emb):
    """(attention_mask, rotary_pos_emb) as the original hands them on, from either form: for a module whose forward
    a tool replaced (forward_replaced). The rotary rows [batch, seq, pairs, (cos, sin)] come from the tables."""
    if not isinstance(rotary_pos_emb, tuple):
        return attention_mask, rotary_pos_emb
    cos, sin, cache_position = rotary_pos_emb[:3]
    turning = cos.shape[-1] // 2  # the first half of a head's channels turns
    rows = torch.stack((cos[:, 0, :, 0:turning:2], sin[:, 0, :, 1:turning:2]), dim=-1)
    return original_mask(attention_mask, cache_position, None, hidden_states.shape[0]), rows


def original_mask(mask, cache_position: torch.Tensor, key_length: Optional[int], batch_size: int):
    """The original's mask (True where a query must NOT look) from the kernel's. With `key_length`, always a tensor
    [batch, 1, new, keys] (core_attention's call: a function written to it may not take None), causal by cache slot;
    without, None stays None: the original's "causal prompt, or one new token"."""
    if mask is not None and mask.dim() == 4:
        return ~mask if mask.dtype == torch.bool else mask < 0  # a custom additive mask hides with negative values
    if mask is None and key_length is None:
        return None
    keys = mask.shape[-1] if mask is not None else key_length
    allowed = (torch.arange(keys, device=cache_position.device) <= cache_position[:, None])[None, None]
    if mask is not None:  # flash's padding mask; a padded query sees every key, as in the original's prompt
        padding = mask.to(allowed.device) != 0
        allowed = (allowed & padding[:, None, None, :]) | ~padding[:, None, -cache_position.shape[0]:, None]
    return ~allowed.expand(batch_size, 1, -1, -1)


def kernel_mask(original, new: int, keys: int, device, implementation: str):
    """The kernel's mask from the original's (True where a query must NOT look; None: causal, the keys ending with
    the queries), for the eager and sdpa kernels."""
    if original is not None:
        return ~original if original.dtype == torch.bool else original
    if new == 1 or (new == keys and implementation == "sdpa"):
        return None
    return torch.ones(new, keys, dtype=torch.bool, device=device).tril_(keys - new)


def check_batch_first(hidden_states, attention_mask, rotary_pos_emb):
    """A call with the original's tensors must be in GLM-4's layout, batch first; ChatGLM2/3's originals were
    sequence-first, and their tensors would be read wrongly without a word."""
    batch, seq = hidden_states.shape[:2]
    fits = rotary_pos_emb.dim() == 4 and rotary_pos_emb.shape[1] == seq and rotary_pos_emb.shape[0] in (1, batch)
    if attention_mask is not None:
        fits = fits and attention_mask.shape[0] in (1, batch) and attention_mask.shape[-2] == seq
    if not fits:
        raise ValueError(
            "This layer was called with the original's tensors in another layout: it takes GLM-4's batch-first "
            "layout, hidden_states [batch, seq, hidden], rotary_pos_emb [batch or 1, seq, rotary_dim / 2, 2] (the "
            "rows `rotary_pos_emb(seq_length)[position_ids]`), attention_mask None or [batch, 1, seq, keys], True "
            f"where a query must not look; got hidden_states {list(hidden_states.shape)}, rotary_pos_emb "
            f"{list(rotary_pos_emb.shape)}, attention_mask "
            f"{None if attention_mask is None else list(attention_mask.shape)}. ChatGLM2/3's original code was "
            "sequence-first ([seq, batch, ...]): transpose its tensors, or call the model instead."
        )


class CoreAttention(nn.Module):
    """The attention kernel's call of one layer, a submodule as in the original (`self_attention.core_attention`).
    It holds no weights. forward(query_layer, key_layer, value_layer, attention_mask) -> [batch, seq, heads * dim] is
    the original's contract (GLM-4's layout, batch first): query [batch, heads, seq, dim], key and value [batch,
    heads, keys, dim] repeated to every query head, attention_mask True where a query must NOT look (None: causal).
    SelfAttention calls it so where a tool has replaced its forward (optimum-intel's OpenVINO export), and otherwise
    with this file's values: key and value per group, and a KernelInputs in the mask's place. Kernels get it as
    their `module`: it has what they read (`config`, `layer_idx`, `is_causal`, `num_key_value_groups`, `scaling`,
    `training`) and the original's names. Its class is named after the attention implementation the model was built
    with, as GLM-4's original names it (SdpaAttention, FlashAttention2 are subclasses; eager is CoreAttention)."""

    def __init__(self, config: ChatGLMConfig, layer_number: int):
        super().__init__()
        self.config = config
        self.layer_number = max(1, layer_number)
        self.layer_idx = layer_number - 1
        self.sizes = AttentionSizes.from_config(config)  # SelfAttention keeps them per rank (tensor parallelism)
        self.is_causal = True
        self.apply_query_key_layer_scaling = config.apply_query_key_layer_scaling
        # The layer scaling forces the fp32 softmax (eager_attention_forward), as in the original.
        self.attention_softmax_in_fp32 = config.attention_softmax_in_fp32 or config.apply_query_key_layer_scaling
        self.coeff = self.layer_number if self.apply_query_key_layer_scaling else None
        self.norm_factor = self.sizes.head_dim ** 0.5 * (self.coeff or 1)
        self.scaling = self.sizes.head_dim ** -0.5
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    num_key_value_groups = property(lambda self: self.sizes.groups)  # read by transformers' attention functions
    num_attention_heads_per_partition = property(lambda self: self.sizes.num_heads)
    hidden_size_per_attention_head = property(lambda self: self.sizes.head_dim)
    hidden_size_per_partition = property(lambda self: self.sizes.num_heads * self.sizes.head_dim)

    @takes_our_values
    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        if isinstance(attention_mask, tuple):  # this file's call (KernelInputs)
            mask, implementation, kernel_kwargs, attentions = attention_mask
        else:  # the original's (the repeated heads count as groups of one); flash takes no 4-D mask: sdpa
            implementation = "eager" if self.config._attn_implementation in (None, "eager") else "sdpa"
            mask = kernel_mask(attention_mask, query_layer.shape[-2], key_layer.shape[-2], query_layer.device,
                               implementation)
            kernel_kwargs, attentions = (), None
        out, weights = attention_function(implementation)(
            self, query_layer, key_layer, value_layer, mask,
            **{**dict(kernel_kwargs), "dropout": self.attention_dropout.p if self.training else 0.0,
               "scaling": self.scaling})
        if attentions is not None:
            attentions[self.layer_idx] = weights
        return out.flatten(2)

class SdpaAttention(CoreAttention):
    """core_attention of a model built with attn_implementation="sdpa" (GLM-4's original class name)."""


class FlashAttention2(CoreAttention):
    """core_attention of a model built with a flash attention implementation (GLM-4's original class name)."""


def core_attention_class(config) -> type:
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation == "sdpa":
        return SdpaAttention
    return FlashAttention2 if implementation.startswith("flash") else CoreAttention


class SelfAttention(nn.Module):
    """The attention of one layer: forward(hidden_states, attention_mask, rotary_pos_emb, kv_cache=None,
    use_cache=True) -> (output, kv_cache), the original's contract, with either form of values ("What travels between
    the modules"). kv_cache: this file's Cache object, which the layer writes its keys and values into (the same
    object comes back; None with use_cache=False), or the original's: None (a tensor [1, 2, batch, kv_heads, seq,
    dim] comes back with use_cache) or the (keys, values) of the earlier tokens (the longer pair comes back)."""

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
            config.hidden_size, self.sizes.qkv_features, bias=config.add_bias_linear or config.add_qkv_bias
        )
        self.dense = linear(self.sizes.num_heads * self.sizes.head_dim, config.hidden_size, bias=config.add_bias_linear)

    @property
    def sizes(self) -> AttentionSizes:
        """This layer's head counts (a rank's under tensor parallelism), handed on to our core_attention, whose
        kernels read them (a core_attention replaced by another module keeps its own)."""
        return self._sizes

    @sizes.setter
    def sizes(self, sizes: AttentionSizes):
        self._sizes = sizes
        if isinstance(self._modules.get("core_attention"), CoreAttention):
            self.core_attention.sizes = sizes

    num_key_value_groups = property(lambda self: self.sizes.groups)
    scaling = property(lambda self: self.sizes.head_dim ** -0.5)
    # The original's size attributes (per rank under tensor parallelism, as its "per partition" names say).
    num_attention_heads_per_partition = property(lambda self: self.sizes.num_heads)
    hidden_size_per_attention_head = property(lambda self: self.sizes.head_dim)
    num_multi_query_groups_per_partition = property(lambda self: self.sizes.num_kv_heads)
    projection_size = property(lambda self: self.sizes.num_heads * self.sizes.head_dim)
    qkv_hidden_size = property(lambda self: self.sizes.qkv_features)
    multi_query_attention = property(lambda self: self.sizes.multi_query)

    def split_heads(self, mixed: torch.Tensor):
        """Fused projection [batch, seq, qkv] -> q [batch, heads, seq, dim], k and v [batch, kv_heads, seq, dim]."""
        s = self.sizes
        if s.multi_query:
            q, k, v = mixed.split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim,
                                   s.num_kv_heads * s.head_dim], dim=-1)
            q, k, v = (t.unflatten(-1, (-1, s.head_dim)) for t in (q, k, v))
        else:
            q, k, v = mixed.unflatten(-1, (s.num_heads, 3 * s.head_dim)).split(s.head_dim, dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def rotated_heads(self, mixed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """split_heads with the query and key turned on the rotary tables. In the grouped layout [q | k | v] the
        queries and keys are one slice, turned at once: four operators a layer, not eight. The key and value get
        their own memory: as views they would keep the queries, or the whole projection, alive in a cache."""
        s = self.sizes
        if not s.multi_query:
            query, key, value = self.split_heads(mixed)
            return apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value.contiguous()
        heads, value = mixed.split([(s.num_heads + s.num_kv_heads) * s.head_dim, s.num_kv_heads * s.head_dim], dim=-1)
        # [batch, seq, heads, dim]: the tables' head axis moves beside the heads
        heads = apply_rotary(heads.unflatten(-1, (-1, s.head_dim)), cos.transpose(1, 2), sin.transpose(1, 2))
        query, key = heads.transpose(1, 2).split([s.num_heads, s.num_kv_heads], dim=1)
        return query, key.contiguous(), value.unflatten(-1, (-1, s.head_dim)).transpose(1, 2).contiguous()

    @takes_our_values
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

    def cached(self, key, value, kv_cache, use_cache: bool, cache_position):
        """The keys and values to attend to, and the cache to return (see the class's docstring)."""
        if isinstance(kv_cache, Cache):
            # The cache keeps this layer's keys on this layer's device. cache_position: static caches before 5.0.
            key, value = kv_cache.update(key, value, self.layer_idx, {"cache_position": cache_position})
            return key, value, (kv_cache if use_cache else None)
        if kv_cache is not None:
            key, value = torch.cat((kv_cache[0], key), dim=2), torch.cat((kv_cache[1], value), dim=2)
            return key, value, ((key, value) if use_cache else None)
        return key, value, (torch.stack((key, value))[None] if use_cache else None)

    def from_original(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache):
        """This file's values from the original's: its rotary rows, its mask (True where a query must NOT look)."""
        batch, new = hidden_states.shape[:2]
        if rotary_pos_emb is None:  # the original rotates nothing then
            rotary_pos_emb = torch.stack((torch.ones(1, new, self.sizes.head_dim // 4), torch.zeros(
                1, new, self.sizes.head_dim // 4)), -1).to(hidden_states.device)
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
        """SwiGLU of x = [gate | up], under the original's name (a patch of it reaches forward, as there)."""
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
        # The original's arithmetic: normalised in fp32, times the weight in fp32, rounded once to the input's dtype.
        # torch's rms_norm does it in one call where both are fp32, and in a half type where it rounds once
        # (rms_norm_rounds_once); otherwise the fp32 product stays apart.
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
    """One layer: forward(hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True) ->
    (hidden_states, kv_cache), the original's contract, its arguments handed to SelfAttention as they come. Under
    gradient checkpointing it recomputes itself in the backward pass (GradientCheckpointingLayer): hidden_states
    stay the first positional argument; the cache comes as `kv_cache`, a name no release's checkpointing drops (a
    checkpointed layer still reads a P-tuning v2 prefix through it, PrefixOnlyCache)."""

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
        """With fp32_residual_connection the residual stream stays fp32 and each norm feeds its sublayer in the
        sublayer's dtype."""
        out = norm(hidden_states)
        return out.to(norm.weight.dtype) if self.fp32_residual_connection else out

    @takes_our_values
    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        normed = self.norm(self.input_layernorm, hidden_states)
        residual = normed if self.apply_residual_connection_post_layernorm else hidden_states
        if forward_replaced(self.self_attention):
            attention_mask, rotary_pos_emb = as_original_call(normed, attention_mask, rotary_pos_emb)
        # The attention output is rebound to the sum at once, not kept alive through the MLP (peak memory).
        hidden_states, kv_cache = self.self_attention(normed, attention_mask, rotary_pos_emb, kv_cache=kv_cache,
                                                      use_cache=use_cache)
        hidden_states = residual + self.dropout(hidden_states)

        normed = self.norm(self.post_attention_layernorm, hidden_states)
        residual = normed if self.apply_residual_connection_post_layernorm else hidden_states
        hidden_states = residual + self.dropout(self.mlp(normed))
        return hidden_states, kv_cache

    def dropout(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0:  # no operator at all in inference (one less per sublayer)
            return hidden_states
        return F.dropout(hidden_states, p=self.hidden_dropout, training=True)


class GLMTransformer(nn.Module):
    """The stack of blocks (the original's `encoder`), with the final norm. forward(hidden_states, attention_mask,
    rotary_pos_emb, kv_caches=None, use_cache=True, output_hidden_states=False) -> (hidden_states, presents,
    all_hidden_states, all_self_attentions) and `_get_layer(i)` are the original's contract, and so is each layer's
    call (three positional arguments, `kv_cache=` and `use_cache=` by keyword): a forward written to the original
    (GPTQModel replaces it so) runs this model unchanged. With this file's values, `kv_caches` is the model's Cache
    object once per layer and `presents` what the layers give back (that object again); with the original's, the
    original's presents (one tensor after a prompt, pairs after cached steps). The hidden states of
    output_hidden_states end with the final norm's output, as in transformers' models; all_self_attentions are what
    the layers wrote into LayerInputs.attentions (None with the original's values, as in the original)."""

    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        self.num_layers = config.num_layers
        self.post_layer_norm = config.post_layer_norm
        self.fp32_residual_connection = config.fp32_residual_connection
        # The original's flag; each layer checkpoints itself (GradientCheckpointingLayer). transformers 4.x sets it
        # with the layers' when checkpointing is turned on or off.
        self.gradient_checkpointing = False
        self.layers = nn.ModuleList([GLMBlock(config, number + 1) for number in range(config.num_layers)])
        self.final_layernorm = make_norm(config) if config.post_layer_norm else None

    def _get_layer(self, layer_number: int) -> GLMBlock:
        return self.layers[layer_number]

    @takes_our_values
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
            hidden_states, kv_cache = layer(hidden_states, mask, rotary, kv_cache=kv_caches[index] if kv_caches else None,
                                            use_cache=use_cache)
            if use_cache:
                presents = gathered_presents(presents, kv_cache)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(device_boundary(hidden_states, execution_device(self.final_layernorm)))
        if output_hidden_states:
            all_hidden_states += (hidden_states,)
        weights = rotary_pos_emb[5] if isinstance(rotary_pos_emb, tuple) else None
        return hidden_states, presents, all_hidden_states, None if weights is None else tuple(weights)


def gathered_presents(presents, kv_cache):
    """The encoder's presents as the original gathers them: a layer's tensor (the original's format after a prompt)
    concatenated along the layers; a (keys, values) pair, or this file's Cache object, one more item."""
    if not isinstance(kv_cache, torch.Tensor):
        return presents + (kv_cache,)
    return kv_cache if isinstance(presents, tuple) else torch.cat((presents, device_boundary(kv_cache, presents.device)))


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
    # transformers 4.30's names, which its quantizers set on a quantized model: False until one does.
    is_loaded_in_4bit = is_loaded_in_8bit = is_quantized = False
    _supports_sdpa = True
    _supports_flash_attn_2 = True  # 4.x name
    _supports_flash_attn = True  # 5.x name
    _supports_cache_class = True  # 4.x: generate() hands us Cache objects
    _supports_static_cache = True
    # Attention kernels registered with transformers (AttentionInterface) run in every layer with the forward's extra
    # keyword arguments, and custom 4D masks are honoured (tests/test_attention.py).
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # static-cache decode compiles as one graph (tests/test_compile.py)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' from_pretrained, with an explicit device_map checked before any weight is read, and the
        loaded weights checked for NaN and inf (`check_finite_weights=False` skips that). With tp_plan="auto" (under
        torchrun), tp_size, device_mesh or distributed_config, the model is sharded by its own tensor-parallel plan
        instead, on every supported transformers release (parallel_chatglm.py)."""
        check_finite = kwargs.pop("check_finite_weights", True)
        if any(kwargs.get(name) is not None for name in ("tp_plan", "tp_size", "device_mesh", "distributed_config")):
            config = cls._config_for(pretrained_model_name_or_path, kwargs)
            parallel = import_companion("parallel_chatglm", config, checkpoint=str(pretrained_model_name_or_path))
            parallel.check_shardable(config)  # before torchrun's environment is asked for

            def load_checked(*args, **load_kwargs):  # every rank checks the whole weights it read, before sharding
                loaded = super(ChatGLMPreTrainedModel, cls).from_pretrained(*args, **load_kwargs)
                if check_finite:
                    check_finite_weights(loaded[0] if isinstance(loaded, tuple) else loaded,
                                         pretrained_model_name_or_path)
                return loaded

            return parallel.from_pretrained_tensor_parallel(
                load_checked, pretrained_model_name_or_path, *model_args, **kwargs
            )
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict):
            check_devices_exist(device_map)
            with torch.device("meta"):
                check_device_map(cls(cls._config_for(pretrained_model_name_or_path, kwargs)), device_map)
        if pretrained_model_name_or_path is not None and os.path.isdir(os.fspath(pretrained_model_name_or_path)):
            check_prefix_checkpoint(pretrained_model_name_or_path, cls._config_for(pretrained_model_name_or_path,
                                                                                   kwargs), kwargs)
        with_info = kwargs.pop("output_loading_info", False)
        checked = check_stored_dtypes(pretrained_model_name_or_path, kwargs,
                                      lambda: cls(cls._config_for(pretrained_model_name_or_path, kwargs)))
        model, info = super().from_pretrained(pretrained_model_name_or_path, *model_args, output_loading_info=True,
                                              **kwargs)
        if not checked:  # downloaded by this call
            check_stored_dtypes(pretrained_model_name_or_path, kwargs, model)
        check_loaded_weights(model, info, pretrained_model_name_or_path)
        check_one_float_width(model)
        settle_loaded_prefix(model, info)
        if check_finite:
            check_finite_weights(model, pretrained_model_name_or_path)
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.own_loaded_buffer()
        if _TIED_KEYS_ARE_A_MAPPING and getattr(model.config, "tie_word_embeddings", False):
            # 5.x leaves a checkpoint's two stored matrices untied (with a warning) even when the config asks for
            # tying; 4.x ties them, the input embedding winning. from_pretrained(..., tie_word_embeddings=True) ties.
            model.tie_weights()
        if weight_storage(model.config) != "float":
            model.use_quantized_kernel("auto")
        return (model, info) if with_info else model

    if _HAS_ACTIVATION_CHECKPOINTING:

        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, *args, **kwargs):
            """transformers' activation checkpointing (the Trainer calls it with every_n_layers and offload;
            gradient_checkpointing_enable() is transformers' alias of it here)."""
            super().activation_checkpointing_enable(
                prefix_checkpointing_kwargs(self, activation_checkpointing_kwargs), *args, **kwargs)

    else:

        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, *args, **kwargs):
            """transformers' gradient checkpointing."""
            super().gradient_checkpointing_enable(
                prefix_checkpointing_kwargs(self, gradient_checkpointing_kwargs), *args, **kwargs)

    def load_prefix_encoder(self, path) -> str:
        """Load a P-tuning v2 prefix saved apart from the base model (a file or a folder: the ChatGLM2/3 ptuning
        trainer's checkpoint, save_prefix_encoder's output, a whole checkpoint, or a PEFT prefix-tuning adapter).
        Returns the file read; a prefix trained for another config fails naming the file and the shapes."""
        return load_prefix_file(require_prefix(self), path)

    def save_prefix_encoder(self, save_directory) -> str:
        """Write the P-tuning v2 prefix alone, the classic layout: `model.safetensors` holding
        `transformer.prefix_encoder.*` (full names), as the ChatGLM2/3 ptuning trainer saved it."""
        from safetensors.torch import save_file

        encoder = require_prefix(self)
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, "model.safetensors")
        save_file({PREFIX_KEY + name: tensor.detach().contiguous().cpu() for name, tensor in encoder.state_dict().items()},
                  path, metadata={"format": "pt"})
        return path

    @classmethod
    def _config_for(cls, pretrained_model_name_or_path, kwargs) -> ChatGLMConfig:
        """The config from_pretrained will use: the one passed, else the checkpoint's, read with this class's config
        class (ours, or the original one beside a copied modeling_chatglm.py)."""
        config = kwargs.get("config")
        if isinstance(config, transformers.PretrainedConfig):  # 5.x: AutoConfig's class is another module's copy
            return config
        config = cls.config_class.from_pretrained(
            pretrained_model_name_or_path,
            **{k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs},
        )
        # Where the code files come from, as from_pretrained records it (config.json may name another repository):
        # GLM-4V's model, built for the device-map check, imports visual.py from there.
        config._name_or_path = str(pretrained_model_name_or_path)
        return config

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save_pretrained, which writes the code files it saw imported; the companion files are
        written beside them, so that the saved folder keeps every capability."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if self._auto_class is None or not kwargs.get("is_main_process", True):
            return
        for name in COMPANION_FILES:
            found, target = find_companion(name, self.config), Path(save_directory) / f"{name}.py"
            if found is not None and not (target.exists() and target.samefile(found)):
                shutil.copyfile(found, target)

    def use_quantized_kernel(self, kernel: str = "packed") -> int:
        """A pre-quantized (int4 or int8) model's matrix kernel (quantization_chatglm.py): "packed", torch's int4 or
        int8 weight-only kernel on bf16 activations for decode (the default in bf16/fp16 models, where torch has it
        for the device; an opt-in in fp32, docs/quantized-checkpoints.md: its deviation), "exact" (the original's arithmetic), "auto" (what
        from_pretrained chose). A move to another device keeps the choice (the layers pack again there). Returns how
        many layers run packed."""
        if weight_storage(self.config) == "float":
            raise ValueError(
                f"use_quantized_kernel({kernel!r}): this model's weights are not pre-quantized (quantization_bit="
                f"{self.config.quantization_bit}); it applies to checkpoints such as chatglm2-6b-int4.")
        packed = import_companion("quantization_chatglm", self.config).use_kernel(self, kernel, self.dtype)
        if kernel == "packed" and not packed:
            raise ValueError(
                f"use_quantized_kernel('packed'): torch {torch.__version__} has no int{self.config.quantization_bit} "
                f"kernel for {self.device.type} that takes this model's quantized layers: use 'exact', or a newer "
                "torch.")
        return packed

    def use_cpu_packed_weights(self, enable: bool = True) -> int:
        """Opt-in for bf16/fp16 decode on a CPU: each float nn.Linear also holds its weight in oneDNN's blocked layout
        (quantization_chatglm.OneDnnLinear), which calls of up to 32 rows without autograd multiply by; one bf16 row
        takes torch's matrix-vector kernel instead, and no copy. Both read the weights 1.1-1.2x as fast as the eager
        product on the benchmark's AVX-512 BF16 CPU, within the dtype's rounding of it (docs/speed-and-memory.md:
        measured). The copy costs those weights' bytes again; the parameters and the state dict stay as they are.
        False drops the copies. Returns how many layers take these paths."""
        return import_companion("quantization_chatglm", self.config).use_cpu_packed_weights(self, enable)

    def tensor_parallel(self, mesh_or_size=None):
        """Shard this model in place over a 1-D DeviceMesh, or over `mesh_or_size` ranks of torch.distributed (all of
        them by default); every rank calls it. See parallel_chatglm.py."""
        return import_companion("parallel_chatglm", self.config).tensor_parallel(self, mesh_or_size)

    # The original's mask and position helpers, for code that calls them: this model's forward builds its own.
    def get_masks(self, input_ids, past_key_values, padding_mask=None):
        """The original's attention mask [batch, 1, seq, past + seq], True where a query must not look: causal,
        every cached slot visible, and a 2-D `padding_mask` (1 = token) applied to the keys (and, for a prompt,
        its padded queries see everything, as in the original)."""
        batch_size, seq_length = input_ids.shape[:2]  # GLM-4V's original passes the embeddings here
        return original_attention_mask(padding_mask, batch_size, seq_length, cached_length_of(past_key_values),
                                       input_ids.device)

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
    # The output layer lives in the base model (the original's layout); tied to the embedding only when
    # config.tie_word_embeddings (false in every released checkpoint).
    _tied_weights_keys = tied_weights_keys("output_layer.weight", "embedding.word_embeddings.weight")

    def __init__(self, config: ChatGLMConfig, empty_init=True, device=None):
        # empty_init and device are the original constructor's arguments, accepted so that calling code keeps
        # working: from_pretrained already skips initialising loaded weights, and `device` places the model.
        super().__init__(config)
        check_supported(config)
        # The original's size attributes (P-tuning and export scripts read them here).
        self.num_layers, self.kv_channels, self.seq_length = config.num_layers, config.kv_channels, config.seq_length
        self.multi_query_group_num = config.multi_query_group_num
        self.pre_seq_len = getattr(config, "pre_seq_len", None)
        self.prefix_projection = getattr(config, "prefix_projection", False)
        self.embedding = Embedding(config)
        self.rotary_pos_emb = RotaryEmbedding(config)
        self.encoder = GLMTransformer(config)
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.prefix_encoder = PrefixEncoder(config) if prefix_slots(config) else None  # P-tuning v2 (own section)
        # GLM-4V (glm-4v-9b): the EVA2-CLIP vision tower of visual.py, whose image rows enter through `splice`.
        self.vision = vision_tower(config) if getattr(config, "vision_config", None) else None
        train_prefix_only(self)
        self.post_init()
        if device is not None:
            self.to(device)

    # transformers 4.46 to 4.52 look for it here (see the compatibility layer).
    _prepare_4d_causal_attention_mask_with_cache_position = staticmethod(static_cache_mask_before_4_53)

    def get_input_embeddings(self):
        return self.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.embedding.word_embeddings = value

    def get_prompt(self, batch_size, device, dtype=torch.float16):
        """The P-tuning v2 prefix as past_key_values: per layer [2, batch, kv_heads, pre_seq_len, head_dim] (key,
        value), the layout of GLM-4's original and of transformers' legacy caches (ChatGLM2/3's original put the
        prefix length first). This model's forward adds the prefix itself: pass none."""
        key_values = require_prefix(self).key_values(batch_size, dtype)
        return tuple(device_boundary(torch.stack(pair), torch.device(device)) for pair in key_values)

    def quantize(self, weight_bit_width: int, storage: str = "library"):
        """The original's base-model call: quantizes the blocks' linear layers (see ChatMixin.quantize)."""
        return quantize_blocks(self, weight_bit_width, storage)

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values=None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        images: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        **kwargs,
    ):
        """`images` (GLM-4V): pixels [batch, 3, S, S], one image per sequence, spliced in where its ids hold
        <|begin_of_image|>; `attention_mask` and `position_ids` then stay in tokens, as the tokenizer makes them.
        `cache` is transformers 5.24's name for `past_key_values` (pass one of the two).
        Keyword arguments the model does not read go to the attention kernel (attention backends pass theirs so)."""
        past_key_values = caller_cache(past_key_values, cache)
        # self.config, not a local name: llm-compressor's rewrite of this forward resolves `self.config.x` when it
        # rewrites it; a config held in a local variable becomes a value of its traced graph, which it cannot keep
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
        # The original's call of its encoder, with this file's values ("Module contracts"): the kernel's mask, the
        # rotary tables and the kernel as `rotary_pos_emb` (LayerInputs), the Cache object as every layer's cache.
        rotary = layer_inputs
        if forward_replaced(self.encoder):  # a tool's encoder forward (GPTQModel's), written to the original
            mask, rotary = as_original_call(inputs_embeds, mask, layer_inputs)
        kv_caches = None if prefix.cache is None else (prefix.cache,) * self.encoder.num_layers
        hidden_states, _, all_hidden_states, all_attentions = self.encoder(
            inputs_embeds, mask, rotary_pos_emb=rotary, kv_caches=kv_caches, use_cache=use_cache,
            output_hidden_states=output_hidden_states,
        )
        if self.config.fp32_residual_connection:
            hidden_states = hidden_states.to(self.compute_dtype)
        outputs = BaseModelOutputWithPast(
            last_hidden_state=hidden_states, **cache_output(cache_to_return(cache, use_cache, legacy)),
            hidden_states=all_hidden_states, attentions=all_attentions,
        )
        if not return_dict:  # (a statement: llm-compressor's rewrite would make the expression a value of its graph)
            return outputs.to_tuple()
        return outputs

    def cache_in_use(self, use_cache: Optional[bool]) -> bool:
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if self.training and use_cache and any(layer.gradient_checkpointing for layer in self.encoder.layers):
            return False  # checkpointed layers run twice; a cache would be filled twice
        return use_cache

    def embed(self, input_ids, inputs_embeds, attention_mask, past_length):
        """The embeddings of input_ids (or inputs_embeds as given). Values are checked where it costs no device sync
        per decode step: tensors on the CPU, or the prompt."""
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
        """The kernel's mask, and the rotary tables and kernel arguments of every layer. Query positions are cache
        slots (after any P-tuning v2 prefix); position ids and a 2-D mask count tokens only."""
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
        """The layers' rotary cos/sin, computed on the rotary module's device for the positions in use. A forward a
        tool put in rotary_pos_emb's place is called as the original calls it, `rotary_pos_emb(seq_length)`, and
        its table's rows are what the layers turn with."""
        rotary = self.rotary_pos_emb
        position_ids = device_boundary(position_ids, execution_device(rotary))
        if forward_replaced(rotary):
            rows = rotary(self.seq_length)[position_ids].float()
            return head_tables(rows[..., 0], rows[..., 1], rotary.head_dim, self.compute_dtype)
        cos, sin = rotary(position_ids)
        return cos.to(self.compute_dtype), sin.to(self.compute_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the hidden states: the embedding's. Not read from a Linear layer, which a quantizer
        (torch.ao, torchao, quanto, bitsandbytes) may have replaced by one without a float `weight`."""
        return self.embedding.word_embeddings.weight.dtype

    @staticmethod
    def default_position_ids(attention_mask, query_positions, query_length):
        """Positions count real tokens only, so a left-padded sequence gets the positions it has alone."""
        if attention_mask is None or attention_mask.dim() != 2:
            return query_positions
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -query_length:]


# ======================================================================================================================
# Companion files: code of optional capabilities, loaded on demand
# ======================================================================================================================


def code_source(config, checkpoint=None) -> Tuple[Optional[str], Optional[str]]:
    """Where this code came from, as transformers resolved it: the repository an `auto_map` entry names
    ("org/repo--modeling_chatglm.X"), else the checkpoint itself (`checkpoint` when from_pretrained has not yet
    recorded it in the config); and the commit of a Hub download."""
    source = None
    for reference in (getattr(config, "auto_map", None) or {}).values():
        reference = reference[0] if isinstance(reference, (list, tuple)) else reference
        if isinstance(reference, str) and "--" in reference:
            source = reference.split("--")[0]
            break
    source = source or checkpoint or getattr(config, "_name_or_path", None) or None
    commit = (__package__ or "").rsplit(".", 1)[-1]
    return source, commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None


# Files of this repository used only by an optional capability, loaded on demand: tensor parallelism, GLM-4V's
# vision tower (visual.py, for a config with vision_config), pre-quantized weights (a config with quantization_bit).
COMPANION_FILES = ("parallel_chatglm", "visual", "quantization_chatglm")


def find_companion(name: str, config=None, checkpoint=None) -> Optional[Path]:
    """`name`.py beside this module, else where this code came from (the checkpoint folder, or the Hub repository at
    the same commit): transformers copies into its modules cache only the files it finds imported."""
    beside = Path(__file__).with_name(f"{name}.py")
    if beside.exists():
        return beside
    source, revision = code_source(config, checkpoint) if config is not None else (checkpoint, None)
    if not source:
        return None
    from transformers.utils import cached_file

    try:
        found = cached_file(source, f"{name}.py", revision=revision, _raise_exceptions_for_missing_entries=False)
    except (OSError, ValueError):
        return None
    return Path(found) if found else None


def import_companion(name: str, config=None, checkpoint=None):
    """Import a companion file (see COMPANION_FILES).

    Not written as a relative import: transformers requires every file that a remote-code module imports relatively
    to sit beside it, even an import inside a function, which would break this file copied alone over an original
    checkpoint. A companion that cannot be found raises an error that says which file to copy."""
    module_name = f"{__package__}.{name}" if __package__ else name
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
    found = find_companion(name, config, checkpoint) if __package__ else None
    if found is None:
        source = code_source(config, checkpoint)[0] if config is not None else checkpoint
        raise ImportError(
            f"This needs {name}.py beside modeling_chatglm.py{f' (looked in {source})' if source else ''}: copy it "
            "from the maintained ChatGLM / GLM-4 repository into the checkpoint folder along with "
            "modeling_chatglm.py, or install all its files with tools/install_into_checkpoint.py."
        )
    shutil.copyfile(found, Path(__file__).with_name(found.name))
    importlib.invalidate_caches()
    return importlib.import_module(module_name)


# ======================================================================================================================
# P-tuning v2 prefix
# ======================================================================================================================


# ChatGLM2/3's P-tuning v2 (`pre_seq_len`, `prefix_projection` in config.json; weights `transformer.prefix_encoder.*`):
# a trained encoder gives every layer `pre_seq_len` key/value slots in front of the real tokens. As in the original,
# they are the first slots of the key/value cache, written unrotated by the first forward and seen by every query;
# the real tokens keep positions 0..n-1 and a 2-D attention_mask covers them alone. The core forward meets this section
# at one seam, `enter_prefix`. GLM-4's original configuration class has no such fields: they are read with getattr.

PREFIX_KEY = "transformer.prefix_encoder."


PREFIX_DROPOUT = 0.1  # the original's dropout on the prefix (train mode only)

def prefix_slots(config) -> int:
    """config.pre_seq_len as a number of prefix slots; 0 without a prefix."""
    value = getattr(config, "pre_seq_len", None)
    if value is None or value == 0:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"config.pre_seq_len must be a positive integer (the P-tuning v2 prefix length) or null, got {value!r}."
        )
    return value


class PrefixEncoder(nn.Module):
    """The original's `transformer.prefix_encoder`: `embedding` [pre_seq_len, 2 * layers * kv_heads * head_dim], with
    `prefix_projection` followed by `trans` (Linear to hidden_size, Tanh, Linear back). Viewed [2 * layers, kv_heads,
    head_dim], row 2l of a slot is layer l's key and row 2l + 1 its value. Without multi-query attention every head
    has its own key/value (the original sized the prefix by multi_query_group_num there, and crashed)."""

    def __init__(self, config: ChatGLMConfig):
        super().__init__()
        sizes = AttentionSizes.from_config(config)
        self.pre_seq_len = prefix_slots(config)
        self.num_layers, self.kv_heads, self.head_dim = config.num_layers, sizes.num_kv_heads, sizes.head_dim
        kv_size = 2 * self.num_layers * self.kv_heads * self.head_dim
        self.embedding = nn.Embedding(self.pre_seq_len, kv_size)
        if getattr(config, "prefix_projection", False):
            self.trans = nn.Sequential(
                nn.Linear(kv_size, config.hidden_size), nn.Tanh(), nn.Linear(config.hidden_size, kv_size)
            )
        else:
            self.trans = None
        self.dropout = nn.Dropout(PREFIX_DROPOUT)

    def forward(self, prefix: torch.Tensor) -> torch.Tensor:
        """prefix: slot indices [batch, n] -> [batch, n, 2 * layers * kv_heads * head_dim] (the original's call)."""
        embedded = self.embedding(prefix)
        return embedded if self.trans is None else self.trans(embedded)

    def key_values(self, batch_size: int, dtype: torch.dtype) -> list:
        """Each layer's prefix as (key, value), [batch, kv_heads, pre_seq_len, head_dim], in `dtype` (the encoder may
        stay fp32 in a half-precision model, as the original ptuning scripts kept it)."""
        slots = torch.arange(self.pre_seq_len, device=execution_device(self))
        prefix = self(slots[None]).to(dtype).expand(batch_size, -1, -1)
        prefix = self.dropout(prefix).unflatten(-1, (2 * self.num_layers, self.kv_heads, self.head_dim))
        prefix = prefix.permute(2, 0, 3, 1, 4)  # [2 * layers, batch, kv_heads, slots, head_dim]
        return [(prefix[2 * layer], prefix[2 * layer + 1]) for layer in range(self.num_layers)]

    def describe(self) -> str:
        kv_size = self.embedding.weight.shape[1]
        return (f"pre_seq_len={self.pre_seq_len}, prefix_projection={self.trans is not None}, embedding.weight "
                f"[pre_seq_len, 2 x {self.num_layers} layers x {self.kv_heads} key/value heads x head size "
                f"{self.head_dim}] = [{self.pre_seq_len}, {kv_size}]")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The classic recipe's call; a prefix trained for another config fails with the shapes expected and found."""
        check_prefix_state(self, state_dict, "the state dict given to prefix_encoder.load_state_dict")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def check_prefix_state(encoder: PrefixEncoder, state_dict: dict, source: str):
    """Refuse prefix tensors trained for another pre_seq_len, depth, key/value heads, head size or projection."""
    expected = {name: list(tensor.shape) for name, tensor in encoder.state_dict().items()}
    found = {name: list(tensor.shape) for name, tensor in state_dict.items()}
    problems = [f"{name} has shape {found[name]}, expected {shape}"
                for name, shape in expected.items() if name in found and found[name] != shape]
    if any(name.startswith("trans.") for name in found) != (encoder.trans is not None):
        problems.append("it was saved " + ("without" if encoder.trans is not None else "with")
                        + " prefix_projection (trans.* weights)")
    if problems:
        raise ValueError(
            f"{source} does not fit this model's P-tuning v2 prefix encoder: {'; '.join(problems)}. This model "
            f"expects {encoder.describe()}. Set pre_seq_len and prefix_projection in the config to the values the "
            "prefix was trained with (the base model must be the one it was trained on)."
        )


PREFIX_FILES = ("adapter_model.safetensors", "adapter_model.bin") + MODEL_FILES

def read_prefix_file(path, names=PREFIX_FILES, shapes_only: bool = False) -> Tuple[dict, str]:
    """The prefix encoder's tensors (names without `transformer.prefix_encoder.`; empty meta tensors with
    `shapes_only`) and the file that holds them. `path` is a safetensors or torch file, or a folder holding one of
    `names`: the ChatGLM2/3 ptuning trainer's checkpoint, a whole or sharded checkpoint, `save_prefix_encoder`'s output,
    or a PEFT prefix-tuning adapter, whose `prompt_embeddings` are the embedding of an encoder without projection."""
    path = os.fspath(path)
    if os.path.isdir(path):
        present = [os.path.join(path, name) for name in names if os.path.isfile(os.path.join(path, name))]
        if not present:
            raise FileNotFoundError(f"{path} holds none of {', '.join(names)}: no P-tuning v2 prefix to load.")
        path = present[0]
    files = [path]
    if path.endswith(".index.json"):
        files = [os.path.join(os.path.dirname(path), shard)
                 for shard in index_shards(path, lambda key: key.startswith(PREFIX_KEY))]

    def wanted(name):
        return name.startswith(PREFIX_KEY) or name == "prompt_embeddings"

    tensors = {}
    for file in files:
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            read_safetensors_header(file)  # a damaged file is named (safetensors' own error names none)
            with safe_open(file, "pt") as weights:
                for name in filter(wanted, weights.keys()):
                    tensors[name] = (torch.empty(weights.get_slice(name).get_shape(), device="meta") if shapes_only
                                     else weights.get_tensor(name))
        else:  # mmap: a whole-model shard is not read for its prefix
            weights = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            tensors.update({name: tensor for name, tensor in weights.items() if wanted(name)})
    state = {name[len(PREFIX_KEY):]: tensor for name, tensor in tensors.items() if name.startswith(PREFIX_KEY)}
    if not state and "prompt_embeddings" in tensors:
        state = {"embedding.weight": tensors["prompt_embeddings"]}
    return state, (files[0] if len(files) == 1 else path)


def load_prefix_file(encoder: PrefixEncoder, path) -> str:
    state, file = read_prefix_file(path)
    if not state:
        raise ValueError(f"{file} holds no {PREFIX_KEY}* tensors (nor PEFT prompt_embeddings): it is not a P-tuning "
                         "v2 prefix.")
    check_prefix_state(encoder, state, file)
    encoder.load_state_dict(state)
    return file


def check_prefix_checkpoint(folder, config, kwargs: dict):
    """Before from_pretrained reads a local checkpoint: prefix weights that do not fit the config (with
    from_pretrained's `kwargs` applied) fail here, naming the file (transformers would name neither the file nor
    pre_seq_len)."""
    config = prefix_config(config, kwargs)
    if not prefix_slots(config):
        return
    try:
        found, file = read_prefix_file(folder, MODEL_FILES, shapes_only=True)
    except FileNotFoundError:  # weights in a subfolder or another format: transformers' own checks apply
        return
    if found:
        with torch.device("meta"):
            check_prefix_state(PrefixEncoder(config), found, file)


PREFIX_SHAPE_FIELDS = ("pre_seq_len", "prefix_projection", "num_layers", "num_attention_heads", "multi_query_attention",
                       "multi_query_group_num", "kv_channels", "hidden_size")

def prefix_config(config, kwargs: dict):
    """The config from_pretrained builds, as far as the prefix's shapes go: a passed `config`, or the checkpoint's
    with from_pretrained's overrides (pre_seq_len=N, ...)."""
    if kwargs.get("config") is None:
        for name in PREFIX_SHAPE_FIELDS:
            if name in kwargs:
                setattr(config, name, kwargs[name])
    return config


def require_prefix(model: nn.Module) -> PrefixEncoder:
    encoder = getattr(model.base_model, "prefix_encoder", None)
    if encoder is None:
        raise ValueError(
            "This model has no P-tuning v2 prefix (config.pre_seq_len is not set). Load it with the prefix length it "
            "was trained with, e.g. AutoConfig.from_pretrained(base, trust_remote_code=True, pre_seq_len=128) and "
            "from_pretrained(base, config=config, trust_remote_code=True)."
        )
    return encoder


def prefix_length(model: nn.Module) -> int:
    """The prefix slots of a model (the base model or a head): pre_seq_len, or 0 without a prefix."""
    encoder = getattr(model.base_model, "prefix_encoder", None)
    return encoder.pre_seq_len if encoder is not None else 0


def cached_prefix(model: "ChatGLMModel", past) -> int:
    """How many of `past` cached slots are prefix: pre_seq_len once a forward wrote them (an empty cache has none)."""
    return prefix_length(model) if not (isinstance(past, int) and past == 0) else 0


@dataclass(frozen=True)
class PrefixEntry:
    """What the core forward gets from this section (enter_prefix): the cache the layers use, the `slots` a prefix
    takes at its start (0 without one: then every method is the identity), and the slots cached before this step's
    tokens, prefix included."""

    cache: Optional[Cache]
    slots: int
    past_slots: Union[int, torch.Tensor]

    def extend_mask(self, attention_mask):
        """A 2-D mask covers the tokens; every query also sees the prefix slots in front of them."""
        if not self.slots or attention_mask is None or attention_mask.dim() != 2:
            return attention_mask
        return torch.cat([attention_mask.new_ones(attention_mask.shape[0], self.slots), attention_mask], -1)


def enter_prefix(model: "ChatGLMModel", cache: Optional[Cache], past_length, batch_size: int, query_length: int
                 ) -> PrefixEntry:
    """The seam into the core forward. An empty cache gets the prefix written first, each layer's slots on that
    layer's device; a cache that is not empty holds it already (an earlier call wrote it); without a cache the layers
    get a PrefixOnlyCache."""
    encoder = model.prefix_encoder
    if encoder is None:
        return PrefixEntry(cache, 0, past_length)
    slots = encoder.pre_seq_len
    if cache is not None and not cache_is_empty(cache):
        return PrefixEntry(cache, slots, past_length)
    room = max_cache_length(cache) if cache is not None else None
    if room is not None and slots + query_length > room:
        raise ValueError(
            f"The static cache has {room} slots; the P-tuning v2 prefix takes pre_seq_len={slots} of them before the "
            f"{query_length} tokens. Build it with max_cache_len >= {slots + query_length} plus the tokens to "
            "generate (generate(cache_implementation='static') does this itself)."
        )
    devices = [execution_device(layer) for layer in model.encoder.layers]
    key_values = [(device_boundary(key, device), device_boundary(value, device))
                  for (key, value), device in zip(encoder.key_values(batch_size, model.compute_dtype), devices)]
    if cache is None:
        cache = PrefixOnlyCache(model.config, key_values)
    else:
        for index, ((key, value), device) in enumerate(zip(key_values, devices)):
            cache.update(key, value, index, {"cache_position": torch.arange(slots, device=device)})
    return PrefixEntry(cache, slots, cache.get_seq_length())


def train_prefix_only(model: "ChatGLMModel"):
    """As in the original, a model with a prefix trains the prefix alone: every other weight of the base model is
    frozen when it is built or loaded. `model.requires_grad_(True)` (or on chosen modules) trains more."""
    if model.prefix_encoder is not None:
        model.requires_grad_(False)
        model.prefix_encoder.requires_grad_(True)


def prefix_checkpointing_kwargs(model: nn.Module, kwargs: Optional[dict]) -> Optional[dict]:
    """The keyword arguments for torch.utils.checkpoint: as given without a prefix. The prefix reaches the layers
    through the cache, which reentrant checkpointing does not see as an input: no gradient would reach the prefix
    encoder. With a prefix, checkpointing is non-reentrant."""
    if not prefix_length(model):
        return kwargs
    kwargs = dict(kwargs or {})
    if kwargs.get("use_reentrant"):
        raise ValueError(
            "gradient_checkpointing_kwargs={'use_reentrant': True} cannot train a P-tuning v2 prefix (it reaches the "
            "layers through the cache, which reentrant checkpointing does not differentiate). Leave use_reentrant "
            "unset or False."
        )
    kwargs["use_reentrant"] = False
    return kwargs


def settle_loaded_prefix(model: nn.Module, loading_info: dict):
    """After from_pretrained: the prefix alone trains (5.x loads weights as new, trainable Parameters), and a prefix
    left random, or prefix weights the config ignores, are said, not silent."""
    train_prefix_only(model.base_model)
    encoder = getattr(model.base_model, "prefix_encoder", None)
    missing = [name if isinstance(name, str) else name[0]  # 4.44 lists mismatches as (name, shapes...)
               for key in ("missing_keys", "mismatched_keys") for name in loading_info.get(key, ())]
    missing = [name for name in missing if "prefix_encoder." in name]
    unexpected = [name for name in loading_info.get("unexpected_keys", ()) if "prefix_encoder." in name]
    if encoder is not None and missing:
        warnings.warn(
            f"The checkpoint holds no P-tuning v2 prefix weights ({', '.join(missing)}): the prefix of "
            f"pre_seq_len={encoder.pre_seq_len} is random, as at the start of P-tuning. To use a trained prefix, load "
            "it: model.load_prefix_encoder(path) or model.transformer.prefix_encoder.load_state_dict(...).",
            stacklevel=3,
        )
    if encoder is None and unexpected:
        warnings.warn(
            f"The checkpoint holds P-tuning v2 prefix weights ({', '.join(unexpected)}) but config.pre_seq_len is not "
            "set: the prefix is ignored and the base model runs. Load with pre_seq_len (and prefix_projection) as "
            "trained, e.g. from_pretrained(path, trust_remote_code=True, pre_seq_len=N).",
            stacklevel=3,
        )


# ======================================================================================================================
# GLM-4V vision
# ======================================================================================================================


# GLM-4V (glm-4v-9b): the EVA2-CLIP vision tower lives in visual.py, a companion file loaded only for a config with
# vision_config. It imports nothing of this file: what it needs of the language model is handed to it here.


def vision_tower(config) -> nn.Module:
    """GLM-4V's vision tower, from this repository's visual.py (glm-4v-9b ships a visual.py of its own)."""
    visual = import_companion("visual", config)
    if not hasattr(visual, "LanguageModelCallbacks"):
        raise ImportError(
            f"{visual.__file__} is not this repository's visual.py, or is an older one (glm-4v-9b's original has the "
            "same name): copy visual.py from the maintained ChatGLM / GLM-4 repository into the checkpoint folder "
            "along with modeling_chatglm.py (tools/install_into_checkpoint.py installs every file), and delete the "
            "stale copy if it sits in the transformers modules cache."
        )
    callbacks = visual.LanguageModelCallbacks(
        device_boundary=device_boundary, execution_device=execution_device,
        default_position_ids=ChatGLMModel.default_position_ids,
        image_rows_in_cache=image_rows_in_cache, record_image_rows=record_image_rows,
    )
    return visual.EVA2CLIPModel(config, callbacks)


def enter_vision(model: "ChatGLMModel", input_ids, inputs_embeds, images, position_ids, attention_mask, cache,
                 past_length):
    """The seam into the core forward: image rows in, the token-layout mask and positions mapped to rows
    (EVA2CLIPModel.splice). Returns (inputs_embeds, position_ids, attention_mask), unchanged for a text model."""
    if model.vision is not None:
        return model.vision.splice(input_ids, inputs_embeds, images, position_ids, attention_mask, cache, past_length)
    if images is not None:
        raise ValueError("images were given, but this model has no vision tower (its config has no vision_config): "
                         "load a GLM-4V checkpoint such as glm-4v-9b.")
    return inputs_embeds, position_ids, attention_mask


# ======================================================================================================================
# Chat helpers: the chat API of ChatGLM3 (and GLM-4) and of ChatGLM2 (chat, stream_chat, stream_generate,
# process_response, ChatGLM2's build_inputs / build_stream_inputs) and quantize(). `chat_format` picks the format.
# ======================================================================================================================


CHAT_ROLES = ("system", "user", "assistant", "observation")

class InvalidScoreLogitsProcessor(LogitsProcessor):
    """The originals' guard in chat(): scores that hold NaN or +inf (an fp16 overflow) become a valid distribution
    instead of failing in sampling. Masked (-inf) scores are valid and left alone."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if torch.isnan(scores).any() or torch.isposinf(scores).any():
            scores.zero_()
            scores[..., 5] = 5e4
        return scores


def checked_history(history) -> list:
    """A copy of a chat history: a list of {"role", "content"[, "metadata", "tools"]} dicts (ChatGLM3's format)."""
    if history is None:
        return []
    if not isinstance(history, (list, tuple)):
        raise ValueError(f"history must be a list of messages, got {type(history).__name__}.")
    for index, message in enumerate(history):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(
                f"history[{index}] must be a dict with 'role' and 'content' (ChatGLM3's format, as chat() returns "
                f"it), got {message!r}. (query, response) pairs are ChatGLM2's format: for a ChatGLM2 checkpoint "
                "load its tokenizer as ChatGLM2's, AutoTokenizer.from_pretrained(..., chatglm_family='chatglm2')."
            )
        if message["role"] not in CHAT_ROLES:
            raise ValueError(f"history[{index}] has role {message['role']!r}; the roles are {', '.join(CHAT_ROLES)}.")
    return [with_text_content(dict(message), index) for message in history]


def with_text_content(message: dict, index: int) -> dict:
    """The message with OpenAI-style content parts ([{"type": "text", "text": ...}, ...]) joined into its text, as
    chat templates that take parts read them (the text parts in order, nothing between them). A GLM chat template
    renders content as a string: a list would be written into the prompt as its Python repr."""
    parts = message.get("content")
    if not isinstance(parts, (list, tuple)):
        return message
    for number, part in enumerate(parts):
        where = f"history[{index}]['content'][{number}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"{where} is a {kind!r} part; chat() takes text parts only ({{'type': 'text', 'text': ...}}). "
                "GLM-4V (glm-4v-9b) takes an image as the message's 'image' (a PIL image), not as a content part."
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where} is a text part without a str 'text': {part!r:.100}.")
    message["content"] = "".join(part["text"] for part in parts)
    return message


def chat_stop_ids(tokenizer) -> list:
    """Generation stops at the end of text and where the model hands the turn back: `<|user|>`, `<|observation|>`."""
    return [tokenizer.eos_token_id, tokenizer.get_command("<|user|>"), tokenizer.get_command("<|observation|>")]


def chat_inputs(tokenizer, query: str, history: list, role: str, continuing: bool = False):
    """Model inputs for `history` + (`role`, `query`), ending where the assistant answers: ChatGLM3's
    `build_chat_input`, or the tokenizer's chat template (GLM-4). `continuing` (a cache holds the history): only the
    ids that follow the history, so that the cache and they make the whole conversation (new_turn_inputs)."""
    if role not in CHAT_ROLES:
        raise ValueError(f"role={role!r} is not a chat role; the roles are {', '.join(CHAT_ROLES)}.")
    if not isinstance(query, str):
        raise ValueError(f"query must be a str, got {type(query).__name__}.")
    if hasattr(tokenizer, "build_chat_input"):
        if not continuing:
            return dict(tokenizer.build_chat_input(query, history=history, role=role))
        # ChatGLM3's layout: get_prefix_tokens() ([gMASK] sop), then one block per message; the cache holds the
        # prefix and the history's blocks, the new message's block follows.
        prefix = len(tokenizer.get_prefix_tokens())
        return {name: value[:, prefix:] for name, value in tokenizer.build_chat_input(query, role=role).items()}
    inputs = dict(rendered_chat(tokenizer, history + [{"role": role, "content": query}], True))
    return new_turn_inputs(tokenizer, history, inputs) if continuing else inputs


def rendered_chat(tokenizer, messages: list, add_generation_prompt: bool):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                         return_tensors="pt", return_dict=True)


def new_turn_inputs(tokenizer, history: list, inputs: dict) -> dict:
    """The part of the whole conversation's inputs (`inputs`, rendered afresh) after what a cache of `history` holds:
    the history rendered alone, which must be where the whole rendering starts. Nothing about the template is
    assumed (a leading [gMASK]<sop>, a default system prompt it adds, how a turn ends). Without a history, the cache
    holds no message (a document, say, put there by the caller) and the whole rendering follows it. Images belong to
    the history's messages: their rows are in the cache."""
    inputs.pop("images", None)
    if not history:
        return inputs
    held = rendered_chat(tokenizer, history, False)["input_ids"][0]
    whole = inputs["input_ids"][0]
    same = torch.eq(whole[:len(held)], held[:len(whole)])
    if len(held) >= len(whole) or not bool(same.all()):
        parted = int((~same).nonzero()[0, 0]) if not bool(same.all()) else min(len(held), len(whole))
        raise ValueError(
            f"stream_chat(past_key_values=...) continues a cache that holds `history`, but this tokenizer's chat "
            f"template renders `history` followed by the new message differently from `history` alone (from id "
            f"{parted} on), so the new message's ids cannot be placed after the cache. Pass past_key_values=None: "
            "the whole conversation is then sent."
        )
    return {name: value[:, len(held):] for name, value in inputs.items()}


def checked_pairs(history) -> list:
    """A copy of a ChatGLM2 chat history: a list of (query, response) pairs, as ChatGLM2's chat() returns it."""
    if history is None:
        return []
    if not isinstance(history, (list, tuple)):
        raise ValueError(f"history must be a list of (query, response) pairs, got {type(history).__name__}.")
    for index, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ValueError(
                f"history[{index}] must be a (query, response) pair of str (ChatGLM2's format, as its chat() returns "
                f"it), got {pair!r:.100}. Role messages are ChatGLM3's format, which a ChatGLM2 tokenizer cannot "
                "encode."
            )
    return list(history)


def chatglm2_inputs(tokenizer, query: str, history: list):
    """ChatGLM2's prompt as model inputs: `tokenizer.build_prompt`'s rounds after [gMASK] sop (its build_inputs)."""
    build_prompt = getattr(tokenizer, "build_prompt", None)
    if build_prompt is None:
        raise ValueError(f"ChatGLM2's prompt comes from tokenizer.build_prompt, which {type(tokenizer).__name__} does "
                         "not have: pass the ChatGLM2 checkpoint's tokenizer.")
    return tokenizer([build_prompt(query, history=history)], return_tensors="pt")


def chatglm2_stream_inputs(tokenizer, query: str, history: list):
    """ChatGLM2's next round for a cache that holds the earlier ones (its build_stream_inputs): the round's text
    after a blank line, without [gMASK] sop and without SentencePiece's leading "▁"; positions from 0 (stream_chat
    puts them after the cache). Without a history, the whole prompt."""
    if not history:
        return chatglm2_inputs(tokenizer, query, history)
    ids = tokenizer.encode(f"\n\n[Round {len(history) + 1}]\n\n问：{query}\n\n答：", add_special_tokens=False)[1:]
    return tokenizer.pad({"input_ids": [ids]}, return_tensors="pt")


class RoleChat:
    """ChatGLM3's chat, and GLM-4's through its chat template: a history of role messages, stops at the end of text
    or where the model hands the turn back, answers (and tool calls) read by process_response."""

    checked_history = staticmethod(checked_history)
    inputs = staticmethod(chat_inputs)
    stop_ids = staticmethod(chat_stop_ids)

    @staticmethod
    def reply(model, text: str, history: list, query: str, role: str):
        return model.process_response(text, history + [{"role": role, "content": query}])


class ChatGLM2Chat:
    """ChatGLM2's chat: a history of (query, response) pairs, build_prompt's rounds, stops at the end of text, the
    answer stripped by process_response(text)."""

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
    """The chat format of a tokenizer, the one place chat() and stream_chat() choose it: ChatGLM2's for a ChatGLM2
    tokenizer (ours with `chatglm_family == "chatglm2"`, or chatglm2-6b's original, which has build_prompt and no
    build_chat_input), else ChatGLM3's role messages (GLM-4's chat template included)."""
    family = getattr(tokenizer, "chatglm_family", None)
    if family == "chatglm2" or (
        family is None and hasattr(tokenizer, "build_prompt") and not hasattr(tokenizer, "build_chat_input")
    ):
        return ChatGLM2Chat
    return RoleChat


def parse_tool_call(content: str) -> Optional[dict]:
    """The arguments of a tool call, read without evaluating model output (the original ran `eval` on it):
    ChatGLM3's ```` ```python\\ntool_call(name=value, ...)\\n``` ```` block, or GLM-4's JSON object. None when the
    content is neither."""
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


def chat_form_of(config) -> str:
    """"rounds" for a ChatGLM2 checkpoint (its chat methods have no `role`), else "roles"."""
    variant = checkpoint_variant(config)
    return "rounds" if variant and CHECKPOINT_VARIANTS[variant]["chat"] == "rounds" else "roles"


class ChatForm:
    """A chat method with the parameters of the checkpoint's own original: ChatGLM3's (`role`, role messages) or,
    for a ChatGLM2 checkpoint (model.chat_form == "rounds"), ChatGLM2's, so that positional calls written for it
    keep their meaning. Both run the same code; the chat format itself follows the tokenizer (`chat_format`)."""

    def __init__(self, with_roles, in_rounds):
        self.with_roles, self.in_rounds = with_roles, in_rounds

    def __get__(self, model, owner=None):
        if model is None:
            return self.with_roles
        function = self.in_rounds if getattr(model, "chat_form", "roles") == "rounds" else self.with_roles
        return function.__get__(model, owner)


class ChatMixin:
    """`model.chat(tokenizer, "你好", history=[])` and friends, with the signatures, defaults and history format of
    chatglm3-6b's remote code; GLM-4 checkpoints get them too, through their chat template. With a ChatGLM2
    tokenizer they are chatglm2-6b's: (query, response) history, `build_inputs`, `build_stream_inputs`."""

    def process_response_with_roles(self, output: str, history: Optional[list] = None):
        """ChatGLM3: split a decoded answer into the assistant messages it holds; returns (content, history). The
        content is the text, or for a tool call {"name", "parameters"} when the conversation declared tools (else
        {"name", "content"}). A message's first line is its metadata (a tool's name) only when more lines follow,
        so an answer without a newline is text. ChatGLM2's call, without a history: the answer stripped,
        "[[训练时间]]" as 2023年."""
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
            if parameters is not None:
                content = {"name": metadata.strip(), "parameters": parameters}
            else:
                content = {"name": metadata.strip(), "content": content}
        return content, history

    def process_response_in_rounds(self, response: str) -> str:
        """ChatGLM2: the answer stripped, "[[训练时间]]" as 2023年."""
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
            temperature=temperature, logits_processor=guarded(logits_processor), eos_token_id=stop_ids, **kwargs,
        )
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
        """chat() that yields (response, history) as the answer grows (whole characters only), with the cache as a
        third item when `return_past_key_values`; pass that cache back (with the history this call returned) to
        continue the conversation without recomputing it: the cache and the new ids make the whole conversation as
        the chat template renders it. ChatGLM2: with a history and no cache the whole prompt is sent (the original
        sent only the last round when return_past_key_values was set, dropping the history). A prompt that reaches
        max_length gets one token, as in the original (chat() raises generate()'s ValueError there)."""
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
        for step in self.stream_generate(
            **inputs, past_key_values=past_key_values, eos_token_id=stop_ids, return_past_key_values=True,
            max_length=max_length, do_sample=do_sample, top_p=top_p, temperature=temperature,
            logits_processor=guarded(logits_processor), **kwargs,
        ):
            ids, past_key_values = step
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

    # Each with the parameters of the checkpoint's own original: ChatGLM2's (no `role`) for a ChatGLM2 checkpoint.
    chat = ChatForm(chat_with_roles, chat_in_rounds)
    stream_chat = ChatForm(stream_chat_with_roles, stream_chat_in_rounds)
    process_response = ChatForm(process_response_with_roles, process_response_in_rounds)

    def build_inputs(self, tokenizer, query: str, history: Optional[list] = None):
        """ChatGLM2's model inputs for `history` ((query, response) pairs) + `query` (API of chatglm2-6b's code), on
        the device the model reads its inputs on."""
        return self.on_input_device(chatglm2_inputs(tokenizer, query, checked_pairs(history)))

    def build_stream_inputs(self, tokenizer, query: str, history: Optional[list] = None):
        """ChatGLM2's next round for a cache holding `history` (API of chatglm2-6b's code; see stream_chat)."""
        return self.on_input_device(chatglm2_stream_inputs(tokenizer, query, checked_pairs(history)))

    def on_input_device(self, inputs):
        """`inputs` (a tokenizer's output) moved to where the model reads its input ids (the embedding's device)."""
        device = execution_device(self.transformer.embedding)
        for name, value in inputs.items():
            inputs[name] = device_boundary(value, device)
        return inputs

    @torch.inference_mode()
    def stream_generate(self, input_ids, generation_config=None, logits_processor=None, stopping_criteria=None,
                        prefix_allowed_tokens_fn=None, return_past_key_values=False, **kwargs):
        """Sampling or greedy decoding that yields the ids so far (prompt included) after every new token, with the
        cache when `return_past_key_values`. Takes generate()'s sampling settings (max_length / max_new_tokens,
        do_sample, temperature, top_k, top_p, repetition_penalty, eos_token_id) and model inputs
        (attention_mask, position_ids, past_key_values). A prompt that reaches max_length still gets one new token,
        with a warning, as in the original (generate() refuses it)."""
        config = copy.deepcopy(generation_config if generation_config is not None else self.generation_config)
        model_inputs = config.update(**kwargs)
        attention_mask = model_inputs.pop("attention_mask", None)
        position_ids = model_inputs.pop("position_ids", None)
        past_key_values = model_inputs.pop("past_key_values", None)
        if model_inputs:
            raise ValueError(f"stream_generate() got unexpected arguments: {', '.join(sorted(model_inputs))}.")
        device = execution_device(self.transformer.output_layer) or input_ids.device
        input_ids = device_boundary(input_ids, device)
        attention_mask = device_boundary(attention_mask, device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        past_length = self.cached_tokens(past_key_values) if past_key_values is not None else 0
        if attention_mask.shape[1] == input_ids.shape[1] and past_length:
            attention_mask = torch.cat([attention_mask.new_ones(attention_mask.shape[0], past_length),
                                        attention_mask], dim=1)
        max_length = input_ids.shape[1] + config.max_new_tokens if config.max_new_tokens is not None \
            else config.max_length
        stop_ids = config.eos_token_id if isinstance(config.eos_token_id, (list, tuple)) else [config.eos_token_id]
        stop_ids = torch.tensor([i for i in stop_ids if i is not None], device=device)
        processors = sampling_processors(config, logits_processor, prefix_allowed_tokens_fn)
        stopping_criteria = stopping_criteria if stopping_criteria is not None else []
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=device)
        if input_ids.shape[1] >= max_length:  # the original's warning; it generated one token all the same
            logger.warning(f"Input length of input_ids is {input_ids.shape[1]}, but `max_length` is set to "
                           f"{max_length}: one token is generated. Raise max_length, or set max_new_tokens.")
        step_ids = input_ids
        while True:
            outputs = self(input_ids=step_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=past_key_values, use_cache=True, logits_to_keep=1)
            past_key_values = returned_cache(outputs)
            scores = processors(input_ids, outputs.logits[:, -1, :].float())
            if config.do_sample:
                next_tokens = torch.multinomial(F.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                next_tokens = scores.argmax(dim=-1)
            if config.pad_token_id is not None:  # finished rows keep padding
                next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, config.pad_token_id))
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
            step_ids, position_ids = next_tokens[:, None], None  # positions now follow the attention mask
            unfinished &= ~torch.isin(next_tokens, stop_ids)
            yield (input_ids, past_key_values) if return_past_key_values else input_ids
            if not unfinished.any() or input_ids.shape[1] >= max_length \
                    or any(bool(torch.all(c(input_ids, scores))) for c in stopping_criteria):
                break

    def cached_tokens(self, cache) -> int:
        """Tokens a cache holds, without the P-tuning v2 prefix slots (an attention mask covers tokens only)."""
        length = cache.get_seq_length()
        return length - cached_prefix(self.transformer, length)

    def quantize(self, bits: int, empty_init=False, device=None, storage: str = "library", **kwargs):
        """The original's `model.quantize(bits)`: weight-only quantization of the blocks' linear layers (embedding
        and output layer stay), through a maintained library (storage="library": torchao when installed, else
        optimum-quanto), or storage="original": the original's own storage (int8 codes, a per-row scale;
        quantization_chatglm.py, multiplied by torch's int8/int4 kernel as a pre-quantized checkpoint is, and saved
        as one). Returns the model. `empty_init` and `device` are accepted for old calling code and not needed."""
        quantize_blocks(self.transformer, bits, storage)
        self.quantized = self.quantized or bits != 0
        return self

    def quantize_output_layer(self, bits: int = 8):
        """Opt-in: the output layer (the logits, 151552 x 4096 for GLM-4) held as `bits`-bit codes (8 or 4) with a
        per-row scale, multiplied by torch's int8/int4 kernel in decode: for checkpoints that keep it in 16 bits
        (chatglm2-6b-int4 keeps it in fp16), where it is most of the bytes a decode step reads. It moves the logits
        (docs/speed-and-memory.md: measured deviation); save_pretrained writes it as float weights again, the values of the codes.
        See quantization_chatglm.quantize_output_layer. Returns the model."""
        import_companion("quantization_chatglm", self.config).quantize_output_layer(self.transformer, bits)
        return self


QUANTIZE_STORAGES = ("library", "original")


def quantize_blocks(model: "ChatGLMModel", bits: int, storage: str = "library") -> "ChatGLMModel":
    """quantize(bits) of the base model: the blocks' linear layers, weight-only; 0 leaves the model as it is."""
    if storage not in QUANTIZE_STORAGES:
        raise ValueError(f"quantize(storage={storage!r}): choose 'library' (torchao or optimum-quanto) or 'original' "
                         "(the original's int8 codes and per-row scales, run by torch's int8/int4 kernels).")
    if bits == 0:
        return model
    if weight_storage(model.config) != "float":
        raise ValueError(
            f"quantize({bits}): this model is already quantized (quantization_bit={model.config.quantization_bit} "
            "in config.json: it was loaded from a pre-quantized checkpoint such as chatglm2-6b-int4, whose layers "
            "are quantized as stored). Call quantize() only on a model with float weights."
        )
    if bits not in QUANTIZATION_WIDTHS:
        raise ValueError(f"quantize(bits={bits!r}): the supported widths are 4 and 8 (0 leaves the model as it is).")
    if storage == "original":
        import_companion("quantization_chatglm", model.config).quantize_as_stored(model, bits)
    else:
        quantize_linear_layers(model.encoder, bits)
    return model


def guarded(logits_processor) -> LogitsProcessorList:
    processors = LogitsProcessorList(logits_processor or [])
    processors.append(InvalidScoreLogitsProcessor())
    return processors


def answer_ids(ids: torch.Tensor, prompt_length: int, stop_ids: list) -> list:
    """The generated ids after the prompt, without the stop token that ended them."""
    answer = ids[prompt_length:].tolist()
    return answer[:-1] if answer and answer[-1] in stop_ids else answer


def sampling_processors(config, logits_processor, prefix_allowed_tokens_fn) -> LogitsProcessorList:
    """The logits processors stream_generate applies, in generate()'s order: the caller's, then penalties and
    constraints, then the sampling warpers."""
    processors = LogitsProcessorList(logits_processor or [])
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if prefix_allowed_tokens_fn is not None:
        processors.append(PrefixConstrainedLogitsProcessor(prefix_allowed_tokens_fn, config.num_beams or 1))
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            processors.append(TopKLogitsWarper(config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(TopPLogitsWarper(config.top_p))
    return processors


QUANTIZATION_WIDTHS = (4, 8)

def quantize_linear_layers(module: nn.Module, bits: int):
    """Weight-only `bits`-bit quantization of the nn.Linear layers in `module`: torchao first (int8 on CPU and
    CUDA; int4 where torchao has a kernel for the device, e.g. CUDA in bf16), then optimum-quanto."""
    def plain_linears():
        return [m for m in module.modules() if type(m) is nn.Linear and type(m.weight) in (nn.Parameter, torch.Tensor)]

    errors, before = [], len(plain_linears())
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        quantize_(module, Int8WeightOnlyConfig() if bits == 8 else Int4WeightOnlyConfig(group_size=128))
        if len(plain_linears()) < before:
            return
        errors.append("torchao: quantized no layer (sizes not a multiple of its group size)")
    except Exception as error:  # not installed, or no kernel for this width and device: try the next library
        errors.append(f"torchao: {type(error).__name__}: {error}")
    try:
        from optimum.quanto import freeze, qint4, qint8, quantize

        quantize(module, weights=qint8 if bits == 8 else qint4)
        freeze(module)
        return
    except Exception as error:
        errors.append(f"optimum-quanto: {type(error).__name__}: {error}")
    raise ImportError(
        f"quantize({bits}) needs torchao (`pip install torchao`) or optimum-quanto (`pip install optimum-quanto`), "
        "and neither could quantize here (" + "; ".join(errors) + "). Or quantize while loading: "
        "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True)) on CUDA, "
        "TorchAoConfig(...) or QuantoConfig(weights='int8')."
    )


# ======================================================================================================================
# Heads
# ======================================================================================================================


def as_tuple(loss, logits, outputs) -> tuple:
    """The return_dict=False outputs of a head: loss, logits, cache, hidden states, attentions, leaving out None."""
    values = (loss, logits, returned_cache(outputs), outputs.hidden_states, outputs.attentions)
    return tuple(v for v in values if v is not None)


def check_targets(name: str, targets: Optional[torch.Tensor], logits: torch.Tensor):
    """labels / shift_labels: integer ids [batch, sequence], one per logits position."""
    if targets is None:
        return
    if not isinstance(targets, torch.Tensor) or targets.shape != logits.shape[:2] \
            or targets.is_floating_point() or targets.dtype == torch.bool:
        got = f"shape {list(targets.shape)}, dtype {targets.dtype}" if isinstance(targets, torch.Tensor) \
            else repr(targets)
        raise ValueError(f"{name} must be an integer tensor {list(logits.shape[:2])} (batch, sequence: one target "
                         f"per position of the logits, also with logits_to_keep); got {got}.")


def check_target_values(labels, shift_labels, vocab_size: int, ignore_index: int) -> bool:
    """Each target a token id of the vocabulary or `ignore_index` (an id out of range would end in a CUDA device-side
    assert); returns whether no position has a target at all. Values are read with one host sync unless compiling:
    targets come with training forwards, never with decode steps. Both on one device."""
    if is_tracing():
        return False
    given = {name: targets for name, targets in (("labels", labels), ("shift_labels", shift_labels))
             if targets is not None}
    out_of_range = {name: (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
                    for name, targets in given.items()}
    scored = shift_labels if shift_labels is not None else labels[..., 1:]  # the loss's targets
    flags = torch.stack([bad.any() for bad in out_of_range.values()] + [(scored == ignore_index).all()]).tolist()
    for (name, bad), flagged in zip(out_of_range.items(), flags):
        if flagged:
            raise ValueError(f"{name} holds {int(given[name][bad][0])}, neither a token id in [0, {vocab_size}) nor "
                             f"ignore_index ({ignore_index}): mark positions without a target with {ignore_index}.")
    return flags[-1]


def warn_nothing_scored(ignore_index: int):
    """Every target ignored: the mean over no token is NaN, as in the original; said once, with the usual cause."""
    logger.warning_once(
        f"loss is NaN: every label is ignore_index ({ignore_index}), so no token has a target. The usual cause is "
        "truncation: the prompt filled max_length and the answer was cut away. Raise max_length or shorten the prompt "
        "(or drop such examples)."
    )


def extend_position_ids(position_ids: torch.Tensor, length: int) -> torch.Tensor:
    """position_ids given to generate() cover the prompt (the GLM tokenizers return them); the tokens generated
    after it continue from the last prompt position. transformers before 5.x does not extend them itself."""
    missing = length - position_ids.shape[-1]
    steps = torch.arange(1, missing + 1, device=position_ids.device, dtype=position_ids.dtype)
    return torch.cat([position_ids, position_ids[..., -1:] + steps], dim=-1)


def warn_beyond_seq_length(config, max_new_tokens, generation_config):
    """Generating more tokens than the model's context (seq_length) runs, with output that degrades past it."""
    if max_new_tokens is None:
        max_new_tokens = getattr(generation_config, "max_new_tokens", None)
    seq_length = getattr(config, "seq_length", None)
    if isinstance(max_new_tokens, int) and isinstance(seq_length, int) and max_new_tokens > seq_length:
        logger.warning_once(
            f"max_new_tokens={max_new_tokens} is beyond this model's seq_length={seq_length} (config.json), the "
            "longest context it was trained for: text generated past it degrades. Lower max_new_tokens."
        )


def settings_aliased_by_a_tool(config) -> bool:
    """Whether the generation settings transformers finds on the model config are all aliases of its own fields:
    GPTQModel's load maps a ChatGLM config's `max_length` to `seq_length` (config.attribute_map), for older remote
    code that read it. transformers 5 takes any generation setting on the model config for the legacy way of
    steering generate() and raises when no generation_config is passed."""
    settings = getattr(config, "_get_generation_parameters", lambda: {})()
    aliases = getattr(config, "attribute_map", None) or {}
    return bool(settings) and all(name in aliases for name in settings)


# Releases whose GenerationConfig() leaves every setting unset (5.x) fill what a passed one leaves unset from the
# model's generation config, then the library defaults, then the call's arguments: the same settings as passing none.
_GENERATION_CONFIG_FILLED_LIKE_NONE = GenerationConfig().max_length is None


class ChatGLMForConditionalGeneration(ChatMixin, ChatGLMPreTrainedModel, GenerationMixin):
    loss_type = "ForCausalLM"
    _tied_weights_keys = tied_weights_keys("transformer.output_layer.weight",
                                           "transformer.embedding.word_embeddings.weight")
    _auto_class = "AutoModelForCausalLM"  # see the compatibility layer

    def __init__(self, config: ChatGLMConfig, empty_init=True, device=None):
        super().__init__(config)
        self.transformer = ChatGLMModel(config, empty_init=empty_init, device=device)
        # The original's attributes: config.max_length (transformers' default, 20, unless config.json sets it;
        # 5.x configs no longer have it), and whether the blocks are quantized.
        self.max_sequence_length = getattr(config, "max_length", 20)
        self.quantized = weight_storage(config) != "float"
        self.chat_form = chat_form_of(config)
        self.post_init()

    def get_output_embeddings(self):
        return self.transformer.output_layer

    def set_output_embeddings(self, new_embeddings):
        self.transformer.output_layer = new_embeddings

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values=None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        return_last_logit: Optional[bool] = False,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        images: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        **loss_kwargs,  # the Trainer of 4.46-4.48 passes num_items_in_batch only to a `**loss_kwargs` by that name
    ):
        """`labels` give the causal-LM loss in fp32, as transformers' ForCausalLMLoss computes it: shifted left, or
        `shift_labels` already shifted (sequence / context parallelism; the loss is computed from either);
        `ignore_index` (-100) marks positions without a target; `num_items_in_batch` (from the Trainer) makes it a sum
        divided by that count. `logits_to_keep` / `return_last_logit` compute the logits of the last positions only.
        `images` (GLM-4V, see ChatGLMModel.forward): the logits have a row per image row, and token-layout labels are
        mapped to those rows (-100 on the image). Other keyword arguments go to the base model (and from there to the
        attention kernel). `cache` is transformers 5.24's name for `past_key_values` (pass one of the two)."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        loss_args = {name: loss_kwargs.pop(name) for name in ("num_items_in_batch", "shift_labels", "ignore_index")
                     if name in loss_kwargs}
        outputs = self.transformer(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
            past_key_values=caller_cache(past_key_values, cache), inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            images=images, **loss_kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if return_last_logit:
            logits_to_keep = 1
        if isinstance(logits_to_keep, int):
            if logits_to_keep:
                hidden_states = hidden_states[:, -logits_to_keep:]
        else:
            hidden_states = hidden_states[:, logits_to_keep]
        # Hidden states to the output layer's device; labels and the item count to the logits' device.
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
        if not return_dict:
            return as_tuple(loss, logits, outputs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **cache_output(returned_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def lm_loss(self, logits, labels, shift_labels=None, ignore_index=-100, num_items_in_batch=None):
        """transformers' causal-LM loss (compatibility layer), with the targets and the item count on the logits'
        device."""
        vocab_size = self.config.padded_vocab_size
        for name, targets in (("labels", labels), ("shift_labels", shift_labels)):
            check_targets(name, targets, logits)
        labels, shift_labels = device_boundary(labels, logits.device), device_boundary(shift_labels, logits.device)
        nothing_scored = check_target_values(labels, shift_labels, vocab_size, ignore_index)
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = device_boundary(num_items_in_batch, logits.device)
        loss = causal_lm_loss(logits, labels, vocab_size=vocab_size, num_items_in_batch=num_items_in_batch,
                              ignore_index=ignore_index, shift_labels=shift_labels)
        if nothing_scored and bool(loss.isnan()):  # a host sync only when no position has a target
            warn_nothing_scored(ignore_index)
        return loss

    def generate(self, inputs=None, *args, **kwargs):
        """transformers' generate(), with its bookkeeping (prompt, mask, the tokens it appends) on one device, wherever
        the caller left the inputs: model.device (4.51+, which move each step's logits there) or the logits' device
        (before 4.51, whose logits processors read the ids beside the scores where the output layer left them); see
        `generation_device`. Each forward moves the step's inputs to the embedding's device. Without this, a prompt
        left on the CPU warns, and a model split over devices fails on 4.44 to 4.50 unless accelerate's hooks move the
        logits back."""
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
        kwargs = reserve_static_cache_room(self, inputs, kwargs, prefix_length(self))  # P-tuning v2
        warn_beyond_seq_length(self.config, kwargs.get("max_new_tokens"),
                               kwargs.get("generation_config") or self.generation_config)
        if kwargs.get("generation_config") is None and _GENERATION_CONFIG_FILLED_LIKE_NONE \
                and settings_aliased_by_a_tool(self.config):
            # An empty config gets the settings transformers gives a call without one (a tool's alias is no setting)
            kwargs["generation_config"] = GenerationConfig()
        with quiet_device_type_check(self, device):
            return super().generate(inputs, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      position_ids=None, inputs_embeds=None, **kwargs):
        """transformers' input preparation (ours on 4.44/4.45), given the cache under the release's name. The inputs
        it returns hold the cache as `past_key_values` on every release: PEFT (0.12 to 0.21, the newest) looks for it
        there and puts its prefix-tuning prefix there, so under 5.24's `cache` a prefix would come as a second cache."""
        past_key_values = caller_cache(past_key_values, kwargs.pop("cache", None))
        if inputs_embeds is None:  # the cache holds the ids but the newest (and the prefix slots): no host sync
            check_cache_room(past_key_values, input_ids.shape[-1] + prefix_length(self),
                             f"the {input_ids.shape[-1]} tokens of the sequence so far")
        if position_ids is not None and inputs_embeds is None and position_ids.shape[-1] < input_ids.shape[-1]:
            position_ids = extend_position_ids(position_ids, input_ids.shape[-1])
        if _HAS_GENERIC_PREPARE_INPUTS:
            model_inputs = super().prepare_inputs_for_generation(
                input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
                **cache_output(past_key_values), **kwargs,
            )
            model_inputs["past_key_values"] = model_inputs.pop(CACHE_NAME, None)
        else:
            model_inputs = prepare_inputs_before_4_46(
                input_ids, past_key_values, attention_mask, position_ids, inputs_embeds, config=self.config, **kwargs
            )
        if prefix_length(self) and (attention_mask is None or attention_mask.dim() == 2):
            # Static caches get a 4-D mask (4.53+, and ours before 4.46), blind to the prefix slots: the model builds
            # its own from the 2-D one.
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

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        full_attention_mask: Optional[torch.Tensor] = None,
        past_key_values=None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        cache: Optional[Cache] = None,
        **kwargs,
    ):
        """Classifies each sequence from its last real token (the last column where attention_mask is 1, so left
        and right padding both work; the last position without a mask, as in the original). `full_attention_mask`
        keeps the original's positional signature and is ignored: the model builds its mask from attention_mask.
        `cache` is transformers 5.24's name for `past_key_values` (pass one of the two)."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.transformer(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
            past_key_values=caller_cache(past_key_values, cache), inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            **kwargs,
        )
        # Pooling on the device of the logits (the classifier's); labels follow.
        head_device = execution_device(self.classifier_head) or outputs.last_hidden_state.device
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
        if not return_dict:
            return as_tuple(loss, logits, outputs)
        return SequenceClassifierOutputWithPast(
            loss=loss, logits=logits, **cache_output(returned_cache(outputs)),
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )

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
