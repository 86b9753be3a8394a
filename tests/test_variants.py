"""What differs per THUDM checkpoint: the variant table both code files read, chatglm2-6b-32k's rotary reading
(positions divided by rope_ratio) wherever a rotary table is built, and the evidence that names a checkpoint.

The truths: the chatglm2-32k-tiny golden outputs of chatglm2-6b-32k's own code, and the reference forward of
tests/reference_glm.py (positions divided as FORMAT.md describes).
"""
import importlib
import json
import shutil

import pytest
import torch

from conftest import load_causal_lm, make_golden_case, randomize_
from reference_glm import reference_logits
from test_parity import assert_logits_close, relative_max_error

# The checkpoints the README's checkpoint table lists: each has its row.
THUDM_CHECKPOINTS = ("chatglm2-6b", "chatglm2-6b-32k", "chatglm2-6b-int4", "codegeex2-6b", "chatglm3-6b",
                     "chatglm3-6b-base", "chatglm3-6b-32k", "chatglm3-6b-128k", "glm-4-9b", "glm-4-9b-chat",
                     "glm-4-9b-chat-1m", "codegeex4-all-9b", "glm-4v-9b")
COLUMN_VALUES = {"rotary": {"base", "positions"}, "tokenizer": {"chatglm2", "chatglm3", "glm4"},
                 "chat": {"rounds", "roles", "template"}}


@pytest.fixture(scope="module")
def tokenization(chatglm):
    return importlib.import_module("chatglm_under_test.tokenization_chatglm")


@pytest.fixture(scope="module")
def golden_32k(tmp_path_factory):
    return make_golden_case("chatglm2-32k-tiny", tmp_path_factory.mktemp("chatglm2-32k-tiny"))


def test_model_and_tokenizer_read_one_table(chatglm, tokenization):
    """Each file keeps its own copy (each must work copied alone): the two copies are the same table."""
    assert chatglm.modeling.CHECKPOINT_VARIANTS == tokenization.CHECKPOINT_VARIANTS
    table = tokenization.CHECKPOINT_VARIANTS
    assert set(THUDM_CHECKPOINTS) <= set(table)
    for row, columns in table.items():
        assert set(columns) == {*COLUMN_VALUES, "fields"}, row  # each column is read by one of the two files
        assert {column: columns[column] in allowed for column, allowed in COLUMN_VALUES.items()} == dict.fromkeys(
            COLUMN_VALUES, True), row
        # ChatGLM2's tokenizer has ChatGLM2's chat rounds, ChatGLM3's its roles, GLM-4's a template
        assert columns["chat"] == {"chatglm2": "rounds", "chatglm3": "roles", "glm4": "template"}[columns["tokenizer"]]


@pytest.mark.parametrize("name, row", [
    ("THUDM/chatglm2-6b-32k", "chatglm2-6b-32k"), ("THUDM/chatglm2-6b", "chatglm2-6b"),
    ("/data/models--THUDM--chatglm2-6b-int4/snapshots/0123abcd", "chatglm2-6b-int4"),
    ("/data/chatglm3-6b-32k", "chatglm3-6b-32k"), ("THUDM/chatglm-6b", None), ("THUDM/glm-4-9b-chat-1m", "glm-4-9b-chat-1m"),
    ("me/chatglm2-6b-32k-sft", "chatglm2-6b-32k"), (None, None),
])
def test_a_name_gives_its_row(chatglm, tokenization, name, row):
    assert chatglm.modeling.variant_named(name) == tokenization.variant_named(name) == row


def test_weight_storage_is_read_from_quantization_bit(chatglm):
    config = chatglm.ChatGLMConfig(num_layers=1)
    assert chatglm.modeling.weight_storage(config) == "float"
    config.quantization_bit = 4
    assert chatglm.modeling.weight_storage(config) == "int4"


# --- chatglm2-6b-32k: positions divided by rope_ratio ----------------------------------------------------------------

def test_32k_rotary_divides_positions_and_save_pretrained_keeps_the_variant(golden_32k, tmp_path):
    model = golden_32k.load()
    rotary = model.transformer.rotary_pos_emb
    assert (rotary.base, rotary.position_divisor) == (10000.0, 16.0)
    assert getattr(model.config, "chatglm_variant", None) is None  # reading the names writes nothing
    model.save_pretrained(tmp_path / "saved")  # the names that told the reading are not saved; the variant is
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["chatglm_variant"] == "chatglm2-6b-32k"
    assert load_causal_lm(tmp_path / "saved").transformer.rotary_pos_emb.position_divisor == 16.0


def test_32k_static_cache_generation_matches_golden(golden_32k):
    model, e = golden_32k.load(), golden_32k.expected
    with torch.no_grad():
        for i in range(3):
            seq = e[f"seq_{i}_input_ids"][None]
            out = model.generate(input_ids=seq, cache_implementation="static", **golden_32k.gen_kwargs)
            assert out.sequences[0, seq.shape[1]:].tolist() == e[f"seq_{i}_gen_tokens"].tolist()
            assert_logits_close(torch.stack(out.logits, 1)[0], e[f"seq_{i}_gen_logits"])


def folder_without_names(golden_32k, folder, **config_changes):
    """The golden checkpoint in a folder that names no checkpoint, its config.json edited."""
    shutil.copytree(golden_32k.folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("_name_or_path")
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def logits_of(model, golden):
    ids = golden.expected["seq_1_input_ids"][None]
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits[0]


def test_32k_without_names_is_known_by_its_rope_ratio_with_a_warning(golden_32k, tmp_path, caplog):
    """A copy whose names are lost (a fine-tune saved elsewhere): rope_ratio 16 is chatglm2-6b-32k's alone; the
    choice is named in a warning, and the golden numbers come out."""
    folder = folder_without_names(golden_32k, tmp_path / "finetuned")
    with caplog.at_level("WARNING"):
        model = load_causal_lm(folder, attn_implementation="eager")
    assert [r for r in caplog.records if "taken as chatglm2-6b-32k" in r.getMessage()]
    assert_logits_close(logits_of(model, golden_32k), golden_32k.expected["seq_1_logits"])


def test_contradicting_evidence_warns_and_chatglm_variant_decides(golden_32k, tmp_path, caplog):
    """config.json names chatglm3-6b-32k (base reading) but has chatglm2-6b-32k's rope_ratio 16: the name wins, and a
    warning names both; chatglm_variant in config.json chooses; an unknown one is refused naming the field."""
    folder = folder_without_names(golden_32k, tmp_path / "named", _name_or_path="THUDM/chatglm3-6b-32k")
    with caplog.at_level("WARNING"):
        named = load_causal_lm(folder, attn_implementation="eager")
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "chatglm3-6b-32k" in message and "rope_ratio" in message and "chatglm_variant" in message, message
    assert named.transformer.rotary_pos_emb.base == 160000.0
    assert relative_max_error(logits_of(named, golden_32k), golden_32k.expected["seq_1_logits"]) > 1e-2
    chosen = folder_without_names(golden_32k, tmp_path / "chosen", _name_or_path="THUDM/chatglm3-6b-32k",
                                  chatglm_variant="chatglm2-6b-32k")
    assert_logits_close(logits_of(load_causal_lm(chosen, attn_implementation="eager"), golden_32k),
                        golden_32k.expected["seq_1_logits"])
    wrong = folder_without_names(golden_32k, tmp_path / "wrong", chatglm_variant="chatglm2-6b-64k")
    with pytest.raises(ValueError, match="chatglm_variant='chatglm2-6b-64k'.*chatglm2-6b-32k"):
        load_causal_lm(wrong)


def test_32k_with_a_p_tuning_prefix_matches_the_reference(tiny_model):
    """P-tuning v2 on chatglm2-6b-32k: the prefix keys stay unrotated, the tokens' positions are divided."""
    model = tiny_model("chatglm3", rope_ratio=16, chatglm_variant="chatglm2-6b-32k", pre_seq_len=4)
    randomize_(model, seed=3)
    assert model.transformer.rotary_pos_emb.position_divisor == 16.0
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(input_ids=ids, use_cache=False).logits
    assert relative_max_error(ours, reference_logits(model.state_dict(), model.config, ids)) < 1e-5
