#!/usr/bin/env python
"""Batch-encode throughput of the GLM-4 and ChatGLM3 tokenizers, all measured in this one process.

    python benchmarks/tokenizer_throughput.py [--family glm4|chatglm3|both] [--seconds 2] [--batch-size 32]

Compares, on the plain-text reference texts of testdata/tokvec (in batches, padded):

* baseline -- GLM-4 only: the original tokenizer's approach, reimplemented here: tiktoken's ids turned into byte
  tokens one by one, then back into ids one by one through transformers' added-token lookup (which rebuilds its
  table for every token), inside the same transformers batch pipeline;
* slow     -- our ChatGLM4Tokenizer / ChatGLMTokenizer (tokenization_chatglm.py);
* fast     -- PreTrainedTokenizerFast on the tokenizer.json written by tools/convert_tokenizer_to_fast.py;
* rust     -- that tokenizer.json in the `tokenizers` library alone (encode_batch, no padding), as a Rust server
  uses it.

All of a family's tokenizers must produce the same input_ids before anything is timed. Prints texts/s, tokens/s and
the ratios to the slow tokenizer (and to the baseline). Reads the repository's testdata/ (or CHATGLM_SHARED_DIR).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from chatglm_tools import SHARED  # noqa: E402

FAMILIES = {"glm4": "glm-4-9b-chat", "chatglm3": "chatglm3-6b"}


def prepare_folder(workdir: Path, family: str) -> Path:
    folder = workdir / f"{family}-benchmark"
    folder.mkdir()
    for item in (SHARED / "tokenizers" / FAMILIES[family]).iterdir():
        shutil.copyfile(item, folder / item.name)
    shutil.copyfile(REPO / "tokenization_chatglm.py", folder / "tokenization_chatglm.py")
    import convert_tokenizer_to_fast

    tokenizer = convert_tokenizer_to_fast.build_fast_tokenizer(folder / "tokenizer.model")
    (folder / "tokenizer.json").write_bytes(convert_tokenizer_to_fast.tokenizer_json(tokenizer))
    return folder


def load_texts(family: str, control_tokens) -> list:
    path = SHARED / "tokvec" / f"{family}.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    # Plain text only, so that every tokenizer agrees without special-token options.
    return [r["text"] for r in records
            if r["kind"] == "encode" and not any(token in r["text"] for token in (*control_tokens, "<s>", "</s>"))]


def baseline_class(slow_class):
    """The original's encode path on top of our class (same transformers pipeline, same padding)."""

    class OriginalApproach(slow_class):
        def tokenize(self, text, **kwargs):
            return [self.tokenizer.decode_single_token_bytes(i) for i in self.tokenizer.encode(text, disallowed_special=())]

        def convert_tokens_to_ids(self, tokens):
            if isinstance(tokens, (str, bytes)):
                return self._original_token_to_id(tokens)
            return [self._original_token_to_id(token) for token in tokens]

        def _original_token_to_id(self, token):
            # transformers 4.x: `added_tokens_encoder` is a property that sorts and rebuilds a dict on every call.
            added = {t.content: i for i, t in sorted(self._added_tokens_decoder.items(), key=lambda item: item[0])}
            if token in added:
                return added[token]
            return self.mergeable_ranks[token]

    return OriginalApproach


def texts_per_second(encode, batches, seconds: float) -> float:
    texts = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for batch in batches:
            encode(batch)
            texts += len(batch)
    return texts / (time.perf_counter() - start)


def benchmark(family: str, workdir: Path, args) -> None:
    import transformers
    from transformers import AutoTokenizer

    folder = prepare_folder(workdir, family)
    slow = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    import convert_tokenizer_to_fast

    fast = convert_tokenizer_to_fast.load_fast_tokenizer(folder)  # as docs/tokenizers.md loads it
    runs = {}
    if family == "glm4":
        baseline = baseline_class(type(slow)).from_pretrained(str(folder))
        runs["baseline"] = lambda batch: baseline(batch, padding=True)["input_ids"]
    runs["slow"] = lambda batch: slow(batch, padding=True)["input_ids"]
    runs["fast"] = lambda batch: fast(batch, padding=True)["input_ids"]
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    runs["rust"] = lambda batch: [encoding.ids for encoding in backend.encode_batch(batch)]

    texts = load_texts(family, type(slow).CONTROL_TOKENS)
    batches = [texts[i:i + args.batch_size] for i in range(0, len(texts), args.batch_size)]
    padded = [runs["slow"](batch) for batch in batches]
    unpadded = [slow(batch)["input_ids"] for batch in batches]
    for name, run in runs.items():
        if [run(batch) for batch in batches] != (unpadded if name == "rust" else padded):
            raise SystemExit(f"{family}: {name} gives different input_ids than the slow tokenizer")

    tokens_per_text = sum(len(slow.encode(text)) for text in texts) / len(texts)  # padding not counted
    print(f"\n{family} ({FAMILIES[family]}): transformers {transformers.__version__}; {len(texts)} texts "
          f"({tokens_per_text:.0f} tokens on average), batches of {args.batch_size}, {args.seconds:.1f} s each, "
          f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}")
    results = {name: texts_per_second(run, batches, args.seconds) for name, run in runs.items()}
    print(f"{'tokenizer':<10}{'texts/s':>12}{'tokens/s':>14}{'vs slow':>10}" + (
        f"{'vs baseline':>14}" if "baseline" in results else ""))
    for name, rate in results.items():
        row = f"{name:<10}{rate:>12,.0f}{rate * tokens_per_text:>14,.0f}{rate / results['slow']:>9.2f}x"
        if "baseline" in results:
            row += f"{rate / results['baseline']:>13.2f}x"
        print(row)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("glm4", "chatglm3", "both"), default="both")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per tokenizer")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="glm-tokenizer-bench-") as workdir:
        os.environ["HF_MODULES_CACHE"] = str(Path(workdir) / "modules")
        import transformers

        transformers.logging.set_verbosity_error()  # the fast load warns that the config names the slow class
        for family in (("glm4", "chatglm3") if args.family == "both" else (args.family,)):
            benchmark(family, Path(workdir), args)


if __name__ == "__main__":
    main()
