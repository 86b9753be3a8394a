"""The fast GLM-4 tokenizer from tools/convert_glm4_tokenizer_to_fast.py, against the original's reference vectors.

The fast tokenizer is transformers' stock PreTrainedTokenizerFast: it parses special-token text by default (as the
original did) and keeps it as text with `split_special_tokens=True` (our slow tokenizer's default).
"""
import base64

import pytest
from hypothesis import given, settings, strategies as st

import conftest

if not hasattr(conftest, "glm4_fast_tokenizer"):  # until conftest.py does `from tokenizer_fixtures import *`
    from tokenizer_fixtures import *  # noqa: F401,F403

GLM4_SPECIALS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
)
PREFIX = [151331, 151333]


def of_kind(records, kind):
    return [record for record in records if record["kind"] == kind]


def bug_fields(record) -> set:
    return {field for fields in record.get("original_bug_fields", {}).values() for field in fields}


@pytest.fixture(scope="session")
def token_bytes():
    """id -> bytes, read straight from the shared tokenizer.model."""
    table = {}
    for line in conftest.shared_path("tokenizers", "glm-4-9b-chat", "tokenizer.model").read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            table[int(rank)] = base64.b64decode(token)
    for index, special in enumerate(GLM4_SPECIALS):
        table[151329 + index] = special.encode()
    return table


def expected_offsets(text, ids, token_bytes):
    """Character span of each token: a token that covers part of a character maps to that whole character."""
    byte_to_char = [index for index, char in enumerate(text) for _ in char.encode("utf-8")]
    spans, position = [], 0
    for index in ids:
        length = len(token_bytes[index])
        spans.append((byte_to_char[position], byte_to_char[position + length - 1] + 1))
        position += length
    assert position == len(byte_to_char)
    return spans


def test_fast_encode_matches_original(glm4_fast_tokenizer, glm4_records):
    fast = glm4_fast_tokenizer
    failures = []
    for record in of_kind(glm4_records, "encode"):
        text = record["text"]
        checks = [
            (fast.encode(text, add_special_tokens=False), record["ids_no_special"]),
            (fast.encode(text), record["ids_special"]),
            (fast.encode(text, add_special_tokens=False, split_special_tokens=True), record["tiktoken_encode_ids"]),
            (fast(text, split_special_tokens=True)["input_ids"], PREFIX + record["tiktoken_encode_ids"]),
        ]
        if any(got != want for got, want in checks):
            failures.append(record["id"])
    assert not failures, failures[:5]


def test_fast_offsets(glm4_fast_tokenizer, glm4_records, token_bytes):
    fast = glm4_fast_tokenizer
    for record in of_kind(glm4_records, "encode"):
        text = record["text"]
        for split in (False, True):
            output = fast(text, add_special_tokens=True, return_offsets_mapping=True, split_special_tokens=split)
            ids = output["input_ids"]
            assert ids[:2] == PREFIX
            expected = [(0, 0), (0, 0)] + expected_offsets(text, ids[2:], token_bytes)
            assert [tuple(span) for span in output["offset_mapping"]] == expected, record["id"]


def test_fast_decode(glm4_fast_tokenizer, glm4_records):
    fast = glm4_fast_tokenizer
    for record in of_kind(glm4_records, "encode"):
        assert fast.decode(record["ids_no_special"]) == record["text"], record["id"]
        assert fast.decode(record["ids_special"], skip_special_tokens=True) == record["decoded_skip_special"]
    for record in of_kind(glm4_records, "decode"):
        if min(record["ids"], default=0) < 0:
            continue  # the Rust tokenizer takes unsigned ids only; the slow tokenizer decodes them to ""
        assert fast.decode(record["ids"]) == record["expected_faithful"], record["id"]
        if "decoded_skip_special" not in bug_fields(record):
            assert fast.decode(record["ids"], skip_special_tokens=True) == record["decoded_skip_special"]


def test_fast_batches(glm4_fast_tokenizer, glm4_records):
    """input_ids and attention_mask of every batch record the original got right (no position_ids: fast tokenizers
    do not make them)."""
    fast = glm4_fast_tokenizer
    for record in of_kind(glm4_records, "batch"):
        if bug_fields(record):
            continue
        kwargs = dict(record["call_kwargs"])
        saved = fast.truncation_side
        fast.truncation_side = record.get("truncation_side", saved)
        try:
            output = fast(record["texts"], **kwargs)
        finally:
            fast.truncation_side = saved
        assert output["input_ids"] == record["input_ids"], record["id"]
        assert output["attention_mask"] == record["attention_mask"], record["id"]


def test_fast_right_padding(glm4_fast_tokenizer, glm4_tokenizer, glm4_records):
    record = next(r for r in of_kind(glm4_records, "batch") if r["padding_side"] == "right")
    saved = glm4_fast_tokenizer.padding_side
    glm4_fast_tokenizer.padding_side = "right"  # transformers < 4.46 has no padding_side call argument
    try:
        fast = glm4_fast_tokenizer(record["texts"], padding=True)
    finally:
        glm4_fast_tokenizer.padding_side = saved
    slow = glm4_tokenizer(record["texts"], padding=True, padding_side="right")
    assert fast["input_ids"] == slow["input_ids"] and fast["attention_mask"] == slow["attention_mask"]


def test_fast_chat_and_pairs(glm4_fast_tokenizer, glm4_tokenizer, glm4_records):
    fast = glm4_fast_tokenizer
    for record in of_kind(glm4_records, "chat"):
        if not bug_fields(record):
            assert fast.encode(record["rendered"], add_special_tokens=False) == record["ids"], record["id"]
    for record in of_kind(glm4_records, "pair"):
        expected = glm4_tokenizer(record["text"], record["text_pair"])["input_ids"]
        assert fast(record["text"], record["text_pair"])["input_ids"] == expected


def test_converter_rejects_a_non_glm4_file(fast_converter, tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(conftest.shared_path("tokenizers", "chatglm3-6b", "tokenizer.model").read_bytes())
    with pytest.raises(SystemExit, match="tokenizer.model"):
        fast_converter.main([str(bad), "-o", str(tmp_path / "tokenizer.json")])


TEXT = st.lists(
    st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=24), st.sampled_from(GLM4_SPECIALS)),
    max_size=5,
).map("".join)


@settings(max_examples=2000, deadline=None, derandomize=True, database=None)
@given(text=TEXT)
def test_fast_equals_slow_property(glm4_fast_tokenizer, glm4_tokenizer, text):
    fast, slow = glm4_fast_tokenizer, glm4_tokenizer
    as_text = fast.encode(text, split_special_tokens=True)
    assert as_text == slow.encode(text)
    parsed = fast.encode(text, add_special_tokens=False)
    assert parsed == slow.encode(text, add_special_tokens=False, split_special_tokens=False)
    assert fast.decode(parsed) == text and fast.decode(as_text, skip_special_tokens=True) == text
