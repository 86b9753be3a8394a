"""generate() and the chat API use the KV cache: after the prefill, every forward of the base model receives only the
new position(s), with a cache that holds every earlier one.

What each forward gets is recorded at the base model (`model.transformer`), whoever calls it (generate, chat, PEFT),
and the cache is found among its arguments by type, not by name. A transformers release that renames the cache
argument, or stops handing it over, fails here on its first decode step: transformers 5.24 renamed it `cache`, and
generate() fed the whole sequence again at every step while the tokens stayed right."""
import copy
from typing import List, NamedTuple

import pytest
import torch
from packaging.version import Version
from transformers.cache_utils import Cache

from chatglm_tools import kv_cache
from conftest import (FAMILIES, REAL_VOCABULARY, TINY_SIZES, TRANSFORMERS, LoggedMessages, glm4v_prompt,
                      optional_package, random_images)

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
NEW_TOKENS = 5


class Forward(NamedTuple):
    fed: int  # positions given to this forward (input_ids or inputs_embeds)
    held: int  # positions the cache it was given held already (0 without a cache)


def cache_length(value) -> int:
    if isinstance(value, Cache):
        return int(value.get_seq_length())
    return value[0][0].shape[-2]  # legacy tuples: (key, value) per layer, [batch, heads, positions, head_dim]


def is_cache(value) -> bool:
    """A Cache, or legacy tuples: per layer a (key, value) pair, or one tensor stacking the two (PEFT before 0.13)."""
    return isinstance(value, Cache) or (
        isinstance(value, (tuple, list)) and len(value) > 0 and isinstance(value[0], (tuple, list, torch.Tensor))
        and len(value[0]) == 2 and isinstance(value[0][0], torch.Tensor) and value[0][0].dim() == 4)


class ForwardLog:
    """`with ForwardLog(model) as log:` records a Forward per call of the model's base (ChatGLMModel)."""

    def __init__(self, model):
        self.base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT wrappers
        self.base = self.base.transformer
        self.calls: List[Forward] = []

    def record(self, module, args, kwargs):
        values = list(args) + list(kwargs.values())
        caches = [v for v in values if is_cache(v)]
        assert len(caches) <= 1, f"the base model was given {len(caches)} caches"
        tokens = kwargs.get("input_ids") if kwargs.get("inputs_embeds") is None else kwargs["inputs_embeds"]
        if tokens is None:
            tokens = args[0]
        self.calls.append(Forward(tokens.shape[1], cache_length(caches[0]) if caches else 0))

    def __enter__(self):
        self.handle = self.base.register_forward_pre_hook(self.record, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def assert_cache_used(calls: List[Forward], prompt: int, new_tokens: int, held_at_start: int = 0, added: int = 0):
    """The first forward gets the `prompt` positions the cache lacks, on a cache of `held_at_start`; every later one
    gets one new position, on a cache holding all earlier ones plus `added` (slots the model itself puts in the cache
    at the prefill: a P-tuning v2 prefix, an image's rows beyond its placeholder tokens)."""
    assert [c.fed for c in calls] == [prompt] + [1] * (new_tokens - 1), calls
    expected_held = [held_at_start] + [held_at_start + added + prompt + step for step in range(new_tokens - 1)]
    assert [c.held for c in calls] == expected_held, calls


def random_ids(batch, length, seed, high=256):
    return torch.randint(3, high, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---- generate(): dynamic, static and caller-passed caches, inputs_embeds ----


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["dynamic", "static"])
def test_generate_feeds_one_position_per_step(tiny_model, family, cache_implementation):
    model = tiny_model(family)
    ids = random_ids(2, 9, seed=1)
    with torch.no_grad(), ForwardLog(model) as log:
        model.generate(ids, max_new_tokens=NEW_TOKENS, cache_implementation=cache_implementation, **GREEDY)
    assert_cache_used(log.calls, prompt=9, new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_generate_continues_from_a_cache_the_caller_passes(tiny_model, chatglm, cache_kind):
    """A prompt cache computed once (a system prompt, a conversation so far) is passed to generate() with the whole
    sequence: only the positions it lacks are fed. Its tokens are those of a generate() without it."""
    model = tiny_model("glm4")
    ids = random_ids(1, 12, seed=2)
    modeling = chatglm.modeling
    if cache_kind == "dynamic":
        cache = modeling.new_dynamic_cache(model.config)
    else:
        cache = modeling.new_static_cache(model.config, 1, 12 + NEW_TOKENS, torch.float32,
                                          [torch.device("cpu")] * model.config.num_layers)
    with torch.no_grad():
        model(input_ids=ids[:, :8], use_cache=True, **kv_cache.argument(cache))
        with ForwardLog(model) as log:
            continued = model.generate(ids, max_new_tokens=NEW_TOKENS, **kv_cache.argument(cache), **GREEDY)
        fresh = model.generate(ids, max_new_tokens=NEW_TOKENS, **GREEDY)
    assert continued.tolist() == fresh.tolist()
    assert_cache_used(log.calls, prompt=4, new_tokens=NEW_TOKENS, held_at_start=8)


@pytest.mark.parametrize("name", sorted({kv_cache.NAME, "past_key_values"}))  # 5.24 takes both names
def test_generate_on_a_static_cache_too_short_names_max_cache_len(tiny_model, name):
    """A StaticCache of 8 slots for 5 prompt tokens and 10 new ones failed after two new tokens with "attention_mask
    must be a custom 4D mask ...", though the caller passed no mask."""
    model = tiny_model("glm4")
    cache = kv_cache.new_static_cache(model.config, 1, 8, device="cpu", dtype=torch.float32)
    with torch.no_grad(), ForwardLog(model) as log, pytest.raises(
            ValueError, match=r"static cache of 8 tokens \(max_cache_len=8\); this step needs 9 .*max_cache_len of "
                              r"at least the prompt plus max_new_tokens"):
        model.generate(random_ids(1, 5, seed=4), max_new_tokens=10, **{name: cache}, **GREEDY)
    assert [call.held for call in log.calls] == [0, 5, 6, 7]  # refused before the step that needs a 9th slot


def test_generate_from_inputs_embeds_feeds_the_embeddings_once(tiny_model):
    model = tiny_model("chatglm3")
    ids = random_ids(1, 10, seed=3)
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad(), ForwardLog(model) as log:
        generated = model.generate(inputs_embeds=embeds, max_new_tokens=NEW_TOKENS, **GREEDY)
        from_ids = model.generate(ids, max_new_tokens=NEW_TOKENS, **GREEDY)[:, 10:]
    assert generated.tolist() == from_ids.tolist()
    assert_cache_used(log.calls[:NEW_TOKENS], prompt=10, new_tokens=NEW_TOKENS)


# ---- the chat API ----


@pytest.fixture(scope="module", params=FAMILIES)
def chat_model(request, tiny_model):
    family = request.param
    model = tiny_model(family, padded_vocab_size=REAL_VOCABULARY[family], hidden_size=32, num_attention_heads=2,
                       kv_channels=16, ffn_hidden_size=48, num_layers=2)
    return model, request.getfixturevalue({"chatglm3": "chatglm3_tokenizer", "glm4": "glm4_tokenizer"}[family])


CHAT = dict(do_sample=False, max_length=None, max_new_tokens=NEW_TOKENS)


def steps(calls) -> int:
    """Forwards of a chat turn: NEW_TOKENS, or fewer where the random model chose a stop token."""
    assert len(calls) >= 3, f"too short a turn to show cache use: {calls}"
    return len(calls)


def chat_prompt_length(model, tokenizer, query) -> int:
    with ForwardLog(model) as log:
        model.chat(tokenizer, query, history=[], **dict(CHAT, max_new_tokens=1))
    return log.calls[0].fed


def test_chat_feeds_one_position_per_step(chat_model):
    model, tokenizer = chat_model
    prompt = chat_prompt_length(model, tokenizer, "你好")
    with ForwardLog(model) as log:
        model.chat(tokenizer, "你好", history=[], **CHAT)
    assert_cache_used(log.calls, prompt=prompt, new_tokens=steps(log.calls))


def test_stream_chat_feeds_one_position_per_step_and_continues_on_its_cache(chat_model):
    model, tokenizer = chat_model
    prompt = chat_prompt_length(model, tokenizer, "你好")
    with ForwardLog(model) as log:
        *_, (response, history, cache) = model.stream_chat(tokenizer, "你好", history=[], return_past_key_values=True,
                                                            **CHAT)
    assert_cache_used(log.calls, prompt=prompt, new_tokens=steps(log.calls))
    held = cache_length(cache)
    assert held == prompt + len(log.calls) - 1  # the last token is not yet in the cache
    with ForwardLog(model) as log:
        list(model.stream_chat(tokenizer, "再见", history=history, past_key_values=cache, **CHAT))
    assert_cache_used(log.calls, prompt=log.calls[0].fed, new_tokens=steps(log.calls), held_at_start=held)


# ---- prefixes and images ----


@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["dynamic", "static"])
def test_ptuning_v2_generate_feeds_one_position_per_step(tiny_model, cache_implementation):
    model = tiny_model("glm4", pre_seq_len=6)
    ids = random_ids(2, 7, seed=4)
    with torch.no_grad(), ForwardLog(model) as log:
        model.generate(ids, max_new_tokens=NEW_TOKENS, cache_implementation=cache_implementation, **GREEDY)
    assert_cache_used(log.calls, prompt=7, new_tokens=NEW_TOKENS, added=6)


def test_peft_prefix_tuning_generate_feeds_one_position_per_step(tiny_model):
    peft = optional_package("peft", "PEFT")

    groups, head = TINY_SIZES["multi_query_group_num"], TINY_SIZES["kv_channels"]
    config = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, num_attention_heads=groups,
                                token_dim=groups * head)
    model = peft.get_peft_model(tiny_model("chatglm3"), config).eval()
    ids = random_ids(1, 8, seed=5)
    with torch.no_grad(), ForwardLog(model) as log:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, **GREEDY)
    assert_cache_used(log.calls, prompt=8, new_tokens=NEW_TOKENS, held_at_start=4)


def test_glm4v_generate_with_an_image_feeds_one_position_per_step(tiny_glm4v):
    model = tiny_glm4v(seed=1)
    prompt = glm4v_prompt(6, torch.Generator().manual_seed(6))
    ids = torch.tensor([prompt])
    with torch.no_grad(), ForwardLog(model) as log:
        model.generate(ids, images=random_images(1, 8, seed=6), max_new_tokens=NEW_TOKENS, **GREEDY)
    # The three placeholder tokens become the image's rows and two more: the cache holds image_tokens - 1 extra.
    assert_cache_used(log.calls, prompt=len(prompt), new_tokens=NEW_TOKENS,
                      added=model.transformer.vision.image_tokens - 1)


# ---- the cache's name in each release ----


def test_the_forward_takes_the_cache_under_the_releases_names(tiny_model):
    """5.24 renamed past_key_values to cache and deprecated the old name: there the forward takes either (the same
    logits), never both; before 5.24 only past_key_values, and cache= names the argument to use."""
    model = tiny_model("glm4")
    ids = random_ids(1, 9, seed=7)
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, -1]
        first = model(input_ids=ids[:, :8], use_cache=True)
        cache = kv_cache.returned(first)
        reference = copy.deepcopy(cache)
        step = model(input_ids=ids[:, 8:], past_key_values=copy.deepcopy(reference), use_cache=True).logits[:, -1]
        torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)
        if TRANSFORMERS >= Version("5.24"):
            renamed = model(input_ids=ids[:, 8:], cache=copy.deepcopy(reference), use_cache=True).logits[:, -1]
            torch.testing.assert_close(renamed, step, atol=0, rtol=0)
            with pytest.raises(ValueError, match="past_key_values and cache"):
                model(input_ids=ids[:, 8:], past_key_values=cache, cache=copy.deepcopy(reference))
        else:
            with pytest.raises(TypeError, match="use that name") as error:
                model(input_ids=ids[:, 8:], cache=cache)
            assert "past_key_values" in str(error.value)


# ---- no deprecation from the model's own calls ----


def test_generate_and_chat_log_no_deprecation(chat_model):
    """The release's own names for everything the model passes and reads (5.24: `cache`, not `past_key_values`)."""
    model, tokenizer = chat_model
    ids = tokenizer("你好", return_tensors="pt")["input_ids"]
    with torch.no_grad(), LoggedMessages("transformers") as log:
        for cache_implementation in (None, "static"):
            model.generate(ids, max_new_tokens=3, cache_implementation=cache_implementation, **GREEDY)
        model.chat(tokenizer, "你好", history=[], **CHAT)
        *_, (_, history, cache) = model.stream_chat(tokenizer, "你好", history=[], return_past_key_values=True, **CHAT)
        list(model.stream_chat(tokenizer, "再见", history=history, past_key_values=cache, **CHAT))
    assert not [message for message in log.messages if "deprecat" in message.lower()]
