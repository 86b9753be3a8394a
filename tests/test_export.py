"""tools/export_to_native_glm.py: an original-format checkpoint as transformers' own Glm, loaded with no remote code.

The truths: the golden outputs of the original code (logits and greedy tokens), our slow tokenizers (ids of text and
of chat templates on the shared vectors), the source folder's bytes before the export.
"""
import hashlib
import json
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from conftest import (GOLDEN_CASES, REPO, TINY_SIZES, TRANSFORMERS, Version, random_model, shared_path,
                      tiny_config_dict)
from tokenizer_fixtures import load_jsonl, make_tokenizer_folder

import export_to_native_glm as exporter

pytestmark = pytest.mark.skipif(TRANSFORMERS < Version("4.46"), reason="GlmForCausalLM arrived in transformers 4.46")
# The golden cases the exporter takes whole: ChatGLM2's tokenizer has no fast tokenizer yet, so its export is refused
# (test_a_chatglm2_checkpoint_is_refused_naming_it).
# The versions between the matrix's ends export GLM-4 only: ChatGLM3's export is the same model conversion, and its
# fast tokenizer has its own tests on every release (tests/test_fast_tokenizer.py).
EXPORTED_CASES = tuple(case if case.startswith("glm4") else pytest.param(case, marks=pytest.mark.matrix_ends)
                       for case in GOLDEN_CASES if not case.startswith("chatglm2"))
exported_cases = pytest.mark.parametrize("golden", EXPORTED_CASES, indirect=True)
SLOW_TOKENIZER = {"glm4": "glm4_tokenizer", "chatglm3": "chatglm3_tokenizer"}
RECORDS = {"glm4": "glm4.jsonl", "chatglm3": "chatglm3.jsonl"}


def digests(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def exported(golden, tmp_path_factory):
    """(source folder, its digests before the export, the export) of a golden checkpoint, in shards of 100 kB."""
    root = tmp_path_factory.mktemp(f"export-{golden.name}")
    # The checkpoint as a user has it: the golden checkpoints hold weights only; the family's tokenizer is added.
    source = make_tokenizer_folder(shutil.copytree(golden.folder, root / "source"), golden.family)
    before = digests(source)
    assert exporter.main([str(source), str(root / "native"), "--max-shard-size", "100KB"]) == 0
    return source, before, root / "native"


def load_native(folder, **kwargs):
    """As a user without remote code loads it."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kwargs, **{
        "dtype" if TRANSFORMERS >= Version("4.56") else "torch_dtype": torch.float32}).eval()


@exported_cases
def test_the_export_loads_without_remote_code_and_gives_the_golden_logits(golden, exported, golden_model):
    _, _, native_folder = exported
    native = load_native(native_folder, attn_implementation="eager")  # golden_model's arithmetic: eager attention
    assert type(native).__name__ == "GlmForCausalLM"
    written = json.loads((native_folder / "config.json").read_text())
    source_ratio = json.loads((golden.folder / "config.json").read_text()).get("rope_ratio", 1)
    assert written["rope_ratio"] == source_ratio  # what llama.cpp's converter reads for the rotary base
    assert len(list(native_folder.glob("model-*-of-*.safetensors"))) > 1  # sharded as asked
    # The goldens were computed in another process, maybe with another thread count, which moves logits by ~1e-5:
    # FORMAT.md's 1e-4. Against our model in this process, with the same threads and attention arithmetic (eager),
    # they differ by rounding only (3e-6 on a 2-core CPU): 1e-5. A real difference (rotary, norms) is above 1e-2.
    with torch.no_grad():
        for i in range(3):
            ids = golden.expected[f"seq_{i}_input_ids"][None]
            logits = native(input_ids=ids).logits[0]
            torch.testing.assert_close(logits, golden.expected[f"seq_{i}_logits"], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(logits, golden_model(input_ids=ids).logits[0], rtol=1e-5, atol=1e-5)


@exported_cases
def test_the_export_generates_the_golden_greedy_tokens(golden, exported):
    native = load_native(exported[2])
    kwargs = {k: v for k, v in golden.gen_kwargs.items() if k not in ("return_dict_in_generate", "output_logits")}
    for i in range(3):
        ids = golden.expected[f"seq_{i}_input_ids"][None]
        out = native.generate(ids, **kwargs)[0, ids.shape[1]:]
        assert out.tolist() == golden.expected[f"seq_{i}_gen_tokens"].tolist()


@exported_cases
def test_the_source_folder_is_untouched(exported):
    source, before, _ = exported
    assert digests(source) == before
    assert not [p.name for p in source.parent.iterdir() if p.name.startswith(".")]  # no staging folder left


@exported_cases
def test_the_exported_tokenizer_gives_our_ids_on_real_text(golden, exported, request):
    native = transformers.AutoTokenizer.from_pretrained(str(exported[2]))
    assert isinstance(native, transformers.PreTrainedTokenizerFast)
    slow = request.getfixturevalue(SLOW_TOKENIZER[golden.family])
    texts = [r["text"] for r in load_jsonl("tokvec", RECORDS[golden.family]) if r["kind"] == "encode"]
    if golden.family == "chatglm3":  # the one documented difference of the fast tokenizer (docs/tokenizers.md)
        texts = [t for t in texts if "<unk>" not in t and "</s>" not in t]
    assert len(texts) > 200
    for text in texts:
        for special in (True, False):
            assert native.encode(text, add_special_tokens=special) == slow.encode(text, add_special_tokens=special), \
                text[:80]


@exported_cases
def test_the_exported_chat_template_gives_our_chat_ids(golden, exported, request):
    """Every shared conversation: the export's ids are those of our render-then-encode path (vLLM's, SGLang's), and
    those of our tokenize=True path unless special-token text inside a message is parsed by rendering (a template
    rendered to text cannot keep it as text)."""
    native = transformers.AutoTokenizer.from_pretrained(str(exported[2]))
    slow = request.getfixturevalue(SLOW_TOKENIZER[golden.family])
    records = [r for r in load_jsonl("tokvec", RECORDS[golden.family]) if r["kind"] == "chat"]
    assert len(records) >= 20
    for record in records:
        settings = dict(add_generation_prompt=record["add_generation_prompt"])
        theirs = native.apply_chat_template(record["messages"], tokenize=True, **settings)
        theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
        rendered = slow.apply_chat_template(record["messages"], tokenize=False, **settings)
        assert theirs == slow.encode(rendered, add_special_tokens=False), record["id"]
        if "CHAT-SPECIAL-TOKEN-INJECTION" not in record.get("original_bug_codes", []):
            assert theirs == list(slow.apply_chat_template(record["messages"], tokenize=True, **settings)), \
                record["id"]


def run_exporter(*args):
    result = subprocess.run([sys.executable, str(REPO / "tools" / "export_to_native_glm.py"), *map(str, args)],
                            capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


# The refusals and the failing export are the exporter's own logic (before or beside transformers' code): the
# matrix's ends run them; the versions between run the exports themselves.
@pytest.mark.matrix_ends
@exported_cases
@pytest.mark.parametrize("field,value", [("pre_seq_len", 8), ("vision_config", {"hidden_size": 8}),
                                         ("quantization_bit", 4), ("add_bias_linear", True), ("rmsnorm", False),
                                         ("model_type", "llama")])
def test_what_glm_cannot_hold_is_refused_naming_it(exported, tmp_path, field, value):
    source = shutil.copytree(exported[0], tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    config[field] = value
    (source / "config.json").write_text(json.dumps(config))
    code, output = run_exporter(source, tmp_path / "native")
    assert code == 2 and field in output, output
    assert not (tmp_path / "native").exists()


@pytest.mark.matrix_ends
@exported_cases
def test_an_existing_output_or_one_inside_the_source_is_refused(exported, tmp_path):
    source = exported[0]
    (tmp_path / "taken").mkdir()
    for output, says in ((tmp_path / "taken", "exists"), (source / "native", "inside the checkpoint")):
        code, message = run_exporter(source, output)
        assert code == 2 and says in message, message
    assert not (source / "native").exists()


@pytest.mark.matrix_ends
@exported_cases
def test_a_failing_export_leaves_no_output(exported, tmp_path):
    """A weight missing half-way through: nothing appears, no staging folder is left, exit code 2 naming it."""
    from safetensors.torch import load_file, save_file

    source = shutil.copytree(exported[0], tmp_path / "source")
    weights = load_file(str(source / "model.safetensors"))
    del weights["transformer.encoder.layers.1.mlp.dense_4h_to_h.weight"]
    save_file(weights, str(source / "model.safetensors"), metadata={"format": "pt"})
    code, output = run_exporter(source, tmp_path / "native", "--max-shard-size", "10KB")
    assert code == 2 and "layers.1.mlp.dense_4h_to_h" in output, output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


@pytest.mark.matrix_ends
def test_a_chatglm2_checkpoint_is_refused_naming_it(tmp_path):
    """ChatGLM2's tokens are not ChatGLM3's (no role tokens, special text stays text): exporting ChatGLM3's fast
    tokenizer for it would be wrong, so the export stops (exit 2, nothing written) and says why."""
    from tokenizer_fixtures import make_chatglm2_folder

    source = make_chatglm2_folder(tmp_path / "source")
    shutil.copy(shared_path("golden", "chatglm2-tiny", "checkpoint", "model.safetensors"), source)
    code, output = run_exporter(source, tmp_path / "native")
    assert code == 2 and "ChatGLM2" in output and "THUDM/chatglm2-6b" in output, output
    assert not (tmp_path / "native").exists()


@pytest.mark.parametrize("golden", ["chatglm2-32k-tiny"], indirect=True)
def test_chatglm2_32k_exports_with_linear_rope_scaling_and_gives_the_golden_logits(golden, tmp_path):
    """chatglm2-6b-32k divides the positions by rope_ratio: the export says so in transformers' own terms (linear
    rope scaling, factor rope_ratio, base 10000) and writes no rope_ratio (llama.cpp's converter reads it as a
    base); GlmForCausalLM reads the scaling from 4.48 on and then gives the original's logits. ChatGLM2 has no fast
    tokenizer here: the model alone (--without-tokenizer)."""
    from chatglm_tools.native_glm import glm_reads_rope_scaling

    code, output = run_exporter(golden.folder, tmp_path / "native", "--without-tokenizer")
    assert code == 0 and "positions / 16" in output and "llama.cpp: not this checkpoint" in output, output
    written = json.loads((tmp_path / "native" / "config.json").read_text())
    rope = written.get("rope_parameters") or dict(written.get("rope_scaling") or {}, rope_theta=written["rope_theta"])
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("linear", 16.0, 10000.0)
    assert "rope_ratio" not in written and not (tmp_path / "native" / "tokenizer.json").exists()
    # The 32k context and the epsilon, under transformers' names and the original's (llama.cpp's converter's)
    assert (written["max_position_embeddings"], written["seq_length"]) == (32768, 32768)
    assert written["rms_norm_eps"] == written["layernorm_epsilon"] == 1e-5
    if not glm_reads_rope_scaling():  # 4.46, 4.47: Glm ignores rope_scaling (docs: the export needs 4.48)
        return
    native = load_native(tmp_path / "native")
    with torch.no_grad():
        for i in range(3):
            ids = golden.expected[f"seq_{i}_input_ids"][None]
            torch.testing.assert_close(native(input_ids=ids).logits[0], golden.expected[f"seq_{i}_logits"],
                                       rtol=1e-4, atol=1e-4)


# The released configs whose values an export must declare to every converter (testdata/configs).
# The versions between the matrix's ends export one GLM-4 config (the 1M one: its rope_ratio) and ChatGLM3's.
RELEASED_CONFIGS = (pytest.param("glm-4-9b-chat", marks=pytest.mark.matrix_ends), "glm-4-9b-chat-1m",
                    pytest.param("glm-4-9b", marks=pytest.mark.matrix_ends), "chatglm3-6b")


def llama_cpp_declares(hparams: dict) -> dict:
    """What llama.cpp's convert_hf_to_gguf.py writes into a GGUF from the config it converts with its ChatGLM class
    (architectures ChatGLMModel and GlmForCausalLM alike; llama-cpp-python 0.3.36's vendored copy): each value from
    the original's field name first, with the converter's fallback when the field is absent."""
    hidden, heads = hparams["hidden_size"], hparams["num_attention_heads"]
    return {"context length": hparams.get("seq_length", hidden), "epsilon": hparams.get("layernorm_epsilon", 1e-5),
            "rope base": 10000 * hparams.get("rope_ratio", 1), "heads": heads,
            "key/value groups": hparams.get("multi_query_group_num", hparams.get("num_key_value_heads", heads)),
            "head size": hidden // heads}  # no key length for this architecture: llama.cpp divides


def glm_declares(hparams: dict) -> dict:
    """What transformers' GlmForCausalLM and vLLM's Glm read from the same config."""
    rope = hparams.get("rope_parameters") or hparams
    return {"context length": hparams["max_position_embeddings"], "epsilon": hparams["rms_norm_eps"],
            "rope base": rope["rope_theta"], "heads": hparams["num_attention_heads"],
            "key/value groups": hparams["num_key_value_heads"], "head size": hparams["head_dim"]}


@pytest.mark.parametrize("name", RELEASED_CONFIGS)
def test_every_converter_reads_the_originals_epsilon_and_context_length(name, chatglm, tmp_path):
    """A released config (sizes shrunk, seq_length, epsilon and rope_ratio as released) exported: the config that
    llama.cpp's converter and Glm (transformers, vLLM) read declares the original's epsilon, context length, rope
    base, heads and key/value groups. The converter loads config.json through AutoConfig without remote code, as
    read here. (Before the fix the GGUF of a GLM-4 export declared epsilon 1e-5 and context length = hidden size.)"""
    original = json.loads(shared_path("configs", name, "config.json").read_text())
    shrunk = dict(original, **{k: v for k, v in TINY_SIZES.items() if k != "seq_length"}, torch_dtype="float32")
    if "num_hidden_layers" in shrunk:  # GLM-4's configs name the layer count twice
        shrunk["num_hidden_layers"] = shrunk["num_layers"]
    source = tmp_path / "source"
    random_model(chatglm, shrunk, 0, "eager").save_pretrained(source)
    (source / "config.json").write_text(json.dumps(shrunk))  # the field set as released, not as save_pretrained has it
    code, output = run_exporter(source, tmp_path / "native", "--without-tokenizer")
    assert code == 0, output
    expected = {"context length": original["seq_length"], "epsilon": original["layernorm_epsilon"],
                "rope base": 10000 * original.get("rope_ratio", 1), "heads": shrunk["num_attention_heads"],
                "key/value groups": shrunk["multi_query_group_num"], "head size": shrunk["kv_channels"]}
    hparams = transformers.AutoConfig.from_pretrained(str(tmp_path / "native")).to_dict()
    assert llama_cpp_declares(hparams) == expected
    assert glm_declares(hparams) == expected
    assert "convert_hf_to_gguf.py" in output  # the route the exporter offers is this one


def test_the_export_names_no_gguf_route_when_llama_cpp_would_take_another_head_size(chatglm, tmp_path):
    """Heads of kv_channels 32 with hidden 64 / 4 heads: llama.cpp's converter writes no key length for this
    architecture, so llama.cpp would take heads of 16; the exporter offers no GGUF route and says why."""
    random_model(chatglm, tiny_config_dict("glm4", kv_channels=32), 0, "eager").save_pretrained(tmp_path / "source")
    code, output = run_exporter(tmp_path / "source", tmp_path / "native", "--without-tokenizer")
    assert code == 0 and "llama.cpp: not this checkpoint" in output and "kv_channels = 32" in output, output


MEMORY_PROBE = """
import sys, threading, time
sys.path.insert(0, sys.argv[3])
import export_to_native_glm as exporter

def anonymous_rss():  # anonymous memory only: the memory-mapped source pages are the file's, not a copy
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

peak, done = [anonymous_rss()], []
baseline = peak[0]
def sample():
    while not done:
        peak.append(max(peak[-1], anonymous_rss()))
        time.sleep(0.002)
thread = threading.Thread(target=sample)
thread.start()
code = exporter.main([sys.argv[1], sys.argv[2], "--max-shard-size", "48MB"])
done.append(1)
thread.join()
print(code, peak[-1] - baseline)
"""


@pytest.mark.matrix_ends
def test_export_memory_is_bounded_by_a_shard_not_the_model(tmp_path):
    """A 430 MB checkpoint exported in 48 MB shards: the export's anonymous memory stays near one shard (plus the
    largest tensor being copied), far below the model."""
    from safetensors.torch import save_file

    config = json.loads(shared_path("configs", "chatglm3-6b", "config.json").read_text())
    config.update(hidden_size=1024, num_attention_heads=8, kv_channels=128, multi_query_group_num=2,
                  ffn_hidden_size=2048, num_layers=10, num_hidden_layers=10, padded_vocab_size=8192)
    source = make_tokenizer_folder(tmp_path / "big", "chatglm3")
    (source / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    qkv = (8 + 2 * 2) * 128
    shards = [{"transformer.embedding.word_embeddings.weight": torch.randn(8192, 1024, generator=generator),
               "transformer.encoder.final_layernorm.weight": torch.ones(1024),
               "transformer.output_layer.weight": torch.randn(8192, 1024, generator=generator)}]
    for i in range(10):
        p = f"transformer.encoder.layers.{i}."
        shards.append({p + "input_layernorm.weight": torch.ones(1024),
                       p + "post_attention_layernorm.weight": torch.ones(1024),
                       p + "self_attention.query_key_value.weight": torch.randn(qkv, 1024, generator=generator),
                       p + "self_attention.query_key_value.bias": torch.randn(qkv, generator=generator),
                       p + "self_attention.dense.weight": torch.randn(1024, 1024, generator=generator),
                       p + "mlp.dense_h_to_4h.weight": torch.randn(4096, 1024, generator=generator),
                       p + "mlp.dense_4h_to_h.weight": torch.randn(1024, 2048, generator=generator)})
    weight_map, model_bytes = {}, 0
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(source / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        model_bytes += sum(t.numel() * 4 for t in shard.values())
    (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    del shards
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(source), str(tmp_path / "native"),
                             str(REPO / "tools")], capture_output=True, text=True, timeout=600)
    code, peak = map(int, result.stdout.split()[-2:])
    assert code == 0, result.stdout + result.stderr
    assert model_bytes > 400e6 and peak < 3 * 48e6, (model_bytes, peak)
    index = json.loads((tmp_path / "native" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == model_bytes
