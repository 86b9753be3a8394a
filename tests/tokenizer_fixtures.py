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
    "chatglm2_records",
    "chatglm2_params",
    "make_chatglm2_folder",
    "make_codegeex2_folder",
    "codegeex2_records",
    "codegeex2_tokenizer",
    "glm4_variant_records",
    "glm4_tokenizer",
    "chatglm3_tokenizer",
    "chatglm2_tokenizer",
    "tokenizer_folder_factory",
    "fast_converter",
    "glm4_fast_tokenizer",
    "chatglm3_fast_tokenizer",
]

# family -> folder under testdata/tokenizers
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


def make_chatglm2_folder(folder: Path, tokenizer_config_changes=None, config_changes=None,
                         drop_names=False) -> Path:
    """A chatglm2-6b folder as its users have it, with our code files: the shared tokenizer.model (chatglm2-6b ships
    chatglm3-6b's, same sha256), chatglm2-6b's tokenizer_config.json (from the chatglm2.jsonl meta record) and
    config.json (the golden chatglm2-tiny checkpoint's, chatglm2-6b's shrunk). `drop_names` removes the names a
    save_pretrained drops (tokenizer_config's name_or_path, config's _name_or_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shared_path("tokenizers", TOKENIZER_DIRS["chatglm3"], "tokenizer.model"), folder / "tokenizer.model")
    tokenizer_config = dict(load_jsonl("tokvec", "chatglm2.jsonl")[0]["tokenizer_config"])
    config = json.loads(shared_path("golden", "chatglm2-tiny", "checkpoint", "config.json").read_text())
    if drop_names:
        tokenizer_config.pop("name_or_path")
        config.pop("_name_or_path")
    tokenizer_config.update(tokenizer_config_changes or {})
    config.update(config_changes or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False), encoding="utf-8")
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return copy_code_into(folder)


def chatglm2_params(kind: str, scenario=None, files=("chatglm2.jsonl",)) -> list:
    """The records of a kind (and chat scenario) of ChatGLM2-form tokenizers' files as pytest params, each with its
    record id."""
    return [pytest.param(record, id=record["id"]) for name in files for record in load_jsonl("tokvec", name)
            if record["kind"] == kind and record.get("scenario") == scenario]


def make_codegeex2_tokenizer_model(path: Path) -> Path:
    """codegeex2-6b's tokenizer.model, made as tokvec/FORMAT.md says: chatglm2-6b's (the shared chatglm3-6b file)
    with normalizer_spec.add_dummy_prefix false, one byte; checked against the recorded sha256 (never committed)."""
    import hashlib

    recipe = load_jsonl("tokvec", "codegeex2.jsonl")[0]["tokenizer_model_reconstruction"]
    data = bytearray(shared_path("tokenizers", TOKENIZER_DIRS["chatglm3"], "tokenizer.model").read_bytes())
    assert hashlib.sha256(data).hexdigest() == recipe["from_sha256"]
    data[recipe["changed_byte_offset"]] = 0
    assert hashlib.sha256(data).hexdigest() == recipe["result_sha256"] and len(data) == recipe["result_size"]
    path.write_bytes(bytes(data))
    return path


def make_codegeex2_folder(folder: Path, config_changes=None) -> Path:
    """A codegeex2-6b folder as downloaded, with our code files: its tokenizer.model, its tokenizer_config.json (the
    exact text the meta record holds) and a config.json naming it (chatglm2-tiny's shrunk config with codegeex2-6b's
    name, eos 2 and no pad_token_id, as its model_config_facts say)."""
    info = load_jsonl("tokvec", "codegeex2.jsonl")[0]
    folder.mkdir(parents=True, exist_ok=True)
    make_codegeex2_tokenizer_model(folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(info["tokenizer_config_text"], encoding="utf-8")
    config = json.loads(shared_path("golden", "chatglm2-tiny", "checkpoint", "config.json").read_text())
    config.pop("pad_token_id")
    config.update(_name_or_path=info["model_config_facts"]["_name_or_path"], **(config_changes or {}))
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
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
def chatglm2_records():
    return load_jsonl("tokvec", "chatglm2.jsonl")


@pytest.fixture(scope="session")
def codegeex2_records():
    return load_jsonl("tokvec", "codegeex2.jsonl")


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
def chatglm2_tokenizer(tmp_path_factory):
    return load_tokenizer(make_chatglm2_folder(tmp_path_factory.mktemp("chatglm2-tokenizer")))


@pytest.fixture(scope="session")
def codegeex2_tokenizer(tmp_path_factory):
    """codegeex2-6b's folder as downloaded, loaded with no chatglm_family argument."""
    return load_tokenizer(make_codegeex2_folder(tmp_path_factory.mktemp("codegeex2-6b")))


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
    """chatglm3-6b folder + the converter's tokenizer.json, loaded as docs/tokenizers.md shows (the converter's
    load_fast_tokenizer): tokenizer.json's own added-token flags, the unk, eos and pad tokens set after loading."""
    folder = tokenizer_folder_factory("chatglm3", "chatglm3-fast")
    assert fast_converter.main([str(folder)]) == 0
    return fast_converter.load_fast_tokenizer(folder)
