"""The call contracts of the original modules (issue 43): how each parent calls its child, with what, and what comes
back, as recorded from the original code (testdata/surface/glm4-calls.json, chatglm3-calls.json). Tools reach that
far: optimum-intel's OpenVINO export replaces every `core_attention.forward` with a function of GLM-4's original
contract, GPTQModel replaces the encoder's forward with the original's and replays each layer with the arguments
it captured. Each is done here the way the tool does it, with functions this file writes from the contract facts,
against the unpatched model (fp32).

Families: GLM-4 and ChatGLM3 (their records), ChatGLM2 and chatglm2-6b-32k (a chatglm2-6b folder: the same rule;
32k's rotary divides the positions). Our layout is batch-first for every family: GLM-4's original is too, so its
shapes and masks are compared one to one; ChatGLM2/3's originals are sequence-first, so for them names, call arity
and return structure are.
"""
import copy
import inspect
import json
import math
import pickle
import types
from functools import partial

import pytest
import torch
from torch import nn

from chatglm_tools import kv_cache, shared_path
from conftest import random_model, tiny_config_dict

# family -> (config family, config overrides): ChatGLM2 is a chatglm2-6b folder (its variant row), 32k its own
FAMILY_MODELS = {"glm4": ("glm4", {}), "chatglm3": ("chatglm3", {}),
                 "chatglm2": ("chatglm3", {"_name_or_path": "THUDM/chatglm2-6b"}),
                 "chatglm2-32k": ("chatglm3", {"_name_or_path": "THUDM/chatglm2-6b-32k", "rope_ratio": 16})}
RECORDS = {"glm4": "glm4", "chatglm3": "chatglm3", "chatglm2": "chatglm3", "chatglm2-32k": "chatglm3"}
IDS = torch.tensor([[11, 12, 13, 14, 15, 16], [0, 0, 21, 22, 23, 24]])  # row 2 left-padded, as recorded
PADDING = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])


def build(chatglm, family: str, implementation: str = "sdpa", seed: int = 0, **overrides):
    config_family, family_overrides = FAMILY_MODELS[family]
    return random_model(chatglm, tiny_config_dict(config_family, **family_overrides, **overrides), seed,
                        implementation)


# ---- functions written to the original's contracts (the facts of testdata/surface) ----------------------------------

def contract_core_attention(self, query_layer, key_layer, value_layer, attention_mask):
    """GLM-4's original core_attention call: query, key, value [batch, heads, seq, dim] with the keys and values
    already repeated to every query head; a boolean mask, True where a query must NOT look; one [batch, seq,
    heads * dim] tensor back. (What optimum-intel's export patch relies on.)"""
    assert key_layer.shape[1] == value_layer.shape[1] == query_layer.shape[1]
    assert attention_mask.dtype == torch.bool and attention_mask.shape[-1] == key_layer.shape[-2]
    scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / math.sqrt(query_layer.shape[-1])
    scores = scores.float().masked_fill(attention_mask, float("-inf"))
    context = torch.matmul(torch.softmax(scores, dim=-1).to(value_layer.dtype), value_layer)
    return context.transpose(1, 2).flatten(2)


class ContractCoreAttention(nn.Module):
    """A whole module in core_attention's place, with the original's contract."""

    forward = contract_core_attention


def contract_encoder_forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_caches=None, use_cache=True,
                             output_hidden_states=False):
    """The original GLMTransformer.forward's body, as GPTQModel installs it on the encoder's class: each layer from
    _get_layer(i), called with keywords, its (hidden_states, kv_cache) unpacked; the first cache decides whether the
    presents are a tuple (decode) or one concatenated tensor (prefill); a 4-tuple back, the final norm last."""
    if not kv_caches:
        kv_caches = [None for _ in range(self.num_layers)]
    presents = () if use_cache else None
    all_hidden_states = () if output_hidden_states else None
    for index in range(self.num_layers):
        if output_hidden_states:
            all_hidden_states = all_hidden_states + (hidden_states,)
        layer = self._get_layer(index)
        hidden_states, kv_cache = layer(hidden_states, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                        kv_cache=kv_caches[index], use_cache=use_cache)
        if use_cache:
            if kv_caches[0] is not None:
                presents = presents + (kv_cache,)
            elif len(presents) == 0:
                presents = kv_cache
            else:
                presents = torch.cat((presents, kv_cache.to(presents.device)), dim=0)
    if output_hidden_states:
        all_hidden_states = all_hidden_states + (hidden_states,)
    if self.post_layer_norm:
        hidden_states = self.final_layernorm(hidden_states)
    return hidden_states, presents, all_hidden_states, None


def patched_cores(model, whole_module: bool):
    """Every layer's core_attention replaced by the contract: its forward (as optimum-intel does) or the module."""
    for layer in model.transformer.encoder.layers:
        if whole_module:
            layer.self_attention.core_attention = ContractCoreAttention()
        else:
            core = layer.self_attention.core_attention
            core.forward = types.MethodType(contract_core_attention, core)
    return model


def steps_logits(model, steps: int = 3):
    """Logits of the padded prefill and of `steps` cached greedy decode steps (explicit positions, as generate())."""
    with torch.no_grad():
        out = model(IDS, attention_mask=PADDING, position_ids=(PADDING.cumsum(-1) - 1).clamp(min=0), use_cache=True)
        logits, cache, mask = [out.logits], out.past_key_values, PADDING
        position = PADDING.sum(-1, keepdim=True)
        for _ in range(steps):
            token = logits[-1][:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], -1)
            out = model(token, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache, position = out.past_key_values, position + 1
    return [step * PADDING[:, :, None] for step in logits[:1]] + logits[1:]  # padded positions hold no token


def assert_same_logits(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


# ---- 1. core_attention replaced (optimum-intel's OpenVINO export) -------------------------------------------------

@pytest.mark.parametrize("whole_module", [False, True], ids=["forward", "module"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_core_attention_replaced_by_the_original_contract_computes_the_same(chatglm, family, implementation,
                                                                             whole_module):
    expected = steps_logits(build(chatglm, family, implementation))
    model = patched_cores(build(chatglm, family, implementation), whole_module)
    assert_same_logits(steps_logits(model), expected)
    # the layer's sizes are its own, not read from the module in core_attention's place
    attention = model.transformer.encoder.layers[0].self_attention
    assert attention.num_attention_heads_per_partition == model.config.num_attention_heads


def test_core_attention_replaced_gets_one_mask_per_step_and_heads_repeated(chatglm):
    """What the replacement is handed on the hot path's cheapest steps too: a prompt without padding and a decode
    step (where our own kernels take no mask at all) come with the original's boolean mask."""
    model = build(chatglm, "glm4")
    seen = []
    core = model.transformer.encoder.layers[0].self_attention.core_attention

    def recording(self, query_layer, key_layer, value_layer, attention_mask):
        seen.append((tuple(key_layer.shape), attention_mask.tolist()))
        return contract_core_attention(self, query_layer, key_layer, value_layer, attention_mask)

    core.forward = types.MethodType(recording, core)
    with torch.no_grad():
        out = model(IDS[:1, :3], use_cache=True)
        model(IDS[:1, 3:4], past_key_values=out.past_key_values, use_cache=True)
    heads, dim = model.config.num_attention_heads, model.config.kv_channels
    causal = [[[False, True, True], [False, False, True], [False, False, False]]]
    assert seen == [((1, heads, 3, dim), [causal]), ((1, heads, 4, dim), [[[[False] * 4]]])]


# ---- 2. the encoder's forward replaced by the original's (GPTQModel) ------------------------------------------

class OriginalEncoderForward:
    """The original GLMTransformer.forward installed on the encoder's class, as GPTQModel's monkey patch does."""

    def __init__(self, chatglm):
        self.encoder_class = chatglm.modeling.GLMTransformer
        self.calls = 0

    def __enter__(self):
        self.own = self.encoder_class.forward

        def forward(encoder, *args, **kwargs):
            self.calls += 1
            return contract_encoder_forward(encoder, *args, **kwargs)

        self.encoder_class.forward = forward
        return self

    def __exit__(self, *exc):
        self.encoder_class.forward = self.own


def greedy_tokens(model):
    with torch.no_grad():
        return model.generate(IDS, attention_mask=PADDING, max_new_tokens=5, do_sample=False, min_new_tokens=5)


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_encoder_forward_of_the_original_runs_the_model(chatglm, family):
    model = build(chatglm, family)
    expected, expected_tokens = steps_logits(model), greedy_tokens(model)
    with OriginalEncoderForward(chatglm) as patched:
        assert_same_logits(steps_logits(model), expected)
        assert torch.equal(greedy_tokens(model), expected_tokens)
    assert patched.calls == 4 + 5  # the prefill and 3 steps, then generate()'s 5 forwards


# ---- 3. a GPTQ-style layer replay (GPTQModel) ---------------------------------------------------------------------

def moved(value, device):
    """What a quantizer's capture does to a keyword argument: tensors to the calibration device, lists and tuples
    rebuilt with their own type, anything else kept as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)([moved(item, device) for item in value])
    return value


@pytest.mark.parametrize("replayed_mask", ["captured", "none"])
@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_layer_replay_gives_the_models_own_hidden_states(chatglm, family, replayed_mask):
    """GPTQModel's flow: the original encoder forward installed, a forward pre-hook on layer 0 captures its first
    positional argument and its keywords (the attention mask apart, moved with `.to(device=)`) and stops the
    forward; each layer is then called on the previous one's output with `use_cache=False` and those keywords
    (the mask as captured; or None where the tool does not batch, on a batch without padding). The outputs are the
    model's own hidden states."""
    model = build(chatglm, family)
    ids, padding = (IDS, PADDING) if replayed_mask == "captured" else (IDS + 30, torch.ones_like(PADDING))
    position_ids = (padding.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(ids, attention_mask=padding, position_ids=position_ids, use_cache=False,
                         output_hidden_states=True).hidden_states
    captured = {}

    class Stop(Exception):
        pass

    def capture(module, args, kwargs):
        captured["hidden_states"] = args[0]
        mask = kwargs.get("attention_mask")
        captured["attention_mask"] = None if mask is None else mask.to(device=torch.device("cpu"))
        captured["kwargs"] = {name: moved(value, torch.device("cpu")) for name, value in kwargs.items()
                              if name not in ("hidden_states", "attention_mask", "position_ids")}
        raise Stop

    layers = model.transformer.encoder.layers
    with OriginalEncoderForward(chatglm), torch.no_grad():
        hook = layers[0].register_forward_pre_hook(capture, with_kwargs=True)
        try:
            with pytest.raises(Stop):
                model(ids, attention_mask=padding, position_ids=position_ids, use_cache=False)
        finally:
            hook.remove()
        hidden_states = captured["hidden_states"]
        mask = captured["attention_mask"] if replayed_mask == "captured" else None
        for index, layer in enumerate(layers):
            torch.testing.assert_close(hidden_states, expected[index], atol=1e-5, rtol=1e-5)
            output = layer(hidden_states, attention_mask=mask, **{**captured["kwargs"], "use_cache": False})
            assert isinstance(output, tuple) and len(output) == 2 and output[1] is None
            hidden_states = output[0]
        final = model.transformer.encoder.final_layernorm(hidden_states)
    torch.testing.assert_close(final, expected[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("replaced", ["layer", "self_attention"])
@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_a_replaced_layer_or_attention_forward_is_handed_the_originals_values(chatglm, family, replaced):
    """A tool's forward in a layer's or its self_attention's place (AutoRound replaces a block's forward to capture
    its inputs) is called with the original's values: the rotary rows, the boolean mask True where a query must
    not look. Calling this file's forward with them gives the model's own logits."""
    model = build(chatglm, family)
    expected = steps_logits(model)
    module = model.transformer.encoder.layers[1]
    module = module if replaced == "layer" else module.self_attention
    seen = []

    def forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=None, use_cache=True):
        seen.append((type(attention_mask), type(rotary_pos_emb)))
        assert isinstance(rotary_pos_emb, torch.Tensor) and rotary_pos_emb.shape[-1] == 2
        assert attention_mask is None or attention_mask.dtype == torch.bool
        return type(self).forward(self, hidden_states, attention_mask, rotary_pos_emb, kv_cache=kv_cache,
                                  use_cache=use_cache)

    module.forward = types.MethodType(forward, module)
    assert_same_logits(steps_logits(model), expected)
    assert seen[0] == (torch.Tensor, torch.Tensor)  # the padded prompt comes with the original's mask
    assert len(seen) == 4


def original_tensors(model, ids, padding, position_ids, past=None):
    """What the original GLM-4 ChatGLMModel.forward hands its encoder: the embeddings, its mask (get_masks, the
    original's helper: True where a query must not look, None without padding in a prompt or a decode step), the
    rows of its rotary table at the position ids."""
    transformer = model.transformer
    new = ids.shape[1]
    mask = None
    if not bool(padding.all()) or (past is not None and new != 1):
        mask = transformer.get_masks(ids, past, padding_mask=padding)
    rotary = transformer.rotary_pos_emb(transformer.seq_length)[position_ids]
    return transformer.embedding(ids), mask, rotary


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_glm4_modules_called_with_the_originals_tensors_return_the_originals_results(chatglm, implementation):
    """GLM-4 (batch first, as ours): each layer, layer 0's self_attention and the encoder, called exactly as the
    original calls them with the original's tensors, return the model's own hidden states (1e-5) in the original's
    formats: a prompt's keys and values as one tensor [1, 2, batch, kv_heads, seq, dim] per layer, concatenated
    over the layers by the encoder; a decode step's as the (keys, values) pairs of every token so far."""
    model = build(chatglm, "glm4", implementation)
    transformer, config = model.transformer, model.config
    position_ids = (PADDING.cumsum(-1) - 1).clamp(min=0)
    attention_outputs = []
    handle = transformer.encoder.layers[0].self_attention.register_forward_hook(
        lambda module, args, output: attention_outputs.append(output[0]))
    try:
        with torch.no_grad():
            ours = model(IDS, attention_mask=PADDING, position_ids=position_ids, use_cache=True,
                         output_hidden_states=True)
    finally:
        handle.remove()
    expected = ours.hidden_states
    layers = transformer.encoder.layers
    with torch.no_grad():
        hidden, mask, rotary = original_tensors(model, IDS, PADDING, position_ids)
        torch.testing.assert_close(hidden, expected[0])
        attention, present = layers[0].self_attention(layers[0].input_layernorm(hidden), mask, rotary,
                                                      kv_cache=None, use_cache=True)
        torch.testing.assert_close(attention, attention_outputs[0], atol=1e-5, rtol=1e-5)
        kv_heads = config.multi_query_group_num
        assert present.shape == (1, 2, 2, kv_heads, 6, config.kv_channels)
        for index, layer in enumerate(layers[:-1]):
            hidden, _ = layer(hidden, mask, rotary, kv_cache=None, use_cache=True)
            torch.testing.assert_close(hidden, expected[index + 1], atol=1e-5, rtol=1e-5)
        encoded, presents, all_hidden, attentions = transformer.encoder(
            expected[0], mask, rotary_pos_emb=rotary, kv_caches=None, use_cache=True, output_hidden_states=False)
        torch.testing.assert_close(encoded, expected[-1], atol=1e-5, rtol=1e-5)
        assert all_hidden is None and attentions is None
        assert presents.shape == (config.num_layers, 2, 2, kv_heads, 6, config.kv_channels)
        cache = kv_cache.returned(ours)
        for index in range(config.num_layers):  # the same keys and values as this model's cache
            torch.testing.assert_close(presents[index, 0], kv_cache.layer_tensors(cache)[index][0], atol=1e-5, rtol=1e-5)

        # one decode step on the original's pairs, as its ChatGLMModel splits the prompt's presents
        pairs = tuple((presents[index, 0], presents[index, 1]) for index in range(config.num_layers))
        token, step_mask = torch.tensor([[74], [196]]), torch.cat([PADDING, torch.ones(2, 1, dtype=torch.long)], -1)
        step_positions = position_ids[:, -1:] + 1
        hidden, mask, rotary = original_tensors(model, token, step_mask, step_positions, past=pairs)
        encoded, step_presents, _, _ = transformer.encoder(hidden, mask, rotary_pos_emb=rotary, kv_caches=pairs,
                                                           use_cache=True)
        step = model(token, attention_mask=step_mask, position_ids=step_positions, use_cache=True,
                     output_hidden_states=True, **kv_cache.argument(cache))
    torch.testing.assert_close(encoded, step.hidden_states[-1], atol=1e-5, rtol=1e-5)
    assert isinstance(step_presents, tuple) and len(step_presents) == config.num_layers
    assert all(keys.shape[-2] == 7 for keys, _ in step_presents)


@pytest.mark.parametrize("family", ["chatglm3", "chatglm2"])
def test_sequence_first_tensors_get_an_error_naming_the_layout(chatglm, family):
    """ChatGLM2/3's originals are sequence-first ([seq, batch, hidden]); this model's layers are batch-first for every
    family. A layer called with sequence-first tensors says which layout it takes instead of computing on them."""
    model = build(chatglm, family)
    transformer = model.transformer
    position_ids = (PADDING.cumsum(-1) - 1).clamp(min=0)
    hidden, mask, rotary = original_tensors(model, IDS, PADDING, position_ids)
    with pytest.raises(ValueError, match=r"batch-first.*hidden_states \[batch, seq, hidden\].*sequence-first"), \
            torch.no_grad():
        transformer.encoder.layers[0](hidden.transpose(0, 1), mask, rotary.transpose(0, 1), kv_cache=None,
                                      use_cache=False)


# ---- 3b. an AutoRound-style capture and replay (AutoRound) ----------------------------------------------------------

class Dropped:
    """What a capture that keeps only some types leaves of an argument it does not keep."""


def kept_as_autoround_keeps(value):
    """An argument as AutoRound's capture keeps it (auto_round 0.16's block-input cache and its to_device): a tensor
    moved to the CPU, a list or tuple rebuilt as a plain list or tuple of its kept items, a string, bool or None as
    it is; an object of any other class is not kept (Dropped)."""
    if isinstance(value, torch.Tensor):
        return value.to("cpu")
    if isinstance(value, (list, tuple)):
        items = [kept_as_autoround_keeps(item) for item in value]
        return tuple(items) if isinstance(value, tuple) else items
    if value is None or isinstance(value, (str, bool)):
        return value
    return Dropped()


def contains_dropped(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(contains_dropped(item) for item in value)
    return isinstance(value, Dropped)


@pytest.mark.parametrize("captured_by", ["replaced forward", "hook"])
@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_layer_inputs_kept_as_autoround_keeps_them_replay_after_deepcopy_and_pickle(chatglm, family, captured_by):
    """AutoRound's flow: layer 0's forward replaced on the instance by one that records its arguments and calls the
    layer's own forward (or, as a tool that only reads, a forward pre-hook), the arguments kept as AutoRound keeps
    them (tensors, plain lists and tuples, strings, bools, None); then each layer, its own forward restored, replayed
    on the previous one's output with layer 0's other arguments: as kept, deep-copied and pickled. Nothing is dropped
    (AutoRound dropped the LayerInputs object, and the replay failed on a missing rotary_pos_emb), and the replay gives
    the model's own hidden states."""
    model = build(chatglm, family)
    position_ids = (PADDING.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(IDS, attention_mask=PADDING, position_ids=position_ids, use_cache=False,
                         output_hidden_states=True).hidden_states
    layers = model.transformer.encoder.layers
    captured = []

    def record(args, kwargs):
        captured.append((kept_as_autoround_keeps(args), {name: kept_as_autoround_keeps(value)
                                                         for name, value in kwargs.items()}))

    if captured_by == "hook":
        handle = layers[0].register_forward_pre_hook(lambda module, args, kwargs: record(args[1:], kwargs),
                                                     with_kwargs=True)
    else:
        def forward(self, hidden_states, *args, **kwargs):
            record(args, kwargs)
            return type(self).forward(self, hidden_states, *args, **kwargs)

        layers[0].forward = types.MethodType(forward, layers[0])
    with torch.no_grad():
        model(IDS, attention_mask=PADDING, position_ids=position_ids, use_cache=False)
    if captured_by == "hook":
        handle.remove()
    else:
        del layers[0].forward
    assert len(captured) == 1 and not contains_dropped(captured[0])
    copies = {"as kept": lambda value: value, "deep-copied": copy.deepcopy,
              "pickled": lambda value: pickle.loads(pickle.dumps(value))}
    for how, copied in copies.items():
        args, kwargs = copied(captured[0])
        hidden_states = expected[0]
        with torch.no_grad():
            for index, layer in enumerate(layers):
                hidden_states, cache = layer(hidden_states, *args, **{**kwargs, "use_cache": False})
                assert cache is None
                if index + 1 < len(layers):
                    torch.testing.assert_close(hidden_states, expected[index + 1], atol=1e-5, rtol=1e-5, msg=how)
            final = model.transformer.encoder.final_layernorm(hidden_states)
        torch.testing.assert_close(final, expected[-1], atol=1e-5, rtol=1e-5, msg=how)


# ---- 4. the record: our modules against the original's, recorded the same way ----------------------------------
RECORDED_PATHS = ("transformer.embedding", "transformer.rotary_pos_emb", "transformer.encoder",
                  "transformer.encoder.layers.0", "transformer.encoder.layers.0.self_attention",
                  "transformer.encoder.layers.0.self_attention.core_attention", "transformer.encoder.layers.0.mlp",
                  "transformer.encoder.final_layernorm", "transformer.output_layer")
# Where this model hands over its own values, cheaper than the original's (modeling_chatglm.py, "Module contracts"):
# (module path, argument or "return[i]" / "return") -> what it is. Everything else is the original's.
OUR_VALUES = {
    ("transformer.rotary_pos_emb", "0"): "positions", ("transformer.rotary_pos_emb", "return"): "tables",
    ("transformer.encoder", "1"): "kernel mask", ("transformer.encoder", "rotary_pos_emb"): "LayerInputs",
    ("transformer.encoder", "kv_caches"): "caches", ("transformer.encoder", "return[1]"): "caches",
    ("transformer.encoder.layers.0", "1"): "kernel mask", ("transformer.encoder.layers.0", "2"): "LayerInputs",
    ("transformer.encoder.layers.0", "kv_cache"): "cache", ("transformer.encoder.layers.0", "return[1]"): "cache",
    ("transformer.encoder.layers.0.self_attention", "1"): "kernel mask",
    ("transformer.encoder.layers.0.self_attention", "2"): "LayerInputs",
    ("transformer.encoder.layers.0.self_attention", "kv_cache"): "cache",
    ("transformer.encoder.layers.0.self_attention", "return[1]"): "cache",
    ("transformer.encoder.layers.0.self_attention.core_attention", "1"): "grouped",
    ("transformer.encoder.layers.0.self_attention.core_attention", "2"): "grouped",
    ("transformer.encoder.layers.0.self_attention.core_attention", "3"): "KernelInputs",
}


def load_calls(record: str) -> dict:
    return json.loads(shared_path("surface", f"{record}-calls.json").read_text(encoding="utf-8"))["calls"]


def checksum(tensor: torch.Tensor) -> float:
    """The record's position-weighted checksum: the values in order, weighted 1 .. 2 evenly."""
    values = tensor.detach().flatten().double()
    return round((values * torch.linspace(1, 2, values.numel(), dtype=torch.double)).sum().item(), 6)


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{value.dim()}"
    if value is None or isinstance(value, (bool, int)):
        return "None" if value is None else type(value).__name__
    if isinstance(value, tuple):
        return f"tuple{len(value)}[{','.join(describe(item) for item in value)}]"
    return type(value).__name__


def value_of(tensor: torch.Tensor):
    return [int(x) for x in tensor.flatten().tolist()] if tensor.dtype == torch.bool else checksum(tensor)


def ours(path: str, slot: str, value, cache, recorded=None, batch_first=False) -> bool:
    """Whether `value` is this model's own value where OUR_VALUES says so. With the original's recorded value of
    that slot (GLM-4, batch first as ours): the kernel's mask is the complement of the original's (True where a
    query may look), the grouped keys and values repeat to the original's shape."""
    kind = OUR_VALUES[(path, slot)]
    if kind == "cache":
        return value is cache or (value is None and cache is None)
    if kind == "caches":
        return (value is None and cache is None) or (isinstance(value, tuple) and all(v is cache for v in value))
    if kind == "positions":
        return isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point()
    if kind == "tables":  # (cos, sin) over a head's width, [batch, 1, seq, head_dim]
        return isinstance(value, tuple) and len(value) == 2 and all(t.dim() == 4 for t in value)
    if kind == "kernel mask":
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 4):
            return False
        return not batch_first or value_of(~value) == recorded
    if kind == "grouped":
        return isinstance(value, torch.Tensor) and value.dim() == 4 and (not batch_first or (
            recorded is not None and recorded[1] % value.shape[1] == 0 and
            [value.shape[0], recorded[1], *value.shape[2:]] == recorded))
    return type(value).__name__ == kind


class Recorder:
    """Forward hooks on the nine modules, recording each call as the record describes it."""

    def __init__(self, model):
        self.calls, self.handles = {}, []
        for path in RECORDED_PATHS:
            module = model.get_submodule(path)
            self.handles.append(module.register_forward_hook(partial(self.record, path), with_kwargs=True))

    def record(self, path, module, args, kwargs, output):
        self.calls.setdefault(path, (args, kwargs, output))  # the first call: layer 0's, the prefill's

    def remove(self):
        for handle in self.handles:
            handle.remove()


def record_two_steps(model):
    """The record's forwards: a batch of 2 (row 2 left-padded by 2), explicit position_ids 0..5, cache on; then one
    cached decode step of ids [74], [196] (the record's)."""
    steps = {}
    with torch.no_grad():
        for phase in ("prefill", "decode"):
            recorder = Recorder(model)
            try:
                if phase == "prefill":
                    out = model(IDS, attention_mask=PADDING, position_ids=torch.arange(6).expand(2, -1),
                                use_cache=True)
                    cache = None
                else:
                    cache = out.past_key_values
                    model(torch.tensor([[74], [196]]), attention_mask=torch.cat([PADDING, torch.ones(2, 1)], -1).long(),
                          position_ids=torch.full((2, 1), 6), past_key_values=cache, use_cache=True)
            finally:
                recorder.remove()
            steps[phase] = (recorder.calls, cache if phase == "decode" else out.past_key_values)
    return steps


@pytest.fixture(scope="module")
def record_models(chatglm):
    """family -> (the record, our model built from the recorded tiny config, the attention implementation the
    original ran, the golden checkpoint's embedding rows: the record's decode ids are looked up in them)."""
    from test_surface import load_surface, recorded_config
    from safetensors.torch import load_file

    built = {}
    for family, record in RECORDS.items():
        config = chatglm.ChatGLMConfig(**recorded_config(load_surface(record)))
        config._attn_implementation = "sdpa" if record == "glm4" else "eager"
        if family.startswith("chatglm2"):
            config._name_or_path = FAMILY_MODELS[family][1]["_name_or_path"]
            config.rope_ratio = FAMILY_MODELS[family][1].get("rope_ratio", 1)
        model = chatglm.modeling.ChatGLMForConditionalGeneration(config).eval()
        golden = {"glm4": "glm4-chat-tiny", "chatglm3": "chatglm3-tiny"}[record]
        embedding = load_file(str(shared_path("golden", golden, "checkpoint", "model.safetensors")))[
            "transformer.embedding.word_embeddings.weight"]
        with torch.no_grad():
            model.transformer.embedding.word_embeddings.weight[: embedding.shape[0]] = embedding
        built[family] = (load_calls(record), model)
    return built


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_modules_keep_the_recorded_call_contracts(record_models, family):
    """9 of 9 boundaries: forward parameters, the class, how the parent calls each (positional count, keywords,
    the kind of every argument) and what comes back, in a padded prefill and a cached decode step. GLM-4 (batch
    first, as ours): every shape, the masks in full. Where the values are the original's whatever the weights,
    their checksums: the rotary tables, the decode step's ids and embeddings (the record's ids are known for the
    decode step; the golden checkpoint's embedding rows are the record's weights)."""
    calls, model = record_models[family]
    batch_first = RECORDS[family] == "glm4"
    steps = record_two_steps(model)
    problems = []
    for path in RECORDED_PATHS:
        recorded, module = calls[path], model.get_submodule(path)
        if type(module).__name__ != recorded["class"]:
            problems.append(f"{path}: class {type(module).__name__}, the original's {recorded['class']}")
        if list(inspect.signature(module.forward).parameters) != recorded["forward"]:
            problems.append(f"{path}: forward{inspect.signature(module.forward)}, the original's {recorded['forward']}")
        if "_get_layer" in recorded and list(inspect.signature(module._get_layer).parameters) != recorded["_get_layer"]:
            problems.append(f"{path}: _get_layer")
        for phase in ("prefill", "decode"):
            seen, cache = steps[phase][0].get(path), steps[phase][1]
            if seen is None:
                problems.append(f"{path} {phase}: not called")
                continue
            problems += call_problems(path, phase, recorded[phase], *seen, cache, batch_first)
    assert not problems, "\n".join(problems)
    if batch_first:  # checksums of values that are the original's whatever the weights
        rotary = calls["transformer.rotary_pos_emb"]
        assert checksum(model.transformer.rotary_pos_emb(4)) == pytest.approx(rotary["called_as_original"]["value"])
        table = model.transformer.rotary_pos_emb(model.config.seq_length)  # the original's call and table
        assert checksum(table) == pytest.approx(rotary["prefill"]["out_value"], rel=1e-6)
        for phase in ("prefill", "decode"):  # what ours hands over: that table's rows of the positions in use
            (positions,), _, (cos, sin) = steps[phase][0]["transformer.rotary_pos_emb"]
            rows = table[positions]
            torch.testing.assert_close(cos[:, 0, :, :2 * rows.shape[-2]:2], rows[..., 0])
            torch.testing.assert_close(sin[:, 0, :, 1:2 * rows.shape[-2]:2], rows[..., 1])
        args, _, output = steps["decode"][0]["transformer.embedding"]
        embedding = calls["transformer.embedding"]["decode"]
        assert [checksum(args[0]), checksum(output)] == pytest.approx(
            [embedding["values"][0], embedding["out_value"]], abs=1e-5)
    elif family != "chatglm2-32k":  # sequence-first original: its table is laid out as ours
        rotary = calls["transformer.rotary_pos_emb"]
        assert checksum(model.transformer.rotary_pos_emb(4)) == pytest.approx(rotary["called_as_original"]["value"])
    else:  # chatglm2-6b-32k's own code: positions divided by rope_ratio (16), base 10000
        rotary = model.transformer.rotary_pos_emb
        angles = torch.outer(torch.arange(4) / 16, 1 / 10000 ** (torch.arange(0, rotary.dim, 2) / rotary.dim))
        torch.testing.assert_close(rotary(4), torch.stack([angles.cos(), angles.sin()], -1))


def call_problems(path, phase, recorded, args, kwargs, output, cache, batch_first) -> list:
    where = f"{path} {phase}"
    problems = []
    if len(args) != recorded["positional"] or sorted(kwargs) != recorded["keywords"]:
        return [f"{where}: called with {len(args)} positional and {sorted(kwargs)}, the original with "
                f"{recorded['positional']} and {recorded['keywords']}"]
    described = [describe(a) for a in args] + [f"{name}={describe(kwargs[name])}" for name in sorted(kwargs)]
    slots = [str(i) for i in range(len(args))] + sorted(kwargs)
    values = list(args) + [kwargs[name] for name in sorted(kwargs)]
    for slot, value, ours_described, original in zip(slots, values, described, recorded["inputs"]):
        if (path, slot) in OUR_VALUES:
            index = int(slot) if slot.isdigit() else None
            expected = None
            if index is not None and OUR_VALUES[(path, slot)] == "kernel mask":
                expected = recorded["values"][index]
            elif index is not None and OUR_VALUES[(path, slot)] == "grouped":
                expected = recorded["shapes"][index]
            if not ours(path, slot, value, cache, expected, batch_first):
                problems.append(f"{where}: argument {slot} is {ours_described}, not this model's own value")
        elif ours_described != original:
            problems.append(f"{where}: argument {slot} is {ours_described}, the original's {original}")
    problems += return_problems(where, path, output, recorded["returns"], cache)
    if batch_first:
        tensors = [(slot, a) for slot, a in zip(slots, args) if (path, slot) not in OUR_VALUES]
        for slot, tensor in tensors:
            shape = recorded["shapes"][int(slot)] if int(slot) < len(recorded["shapes"]) else None
            if isinstance(tensor, torch.Tensor) and list(tensor.shape) != shape:
                problems.append(f"{where}: argument {slot} has shape {list(tensor.shape)}, the original's {shape}")
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool and \
                    value_of(tensor) != recorded["values"][int(slot)]:
                problems.append(f"{where}: mask {slot} is {value_of(tensor)}, the original's "
                                f"{recorded['values'][int(slot)]}")
        first = output[0] if isinstance(output, tuple) else output
        if (path, "return") not in OUR_VALUES and list(first.shape) != recorded["out_shape"]:
            problems.append(f"{where}: returns shape {list(first.shape)}, the original's {recorded['out_shape']}")
    return problems


def return_problems(where, path, output, recorded: str, cache) -> list:
    if (path, "return") in OUR_VALUES:
        return [] if ours(path, "return", output, cache) else [f"{where}: returns {describe(output)}, not ours"]
    if not recorded.startswith("tuple"):
        return [] if describe(output) == recorded else [f"{where}: returns {describe(output)}, the original {recorded}"]
    count = int(recorded[len("tuple"):recorded.index("[")])
    if not isinstance(output, tuple) or len(output) != count:
        return [f"{where}: returns {describe(output)}, the original {recorded}"]
    items = split_top(recorded[recorded.index("[") + 1:-1])
    problems = []
    for index, (item, original) in enumerate(zip(output, items)):
        slot = f"return[{index}]"
        if (path, slot) in OUR_VALUES:
            if not ours(path, slot, item, cache):
                problems.append(f"{where}: {slot} is {describe(item)}, not this model's own value")
        elif describe(item) != original:
            problems.append(f"{where}: {slot} is {describe(item)}, the original's {original}")
    return problems


def split_top(text: str) -> list:
    """'tensor3,tuple2[a,b],None' -> ['tensor3', 'tuple2[a,b]', 'None']"""
    items, depth, start = [], 0, 0
    for position, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:position])
            start = position + 1
    return items + [text[start:]]


def test_the_records_hand_overs_are_ours_too(record_models):
    """GLM-4's record says which tensor a parent hands on unchanged (equal checksums: the embedding's output is
    the encoder's and layer 0's input, the encoder's output the final norm's, the output layer's input); ours hands
    on the same tensors."""
    calls, model = record_models["glm4"]
    steps = record_two_steps(model)
    for phase in ("prefill", "decode"):
        recorded_values, our_values = {}, {}
        for path in RECORDED_PATHS:
            args, _, output = steps[phase][0][path]
            first = output[0] if isinstance(output, tuple) else output
            record = calls[path][phase]
            for index, value in enumerate(record["values"]):
                if isinstance(value, float) and isinstance(args[index], torch.Tensor):
                    recorded_values[(path, str(index))], our_values[(path, str(index))] = value, checksum(args[index])
            recorded_values[(path, "out")], our_values[(path, "out")] = record["out_value"], checksum(first)
        keys = list(recorded_values)
        equal_in_record = {(a, b) for a in keys for b in keys if a < b and recorded_values[a] == recorded_values[b]}
        assert len(equal_in_record) >= 5
        for a, b in equal_in_record:
            assert our_values[a] == our_values[b], (phase, a, b)


# ---- the rotary table -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_rotary_pos_emb_hooked_sees_the_positions_and_a_replaced_one_is_called_as_the_original(chatglm, family):
    """A hook reads what this model hands the rotary module (the position ids) and what it returns (the tables of
    those rows): no table of seq_length rows. A forward a tool put in its place is called as the original calls
    it, `rotary_pos_emb(seq_length)`, and its table is what the layers turn with."""
    model = build(chatglm, family)
    expected = steps_logits(model)
    rotary = model.transformer.rotary_pos_emb
    calls = []
    handle = rotary.register_forward_hook(
        lambda module, args, output: calls.append((tuple(args[0].shape), tuple(output[0].shape))))
    try:
        assert_same_logits(steps_logits(model), expected)
    finally:
        handle.remove()
    dim = model.config.kv_channels
    assert calls == [((2, 6), (2, 1, 6, dim))] + [((2, 1), (2, 1, 1, dim))] * 3
    asked = []

    def original_table(max_seq_len, offset=0):
        asked.append(max_seq_len)
        return type(rotary).forward(rotary, max_seq_len)

    rotary.forward = original_table
    try:
        assert_same_logits(steps_logits(model), expected)
        assert asked == [model.config.seq_length] * 4
        rotary.forward = lambda max_seq_len, offset=0: original_table(max_seq_len) * 0 + 1  # another table
        assert not torch.allclose(steps_logits(model)[0], expected[0])
    finally:
        del rotary.forward
