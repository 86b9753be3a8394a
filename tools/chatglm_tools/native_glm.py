"""Conversion of a ChatGLM checkpoint to transformers' own GlmForCausalLM (transformers >= 4.46): an independent
implementation of the same architecture to compare against. Shared by the tests (parity) and by
benchmarks/model_benchmark.py (speed and memory).

Layout facts: the fused `query_key_value` is [all q | all k | all v] (multi-query attention); `dense_h_to_4h` is
[gate | up], like Glm's `gate_up_proj`; the rotary base is 10000 * rope_ratio and half of each head turns, as
interleaved pairs (Glm's partial_rotary_factor 0.5); chatglm2-6b-32k instead divides the positions by rope_ratio
with the base 10000, which is Glm's linear RoPE scaling.
"""
import inspect
import json
import re
from pathlib import Path

import torch
import transformers


def native_glm_config(config, rope_theta=None, position_divisor=1.0):
    """GlmConfig for a ChatGLMConfig. `rope_theta` overrides the base (to show what forgetting rope_ratio does).
    `position_divisor` > 1: the checkpoint divides the positions by rope_ratio with the base 10000 (chatglm2-6b-32k,
    see `rotary_position_divisor`): transformers' linear RoPE scaling, factor = the divisor."""
    interpolated = position_divisor != 1.0
    theta = float(10000 if interpolated else 10000 * config.rope_ratio) if rope_theta is None else float(rope_theta)
    fields = dict(
        vocab_size=config.padded_vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=key_value_heads(config),
        head_dim=config.kv_channels,
        rms_norm_eps=config.layernorm_epsilon,
        attention_bias=config.add_qkv_bias,
        max_position_embeddings=config.seq_length,
        pad_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    scaling = {"rope_type": "linear", "factor": float(position_divisor)} if interpolated else {"rope_type": "default"}
    if "rope_parameters" in inspect.signature(transformers.GlmConfig.__init__).parameters or hasattr(
        transformers.GlmConfig, "rope_parameters"
    ):  # 5.x: one dict holds the base, the rotated share and the scaling
        fields["rope_parameters"] = dict(scaling, rope_theta=theta, partial_rotary_factor=0.5)
    else:  # 4.x: rope_theta and partial_rotary_factor apart, rope_scaling only when there is one
        fields.update(rope_theta=theta, partial_rotary_factor=0.5)
        if interpolated:
            fields["rope_scaling"] = scaling
    return transformers.GlmConfig(**fields)


def glm_reads_rope_scaling() -> bool:
    """Whether the installed transformers' Glm applies a config's RoPE scaling. Its first rotary class (4.46, 4.47)
    took only the base and ignored rope_scaling; later ones are built from the config. Told by behaviour."""
    from transformers.models.glm import modeling_glm

    return "config" in inspect.signature(modeling_glm.GlmRotaryEmbedding.__init__).parameters


def rotary_position_divisor(model) -> float:
    """What our model divides the rotary positions by (1.0 unless the checkpoint is chatglm2-6b-32k)."""
    return float(getattr(model.transformer.rotary_pos_emb, "position_divisor", 1.0))


def key_value_heads(config) -> int:
    """Heads of keys and values: the multi-query groups, or every head without multi-query attention."""
    if getattr(config, "multi_query_attention", True):
        return config.multi_query_group_num
    return config.num_attention_heads


def glm_weight_map(config, has):
    """(Glm key, ChatGLM key, rows) of every Glm weight, in checkpoint order: `rows` is the (start, stop) slice of the
    fused query_key_value that makes q, k or v, else None. `has(key)` tells whether the checkpoint holds the optional
    query_key_value bias."""
    q = config.num_attention_heads * config.kv_channels
    kv = key_value_heads(config) * config.kv_channels
    yield "model.embed_tokens.weight", "transformer.embedding.word_embeddings.weight", None
    for i in range(config.num_layers):
        src, dst = f"transformer.encoder.layers.{i}.", f"model.layers.{i}."
        yield dst + "input_layernorm.weight", src + "input_layernorm.weight", None
        for part in ("weight", "bias"):
            fused = src + f"self_attention.query_key_value.{part}"
            if part == "weight" or has(fused):
                for name, rows in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
                    yield dst + f"self_attn.{name}.{part}", fused, rows
        yield dst + "self_attn.o_proj.weight", src + "self_attention.dense.weight", None
        yield dst + "post_attention_layernorm.weight", src + "post_attention_layernorm.weight", None
        yield dst + "mlp.gate_up_proj.weight", src + "mlp.dense_h_to_4h.weight", None
        yield dst + "mlp.down_proj.weight", src + "mlp.dense_4h_to_h.weight", None
    yield "model.norm.weight", "transformer.encoder.final_layernorm.weight", None
    yield "lm_head.weight", "transformer.output_layer.weight", None


def convert_state_dict(state_dict, config):
    """ChatGLM keys and layout -> GlmForCausalLM's."""
    return {glm: state_dict[source] if rows is None else state_dict[source][rows[0]:rows[1]]
            for glm, source, rows in glm_weight_map(config, state_dict.__contains__)}


def native_glm(model, rope_theta=None, attn_implementation="eager", dtype=torch.float32):
    """A GlmForCausalLM holding the weights of our `model`, in `dtype`, built on the default device."""
    divisor = rotary_position_divisor(model)
    if divisor != 1.0 and not glm_reads_rope_scaling():
        raise ValueError(f"transformers {transformers.__version__}'s GlmForCausalLM ignores rope_scaling, so it cannot "
                         "hold chatglm2-6b-32k's position interpolation: use transformers >= 4.48")
    config = native_glm_config(model.config, rope_theta, divisor)
    config._attn_implementation = attn_implementation
    native = transformers.GlmForCausalLM(config).to(dtype)
    missing, unexpected = native.load_state_dict(convert_state_dict(model.state_dict(), model.config), strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    return native.eval()


def save_native_checkpoint(model, folder) -> Path:
    """Write `model`'s weights as a GlmForCausalLM checkpoint in the model's dtype (config.json, one safetensors
    shard per layer, as save_by_layer writes them), so that a native model loads from disk as ours does."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    native_glm_config(model.config, position_divisor=rotary_position_divisor(model)).save_pretrained(folder)
    save_by_layer(convert_state_dict(model.state_dict(), model.config), folder)
    return folder


def save_by_layer(state_dict: dict, folder) -> None:
    """One safetensors shard per decoder layer (keys `...layers.N....`) and one for the rest, with the index
    file: a checkpoint's layout decides what loading keeps mapped at once, so models compared on memory are saved
    alike. The tensors may be views (the converted ones are); one layer's copies at a time are made for writing,
    so a full-size model is written without a second copy of itself."""
    from safetensors.torch import save_file

    groups = {}
    for key, tensor in state_dict.items():
        layer = re.search(r"\.layers\.(\d+)\.", key)
        groups.setdefault(layer.group(1) if layer else "outer", {})[key] = tensor
    weight_map = {}
    for number, group in enumerate(groups.values()):
        name = f"model-{number + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in group.items()}, str(Path(folder) / name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, name))
    (Path(folder) / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
