"""ChatGLM3's chat API (chat, stream_chat, stream_generate, process_response) and quantize(), on tiny random models
whose vocabularies cover the real tokenizers; ChatGLM2's chat API against the original's (tokvec/chatglm2.jsonl)."""
import inspect
import json
import shutil
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessor

from chatglm_tools import kv_cache
from conftest import REAL_VOCABULARY, LoggedMessages, optional_package, shared_path
from tokenizer_fixtures import chatglm2_params, load_tokenizer, make_chatglm2_folder, make_tokenizer_folder

TOKENIZER = {"chatglm3": "chatglm3_tokenizer", "glm4": "glm4_tokenizer"}
GREEDY = dict(do_sample=False, max_length=None, max_new_tokens=12)


def small_chat_model(tiny_model, family):
    """A tiny random model whose vocabulary covers the family's real tokenizer."""
    return tiny_model(family, padded_vocab_size=REAL_VOCABULARY[family], hidden_size=32, num_attention_heads=2,
                      kv_channels=16, ffn_hidden_size=48, num_layers=2)


@pytest.fixture(scope="module", params=["chatglm3", "glm4"])
def chat_setup(request, tiny_model):
    family = request.param
    return family, small_chat_model(tiny_model, family), request.getfixturevalue(TOKENIZER[family])


def stop_ids(tokenizer):
    return [tokenizer.eos_token_id, tokenizer.get_command("<|user|>"), tokenizer.get_command("<|observation|>")]


def prompt_inputs(family, tokenizer, messages):
    """The prompt as the family's own documentation builds it: ChatGLM3's build_chat_input, GLM-4's chat template."""
    if family == "chatglm3":
        return dict(tokenizer.build_chat_input(messages[-1]["content"], history=messages[:-1],
                                               role=messages[-1]["role"]))
    return dict(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_tensors="pt", return_dict=True))


def test_greedy_chat_equals_decoding_generate_on_the_documented_prompt(chat_setup):
    family, model, tokenizer = chat_setup
    history = [{"role": "user", "content": "你好"}, {"role": "assistant", "metadata": "", "content": "你好👋"}]
    inputs = prompt_inputs(family, tokenizer, history + [{"role": "user", "content": "Tell me about 北京."}])
    generated = model.generate(**inputs, eos_token_id=stop_ids(tokenizer), **GREEDY)[0, inputs["input_ids"].shape[1]:]
    answer = generated.tolist()
    if answer[-1] in stop_ids(tokenizer):
        answer = answer[:-1]
    expected_text = tokenizer.decode(answer)

    caller_history = list(history)
    response, new_history = model.chat(tokenizer, "Tell me about 北京.", history=caller_history, **GREEDY)
    assert caller_history == history  # not modified
    # The original's reading: the first line is metadata only when more lines follow.
    metadata, content = expected_text.split("\n", 1) if "\n" in expected_text else ("", expected_text)
    assert new_history[:3] == history + [{"role": "user", "content": "Tell me about 北京."}]
    assert new_history[3]["role"] == "assistant"
    if not metadata.strip():
        assert response == content.strip().replace("[[训练时间]]", "2023年")
    else:  # the random model named a "tool": no tools were declared, so the raw content comes back
        assert response == {"name": metadata.strip(), "content": content}


def test_stream_chat_yields_growing_prefixes_ending_in_the_chat_answer(chat_setup):
    family, model, tokenizer = chat_setup
    response, history = model.chat(tokenizer, "写一首诗", history=[], **GREEDY)
    steps = list(model.stream_chat(tokenizer, "写一首诗", history=[], **GREEDY))
    assert steps and steps[-1] == (response, history)
    # The answer so far, as the message holds it: a first line followed by more is its metadata (the original's
    # reading), and a message without metadata is stripped.
    messages = [step[1][-1] for step in steps]
    texts = [f"{m['metadata']}\n{m['content']}" if m["metadata"] else m["content"] for m in messages]
    for shorter, longer in zip(texts, texts[1:]):
        assert longer.lstrip().startswith(shorter.strip())
    assert not any(text.endswith("\ufffd") for text in texts[:-1])  # multi-byte characters come whole


def test_stream_generate_matches_generate_greedy_and_stops_at_stop_ids(chat_setup):
    family, model, tokenizer = chat_setup
    inputs = prompt_inputs(family, tokenizer, [{"role": "user", "content": "hello"}])
    expected = model.generate(**inputs, **GREEDY)
    *_, last = model.stream_generate(**inputs, **GREEDY)
    assert last.tolist() == expected.tolist()
    # Make the first greedy token a stop id: the stream ends right there.
    first = int(expected[0, inputs["input_ids"].shape[1]])
    *_, stopped = model.stream_generate(**inputs, eos_token_id=[first], **GREEDY)
    assert stopped.shape[1] == inputs["input_ids"].shape[1] + 1


def test_stream_chat_continues_from_the_returned_cache(chat_setup):
    """A second turn on the first turn's cache equals generate() over what that cache holds plus the new turn
    (which does not repeat the [gMASK]<sop> prefix)."""
    family, model, tokenizer = chat_setup
    *_, (_, history, cache) = model.stream_chat(tokenizer, "你好", history=[], return_past_key_values=True, **GREEDY)
    cached = cache.get_seq_length()
    first_turn = prompt_inputs(family, tokenizer, [{"role": "user", "content": "你好"}])["input_ids"]
    answer = model.generate(input_ids=first_turn, eos_token_id=stop_ids(tokenizer), **GREEDY)
    held = answer[:, :cached]
    new_turn = prompt_inputs(family, tokenizer, [{"role": "user", "content": "再见"}])["input_ids"]
    prefix = len(tokenizer.get_prefix_tokens())
    assert new_turn[0, :prefix].tolist() == tokenizer.get_prefix_tokens()
    truth = model.generate(input_ids=torch.cat([held, new_turn[:, prefix:]], 1), eos_token_id=stop_ids(tokenizer),
                           **GREEDY)[0, cached + new_turn.shape[1] - prefix:].tolist()
    if truth and truth[-1] in stop_ids(tokenizer):
        truth = truth[:-1]
    *_, (response, history2, _) = model.stream_chat(tokenizer, "再见", history=history, past_key_values=cache,
                                                      return_past_key_values=True, **GREEDY)
    expected, _ = model.process_response(tokenizer.decode(truth), history)
    assert response == expected


@pytest.mark.parametrize("history,entry", [
    ([("你好", "你好！")], r"history\[0\]"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"history\[1\]"),
    ([{"role": "bot", "content": "a"}], r"history\[0\].*'bot'"),
])
def test_chat_history_in_the_wrong_shape_names_the_entry(chat_setup, history, entry):
    _, model, tokenizer = chat_setup
    with pytest.raises(ValueError, match=entry):
        model.chat(tokenizer, "hi", history=history)


def test_chat_with_an_unknown_role_names_it(chat_setup):
    _, model, tokenizer = chat_setup
    with pytest.raises(ValueError, match="'narrator'"):
        model.chat(tokenizer, "hi", history=[], role="narrator")


@pytest.mark.parametrize("method", ["chat", "stream_chat"])
@pytest.mark.parametrize("where", ["query", "history"])
def test_chat_with_a_lone_surrogate_names_it(chat_setup, method, where):
    """ChatGLM3's chat() ended in SentencePiece's "Unable to cast Python instance of type <class 'str'> to C++
    type"; GLM-4's sent U+FFFD in its place without a word."""
    family, model, tokenizer = chat_setup
    history = [{"role": "user", "content": "hi\ud800"}] if where == "history" else []
    query = "hi" if where == "history" else "hi\ud800"
    named = {("chatglm3", "query"): "query", ("chatglm3", "history"): r"history\[0\]\['content'\]",
             ("glm4", "query"): r"conversation\[0\]\['content'\]",
             ("glm4", "history"): r"conversation\[0\]\['content'\]"}[family, where]
    with pytest.raises(ValueError, match=rf"^{named} holds a lone surrogate '\\ud800' at position 2"):
        result = getattr(model, method)(tokenizer, query, history=history, **GREEDY)
        if method == "stream_chat":
            next(result)


# ---- process_response: tool calls are parsed, never evaluated ----

TOOLS_HISTORY = [{"role": "system", "content": "Answer with tools.", "tools": [{"name": "get_weather"}]},
                 {"role": "user", "content": "Weather in Beijing?"}]


def test_chatglm3_tool_call_is_parsed_into_parameters(tiny_model):
    model = tiny_model("chatglm3")
    output = 'get_weather\n ```python\ntool_call(city="北京", days=3, detail={"wind": True})\n```'
    content, history = model.process_response(output, TOOLS_HISTORY)
    assert content == {"name": "get_weather", "parameters": {"city": "北京", "days": 3, "detail": {"wind": True}}}
    assert history[-1] == {"role": "assistant", "metadata": "get_weather", "content": output.split("\n", 1)[1]}
    assert len(TOOLS_HISTORY) == 2


def test_glm4_json_tool_call_is_parsed_into_parameters(tiny_model):
    model = tiny_model("glm4")
    content, _ = model.process_response('get_weather\n{"city": "Beijing"}', TOOLS_HISTORY)
    assert content == {"name": "get_weather", "parameters": {"city": "Beijing"}}


def test_tool_call_output_is_never_evaluated(tiny_model, tmp_path):
    model = tiny_model("chatglm3")
    marker = tmp_path / "evaluated"
    output = f"get_weather\n```python\ntool_call(city=open({str(marker)!r}, 'w').write('x'))\n```"
    content, _ = model.process_response(output, TOOLS_HISTORY)
    assert not marker.exists()
    assert content == {"name": "get_weather", "content": output.split("\n", 1)[1]}


def test_plain_answer_and_multi_message_output(tiny_model):
    model = tiny_model("chatglm3")
    content, history = model.process_response("\n 你好，我是 ChatGLM3 [[训练时间]]", [])
    assert content == "你好，我是 ChatGLM3 2023年"
    assert history == [{"role": "assistant", "metadata": "", "content": "你好，我是 ChatGLM3 [[训练时间]]"}]


# ---- quantize() and quantized layers ----


def test_quantize_rejects_unsupported_widths(tiny_model):
    with pytest.raises(ValueError, match="4 and 8"):
        tiny_model("glm4").quantize(3)


def test_quantize_without_a_library_names_the_packages_and_alternatives(tiny_model, monkeypatch):
    for name in ("torchao", "torchao.quantization", "optimum", "optimum.quanto"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(ImportError, match="torchao.*optimum-quanto.*BitsAndBytesConfig"):
        tiny_model("glm4").quantize(8)


def quantized_runs_close(model, reference, ids, tolerance=0.05):
    """A quantized model runs forward and generate, and stays near the full-precision logits (another random model
    is ~1.4 away in this measure; 4-bit weights of these tiny random layers move the logits by ~0.3)."""
    with torch.no_grad():
        got, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
        model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    relative = (got - expected).norm() / expected.norm()
    assert relative < tolerance, relative


IDS = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_with_a_maintained_library(tiny_model, bits):
    optional_package(*(("torchao", "torchao") if bits == 8 else ("optimum.quanto", "optimum-quanto")))
    model = tiny_model("glm4").quantize(bits)
    layer = model.transformer.encoder.layers[0].mlp.dense_h_to_4h
    assert type(layer) is not torch.nn.Linear or type(layer.weight) is not torch.nn.Parameter  # really quantized
    assert type(model.transformer.output_layer.weight) is torch.nn.Parameter  # the heads stay as they were
    quantized_runs_close(model, tiny_model("glm4"), IDS, tolerance=0.05 if bits == 8 else 0.5)


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_torch_ao_dynamic_int8_model_runs(tiny_model, family):
    """Every nn.Linear, the output layer included, becomes a module without a float `weight`."""
    model = torch.ao.quantization.quantize_dynamic(tiny_model(family), {torch.nn.Linear}, torch.qint8)
    quantized_runs_close(model, tiny_model(family), IDS, tolerance=0.15)  # activations are quantized too


def test_torch_ao_dynamic_int8_generate_equals_the_cached_greedy_loop(tiny_model):
    """generate() on a quantize_dynamic model picks the tokens of a greedy loop over the same model with its cache.
    (A loop that recomputes the whole sequence each step picks others: dynamic quantization scales each call's
    activations, one new token's or the whole sequence's; fp32 has no such difference.)"""
    model = torch.ao.quantization.quantize_dynamic(tiny_model("glm4"), {torch.nn.Linear}, torch.qint8)
    generated = model.generate(IDS, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens, past, steps = IDS, None, []
    with torch.no_grad():
        for _ in range(8):
            step = tokens if past is None else tokens[:, -1:]
            positions = torch.arange(tokens.shape[1] - step.shape[1], tokens.shape[1]).expand(len(tokens), -1)
            out = model(input_ids=step, position_ids=positions, past_key_values=past, use_cache=True)
            past, chosen = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, chosen], dim=1)
    assert torch.equal(generated, tokens)


# ---- ChatGLM2 (chatglm2-6b): its chat API with its own tokenizer (tokvec/chatglm2.jsonl) ----


@pytest.fixture(scope="module")
def chatglm2_chat(tmp_path_factory, chatglm2_records):
    """(model, tokenizer) of a chatglm2-6b folder as users have it, holding the tiny random model the chat records
    were made with (tokvec FORMAT.md, chatglm2.jsonl: the records' `tiny_model`): same config, same draws."""
    specs = [r["tiny_model"] for r in chatglm2_records if "tiny_model" in r]
    spec = specs[0]
    assert all(other == spec for other in specs) and spec["init"].startswith("every parameter re-drawn")
    overrides = json.loads(spec["config"][spec["config"].index("{"):])  # "real chatglm2-6b config.json with {...}"
    overrides["padded_vocab_size"] = chatglm2_records[0]["model_config_special_ids"]["padded_vocab_size"]
    folder = make_chatglm2_folder(tmp_path_factory.mktemp("chatglm2-chat"), config_changes=overrides)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()
    generator = torch.Generator().manual_seed(spec["init_seed"])
    with torch.no_grad():  # layernorm weights 1, word_embeddings normal(0, 1), others normal(0, 0.1)
        for name, param in model.named_parameters():
            if "layernorm" in name:
                param.fill_(1.0)
            else:
                scale = 1.0 if "word_embeddings" in name else 0.1
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    return model, load_tokenizer(folder)


def recorded_calls(monkeypatch, model, method: str) -> list:
    """Each call of model.<method>: {"kwargs": ..., "result": ...}; a generator's result is its last item."""
    calls, original = [], getattr(model, method)

    def recorder(**kwargs):
        call = {"kwargs": kwargs}
        calls.append(call)
        result = original(**kwargs)
        if not inspect.isgenerator(result):
            call["result"] = result
            return result
        return last_item_kept(result, call)

    monkeypatch.setattr(model, method, recorder)
    return calls


def last_item_kept(generator, call):
    for item in generator:
        call["result"] = item
        yield item


def stream_generate_inputs(call) -> dict:
    """What stream_chat handed stream_generate, in the record's fields. Without position_ids the model places the
    new tokens after those the attention mask covers (the cache's), so those are the positions it uses."""
    kwargs = call["kwargs"]
    mask, ids = kwargs["attention_mask"], kwargs["input_ids"]
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = (mask.cumsum(-1) - 1)[:, -ids.shape[1]:]
    output, _ = call["result"]
    return {"input_ids": ids.tolist(), "position_ids": positions.tolist(), "attention_mask": mask.tolist(),
            "past_key_values_given": kwargs.get("past_key_values") is not None,
            "max_length": kwargs["max_length"], "output_length": output.shape[1]}


def as_lists(history) -> list:
    return [list(item) for item in history]


def item_types(history) -> list:
    return [type(item).__name__ for item in history]


def test_chatglm2_chat_record(chatglm2_chat, chatglm2_records, monkeypatch):
    """chat() sends ChatGLM2's prompt, and the tiny model of the record answers as the original's did (same ids, so
    the same text); the history comes back as a new list with a (query, response) tuple added."""
    model, tokenizer = chatglm2_chat
    record = next(r for r in chatglm2_records if r.get("scenario") == "chat_call")
    calls = recorded_calls(monkeypatch, model, "generate")
    history_in = [tuple(pair) for pair in record["history"]]
    response, history = model.chat(tokenizer, record["query"], history=history_in, **record["call_kwargs"])
    (call,) = calls
    prompt = call["kwargs"]["input_ids"][0].tolist()
    assert prompt == record["prompt_ids"]
    assert call["result"][0, len(prompt):].tolist() == record["generated_ids"]
    assert response == record["response"] == model.process_response(tokenizer.decode(record["generated_ids"]))
    assert as_lists(history) == record["history_out"] and item_types(history) == record["history_out_item_types"]
    assert history is not history_in and history_in == [tuple(pair) for pair in record["history"]]


def test_chatglm2_stream_chat_record_and_its_follow_up_on_the_cache(chatglm2_chat, chatglm2_records, monkeypatch):
    """A first round, then a follow-up fed with the returned cache: the follow-up sends only build_stream_inputs'
    round after it (CHATGLM2-STREAM-INPUTS-NO-PREFIX), at the positions after the cache, which holds prompt + answer
    less the last id, as the original's (CHATGLM2-STREAM-PAST-EXCLUDES-LAST-ID); the answers are the original's."""
    model, tokenizer = chatglm2_chat
    record = next(r for r in chatglm2_records if r.get("scenario") == "stream_chat_call")
    calls = recorded_calls(monkeypatch, model, "stream_generate")
    steps = list(model.stream_chat(tokenizer, record["query"], history=record["history"],
                                   **record["round1_call_kwargs"]))
    history, cache = assert_stream_round(model, steps, calls[0], record, "round1", "round1_build_inputs_ids",
                                         "round1_past_length")
    steps = list(model.stream_chat(tokenizer, record["follow_up_query"], history=history, past_key_values=cache,
                                   **record["follow_up_call_kwargs"]))
    assert_stream_round(model, steps, calls[1], record, "follow_up", "follow_up_build_stream_inputs_ids",
                        "follow_up_past_length_after")


def assert_stream_round(model, steps, call, record, prefix: str, prompt_field: str, past_field: str):
    """One stream_chat round against the record's `<prefix>_...` fields; returns its history and cache."""
    assert len(steps) == record[f"{prefix}_n_yields"] and {len(step) for step in steps} == {3}
    response, history, cache = steps[-1]
    sent = record[f"{prefix}_stream_generate_inputs"]
    assert stream_generate_inputs(call) == sent and sent["input_ids"][0] == record[prompt_field]
    assert response == record[f"{prefix}_response"]
    assert as_lists(history) == record[f"{prefix}_history_out"]
    assert item_types(history) == record[f"{prefix}_history_out_item_types"]
    assert model.cached_tokens(cache) == record[past_field]
    return history, cache


def test_chatglm2_stream_chat_with_a_history_and_no_cache_sends_the_history(chatglm2_chat, chatglm2_records,
                                                                             monkeypatch):
    """CHATGLM2-STREAM-HISTORY-WITHOUT-PAST-DROPPED fixed: return_past_key_values=True without a cache sent only the
    last round ('\\n\\n[Round k]...', no [gMASK] sop, no history); the model now gets build_inputs' whole prompt."""
    model, tokenizer = chatglm2_chat
    record = next(r for r in chatglm2_records if r.get("scenario") == "build_inputs" and r["history"])
    calls = recorded_calls(monkeypatch, model, "stream_generate")
    *_, (_, history, _) = model.stream_chat(tokenizer, record["query"], history=record["history"],
                                            return_past_key_values=True, do_sample=False, max_new_tokens=2)
    sent = stream_generate_inputs(calls[0])
    assert sent["input_ids"] == record["build_inputs"]["input_ids"] != record["build_stream_inputs"]["input_ids"]
    assert sent["position_ids"] == record["build_inputs"]["position_ids"] and not sent["past_key_values_given"]
    assert as_lists(history[:-1]) == record["history"] and history[-1][0] == record["query"]


@pytest.mark.parametrize("record", chatglm2_params("chat", "build_inputs"))
def test_chatglm2_build_inputs_record(chatglm2_chat, record):
    model, tokenizer = chatglm2_chat
    for method, expected in ((model.build_inputs, record["build_inputs"]),
                             (model.build_stream_inputs, record["build_stream_inputs"])):
        inputs = method(tokenizer, record["query"], history=record["history"])
        assert {name: value.tolist() for name, value in inputs.items()} == expected, method.__name__


@pytest.mark.parametrize("record", chatglm2_params("chat", "process_response"))
def test_chatglm2_process_response_record(chatglm2_chat, record):
    """CHATGLM2-PROCESS-RESPONSE-MINIMAL: strip, and [[训练时间]] as 2023年; nothing else is rewritten."""
    model, _ = chatglm2_chat
    assert model.process_response(record["raw"]) == record["processed"]


class OriginalChatGLM2Tokenizer:
    """What chat() can see of chatglm2-6b's original tokenizer (a folder where only modeling_chatglm.py was
    replaced): build_prompt, no build_chat_input, no chatglm_family. Everything else is our ChatGLM2 tokenizer's."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        if name in ("build_chat_input", "chatglm_family"):
            raise AttributeError(name)
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)


def test_chatglm2_chat_with_the_original_tokenizer_is_chatglm2s(chatglm2_chat, chatglm2_records):
    model, tokenizer = chatglm2_chat
    record = next(r for r in chatglm2_records if r.get("scenario") == "chat_call")
    response, history = model.chat(OriginalChatGLM2Tokenizer(tokenizer), record["query"], **record["call_kwargs"])
    assert response == record["response"] and as_lists(history) == record["history_out"]


@pytest.mark.parametrize("call, message", [
    (dict(history=[{"role": "user", "content": "你好"}]), r"history\[0\].*\(query, response\) pair"),
    (dict(history=[("你好", "你好！", "extra")]), r"history\[0\] must be a \(query, response\) pair"),
    (dict(history=[], role="system"), r"role='system'.*no roles"),
])
def test_chatglm2_chat_names_what_it_cannot_take(chatglm2_chat, call, message):
    model, tokenizer = chatglm2_chat
    with pytest.raises(ValueError, match=message):
        model.chat(tokenizer, "hi", **call)


@pytest.mark.parametrize("call", [dict(query="hi\ud800"), dict(query="hi", history=[("a\ud800", "b")])])
def test_chatglm2_chat_with_a_lone_surrogate_names_it(chatglm2_chat, call):
    """It ended in SentencePiece's "Unable to cast Python instance of type <class 'str'> to C++ type"."""
    model, tokenizer = chatglm2_chat
    named = "query" if "history" not in call else r"history\[0\]\[0\]"
    with pytest.raises(ValueError, match=rf"^{named} holds a lone surrogate '\\ud800' at position \d"):
        model.chat(tokenizer, **call)


def test_chatglm3_folder_keeps_chatglm3s_chat(tiny_model, tmp_path, monkeypatch):
    """A chatglm3-6b folder (its tokenizer files and config.json): chat() sends build_chat_input's prompt and returns
    role messages, as before."""
    folder = make_tokenizer_folder(tmp_path / "chatglm3-6b", "chatglm3")
    shutil.copy(shared_path("configs", "chatglm3-6b", "config.json"), folder / "config.json")
    tokenizer = load_tokenizer(folder)
    model = small_chat_model(tiny_model, "chatglm3")
    calls = recorded_calls(monkeypatch, model, "generate")
    _, history = model.chat(tokenizer, "你好", history=[], **GREEDY)
    sent = calls[0]["kwargs"]["input_ids"].tolist()
    assert sent == tokenizer.build_chat_input("你好")["input_ids"].tolist()
    assert 64795 in sent[0] and history[0] == {"role": "user", "content": "你好"}


# ---- a continued chat: the cache and the new ids make the whole conversation, whatever the template ----

HISTORY = [{"role": "user", "content": "你好"}, {"role": "assistant", "metadata": "", "content": "你好👋"}]
CODEGEEX_SYSTEM = "你是一位智能编程助手，你叫CodeGeeX。你会为用户回答关于编程、代码、计算机方面的任何问题。"
# Templates GLM-4 checkpoints ship besides glm-4-9b-chat's: codegeex4-all-9b's later one, as serving projects ship it,
# renders no [gMASK]<sop>, adds a default system prompt when the first message is not a system one, and ends the
# generation prompt with "<|assistant|>\n"; and glm-4-9b-chat's own without its [gMASK]<sop>.
TEMPLATES = {
    "default system prompt": (
        "{% if messages[0]['role'] != 'system' %}<|system|>\n" + CODEGEEX_SYSTEM + "{% endif %}"
        "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "no prefix": json.loads(shared_path("tokenizers", "glm-4-9b-chat", "tokenizer_config.json").read_text(
        encoding="utf-8"))["chat_template"].replace("[gMASK]<sop>", ""),
}


@pytest.fixture(scope="module")
def glm4_chat_model(tiny_model):
    return small_chat_model(tiny_model, "glm4")


def rendered(tokenizer, messages, add_generation_prompt=False):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_continued_chat_sends_what_follows_the_cached_history(glm4_chat_model, tokenizer_folder_factory,
                                                               monkeypatch, template):
    """The round sent after a cache of the history is the whole conversation rendered afresh less the history: it
    cut the first two ids of the new round, assuming [gMASK]<sop> there (with the CodeGeeX template the round lost
    <|system|> and the default system prompt's body landed mid-conversation). The answer is generate()'s on the
    whole conversation."""
    model = glm4_chat_model
    tokenizer = load_tokenizer(tokenizer_folder_factory("glm4", "glm4-template",
                                                        config_changes={"chat_template": TEMPLATES[template]}))
    held = rendered(tokenizer, HISTORY)
    whole = tokenizer.apply_chat_template(HISTORY + [{"role": "user", "content": "再见"}], add_generation_prompt=True,
                                          tokenize=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        cache = kv_cache.returned(model(input_ids=held, use_cache=True))
    calls = recorded_calls(monkeypatch, model, "stream_generate")
    *_, (response, _) = model.stream_chat(tokenizer, "再见", history=HISTORY, past_key_values=cache, **GREEDY)
    sent = calls[0]["kwargs"]["input_ids"]
    assert torch.cat([held, sent], 1).tolist() == whole["input_ids"].tolist()
    truth = answer_ids(model.generate(**whole, eos_token_id=stop_ids(tokenizer), **GREEDY)[0],
                       whole["input_ids"].shape[1], stop_ids(tokenizer))
    assert response == model.process_response(tokenizer.decode(truth), HISTORY)[0]


def test_a_template_that_renders_the_history_otherwise_is_refused(glm4_chat_model, tokenizer_folder_factory):
    """A template that marks the last message renders the history differently once a message follows it: the new
    ids cannot be placed after the cache, and the error says so instead of sending a wrong round."""
    template = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
                "{% if loop.last %} (latest){% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer = load_tokenizer(tokenizer_folder_factory("glm4", "glm4-last-marked",
                                                        config_changes={"chat_template": template}))
    with torch.no_grad():
        cache = kv_cache.returned(glm4_chat_model(input_ids=rendered(tokenizer, HISTORY), use_cache=True))
    with pytest.raises(ValueError, match=r"renders `history` followed by the new message differently.*"
                                         r"past_key_values=None"):
        list(glm4_chat_model.stream_chat(tokenizer, "再见", history=HISTORY, past_key_values=cache, **GREEDY))


def answer_ids(ids, prompt_length: int, stops: list) -> list:
    answer = ids[prompt_length:].tolist()
    return answer[:-1] if answer and answer[-1] in stops else answer


# ---- a prompt that reaches max_length ----


@pytest.mark.parametrize("chat_kind", ["glm4", "chatglm2"])
def test_stream_chat_past_max_length_gives_one_token_as_the_original(chat_kind, glm4_chat_model, glm4_tokenizer,
                                                                      chatglm2_chat, monkeypatch):
    """It raised UnboundLocalError ('text'). The originals' stream_generate generated one token and warned; their
    chat() raised generate()'s ValueError, naming both lengths."""
    model, tokenizer = (glm4_chat_model, glm4_tokenizer) if chat_kind == "glm4" else chatglm2_chat
    calls = recorded_calls(monkeypatch, model, "stream_generate")
    with LoggedMessages(type(model).__module__) as log:
        steps = list(model.stream_chat(tokenizer, "hi", history=[], max_length=3, do_sample=False))
    prompt = calls[0]["kwargs"]["input_ids"].shape[1]
    assert prompt > 3 and len(steps) == 1 and calls[0]["result"][0].shape[1] == prompt + 1
    assert any(f"Input length of input_ids is {prompt}, but `max_length` is set to 3" in m for m in log.messages)
    with pytest.raises(ValueError, match=rf"Input length of input_ids is {prompt}, but `max_length` is set to 3"):
        model.chat(tokenizer, "hi", history=[], max_length=3, do_sample=False)


# ---- stream_chat applies every generation setting chat() (generate()) applies ----


@pytest.fixture(scope="module", params=["chatglm3", "glm4", "chatglm2"])
def each_chat_format(request, tiny_model):
    """(model, tokenizer, a stop id of its chat) for ChatGLM3's and GLM-4's role messages and ChatGLM2's rounds."""
    if request.param == "chatglm2":
        model, tokenizer = request.getfixturevalue("chatglm2_chat")
        return model, tokenizer, tokenizer.eos_token_id
    model = request.getfixturevalue("glm4_chat_model") if request.param == "glm4" \
        else small_chat_model(tiny_model, request.param)
    tokenizer = request.getfixturevalue(TOKENIZER[request.param])
    return model, tokenizer, tokenizer.get_command("<|observation|>")


class EndAt(LogitsProcessor):
    """Leaves `token` the only choice once the ids reach `length`."""

    def __init__(self, length: int, token: int):
        self.length, self.token = length, token

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] >= self.length:
            scores[:, :self.token] = scores[:, self.token + 1:] = -float("inf")
        return scores


SAMPLED, SHORT_GREEDY = dict(max_length=None, max_new_tokens=8), dict(GREEDY, max_new_tokens=8)
REPEATING = dict(SHORT_GREEDY, repetition_penalty=0.01)  # below 1: the tokens seen so far come back
# setting: (the call's other settings, (prompt length, the answer's ids without the setting, a stop id) -> the setting).
# Each changes the tiny models' answer with SEED (asserted); the sampled ones keep chat()'s top_p and temperature.
SETTINGS = {
    "no_repeat_ngram_size": (REPEATING, lambda prompt, answer, stop: dict(no_repeat_ngram_size=2)),
    "min_p": (SAMPLED, lambda prompt, answer, stop: dict(min_p=0.9)),
    "typical_p": (SAMPLED, lambda prompt, answer, stop: dict(typical_p=0.2)),
    "bad_words_ids": (SHORT_GREEDY, lambda prompt, answer, stop: dict(bad_words_ids=[[answer[1]]])),
    "suppress_tokens": (SHORT_GREEDY, lambda prompt, answer, stop: dict(suppress_tokens=answer[:2])),
    "repetition_penalty": (SHORT_GREEDY, lambda prompt, answer, stop: dict(repetition_penalty=0.01)),
    "top_k": (SAMPLED, lambda prompt, answer, stop: dict(top_k=2)),
    "top_p": (SAMPLED, lambda prompt, answer, stop: dict(top_p=0.1)),
    "temperature": (SAMPLED, lambda prompt, answer, stop: dict(temperature=0.1)),
    "max_new_tokens": (SHORT_GREEDY, lambda prompt, answer, stop: dict(max_new_tokens=3)),
    "max_length": (SHORT_GREEDY, lambda prompt, answer, stop: dict(max_new_tokens=None, max_length=prompt + 3)),
    "eos": (SHORT_GREEDY, lambda prompt, answer, stop: dict(logits_processor=[EndAt(prompt + 3, stop)])),
}
SEED = 3


@pytest.mark.parametrize("setting", SETTINGS)
def test_stream_chat_ends_in_chats_answer_with_each_setting(each_chat_format, setting, monkeypatch):
    """stream_chat sampled with five processors of its own: no_repeat_ngram_size, min_p, typical_p, bad_words_ids
    and suppress_tokens were taken and ignored. With the same settings and seed its last answer is chat()'s."""
    model, tokenizer, stop = each_chat_format
    others, choose = SETTINGS[setting]
    calls = recorded_calls(monkeypatch, model, "generate")
    torch.manual_seed(SEED)
    without = model.chat(tokenizer, "写一首诗", history=[], **others)
    prompt = calls[0]["kwargs"]["input_ids"].shape[1]
    settings = dict(others, **choose(prompt, calls[0]["result"][0, prompt:].tolist(), stop))
    torch.manual_seed(SEED)
    expected = model.chat(tokenizer, "写一首诗", history=[], **settings)
    assert expected != without, f"{setting} does not change this answer: the test would show nothing"
    torch.manual_seed(SEED)
    *_, last = model.stream_chat(tokenizer, "写一首诗", history=[], **settings)
    assert last == expected


@pytest.mark.parametrize("settings, named", [(dict(num_beams=2), "num_beams=2"),
                                             (dict(num_return_sequences=2), "num_return_sequences=2"),
                                             (dict(do_sample=False, penalty_alpha=0.6, top_k=4), "penalty_alpha=0.6")])
def test_stream_chat_refuses_a_setting_it_cannot_apply_naming_it(each_chat_format, settings, named):
    """num_beams was taken and ignored: the answer streamed was sampled, not the beam search's."""
    model, tokenizer, _ = each_chat_format
    with pytest.raises(ValueError, match=rf"stream_chat\(\) / stream_generate\(\) cannot apply {named}.*"
                                         r"Use chat\(\) / generate\(\)"):
        next(model.stream_chat(tokenizer, "你好", history=[], **settings))


# ---- OpenAI-style content parts ----


def test_history_with_text_content_parts_sends_their_text(chat_setup, monkeypatch):
    """[{"type": "text", "text": ...}] content put the list's Python repr into the prompt."""
    _, model, tokenizer = chat_setup
    calls = recorded_calls(monkeypatch, model, "generate")
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]}]
    _, history = model.chat(tokenizer, "再见", history=parts, **GREEDY)
    model.chat(tokenizer, "再见", history=[{"role": "user", "content": "hello there"},
                                          {"role": "assistant", "content": "Hi!"}], **GREEDY)
    assert calls[0]["kwargs"]["input_ids"].tolist() == calls[1]["kwargs"]["input_ids"].tolist()
    assert history[:2] == [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "Hi!"}]


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, r"is a 'image_url' part.*'image'"),
    ({"type": "text", "text": None}, r"is a text part without a str 'text'"),
    ("plain", r"is a 'str' part"),
])
def test_history_with_other_content_parts_is_refused_naming_them(chat_setup, part, message):
    _, model, tokenizer = chat_setup
    history = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(ValueError, match=r"history\[0\]\['content'\]\[1\] " + message):
        model.chat(tokenizer, "hi", history=history, **GREEDY)
