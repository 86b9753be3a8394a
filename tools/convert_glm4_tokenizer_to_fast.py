#!/usr/bin/env python
"""Convert GLM-4's tiktoken `tokenizer.model` into a `tokenizer.json` for transformers' PreTrainedTokenizerFast.

    python tools/convert_glm4_tokenizer_to_fast.py /path/to/glm-4-9b-chat            # writes tokenizer.json there
    python tools/convert_glm4_tokenizer_to_fast.py /path/to/tokenizer.model -o out/tokenizer.json

The result is a byte-level BPE with the same ids as the tiktoken encoder:

* vocabulary: each rank's bytes, written in the GPT-2 byte-to-unicode alphabet that byte-level BPE files use;
* merges: every way of splitting a token into two tokens, ordered by the rank of the merged token (then by the ranks
  of the halves), which reproduces tiktoken's "merge the adjacent pair with the lowest-ranked result" loop;
* pre-tokenizer: GLM-4's regex (isolated splits), then the byte-level mapping without its own regex;
* the 14 special tokens at 151329..151342, and a post-processor adding `[gMASK] <sop>` (pairs: `... A B
  <|endoftext|>`), as the slow tokenizer does with add_special_tokens=True.

Load it with `PreTrainedTokenizerFast.from_pretrained(folder)` (the folder's tokenizer_config.json supplies eos/pad,
padding side and chat template). Like every transformers fast tokenizer it parses special-token text unless called
with `split_special_tokens=True`, and it returns no `position_ids`; the slow `ChatGLM4Tokenizer` remains the
reference (see tokenization_chatglm.py, which this tool takes GLM-4's regex and special tokens from).
"""
import argparse
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenization_chatglm import GLM4_PAT_STR, ChatGLM4Tokenizer, read_tiktoken_ranks  # noqa: E402


def byte_to_unicode() -> Dict[int, str]:
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


def vocab_and_merges(ranks: Dict[bytes, int]) -> Tuple[Dict[str, int], List[Tuple[str, str]]]:
    alphabet = byte_to_unicode()

    def as_text(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        splits = [(left, right) for left, right in splits if left in ranks and right in ranks]
        splits.sort(key=lambda pair: (ranks[pair[0]], ranks[pair[1]]))
        merges.extend((rank, left, right) for left, right in splits)
    merges.sort(key=lambda merge: merge[0])  # stable: keeps the per-token order
    return vocab, [(as_text(left), as_text(right)) for _, left, right in merges]


def build_fast_tokenizer(model_path: Path) -> Tokenizer:
    ranks = read_tiktoken_ranks(str(model_path))
    vocab, merges = vocab_and_merges(ranks)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    specials = ChatGLM4Tokenizer.CONTROL_TOKENS
    # Added in order, so they take ids len(ranks) + 0..13.
    tokenizer.add_special_tokens([
        AddedToken(token, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
        for token in specials
    ])
    ids = {token: tokenizer.token_to_id(token) for token in specials}
    assert ids == {token: len(ranks) + index for index, token in enumerate(specials)}
    prefix, eos = ChatGLM4Tokenizer.PREFIX_TOKENS, ChatGLM4Tokenizer.EOS_TOKEN
    tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(prefix) + " $A",
        pair=" ".join(prefix) + f" $A $B {eos}",
        special_tokens=[(token, ids[token]) for token in (*prefix, eos)],
    )
    return tokenizer


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="GLM-4 checkpoint folder or its tokenizer.model")
    parser.add_argument("-o", "--output", type=Path, help="where to write (default: tokenizer.json next to the model)")
    args = parser.parse_args(argv)
    model_path = args.source / "tokenizer.model" if args.source.is_dir() else args.source
    if not model_path.is_file():
        raise SystemExit(f"{model_path} not found: expected GLM-4's tiktoken tokenizer.model")
    try:
        tokenizer = build_fast_tokenizer(model_path)
    except ValueError as err:  # a damaged or foreign tokenizer.model; the message names the file
        raise SystemExit(str(err)) from None
    output = args.output or model_path.with_name("tokenizer.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output))
    print(f"wrote {output}")
    return output


if __name__ == "__main__":
    main()
