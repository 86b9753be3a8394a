"""Drop-in beyond numbers: every public name of the ORIGINAL objects exists on ours, with the same kind, the
original's parameters and the tokenizer's recorded values (shared/surface, recorded from the original code), and the
clients that read those names (ChatGLM3's finetune_hf.py sanity check, its cli_demo's streaming loop, attention hooks
on `core_attention`) run as they do with the original files.
"""
import ast
import inspect
import json
import os
import re

import pytest
import torch
from torch import nn

from chatglm_tools import REPO, shared_path
from tokenizer_fixtures import load_jsonl

SURFACES = ("chatglm3", "glm4", "chatglm2")
# Names whose recorded value is an original bug this fork fixes on purpose; the README's "Drop-in surface" section
# lists each. (family, path, name) -> why.
KNOWN_DIFFERENCES = {
    ("chatglm3", "tokenizer", "total_vocab_size"):
        "64798, every id: the original's 64796 counted <unk>, <s> and </s> once, all three named ''",
}


def load_surface(family: str) -> dict:
    return json.loads(shared_path("surface", f"{family}.json").read_text(encoding="utf-8"))


def recorded_config(surface: dict) -> dict:
    """The tiny checkpoint's config as recorded: every config attribute with its value (None for NoneType)."""
    return {name: entry.get("value") for name, entry in surface["objects"]["config"]["names"].items()
            if entry["kind"] == "attribute" and ("value" in entry or entry["type"] == "NoneType")}


@pytest.fixture(scope="session")
def surface_objects(chatglm, chatglm3_tokenizer, glm4_tokenizer, chatglm2_tokenizer):
    """family -> (surface, {"model", "tokenizer", "config"}): our model built from the recorded config (the
    attention implementation the original ran: GLM-4's sdpa, ChatGLM2/3's eager) and our tokenizer."""
    tokenizers = {"chatglm3": chatglm3_tokenizer, "glm4": glm4_tokenizer, "chatglm2": chatglm2_tokenizer}
    built = {}
    for family in SURFACES:
        surface = load_surface(family)
        config = chatglm.ChatGLMConfig(**recorded_config(surface))
        if family == "chatglm2":
            config._name_or_path = "THUDM/chatglm2-6b"  # a chatglm2-6b folder
        config._attn_implementation = "sdpa" if family == "glm4" else "eager"
        model = chatglm.modeling.ChatGLMForConditionalGeneration(config).eval()
        built[family] = (surface, {"model": model, "tokenizer": tokenizers[family], "config": model.config})
    return built


def reach(objects: dict, path: str):
    """The object at a surface PATH such as `model.transformer.encoder.layers[0].self_attention`."""
    head, *rest = re.split(r"\.(?![^\[]*\])", path)
    obj = objects[head]
    for part in rest:
        name, index = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", part).groups()
        obj = getattr(obj, name)
        if index is not None:
            obj = obj[int(index)]
    return obj


def parameters_of(signature: str) -> list:
    """(name, kind, default source) of each parameter of a recorded signature `(a, b: int = 1, **kwargs) -> str`."""
    args = ast.parse(f"def f{signature}: pass").body[0].args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    found = [(a.arg, "positional", None if d is None else ast.unparse(d)) for a, d in zip(positional, defaults)]
    if args.vararg:
        found.append((args.vararg.arg, "*", None))
    found += [(a.arg, "keyword", None if d is None else ast.unparse(d))
              for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        found.append((args.kwarg.arg, "**", None))
    return found


def our_parameters(function) -> list:
    kinds = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**",
             inspect.Parameter.KEYWORD_ONLY: "keyword"}
    found = []
    for parameter in inspect.signature(function).parameters.values():
        default = None if parameter.default is inspect.Parameter.empty else parameter.default
        source = None if parameter.default is inspect.Parameter.empty else (
            repr(default) if not isinstance(default, (torch.dtype,)) else str(default))
        found.append((parameter.name, kinds.get(parameter.kind, "positional"), source))
    return found


def same_default(recorded: str, ours: str) -> bool:
    if recorded is None:  # required in the original: a default here still takes every call
        return True
    if ours is None:
        return False
    try:
        return ast.literal_eval(recorded) == ast.literal_eval(ours)
    except ValueError:
        return recorded == ours


def takes_every_call(recorded: list, ours: list) -> bool:
    """Whether our parameters take every call the original's take: the same names, kinds and order, the same
    defaults (or one where the original required the argument), and any further parameters optional and placed
    after the original's (before a **kwargs both have)."""
    tail = [p for p in ours if p[1] == "**"] if recorded and recorded[-1][1] == "**" else []
    head, extra = ours[:len(recorded) - len(tail)], ours[len(recorded) - len(tail):len(ours) - len(tail)]
    if [(n, k) for n, k, _ in recorded] != [(n, k) for n, k, _ in head + tail]:
        return False
    if not all(same_default(r[2], o[2]) for r, o in zip(recorded, head + tail)):
        return False
    return all(default is not None or kind in ("*", "**") for _, kind, default in extra)


def mismatch(obj, name: str, entry: dict):
    """Why `obj.name` is not the recorded ENTRY, or None when it is."""
    kind = entry["kind"]
    if kind == "module":
        module = getattr(obj, "_modules", {}).get(name)
        if module is None:
            return "is not a submodule"
        return None if type(module).__name__ == entry["type"] else f"is a {type(module).__name__}"
    try:
        value = getattr(obj, name)
    except AttributeError as err:
        return f"is missing ({err})"
    if kind == "method":
        if not callable(value) or isinstance(value, nn.Module):
            return f"is not a method but {type(value).__name__}"
        recorded, ours = parameters_of(entry["signature"]), our_parameters(value)
        return None if takes_every_call(recorded, ours) else f"takes {ours}, the original {recorded}"
    if callable(value) and not isinstance(value, (torch.Tensor, re.Pattern)) and entry["type"] != "SPTokenizer" \
            and entry["type"] != "Encoding" and entry["type"] != "SentencePieceProcessor":
        return f"is callable ({type(value).__name__}), not an attribute"
    if type(value).__name__ != entry["type"]:
        return f"is a {type(value).__name__}, the original's a {entry['type']}"
    if name == "vocab_file":  # recorded as the file's name; both keep the path loaded from
        value = os.path.basename(value)
    if "value" in entry and json.loads(json.dumps(value)) != entry["value"]:
        return f"is {value!r:.200}, the original's {entry['value']!r:.200}"
    return None


@pytest.mark.parametrize("family", SURFACES)
def test_every_recorded_name_matches(surface_objects, family):
    surface, objects = surface_objects[family]
    problems = []
    for path, recorded in surface["objects"].items():
        try:
            obj = reach(objects, path)
        except AttributeError as err:
            problems.append(f"{path} is missing ({err})")
            continue
        for name, entry in recorded["names"].items():
            problem = mismatch(obj, name, entry)
            if problem and (family, path, name) not in KNOWN_DIFFERENCES:
                problems.append(f"{path}.{name} {problem}")
    assert not problems, f"{len(problems)} names differ from the original's:\n" + "\n".join(problems)


@pytest.mark.parametrize("family", SURFACES)
def test_every_submodule_name_exists(surface_objects, family):
    surface, objects = surface_objects[family]
    ours = {name for name, _ in objects["model"].named_modules()}
    assert not set(surface["module_names"]) - ours


def test_known_differences_are_real_and_documented(surface_objects):
    """Each deliberate difference still differs (else it belongs back in the check) and the README names it."""
    section = REPO.joinpath("README.md").read_text(encoding="utf-8").split("### Drop-in surface", 1)[1].split("\n## ")[0]
    for (family, path, name), why in KNOWN_DIFFERENCES.items():
        surface, objects = surface_objects[family]
        assert mismatch(reach(objects, path), name, surface["objects"][path]["names"][name]), (family, path, name)
        assert f"`{path}.{name}`" in section, f"README's Drop-in surface section does not list {path}.{name}"
