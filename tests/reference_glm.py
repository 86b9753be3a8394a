"""A plain reference forward of the ChatGLM architecture, written from the description of the original code rather
than from our module: float64, sequence-first ([seq, batch, hidden]) as the original, explicit pairs for the rotary
embedding and an explicit key/value head per query head. No cache, no padding: the truth for config flags that
neither the goldens nor GlmForCausalLM cover. A P-tuning v2 prefix, when the state dict has one, is computed from its
encoder weights and put in front of each layer's keys and values, unrotated, with the tokens at positions 0..n-1."""
import math

import torch


def _norm(x, sd, prefix, config):
    weight = sd[prefix + ".weight"].double()
    if config.rmsnorm:
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon)
    bias = sd[prefix + ".bias"].double()
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return weight * (x - mean) / torch.sqrt(var + config.layernorm_epsilon) + bias


def _linear(x, sd, prefix):
    y = x @ sd[prefix + ".weight"].double().T
    bias = sd.get(prefix + ".bias")
    return y if bias is None else y + bias.double()


def _rotate(t, positions, config):
    """t: [seq, batch, heads, dim]; turn pairs (2j, 2j+1) of the first kv_channels/2 channels."""
    rot = config.kv_channels // 2
    base = 10000 * config.rope_ratio
    if getattr(config, "chatglm_variant", None) == "chatglm2-6b-32k":  # FORMAT.md: positions / rope_ratio, base 10000
        base, positions = 10000, positions / config.rope_ratio
    out = t.clone()
    for j in range(rot // 2):
        theta = 1.0 / base ** (2 * j / rot)
        angle = positions[:, None, None].double() * theta
        x0, x1 = t[..., 2 * j], t[..., 2 * j + 1]
        out[..., 2 * j] = x0 * torch.cos(angle) - x1 * torch.sin(angle)
        out[..., 2 * j + 1] = x1 * torch.cos(angle) + x0 * torch.sin(angle)
    return out


def _prefix(sd, config):
    """[P, 2 * layers, kv_heads, dim] from `transformer.prefix_encoder.*`, or None: embedding, then (with
    prefix_projection) Linear, tanh, Linear."""
    weight = sd.get("transformer.prefix_encoder.embedding.weight")
    if weight is None:
        return None
    out = weight.double()
    if "transformer.prefix_encoder.trans.0.weight" in sd:
        out = _linear(torch.tanh(_linear(out, sd, "transformer.prefix_encoder.trans.0")), sd,
                      "transformer.prefix_encoder.trans.2")
    kv_heads = config.multi_query_group_num if config.multi_query_attention else config.num_attention_heads
    return out.reshape(out.shape[0], 2 * config.num_layers, kv_heads, config.kv_channels)


def _attention(x, sd, prefix, config, layer_prefix=None):
    seq, batch, _ = x.shape
    heads, dim = config.num_attention_heads, config.kv_channels
    kv_heads = config.multi_query_group_num if config.multi_query_attention else heads
    mixed = _linear(x, sd, prefix + ".query_key_value")
    if config.multi_query_attention:
        q = mixed[..., : heads * dim].reshape(seq, batch, heads, dim)
        k = mixed[..., heads * dim: (heads + kv_heads) * dim].reshape(seq, batch, kv_heads, dim)
        v = mixed[..., (heads + kv_heads) * dim:].reshape(seq, batch, kv_heads, dim)
    else:  # per head: [q | k | v]
        per_head = mixed.reshape(seq, batch, heads, 3 * dim)
        q, k, v = per_head[..., :dim], per_head[..., dim: 2 * dim], per_head[..., 2 * dim:]
    positions = torch.arange(seq)
    q, k = _rotate(q, positions, config), _rotate(k, positions, config)
    causal = torch.ones(seq, seq).tril().bool()
    if layer_prefix is not None:  # (key, value) [P, kv_heads, dim]: unrotated, seen by every query
        slots = layer_prefix[0].shape[0]
        k = torch.cat([layer_prefix[0][:, None].expand(slots, batch, kv_heads, dim), k])
        v = torch.cat([layer_prefix[1][:, None].expand(slots, batch, kv_heads, dim), v])
        causal = torch.cat([torch.ones(seq, slots).bool(), causal], dim=1)
    context = torch.empty(seq, batch, heads, dim, dtype=torch.float64)
    for h in range(heads):
        g = h // (heads // kv_heads)
        scores = torch.einsum("sbd,tbd->bst", q[:, :, h], k[:, :, g]) / math.sqrt(dim)
        scores = scores.masked_fill(~causal, float("-inf"))
        context[:, :, h] = torch.einsum("bst,tbd->sbd", scores.softmax(-1), v[:, :, g])
    return _linear(context.reshape(seq, batch, heads * dim), sd, prefix + ".dense")


def _mlp(x, sd, prefix):
    gate, up = _linear(x, sd, prefix + ".dense_h_to_4h").chunk(2, dim=-1)
    return _linear(gate * torch.sigmoid(gate) * up, sd, prefix + ".dense_4h_to_h")


def reference_logits(state_dict, config, input_ids):
    sd = {k: v.detach().cpu() for k, v in state_dict.items()}
    x = sd["transformer.embedding.word_embeddings.weight"].double()[input_ids].transpose(0, 1)
    prefix = _prefix(sd, config)
    for i in range(config.num_layers):
        p = f"transformer.encoder.layers.{i}"
        layer_prefix = None if prefix is None else (prefix[:, 2 * i], prefix[:, 2 * i + 1])
        normed = _norm(x, sd, p + ".input_layernorm", config)
        residual = normed if config.apply_residual_connection_post_layernorm else x
        x = residual + _attention(normed, sd, p + ".self_attention", config, layer_prefix)
        normed = _norm(x, sd, p + ".post_attention_layernorm", config)
        residual = normed if config.apply_residual_connection_post_layernorm else x
        x = residual + _mlp(normed, sd, p + ".mlp")
    if config.post_layer_norm:
        x = _norm(x, sd, "transformer.encoder.final_layernorm", config)
    logits = x @ sd["transformer.output_layer.weight"].double().T
    return logits.transpose(0, 1).float()
