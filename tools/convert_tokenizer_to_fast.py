#!/usr/bin/env python
"""Write a `tokenizer.json` for a GLM-4 or ChatGLM3 checkpoint: a fast (Rust) tokenizer with the slow tokenizer's ids.

    python tools/convert_tokenizer_to_fast.py /path/to/glm-4-9b-chat            # or /path/to/chatglm3-6b
    python tools/convert_tokenizer_to_fast.py /path/to/tokenizer.model -o out/tokenizer.json
    python tools/convert_tokenizer_to_fast.py /path/to/glm-4-9b-chat --revert   # put back what was there before

The family is told by the `tokenizer.model` itself (tiktoken text for GLM-4, a SentencePiece model for ChatGLM3).

GLM-4: a byte-level BPE with tiktoken's ids. The vocabulary is each rank's bytes in the GPT-2 byte alphabet; the
merges are every split of a token into two tokens, ordered by the rank of the result (then of the halves), which is
tiktoken's "merge the adjacent pair with the lowest-ranked result"; and, like tiktoken, a pre-token that is itself in
the vocabulary is taken whole before any merge (`ignore_merges`): without it 893 vocabulary entries such as " 王"
could not be produced. GLM-4's regex splits first; 14 special tokens at 151329..151342.

ChatGLM3: SentencePiece's BPE over the whole text (no pre-tokenizer): a "▁" in front and every space as "▁", merges
ordered by piece score, bytes for characters outside the vocabulary; 9 control tokens at 64789..64797, of which the
text of "[gMASK]", "sop" (as a whole word) and the four role tokens is parsed, as ChatGLMTokenizer parses it;
"[MASK]", "[sMASK]" and "eop" are vocabulary entries that text never produces. SentencePiece's own pieces "<unk>",
"<s>" and "</s>" are plain vocabulary entries too, so that their text stays text as in the slow tokenizer (and the
original), and they decode to nothing, as SentencePiece decodes them. transformers registers a fast tokenizer's
unk, eos and pad tokens as added tokens when they are set while it loads, and a Rust tokenizer matches every added
token in text: load the file with them set afterwards (docs/tokenizers.md, "Fast tokenizers";
`load_fast_tokenizer`).

Both add the `[gMASK] <sop>` prefix (ChatGLM3: `[gMASK] sop`) with add_special_tokens=True, and pairs end with the eos
token. The merges are written in the format every tokenizers release reads (0.19, transformers 4.44, and up).

The file is written as install_into_checkpoint.py writes (chatglm_tools/folder_transaction.py): atomically, never
through a link (in a Hugging Face cache snapshot the link is replaced, the blob is untouched), an existing
tokenizer.json kept in `chatglm_fork_originals/` and recorded in the folder's manifest, so `--revert` here or in
install_into_checkpoint.py puts it back. Exit codes: 0 done, 1 failed with the folder unchanged, 2 refused.
"""
import argparse
import json
import re
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from chatglm_tools import repository_module
from chatglm_tools.folder_transaction import (
    REPO, Refused, check_target_folder, command, exit_code, finish_interrupted_run, folder_lock, plan_update,
    read_manifest, report, run_plan,
)

_tokenization = repository_module("tokenization_chatglm")
CHATGLM3_N_PIECES, GLM4_PAT_STR = _tokenization.CHATGLM3_N_PIECES, _tokenization.GLM4_PAT_STR
ChatGLM4Tokenizer, ChatGLMTokenizer = _tokenization.ChatGLM4Tokenizer, _tokenization.ChatGLMTokenizer
read_tiktoken_ranks = _tokenization.read_tiktoken_ranks

TOOL = "convert_tokenizer_to_fast.py"
FAMILY_NAMES = {"glm4": "GLM-4", "chatglm3": "ChatGLM3"}
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+=* \d+\r?\n")


# ---------------------------------------------------------------------------------------------------------------------
# GLM-4
# ---------------------------------------------------------------------------------------------------------------------

def byte_to_unicode() -> dict:
    """The GPT-2 byte-level alphabet: printable bytes map to themselves, the others to code points from 256 up."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(
        range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def merges_by_result(vocab: dict, mergeable) -> list:
    """Every split of a token into two tokens, ordered by the result's id, then the halves' ids: for BPE whose ids
    follow the merge order (tiktoken ranks, SentencePiece BPE scores), the lowest merge is the one these apply."""
    merges = []
    for token, index in vocab.items():
        if not mergeable(index):
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab and mergeable(vocab[left]) and mergeable(vocab[right]):
                merges.append((index, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def glm4_tokenizer(model_path: Path) -> Tokenizer:
    ranks = read_tiktoken_ranks(str(model_path))
    alphabet = byte_to_unicode()
    vocab = {"".join(alphabet[byte] for byte in token): rank for token, rank in ranks.items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges_by_result(vocab, lambda index: True),
                                     fuse_unk=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return with_control_tokens(tokenizer, ChatGLM4Tokenizer, first_id=len(ranks))


# ---------------------------------------------------------------------------------------------------------------------
# ChatGLM3
# ---------------------------------------------------------------------------------------------------------------------

def chatglm3_tokenizer(model_path: Path) -> Tokenizer:
    import sentencepiece

    expected = f"expected ChatGLM3's SentencePiece model ({CHATGLM3_N_PIECES} pieces) or GLM-4's tiktoken file"
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(str(model_path))
    except (OSError, RuntimeError) as error:
        raise ValueError(f"{model_path}: neither a tiktoken file nor a SentencePiece model ({error}); "
                         f"{expected}") from None
    if sp.vocab_size() != CHATGLM3_N_PIECES:
        raise ValueError(f"{model_path}: a SentencePiece model of {sp.vocab_size()} pieces; {expected}")
    # What the normalizer below reproduces: a "▁" in front, spaces kept (not collapsed) and written as "▁".
    if sp.normalize(" a  b") != "▁▁a▁▁b":
        raise ValueError(f"{model_path}: its normalizer is not ChatGLM3's; {expected}")
    vocab = {sp.id_to_piece(index): index for index in range(sp.vocab_size())}

    def mergeable(index: int) -> bool:
        return not (sp.is_control(index) or sp.is_unknown(index) or sp.is_byte(index) or sp.is_unused(index))

    merges = merges_by_result(vocab, mergeable)
    # The control tokens whose text stays text ("[MASK]", "[sMASK]", "eop") must not be added tokens, which a fast
    # tokenizer always matches in text: all nine go into the model's vocabulary at their ids (no merge builds them,
    # so text never produces them), and the parsed ones are then added on top of those ids.
    vocab.update({token: sp.vocab_size() + index for index, token in enumerate(ChatGLMTokenizer.CONTROL_TOKENS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # "<unk>", "<s>" and "</s>" are no added tokens: an added token's text is parsed wherever it is typed, and the
    # slow tokenizer keeps their text as text. SentencePiece decodes them to nothing, with or without
    # skip_special_tokens; no other piece holds their text, so the replacements touch only them.
    sentencepiece_pieces = [sp.id_to_piece(index) for index in range(sp.vocab_size())
                            if sp.is_control(index) or sp.is_unknown(index)]
    tokenizer.decoder = decoders.Sequence([*(decoders.Replace(piece, "") for piece in sentencepiece_pieces),
                                           decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return with_control_tokens(tokenizer, ChatGLMTokenizer, first_id=sp.vocab_size())


# ---------------------------------------------------------------------------------------------------------------------
# Shared: control tokens, the prefix, the file
# ---------------------------------------------------------------------------------------------------------------------

def with_control_tokens(tokenizer: Tokenizer, slow_class, first_id: int) -> Tokenizer:
    """The slow tokenizer's control tokens, in its id order, and its prefix / pair template."""
    whole_word = set(getattr(slow_class, "WHOLE_WORD_CONTROL_TOKENS", ()))
    parsed = getattr(slow_class, "PARSED_CONTROL_TOKENS", None) or slow_class.CONTROL_TOKENS
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False, lstrip=False, rstrip=False, single_word=token in whole_word)
        for token in slow_class.CONTROL_TOKENS if token in parsed
    ])
    ids = {token: tokenizer.token_to_id(token) for token in slow_class.CONTROL_TOKENS}
    assert ids == {token: first_id + index for index, token in enumerate(slow_class.CONTROL_TOKENS)}, ids
    prefix, eos = " ".join(slow_class.PREFIX_TOKENS), slow_class.EOS_TOKEN
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{prefix} $A", pair=f"{prefix} $A $B {eos}",
        special_tokens=[(token, tokenizer.token_to_id(token)) for token in (*slow_class.PREFIX_TOKENS, eos)],
    )
    return tokenizer


def family_of(model_path: Path) -> str:
    with open(model_path, "rb") as handle:
        first_line = handle.readline(200)
    return "glm4" if _TIKTOKEN_LINE.fullmatch(first_line) else "chatglm3"


def build_fast_tokenizer(model_path) -> Tokenizer:
    """The fast tokenizer of a GLM-4 or ChatGLM3 tokenizer.model (ValueError naming the file if it is neither)."""
    model_path = Path(model_path)
    if family_of(model_path) == "glm4":
        return glm4_tokenizer(model_path)
    # chatglm2-6b ships the same tokenizer.model; the files beside it tell (tokenization_chatglm.chatglm_family_of).
    family, evidence = _tokenization.chatglm_family_of(str(model_path))
    if family == "chatglm2":
        raise ValueError(f"{model_path}: a ChatGLM2 checkpoint ({evidence}); this converter writes ChatGLM3's fast "
                         "tokenizer, which encodes ChatGLM2's text differently (role tokens, parsed special "
                         "text): ChatGLM2 has no fast tokenizer here yet, use its slow tokenizer (tools/export_to_native_glm.py "
                         "exports the model alone with --without-tokenizer)")
    return chatglm3_tokenizer(model_path)


def load_fast_tokenizer(folder):
    """A converted folder as transformers' PreTrainedTokenizerFast, loaded as docs/tokenizers.md shows. ChatGLM3: its
    tokenizer_config.json lists four control tokens as plain, normalized tokens (`added_tokens_decoder={}` keeps
    tokenizer.json's flags), and its unk, eos and pad tokens are set after loading: named while loading, they become
    added tokens, whose text is parsed wherever it is typed (the slow tokenizer keeps it as text)."""
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    if family_of(folder / "tokenizer.model") == "glm4":
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder), added_tokens_decoder={}, unk_token=None,
                                                        eos_token=None, pad_token=None)
    tokenizer.unk_token, tokenizer.eos_token, tokenizer.pad_token = "<unk>", ChatGLMTokenizer.EOS_TOKEN, "<unk>"
    return tokenizer


def tokenizer_json(tokenizer: Tokenizer) -> bytes:
    """tokenizer.json as every supported tokenizers release reads it: tokenizers 0.20 and later write each merge as
    a pair, which 0.19 (transformers 4.44) cannot read; "left right" strings are read by all, given no token holds
    a space (none does: byte-level and SentencePiece spell it "Ġ" / "▁")."""
    content = json.loads(tokenizer.to_str())
    merges = content["model"].get("merges", [])
    if merges and not isinstance(merges[0], str) and not any(" " in part for merge in merges for part in merge):
        content["model"]["merges"] = [" ".join(merge) for merge in merges]
    return json.dumps(content, ensure_ascii=False).encode("utf-8")


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------

def convert(model_path: Path, output: Path, force: bool) -> int:
    folder = output.parent
    try:
        family = family_of(model_path)
        data = tokenizer_json(build_fast_tokenizer(model_path))
    except ValueError as error:  # a damaged or foreign tokenizer.model; the message names the file
        raise Refused(str(error)) from None
    folder.mkdir(parents=True, exist_ok=True)
    check_target_folder(folder)
    with folder_lock(folder):
        finish_interrupted_run(folder)
        plan = plan_update(folder, {output.name: data}, [], TOOL, force)
        if not plan.changes:
            print(f"{output} is already this conversion of {model_path}; nothing changed.")
            return 0
        warning = run_plan(folder, "tokenizer conversion", plan)
    report(f"wrote the {FAMILY_NAMES[family]} fast tokenizer to {output}", plan.lines, warning)
    print(f"undo with: {command(__file__, model_path, '-o', output, '--revert')}")
    return 0


def revert(output: Path, force: bool) -> int:
    folder = output.parent
    check_target_folder(folder)
    with folder_lock(folder):
        finish_interrupted_run(folder)
        record = read_manifest(folder)["files"].get(output.name)
        if record is None or record["tool"] != TOOL:
            print(f"nothing to revert: the manifest of {folder} records no {output.name} written by this tool.")
            return 0
        plan = plan_update(folder, {}, [output.name], TOOL, force)
        warning = run_plan(folder, "tokenizer revert", plan)
    report(f"reverted {output}", plan.lines, warning)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="GLM-4 or ChatGLM3 checkpoint folder, or its tokenizer.model")
    parser.add_argument("-o", "--output", type=Path, help="where to write (default: tokenizer.json next to the model)")
    parser.add_argument("--revert", action="store_true", help="put back what was there before this tool wrote it")
    parser.add_argument("--force", action="store_true", help="also replace a tokenizer.json changed by hand since")
    args = parser.parse_args(argv)
    model_path = args.source / "tokenizer.model" if args.source.is_dir() else args.source
    output = args.output or model_path.with_name("tokenizer.json")

    def run() -> int:
        if args.revert:
            return revert(output, args.force)
        if not model_path.is_file():
            raise Refused(f"{model_path} not found: expected GLM-4's or ChatGLM3's tokenizer.model")
        return convert(model_path, output, args.force)

    return exit_code(run)


if __name__ == "__main__":
    sys.exit(main())
