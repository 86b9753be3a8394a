"""Drop-in beyond numbers: every public name of the ORIGINAL objects exists on ours, with the same kind, the
original's parameters and the tokenizer's recorded values (testdata/surface, recorded from the original code), and the
clients that read those names (ChatGLM3's finetune_hf.py sanity check, its cli_demo's streaming loop, attention hooks
on `core_attention`) run as they do with the original files.
"""
import ast
import inspect
import json
import os
import re

import pytest
import torch
from torch import nn

from chatglm_tools import REPO, shared_path
from tokenizer_fixtures import load_jsonl

SURFACES = ("chatglm3", "glm4", "chatglm2")
# Names whose recorded value is an original bug this fork fixes on purpose; the "Drop-in surface" section of
# docs/drop-in-surface.md lists each. (family, path, name) -> why.
KNOWN_DIFFERENCES = {
    ("chatglm3", "tokenizer", "total_vocab_size"):
        "64798, every id: the original's 64796 counted <unk>, <s> and </s> once, all three named ''",
}


def load_surface(family: str) -> dict:
    return json.loads(shared_path("surface", f"{family}.json").read_text(encoding="utf-8"))


def recorded_config(surface: dict) -> dict:
    """The tiny checkpoint's config as recorded: every config attribute with its value (None for NoneType)."""
    return {name: entry.get("value") for name, entry in surface["objects"]["config"]["names"].items()
            if entry["kind"] == "attribute" and ("value" in entry or entry["type"] == "NoneType")}


@pytest.fixture(scope="session")
def surface_objects(chatglm, chatglm3_tokenizer, glm4_tokenizer, chatglm2_tokenizer):
    """family -> (surface, {"model", "tokenizer", "config"}): our model built from the recorded config (the
    attention implementation the original ran: GLM-4's sdpa, ChatGLM2/3's eager) and our tokenizer."""
    tokenizers = {"chatglm3": chatglm3_tokenizer, "glm4": glm4_tokenizer, "chatglm2": chatglm2_tokenizer}
    built = {}
    for family in SURFACES:
        surface = load_surface(family)
        config = chatglm.ChatGLMConfig(**recorded_config(surface))
        if family == "chatglm2":
            config._name_or_path = "THUDM/chatglm2-6b"  # a chatglm2-6b folder
        config._attn_implementation = "sdpa" if family == "glm4" else "eager"
        model = chatglm.modeling.ChatGLMForConditionalGeneration(config).eval()
        built[family] = (surface, {"model": model, "tokenizer": tokenizers[family], "config": model.config})
    return built


def reach(objects: dict, path: str):
    """The object at a surface PATH such as `model.transformer.encoder.layers[0].self_attention`."""
    head, *rest = re.split(r"\.(?![^\[]*\])", path)
    obj = objects[head]
    for part in rest:
        name, index = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", part).groups()
        obj = getattr(obj, name)
        if index is not None:
            obj = obj[int(index)]
    return obj


def parameters_of(signature: str) -> list:
    """(name, kind, default source) of each parameter of a recorded signature `(a, b: int = 1, **kwargs) -> str`."""
    args = ast.parse(f"def f{signature}: pass").body[0].args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    found = [(a.arg, "positional", None if d is None else ast.unparse(d)) for a, d in zip(positional, defaults)]
    if args.vararg:
        found.append((args.vararg.arg, "*", None))
    found += [(a.arg, "keyword", None if d is None else ast.unparse(d))
              for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        found.append((args.kwarg.arg, "**", None))
    return found


def our_parameters(function) -> list:
    kinds = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**",
             inspect.Parameter.KEYWORD_ONLY: "keyword"}
    found = []
    for parameter in inspect.signature(function).parameters.values():
        default = None if parameter.default is inspect.Parameter.empty else parameter.default
        source = None if parameter.default is inspect.Parameter.empty else (
            repr(default) if not isinstance(default, (torch.dtype,)) else str(default))
        found.append((parameter.name, kinds.get(parameter.kind, "positional"), source))
    return found


def same_default(recorded: str, ours: str) -> bool:
    if recorded is None:  # required in the original: a default here still takes every call
        return True
    if ours is None:
        return False
    try:
        return ast.literal_eval(recorded) == ast.literal_eval(ours)
    except ValueError:
        return recorded == ours


def takes_every_call(recorded: list, ours: list) -> bool:
    """Whether our parameters take every call the original's take: the same names, kinds and order, the same
    defaults (or one where the original required the argument), and any further parameters optional and placed
    after the original's (before a **kwargs both have)."""
    tail = [p for p in ours if p[1] == "**"] if recorded and recorded[-1][1] == "**" else []
    head, extra = ours[:len(recorded) - len(tail)], ours[len(recorded) - len(tail):len(ours) - len(tail)]
    if [(n, k) for n, k, _ in recorded] != [(n, k) for n, k, _ in head + tail]:
        return False
    if not all(same_default(r[2], o[2]) for r, o in zip(recorded, head + tail)):
        return False
    return all(default is not None or kind in ("*", "**") for _, kind, default in extra)


def mismatch(obj, name: str, entry: dict):
    """Why `obj.name` is not the recorded ENTRY, or None when it is."""
    kind = entry["kind"]
    if kind == "module":
        module = getattr(obj, "_modules", {}).get(name)
        if module is None:
            return "is not a submodule"
        return None if type(module).__name__ == entry["type"] else f"is a {type(module).__name__}"
    try:
        value = getattr(obj, name)
    except AttributeError as err:
        return f"is missing ({err})"
    if kind == "method":
        if not callable(value) or isinstance(value, nn.Module):
            return f"is not a method but {type(value).__name__}"
        recorded, ours = parameters_of(entry["signature"]), our_parameters(value)
        return None if takes_every_call(recorded, ours) else f"takes {ours}, the original {recorded}"
    if callable(value) and not isinstance(value, (torch.Tensor, re.Pattern)) and entry["type"] != "SPTokenizer" \
            and entry["type"] != "Encoding" and entry["type"] != "SentencePieceProcessor":
        return f"is callable ({type(value).__name__}), not an attribute"
    if type(value).__name__ != entry["type"]:
        return f"is a {type(value).__name__}, the original's a {entry['type']}"
    if name == "vocab_file":  # recorded as the file's name; both keep the path loaded from
        value = os.path.basename(value)
    if "value" in entry and json.loads(json.dumps(value)) != entry["value"]:
        return f"is {value!r:.200}, the original's {entry['value']!r:.200}"
    return None


@pytest.mark.parametrize("family", SURFACES)
def test_every_recorded_name_matches(surface_objects, family):
    surface, objects = surface_objects[family]
    problems = []
    for path, recorded in surface["objects"].items():
        try:
            obj = reach(objects, path)
        except AttributeError as err:
            problems.append(f"{path} is missing ({err})")
            continue
        for name, entry in recorded["names"].items():
            problem = mismatch(obj, name, entry)
            if problem and (family, path, name) not in KNOWN_DIFFERENCES:
                problems.append(f"{path}.{name} {problem}")
    assert not problems, f"{len(problems)} names differ from the original's:\n" + "\n".join(problems)


@pytest.mark.parametrize("family", SURFACES)
def test_every_submodule_name_exists(surface_objects, family):
    surface, objects = surface_objects[family]
    ours = {name for name, _ in objects["model"].named_modules()}
    assert not set(surface["module_names"]) - ours


def test_known_differences_are_real_and_documented(surface_objects):
    """Each deliberate difference still differs (else it belongs back in the check) and the docs name it."""
    page = REPO.joinpath("docs", "drop-in-surface.md").read_text(encoding="utf-8")
    section = page.split("\n## Drop-in surface\n", 1)[1].split("\n## ")[0]
    for (family, path, name), why in KNOWN_DIFFERENCES.items():
        surface, objects = surface_objects[family]
        assert mismatch(reach(objects, path), name, surface["objects"][path]["names"][name]), (family, path, name)
        assert f"`{path}.{name}`" in section, f"docs/drop-in-surface.md: Drop-in surface does not list {path}.{name}"


# ---- What the clients do ---------------------------------------------------------------------------------------


def test_chatglm3_finetune_sanity_check_maps_every_prompt_id(chatglm3_tokenizer):
    """ChatGLM3 finetune_demo/finetune_hf.py builds a conversation's ids from get_prefix_tokens() and
    build_single_message(), then, before training, prints each id as text: control ids through
    `tokenizer.tokenizer.index_special_tokens[id]`, the others through decode([id])."""
    tokenizer = chatglm3_tokenizer
    conversation = [{"role": "system", "content": "You are ChatGLM3."}, {"role": "user", "content": "你好"},
                    {"role": "assistant", "content": "你好👋！有什么可以帮你？"}]
    input_ids = tokenizer.get_prefix_tokens()
    for message in conversation:
        input_ids += tokenizer.build_single_message(message["role"], "", message["content"])
    input_ids.append(tokenizer.eos_token_id)

    recorded = load_surface("chatglm3")["objects"]["tokenizer.tokenizer"]["names"]["index_special_tokens"]["value"]
    shown = []
    for in_id in input_ids:  # the script's loop
        if in_id == 0:
            continue
        if in_id in tokenizer.tokenizer.index_special_tokens:
            in_text = tokenizer.tokenizer.index_special_tokens[in_id]
        else:
            in_text = tokenizer.decode([in_id])
        shown.append((in_id, in_text))
    controls = [(i, text) for i, text in shown if str(i) in recorded]
    assert controls == [(i, recorded[str(i)]) for i, _ in controls]
    assert [text for _, text in controls] == ["[gMASK]", "sop", "<|system|>", "<|user|>", "<|assistant|>"]


class ForcedAnswer(torch.nn.Module):
    """A logits processor that makes the model answer `ids`, one per step after the prompt."""

    def __init__(self, ids, prompt_length):
        super().__init__()
        self.ids, self.prompt_length = ids, prompt_length

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_length
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.ids[step] if step < len(self.ids) else 2] = 0.0
        return forced


@pytest.mark.parametrize("answer", ["你好👋！我是人工智能助手 ChatGLM3-6B，很高兴见到你。", "OK"])
def test_chatglm3_cli_demo_streaming_loop_prints_the_answer(tiny_model, chatglm3_tokenizer, answer):
    """ChatGLM3 basic_demo/cli_demo.py prints `response[current_length:]` from every stream_chat step: each
    partial answer without a newline is text, as the original's process_response reads it."""
    tokenizer = chatglm3_tokenizer
    model = tiny_model("chatglm3", padded_vocab_size=65024, hidden_size=32, num_attention_heads=2, kv_channels=16,
                       ffn_hidden_size=48, num_layers=2)
    ids = tokenizer.encode(answer, add_special_tokens=False)
    prompt_length = tokenizer.build_chat_input("你好", history=[])["input_ids"].shape[1]
    printed, current_length, past_key_values, history = "", 0, None, []
    for response, history, past_key_values in model.stream_chat(
            tokenizer, "你好", history=history, top_p=1, temperature=0.01, past_key_values=past_key_values,
            return_past_key_values=True, logits_processor=[ForcedAnswer(ids, prompt_length)]):
        printed += response[current_length:]
        current_length = len(response)
    assert printed == answer
    assert history[-1] == {"role": "assistant", "metadata": "", "content": answer}


def original_process_response(output: str, history: list):
    """ChatGLM3's process_response as the original computes it (reference for the test below; its tool call is
    read here with ast instead of eval)."""
    content, history = "", [dict(message) for message in history]
    for response in output.split("<|assistant|>"):
        metadata, content = response.split("\n", maxsplit=1) if "\n" in response else ("", response)
        if not metadata.strip():
            content = content.strip()
            history.append({"role": "assistant", "metadata": metadata, "content": content})
            content = content.replace("[[训练时间]]", "2023年")
        else:
            history.append({"role": "assistant", "metadata": metadata, "content": content})
            if history[0]["role"] == "system" and "tools" in history[0]:
                call = ast.parse("\n".join(content.split("\n")[1:-1]).strip(), mode="eval").body
                content = {"name": metadata.strip(),
                           "parameters": {k.arg: ast.literal_eval(k.value) for k in call.keywords}}
            else:
                content = {"name": metadata.strip(), "content": content}
    return content, history


TOOLS = [{"role": "system", "content": "Answer with tools.", "tools": [{"name": "get_weather"}]}]


@pytest.mark.parametrize("output, history", [
    ("你好", []),
    (" 你好，我是 [[训练时间]] ", []),
    ("\n你好", []),
    ("第一行\n第二行", []),
    ("get_weather\n```python\ntool_call(city='北京')\n```", TOOLS),
    ("get_weather\n```python\ntool_call(city='北京')\n```", []),
    ("想一想<|assistant|>get_weather\n```python\ntool_call(days=3)\n```", TOOLS),
    ("没有换行的回答", TOOLS),
])
def test_process_response_reads_answers_as_the_original(surface_objects, output, history):
    model = surface_objects["chatglm3"][1]["model"]
    assert model.process_response(output, history) == original_process_response(output, history)


def test_chatglm2_process_response_takes_its_parameter_name(surface_objects):
    model = surface_objects["chatglm2"][1]["model"]
    assert model.process_response(response=" [[训练时间]] 的回答\n") == "2023年 的回答"


def test_glm4_build_single_message_as_text_encodes_to_its_ids(glm4_tokenizer):
    """GLM-4's finetune and API demos build prompts as text with build_single_message(..., tokenize=False)."""
    tokenizer = glm4_tokenizer
    for role, metadata, message in [("system", "", "You are GLM-4."), ("user", "", "你好\n世界"),
                                    ("assistant", "get_weather", '{"city": "北京"}')]:
        text = tokenizer.build_single_message(role, metadata, message, tokenize=False)
        assert text == f"<|{role}|>{metadata}\n{message}"
        assert tokenizer.encode(text, add_special_tokens=False) == \
            tokenizer.build_single_message(role, metadata, message)


# ---- core_attention: hooks and patches see every attention computation -----------------------------------------


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_forward_hook_on_core_attention_sees_every_layer(tiny_model, implementation):
    """A hook sees every layer's attention call as this model makes it (hooks only read): query [batch, heads, seq,
    dim], key and value per key/value group, the kernel's inputs in the mask's place, and one [batch, seq, hidden]
    tensor back (docs/serving-and-tools.md; tests/test_contracts.py checks the values)."""
    model = tiny_model("glm4", attn_implementation=implementation)
    seen = []
    hooks = [layer.self_attention.core_attention.register_forward_hook(
        lambda module, args, output: seen.append((module.layer_number, [tuple(a.shape) for a in args[:3]],
                                                  type(args[3]).__name__, tuple(output.shape))))
        for layer in model.transformer.encoder.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7, 8]]))
    finally:
        for hook in hooks:
            hook.remove()
    heads, groups, dim = model.config.num_attention_heads, model.config.multi_query_group_num, model.config.kv_channels
    assert seen == [(number, [(1, heads, 4, dim)] + [(1, groups, 4, dim)] * 2, "KernelInputs", (1, 4, heads * dim))
                    for number in range(1, model.config.num_layers + 1)]


def test_a_patched_core_attention_forward_changes_the_output(tiny_model):
    """The kernel call goes through core_attention: a patch of its forward is what the model computes."""
    model = tiny_model("chatglm3")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(ids).logits
        core = model.transformer.encoder.layers[1].self_attention.core_attention
        original_forward = core.forward
        core.forward = lambda *args, **kwargs: torch.zeros_like(original_forward(*args, **kwargs))
        try:
            patched = model(ids).logits
        finally:
            del core.forward
        assert torch.equal(model(ids).logits, before)
    assert not torch.allclose(patched, before)


def test_core_attention_holds_no_weights(surface_objects):
    model = surface_objects["glm4"][1]["model"]
    for layer in model.transformer.encoder.layers:
        assert not list(layer.self_attention.core_attention.state_dict())


# ---- GLM-4V (glm-4v-9b): its original objects' names ----------------------------------------------------------
# From glm-4v-9b's original visual.py and modeling_chatglm.py: every name its objects define, by kind.
GLM4V_NAMES = {
    "model": {"attribute": ["max_sequence_length"], "method": ["get_masks", "get_position_ids",
                                                               "get_multimodal_position_ids"]},
    "model.transformer": {"module": ["embedding", "rotary_pos_emb", "encoder", "output_layer", "vision"],
                          "attribute": ["num_layers", "multi_query_group_num", "kv_channels", "seq_length",
                                        "pre_seq_len", "prefix_projection"],
                          "method": ["get_prompt"]},
    "model.transformer.vision": {"module": ["patch_embedding", "transformer", "linear_proj", "conv"],
                                 "attribute": ["boi", "eoi", "scaling_factor"]},
    "model.transformer.vision.patch_embedding": {"module": ["proj", "position_embedding"],
                                                 "attribute": ["cls_embedding"]},
    "model.transformer.vision.transformer": {"module": ["layers"]},
    "model.transformer.vision.transformer.layers[0]": {
        "module": ["input_layernorm", "attention", "mlp", "post_attention_layernorm"]},
    "model.transformer.vision.transformer.layers[0].attention": {
        "module": ["query_key_value", "dense", "output_dropout"], "attribute": ["num_heads", "scale"],
        "method": ["attention"]},
    "model.transformer.vision.transformer.layers[0].mlp": {"module": ["fc1", "fc2"],
                                                           "attribute": ["config", "activation_fn"]},
    "model.transformer.vision.linear_proj": {
        "module": ["linear_proj", "norm1", "act1", "dense_h_to_4h", "gate_proj", "dense_4h_to_h"],
        "attribute": ["act2"]},
}


def test_glm4v_original_names_exist(tiny_glm4v):
    model = tiny_glm4v()
    problems = []
    for path, kinds in GLM4V_NAMES.items():
        obj = reach({"model": model}, path)
        for kind, names in kinds.items():
            for name in names:
                if kind == "module":
                    ok = isinstance(obj._modules.get(name), nn.Module)
                elif kind == "method":
                    ok = callable(getattr(obj, name, None)) and not isinstance(getattr(obj, name), nn.Module)
                else:
                    ok = hasattr(obj, name)
                if not ok:
                    problems.append(f"{path}.{name} ({kind})")
    assert not problems
    attention = model.transformer.vision.transformer.layers[0].attention
    q, k, v = torch.randn(3, 1, attention.num_heads, 5, 8).unbind(0)
    torch.testing.assert_close(attention.attention(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v))


# ---- The original's methods return what the original returns ---------------------------------------------------


def test_get_prompt_is_the_originals_prefix_in_glm4_layout(ptuning):
    """glm-4's original get_prompt: the prefix encoder's output viewed [batch, pre_seq_len, 2 * layers, kv_heads,
    head_dim], permuted to [2 * layers, batch, kv_heads, pre_seq_len, head_dim] and split per layer."""
    model = ptuning.load()
    config, slots = model.config, ptuning.cases["prefix"]["pre_seq_len"]
    encoded = ptuning.expected["prefix_encoder_output"]  # the original's prefix_encoder(arange(pre_seq_len))
    expected = encoded[None].expand(2, -1, -1).reshape(
        2, slots, 2 * config.num_layers, config.multi_query_group_num, config.kv_channels).permute(2, 0, 3, 1, 4)
    with torch.no_grad():
        prompt = model.transformer.get_prompt(2, torch.device("cpu"), dtype=torch.float32)
    assert len(prompt) == config.num_layers
    for layer, pair in enumerate(prompt):
        torch.testing.assert_close(pair, expected[2 * layer: 2 * layer + 2], atol=1e-6, rtol=1e-6)


def test_get_prompt_without_a_prefix_says_what_to_do(surface_objects):
    with pytest.raises(ValueError, match="pre_seq_len"):
        surface_objects["glm4"][1]["model"].transformer.get_prompt(1, torch.device("cpu"))


def test_get_masks_and_get_position_ids_are_the_originals(surface_objects):
    model = surface_objects["chatglm3"][1]["model"]
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    causal = torch.ones(3, 3).tril().bool()
    assert torch.equal(model.get_masks(ids, None), ~causal.expand(2, 1, 3, 3))
    padding = torch.tensor([[0, 1, 1], [1, 1, 1]])
    masked = model.get_masks(ids, None, padding_mask=padding)
    # the original: keys at padding are masked, and a padded query row sees every key
    assert torch.equal(masked[0, 0], torch.tensor([[False, False, False], [True, False, True], [True, False, False]]))
    assert torch.equal(masked[1, 0], ~causal)
    past = [(torch.zeros(2, 2, 4, 16), torch.zeros(2, 2, 4, 16))] * 3
    with_past = model.get_masks(ids, past)
    assert with_past.shape == (2, 1, 3, 7) and not with_past[..., :4].any() and torch.equal(with_past[0, 0, :, 4:],
                                                                                          ~causal)
    assert model.get_position_ids(ids, ids.device).tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("family", ["glm4", "chatglm2"])
def test_forward_impl_is_the_table_the_model_rotates_with(surface_objects, family):
    """forward_impl(seq_len, n_elem, ...) -> [seq_len, n_elem / 2, (cos, sin)]: the angles forward() uses (rope_ratio
    included), for positions 0 .. seq_len - 1."""
    rotary = surface_objects[family][1]["model"].transformer.rotary_pos_emb
    table = rotary.forward_impl(6, rotary.dim, torch.float32, torch.device("cpu"))
    cos, sin = rotary.cos_sin(torch.arange(6)[None], torch.float32)
    assert table.shape == (6, rotary.dim // 2, 2)
    # forward()'s tables span the whole head: each angle repeats for its pair, sin signed (-, +) per pair
    torch.testing.assert_close(table[..., 0], cos[0, 0, :, :rotary.dim:2])
    torch.testing.assert_close(table[..., 1], sin[0, 0, :, 1:rotary.dim:2])
    assert rotary.forward_impl(6, rotary.dim, torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16


def test_sentencepiece_wrapper_methods_are_the_originals(chatglm3_tokenizer, chatglm3_records):
    sp, tokenizer = chatglm3_tokenizer.tokenizer, chatglm3_tokenizer
    for record in [r for r in chatglm3_records if r["kind"] == "encode"][:60]:
        text, ids = record["text"], record["sp_encode_ids"]  # the original SPTokenizer.encode's ids
        assert sp.encode(text) == ids
        pieces = sp.tokenize(text)
        assert [sp.convert_token_to_id(piece) for piece in pieces] == ids
        assert [sp.convert_id_to_token(index) for index in ids] == pieces
        assert sp.decode_tokens(pieces) == sp.decode(ids)
    # Control tokens: their text both ways; with encode_special_tokens every one of them is kept whole.
    assert sp.decode([sp.special_tokens["<|user|>"]] + sp.encode("你好")) == "<|user|>你好"
    assert sp.convert_id_to_token(sp.special_tokens["eop"]) == "eop" and sp.convert_id_to_token(sp.eos_id) == ""
    assert sp.tokenize("[MASK]hi<|user|>", encode_special_tokens=True)[0] == "[MASK]"
    assert "<|user|>" in sp.tokenize("[MASK]hi<|user|>", encode_special_tokens=True)
    assert tokenizer.decode(sp.encode("你好")) == sp.decode(sp.encode("你好"))


def test_encode_special_tokens_parses_every_control_token(tokenizer_folder_factory):
    from tokenizer_fixtures import load_tokenizer

    folder = tokenizer_folder_factory("chatglm3", "chatglm3-encode-special")
    plain, parsing = load_tokenizer(folder), load_tokenizer(folder, encode_special_tokens=True)
    assert plain.encode_special_tokens is False and parsing.encode_special_tokens is True
    mask, eop = parsing.get_command("[MASK]"), parsing.get_command("eop")
    assert mask not in plain.encode("a [MASK] b eop", add_special_tokens=False)
    ids = parsing.encode("a [MASK] b eop", add_special_tokens=False)
    assert mask in ids and ids[-1] == eop
