#!/usr/bin/env python
"""Export a ChatGLM2/3 or GLM-4 checkpoint (the original format) to transformers' own Glm: no remote code needed.

    python tools/export_to_native_glm.py /path/to/glm-4-9b-chat  /path/to/glm-4-9b-chat-native
    python tools/export_to_native_glm.py /path/to/chatglm3-6b    /path/to/chatglm3-6b-native --max-shard-size 2GB

SOURCE is a checkpoint folder in the original layout (config.json with `padded_vocab_size`, safetensors or
pytorch_model*.bin weights, tokenizer.model): chat, base, 1m, codegeex4, fine-tuned or LoRA-merged; or a Hugging Face
cache folder (`models--THUDM--glm-4-9b-chat`, or one of its snapshots). OUTPUT is a new folder that
`AutoModelForCausalLM.from_pretrained(OUTPUT)` and `AutoTokenizer.from_pretrained(OUTPUT)` load without
`trust_remote_code` (transformers >= 4.46), and that vLLM, SGLang and llama.cpp's convert_hf_to_gguf.py read as Glm:

* config.json: GlmConfig, `architectures: ["GlmForCausalLM"]`, the rotary base 10000 * rope_ratio (half of each head
  turns; chatglm2-6b-32k, which divides the positions by rope_ratio instead: base 10000 and linear rope scaling with
  factor rope_ratio, read by transformers >= 4.48), the checkpoint's dtype, eos and pad ids; and the original's
  layernorm_epsilon, seq_length and rope_ratio, which llama.cpp's converter reads instead of Glm's names;
* model-0000N-of-0000M.safetensors + index: the weights in Glm's names (the fused query_key_value split into q/k/v;
  dense_h_to_4h is already gate|up), written shard by shard: memory holds one output shard, never the model;
* tokenizer.json (the fast tokenizer of tools/convert_tokenizer_to_fast.py, ids equal to the slow tokenizer's),
  tokenizer_config.json (PreTrainedTokenizerFast, the family's special tokens, the chat template: GLM-4's own, with
  tools and observations; for ChatGLM3 one that renders build_chat_input's prompt), generation_config.json (ChatGLM3
  also stops at <|user|> and <|observation|>, as its chat() does). `--without-tokenizer` writes the model alone
  (ChatGLM2, whose tokenizer has no fast form here, is otherwise refused: keep its own tokenizer beside).

What Glm cannot hold is refused, naming the field: a P-tuning v2 prefix (`pre_seq_len`), GLM-4V's vision tower,
`quantization_bit`, and the layout flags released checkpoints never set. SOURCE is only read. OUTPUT is written in a
hidden folder beside it and renamed into place at the end: it appears complete or not at all (an existing OUTPUT is
refused). Exit codes: 0 done, 1 failed (nothing written), 2 refused.
"""
import argparse
import json
import os
import re
import shutil
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from chatglm_tools import REPO, repository_module
from chatglm_tools.folder_transaction import Failed, Refused, exit_code, report

TOOL = "export_to_native_glm.py"
# safetensors' dtype names (its format) and torch's
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
DEFAULT_SHARD = "5GB"
# Flags of the original config that Glm has no counterpart for, with the value Glm computes (released checkpoints all
# have it); anything else is refused.
GLM_LAYOUT = {"rmsnorm": True, "add_bias_linear": False, "apply_residual_connection_post_layernorm": False,
              "post_layer_norm": True, "original_rope": True}
FAMILY_NAMES = {"glm4": "GLM-4", "chatglm3": "ChatGLM3", "chatglm": "ChatGLM2/3"}
# ChatGLM3's prompt as build_chat_input writes it, as text: [gMASK]sop, then per message <|role|>, its metadata line,
# and " content" (SentencePiece's word-start marker before content encoded on its own); a system message's tools follow
# its content as indented JSON, as the original did.
CHATGLM3_TEMPLATE = (
    "[gMASK]sop{% for message in messages %}"
    "{% set content = message.get('content') or '' %}"
    "{% if message['role'] == 'system' and message.get('tools') is not none %}"
    "{% set content = content ~ '\\n' ~ (message['tools'] | tojson(indent=4)) %}{% endif %}"
    "<|{{ message['role'] }}|>{{ message.get('metadata') or '' }}\n{% if content %} {{ content }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def parse_size(text: str) -> int:
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", text, re.IGNORECASE)
    if not found:
        raise Refused(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or a number of bytes")
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    size = int(float(found.group(1)) * units[(found.group(2) or "").upper()])
    if size < 1:
        raise Refused(f"--max-shard-size {text!r} is not a positive size")
    return size


# ---------------------------------------------------------------------------------------------------------------------
# The source checkpoint
# ---------------------------------------------------------------------------------------------------------------------

def checkpoint_folder(source: Path) -> Path:
    """The folder holding config.json: SOURCE itself, or the snapshot a Hugging Face cache folder's refs/main names."""
    if (source / "config.json").is_file():
        return source
    if (source / "snapshots").is_dir():
        ref = source / "refs" / "main"
        snapshots = sorted(p for p in (source / "snapshots").iterdir() if (p / "config.json").is_file())
        chosen = source / "snapshots" / ref.read_text().strip() if ref.is_file() else None
        if chosen is not None and (chosen / "config.json").is_file():
            return chosen
        if len(snapshots) == 1:
            return snapshots[0]
        raise Refused(f"{source} is a Hugging Face cache folder with {len(snapshots)} snapshots and no refs/main: "
                      "give the snapshot folder to export")
    raise Refused(f"{source} has no config.json: give the folder of a ChatGLM2/3 or GLM-4 checkpoint")


def read_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "chatglm":
        raise Refused(f"{folder / 'config.json'} has model_type {config.get('model_type')!r}, not 'chatglm': this "
                      "tool exports ChatGLM2/3 and GLM-4 checkpoints in the original format")
    if config.get("pre_seq_len"):
        raise Refused(f"pre_seq_len={config['pre_seq_len']} in config.json: a P-tuning v2 prefix has no place in Glm "
                      "(serve this checkpoint with our remote code, or export the base checkpoint without the prefix)")
    if config.get("vision_config"):
        raise Refused("vision_config in config.json: GLM-4V's vision tower has no place in Glm (serve glm-4v-9b with "
                      "our remote code)")
    if config.get("quantization_bit"):
        raise Refused(f"quantization_bit={config['quantization_bit']} in config.json: export the unquantized "
                      "checkpoint, then quantize the export (bitsandbytes, GGUF, ...)")
    for field, value in GLM_LAYOUT.items():
        if config.get(field, value) != value:
            raise Refused(f"{field}={config[field]!r} in config.json: transformers' Glm computes {field}={value!r} "
                          "only; this checkpoint cannot be exported")
    for field in ("hidden_size", "num_layers", "num_attention_heads", "kv_channels", "ffn_hidden_size",
                  "padded_vocab_size"):
        if not isinstance(config.get(field), int):
            raise Refused(f"config.json lacks the integer field {field!r} of a ChatGLM2/3 / GLM-4 config")
    return config


class SourceWeights:
    """The checkpoint's tensors, read one at a time (safetensors files memory-mapped, .bin files loaded mmap)."""

    def __init__(self, folder: Path):
        self.files = {}  # key -> file
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            if (folder / index_name).is_file():
                weight_map = json.loads((folder / index_name).read_text())["weight_map"]
                self.files = {key: folder / name for key, name in weight_map.items()}
                break
        else:
            for pattern in ("model*.safetensors", "pytorch_model*.bin"):
                for path in sorted(folder.glob(pattern)):
                    self.files.update(dict.fromkeys(self._keys(path), path))
                if self.files:
                    break
        if not self.files:
            raise Refused(f"{folder} holds no weights (model*.safetensors or pytorch_model*.bin)")
        self._open = {}

    @staticmethod
    def _keys(path: Path):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), "pt") as handle:
                return list(handle.keys())
        return list(torch.load(str(path), map_location="cpu", mmap=True, weights_only=True))

    def _handle(self, key: str):
        path = self.files.get(key)
        if path is None:
            raise Refused(f"the checkpoint has no weight {key!r}: it is not a complete ChatGLM2/3 / GLM-4 checkpoint")
        if path not in self._open:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                self._open[path] = safe_open(str(path), "pt")
            else:
                self._open[path] = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        return self._open[path]

    def has(self, key: str) -> bool:
        return key in self.files

    def meta(self, key: str):
        """(shape, dtype) without reading the data."""
        handle = self._handle(key)
        if hasattr(handle, "get_slice"):
            part = handle.get_slice(key)
            return tuple(part.get_shape()), SAFETENSORS_DTYPES[part.get_dtype()]
        return tuple(handle[key].shape), handle[key].dtype

    def read(self, key: str):
        handle = self._handle(key)
        return handle.get_tensor(key) if hasattr(handle, "get_tensor") else handle[key]


class Piece:
    """One tensor of the export: rows [start, stop) of a source tensor (all of it when stop is None)."""

    def __init__(self, key, source, shape, dtype, start=0, stop=None):
        self.key, self.source, self.shape, self.dtype, self.start, self.stop = key, source, shape, dtype, start, stop

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def native_pieces(weights: SourceWeights, sizes: SimpleNamespace) -> list:
    """The export's tensors in Glm's names and checkpoint order (the mapping of tools/chatglm_tools/native_glm.py),
    from the source's metadata alone: the fused query_key_value is cut into q/k/v rows."""
    from chatglm_tools.native_glm import glm_weight_map, key_value_heads

    fused_rows = (sizes.num_attention_heads + 2 * key_value_heads(sizes)) * sizes.kv_channels
    pieces = []
    for key, source, rows in glm_weight_map(sizes, weights.has):
        shape, dtype = weights.meta(source)
        if rows is None:
            pieces.append(Piece(key, source, shape, dtype))
            continue
        if shape[0] != fused_rows:
            raise Refused(f"{source} has {shape[0]} rows; the config's heads give {fused_rows}")
        pieces.append(Piece(key, source, (rows[1] - rows[0],) + shape[1:], dtype, *rows))
    return pieces


def write_safetensors(path: Path, pieces: list, weights: SourceWeights) -> None:
    """A safetensors file written tensor by tensor (the format: 8-byte little-endian header size, the JSON header
    with each tensor's dtype, shape and byte range, the data): memory holds one source tensor, not the shard."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for piece in pieces:
        header[piece.key] = {"dtype": SAFETENSORS_NAMES[piece.dtype], "shape": list(piece.shape),
                             "data_offsets": [offset, offset + piece.nbytes]}
        offset += piece.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    cached = (None, None)  # q, k and v come from one fused tensor: read it once
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for piece in pieces:
            if cached[0] != piece.source:
                cached = (piece.source, weights.read(piece.source))
            tensor = cached[1] if piece.stop is None else cached[1][piece.start:piece.stop]
            handle.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        handle.flush()
        os.fsync(handle.fileno())


def write_shards(pieces: list, weights: SourceWeights, folder: Path, max_shard_bytes: int) -> tuple:
    """Shards of at most max_shard_bytes (a larger tensor gets one of its own) and the index; returns (file names,
    dtype of the embedding, total bytes)."""
    groups, current, size = [], [], 0
    for piece in pieces:
        if current and size + piece.nbytes > max_shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(piece)
        size += piece.nbytes
    groups.append(current)
    names, weight_map = [], {}
    for number, group in enumerate(groups):
        name = f"model-{number + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(folder / name, group, weights)
        names.append(name)
        weight_map.update(dict.fromkeys((piece.key for piece in group), name))
    total = sum(piece.nbytes for piece in pieces)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names, pieces[0].dtype, total


# ---------------------------------------------------------------------------------------------------------------------
# Config, generation config, tokenizer
# ---------------------------------------------------------------------------------------------------------------------

def rotary_position_divisor(config: dict, folder: Path) -> float:
    """rope_ratio where the checkpoint divides the rotary positions by it (chatglm2-6b-32k), else 1.0: the
    CHECKPOINT_VARIANTS row named by config.json (chatglm_variant, _name_or_path) or the folder, else by its fields."""
    tokenization = repository_module("tokenization_chatglm")
    row = (tokenization.variant_named(config.get("chatglm_variant")) or tokenization.variant_named(
        config.get("_name_or_path")) or tokenization.variant_named(str(folder)) or tokenization.variant_of_fields(config))
    if row is not None and tokenization.CHECKPOINT_VARIANTS[row]["rotary"] == "positions":
        return float(config.get("rope_ratio", 1))
    return 1.0


def glm_sizes(config: dict, folder: Path) -> SimpleNamespace:
    """What tools/chatglm_tools/native_glm.py reads of a ChatGLMConfig, from config.json."""
    return SimpleNamespace(position_divisor=rotary_position_divisor(config, folder),
        padded_vocab_size=config["padded_vocab_size"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["ffn_hidden_size"], num_layers=config["num_layers"],
        num_attention_heads=config["num_attention_heads"], kv_channels=config["kv_channels"],
        multi_query_attention=config.get("multi_query_attention", False),
        multi_query_group_num=config.get("multi_query_group_num", 1),
        layernorm_epsilon=config.get("layernorm_epsilon", 1e-5), add_qkv_bias=config.get("add_qkv_bias", False),
        seq_length=config.get("seq_length", 2048), rope_ratio=config.get("rope_ratio", 1),
    )


def eos_ids(config: dict, family: str, tokenizer) -> list:
    ids = config.get("eos_token_id")
    ids = list(ids) if isinstance(ids, list) else [ids if ids is not None else tokenizer.eos_token_id]
    if family == "chatglm3":  # chat() stops at the next turn's role too
        ids += [tokenizer.convert_tokens_to_ids(t) for t in ("<|user|>", "<|observation|>")]
    return list(dict.fromkeys(ids))


def llama_cpp_fields(sizes) -> dict:
    """The original's names that llama.cpp's convert_hf_to_gguf.py reads from a Glm checkpoint, which it converts
    with its ChatGLM class: the norm epsilon from layernorm_epsilon (without it 1e-5: GLM-4's is 1.5625e-07), the
    context length from seq_length (without it the hidden size), the rotary base from rope_ratio (without it 10000).
    transformers and vLLM read rms_norm_eps, max_position_embeddings and rope_theta; GlmConfig keeps the extra keys
    as attributes. No rope_ratio where it divides the positions (chatglm2-6b-32k: linear rope scaling), which that
    converter would read as a base."""
    fields = {"layernorm_epsilon": sizes.layernorm_epsilon, "seq_length": sizes.seq_length}
    if sizes.position_divisor == 1.0:
        fields["rope_ratio"] = sizes.rope_ratio
    return fields


def write_config(folder: Path, sizes, dtype, eos: list, pad_id: int) -> None:
    from chatglm_tools.native_glm import native_glm_config

    glm = native_glm_config(sizes, position_divisor=sizes.position_divisor)
    glm.architectures = ["GlmForCausalLM"]
    glm.eos_token_id, glm.pad_token_id = eos, pad_id
    glm.save_pretrained(folder)
    path = folder / "config.json"
    content = json.loads(path.read_text())
    content["torch_dtype"] = str(dtype).removeprefix("torch.")
    content.update(llama_cpp_fields(sizes))
    if "dtype" in content:
        content["dtype"] = content["torch_dtype"]
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def write_generation_config(source: Path, folder: Path, eos: list, pad_id: int) -> None:
    settings = {}
    if (source / "generation_config.json").is_file():
        settings = json.loads((source / "generation_config.json").read_text())
    settings.pop("transformers_version", None)
    settings.update(eos_token_id=eos, pad_token_id=pad_id)
    (folder / "generation_config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def write_tokenizer(source: Path, folder: Path, seq_length: int):
    """tokenizer.json and tokenizer_config.json; returns (family, our slow tokenizer of SOURCE)."""
    from convert_tokenizer_to_fast import build_fast_tokenizer, family_of, tokenizer_json

    model_path = source / "tokenizer.model"
    if not model_path.is_file():
        raise Refused(f"{source} has no tokenizer.model: the export needs the checkpoint's tokenizer")
    try:
        family = family_of(model_path)
        (folder / "tokenizer.json").write_bytes(tokenizer_json(build_fast_tokenizer(model_path)))
    except ValueError as error:  # a damaged or foreign tokenizer.model; the message names the file
        raise Refused(str(error)) from None
    tokenization = repository_module("tokenization_chatglm")
    ChatGLM4Tokenizer, ChatGLMTokenizer = tokenization.ChatGLM4Tokenizer, tokenization.ChatGLMTokenizer
    keep_glm4_tool_heading_newlines = tokenization.keep_glm4_tool_heading_newlines

    slow_class = ChatGLM4Tokenizer if family == "glm4" else ChatGLMTokenizer
    slow = slow_class(vocab_file=str(model_path))
    source_settings = {}
    if (source / "tokenizer_config.json").is_file():
        source_settings = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    if family == "glm4":
        # GLM-4's own template (the checkpoint's, else this repository's copy of glm-4-9b-chat's), with the newline
        # before each tool's heading that transformers' trim_blocks drops kept, as our tokenizer renders it.
        template = keep_glm4_tool_heading_newlines(source_settings.get("chat_template") or json.loads(
            (REPO / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"])
        special = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    else:
        template = CHATGLM3_TEMPLATE
        special = {"eos_token": "</s>", "pad_token": "<unk>", "unk_token": "<unk>"}
    settings = dict(special, tokenizer_class="PreTrainedTokenizerFast", chat_template=template,
                    add_bos_token=False,  # the [gMASK] sop prefix comes from the post-processor / the template
                    clean_up_tokenization_spaces=False, padding_side="left", model_max_length=seq_length,
                    model_input_names=["input_ids", "attention_mask"])
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
    return family, slow


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------

def model_only_settings(folder: Path, config: dict) -> tuple:
    """(family, eos ids, pad id) of an export without a tokenizer: the ids config.json gives."""
    family = "glm4" if config.get("padded_vocab_size", 0) > 100000 else "chatglm"
    eos = config.get("eos_token_id")
    return family, list(eos) if isinstance(eos, list) else [eos] if eos is not None else [], config.get("pad_token_id")


def export(source: Path, output: Path, max_shard_bytes: int, with_tokenizer: bool = True) -> int:
    folder = checkpoint_folder(source)
    config = read_config(folder)
    output = Path(os.path.abspath(output))
    if output.exists() or output.is_symlink():
        raise Refused(f"{output} exists: give a new folder (the export never writes into an existing one)")
    if output == folder.resolve() or folder.resolve() in output.parents or source.resolve() in output.parents:
        raise Refused(f"{output} is inside the checkpoint {folder}: the export writes a new folder and never into "
                      "the source")
    if not output.parent.is_dir():
        raise Refused(f"{output.parent} does not exist: create it, or give OUTPUT in an existing folder")
    sizes = glm_sizes(config, folder)
    staging = output.parent / f".{output.name}.export-{os.getpid()}"
    try:
        staging.mkdir()
        if with_tokenizer:
            family, slow = write_tokenizer(folder, staging, sizes.seq_length)
            eos = eos_ids(config, family, slow)
            pad_id = config.get("pad_token_id", slow.pad_token_id)
        else:
            family, eos, pad_id = model_only_settings(folder, config)
        if pad_id is not None and not 0 <= pad_id < sizes.padded_vocab_size:
            pad_id = None  # Glm's embedding takes the pad id as padding_idx, which must be a row of it
        weights = SourceWeights(folder)
        shards, dtype, total = write_shards(native_pieces(weights, sizes), weights, staging, max_shard_bytes)
        write_config(staging, sizes, dtype, eos, pad_id)
        write_generation_config(folder, staging, eos, pad_id)
        os.rename(staging, output)  # the whole export appears at once
    except (Refused, KeyboardInterrupt):
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise Failed(f"writing {output} failed ({error.strerror or error}); nothing was written") from None
    except Exception:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    interpolated = sizes.position_divisor != 1.0
    rotary = (f"rope base 10000, positions / {sizes.position_divisor:g} (linear rope scaling)" if interpolated
              else f"rope base {10000 * sizes.rope_ratio:g}")
    report(f"exported the {FAMILY_NAMES[family]} checkpoint {folder} to {output} (transformers' Glm, no remote code)",
           [f"config.json: GlmForCausalLM, {sizes.num_layers} layers, {rotary}, "
            f"{str(dtype).removeprefix('torch.')}, eos {eos}",
            f"{len(shards)} weight shard(s), {total / 1e9:.2f} GB, with model.safetensors.index.json",
            "tokenizer.json, tokenizer_config.json (PreTrainedTokenizerFast, chat template), generation_config.json"
            if with_tokenizer else "generation_config.json; no tokenizer (--without-tokenizer): load it from "
            f"{folder} with trust_remote_code=True"])
    print(f"load it with (transformers >= {'4.48' if interpolated else '4.46'}):\n"
          f"  AutoModelForCausalLM.from_pretrained({str(output)!r})"
          + (f"; AutoTokenizer.from_pretrained({str(output)!r})" if with_tokenizer else ""))
    print(f"serve it: vllm serve {output}   |   llama.cpp: " + llama_cpp_route(sizes, output))
    return 0


def llama_cpp_route(sizes, output: Path) -> str:
    """How llama.cpp takes the export, or why it cannot."""
    if sizes.position_divisor != 1.0:
        return ("not this checkpoint (convert_hf_to_gguf.py reads no rope scaling for Glm: the GGUF would rotate "
                "undivided positions)")
    if sizes.kv_channels * sizes.num_attention_heads != sizes.hidden_size:
        # Its converter writes no key length for this architecture; llama.cpp then takes hidden / heads.
        return (f"not this checkpoint (a GGUF of it has heads of hidden_size / num_attention_heads = "
                f"{sizes.hidden_size // sizes.num_attention_heads}, not kv_channels = {sizes.kv_channels})")
    return f"python convert_hf_to_gguf.py {output} --outfile model.gguf"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="ChatGLM2/3 or GLM-4 checkpoint folder (or Hugging Face cache folder)")
    parser.add_argument("output", type=Path, help="the new folder to write")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD, help=f"largest weight file (default {DEFAULT_SHARD})")
    parser.add_argument("--without-tokenizer", action="store_true",
                        help="the model only (ChatGLM2 has no fast tokenizer here: keep using its own tokenizer)")
    args = parser.parse_args(argv)
    return exit_code(lambda: export(args.source, args.output, parse_size(args.max_shard_size),
                                    with_tokenizer=not args.without_tokenizer))


if __name__ == "__main__":
    sys.exit(main())
