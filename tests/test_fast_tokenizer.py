"""The fast tokenizers written by tools/convert_tokenizer_to_fast.py (GLM-4 and ChatGLM3), against the slow
tokenizers, the originals' reference vectors, every vocabulary entry and the real text of the shared data; and the
converter's file discipline (atomic, never through a link, the old file kept and revertible).

The fast tokenizer is transformers' stock PreTrainedTokenizerFast: like the slow tokenizers it parses special-token
text by default and keeps it as text with `split_special_tokens=True`.
"""
import base64
import functools
import json
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings, strategies as st
from packaging.version import Version
from tokenizers import Tokenizer

import conftest
from tool_faults import FaultyDisk, dangling_links, folder_state, hub_cache, run_tool

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


# tokenizers before 0.20.1 (transformers 4.44) give a token that ignore_merges takes whole the empty span
# (start, start) (huggingface/tokenizers#1640); its ids are right.
WHOLE_TOKEN_SPANS = Version(tokenizers.__version__) >= Version("0.20.1")


def assert_glm4_offsets(got, expected, context):
    got = [tuple(span) for span in got]
    if WHOLE_TOKEN_SPANS:
        assert got == expected, context
    else:
        assert len(got) == len(expected), context
        assert all(span in (want, (want[0], want[0])) for span, want in zip(got, expected)), context


def test_fast_offsets(glm4_fast_tokenizer, glm4_records, token_bytes):
    fast = glm4_fast_tokenizer
    for record in of_kind(glm4_records, "encode"):
        text = record["text"]
        for split in (False, True):
            output = fast(text, add_special_tokens=True, return_offsets_mapping=True, split_special_tokens=split)
            ids = output["input_ids"]
            assert ids[:2] == PREFIX
            expected = [(0, 0), (0, 0)] + expected_offsets(text, ids[2:], token_bytes)
            assert_glm4_offsets(output["offset_mapping"], expected, record["id"])


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




@functools.lru_cache(maxsize=None)
def glm4_vocabulary() -> list:
    """Each rank's bytes as text (U+FFFD for bytes that are part of a character)."""
    lines = conftest.shared_path("tokenizers", "glm-4-9b-chat", "tokenizer.model").read_bytes().split()
    return [base64.b64decode(token).decode("utf-8", errors="replace") for token in lines[::2]]


# Uniform random characters alone almost never form a multi-byte vocabulary entry such as " 王", which is how the
# converted tokenizer once missed 893 of them: vocabulary entries are drawn too, spread over all ranks (Hypothesis
# favours small integers, the low ranks being single bytes).
TEXT = st.lists(
    st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=24), st.sampled_from(GLM4_SPECIALS),
              st.integers(0, 2**32).map(lambda number: glm4_vocabulary()[number % 151329])),
    max_size=5,
).map("".join)


@settings(max_examples=2000, deadline=None, derandomize=True, database=None)
@given(text=TEXT)
def test_fast_equals_slow_property(glm4_fast_tokenizer, glm4_tokenizer, text):
    fast, slow = glm4_fast_tokenizer, glm4_tokenizer
    as_text = fast.encode(text, split_special_tokens=True)
    assert as_text == slow.encode(text, split_special_tokens=True)
    parsed = fast.encode(text, add_special_tokens=False)
    assert parsed == slow.encode(text, add_special_tokens=False, split_special_tokens=False)
    assert fast.decode(parsed) == text and fast.decode(as_text, skip_special_tokens=True) == text


# ---------------------------------------------------------------------------------------------------------------------
# Every vocabulary entry, and the real text of the shared data
# ---------------------------------------------------------------------------------------------------------------------

def string_leaves(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from string_leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from string_leaves(item)


@pytest.fixture(scope="session")
def real_texts():
    """Every string of the shared data: the reference vectors' texts, chat messages, tools and renderings, the
    tokenizers' configs and chat templates, and the data's documentation."""
    shared = conftest.shared_path()
    texts = set()
    for path in sorted(shared.rglob("*.jsonl")) + sorted(shared.glob("tokenizers/*/*.json")):
        lines = path.read_text(encoding="utf-8").splitlines() if path.suffix == ".jsonl" else [path.read_text()]
        for line in lines:
            if line.strip():
                texts.update(string_leaves(json.loads(line)))
    texts.update(path.read_text(encoding="utf-8") for path in sorted(shared.rglob("*.md")))
    return sorted(texts - {""})


def text_backend(fast):
    """An independent copy of the fast tokenizer's Rust backend that keeps special-token text as text."""
    backend = Tokenizer.from_str(fast.backend_tokenizer.to_str())
    backend.encode_special_tokens = True
    return backend


def glm4_vocabulary_texts(token_bytes):
    """(rank, text) of every plain token whose bytes are whole UTF-8 text."""
    entries = []
    for rank in range(151329):
        try:
            entries.append((rank, token_bytes[rank].decode("utf-8")))
        except UnicodeDecodeError:
            continue  # part of a character: no text encodes to it alone
    return entries


# Every vocabulary entry: the matrix's ends (the versions between run the property and real-text tests).
@pytest.mark.matrix_ends
def test_glm4_every_vocabulary_entry_is_reachable_and_splits_as_tiktoken(glm4_fast_tokenizer, glm4_tokenizer,
                                                                         token_bytes, fast_converter):
    """tiktoken takes a pre-token that is in the vocabulary whole; merges alone cannot reach 893 entries (" 王",
    " 参考", " Rodríguez", ...). Each entry that is one pre-token must encode to itself, every other entry as
    tiktoken encodes it."""
    import regex

    entries = glm4_vocabulary_texts(token_bytes)
    fast = text_backend(glm4_fast_tokenizer).encode_batch([text for _, text in entries], add_special_tokens=False)
    pattern = regex.compile(fast_converter.GLM4_PAT_STR)
    whole = [pattern.findall(text) == [text] for _, text in entries]
    assert len(entries) > 150_000 and sum(whole) > 149_000
    unreachable = [rank for (rank, _), encoding, one in zip(entries, fast, whole) if one and encoding.ids != [rank]]
    assert not unreachable, [token_bytes[rank] for rank in unreachable[:10]]
    split = [(text, encoding.ids) for (_, text), encoding, one in zip(entries, fast, whole) if not one]
    expected = glm4_tokenizer.tokenizer.encode_ordinary_batch([text for text, _ in split])
    assert [ids for _, ids in split] == expected


@pytest.mark.matrix_ends
def test_glm4_every_vocabulary_entry_has_its_offsets(glm4_fast_tokenizer, token_bytes):
    entries = glm4_vocabulary_texts(token_bytes)
    fast = text_backend(glm4_fast_tokenizer).encode_batch([text for _, text in entries], add_special_tokens=False)
    for (rank, text), encoding in zip(entries, fast):
        assert_glm4_offsets(encoding.offsets, expected_offsets(text, encoding.ids, token_bytes), rank)


def holds_any(text, strings):
    return any(string in text for string in strings)


def test_glm4_fast_equals_slow_on_real_text(glm4_fast_tokenizer, glm4_tokenizer, real_texts, token_bytes):
    """Text mode against tiktoken (the slow tokenizer's encoder for plain text), with offsets; parse mode against the
    slow tokenizer itself wherever the text holds a special token's text (elsewhere the two modes are one)."""
    backend = text_backend(glm4_fast_tokenizer)
    expected = glm4_tokenizer.tokenizer.encode_ordinary_batch(real_texts)
    for text, ids, encoding in zip(real_texts, expected, backend.encode_batch(real_texts, add_special_tokens=False)):
        assert encoding.ids == ids, text[:80]
        assert_glm4_offsets(encoding.offsets, expected_offsets(text, ids, token_bytes), text[:80])
    backend.encode_special_tokens = False
    with_specials = [text for text in real_texts if holds_any(text, GLM4_SPECIALS)]
    assert len(with_specials) > 50
    for text, encoding in zip(with_specials, backend.encode_batch(with_specials, add_special_tokens=False)):
        assert encoding.ids == glm4_tokenizer.encode(text, add_special_tokens=False, split_special_tokens=False)


# ---------------------------------------------------------------------------------------------------------------------
# ChatGLM3
# ---------------------------------------------------------------------------------------------------------------------

# SentencePiece's own pieces: plain vocabulary entries in the fast tokenizer, their text kept as text in both modes,
# as in the slow tokenizer (and the original).
SENTENCEPIECE_SPECIALS = ("<unk>", "<s>", "</s>")
CHATGLM3_PREFIX = [64790, 64792]


def chatglm3_expected_offsets(text, ids, sp_model):
    """Character span of each token. SentencePiece encodes "▁" + text with spaces as "▁"; that "▁" in front counts
    as part of the first character, and a byte piece covers its whole character."""
    normalized = "▁" + text.replace(" ", "▁")

    def span(index):  # the original characters under normalized[index]
        return (max(index - 1, 0), max(index, 1))

    spans, position, bytes_done = [], 0, 0
    for index in ids:
        if sp_model.is_byte(index):
            spans.append(span(position))
            bytes_done += 1
            if bytes_done == len(normalized[position].encode("utf-8")):
                position, bytes_done = position + 1, 0
        else:
            length = len(sp_model.id_to_piece(index))
            spans.append((span(position)[0], span(position + length - 1)[1]))
            position += length
    assert position == len(normalized) or not text
    return spans


def chatglm3_vocabulary_texts(sp_model):
    return [(index, sp_model.id_to_piece(index).replace("▁", " ")) for index in range(sp_model.vocab_size())
            if not (sp_model.is_control(index) or sp_model.is_unknown(index) or sp_model.is_byte(index))]


@pytest.mark.matrix_ends
def test_chatglm3_every_vocabulary_entry_encodes_as_sentencepiece_does(chatglm3_fast_tokenizer, chatglm3_tokenizer):
    sp = chatglm3_tokenizer.tokenizer  # the slow tokenizer's SentencePiece model (the original's API name)
    entries = chatglm3_vocabulary_texts(sp.sp_model)
    assert len(entries) > 64_000
    texts = [text for _, text in entries]
    backend = text_backend(chatglm3_fast_tokenizer)
    fast = backend.encode_batch(texts, add_special_tokens=False)
    assert [encoding.ids for encoding in fast] == [sp.encode(text) for text in texts]
    for (index, text), encoding in zip(entries, fast):
        assert encoding.offsets == chatglm3_expected_offsets(text, encoding.ids, sp.sp_model), index
    # Special-token text parsed: the same as the slow tokenizer (entries such as " sop" hold a control token's text).
    backend.encode_special_tokens = False
    parsed = [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
    assert parsed == chatglm3_tokenizer(texts, add_special_tokens=False)["input_ids"]


def test_chatglm3_fast_matches_the_reference_vectors_and_the_slow_tokenizer(chatglm3_fast_tokenizer,
                                                                           chatglm3_tokenizer, chatglm3_records):
    fast, slow = chatglm3_fast_tokenizer, chatglm3_tokenizer
    for record in of_kind(chatglm3_records, "encode"):
        text = record["text"]
        # sp_encode_ids: the original's SentencePiece ids, what its build_chat_input used for plain text.
        assert fast.encode(text, add_special_tokens=False, split_special_tokens=True) == record["sp_encode_ids"]
        assert fast(text, split_special_tokens=True)["input_ids"] == CHATGLM3_PREFIX + record["sp_encode_ids"]
        assert fast.encode(text, add_special_tokens=False) == slow.encode(text, add_special_tokens=False), record["id"]
        assert fast.decode(record["sp_encode_ids"]) == slow.decode(record["sp_encode_ids"]) == text
        ids = slow.encode(text, split_special_tokens=True)
        assert fast.decode(ids, skip_special_tokens=True) == slow.decode(ids, skip_special_tokens=True) == text
    for record in of_kind(chatglm3_records, "batch"):
        side = "right" if record["padding_side"] == "right" else "left"
        outputs = []
        for tokenizer in (fast, slow):
            saved = tokenizer.padding_side, tokenizer.truncation_side
            tokenizer.padding_side = side  # transformers < 4.46 has no padding_side call argument
            tokenizer.truncation_side = record.get("truncation_side", tokenizer.truncation_side)
            try:
                outputs.append(tokenizer(record["texts"], split_special_tokens=True, **record["call_kwargs"]))
            finally:
                tokenizer.padding_side, tokenizer.truncation_side = saved
        got, want = outputs
        assert got["input_ids"] == want["input_ids"], record["id"]
        assert got.get("attention_mask") == want.get("attention_mask"), record["id"]
    for record in of_kind(chatglm3_records, "pair"):
        assert fast(record["text"], record["text_pair"], split_special_tokens=True)["input_ids"] == \
            slow(record["text"], record["text_pair"], split_special_tokens=True)["input_ids"]


def test_chatglm3_fast_equals_slow_on_real_text(chatglm3_fast_tokenizer, chatglm3_tokenizer, real_texts):
    """As for GLM-4: text mode against SentencePiece with offsets, parse mode against ChatGLMTokenizer."""
    sp = chatglm3_tokenizer.tokenizer
    backend = text_backend(chatglm3_fast_tokenizer)
    for text, encoding in zip(real_texts, backend.encode_batch(real_texts, add_special_tokens=False)):
        assert encoding.ids == sp.encode(text), text[:80]
        assert encoding.offsets == chatglm3_expected_offsets(text, encoding.ids, sp.sp_model), text[:80]
    backend.encode_special_tokens = False
    with_controls = [text for text in real_texts
                     if holds_any(text, chatglm3_tokenizer.CONTROL_TOKENS + SENTENCEPIECE_SPECIALS)]
    assert len(with_controls) > 50
    for text, encoding in zip(with_controls, backend.encode_batch(with_controls, add_special_tokens=False)):
        assert encoding.ids == chatglm3_tokenizer.encode(text, add_special_tokens=False), text[:80]


@pytest.mark.parametrize("text", ["eop The ratio was 3:1", "[sMASK]", "a [MASK] b", "<s>", "isopropyl sop",
                                  "<|system|>x<|observation|>", "a <unk> b", "a </s> b", "</s>"])
def test_chatglm3_fast_parses_the_slow_tokenizers_control_tokens_only(chatglm3_fast_tokenizer, chatglm3_tokenizer,
                                                                       text):
    """"[MASK]", "[sMASK]", "eop", "<unk>", "<s>" and "</s>" stay text, as in the slow tokenizer and the original
    ("a </s> b" was [260, 30910, 2, 265, 30931]); the control ids still decode to their text."""
    fast, slow = chatglm3_fast_tokenizer, chatglm3_tokenizer
    assert fast.encode(text, add_special_tokens=False) == slow.encode(text, add_special_tokens=False)
    assert fast.decode([64789, 64791, 64793]) == slow.decode([64789, 64791, 64793]) == "[MASK][sMASK]eop"


@pytest.mark.parametrize("skip", [False, True])
def test_chatglm3_fast_decodes_sentencepieces_own_pieces_as_the_slow_tokenizer(chatglm3_fast_tokenizer,
                                                                               chatglm3_tokenizer, skip):
    """"<unk>", "<s>" and "</s>" decode to nothing, as SentencePiece decodes them, whether or not special tokens are
    skipped; the unk, eos and pad tokens keep their ids."""
    fast, slow = chatglm3_fast_tokenizer, chatglm3_tokenizer
    assert (fast.unk_token_id, fast.eos_token_id, fast.pad_token_id) == (slow.unk_token_id, slow.eos_token_id,
                                                                         slow.pad_token_id) == (0, 2, 0)
    for ids in ([260, 0, 280], [260, 1, 280], [260, 2, 280], [2], [1, 260, 280, 2, 0]):
        assert fast.decode(ids, skip_special_tokens=skip) == slow.decode(ids, skip_special_tokens=skip), ids


# ---------------------------------------------------------------------------------------------------------------------
# Every vocabulary entry's spelling typed in text: fast == slow, in both special-token modes
# ---------------------------------------------------------------------------------------------------------------------

def chatglm3_spellings(slow) -> list:
    """Every SentencePiece piece as written ("▁the", "<0x0A>", "</s>") and as the text it stands for (" the"), and the
    9 control tokens."""
    sp_model = slow.tokenizer.sp_model
    pieces = [sp_model.id_to_piece(index) for index in range(sp_model.vocab_size())]
    return sorted(set(pieces) | {piece.replace("▁", " ") for piece in pieces} | set(slow.CONTROL_TOKENS))


def glm4_spellings(token_bytes) -> list:
    """Every rank's bytes as text (U+FFFD for bytes that are part of a character), and the 14 special tokens."""
    return sorted({data.decode("utf-8", errors="replace") for data in token_bytes.values()} | set(GLM4_SPECIALS))


def spelling_mismatches(fast, slow, texts, **kwargs) -> list:
    got = fast(texts, **kwargs)["input_ids"]
    want = slow(texts, **kwargs)["input_ids"]
    return [(text, fast_ids, slow_ids) for text, fast_ids, slow_ids in zip(texts, got, want) if fast_ids != slow_ids]


# Over 85,000 slow encodes per family and mode: the matrix's ends; the versions between run the property test.
@pytest.mark.matrix_ends
@pytest.mark.parametrize("family", ["chatglm3", "glm4"])
@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_fast_equals_slow_on_every_spelling_typed_in_text(family, split_special_tokens, request):
    """Each vocabulary entry's and special token's spelling in "a {spelling} b", encoded in one batch per mode:
    parsed (split_special_tokens=False) and as text, each with and without the [gMASK] <sop> prefix. ChatGLM3's
    fast tokenizer used to parse "<unk>" and "</s>" typed in text (ids 0 and 2), which the slow one keeps as text."""
    fast = request.getfixturevalue(f"{family}_fast_tokenizer")
    slow = request.getfixturevalue(f"{family}_tokenizer")
    spellings = chatglm3_spellings(slow) if family == "chatglm3" else glm4_spellings(
        request.getfixturevalue("token_bytes"))
    assert len(spellings) > (85_000 if family == "chatglm3" else 150_000)
    texts = [f"a {spelling} b" for spelling in spellings]
    for add_special_tokens in (False, True):
        bad = spelling_mismatches(fast, slow, texts, add_special_tokens=add_special_tokens,
                                  split_special_tokens=split_special_tokens)
        assert not bad, f"{len(bad)} of {len(texts)} texts (add_special_tokens={add_special_tokens}) differ, " \
                        f"as (text, fast, slow): {bad[:5]}"


# ---------------------------------------------------------------------------------------------------------------------
# The converter writes like the installer: atomically, never through a link, the old file kept and revertible
# ---------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def quick_converter(fast_converter, monkeypatch):
    """The converter, building each tokenizer.model's tokenizer once: these tests are about how the file is
    written, and a ChatGLM3 build takes seconds."""
    built = {}
    build = fast_converter.build_fast_tokenizer

    def cached(model_path):
        key = Path(model_path).read_bytes()
        if key not in built:
            built[key] = build(model_path)
        return built[key]

    monkeypatch.setattr(fast_converter, "build_fast_tokenizer", cached)
    return fast_converter


def chatglm3_files():
    source = conftest.shared_path("tokenizers", "chatglm3-6b")
    files = {path.name: path.read_bytes() for path in source.iterdir()}
    files["tokenizer.json"] = b'{"an": "older tokenizer.json from the hub"}'
    return files


# How the converter writes (links, a full disk, its former name) is its own code: the matrix's ends.
@pytest.mark.matrix_ends
def test_converter_in_a_hub_cache_snapshot_replaces_the_link_keeps_the_blob_and_reverts(quick_converter, tmp_path):
    fast_converter = quick_converter
    import install_into_checkpoint
    from chatglm_tools.folder_transaction import ORIGINALS

    layout = hub_cache(tmp_path, chatglm3_files(), repo_id="THUDM/chatglm3-6b")
    cache, snapshot = layout["cache"], layout["a"]
    start, blobs, other_revision = folder_state(cache), folder_state(cache / "blobs"), folder_state(layout["b"])

    code, out, err = run_tool(fast_converter.main, [snapshot])
    assert code == 0, err
    written = snapshot / "tokenizer.json"
    assert not written.is_symlink() and json.loads(written.read_text())["model"]["type"] == "BPE"
    assert (snapshot / ORIGINALS / "tokenizer.json").read_bytes() == chatglm3_files()["tokenizer.json"]
    assert folder_state(cache / "blobs") == blobs and folder_state(layout["b"]) == other_revision
    assert not dangling_links(cache)
    converted = folder_state(cache)
    code, out, err = run_tool(fast_converter.main, [snapshot])
    assert code == 0 and "nothing changed" in out and folder_state(cache) == converted

    code, out, err = run_tool(fast_converter.main, [snapshot, "--revert"])
    assert code == 0, err
    assert folder_state(cache) == start
    # The installer's --revert undoes the converter's file too: they share the folder's manifest.
    assert run_tool(fast_converter.main, [snapshot])[0] == 0
    code, out, err = run_tool(install_into_checkpoint.main, [snapshot, "--revert"])
    assert code == 0 and "tokenizer.json: restored as the link to ../../blobs/" in out, out + err
    assert folder_state(cache) == start


@pytest.mark.matrix_ends
def test_converter_leaves_the_folder_as_it_was_when_the_disk_fills_up(quick_converter, tmp_path):
    fast_converter = quick_converter
    folder = tmp_path / "chatglm3"
    folder.mkdir()
    for name, data in chatglm3_files().items():
        (folder / name).write_bytes(data)
    before = folder_state(folder)
    for budget in (0, 1 << 20):
        code, out, err = run_tool(fast_converter.main, [folder], FaultyDisk(space=budget))
        assert code == 1 and "the disk is full" in err and "Traceback" not in out + err, err
        assert folder_state(folder) == before


def test_converter_refuses_a_file_that_is_no_tokenizer_model(fast_converter, tmp_path):
    bad = tmp_path / "tokenizer.model"
    bad.write_text("<html>rate limited</html>\n")
    code, out, err = run_tool(fast_converter.main, [bad, "-o", tmp_path / "tokenizer.json"])
    assert code == 2 and str(bad) in err and "SentencePiece" in err and "Traceback" not in err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tokenizer.model"]


def test_converter_refuses_a_chatglm2_checkpoint_naming_it(fast_converter, tmp_path):
    """chatglm2-6b ships chatglm3-6b's tokenizer.model, but not its tokens: ChatGLM3's tokenizer.json would parse role
    tokens and special text ChatGLM2 keeps as text. The converter says so and writes nothing."""
    from tokenizer_fixtures import make_chatglm2_folder

    folder = make_chatglm2_folder(tmp_path / "chatglm2-6b")
    before = folder_state(folder)
    code, out, err = run_tool(fast_converter.main, [folder])
    assert code == 2 and "ChatGLM2" in err and "THUDM/chatglm2-6b" in err and "Traceback" not in out + err, err
    assert folder_state(folder) == before


def test_tokenizer_json_merges_are_readable_by_every_supported_tokenizers_release(fast_converter, tmp_path):
    """tokenizers 0.20+ writes merges as pairs, which tokenizers 0.19 (transformers 4.44) cannot parse; the converter
    writes the "left right" strings that all releases read, and they load back to the same tokenizer."""
    model = conftest.shared_path("tokenizers", "chatglm3-6b", "tokenizer.model")
    tokenizer = fast_converter.build_fast_tokenizer(model)
    content = json.loads(fast_converter.tokenizer_json(tokenizer))
    assert all(isinstance(merge, str) and merge.count(" ") == 1 for merge in content["model"]["merges"])
    reloaded = Tokenizer.from_str(json.dumps(content))
    text = "ChatGLM3 的分词器 isopropyl sop\n  x"
    assert reloaded.encode(text).ids == tokenizer.encode(text).ids


@pytest.mark.matrix_ends
def test_the_converter_under_its_former_name_runs_as_a_user_runs_it(quick_converter, tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "chatglm3"
    folder.mkdir()
    for path in conftest.shared_path("tokenizers", "chatglm3-6b").iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    script = conftest.REPO / "tools" / "convert_glm4_tokenizer_to_fast.py"
    result = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "--revert" in result.stdout, result.stderr[-2000:]
    model = folder / "tokenizer.model"
    expected = quick_converter.tokenizer_json(quick_converter.build_fast_tokenizer(model))
    assert (folder / "tokenizer.json").read_bytes() == expected
