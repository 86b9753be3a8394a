"""Generation: cache equivalence, left padding, static caches, position handling."""
import pytest
import torch
from conftest import FAMILIES
from chatglm_tools.device_check import left_pad

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def random_ids(batch, length, seed):
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_greedy_generation_with_and_without_cache_is_identical(tiny_model, family, attn):
    model = tiny_model(family, attn_implementation=attn)
    ids = random_ids(2, 11, seed=5)
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=20, use_cache=True, **GREEDY)
        uncached = model.generate(ids, max_new_tokens=20, use_cache=False, **GREEDY)
    assert cached.tolist() == uncached.tolist()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padded_batch_equals_each_sequence_alone(tiny_model, family, attn):
    model = tiny_model(family, attn_implementation=attn)
    sequences = [random_ids(1, n, seed=n)[0].tolist() for n in (4, 13, 9)]
    ids, mask = left_pad(sequences)
    with torch.no_grad():
        batch_logits = model(input_ids=ids, attention_mask=mask).logits
        batch_generated = model.generate(ids, attention_mask=mask, max_new_tokens=10, **GREEDY)[:, ids.shape[1]:]
        for row, seq in enumerate(sequences):
            alone = model(input_ids=torch.tensor([seq])).logits[0]
            torch.testing.assert_close(batch_logits[row, -len(seq):], alone, atol=1e-5, rtol=1e-5)
            generated = model.generate(torch.tensor([seq]), max_new_tokens=10, **GREEDY)[0, len(seq):]
            assert batch_generated[row].tolist() == generated.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_with_cache_equals_one_forward(tiny_model, family):
    """A multi-token step on top of a cache (chunked prefill, speculative decoding) is causal inside the chunk."""
    model = tiny_model(family)
    ids = random_ids(1, 24, seed=6)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :10], use_cache=True)
        second = model(input_ids=ids[:, 10:], past_key_values=first.past_key_values, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full, atol=1e-5, rtol=1e-5)


def test_static_cache_generation_equals_dynamic(tiny_model):
    model = tiny_model("glm4")
    ids = random_ids(1, 9, seed=7)
    with torch.no_grad():
        dynamic = model.generate(ids, max_new_tokens=12, **GREEDY)
        static = model.generate(ids, max_new_tokens=12, cache_implementation="static", **GREEDY)
    assert static.tolist() == dynamic.tolist()


def test_logits_to_keep_and_return_last_logit(tiny_model):
    model = tiny_model("chatglm3")
    ids = random_ids(2, 8, seed=8)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids, logits_to_keep=3).logits, full[:, -3:])
        torch.testing.assert_close(model(input_ids=ids, return_last_logit=True).logits, full[:, -1:])


def test_each_layer_cache_lives_on_its_layer_and_grows(tiny_model):
    model = tiny_model("glm4")
    ids = random_ids(2, 6, seed=9)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        out = model(input_ids=ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    assert out.past_key_values.get_seq_length() == 7


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_with_and_without_cache_is_identical(tiny_model, family):
    """Beam search reorders the cache between steps."""
    model = tiny_model(family)
    ids = random_ids(2, 7, seed=10)
    kwargs = dict(num_beams=3, do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **kwargs)
        uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.tolist() == uncached.tolist()


def test_output_attentions_and_hidden_states(tiny_model):
    model = tiny_model("glm4", attn_implementation="eager")
    ids, mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    config = model.config
    assert len(out.attentions) == config.num_layers and len(out.hidden_states) == config.num_layers + 1
    probs = out.attentions[0]
    assert probs.shape == (2, config.num_attention_heads, 5, 5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, config.num_attention_heads, 5))
    assert probs[0, :, 2:, :2].abs().max() == 0  # real tokens never attend to the padding
    assert torch.equal(out.hidden_states[-1], model.transformer(input_ids=ids, attention_mask=mask).last_hidden_state)


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_given_with_use_cache_false_is_used_and_none_returned(tiny_model, family):
    """As the original, GlmForCausalLM and LlamaForCausalLM do: the cached step equals the full forward."""
    model = tiny_model(family)
    ids = random_ids(1, 12, seed=8)
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[0, -1]
        past = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
        step = model(input_ids=ids[:, -1:], past_key_values=past, use_cache=False)
    assert step.past_key_values is None
    torch.testing.assert_close(step.logits[0, -1], full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_generate_without_a_generation_config_after_a_tool_aliased_max_length(tiny_model, family):
    """GPTQModel's load maps a ChatGLM config's `max_length` to `seq_length` (config.attribute_map on the instance),
    and transformers 5 took that for the legacy way of steering generation: generate() without a generation_config
    raised `ValueError: You have modified the pretrained model configuration ... {'max_length': 131072}`. It
    generates what it generates without the alias, with the model's own generation config (here its
    max_new_tokens) and the call's arguments."""
    model = tiny_model(family)
    model.generation_config.max_new_tokens = 3
    ids = random_ids(2, 7, seed=3)
    with torch.no_grad():
        expected = model.generate(ids, **GREEDY), model.generate(ids, max_new_tokens=5, **GREEDY)
        model.config.attribute_map = dict(model.config.attribute_map or {}, max_length="seq_length")
        assert model.config.max_length == model.config.seq_length
        got = model.generate(ids, **GREEDY), model.generate(ids, max_new_tokens=5, **GREEDY)
    assert [tokens.shape[1] - ids.shape[1] for tokens in got] == [3, 5]
    assert [tokens.tolist() for tokens in got] == [tokens.tolist() for tokens in expected]
