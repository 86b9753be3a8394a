"""Tokenizer tests against the reference vectors of the ORIGINAL tokenizers (shared/tokvec, see its FORMAT.md).

Fields a record marks as an original bug (`original_bug_fields`) are checked against the FIXED behaviour. Those
expectations are derived from independent sources -- the original's own faithful fields (`decoded_nospace`,
`expected_faithful`, `sp_encode_ids`, `tiktoken_encode_ids`, `build_chat_input`), the glm-4-9b Python prompt
builder's output, or tiktoken / sentencepiece called directly on the shared model files -- never from our code.
Each derivation is first checked against the records where the original is right.
"""
import ast
import base64
import json
import pickle
import re

import pytest
from hypothesis import given, settings, strategies as st

import conftest

if not hasattr(conftest, "glm4_tokenizer"):  # until conftest.py does `from tokenizer_fixtures import *`
    from tokenizer_fixtures import *  # noqa: F401,F403

from tokenizer_fixtures import load_tokenizer

GLM4_SPECIALS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
)
CHATGLM3_CONTROLS = ("[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>",
                     "<|observation|>")
# The four the original registered as added tokens (the others were encoded as text).
CHATGLM3_ORIGINAL_ADDED = ("[gMASK]", "sop", "<|user|>", "<|assistant|>")


# ---------------------------------------------------------------------------------------------------------------------
# Record helpers
# ---------------------------------------------------------------------------------------------------------------------


def of_kind(records, kind):
    return [record for record in records if record["kind"] == kind]


def meta(records):
    return of_kind(records, "meta")[0]


def bug_fields(record) -> set:
    return {field for fields in record.get("original_bug_fields", {}).values() for field in fields}


def has_code(record, code) -> bool:
    return code in record.get("original_bug_codes", []) or code in record.get("original_quirk_codes", [])


def assert_no_failures(failures, what):
    assert not failures, f"{len(failures)} {what} differ; first: {failures[:3]}"


# ---------------------------------------------------------------------------------------------------------------------
# Independent oracles: tiktoken / sentencepiece on the shared model files
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiktoken_oracle(glm4_records):
    """GLM-4's BPE rebuilt with tiktoken from the shared file and the original's regex (meta record)."""
    import tiktoken

    ranks = {}
    for line in conftest.shared_path("tokenizers", "glm-4-9b-chat", "tokenizer.model").read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    info = meta(glm4_records)
    return tiktoken.Encoding(name="oracle", pat_str=info["tiktoken_pat_str"], mergeable_ranks=ranks,
                             special_tokens={})


@pytest.fixture(scope="session")
def sp_oracle():
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(
        model_file=str(conftest.shared_path("tokenizers", "chatglm3-6b", "tokenizer.model"))
    )


def special_spans(text, tokens, whole_word=()):
    """(start, end, token) of each special token in `text`, longest match first; `whole_word` ones not in words."""
    alternatives = [
        rf"(?<!\w){re.escape(t)}(?!\w)" if t in whole_word else re.escape(t)
        for t in sorted(tokens, key=len, reverse=True)
    ]
    return [(m.start(), m.end(), m.group(0)) for m in re.finditer("|".join(alternatives), text)]


def encode_split(text, spans, token_ids, encode_text):
    """Ids of `text` with the tokens at `spans` as control ids and everything between encoded as plain text."""
    ids, cursor = [], 0
    for start, end, token in spans:
        if start > cursor:
            ids += encode_text(text[cursor:start])
        ids.append(token_ids[token])
        cursor = end
    if cursor < len(text):
        ids += encode_text(text[cursor:])
    return ids


def chatglm3_reference_parse(text, sp_oracle):
    """ChatGLM3 with split_special_tokens=False: the 9 control tokens ("sop"/"eop" as whole words), each text
    piece encoded by SentencePiece on its own (the original's splitting, with the registration made consistent)."""
    ids = {token: 64789 + index for index, token in enumerate(CHATGLM3_CONTROLS)}
    spans = special_spans(text, CHATGLM3_CONTROLS, whole_word=("sop", "eop"))
    return encode_split(text, spans, ids, sp_oracle.encode)


def chatglm3_reference_decode(ids, sp_oracle, skip_special=False):
    """Faithful ChatGLM3 decode: control ids give their text (or nothing when skipped), each run of pieces between
    them is decoded by SentencePiece on its own; <unk>/<s>/</s> and ids outside the vocabulary give ""."""
    parts, run = [], []
    for index in ids:
        if 64789 <= index <= 64797:
            parts.append(sp_oracle.decode(run))
            run = []
            if not skip_special:
                parts.append(CHATGLM3_CONTROLS[index - 64789])
        elif 3 <= index < 64789:
            run.append(index)
    parts.append(sp_oracle.decode(run))
    return "".join(parts)


def content_spans(rendered, messages):
    """Character spans of the message contents inside a rendered chat (found in order)."""
    spans, cursor = [], 0
    for message in messages:
        content = message.get("content") or ""
        if not content:
            continue
        start = rendered.find(content, cursor)
        assert start >= 0, "message content not found in the rendered chat"
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def reference_chat_ids(rendered, messages, tokens, token_ids, encode_text, whole_word=()):
    """Chat ids where the template's control tokens are parsed and control-token text in contents stays text."""
    inside = content_spans(rendered, messages)
    spans = [
        span for span in special_spans(rendered, tokens, whole_word)
        if not any(start <= span[0] < end for start, end in inside)
    ]
    return encode_split(rendered, spans, token_ids, encode_text)


def pad_rows(rows, side, length, pad_id):
    """Expected padded batch: pad id / mask 0 / position 0 on the padding, positions 0..n-1 on the tokens."""
    batch = {"input_ids": [], "attention_mask": [], "position_ids": []}
    for row in rows:
        missing = length - len(row)
        values = (row, [1] * len(row), list(range(len(row))))
        fills = (pad_id, 0, 0)
        for key, value, fill in zip(batch, values, fills):
            padding = [fill] * missing
            batch[key].append(padding + value if side == "left" else value + padding)
    return batch


def padded_length(rows, call_kwargs):
    if call_kwargs.get("padding") == "max_length":
        length = call_kwargs["max_length"]
    elif call_kwargs.get("padding"):
        length = max(len(row) for row in rows)
    else:
        return None
    multiple = call_kwargs.get("pad_to_multiple_of")
    if multiple and length % multiple:
        length += multiple - length % multiple
    return length


def unpadded_rows(record):
    return [[i for i, m in zip(ids, mask) if m] for ids, mask in zip(record["input_ids"], record["attention_mask"])]


# ---------------------------------------------------------------------------------------------------------------------
# Loading and tokenizer facts
# ---------------------------------------------------------------------------------------------------------------------


def test_glm4_facts_match_original(glm4_tokenizer, glm4_records):
    tok, info = glm4_tokenizer, meta(glm4_records)
    assert type(tok).__name__ == "ChatGLM4Tokenizer" == info["tokenizer_class"]
    assert (tok.vocab_size, len(tok), len(tok.get_vocab())) == (info["vocab_size"], info["len_tokenizer"],
                                                                 info["len_tokenizer"])
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == (
        info["eos_token"], info["eos_token_id"], info["pad_token"], info["pad_token_id"])
    assert (tok.padding_side, tok.truncation_side, tok.model_max_length) == (
        info["padding_side"], info["truncation_side"], info["model_max_length"])
    assert list(tok.model_input_names) == info["model_input_names"]
    assert tok.all_special_tokens == info["all_special_tokens"]
    assert tok.all_special_ids == info["all_special_ids"]
    assert tok.get_prefix_tokens() == info["prefix_tokens"]
    assert {t: tok.convert_tokens_to_ids(t) for t in info["special_token_ids"]} == info["special_token_ids"]
    assert {str(i): t.content for i, t in tok.added_tokens_decoder.items()} == {
        i: t["content"] for i, t in info["added_tokens"].items()}
    assert tok.tokenizer._pat_str == info["tiktoken_pat_str"]
    assert len(tok.mergeable_ranks) == info["n_mergeable_ranks"]
    assert tok.split_special_tokens is True  # our documented default


def test_chatglm3_facts_match_original_with_fixes(chatglm3_tokenizer, chatglm3_records):
    tok, info = chatglm3_tokenizer, meta(chatglm3_records)
    assert type(tok).__name__ == "ChatGLMTokenizer" == info["tokenizer_class"]
    # CHATGLM3-LEN-LT-VOCAB fixed: every id has its own token, so len(tok) == vocab_size.
    assert tok.vocab_size == info["vocab_size"] == len(tok) == len(tok.get_vocab())
    assert (tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        info["eos_token_id"], info["pad_token_id"], info["unk_token_id"])
    assert tok.padding_side == info["padding_side"] and tok.model_max_length == info["model_max_length"]
    assert list(tok.model_input_names) == info["model_input_names"]
    assert tok.get_prefix_tokens() == info["prefix_tokens"]
    assert {t: tok.convert_tokens_to_ids(t) for t in info["special_token_ids"]} == info["special_token_ids"]
    assert tok.special_tokens == info["chatglm_special_tokens_attr"]
    assert tok.tokenizer.n_words == info["sp_vocab_size"]
    assert [tok.tokenizer.bos_id, tok.tokenizer.eos_id, tok.tokenizer.pad_id] == info["sp_bos_eos_unk"]
    # CHATGLM3-SKIP-SPECIAL-NOOP fixed: the 9 control tokens are special tokens.
    controls = [info["special_token_ids"][t] for t in CHATGLM3_CONTROLS]
    assert set(controls) <= set(tok.all_special_ids)
    assert tok.build_chat_input is not None and info["has_build_chat_input"]


def test_repository_tokenizer_config_is_glm4_chat(glm4_records):
    ours = json.loads((conftest.REPO / "tokenizer_config.json").read_text(encoding="utf-8"))
    original = json.loads(conftest.shared_path("tokenizers", "glm-4-9b-chat", "tokenizer_config.json").read_text(
        encoding="utf-8"))
    assert ours == original
    assert ours["auto_map"] == meta(glm4_records)["auto_map"]


def test_glm4_builtin_template_is_the_checkpoint_template():
    """The template used when a checkpoint has none (glm-4-9b base) is glm-4-9b-chat's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("our_tokenization", conftest.REPO / "tokenization_chatglm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = json.loads(conftest.shared_path("tokenizers", "glm-4-9b-chat", "tokenizer_config.json").read_text(
        encoding="utf-8"))
    assert module._GLM4_CHAT_TEMPLATE == config["chat_template"]
    patched = module.keep_glm4_tool_heading_newlines(config["chat_template"])
    assert module.keep_glm4_tool_heading_newlines(patched) == patched  # idempotent
    assert patched.replace("\n\n\n## ", "\n\n## ") == config["chat_template"]  # only newlines added
    assert patched.count("\n\n\n## ") == 4  # the four tool types


# ---------------------------------------------------------------------------------------------------------------------
# GLM-4 encode / decode
# ---------------------------------------------------------------------------------------------------------------------


def test_glm4_special_text_stays_text_by_default(glm4_tokenizer, glm4_records):
    tok, prefix = glm4_tokenizer, meta(glm4_records)["prefix_tokens"]
    failures = []
    for record in of_kind(glm4_records, "encode"):
        text, plain = record["text"], record["tiktoken_encode_ids"]
        if not has_code(record, "SPECIAL-TEXT-PARSED"):
            assert plain == record["ids_no_special"], record["id"]  # so these match the original's ids too
        if tok.encode(text, add_special_tokens=False) != plain or tok.encode(text) != prefix + plain:
            failures.append(record["id"])
        if not has_code(record, "SPECIAL-TEXT-PARSED") and [repr(t) for t in tok.tokenize(text)] != record[
                "tokens_repr"]:
            failures.append(record["id"] + " tokens")
    assert_no_failures(failures, "GLM-4 encodings")


def test_glm4_parse_mode_reproduces_original(glm4_tokenizer, glm4_records):
    """split_special_tokens=False is the original's behaviour: special-token text becomes control ids."""
    tok = glm4_tokenizer
    failures = []
    for record in of_kind(glm4_records, "encode"):
        text = record["text"]
        if (tok.encode(text, add_special_tokens=False, split_special_tokens=False) != record["ids_no_special"]
                or tok.encode(text, split_special_tokens=False) != record["ids_special"]
                or [repr(t) for t in tok.tokenize(text, split_special_tokens=False)] != record["tokens_repr"]):
            failures.append(record["id"])
    assert_no_failures(failures, "GLM-4 parse-mode encodings")


def test_glm4_decode_encode_records(glm4_tokenizer, glm4_records):
    tok = glm4_tokenizer
    failures = []
    for record in of_kind(glm4_records, "encode"):
        faithful = record["decoded_nospace"]  # GLM4-DECODE-SPACES: the faithful target
        assert faithful == record["text"] and ("decoded" in bug_fields(record) or record["decoded"] == faithful)
        checks = [
            (tok.decode(record["ids_no_special"]), faithful),
            (tok.decode(record["ids_no_special"], spaces_between_special_tokens=True), faithful),
            (tok.decode(record["ids_special"]), "[gMASK]<sop>" + faithful),
            (tok.decode(record["ids_special"], skip_special_tokens=True), record["decoded_skip_special"]),
            (tok.decode(tok.encode(record["text"])), "[gMASK]<sop>" + record["text"]),
        ]
        if any(got != want for got, want in checks):
            failures.append(record["id"])
    assert_no_failures(failures, "GLM-4 decodes")


def test_glm4_decode_records(glm4_tokenizer, glm4_records):
    tok = glm4_tokenizer
    for record in of_kind(glm4_records, "decode"):
        ids = record["ids"]
        # GLM4-CONVERT-TOKENS-DUP / GLM4-DECODE-SPACES: the generator's byte-exact decode is the target.
        assert tok.decode(ids) == record["expected_faithful"], record["id"]
        assert tok.decode(ids, spaces_between_special_tokens=False) == record["expected_faithful"], record["id"]
        if "decoded_skip_special" in bug_fields(record):
            expected_skip = record["expected_faithful"]
            for special in GLM4_SPECIALS:
                expected_skip = expected_skip.replace(special, "")
        else:
            expected_skip = record["decoded_skip_special"]
        assert tok.decode(ids, skip_special_tokens=True) == expected_skip, record["id"]
        assert [repr(t) for t in tok.convert_ids_to_tokens(ids)] == record["tokens_repr"], record["id"]
        assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids)) == record["expected_faithful"]


def test_glm4_pairs_encode(glm4_tokenizer, glm4_records, tiktoken_oracle):
    """GLM4-PAIR-EOS-KEYERROR fixed: [gMASK] <sop> A B <|endoftext|>, as ChatGLM3 does with its eos."""
    tok, info = glm4_tokenizer, meta(glm4_records)
    for record in of_kind(glm4_records, "pair"):
        assert "KeyError" in record["error"]
        output = tok(record["text"], record["text_pair"])
        expected = (info["prefix_tokens"] + tiktoken_oracle.encode(record["text"])
                    + tiktoken_oracle.encode(record["text_pair"]) + [info["eos_token_id"]])
        assert output["input_ids"] == expected
        assert output["attention_mask"] == [1] * len(expected)
        assert output["position_ids"] == list(range(len(expected)))
        assert tok.get_special_tokens_mask(tiktoken_oracle.encode(record["text"]),
                                           tiktoken_oracle.encode(record["text_pair"])) == [
            1 if i < 2 or i == len(expected) - 1 else 0 for i in range(len(expected))]


# ---------------------------------------------------------------------------------------------------------------------
# ChatGLM3 encode / decode
# ---------------------------------------------------------------------------------------------------------------------


def test_chatglm3_encode_is_sentencepiece_by_default(chatglm3_tokenizer, chatglm3_records):
    """Fixes CHATGLM3-SOP-LITERAL / -GMASK-LITERAL / -ROLE-TEXT-INCONSISTENT: text is text (sp_encode_ids)."""
    tok, prefix = chatglm3_tokenizer, meta(chatglm3_records)["prefix_tokens"]
    literal_bugs = ("CHATGLM3-SOP-LITERAL", "CHATGLM3-GMASK-LITERAL", "CHATGLM3-ROLE-TEXT-INCONSISTENT")
    failures = []
    for record in of_kind(chatglm3_records, "encode"):
        text, plain = record["text"], record["sp_encode_ids"]
        original_right = not any(has_code(record, code) for code in literal_bugs + ("SPECIAL-TEXT-PARSED",))
        if original_right:
            assert plain == record["ids_no_special"], record["id"]
        if tok.encode(text, add_special_tokens=False) != plain or tok.encode(text) != prefix + plain:
            failures.append(record["id"])
        if original_right and tok.tokenize(text) != [ast.literal_eval(t) for t in record["tokens_repr"]]:
            failures.append(record["id"] + " tokens")
    assert_no_failures(failures, "ChatGLM3 encodings")


def test_chatglm3_parse_mode(chatglm3_tokenizer, chatglm3_records, sp_oracle):
    """split_special_tokens=False parses all 9 control tokens ("sop"/"eop" only as whole words)."""
    tok = chatglm3_tokenizer
    failures = []
    for record in of_kind(chatglm3_records, "encode"):
        text = record["text"]
        expected = chatglm3_reference_parse(text, sp_oracle)
        ours_rule = [span[2] for span in special_spans(text, CHATGLM3_CONTROLS, whole_word=("sop", "eop"))]
        original_rule = [span[2] for span in special_spans(text, CHATGLM3_ORIGINAL_ADDED)]
        if ours_rule == original_rule:  # where both agree on what is a control token, the original is the oracle
            assert expected == record["ids_no_special"], record["id"]
        if tok.encode(text, add_special_tokens=False, split_special_tokens=False) != expected:
            failures.append(record["id"])
    assert_no_failures(failures, "ChatGLM3 parse-mode encodings")


def test_chatglm3_decode_encode_records(chatglm3_tokenizer, chatglm3_records, sp_oracle):
    tok = chatglm3_tokenizer
    failures = []
    for record in of_kind(chatglm3_records, "encode"):
        text, original_ids = record["text"], record["ids_no_special"]
        # CHATGLM3-DECODE-SPACES: decoded_nospace is the faithful decode of the original ids.
        faithful = record["decoded"] if "decoded" not in bug_fields(record) else record["decoded_nospace"]
        assert chatglm3_reference_decode(original_ids, sp_oracle) == faithful, record["id"]
        checks = [
            (tok.decode(record["sp_encode_ids"]), text),
            (tok.decode(original_ids), faithful),
            (tok.decode(record["ids_special"]), "[gMASK]sop" + faithful),
            # CHATGLM3-SKIP-SPECIAL-NOOP fixed: the control tokens are removed.
            (tok.decode(record["ids_special"], skip_special_tokens=True),
             chatglm3_reference_decode(original_ids, sp_oracle, skip_special=True)),
            (tok.decode(tok.encode(text), skip_special_tokens=True), text),
        ]
        if any(got != want for got, want in checks):
            failures.append(record["id"])
    assert_no_failures(failures, "ChatGLM3 decodes")


def test_chatglm3_decode_records(chatglm3_tokenizer, chatglm3_records, sp_oracle):
    tok = chatglm3_tokenizer
    sp_control = {0: "<unk>", 1: "<s>", 2: "</s>"}
    for record in of_kind(chatglm3_records, "decode"):
        ids = record["ids"]
        reference = chatglm3_reference_decode(ids, sp_oracle)
        if not has_code(record, "CHATGLM3-UNREGISTERED-SPECIAL-DECODE"):
            assert reference == record["decoded_nospace"], record["id"]
        assert tok.decode(ids) == reference, record["id"]
        assert tok.decode(ids, skip_special_tokens=True) == chatglm3_reference_decode(ids, sp_oracle, True)
        # Ids 0/1/2 are SentencePiece's <unk>/<s>/</s> (the original mapped all three to "", CHATGLM3-LEN-LT-VOCAB).
        expected_tokens = [sp_control.get(i, ast.literal_eval(t)) for i, t in zip(ids, record["tokens_repr"])]
        assert tok.convert_ids_to_tokens(ids) == expected_tokens, record["id"]


def test_chatglm3_pairs_match_original(chatglm3_tokenizer, chatglm3_records):
    for record in of_kind(chatglm3_records, "pair"):
        output = chatglm3_tokenizer(record["text"], record["text_pair"])
        assert dict(output) == record["output"], record["id"]


# ---------------------------------------------------------------------------------------------------------------------
# Padded batches
# ---------------------------------------------------------------------------------------------------------------------


def expected_batches(records, prefix, pad_id, encode_text):
    """(record, side, call kwargs, expected output) for each batch record, fixed where the original was wrong."""
    cases = []
    for record in of_kind(records, "batch"):
        kwargs = dict(record["call_kwargs"])
        side = "right" if record["padding_side"] == "right" else "left"
        if "truncation_side" in record:
            kwargs["truncation_side"] = record["truncation_side"]
        add_special = kwargs.get("add_special_tokens", True)
        # Each text encoded as plain text by the oracle: our default keeps special-token text as text.
        fresh = [(prefix if add_special else []) + encode_text(text) for text in record["texts"]]
        # Truncated batches keep the original's (correctly truncated) rows; their texts hold no special tokens.
        rows = unpadded_rows(record) if record.get("truncation") else fresh
        length = padded_length(rows, kwargs)
        if length:
            expected = pad_rows(rows, side, length, pad_id)
        else:
            expected = {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows],
                        "position_ids": [list(range(len(r))) for r in rows]}
        if "PAD-IGNORES-RETURN-ATTENTION-MASK" in record.get("original_bug_codes", []):
            expected = {"input_ids": expected["input_ids"]}  # fixed: no attention_mask, hence no position_ids
        if "error" not in record and not bug_fields(record) and unpadded_rows(record) == rows:
            # The expectation builder reproduces every batch the original got right.
            assert expected == {key: record[key] for key in record["output_keys"]}, record["id"]
        cases.append((record, side, kwargs, expected))
    return cases


def run_batch(tok, record, side, kwargs, mechanism):
    kwargs = dict(kwargs)
    truncation_side = kwargs.pop("truncation_side", None)
    saved = tok.padding_side, tok.truncation_side
    try:
        if truncation_side:
            tok.truncation_side = truncation_side
        if mechanism == "attribute":
            tok.padding_side = side
        else:
            kwargs["padding_side"] = side
        return {key: value for key, value in tok(record["texts"], **kwargs).items()}
    finally:
        tok.padding_side, tok.truncation_side = saved


@pytest.mark.parametrize("mechanism", ["attribute", "call_kwarg"])
def test_glm4_batches(glm4_tokenizer, glm4_records, tiktoken_oracle, mechanism):
    info = meta(glm4_records)
    for record, side, kwargs, expected in expected_batches(glm4_records, info["prefix_tokens"],
                                                           info["pad_token_id"], tiktoken_oracle.encode):
        assert run_batch(glm4_tokenizer, record, side, kwargs, mechanism) == expected, record["id"]


@pytest.mark.parametrize("mechanism", ["attribute", "call_kwarg"])
def test_chatglm3_batches(chatglm3_tokenizer, chatglm3_records, sp_oracle, mechanism):
    info = meta(chatglm3_records)
    for record, side, kwargs, expected in expected_batches(chatglm3_records, info["prefix_tokens"],
                                                           info["pad_token_id"], sp_oracle.encode):
        assert run_batch(chatglm3_tokenizer, record, side, kwargs, mechanism) == expected, record["id"]


def test_right_padding_for_every_record_text(glm4_tokenizer, chatglm3_tokenizer, glm4_records, chatglm3_records):
    """PAD-ASSERT-LEFT / GLM4-PAD-IGNORES-PADDING-SIDE: right padding mirrors left padding row by row."""
    for tok, records in ((glm4_tokenizer, glm4_records), (chatglm3_tokenizer, chatglm3_records)):
        for record in of_kind(records, "batch"):
            left = tok(record["texts"], padding=True, padding_side="left")
            right = tok(record["texts"], padding=True, padding_side="right")
            for key in ("input_ids", "attention_mask", "position_ids"):
                for l_row, r_row, mask in zip(left[key], right[key], left["attention_mask"]):
                    pads = len(mask) - sum(mask)
                    assert r_row == l_row[pads:] + l_row[:pads], (record["id"], key)


def test_variant_batches(glm4_tokenizer, glm4_variant_records, glm4_records, tiktoken_oracle):
    """The glm-4-9b-chat-1m / glm-4-9b files asserted left padding (PAD-ASSERT-LEFT); ours pads either side."""
    info = meta(glm4_records)
    for record, side, kwargs, expected in expected_batches(glm4_variant_records, info["prefix_tokens"],
                                                           info["pad_token_id"], tiktoken_oracle.encode):
        assert run_batch(glm4_tokenizer, record, side, kwargs, "attribute") == expected, record["id"]


def test_pad_keeps_existing_position_ids(glm4_tokenizer):
    features = [{"input_ids": [1, 2, 3], "position_ids": [0, 1, 2]}, {"input_ids": [4], "position_ids": [7]}]
    padded = glm4_tokenizer.pad(features, padding=True)
    assert padded["position_ids"] == [[0, 1, 2], [0, 0, 7]]
    assert padded["attention_mask"] == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="padding_side"):
        glm4_tokenizer(["a", "bb"], padding=True, padding_side="middle")


# ---------------------------------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------------------------------


def glm4_expected_rendering(record, base_records):
    """GLM4-CHAT-TOOLS-NEWLINE-TRIMMED: the glm-4-9b Python prompt builder (typo fixed) is the target."""
    if "rendered" not in bug_fields(record):
        return record["rendered"]
    base = base_records[record["id"].rsplit("-", 1)[1]]
    expected = base["rendered"].replace("GhatGLM", "ChatGLM")  # GLM4-BASE-GHATGLM-TYPO
    assert expected.replace("\n\n## ", "\n## ") == record["rendered"]  # only the blank lines differ
    return expected


@pytest.fixture(scope="session")
def glm4_base_chat_records(glm4_variant_records):
    return {r["id"].rsplit("-", 1)[1]: r for r in of_kind(glm4_variant_records, "chat") if r["variant"] == "glm-4-9b"}


def glm4_expected_chat_ids(record, rendered, tiktoken_oracle):
    ids = {token: 151329 + index for index, token in enumerate(GLM4_SPECIALS)}
    return reference_chat_ids(rendered, record["messages"], GLM4_SPECIALS, ids, tiktoken_oracle.encode)


def call_template(tok, record, **kwargs):
    return tok.apply_chat_template(record["messages"], add_generation_prompt=record["add_generation_prompt"],
                                   **record.get("apply_chat_template_kwargs", {}), **kwargs)


def test_glm4_chat(glm4_tokenizer, glm4_records, glm4_base_chat_records, tiktoken_oracle):
    for record in of_kind(glm4_records, "chat"):
        expected_text = glm4_expected_rendering(record, glm4_base_chat_records)
        assert call_template(glm4_tokenizer, record, tokenize=False) == expected_text, record["id"]
        if not bug_fields(record):  # the oracle reproduces the original where it was right
            assert glm4_expected_chat_ids(record, record["rendered"], tiktoken_oracle) == record["ids"], record["id"]
        expected_ids = glm4_expected_chat_ids(record, expected_text, tiktoken_oracle)
        assert call_template(glm4_tokenizer, record) == expected_ids, record["id"]


def test_glm4_chat_injection_stays_text(glm4_tokenizer, glm4_records):
    record = next(r for r in of_kind(glm4_records, "chat") if has_code(r, "CHAT-SPECIAL-TOKEN-INJECTION"))
    ids = call_template(glm4_tokenizer, record)
    assert ids.count(151340) == 0 and record["ids"].count(151340) == 1  # <|end_of_image|> in the content
    # The same text through the template path with an explicit template keeps the content as text too.
    assert call_template(glm4_tokenizer, record, chat_template=glm4_tokenizer.chat_template) == ids


def test_glm4_control_text_in_tools_and_content_stays_text(glm4_tokenizer):
    tools = [{"type": "function", "function": {"name": "f", "description": "stop at <|observation|> or [gMASK]"}}]
    messages = [{"role": "system", "content": "", "tools": tools}, {"role": "user", "content": "<|assistant|>hi"}]
    text = glm4_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = glm4_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert "<|observation|>" in text and glm4_tokenizer.decode(ids) == text
    # Only the template's own control tokens: [gMASK] <sop> <|system|> <|user|> <|assistant|>.
    assert [i for i in ids if i >= 151329] == [151331, 151333, 151335, 151336, 151337]


def test_glm4_explicit_template_is_rendered_as_given(glm4_tokenizer, glm4_records):
    record = next(r for r in of_kind(glm4_records, "chat") if has_code(r, "GLM4-CHAT-TOOLS-NEWLINE-TRIMMED"))
    text = call_template(glm4_tokenizer, record, tokenize=False, chat_template=glm4_tokenizer.chat_template)
    assert text == record["rendered"]


def test_chatglm3_chat(chatglm3_tokenizer, chatglm3_records):
    """Text: the checkpoint's Jinja template (unchanged). Ids: build_chat_input's (CHATGLM3-TEMPLATE-VS-BUILD-...)."""
    tok = chatglm3_tokenizer
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    for record in of_kind(chatglm3_records, "chat"):
        assert call_template(tok, record, tokenize=False) == record["rendered"], record["id"]
        full = record["build_chat_input"]["input_ids"][0]
        assert full[-1] == assistant
        expected = full if record["add_generation_prompt"] else full[:-1]
        if record.get("template_matches_build_chat_input"):
            assert expected == record["ids"] and full == record["template_ids_with_generation_prompt"]
        assert call_template(tok, record) == expected, record["id"]
        assert tok.apply_chat_template(record["messages"], add_generation_prompt=True) == full, record["id"]


def test_chatglm3_build_chat_input_matches_original(chatglm3_tokenizer, chatglm3_records):
    for record in of_kind(chatglm3_records, "chat"):
        reference = record["build_chat_input"]
        output = chatglm3_tokenizer.build_chat_input(reference["query"], history=reference["history"],
                                                     role=reference["role"])
        for key in ("input_ids", "attention_mask", "position_ids"):
            assert output[key].tolist() == reference[key], (record["id"], key)


def test_chatglm3_explicit_template_keeps_content_text(chatglm3_tokenizer, chatglm3_records, sp_oracle):
    """With an explicit template the Jinja text is encoded: the template's control tokens parsed, content as text."""
    tok = chatglm3_tokenizer
    ids = {token: 64789 + index for index, token in enumerate(CHATGLM3_CONTROLS)}
    for record in of_kind(chatglm3_records, "chat"):
        expected = reference_chat_ids(record["rendered"], record["messages"], CHATGLM3_CONTROLS, ids,
                                      sp_oracle.encode, whole_word=("sop", "eop"))
        if not bug_fields(record):
            assert expected == record["ids"], record["id"]
        assert call_template(tok, record, chat_template=tok.chat_template) == expected, record["id"]


def test_chat_template_return_types(glm4_tokenizer, chatglm3_tokenizer):
    """Documented choice: list[int] unless return_dict=True, on every transformers version."""
    from transformers import BatchEncoding

    messages = [{"role": "user", "content": "hi"}]
    for tok in (glm4_tokenizer, chatglm3_tokenizer):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
        assert tok.apply_chat_template([messages, messages]) == [ids[:-1], ids[:-1]]
        encoding = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        assert isinstance(encoding, BatchEncoding) and encoding["input_ids"] == ids
        assert encoding["position_ids"] == list(range(len(ids)))
        tensor = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        assert tensor.tolist() == [ids]
        batch = tok.apply_chat_template([messages, messages + messages], padding=True, return_dict=True,
                                        return_tensors="pt")
        assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["position_ids"].shape
        with pytest.raises(ValueError):
            tok.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)


def test_variant_chat_ids_from_rendered_text(glm4_tokenizer, glm4_variant_records):
    """glm-4-9b-chat-1m's ids are its rendered text encoded with control tokens parsed; ours encode it the same."""
    for record in of_kind(glm4_variant_records, "chat"):
        if record["variant"] != "glm-4-9b-chat-1m" or has_code(record, "CHAT-SPECIAL-TOKEN-INJECTION"):
            continue
        ids = glm4_tokenizer.encode(record["rendered"], add_special_tokens=False, split_special_tokens=False)
        assert ids == record["ids"], record["id"]


def test_glm4_base_checkpoint_chat(tokenizer_folder_factory, glm4_tokenizer, glm4_records, glm4_base_chat_records):
    """glm-4-9b (base) ships no template; the original built the prompt in Python. Ours uses glm-4-9b-chat's."""
    folder = tokenizer_folder_factory("glm4", "glm4-base", drop_config_keys=("chat_template",),
                                      config_changes={"model_max_length": 8000})
    base = load_tokenizer(folder)
    assert base.chat_template is None and base.model_max_length == 8000
    for record in of_kind(glm4_records, "chat"):
        base_record = glm4_base_chat_records[record["id"].rsplit("-", 1)[1]]
        ours_text = call_template(base, record, tokenize=False)
        ours_ids = call_template(base, record)
        assert ours_text == call_template(glm4_tokenizer, record, tokenize=False)
        assert ours_ids == call_template(glm4_tokenizer, record)
        if base_record.get("same_ids_as_glm4_chat"):
            assert [ours_ids] == base_record["ids"], record["id"]  # the original nested the list
        if record["scenario"] != "tools_empty_list":  # the Python builder skipped an empty tools list
            assert ours_text == base_record["rendered"].replace("GhatGLM", "ChatGLM"), record["id"]


# ---------------------------------------------------------------------------------------------------------------------
# Opting in to special-token parsing, added tokens, pickling
# ---------------------------------------------------------------------------------------------------------------------


def test_split_special_tokens_per_tokenizer(tokenizer_folder_factory, glm4_records):
    folder = tokenizer_folder_factory("glm4", "glm4-parse")
    tok = load_tokenizer(folder, split_special_tokens=False)
    record = next(r for r in of_kind(glm4_records, "encode") if has_code(r, "SPECIAL-TEXT-PARSED"))
    assert tok.encode(record["text"], add_special_tokens=False) == record["ids_no_special"]
    assert tok([record["text"]], add_special_tokens=False)["input_ids"] == [record["ids_no_special"]]
    assert tok.encode(record["text"], add_special_tokens=False, split_special_tokens=True) == record[
        "tiktoken_encode_ids"]


def test_batch_honours_split_special_tokens_argument(glm4_tokenizer, glm4_records):
    record = next(r for r in of_kind(glm4_records, "encode") if has_code(r, "SPECIAL-TEXT-PARSED"))
    batch = glm4_tokenizer([record["text"]] * 2, add_special_tokens=False, split_special_tokens=False)
    assert batch["input_ids"] == [record["ids_no_special"]] * 2


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_added_tokens(tokenizer_folder_factory, family):
    tok = load_tokenizer(tokenizer_folder_factory(family, f"{family}-added"))
    size = len(tok)
    tok.add_tokens(["<my_word>"])
    tok.add_special_tokens({"additional_special_tokens": ["<my_special>"]})
    word, special = tok.convert_tokens_to_ids(["<my_word>", "<my_special>"])
    assert (word, special) == (size, size + 1) and len(tok) == size + 2
    text = "a<my_word>b<my_special>c"
    default = tok.encode(text, add_special_tokens=False)
    parsed = tok.encode(text, add_special_tokens=False, split_special_tokens=False)
    assert word in default and special not in default  # vocabulary tokens always match, special ones on request
    assert word in parsed and special in parsed
    assert tok.decode(default) == tok.decode(parsed) == text
    assert tok.decode(parsed, skip_special_tokens=True) == "a<my_word>bc"


def test_pickle_roundtrip(glm4_tokenizer, chatglm3_tokenizer):
    for tok in (glm4_tokenizer, chatglm3_tokenizer):
        copy = pickle.loads(pickle.dumps(tok))
        text = "Hello, 世界 <|user|> isopropyl"
        assert copy.encode(text) == tok.encode(text) and copy.decode(copy.encode(text)) == tok.decode(tok.encode(text))


def test_save_and_reload(tmp_path, glm4_tokenizer, chatglm3_tokenizer):
    for index, tok in enumerate((glm4_tokenizer, chatglm3_tokenizer)):
        folder = tmp_path / f"saved{index}"
        tok.save_pretrained(folder)
        conftest.copy_code_into(folder)
        again = load_tokenizer(folder)
        text = "The isopropyl <|user|> 你好"
        assert again.encode(text) == tok.encode(text)
        assert again.apply_chat_template([{"role": "user", "content": text}]) == tok.apply_chat_template(
            [{"role": "user", "content": text}])


# ---------------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["glm4", "chatglm3"])
def test_missing_tokenizer_model(tokenizer_folder_factory, family):
    folder = tokenizer_folder_factory(family, f"{family}-missing")
    (folder / "tokenizer.model").unlink()
    with pytest.raises(ValueError) as error:
        load_tokenizer(folder)
    assert "tokenizer.model" in str(error.value) and "expected" in str(error.value)


@pytest.mark.parametrize("family, damage, expected", [
    ("glm4", b"not base64 !!\n", "base64"),
    ("glm4", "truncate", "151329"),
    ("chatglm3", b"\x00garbage", "SentencePiece"),
    ("chatglm3", "other-family", "SentencePiece"),
])
def test_corrupt_tokenizer_model(tokenizer_folder_factory, family, damage, expected):
    folder = tokenizer_folder_factory(family, f"{family}-corrupt")
    model = folder / "tokenizer.model"
    if damage == "truncate":
        model.write_bytes(b"\n".join(model.read_bytes().splitlines()[:1000]))
    elif damage == "other-family":
        model.write_bytes(conftest.shared_path("tokenizers", "glm-4-9b-chat", "tokenizer.model").read_bytes())
    else:
        model.write_bytes(damage)
    with pytest.raises(ValueError) as error:
        load_tokenizer(folder)
    assert str(model) in str(error.value) and expected in str(error.value)


@pytest.mark.parametrize("bad", [123, None, b"bytes", 1.5, ["ok", 3.5], [{"role": "user"}]])
def test_non_string_input_raises_type_error(glm4_tokenizer, chatglm3_tokenizer, bad):
    for tok in (glm4_tokenizer, chatglm3_tokenizer):
        with pytest.raises(TypeError):
            tok(bad) if bad is not None else tok.encode(bad)
        if not isinstance(bad, list):
            with pytest.raises(TypeError):
                tok.tokenize(bad)
            with pytest.raises(TypeError):
                tok.encode(bad)
        with pytest.raises(TypeError):
            tok("fine", text_pair=bad if bad is not None else 7)


# ---------------------------------------------------------------------------------------------------------------------
# Property: decode(encode(s)) == s
# ---------------------------------------------------------------------------------------------------------------------

ROUNDTRIP_SETTINGS = settings(max_examples=2000, deadline=None, derandomize=True, database=None)


def texts(specials, excluded=""):
    """Arbitrary unicode (no surrogates), with the family's special-token strings mixed in."""
    characters = st.characters(blacklist_categories=("Cs",), blacklist_characters=excluded)
    pieces = st.one_of(st.text(characters, max_size=24), st.sampled_from(specials))
    return st.lists(pieces, max_size=5).map("".join)


def assert_roundtrip(tok, text, prefix_text):
    plain = tok.encode(text, add_special_tokens=False)
    assert tok.decode(plain) == text
    parsed = tok.encode(text, add_special_tokens=False, split_special_tokens=False)
    assert tok.decode(parsed) == text
    with_prefix = tok.encode(text)
    assert tok.decode(with_prefix) == prefix_text + text
    assert tok.decode(with_prefix, skip_special_tokens=True) == text


@ROUNDTRIP_SETTINGS
@given(text=texts(GLM4_SPECIALS))
def test_glm4_roundtrip_property(glm4_tokenizer, text):
    assert_roundtrip(glm4_tokenizer, text, "[gMASK]<sop>")


# U+2581 is SentencePiece's space symbol: ChatGLM3 encodes it as a space (quirk CHATGLM3-U2581-LOSSY, kept so the ids
# stay the model's), so it is left out here and checked on its own below.
@ROUNDTRIP_SETTINGS
@given(text=texts(CHATGLM3_CONTROLS + ("isopropyl", "Aesop"), excluded="\u2581"))
def test_chatglm3_roundtrip_property(chatglm3_tokenizer, text):
    assert_roundtrip(chatglm3_tokenizer, text, "[gMASK]sop")


def test_chatglm3_u2581_decodes_as_space(chatglm3_tokenizer, sp_oracle):
    ids = chatglm3_tokenizer.encode("a\u2581b", add_special_tokens=False)
    assert ids == sp_oracle.encode("a\u2581b") and chatglm3_tokenizer.decode(ids) == "a b"


def test_pipeline_style_chat_call(glm4_tokenizer, chatglm3_tokenizer):
    """The call transformers' text-generation pipeline makes (continue_final_message, tools/documents=None)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    for tok in (glm4_tokenizer, chatglm3_tokenizer):
        inputs = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                         return_dict=True, return_tensors="pt", tools=None, documents=None)
        assert inputs["input_ids"].tolist() == [tok.apply_chat_template(messages)]
        assert tok.decode(inputs["input_ids"][0]).endswith("Hello")


def test_control_token_text_encoded_as_text_warns_once_unless_chosen(tokenizer_folder_factory, caplog):
    """Tokenizing apply_chat_template(tokenize=False) output relied on the originals parsing control-token text:
    a tokenizer at the default says once that it encodes such text as text; an explicit choice is not warned."""
    import logging

    from transformers import AutoTokenizer

    folder = tokenizer_folder_factory("glm4", "glm4-warning")
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
    with caplog.at_level(logging.WARNING):
        ids = tok(rendered, add_special_tokens=False)["input_ids"]
        tok(rendered, add_special_tokens=False)
    warnings = [r for r in caplog.records if "split_special_tokens=False" in r.getMessage()]
    assert len(warnings) == 1
    assert tok.convert_tokens_to_ids("<|user|>") not in ids
    caplog.clear()
    parsed = tok(rendered, add_special_tokens=False, split_special_tokens=False)["input_ids"]
    assert parsed == tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    explicit = AutoTokenizer.from_pretrained(folder, trust_remote_code=True, split_special_tokens=True)
    with caplog.at_level(logging.WARNING):
        explicit(rendered)
    assert not [r for r in caplog.records if "split_special_tokens=False" in r.getMessage()]
