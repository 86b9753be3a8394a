"""Tokenizer fixtures: checkpoint-like folders built from the shared tokenizer files plus our tokenization_chatglm.py.

conftest.py imports everything here (`from tokenizer_fixtures import *`); this module imports nothing of conftest.py
(the shared paths come from tools/chatglm_tools).
"""
import importlib
import json
import shutil
from pathlib import Path

import pytest

from chatglm_tools import copy_code_into, shared_path

__all__ = [
    "load_jsonl",
    "make_tokenizer_folder",
    "load_tokenizer",
    "glm4_records",
    "chatglm3_records",
    "glm4_variant_records",
    "glm4_tokenizer",
    "chatglm3_tokenizer",
    "tokenizer_folder_factory",
    "fast_converter",
    "glm4_fast_tokenizer",
    "chatglm3_fast_tokenizer",
]

# family -> folder under shared/tokenizers
TOKENIZER_DIRS = {"glm4": "glm-4-9b-chat", "chatglm3": "chatglm3-6b"}


def load_jsonl(*parts) -> list:
    """Records of a shared JSON-lines file (a missing file is an error, not a skip)."""
    path = shared_path(*parts)
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def make_tokenizer_folder(folder: Path, family: str, config_changes=None, drop_config_keys=()) -> Path:
    """A checkpoint folder with the shared tokenizer files of `family` and our code files.

    `config_changes` / `drop_config_keys` edit the copied tokenizer_config.json (for variants and bad-input tests).
    """
    source = shared_path("tokenizers", TOKENIZER_DIRS[family])
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        shutil.copyfile(item, folder / item.name)
    if config_changes or drop_config_keys:
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        for key in drop_config_keys:
            config.pop(key, None)
        config.update(config_changes or {})
        config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    return copy_code_into(folder)


def load_tokenizer(folder: Path, **kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True, **kwargs)


@pytest.fixture(scope="session")
def glm4_records():
    return load_jsonl("tokvec", "glm4.jsonl")


@pytest.fixture(scope="session")
def chatglm3_records():
    return load_jsonl("tokvec", "chatglm3.jsonl")


@pytest.fixture(scope="session")
def glm4_variant_records():
    return load_jsonl("tokvec", "glm4_variants.jsonl")


@pytest.fixture(scope="session")
def tokenizer_folder_factory(tmp_path_factory):
    """make(family, name, **edits) -> a fresh, uniquely named checkpoint folder."""

    def make(family: str, name: str, **edits) -> Path:
        return make_tokenizer_folder(tmp_path_factory.mktemp(name), family, **edits)

    return make


@pytest.fixture(scope="session")
def glm4_tokenizer(tokenizer_folder_factory):
    return load_tokenizer(tokenizer_folder_factory("glm4", "glm4-tokenizer"))


@pytest.fixture(scope="session")
def chatglm3_tokenizer(tokenizer_folder_factory):
    return load_tokenizer(tokenizer_folder_factory("chatglm3", "chatglm3-tokenizer"))


@pytest.fixture(scope="session")
def fast_converter():
    """tools/convert_tokenizer_to_fast.py as a module (conftest puts tools/ on sys.path)."""
    return importlib.import_module("convert_tokenizer_to_fast")


@pytest.fixture(scope="session")
def glm4_fast_tokenizer(tokenizer_folder_factory, fast_converter):
    """glm-4-9b-chat folder + the converter's tokenizer.json, loaded as transformers' PreTrainedTokenizerFast."""
    folder = tokenizer_folder_factory("glm4", "glm4-fast")
    assert fast_converter.main([str(folder)]) == 0
    return fast_converter.load_fast_tokenizer(folder)


@pytest.fixture(scope="session")
def chatglm3_fast_tokenizer(tokenizer_folder_factory, fast_converter):
    """chatglm3-6b folder + the converter's tokenizer.json, loaded as the README shows (the converter's
    load_fast_tokenizer): tokenizer.json's own added-token flags, the unk, eos and pad tokens set after loading."""
    folder = tokenizer_folder_factory("chatglm3", "chatglm3-fast")
    assert fast_converter.main([str(folder)]) == 0
    return fast_converter.load_fast_tokenizer(folder)
