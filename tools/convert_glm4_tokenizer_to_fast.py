#!/usr/bin/env python
"""The fast-tokenizer converter under its first name, kept for existing scripts and links: the converter is
tools/convert_tokenizer_to_fast.py, which converts ChatGLM3's tokenizer.model too. Same arguments, same result."""
import sys

from convert_tokenizer_to_fast import build_fast_tokenizer, main, tokenizer_json  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
