"""Loading: drop-in checkpoints, every real config, config validation, bad input, no import side effects."""
import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (CODE_FILES, REAL_VOCABULARY, REPO, TRANSFORMERS, LoggedMessages, Version, copy_code_into,
                      load_causal_lm, save_checkpoint, shared_path, tiny_config_dict)

REAL_CONFIGS = ("glm-4-9b-chat", "glm-4-9b-chat-1m", "glm-4-9b", "chatglm3-6b")
ORIGINAL_AUTO_MAP = {
    "AutoConfig": "configuration_chatglm.ChatGLMConfig",
    "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
    "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification",
}


def test_original_checkpoint_loads_with_no_missing_or_unexpected_keys(golden):
    model, info = load_causal_lm(golden.folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    keys = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert keys == golden.cases["checkpoint_keys"]


def test_save_and_reload_keeps_keys_and_numbers(golden, golden_model, tmp_path):
    folder = tmp_path / f"resaved_{golden.family}"
    golden_model.save_pretrained(folder)  # writes the code files too (4.46-4.52 left them out)
    assert {"modeling_chatglm.py", "configuration_chatglm.py", "parallel_chatglm.py"} <= {p.name for p in folder.iterdir()}
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(golden.cases["checkpoint_keys"])
    saved = json.loads((folder / "config.json").read_text())
    assert saved["auto_map"] == golden.cases["config"]["auto_map"]  # the checkpoint's own (chatglm2-6b-32k has 4)
    assert saved["num_layers"] == golden.cases["config"]["num_layers"]
    reloaded = load_causal_lm(folder, attn_implementation="eager")
    ids = golden.expected["seq_1_input_ids"][None]
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, golden_model(input_ids=ids).logits)


def test_repository_config_is_glm_4_9b_chat_with_original_auto_map():
    ours = json.loads((REPO / "config.json").read_text())
    original = json.loads(shared_path("configs", "glm-4-9b-chat", "config.json").read_text())
    assert ours == original
    assert ours["auto_map"] == ORIGINAL_AUTO_MAP
    assert json.loads((REPO / "generation_config.json").read_text()) == json.loads(
        shared_path("configs", "glm-4-9b-chat", "generation_config.json").read_text())


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_real_configs_build_full_size_models(chatglm, name):
    """Every field of the real configs is accepted, and the full-size model has the original keys and sizes."""
    fields = json.loads(shared_path("configs", name, "config.json").read_text())
    config = chatglm.ChatGLMConfig(**fields)
    assert config.num_hidden_layers == config.num_layers == fields["num_layers"]  # chatglm3 has no num_hidden_layers
    assert config.vocab_size == fields["padded_vocab_size"]
    for key, value in fields.items():
        if key not in ("torch_dtype", "transformers_version", "auto_map", "architectures", "_name_or_path",
                       "attn_implementation", "num_hidden_layers"):
            assert getattr(config, key) == value, key
    with torch.device("meta"):
        model = chatglm.modeling.ChatGLMForConditionalGeneration(config)
    params = sum(p.numel() for p in model.parameters())
    expected_billions = {"glm-4-9b-chat": 9.40, "glm-4-9b-chat-1m": 9.48, "glm-4-9b": 9.40, "chatglm3-6b": 6.24}[name]
    assert abs(params / 1e9 - expected_billions) < 0.01, params
    qkv = model.transformer.encoder.layers[0].self_attention.query_key_value.weight
    kv_groups = fields["multi_query_group_num"]
    assert list(qkv.shape) == [(32 + 2 * kv_groups) * 128, 4096]


BAD_CONFIGS = [
    ({"num_attention_heads": 6, "multi_query_group_num": 4}, "multi_query_group_num"),
    ({"kv_channels": 18}, "kv_channels"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"num_layers": -1}, "num_layers"),
    ({"padded_vocab_size": 1.5}, "padded_vocab_size"),
    ({"hidden_dropout": 1.0}, "hidden_dropout"),
    ({"layernorm_epsilon": 0}, "layernorm_epsilon"),
    ({"rope_ratio": 0}, "rope_ratio"),
    ({"num_layers": 3, "num_hidden_layers": 4}, "num_hidden_layers"),
    # It said "num_layers=3 but num_hidden_layers=3".
    ({"num_layers": 3, "num_hidden_layers": "3"}, "num_hidden_layers must be a positive integer, got '3'"),
    ({"num_layers": 3, "num_hidden_layers": 3.0}, "num_hidden_layers must be a positive integer"),
    ({"rope_ratio": float("inf")}, "rope_ratio must be a finite positive number, got inf"),
    ({"layernorm_epsilon": float("inf")}, "layernorm_epsilon must be a finite positive number"),
    ({"rope_ratio": float("nan")}, "rope_ratio must be a finite"),
    ({"hidden_dropout": float("nan")}, "hidden_dropout"),
    # vocab_size (the alias of padded_vocab_size) was dropped silently when it disagreed.
    ({"padded_vocab_size": 64, "vocab_size": 100}, "padded_vocab_size=64 but vocab_size=100"),
    ({"padded_vocab_size": 64, "vocab_size": "64"}, "vocab_size must be a positive integer"),
]


@pytest.mark.parametrize("overrides,field", BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_bad_config_raises_value_error_naming_the_field(chatglm, overrides, field):
    with pytest.raises(ValueError, match=field):
        chatglm.ChatGLMConfig(**{"multi_query_attention": True, "multi_query_group_num": 2, **overrides})


def test_config_changed_after_construction_is_checked_by_the_model(chatglm):
    config = chatglm.ChatGLMConfig(num_layers=1, hidden_size=32, ffn_hidden_size=32, kv_channels=8,
                                   num_attention_heads=4, padded_vocab_size=64, multi_query_attention=True,
                                   multi_query_group_num=2)
    config.multi_query_group_num = 3
    with pytest.raises(ValueError, match="multi_query_group_num"):
        chatglm.modeling.ChatGLMForConditionalGeneration(config)


def test_a_quantization_width_the_original_never_wrote_is_refused_naming_it(chatglm):
    """The original's quantize() stores 4 or 8 bits (tests/test_quantized.py loads those)."""
    config = chatglm.ChatGLMConfig(num_layers=1, hidden_size=32, ffn_hidden_size=32, kv_channels=8,
                                   num_attention_heads=4, padded_vocab_size=64, quantization_bit=3)
    with pytest.raises(ValueError, match="quantization_bit=3.*4 or 8"):
        chatglm.modeling.ChatGLMForConditionalGeneration(config)


@pytest.mark.parametrize("bad_id", [256, 10**6, -1])
def test_token_ids_outside_the_vocabulary_raise_a_clear_error(tiny_model, bad_id):
    model = tiny_model("glm4")
    ids = torch.tensor([[5, 6, bad_id, 7]])
    with pytest.raises(ValueError, match=r"outside this model's vocabulary \[0, 256\)"):
        model(input_ids=ids)


def test_import_has_no_global_side_effects(tmp_path):
    """The original flipped torch's JIT fuser flags at import; ours changes no global torch state."""
    package = tmp_path / "sidefx"
    package.mkdir()
    (package / "__init__.py").write_text("")
    copy_code_into(package)
    probe = (
        "import torch, sys\n"
        "state = lambda: (torch._C._jit_can_fuse_on_cpu(), torch._C._jit_can_fuse_on_gpu(),"
        " torch._C._get_graph_executor_optimize(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled())\n"
        "before = state()\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import sidefx.modeling_chatglm\n"
        "assert state() == before, (before, state())\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)
    assert "torch._C._jit" not in (REPO / "modeling_chatglm.py").read_text()


LOADERS = ("import_companion", "repository_module", "import_module")  # functions that import a module named by a string


def called_name(call) -> str:
    return getattr(call.func, "id", getattr(call.func, "attr", ""))


def repository_imports() -> dict:
    """Module -> the repository modules it imports, read from the source of every Python file of the repository:
    import statements anywhere (also inside functions), relative imports, and the modules loaded by name
    (import_companion("visual"), repository_module("tokenization_chatglm"), importlib.import_module("..."))."""
    import ast

    files = {}
    for path in sorted(REPO.rglob("*.py")):
        relative = path.relative_to(REPO)
        if relative.parts[0].startswith("."):
            continue
        package = relative.parts[1:-1] if relative.parts[0] == "tools" else ()
        name = ".".join(package + (() if path.stem == "__init__" else (path.stem,)))
        files[name] = (path, ".".join(package))
    graph = {}
    for name, (path, package) in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            found = []
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: within the file's package (remote code: beside it)
                    base = ".".join(filter(None, (package, base)))
                found = [base] + [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
            elif isinstance(node, ast.Call) and called_name(node) in LOADERS and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found = [node.args[0].value.split(".")[-1]]
            targets.update(target for target in found if target in files and target != name)
        graph[name] = targets
    return graph


def test_repository_import_graph_has_no_loop():
    """visual.py gets what it needs of modeling_chatglm.py as arguments (no import back), and no other file of the
    repository imports one that imports it."""
    graph = repository_imports()
    assert {"modeling_chatglm", "visual", "chatglm_tools.folder_transaction"} <= set(graph)
    assert "visual" in graph["modeling_chatglm"] and "modeling_chatglm" not in graph["visual"]
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            assert state.get(target) != "open", "import loop: " + " -> ".join(path + [target])
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.skipif(TRANSFORMERS >= Version("5.0"), reason="transformers 5 removed legacy tuple caches")
def test_legacy_tuple_cache_is_accepted_and_returned(tiny_model):
    model = tiny_model("glm4")
    ids = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits[0, -1]
        prefill = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
        legacy = prefill.to_legacy_cache()
        step = model(input_ids=ids[:, -1:], past_key_values=legacy, use_cache=True)
    assert isinstance(step.past_key_values, tuple) and step.past_key_values[0][0].shape[2] == 9
    torch.testing.assert_close(step.logits[0, -1], full, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(TRANSFORMERS < Version("5.0"), reason="tuple caches still work before transformers 5")
def test_legacy_tuple_cache_error_says_what_to_do(tiny_model):
    model = tiny_model("glm4")
    past = tuple((torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16)) for _ in range(3))
    with pytest.raises(TypeError, match="Cache"):
        model(input_ids=torch.tensor([[5]]), past_key_values=past)


def test_first_generation_chatglm_6b_config_is_refused(chatglm):
    """ChatGLM-6B (v1) names itself model_type "chatglm" too; its weights would all be missing here."""
    v1_fields = dict(hidden_size=4096, inner_hidden_size=16384, num_layers=28, num_attention_heads=32,
                     position_encoding_2d=True, gmask_token_id=130001, vocab_size=130528, max_sequence_length=2048)
    with pytest.raises(ValueError, match="first-generation ChatGLM-6B"):
        chatglm.ChatGLMConfig(**v1_fields)


def test_return_dict_false_gives_the_same_values_as_a_tuple(golden, golden_model):
    ids, labels = golden.expected["seq_0_input_ids"][None], golden.expected["seq_0_labels"][None]
    with torch.no_grad():
        as_dict = golden_model(input_ids=ids, labels=labels, use_cache=True)
        loss, logits, cache = golden_model(input_ids=ids, labels=labels, use_cache=True, return_dict=False)
    assert torch.equal(loss, as_dict.loss) and torch.equal(logits, as_dict.logits)
    assert cache.get_seq_length() == ids.shape[1]


# ---------------------------------------------------------------------------------------------------------------------
# modeling_chatglm.py copied alone over an original checkpoint folder (the fix the upstream issue threads give)
# ---------------------------------------------------------------------------------------------------------------------
from original_code import original_configuration_source  # noqa: E402


def original_folder_with_our_modeling(golden, tmp_path, configuration_source=None):
    """The golden checkpoint as a user has it (the original configuration_chatglm.py), with only our
    modeling_chatglm.py copied in."""
    folder = tmp_path / f"one_file_{golden.name.replace('-', '_')}"  # a package of its own per case
    folder.mkdir()
    for path in golden.folder.iterdir():
        if path.suffix != ".py":
            shutil.copy(path, folder / path.name)
    source = configuration_source or original_configuration_source(golden.family)
    (folder / "configuration_chatglm.py").write_text(source)
    shutil.copy(REPO / "modeling_chatglm.py", folder / "modeling_chatglm.py")
    return folder


def companions_imported(model) -> list:
    """The companion files imported for `model`'s code (its package's modules beside modeling_chatglm)."""
    package = type(model).__module__.rsplit(".", 1)[0]
    return sorted(name.rsplit(".", 1)[1] for name in sys.modules
                  if name.rsplit(".", 1)[0] == package and name.rsplit(".", 1)[1] + ".py" in CODE_FILES
                  and name.rsplit(".", 1)[1] not in ("modeling_chatglm", "configuration_chatglm"))


def test_modeling_file_copied_alone_gives_the_golden_numbers(golden, tmp_path):
    """Without its companion files the model loads, runs and generates; the load and input checks are skipped, which
    is said once, and no companion file is imported."""
    folder = original_folder_with_our_modeling(golden, tmp_path)
    with LoggedMessages("transformers_modules") as log:
        model = load_causal_lm(folder, attn_implementation="eager")
        with torch.no_grad():
            model(input_ids=golden.expected["seq_0_input_ids"][None])
    assert len([m for m in log.messages if "checks_chatglm.py is not beside modeling_chatglm.py" in m]) == 1
    assert companions_imported(model) == []
    assert type(model.config).__name__ == "ChatGLMConfig" and not hasattr(type(model.config), "validate_chatglm")
    expected = golden.expected
    with torch.no_grad():
        batch = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"],
                      position_ids=expected["position_ids"], labels=expected["labels"])
        real = expected["attention_mask"].bool()
        torch.testing.assert_close(batch.logits[real], expected["batch_logits"][real], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(batch.loss, expected["batch_loss"], atol=1e-5, rtol=1e-5)
        ids = expected["seq_0_input_ids"][None]
        generated = model.generate(input_ids=ids, **{**golden.gen_kwargs, "return_dict_in_generate": False,
                                                     "output_logits": False})
        assert generated[0, ids.shape[1]:].tolist() == expected["seq_0_gen_tokens"].tolist()
        static = model.generate(input_ids=ids, cache_implementation="static",
                                **{**golden.gen_kwargs, "return_dict_in_generate": False, "output_logits": False})
        assert static.tolist() == generated.tolist()


def test_modeling_file_copied_alone_gives_a_config_with_rope_ratio(golden, tmp_path):
    """ChatGLM2/3's own configuration classes have no rope_ratio, and tools tell the batch-first GLM-4 layout (every
    family's here) by it: optimum-intel's OpenVINO export took its sequence-first ChatGLM2 path without it. The
    model's config has it, 1 where the checkpoint has none (the reading of the rotary embedding)."""
    folder = original_folder_with_our_modeling(golden, tmp_path)
    stored = json.loads((folder / "config.json").read_text())
    model = load_causal_lm(folder, attn_implementation="eager")
    assert model.config.rope_ratio == stored.get("rope_ratio", 1)


def test_modeling_file_copied_alone_names_the_file_tensor_parallelism_needs(golden, tmp_path):
    folder = original_folder_with_our_modeling(golden, tmp_path)
    with pytest.raises(ImportError, match=r"parallel_chatglm\.py beside modeling_chatglm\.py"):
        load_causal_lm(folder, tp_plan="auto")


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_modeling_file_copied_alone_chats_as_with_every_file(tiny_model, family, tmp_path, request):
    """chat() and stream_chat() with modeling_chatglm.py alone beside the original configuration class answer what
    the model with all the code files answers."""
    tokenizer = request.getfixturevalue({"glm4": "glm4_tokenizer", "chatglm3": "chatglm3_tokenizer"}[family])
    model = tiny_model(family, padded_vocab_size=REAL_VOCABULARY[family], num_layers=2)
    folder = tmp_path / f"chat_one_file_{family}"
    model.save_pretrained(folder)
    for path in folder.glob("*.py"):
        path.unlink()
    (folder / "configuration_chatglm.py").write_text(original_configuration_source(family))
    shutil.copy(REPO / "modeling_chatglm.py", folder / "modeling_chatglm.py")
    alone = load_causal_lm(folder)
    greedy = dict(do_sample=False, max_length=None, max_new_tokens=6)
    assert alone.chat(tokenizer, "你好", history=[], **greedy) == model.chat(tokenizer, "你好", history=[], **greedy)
    assert list(alone.stream_chat(tokenizer, "你好", history=[], **greedy))[-1] == model.chat(
        tokenizer, "你好", history=[], **greedy)
    assert companions_imported(alone) == []


def test_companion_files_load_from_where_they_are_with_a_read_only_modules_cache(tiny_model, tmp_path):
    """A companion file is imported from the checkpoint folder it was found in, under the code's package name: the
    modules cache (read-only here, as in a container image) is not written."""
    folder = save_checkpoint(tiny_model("glm4"), tmp_path / "read_only_cache")
    model = load_causal_lm(folder)
    module = sys.modules[type(model).__module__]
    cache = Path(module.__file__).parent
    before = sorted(path.name for path in cache.iterdir())
    modes = {path: path.stat().st_mode for path in (cache, *cache.iterdir())}
    try:
        for path in modes:
            path.chmod(0o555 if path.is_dir() else 0o444)
        parallel = module.import_companion("parallel_chatglm", model.config)
        quantization = module.import_companion("quantization_chatglm", model.config)
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    assert sorted(path.name for path in cache.iterdir()) == before
    assert Path(parallel.__file__) == folder / "parallel_chatglm.py" and parallel.__name__ == module.__package__ + \
        ".parallel_chatglm"
    assert Path(quantization.__file__) == folder / "quantization_chatglm.py"
    assert companions_imported(model) == ["checks_chatglm", "parallel_chatglm", "quantization_chatglm"]


def test_a_model_without_a_prefix_never_imports_the_ptuning_file(tiny_model, tmp_path):
    model = load_causal_lm(save_checkpoint(tiny_model("chatglm3"), tmp_path / "no_prefix"))
    with torch.no_grad():
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    model.gradient_checkpointing_enable()
    assert "ptuning_chatglm" not in companions_imported(model)
    with pytest.raises(ValueError, match="no P-tuning v2 prefix"):
        model.save_prefix_encoder(tmp_path / "prefix")
    assert "ptuning_chatglm" not in companions_imported(model)


def test_companion_file_in_the_folder_is_found_and_saved_with_the_model(golden, golden_model, tmp_path):
    """transformers copies only the files it sees imported; the tensor-parallel file comes from the checkpoint folder
    the code was loaded from, and save_pretrained writes it beside the other code files."""
    module = sys.modules[type(golden_model).__module__]
    parallel = module.import_companion("parallel_chatglm", golden_model.config)
    assert (REPO / "parallel_chatglm.py").read_text() == Path(parallel.__file__).read_text()
    golden_model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "parallel_chatglm.py").read_bytes() == (REPO / "parallel_chatglm.py").read_bytes()


def test_configuration_class_lacking_a_field_names_the_file_to_copy(golden, tmp_path):
    older = original_configuration_source(golden.family).replace("        add_qkv_bias=False,\n", "").replace(
        "        self.add_qkv_bias = add_qkv_bias\n", "")
    folder = original_folder_with_our_modeling(golden, tmp_path, older)
    config = json.loads((folder / "config.json").read_text())
    del config["add_qkv_bias"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"add_qkv_bias.*configuration_chatglm\.py"):
        load_causal_lm(folder)


# ---------------------------------------------------------------------------------------------------------------------
# Config fields: types, other families, sizes, rotary fields
# ---------------------------------------------------------------------------------------------------------------------

STRING_VALUES = [("rope_ratio", "500"), ("num_layers", "28"), ("hidden_dropout", "0.0"), ("layernorm_epsilon", "1e-5"),
                 ("rmsnorm", "false"), ("multi_query_attention", "true"), ("add_qkv_bias", "False"),
                 ("use_cache", "true"), ("num_layers", 1e9), ("seq_length", 8192.0), ("post_layer_norm", 1),
                 ("classifier_dropout", "0.1"), ("quantization_bit", "4")]


@pytest.mark.parametrize("field,value", STRING_VALUES, ids=[f"{f}={v!r}" for f, v in STRING_VALUES])
def test_config_field_of_the_wrong_type_names_the_field(chatglm, tmp_path, field, value):
    """Numbers or booleans written as strings in config.json (or a float where an integer belongs) fail at load."""
    fields = json.loads(shared_path("configs", "glm-4-9b-chat", "config.json").read_text())
    fields[field] = value
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match=rf"ChatGLMConfig\.{field} must be .*got {re.escape(repr(value))}"):
        chatglm.ChatGLMConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("field", ["rope_ratio", "layernorm_epsilon"])
def test_config_json_infinity_is_refused(chatglm, tmp_path, field):
    """Python's json reads `Infinity` as a float; a model built from it gives NaN or no rotation at all."""
    fields = json.loads(shared_path("configs", "glm-4-9b-chat", "config.json").read_text())
    fields[field] = float("inf")
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert "Infinity" in (tmp_path / "config.json").read_text()
    with pytest.raises(ValueError, match=rf"ChatGLMConfig\.{field} must be a finite positive number, got inf"):
        chatglm.ChatGLMConfig.from_pretrained(tmp_path)


def test_config_aliases_that_agree_are_accepted(chatglm):
    config = chatglm.ChatGLMConfig(num_layers=2, num_hidden_layers=2, padded_vocab_size=64, vocab_size=64)
    assert (config.num_hidden_layers, config.vocab_size) == (2, 64)


def other_family_folder(tmp_path, config) -> "Path":
    """A checkpoint folder of another family whose config.json points its auto_map at ChatGLM's code."""
    fields = config.to_dict()
    fields["auto_map"] = {k: v for k, v in ORIGINAL_AUTO_MAP.items() if k in ("AutoConfig", "AutoModelForCausalLM")}
    folder = tmp_path / f"other_{config.model_type}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return copy_code_into(folder)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_config_of_another_family_is_refused_before_building(tmp_path, family):
    import transformers

    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](
        hidden_size=64, intermediate_size=96, num_hidden_layers=28, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256)
    folder = other_family_folder(tmp_path, config)
    with pytest.raises(ValueError, match=rf"model_type '{family}'.*not ChatGLM2/3 or GLM-4.*auto_map"):
        transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    with pytest.raises(ValueError, match="auto_map"):
        load_causal_lm(folder)


def test_config_json_without_sizes_is_refused(chatglm, tmp_path):
    """Without sizes the model would be the 6B default (25 GB in fp32) with none of the checkpoint's weights."""
    fields = json.loads(shared_path("configs", "chatglm3-6b", "config.json").read_text())
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "kv_channels", "num_attention_heads",
                 "padded_vocab_size"):
        del fields[name]
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="config.json gives no num_layers, padded_vocab_size, hidden_size"):
        chatglm.ChatGLMConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_sizes_that_cannot_fit_in_memory_are_refused_before_allocation(chatglm, device):
    """num_layers 10**9 would hang building modules (or exhaust memory): refused from the sizes alone."""
    config = chatglm.ChatGLMConfig(num_layers=10**9, hidden_size=64, ffn_hidden_size=96, kv_channels=16,
                                   num_attention_heads=4, padded_vocab_size=256)
    with pytest.raises(ValueError, match=r"num_layers \(1000000000\)"), torch.device(device):
        chatglm.modeling.ChatGLMForConditionalGeneration(config)


ROPE_FIELDS = [{"rope_scaling": {"type": "linear", "factor": 2.0}},
               {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}},
               {"rope_scaling": {"type": "bogus"}}, {"rope_theta": 5e6},
               {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
               {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "factor": 2.0}}]


@pytest.mark.parametrize("fields", ROPE_FIELDS, ids=[next(iter(f)) + str(i) for i, f in enumerate(ROPE_FIELDS)])
def test_rotary_fields_of_other_families_are_refused_naming_rope_ratio(chatglm, fields):
    """ChatGLM's rotary base is 10000 * rope_ratio; rope_scaling / rope_theta were silently ignored (and yarn
    crashed on 5.x with an AttributeError)."""
    with pytest.raises(ValueError, match=rf"{next(iter(fields))}.*rope_ratio"):
        chatglm.ChatGLMConfig(**fields)


def test_rope_theta_equal_to_the_rope_ratio_base_is_accepted(chatglm):
    config = chatglm.ChatGLMConfig(rope_ratio=500, rope_theta=5e6)
    assert config.rope_ratio == 500


DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}  # what GPTQModel writes on every config


def test_default_rope_parameters_are_accepted_and_the_rotary_stays_rope_ratios(chatglm, tiny_model, tmp_path,
                                                                               caplog):
    """transformers 5's standard rotary field, as GPTQModel sets it after loading (issue 43): the model builds and
    computes as without it, with rope_ratio's base; the theta that disagrees is reported once; the field is kept
    through save and load; another rope_type keeps its clear error (ROPE_FIELDS)."""
    reference = tiny_model("glm4")
    ids = torch.tensor([[5, 6, 7, 8]])
    with caplog.at_level(logging.WARNING):
        config = reference.config.__class__(**{**reference.config.to_dict(), "rope_parameters": dict(DEFAULT_ROPE)})
        # to_dict() leaves the attention implementation out, and 4.46 to 4.49 then build eager: compare like with like
        config._attn_implementation = reference.config._attn_implementation
        for _ in range(2):
            model = chatglm.modeling.ChatGLMForConditionalGeneration(config).eval()
    warned = [r for r in caplog.records if "rope_theta=10000.0" in r.getMessage()]
    assert len(warned) == 1 and "10000 * rope_ratio = 5000000" in warned[0].getMessage()
    model.load_state_dict(reference.state_dict())
    assert model.transformer.rotary_pos_emb.base == 5e6
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    reference.config.rope_parameters = dict(DEFAULT_ROPE, rope_theta=5e6)  # set after construction, as GPTQModel
    reference.config.validate_chatglm()
    config.save_pretrained(tmp_path)
    assert chatglm.ChatGLMConfig.from_pretrained(tmp_path).rope_parameters == DEFAULT_ROPE


def test_original_config_class_with_default_rope_parameters_builds_the_model(chatglm):
    config = original_config("glm4")
    config.rope_parameters = dict(DEFAULT_ROPE)
    model = chatglm.modeling.ChatGLMForConditionalGeneration(config)
    assert model.transformer.rotary_pos_emb.base == 10000.0 * config.rope_ratio


# ---------------------------------------------------------------------------------------------------------------------
# The original configuration class beside our modeling file (a user may copy modeling_chatglm.py alone)
# ---------------------------------------------------------------------------------------------------------------------


def original_config(family="glm4", **fields):
    """A tiny config made by the original configuration class (tests/original_code.py), which checks nothing."""
    namespace = {}
    exec(original_configuration_source(family), namespace)
    return namespace["ChatGLMConfig"](**{**tiny_config_dict(family), **fields})


@pytest.mark.parametrize("fields,named", [
    (dict(num_layers="2"), "num_layers"), (dict(hidden_size=None), "hidden_size"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_ratio"), (dict(rope_theta=1e6), "rope_ratio"),
    (dict(model_type="llama", num_key_value_heads=2, intermediate_size=96), "another model family"),
    (dict(num_layers=10**9), "GiB"),
])
def test_original_config_class_gets_the_model_building_checks(chatglm, fields, named):
    with pytest.raises(ValueError, match=named):
        chatglm.modeling.ChatGLMForConditionalGeneration(original_config(**fields))


def test_original_config_class_builds_the_model(chatglm):
    model = chatglm.modeling.ChatGLMForConditionalGeneration(original_config("chatglm3"))
    assert len(model.transformer.encoder.layers) == 3


# ---------------------------------------------------------------------------------------------------------------------
# Weight tying
# ---------------------------------------------------------------------------------------------------------------------


def is_tied(model) -> bool:
    return model.transformer.output_layer.weight is model.transformer.embedding.word_embeddings.weight


def test_tie_word_embeddings_ties_the_output_layer(tiny_model, chatglm, tmp_path):
    config = tiny_model("glm4").config
    config.tie_word_embeddings = True
    model = chatglm.modeling.ChatGLMForConditionalGeneration(config).eval()
    assert is_tied(model)
    folder = save_checkpoint(model, tmp_path / "tied")
    reloaded, info = load_causal_lm(folder, output_loading_info=True)
    assert is_tied(reloaded) and not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_tie_weights_after_setting_the_config(tiny_model):
    model = tiny_model("chatglm3")
    assert not is_tied(model)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert is_tied(model)


def test_released_checkpoints_load_untied(golden, golden_model):
    from safetensors.torch import load_file

    saved = load_file(str(golden.folder / "model.safetensors"))
    assert not is_tied(golden_model)
    assert torch.equal(golden_model.transformer.output_layer.weight, saved["transformer.output_layer.weight"])
    assert not torch.equal(saved["transformer.output_layer.weight"],
                           saved["transformer.embedding.word_embeddings.weight"])


# ---------------------------------------------------------------------------------------------------------------------
# A checkpoint of another family's weights
# ---------------------------------------------------------------------------------------------------------------------


def first_generation_state_dict(config):
    """ChatGLM-6B (first generation) key names, for a ChatGLM2/3 config's sizes."""
    state = {"transformer.word_embeddings.weight": torch.zeros(config.padded_vocab_size, config.hidden_size),
             "transformer.final_layernorm.weight": torch.ones(config.hidden_size),
             "lm_head.weight": torch.zeros(config.padded_vocab_size, config.hidden_size)}
    for i in range(config.num_layers):
        p = f"transformer.layers.{i}."
        state.update({p + "input_layernorm.weight": torch.ones(config.hidden_size),
                      p + "attention.query_key_value.weight": torch.zeros(3 * config.hidden_size, config.hidden_size),
                      p + "attention.dense.weight": torch.zeros(config.hidden_size, config.hidden_size),
                      p + "mlp.dense_h_to_4h.weight": torch.zeros(config.ffn_hidden_size, config.hidden_size),
                      p + "mlp.dense_4h_to_h.weight": torch.zeros(config.hidden_size, config.ffn_hidden_size)})
    return state


@pytest.mark.parametrize("weights", ["llama", "chatglm-6b"])
def test_checkpoint_with_another_familys_weights_is_refused_listing_keys(tiny_model, tmp_path, weights):
    import transformers
    from safetensors.torch import save_file

    model = tiny_model("chatglm3")
    folder = save_checkpoint(model, tmp_path / weights)
    if weights == "llama":
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256))
        state, found = llama.state_dict(), "model.embed_tokens.weight"
    else:
        state, found = first_generation_state_dict(model.config), "lm_head.weight"
    (folder / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"holds 0 of the \d+ weights.*transformer\.embedding.*{re.escape(found)}"):
        load_causal_lm(folder)


@pytest.mark.parametrize("device, named", [("cuda:97", "no such device"), (97, "no such device"),
                                           ("bogus", "is not a device"), (None, "is not a device")])
def test_device_map_naming_a_device_this_machine_lacks_is_refused_before_loading(golden, monkeypatch, device, named):
    """transformers < 4.46 found out only after reading the weights."""
    import safetensors.torch

    def no_read(*args, **kwargs):
        raise AssertionError("weights were read before the device map was checked")

    monkeypatch.setattr(safetensors.torch, "load_file", no_read)
    monkeypatch.setattr(safetensors, "safe_open", no_read)
    with pytest.raises(ValueError, match=rf"device_map\[''\] = {re.escape(repr(device))}.*{named}"):
        load_causal_lm(golden.folder, device_map={"": device})


def test_config_json_attn_implementation_that_does_not_exist_is_refused(golden, tmp_path):
    """transformers 4.44 dropped the value silently and ran sdpa; 4.49 accepted it too."""
    folder = tmp_path / "bogus_attention"
    shutil.copytree(golden.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["attn_implementation"] = "bogus"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"attn_implementation.*bogus"):
        load_causal_lm(folder)


def test_checkpoint_with_a_float64_weight_loads_in_one_dtype_or_names_the_argument(golden, tmp_path):
    """transformers 4.44 with dtype "auto" and no torch_dtype in config.json loaded that weight as float64 and the
    others as float32; the forward then failed on mixed dtypes."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "float64_weight"
    shutil.copytree(golden.folder, folder)
    weights = load_file(str(folder / "model.safetensors"))
    first = sorted(weights)[0]
    weights[first] = weights[first].double()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps(config))
    try:
        model = load_causal_lm(folder, dtype="auto")
    except ValueError as error:
        assert "float64" in str(error) and "torch_dtype" in str(error) and first in str(error), str(error)
        return
    assert len({p.dtype for p in model.parameters()}) == 1
    with torch.no_grad():
        model(input_ids=golden.expected["seq_1_input_ids"][None])


# ---------------------------------------------------------------------------------------------------------------------
# Weights stored as integers or bools
# ---------------------------------------------------------------------------------------------------------------------
QKV = "transformer.encoder.layers.0.self_attention.query_key_value.weight"
# Every way transformers reads the weights: 4.x copies them into the built model unless low_cpu_mem_usage or a
# device_map loads them into an empty one; 5.x has one path.
LOAD_PATHS = [{}, {"device_map": "cpu"}] + ([{"low_cpu_mem_usage": True}] if TRANSFORMERS < Version("5.0") else [])


def write_weights(model, folder: Path, change: dict, layout: str = "safetensors") -> Path:
    """A checkpoint folder of `model` whose weights hold `change` (name -> tensor): one safetensors file, two
    safetensors shards with their index, or a torch file. Returns the file holding the first changed name."""
    from safetensors.torch import save_file

    folder = save_checkpoint(model, folder)
    for path in folder.glob("model*.safetensors*"):
        path.unlink()
    state = {name: tensor.contiguous() for name, tensor in {**model.state_dict(), **change}.items()}
    if layout == "torch file":
        torch.save(state, folder / "pytorch_model.bin")
        return folder / "pytorch_model.bin"
    if layout == "safetensors":
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder / "model.safetensors"
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in halves.items():
        save_file({name: state[name] for name in shard_names}, str(folder / shard), metadata={"format": "pt"})
    weight_map = {name: shard for shard, shard_names in halves.items() for name in shard_names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder / weight_map[next(iter(change))]


@pytest.mark.parametrize("load", LOAD_PATHS, ids=lambda load: ",".join(load) or "default")
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_a_float_weight_stored_as_integers_or_bools_is_refused_naming_it(tiny_model, tmp_path, dtype, load):
    """It loaded, cast to float, and the logits were off by about 10 with no message (4.44 without low_cpu_mem_usage
    failed on the copy, naming neither the dtype nor the file)."""
    model = tiny_model("glm4")
    file = write_weights(model, tmp_path / "checkpoint", {QKV: model.state_dict()[QKV].to(dtype)})
    name = str(dtype).replace("torch.", "")
    with pytest.raises(ValueError, match=rf"^{re.escape(QKV)} is stored as {name} in {re.escape(str(file))};.*float32"):
        load_causal_lm(file.parent, **load)


@pytest.mark.parametrize("layout", ["shards", "torch file"])
def test_the_refusal_names_the_shard_or_torch_file_holding_the_tensor(tiny_model, tmp_path, layout):
    model = tiny_model("chatglm3")
    file = write_weights(model, tmp_path / "checkpoint", {QKV: model.state_dict()[QKV].to(torch.int64)}, layout)
    with pytest.raises(ValueError, match=rf"^{re.escape(QKV)} is stored as int64 in {re.escape(str(file))};"):
        load_causal_lm(file.parent)


def test_the_refusal_names_the_file_in_the_hugging_face_cache(tiny_model, tmp_path):
    from tool_faults import hub_cache

    model = tiny_model("glm4")
    folder = write_weights(model, tmp_path / "checkpoint", {QKV: model.state_dict()[QKV].to(torch.int32)}).parent
    layout = hub_cache(tmp_path / "hub", {path.name: path.read_bytes() for path in folder.iterdir()},
                       repo_id="someone/glm4-tiny-int")
    with pytest.raises(ValueError, match=rf"^{re.escape(QKV)} is stored as int32 in "
                                         rf"{re.escape(str(layout['a'] / 'model.safetensors'))};"):
        load_causal_lm("someone/glm4-tiny-int", cache_dir=str(tmp_path / "hub"))


def test_an_integer_tensor_that_is_no_weight_of_the_model_loads(tiny_model, tmp_path):
    """Only the model's float weights are checked: another integer entry (a training step counter) is transformers'
    unexpected key, as before."""
    model = tiny_model("glm4")
    folder = write_weights(model, tmp_path / "checkpoint", {"transformer.step": torch.tensor([7])}).parent
    loaded = load_causal_lm(folder)
    assert all(torch.equal(tensor, loaded.state_dict()[name]) for name, tensor in model.state_dict().items())


def test_after_a_download_the_loaded_model_is_checked(tiny_model, chatglm, tmp_path):
    """A hub checkpoint not yet on this machine is checked once from_pretrained has downloaded it, against the
    loaded model."""
    model = tiny_model("glm4")
    file = write_weights(model, tmp_path / "checkpoint", {QKV: model.state_dict()[QKV].to(torch.int16)})
    with pytest.raises(ValueError, match=rf"^{re.escape(QKV)} is stored as int16 in {re.escape(str(file))};"):
        chatglm.checks.check_stored_dtypes(file.parent, {}, model)
    assert chatglm.checks.check_stored_dtypes(tmp_path / "elsewhere", {}, model) is False


# ---------------------------------------------------------------------------------------------------------------------
# Weights holding NaN or inf
# ---------------------------------------------------------------------------------------------------------------------


def with_values(tensor: torch.Tensor, values: list) -> torch.Tensor:
    """`tensor` with its first len(values) entries replaced."""
    changed = tensor.clone()
    changed.view(-1)[:len(values)] = torch.tensor(values, dtype=tensor.dtype)
    return changed


@pytest.mark.parametrize("load", LOAD_PATHS, ids=lambda load: ",".join(load) or "default")
@pytest.mark.parametrize("values, dtype", [([float("nan")], torch.float32), ([float("inf"), float("-inf")],
                                                                             torch.float32),
                                           ([float("nan")] * 3, torch.bfloat16), ([float("inf")], torch.float16)])
def test_a_weight_holding_nan_or_inf_is_refused_naming_it_and_the_count(tiny_model, tmp_path, values, dtype, load):
    """It loaded without a word, and every logit came out NaN."""
    model = tiny_model("glm4").to(dtype)
    file = write_weights(model, tmp_path / "checkpoint", {QKV: with_values(model.state_dict()[QKV], values)})
    count = f"{len(values)} NaN or inf value{'s' if len(values) > 1 else ''}"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(file.parent))}: the weight {re.escape(QKV)} holds "
                                         rf"{count} .*download or convert it again.*check_finite_weights=False"):
        load_causal_lm(file.parent, dtype=dtype, **load)


def test_the_check_can_be_switched_off(tiny_model, tmp_path):
    model = tiny_model("chatglm3")
    folder = write_weights(model, tmp_path / "checkpoint", {QKV: with_values(model.state_dict()[QKV], [1e39])}).parent
    loaded = load_causal_lm(folder, check_finite_weights=False)
    assert torch.isinf(loaded.state_dict()[QKV]).any()
    with torch.no_grad():
        assert torch.isnan(loaded(input_ids=torch.tensor([[5, 6, 7]])).logits).all()  # what the check prevents


def test_the_tensor_parallel_path_checks_the_weights_and_takes_the_switch(tiny_model, tmp_path):
    """Each rank reads the whole checkpoint before keeping its shards: the check runs there, alike on every rank
    (tp_size=1 takes that path in one process)."""
    model = tiny_model("glm4")
    folder = write_weights(model, tmp_path / "checkpoint", {QKV: with_values(model.state_dict()[QKV], [-1e39])}).parent
    with pytest.raises(ValueError, match=rf"the weight {re.escape(QKV)} holds 1 NaN or inf value "):
        load_causal_lm(folder, tp_size=1)
    assert torch.isinf(load_causal_lm(folder, tp_size=1, check_finite_weights=False).state_dict()[QKV]).any()


def test_finite_weights_whose_sum_overflows_load(tiny_model, tmp_path):
    """float16 weights of large magnitude sum past float16's range (65504): the check counts the values themselves
    before refusing anything."""
    model = tiny_model("glm4").to(torch.float16)
    norm = "transformer.encoder.final_layernorm.weight"
    folder = write_weights(model, tmp_path / "checkpoint", {norm: torch.full_like(model.state_dict()[norm], 6e4)}).parent
    loaded = load_causal_lm(folder, dtype=torch.float16)
    assert torch.equal(loaded.state_dict()[norm], torch.full_like(model.state_dict()[norm], 6e4))


def test_weights_this_process_does_not_hold_are_not_read(tiny_model, chatglm, tmp_path):
    """Weights offloaded by a device map (meta tensors) and integer storage (int8/int4 codes) are skipped; the
    floating weights held are checked."""
    with torch.device("meta"):
        offloaded = chatglm.modeling.ChatGLMForConditionalGeneration(tiny_model("glm4").config)
    chatglm.checks.check_finite_weights(offloaded, "offloaded")
    model = tiny_model("glm4")
    model.transformer.encoder.layers[0].mlp.dense_4h_to_h.weight_codes = torch.nn.Parameter(
        torch.full((4, 4), 7, dtype=torch.int8), requires_grad=False)
    chatglm.checks.check_finite_weights(model, "codes")
    with torch.no_grad():
        model.transformer.output_layer.weight[3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"^held: the weight transformer\.output_layer\.weight holds 1 NaN"):
        chatglm.checks.check_finite_weights(model, "held")


# ---------------------------------------------------------------------------------------------------------------------
# Damaged weight files: the stored-dtype check reads every header before transformers does
# ---------------------------------------------------------------------------------------------------------------------

def header_length(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


# What an interrupted download, a full disk or a bad copy leaves, as bytes of a good file -> bytes of the damaged one.
DAMAGES = {
    "empty": lambda data: b"",
    "cut to 4 bytes": lambda data: data[:4],
    "random bytes": lambda data: torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(0),
                                               dtype=torch.uint8).numpy().tobytes(),
    "corrupt header": lambda data: data[:8] + b"\xff{not json" + b" " * (header_length(data) - 10)
                                   + data[8 + header_length(data):],
    "header length of 40 GiB": lambda data: (40 << 30).to_bytes(8, "little") + data[8:],
    "cut in the tensor data": lambda data: data[:len(data) - 100],
}


@pytest.mark.parametrize("layout", ["safetensors", "shards"])
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_weight_file_is_named_with_what_to_do(tiny_model, tmp_path, damage, layout):
    """Each damage gave a bare JSONDecodeError, OverflowError or MemoryError from the stored-dtype check."""
    model = tiny_model("glm4")
    file = write_weights(model, tmp_path / "checkpoint", {QKV: model.state_dict()[QKV]}, layout)
    file.write_bytes(DAMAGES[damage](file.read_bytes()))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(file))} is damaged or incomplete: .*Download it again"):
        load_causal_lm(file.parent)


def test_a_damaged_weights_index_is_named_with_what_to_do(tiny_model, tmp_path):
    model = tiny_model("glm4")
    folder = write_weights(model, tmp_path / "checkpoint", {QKV: model.state_dict()[QKV]}, "shards").parent
    index = folder / "model.safetensors.index.json"
    index.write_bytes(index.read_bytes()[:40])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(index))} is damaged or incomplete: .*Download it again"):
        load_causal_lm(folder)
