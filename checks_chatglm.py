"""Load-time checks for ChatGLM2/3 and GLM-4: a config's sizes against memory, device maps, the weight files' storage
and damage, and the loaded weights (keys, float widths, NaN and inf). docs/load-checks.md says what each refuses.

modeling_chatglm.py loads this file (`import_companion("checks_chatglm")`) when it builds or loads a model. Copied
alone over a checkpoint, modeling_chatglm.py loads and runs without it, and says once that these checks are skipped.
This file imports nothing of modeling_chatglm.py (no import loop): what it needs of the model (its parameter counts,
the model built on `meta`) comes as arguments. Every check reads sizes, names and file headers, and no weight value,
except `check_finite_weights`.
"""

import json
import os
import warnings
from typing import Iterable, Optional

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, logging

logger = logging.get_logger(__name__)

# ======================================================================================================================
# Config and memory
# ======================================================================================================================


def validate_config(config):
    """The fields the model is built from, under the original configuration class, which a user may keep beside
    modeling_chatglm.py and which checks nothing (ours checks every field itself: `validate_chatglm`)."""
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


def parameter_creation_device() -> torch.device:
    """Where new parameters go now: the default device, a `with torch.device(...)` block, or `meta` under
    accelerate's init_empty_weights (which moves each registered parameter)."""
    probe = nn.Module()
    probe.register_parameter("probe", nn.Parameter(torch.empty(0)))
    return probe.probe.device


# Host memory the module objects of one block take even where its weights are not allocated (`meta`): about 19 KiB
# measured (torch 2.13); a lower bound, for a num_layers that could never be built.
BLOCK_OBJECT_BYTES = 16 * 1024


def check_fits_in_memory(config, parameters: int):
    """Refuse sizes that cannot be built where they would be, before anything is allocated: otherwise a config with
    num_layers 1e9 hangs building modules, and one with absurd sizes dies in an out-of-memory error. `parameters`: the
    weights the config describes. On `meta` (from_pretrained) no weight is allocated now and the device map places
    them later (accelerate, or disk offload, says what does not fit): only the blocks' module objects are counted."""
    device = parameter_creation_device()
    host = host_memory_bytes()
    if device.type == "meta":
        needed, capacity = config.num_layers * BLOCK_OBJECT_BYTES, host
        what = f"{config.num_layers:,} blocks, whose module objects alone take {needed / 2 ** 30:,.0f} GiB"
    else:
        capacity = {"cpu": host}.get(device.type)
        if device.type == "cuda":
            capacity = torch.cuda.get_device_properties(device.index or 0).total_memory
        dtype = torch.get_default_dtype()
        needed = parameters * torch.empty(0, dtype=dtype, device="meta").element_size()
        what = f"a model of {parameters / 1e9:,.1f}B parameters ({needed / 2 ** 30:,.0f} GiB in {dtype})"
    if capacity is not None and needed > capacity:
        raise ValueError(
            f"This config describes {what}, more than the {capacity / 2 ** 30:,.0f} GiB available on {device}: check "
            f"num_layers ({config.num_layers}), hidden_size, ffn_hidden_size and padded_vocab_size in config.json, or "
            "load with device_map / a smaller dtype."
        )


# ======================================================================================================================
# Device maps
# ======================================================================================================================


def balanced_device_map(config, devices, block_parameters: int, vision_parameters: int = 0) -> dict:
    """An explicit device map for `devices` (e.g. ["cuda:0", "cuda:1"]): embedding and rotary table on the first,
    final norm and output layer on the last, the blocks (`block_parameters` each) in contiguous runs that balance the
    parameter count, GLM-4V's vision tower (`vision_parameters`) first. The successor of ChatGLM3's
    `load_model_on_gpus`, whose maps missed modules."""
    if isinstance(devices, (str, bytes, int, torch.device)) or not isinstance(devices, Iterable):
        # A string is iterable: "cuda:0" mapped the layers to 'c', 'u', 'd', ...
        raise TypeError(f"balanced_device_map: devices must be a list of devices, e.g. [{devices!r}], got "
                        f"{type(devices).__name__} {devices!r}.")
    devices = list(devices)
    if not devices:
        raise ValueError("balanced_device_map needs at least one device")
    vocab_weights = config.padded_vocab_size * config.hidden_size
    pieces = ([("transformer.embedding", vocab_weights)]
              + [(f"transformer.encoder.layers.{i}", block_parameters) for i in range(config.num_layers)]
              + [("transformer.output_layer", vocab_weights)])
    if vision_parameters:  # GLM-4V: the vision tower computes first
        pieces = [("transformer.vision", vision_parameters)] + pieces
    share = sum(size for _, size in pieces) / len(devices)
    device_map, start = {}, 0
    for name, size in pieces:
        device_map[name] = devices[min(len(devices) - 1, int((start + size / 2) // share))]
        start += size
    device_map["transformer.rotary_pos_emb"] = device_map["transformer.embedding"]
    if getattr(config, "pre_seq_len", None):  # P-tuning v2
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
# Weight files: what they store, read from their headers before transformers reads them
# ======================================================================================================================

# The weight files from_pretrained reads (transformers' names), in the order it looks for them (an index names shards).
MODEL_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)


def damaged_file_error(path, problem: str) -> ValueError:
    return ValueError(f"{path} is damaged or incomplete: {problem}. Download it again (an interrupted download or a "
                      "full disk leaves such a file), or save the checkpoint again.")


def index_shards(index_file: str) -> list:
    """The shard file names a sharded checkpoint's index (`*.index.json`) gives, sorted."""
    try:
        with open(index_file, "rb") as index:
            return sorted(set(json.loads(index.read())["weight_map"].values()))
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise damaged_file_error(index_file, "it is not a JSON object with a 'weight_map' table") from None


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
        if name.startswith(SAFE_WEIGHTS_NAME) and kwargs.get("use_safetensors") is False:
            continue
        found = local_checkpoint_file(source, with_variant(name, kwargs.get("variant")), kwargs)
        if found is None:
            continue
        if not found.endswith(".index.json"):
            return [found]
        files = [local_checkpoint_file(source, shard, kwargs) for shard in index_shards(found)]
        return files if all(files) else None
    return None


# safetensors' dtype codes ("I32", "BF16", "F8_E4M3", "BOOL") by prefix, as torch names them ("int32", ...).
SAFETENSORS_KINDS = {"BOOL": "bool", "BF": "bfloat", "F": "float", "I": "int", "U": "uint", "C": "complex"}


def stored_dtypes(files: list) -> list:
    """(name, dtype, floating, file) of every stored tensor: safetensors' own header reader (which refuses a damaged
    or cut file before allocating anything), or a torch file's records, memory-mapped."""
    from safetensors import safe_open

    found = []
    for file in files:
        if file.endswith(".safetensors"):
            try:
                with safe_open(file, "pt") as weights:
                    codes = {name: weights.get_slice(name).get_dtype() for name in weights.keys()}
            except Exception as error:  # safetensors' error names no file
                raise damaged_file_error(file, f"safetensors cannot read it ({error})") from None
            for name, code in codes.items():
                kind = next((prefix for prefix in SAFETENSORS_KINDS if code.startswith(prefix)), "")
                found.append((name, SAFETENSORS_KINDS.get(kind, "") + code[len(kind):].lower(), kind in ("F", "BF"),
                              file))
            continue
        # Kept although transformers reads the file again: it casts an integer tensor of a .bin to float without a
        # word, and mmap reads the pickled records only, no tensor data.
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (not zip) torch file cannot be memory-mapped: transformers' checks apply
            continue
        found += [(name, str(tensor.dtype).replace("torch.", ""), tensor.is_floating_point(), file)
                  for name, tensor in state.items() if isinstance(tensor, torch.Tensor)]
    return found


def check_stored_dtypes(source, kwargs: dict, model, config=None) -> bool:
    """Refuse a checkpoint whose stored dtypes contradict the model: one of its float weights stored as an integer or
    bool tensor (transformers casts it to float without a word; 4.44 without low_cpu_mem_usage fails on the copy,
    naming neither dtype nor file), or float weights under a config with `quantization_bit` (an int8 storage loaded
    all zeros, an int4 one failed on transformers' shapes error, neither naming the field). Reads the files' headers
    only. `model` is the loaded model, or a callable building one on the meta device, called only if needed; `config`
    a callable returning its config (with a callable `model`). Returns whether the files were on this machine to check
    (a hub checkpoint is downloaded by from_pretrained itself)."""
    files = stored_weight_files(source, kwargs)
    if files is None:
        return False
    if kwargs.get("quantization_config") is not None:  # a quantizer's storage is its own
        return True
    stored = stored_dtypes(files)
    bits = getattr(model.config if isinstance(model, nn.Module) else config(), "quantization_bit", 0) or 0
    if all(floating for _, _, floating, _ in stored) and not bits:
        return True
    if not isinstance(model, nn.Module):
        with torch.device("meta"):
            model = model()
    if getattr(model.config, "quantization_config", None) is not None:  # quantized weights are stored as integers
        return True
    expected = {name: tensor.dtype for name, tensor in model.state_dict().items()}
    prefix = model.base_model_prefix + "."
    scales = {name[:-len("_scale")] for name, _, _, _ in stored if name.endswith(".weight_scale")}
    for name, dtype, floating, file in stored:
        for key in (name, name[len(prefix):] if name.startswith(prefix) else prefix + name):
            if key not in expected or floating == expected[key].is_floating_point:
                continue
            if floating and not bits:  # a float tensor where the model holds integers: transformers' checks apply
                continue
            if floating:
                raise ValueError(
                    f"quantization_bit={bits} in the config asks for int{bits} weights (codes and weight_scale, as "
                    f"the original's quantize() saved them), but {file} stores {name} as {dtype}: the checkpoint "
                    "holds float weights, which would load as all-zero codes or fail on their shapes. Remove "
                    f"quantization_bit from config.json to load them, and call model.quantize({bits}) after loading "
                    "to quantize them."
                )
            hint = (" It is pre-quantized: set quantization_bit in config.json to the width it was saved with."
                    if name in scales else " The checkpoint was saved or edited wrong: save the weights as float "
                    "(bfloat16, float16 or float32).")
            raise ValueError(
                f"{name} is stored as {dtype} in {file}; this model's weight is floating point ({expected[key]}), "
                f"and loading would cast the {dtype} values to it without a word, giving wrong logits.{hint}"
            )
    return True


# ======================================================================================================================
# The loaded weights
# ======================================================================================================================


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


def check_one_float_width(model: nn.Module):
    """transformers 4.44 with dtype "auto" and no torch_dtype in config.json took the first weight's dtype for some
    layers and float32 for others: a float64 weight loaded, and the forward failed on mixed dtypes."""
    wide = [name for name, param in model.named_parameters() if param.dtype == torch.float64]
    if wide and len(wide) < sum(1 for param in model.parameters() if param.is_floating_point()):
        raise ValueError(f"{len(wide)} weights loaded as float64 ({', '.join(wide[:3])}{', ...' if len(wide) > 3 else ''})"
                         " and the others in another dtype: the checkpoint stores float64 tensors. Pass "
                         "torch_dtype=torch.bfloat16 (or float32) to from_pretrained (`dtype=` on transformers >= 4.56).")


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


def check_loaded(model: nn.Module, loading_info: dict, source, finite: bool = True):
    """What from_pretrained checks of the model it loaded: the keys found, one float width, and (unless
    check_finite_weights=False) NaN and inf. P-tuning v2 prefix weights that the config ignores are said."""
    check_loaded_weights(model, loading_info, source)
    check_one_float_width(model)
    ignored = [name for name in loading_info.get("unexpected_keys", ()) if "prefix_encoder." in name]
    if ignored and getattr(model.base_model, "prefix_encoder", None) is None:
        warnings.warn(
            f"The checkpoint holds P-tuning v2 prefix weights ({', '.join(ignored)}) but config.pre_seq_len is not "
            "set: the prefix is ignored and the base model runs. Load with pre_seq_len (and prefix_projection) as "
            "trained, e.g. from_pretrained(path, trust_remote_code=True, pre_seq_len=N).",
            stacklevel=3,
        )
    if finite:
        check_finite_weights(model, source)


# ======================================================================================================================
# Inputs: what the forwards are given (shapes and dtypes on every call; values where reading them costs no device sync)
# ======================================================================================================================


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


def check_inputs(model, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, capacity):
    """Shapes and dtypes of the base model's inputs, each error naming the argument and the shape it must have. Reads
    shapes only (no host sync); token id values are checked separately (check_token_ids). `capacity`: the slots of a
    static cache given, None for one that grows."""

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
        check_cache_room(capacity, past + length, f"{past} cached and {length} new")
    prefix = model.prefix_encoder.pre_seq_len if getattr(model, "prefix_encoder", None) is not None else 0
    tokens = past - (prefix if not (isinstance(past, int) and past == 0) else 0)  # a 2-D mask covers no prefix
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
                                        if prefix else ""))
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 \
                or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length \
                or not is_integer(position_ids):
            refuse("position_ids", position_ids, f"an integer tensor [{batch}, {length}] (batch, new tokens)")


def cache_argument_error(problem: str) -> ValueError:
    """An error about the cache the caller passed, naming the argument: the one place that spells its name."""
    return ValueError(f"past_key_values {problem}")


def check_cache_room(capacity: Optional[int], needed: int, what: str):
    """A static cache holds max_cache_len (`capacity`) slots; a step needing more would fail further on, unclearly
    (on the 4-D mask generate() sized for the cache, or in the cache's index copy). Checked first: by the forward
    where the cached length is an int (a static cache on an accelerator counts its slots in a tensor, and reading it
    costs a host sync), and by generate() from the length of its ids."""
    if capacity is None or needed <= capacity:
        return
    raise cache_argument_error(
        f"is a static cache of {capacity} tokens (max_cache_len={capacity}); this step needs {needed} ({what}). "
        "Create it with max_cache_len of at least the prompt plus max_new_tokens (plus pre_seq_len with a P-tuning "
        "v2 prefix)."
    )


def first_layer_keys(cache) -> Optional[torch.Tensor]:
    """Layer 0's keys [batch, kv_heads, slots, head_dim] as `cache` holds them, None while it holds none (a new cache;
    4.56+ static caches allocate on the first update). 4.56+ keep them on `cache.layers`, earlier releases in
    `cache.key_cache` (static caches allocated up front, with their batch size)."""
    if hasattr(cache, "layers"):
        keys = getattr(cache.layers[0], "keys", None) if len(cache.layers) else None
    else:
        stored = getattr(cache, "key_cache", None)
        keys = stored[0] if stored else None
    return keys if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None


def check_cache_shape(cache, model, batch: int):
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
        if isinstance(length, torch.Tensor) and length.device.type == "cpu" and not torch.compiler.is_compiling():
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
    assert); returns whether no position has a target at all. Values are read with one host sync (the model skips
    this while compiling or tracing): targets come with training forwards, never with decode steps. Both on one
    device."""
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
