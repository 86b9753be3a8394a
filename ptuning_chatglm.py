"""P-tuning v2 for ChatGLM2/3 and GLM-4: the prefix encoder, its place in the KV cache, and its files.

modeling_chatglm.py loads this file (`import_companion("ptuning_chatglm")`) only for a config with `pre_seq_len`
(`prefix_projection` optional; weights `transformer.prefix_encoder.*`); a model without a prefix never imports it.
This file imports nothing of modeling_chatglm.py (no import loop): what it uses of the language model (device
boundaries, cache constructors and queries) is handed in as `LanguageModelCallbacks`.

A trained encoder gives every layer `pre_seq_len` key/value slots in front of the real tokens. As in the original, they
are the first slots of the key/value cache, written unrotated by the first forward and seen by every query; the real
tokens keep positions 0..n-1 and a 2-D attention_mask covers them alone. The core forward meets this file at one seam,
modeling_chatglm.py's `enter_prefix`, which calls `enter_prefix` here. GLM-4's original configuration class has no
such fields: they are read with getattr.
"""

import copy
import json
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME


@dataclass(frozen=True)
class LanguageModelCallbacks:
    """What the prefix uses of modeling_chatglm.py, which builds the encoder (`prefix_encoder`) and hands these in."""

    device_boundary: Callable  # (tensor, device) -> tensor on device: every device crossing
    execution_device: Callable  # module -> the device it computes on
    cache_is_empty: Callable  # cache -> whether no forward has written to it
    max_cache_length: Callable  # cache -> its preallocated length, None for a cache that grows
    dynamic_cache_kwargs: Callable  # config -> DynamicCache's keyword arguments on this transformers release
    new_static_cache: Callable  # (config, batch, length, dtype, layer devices) -> a StaticCache
    cache_output: Callable  # cache -> {the release's name of the cache argument: cache}


PREFIX_KEY = "transformer.prefix_encoder."
PREFIX_DROPOUT = 0.1  # the original's dropout on the prefix (train mode only)
# The whole-model files from_pretrained reads (transformers' names), in the order it looks for them.
MODEL_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
PREFIX_FILES = ("adapter_model.safetensors", "adapter_model.bin") + MODEL_FILES


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

    def __init__(self, config, callbacks: Optional[LanguageModelCallbacks] = None):
        super().__init__()
        self.callbacks = callbacks  # None for an encoder built only for its shapes (check_prefix_checkpoint)
        self.pre_seq_len = prefix_slots(config)
        # GLM's key/value heads: the multi-query groups, or every head without multi-query attention.
        self.kv_heads = config.multi_query_group_num if config.multi_query_attention else config.num_attention_heads
        self.num_layers, self.head_dim = config.num_layers, config.kv_channels
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

    def key_values(self, batch_size: int, dtype: torch.dtype, device: Optional[torch.device]) -> list:
        """Each layer's prefix as (key, value), [batch, kv_heads, pre_seq_len, head_dim], in `dtype` (the encoder may
        stay fp32 in a half-precision model, as the original ptuning scripts kept it); `device`: where the encoder
        computes."""
        slots = torch.arange(self.pre_seq_len, device=device)
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


# ---- files ------------------------------------------------------------------------------------------------------------


def prefix_shards(index_file: str) -> list:
    """The shards of a sharded checkpoint that hold prefix weights, as its index (`*.index.json`) names them."""
    try:
        with open(index_file, "rb") as index:
            weight_map = json.loads(index.read())["weight_map"]
        return sorted({shard for key, shard in weight_map.items() if key.startswith(PREFIX_KEY)})
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{index_file} is damaged or incomplete: it is not a JSON object with a 'weight_map' table. "
                         "Download it again, or save the checkpoint again.") from None


def read_prefix_file(path, names=PREFIX_FILES, shapes_only: bool = False) -> Tuple[dict, str]:
    """The prefix encoder's tensors (names without `transformer.prefix_encoder.`; empty meta tensors with
    `shapes_only`) and the file that holds them. `path` is a safetensors or torch file, or a folder holding one of
    `names`: the ChatGLM2/3 ptuning trainer's checkpoint, a whole or sharded checkpoint, `save_prefix_file`'s output,
    or a PEFT prefix-tuning adapter, whose `prompt_embeddings` are the embedding of an encoder without projection."""
    from safetensors import safe_open

    path = os.fspath(path)
    if os.path.isdir(path):
        present = [os.path.join(path, name) for name in names if os.path.isfile(os.path.join(path, name))]
        if not present:
            raise FileNotFoundError(f"{path} holds none of {', '.join(names)}: no P-tuning v2 prefix to load.")
        path = present[0]
    files = [path]
    if path.endswith(".index.json"):
        files = [os.path.join(os.path.dirname(path), shard) for shard in prefix_shards(path)]

    def wanted(name):
        return name.startswith(PREFIX_KEY) or name == "prompt_embeddings"

    tensors = {}
    for file in files:
        if file.endswith(".safetensors"):
            try:
                weights = safe_open(file, "pt")
            except Exception as error:  # safetensors' own error names no file
                raise ValueError(f"{file} is damaged or incomplete ({error}). Download it again, or save the "
                                 "checkpoint again.") from None
            with weights:
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
    """model.load_prefix_encoder(path): the prefix read from `path` (see read_prefix_file); returns the file read."""
    state, file = read_prefix_file(path)
    if not state:
        raise ValueError(f"{file} holds no {PREFIX_KEY}* tensors (nor PEFT prompt_embeddings): it is not a P-tuning "
                         "v2 prefix.")
    check_prefix_state(encoder, state, file)
    encoder.load_state_dict(state)
    return file


def save_prefix_file(encoder: PrefixEncoder, save_directory) -> str:
    """model.save_prefix_encoder(directory): the classic layout, `model.safetensors` holding
    `transformer.prefix_encoder.*` (full names), as the ChatGLM2/3 ptuning trainer saved it."""
    from safetensors.torch import save_file

    os.makedirs(save_directory, exist_ok=True)
    path = os.path.join(save_directory, SAFE_WEIGHTS_NAME)
    save_file({PREFIX_KEY + name: tensor.detach().contiguous().cpu() for name, tensor in encoder.state_dict().items()},
              path, metadata={"format": "pt"})
    return path


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


# ---- training and loading -------------------------------------------------------------------------------------------


def train_prefix_only(model: nn.Module):
    """As in the original, a model with a prefix trains the prefix alone: every other weight of the base model is
    frozen when it is built or loaded. `model.requires_grad_(True)` (or on chosen modules) trains more."""
    model.requires_grad_(False)
    model.prefix_encoder.requires_grad_(True)


def checkpointing_kwargs(kwargs: Optional[dict]) -> dict:
    """The keyword arguments for torch.utils.checkpoint with a prefix: it reaches the layers through the cache, which
    reentrant checkpointing does not see as an input, so no gradient would reach the prefix encoder. Non-reentrant."""
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
    left random is said, not silent."""
    encoder = model.base_model.prefix_encoder
    train_prefix_only(model.base_model)
    missing = [name if isinstance(name, str) else name[0]  # 4.44 lists mismatches as (name, shapes...)
               for key in ("missing_keys", "mismatched_keys") for name in loading_info.get(key, ())]
    missing = [name for name in missing if "prefix_encoder." in name]
    if missing:
        warnings.warn(
            f"The checkpoint holds no P-tuning v2 prefix weights ({', '.join(missing)}): the prefix of "
            f"pre_seq_len={encoder.pre_seq_len} is random, as at the start of P-tuning. To use a trained prefix, load "
            "it: model.load_prefix_encoder(path) or model.transformer.prefix_encoder.load_state_dict(...).",
            stacklevel=3,
        )


# ---- the prefix in the KV cache ---------------------------------------------------------------------------------------


class PrefixOnlyCache(DynamicCache):
    """The prefix for a forward that keeps no cache (use_cache=False, gradient checkpointing): each layer attends to
    its prefix followed by the new keys, and nothing is stored, so a checkpointed layer that runs again sees the same
    keys. Gradients reach the prefix encoder through the concatenation."""

    def __init__(self, key_values: list, **cache_kwargs):
        super().__init__(**cache_kwargs)
        self.prefix = key_values

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        key, value = self.prefix[layer_idx]
        return torch.cat([key, key_states], dim=-2), torch.cat([value, value_states], dim=-2)

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        return self.prefix[layer_idx][0].shape[-2]


def enter_prefix(model: nn.Module, cache, past_length, batch_size: int, query_length: int) -> tuple:
    """The base model's forward meets the prefix here (through modeling_chatglm.py's `enter_prefix`): an empty cache
    gets the prefix written first, each layer's slots on that layer's device; a cache that is not empty holds it
    already (an earlier call wrote it); without a cache the layers get a PrefixOnlyCache. Returns (the cache the layers
    use, the prefix's slots, the slots cached before this step's tokens, prefix included)."""
    encoder = model.prefix_encoder
    host = encoder.callbacks
    slots = encoder.pre_seq_len
    if cache is not None and not host.cache_is_empty(cache):
        return cache, slots, past_length
    room = host.max_cache_length(cache) if cache is not None else None
    if room is not None and slots + query_length > room:
        raise ValueError(
            f"The static cache has {room} slots; the P-tuning v2 prefix takes pre_seq_len={slots} of them before the "
            f"{query_length} tokens. Build it with max_cache_len >= {slots + query_length} plus the tokens to "
            "generate (generate(cache_implementation='static') does this itself)."
        )
    devices = [host.execution_device(layer) for layer in model.encoder.layers]
    key_values = encoder.key_values(batch_size, model.compute_dtype, host.execution_device(encoder))
    key_values = [(host.device_boundary(key, device), host.device_boundary(value, device))
                  for (key, value), device in zip(key_values, devices)]
    if cache is None:
        cache = PrefixOnlyCache(key_values, **host.dynamic_cache_kwargs(model.config))
    else:
        for index, ((key, value), device) in enumerate(zip(key_values, devices)):
            cache.update(key, value, index, {"cache_position": torch.arange(slots, device=device)})
    return cache, slots, cache.get_seq_length()


def reserve_static_cache_room(model: nn.Module, inputs: Optional[torch.Tensor], kwargs: dict) -> dict:
    """generate(cache_implementation="static") sizes its cache for the prompt and the new tokens only: with a prefix
    the static cache is built here, pre_seq_len larger, and handed to generate."""
    if any(kwargs.get(name) is not None for name in ("past_key_values", "cache")):
        return kwargs
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    config.update(**{name: value for name, value in kwargs.items() if hasattr(config, name)})
    if config.cache_implementation != "static" or config.use_cache is False:
        return kwargs
    transformer = model.base_model
    host = transformer.prefix_encoder.callbacks
    prompt = next(t for t in (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds")) if t is not None)
    batch_size, length = prompt.shape[:2]
    new_tokens = config.max_new_tokens if config.max_new_tokens is not None else max(config.max_length - length, 0)
    cache = host.new_static_cache(
        model.config, batch_size * max(config.num_beams or 1, config.num_return_sequences or 1),
        transformer.prefix_encoder.pre_seq_len + length + new_tokens, transformer.compute_dtype,
        [host.execution_device(layer) for layer in transformer.encoder.layers],
    )
    config.cache_implementation = None
    kwargs = {name: value for name, value in kwargs.items() if name != "cache_implementation"}
    return dict(kwargs, **host.cache_output(cache), generation_config=config)
