"""Inputs: every shape or dtype mistake a caller can make is a ValueError naming the argument and the shape it must
have; the checks read no tensor value during a decode step."""
import re

import pytest
import torch

IDS = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(0))
HIDDEN = 64  # tiny_model's hidden_size


def embeds(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype)


# (forward arguments, the argument named, the expected shape the message gives)
BAD_INPUTS = {
    "ids 1-D": (dict(input_ids=IDS[0]), "input_ids", r"\[batch, sequence\]"),
    "ids 3-D": (dict(input_ids=IDS[None]), "input_ids", r"\[batch, sequence\]"),
    "ids float": (dict(input_ids=IDS.float()), "input_ids", "integer tensor"),
    "no tokens": (dict(input_ids=IDS[:, :0]), "input_ids", r"no tokens \(shape \[2, 0\]\)"),
    "no sequences": (dict(input_ids=IDS[:0]), "input_ids", "no tokens"),
    "ids and embeds": (dict(input_ids=IDS, inputs_embeds=embeds(2, 7, HIDDEN)), "input_ids and inputs_embeds", ""),
    "embeds hidden": (dict(inputs_embeds=embeds(2, 7, HIDDEN + 1)), "inputs_embeds", rf"\[batch, sequence, {HIDDEN}\]"),
    "embeds 2-D": (dict(inputs_embeds=embeds(7, HIDDEN)), "inputs_embeds", rf"\[batch, sequence, {HIDDEN}\]"),
    "embeds int": (dict(inputs_embeds=embeds(2, 7, HIDDEN, dtype=torch.long)), "inputs_embeds", "floating"),
    "embeds empty": (dict(inputs_embeds=embeds(2, 0, HIDDEN)), "inputs_embeds", "no tokens"),
    "mask width": (dict(input_ids=IDS, attention_mask=torch.ones(2, 6)), "attention_mask", r"\[2, 0 \+ 7\]"),
    "mask batch": (dict(input_ids=IDS, attention_mask=torch.ones(1, 7)), "attention_mask", r"\[2, 0 \+ 7\]"),
    "mask 1-D": (dict(input_ids=IDS, attention_mask=torch.ones(7)), "attention_mask", r"\[2, 0 \+ 7\]"),
    "mask 3-D": (dict(input_ids=IDS, attention_mask=torch.ones(2, 7, 7)), "attention_mask", r"\[2, 0 \+ 7\]"),
    "mask 4-D shape": (dict(input_ids=IDS, attention_mask=torch.ones(2, 1, 6, 7)), "attention_mask",
                       r"\[2, 1, 7, 0 \+ 7\]"),
    "mask 4-D int": (dict(input_ids=IDS, attention_mask=torch.ones(2, 1, 7, 7, dtype=torch.long)), "attention_mask",
                     "bool"),
    "mask list": (dict(input_ids=IDS, attention_mask=[[1] * 7] * 2), "attention_mask", r"\[2, 0 \+ 7\]"),
    "positions length": (dict(input_ids=IDS, position_ids=torch.arange(6)[None]), "position_ids", r"\[2, 7\]"),
    "positions 1-D": (dict(input_ids=IDS, position_ids=torch.arange(7)), "position_ids", r"\[2, 7\]"),
    "positions float": (dict(input_ids=IDS, position_ids=torch.arange(7.0)[None]), "position_ids", "integer"),
    "labels shape": (dict(input_ids=IDS, labels=IDS[:, :-1]), "labels", r"\[2, 7\]"),
    "labels float": (dict(input_ids=IDS, labels=IDS.float()), "labels", r"integer tensor \[2, 7\]"),
    "labels kept logits": (dict(input_ids=IDS, labels=IDS, logits_to_keep=1), "labels", r"\[2, 1\]"),
    "labels value": (dict(input_ids=IDS, labels=IDS.masked_fill(IDS > 100, 300)), "labels", r"\[0, 256\)"),
    "shift_labels shape": (dict(input_ids=IDS, shift_labels=IDS[:1]), "shift_labels", r"\[2, 7\]"),
    "cache type": (dict(input_ids=IDS, past_key_values={"keys": IDS}), "past_key_values", "Cache"),
    "cache layers": (dict(input_ids=IDS, past_key_values=((embeds(2, 2, 3, 16), embeds(2, 2, 3, 16)),)),
                     "past_key_values", r"tuple of 3 \(key, value\) pairs, each a floating tensor \[2, 2, cached "),
    "cache dtype": (dict(input_ids=IDS, past_key_values=((embeds(2, 2, 3, 16, dtype=torch.long),) * 2,) * 3),
                    "past_key_values", r"floating tensor \[2, 2, cached tokens, 16\]"),
    "cache head_dim": (dict(input_ids=IDS, past_key_values=((embeds(2, 2, 3, 8), embeds(2, 2, 3, 8)),) * 3),
                       "past_key_values", r"\[2, 2, cached tokens, 16\]"),
    "cache batch": (dict(input_ids=IDS, past_key_values=((embeds(1, 2, 3, 16), embeds(1, 2, 3, 16)),) * 3),
                    "past_key_values", r"\[2, 2, cached tokens, 16\]"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_a_value_error_naming_the_argument_and_the_shape(tiny_model, case):
    arguments, name, expected = BAD_INPUTS[case]
    model = tiny_model("glm4")
    with pytest.raises(ValueError, match=name) as error, torch.no_grad():
        model(**arguments)
    assert re.search(expected, str(error.value)), str(error.value)


def static_cache(config, batch_size: int, max_cache_len: int):
    """A transformers StaticCache built by hand, with the arguments each release takes (4.56+ size it lazily)."""
    from transformers import StaticCache
    import inspect

    params = inspect.signature(StaticCache.__init__).parameters
    extra = {k: v for k, v in (("max_batch_size", batch_size), ("device", "cpu"), ("dtype", torch.float32))
             if k in params}
    return StaticCache(config=config, max_cache_len=max_cache_len, **extra)


def test_a_full_static_cache_says_how_to_make_room(tiny_model):
    model = tiny_model("chatglm3")
    cache = static_cache(model.config, 2, 8)
    with torch.no_grad():
        model(input_ids=IDS[:, :6], past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match=r"past_key_values is a static cache of 8 tokens.*max_cache_len"):
            model(input_ids=IDS[:, :3], past_key_values=cache, use_cache=True)


def test_a_decode_step_reads_no_tensor_value(tiny_model, chatglm):
    """On an accelerator, reading a value (bool(), .item(), .tolist()) waits for the device. A decode step built from
    meta tensors, which hold no values, runs through every check: none reads one."""
    model = tiny_model("glm4")
    with torch.device("meta"):
        meta_model = chatglm.modeling.ChatGLMForConditionalGeneration(model.config).eval()
    cache = chatglm.modeling.new_dynamic_cache(model.config)
    for layer in range(model.config.num_layers):
        cache.update(torch.zeros(2, 2, 5, 16, device="meta"), torch.zeros(2, 2, 5, 16, device="meta"), layer)
    with torch.no_grad():
        out = meta_model(input_ids=torch.zeros(2, 1, dtype=torch.long, device="meta"),
                         attention_mask=torch.ones(2, 6, dtype=torch.long, device="meta"),
                         position_ids=torch.zeros(2, 1, dtype=torch.long, device="meta"),
                         past_key_values=cache, use_cache=True)
    assert out.logits.shape == (2, 1, 256) and out.past_key_values.get_seq_length() == 6
    with pytest.raises(ValueError, match=r"attention_mask must be .*\[2, 6 \+ 1\]"):  # the checks did run
        meta_model(input_ids=torch.zeros(2, 1, dtype=torch.long, device="meta"),
                   attention_mask=torch.ones(2, 5, dtype=torch.long, device="meta"), past_key_values=cache)


# A 2-D mask's values: a 2 was attended like a 1 and a row of zeros attended to nothing, both giving logits off by
# 6-9 from any meaningful answer, with no error.
BAD_MASKS = {
    "value 2": (lambda m: m.masked_fill(torch.arange(7) == 3, 2), "only 1 \\(token\\) and 0 \\(padding\\); it holds 2"),
    "value -1": (lambda m: m.masked_fill(torch.arange(7) == 0, -1), "it holds -1"),
    "float 0.5": (lambda m: m.float().masked_fill(torch.arange(7) == 0, 0.5), "it holds 0.5"),
    "row of zeros": (lambda m: m.masked_fill(torch.arange(2)[:, None] == 1, 0), "row 1 is all 0"),
    "bool row of False": (lambda m: m.bool().masked_fill(torch.arange(2)[:, None] == 0, False), "row 0 is all 0"),
}


@pytest.mark.parametrize("case", BAD_MASKS)
def test_attention_mask_values_other_than_0_and_1_are_refused(tiny_model, case):
    change, expected = BAD_MASKS[case]
    model = tiny_model("glm4")
    with pytest.raises(ValueError, match="^attention_mask ") as error, torch.no_grad():
        model(input_ids=IDS, attention_mask=change(torch.ones(2, 7, dtype=torch.long)))
    assert re.search(expected, str(error.value)), str(error.value)


def test_attention_masks_of_0_and_1_in_any_dtype_give_the_same_logits(tiny_model):
    model = tiny_model("glm4")
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        reference = model(input_ids=IDS, attention_mask=mask).logits
        for form in (mask.bool(), mask.float(), mask.int()):
            assert torch.equal(model(input_ids=IDS, attention_mask=form).logits, reference)


def test_max_new_tokens_beyond_seq_length_warns_once_naming_both(tiny_model, caplog):
    import logging

    model = tiny_model("chatglm3", seq_length=9)  # a length no other test uses: warning_once remembers messages
    prompt = IDS[:1, :4]
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            model.generate(prompt, max_new_tokens=11, do_sample=False, min_new_tokens=11)
        model.generate(prompt, max_new_tokens=9, do_sample=False)  # within seq_length: no warning
    warned = [r.getMessage() for r in caplog.records if "seq_length" in r.getMessage()]
    assert len(warned) == 1 and "max_new_tokens=11" in warned[0] and "seq_length=9" in warned[0], warned


@pytest.mark.parametrize("devices", ["cuda:0", "cpu", 0, torch.device("cpu")])
def test_balanced_device_map_refuses_a_single_device_where_a_list_belongs(chatglm, devices):
    """A string is iterable: "cuda:0" mapped the layers to 'c', 'u', 'd', ..."""
    config = chatglm.ChatGLMConfig(num_layers=2, hidden_size=32, ffn_hidden_size=32, kv_channels=8,
                                   num_attention_heads=4, padded_vocab_size=64)
    with pytest.raises(TypeError, match=r"devices must be a list of devices, e\.g\. \["):
        chatglm.modeling.balanced_device_map(config, devices)
    assert set(chatglm.modeling.balanced_device_map(config, [devices]).values()) == {devices}


def test_a_cache_with_fewer_layers_than_the_model_is_refused(tiny_model):
    """transformers < 4.47 took it, and attention failed on mismatched sizes."""
    from transformers import DynamicCache

    model = tiny_model("glm4")  # 3 layers
    cache = DynamicCache()
    cache.update(embeds(2, 2, 3, 16), embeds(2, 2, 3, 16), 0)
    with pytest.raises(ValueError, match=r"past_key_values holds 1 layers; this model has 3 \(num_layers\)"), \
            torch.no_grad():
        model(input_ids=IDS, past_key_values=cache)


def forward_cache(model, batch: int):
    """The cache `model` returns for a prompt of `batch` sequences of 7 tokens."""
    with torch.no_grad():
        return model(input_ids=IDS[:1, :].expand(batch, -1), use_cache=True).past_key_values


def test_a_cache_of_another_batch_size_is_refused_naming_both_shapes(tiny_model):
    """It failed in the first layer's torch.cat ("Sizes of tensors must match ... Expected size 3 but got size 1")."""
    model = tiny_model("glm4")
    cache = forward_cache(model, 3)
    with pytest.raises(ValueError, match=r"^past_key_values holds keys of shape \[3, 2, 7, 16\] .*needs "
                                         r"\[1, 2, cached tokens, 16\]"), torch.no_grad():
        model(input_ids=IDS[:1, :1], past_key_values=cache)


def test_a_cache_of_another_models_key_value_heads_is_refused_naming_both_shapes(tiny_model):
    """A cache of a model with 4 key/value heads failed in torch.cat ("Expected size 4 but got size 2")."""
    model, other = tiny_model("glm4"), tiny_model("glm4", multi_query_group_num=4)
    cache = forward_cache(other, 2)
    with pytest.raises(ValueError, match=r"^past_key_values holds keys of shape \[2, 4, 7, 16\] .*needs "
                                         r"\[2, 2, cached tokens, 16\]"), torch.no_grad():
        model(input_ids=IDS[:, :1], past_key_values=cache)
    head_dim = forward_cache(tiny_model("glm4", kv_channels=8), 2)
    with pytest.raises(ValueError, match=r"^past_key_values holds keys of shape \[2, 2, 7, 8\] .*needs "
                                         r"\[2, 2, cached tokens, 16\]"), torch.no_grad():
        model(input_ids=IDS[:, :1], past_key_values=head_dim)


def test_a_static_cache_of_another_batch_size_is_refused(tiny_model):
    model = tiny_model("chatglm3")
    cache = static_cache(model.config, 4, 16)
    with torch.no_grad():
        model(input_ids=IDS[:1].expand(4, -1), past_key_values=cache, use_cache=True)  # 4.56+ allocate here
        with pytest.raises(ValueError, match=r"^past_key_values holds keys of shape \[4, 2, 16, 16\] .*needs "
                                             r"\[2, 2, cached tokens, 16\]"):
            model(input_ids=IDS[:, :1], past_key_values=cache, use_cache=True)


def test_generate_with_beams_refuses_a_prompt_cache_of_the_unexpanded_batch(tiny_model):
    """generate() expands the inputs for num_beams, not a cache it is given: the error says what to pass."""
    model = tiny_model("glm4")
    cache = forward_cache(model, 1)
    prompt = torch.cat([IDS[:1], IDS[:1, :2]], dim=1)
    with pytest.raises(ValueError, match=r"^past_key_values holds keys of shape \[1, 2, 7, 16\] .*batch 2"):
        model.generate(prompt, past_key_values=cache, num_beams=2, max_new_tokens=2, do_sample=False)
    continued = model.generate(prompt, past_key_values=forward_cache(model, 1), max_new_tokens=2, do_sample=False)
    assert torch.equal(continued, model.generate(prompt, max_new_tokens=2, do_sample=False))
