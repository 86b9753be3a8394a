"""Fixtures shared by every test module.

The environment is fixed here, before anything imports transformers: remote code goes to a fresh modules cache
(a stale copy from an earlier run would otherwise be tested), and nothing may reach a hub.
"""
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

_MODULES_CACHE = tempfile.mkdtemp(prefix="chatglm-hf-modules-")
os.environ["HF_MODULES_CACHE"] = _MODULES_CACHE
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# tools/chatglm_tools holds what the tests share with the user tools (pytest.ini puts tools/ on the path): the list of
# code files a user copies, the device checks of tools/gpu_check.py, the reference Glm conversion.
from chatglm_tools import CODE_FILES, REPO, SHARED, copy_code_into, shared_path  # noqa: E402,F401


# The minimal environment (scripts/test.sh, CHATGLM_TEST_ENV=minimal) holds only the six dependencies: tests of an
# optional feature skip there, naming its package. Anywhere else a missing optional package fails its tests.
MINIMAL_ENVIRONMENT = os.environ.get("CHATGLM_TEST_ENV") == "minimal"


def optional_package(module: str, package: str):
    """Import an optional feature's package for a test (skipped, naming it, only in the minimal environment)."""
    if MINIMAL_ENVIRONMENT:
        return pytest.importorskip(module, reason=f"{package} is optional and not in the minimal environment")
    import importlib

    return importlib.import_module(module)


# Modules whose tests split a model over simulated devices or processes: marked `multi_device` for the quick run.
MULTI_DEVICE_MODULES = ("test_devices", "test_parallel", "test_virtual_devices")


# Tests whose outcome no transformers release can change: no transformers code runs in them (the simulated devices
# on plain torch; the installer's file transactions, which import neither torch nor transformers). Marked
# `release_independent`: the matrix's versions between its ends skip them (scripts/test.sh); the oldest and newest run
# them. A test that starts to load, generate or tokenize through transformers leaves this list.
# Whole modules with no transformers code in them: the docs' links and file lists, the data folder and its refresh.
RELEASE_INDEPENDENT_MODULES = ("test_docs", "test_testdata")
RELEASE_INDEPENDENT = {
    "test_virtual_devices": (
        "test_forgotten_to_raises_like_a_gpu", "test_corrected_module_matches_cpu_forward_and_backward",
        "test_every_mixing_operation_raises", "test_cpu_scalars_and_cpu_indices_are_accepted_as_on_cuda",
        "test_transformer_operations_match_cpu_with_gradients",
        "test_to_round_trips_through_every_device_as_real_copies", "test_safetensors_and_deepcopy",
        "test_devices_exist_only_inside_the_block"),
    "test_tools": (
        "test_hub_cache_snapshot_survives_install_install_revert_and_shares_nothing",
        "test_a_companion_file_added_to_the_code_files_later_is_installed_and_reverted",
        "test_files_changed_by_hand_are_not_overwritten_without_force", "test_status_says_what_is_installed",
        "test_refusals_exit_2_with_a_message_and_change_nothing", "test_refuses_to_install_into_this_repository",
        "test_another_run_on_the_same_folder_is_turned_away",
        "test_a_permission_error_at_any_step_leaves_the_folder_as_it_was",
        "test_a_full_disk_after_any_number_of_bytes_leaves_the_folder_as_it_was",
        "test_an_exception_or_ctrl_c_in_the_middle_of_the_renames_leaves_the_folder_as_it_was",
        "test_sigkill_then_the_next_run_finishes_or_undoes_the_install",
        "test_a_real_full_tmpfs_leaves_the_folder_as_it_was"),
}


# The smoke tier (`scripts/test.sh --smoke`, `-m smoke`): the edit-run loop's few tests, under 2 minutes on 2 cores
# (docs/run-history.md): load, forward, generate, chat() and stream_chat(), the tokenizers, and a golden case of the
# original code per family (GLM-4, ChatGLM3, ChatGLM2, GLM-4V). A name with [parameters] marks that case only, a bare
# name every case. tests/test_docs.py checks the golden case per family; a name no test has stops the run.
SMOKE = {
    "test_loading": (
        "test_original_checkpoint_loads_with_no_missing_or_unexpected_keys[glm4-chat-tiny]",
        "test_original_checkpoint_loads_with_no_missing_or_unexpected_keys[chatglm3-tiny]",
        "test_original_checkpoint_loads_with_no_missing_or_unexpected_keys[chatglm2-tiny]",
        "test_modeling_file_copied_alone_gives_the_golden_numbers[glm4-chat-tiny]"),
    "test_parity": (
        "test_single_sequences_match_golden[glm4-chat-tiny-eager]",
        "test_single_sequences_match_golden[chatglm3-tiny-eager]",
        "test_single_sequences_match_golden[chatglm2-tiny-eager]",
        "test_greedy_generation_matches_golden[glm4-chat-tiny]",
        "test_greedy_generation_matches_golden[chatglm2-tiny]"),
    "test_glm4v": (
        "test_original_checkpoint_loads_with_every_key", "test_forward_with_an_image_matches_golden[eager]",
        "test_greedy_generation_matches_golden[glm4v-tiny-text]"),
    "test_cache_use": ("test_generate_feeds_one_position_per_step[dynamic-glm4]",),
    "test_chat": (
        "test_greedy_chat_equals_decoding_generate_on_the_documented_prompt",
        "test_stream_chat_yields_growing_prefixes_ending_in_the_chat_answer[glm4]",
        "test_chatglm2_chat_record", "test_chatglm2_stream_chat_record_and_its_follow_up_on_the_cache"),
    "test_tokenizer": (
        "test_glm4_encode_reproduces_original", "test_glm4_decode_records",
        "test_glm4_render_then_encode_equals_chat_ids",
        "test_chatglm3_encode_gives_the_original_ids", "test_chatglm3_decode_records",
        "test_chatglm3_render_then_encode_equals_chat_ids", "test_chatglm2_encode_record"),
}


def pytest_ignore_collect(collection_path, config):
    """`-m smoke` imports only the modules that hold smoke tests: importing all of them costs about 8 s of CPU."""
    if config.getoption("markexpr", "") == "smoke" and collection_path.suffix == ".py" and \
            collection_path.parent == Path(__file__).parent and collection_path.name.startswith("test_"):
        return collection_path.stem not in SMOKE or None
    return None


def pytest_collection_modifyitems(config, items):
    smoke_seen = set()
    for item in items:
        module = item.module.__name__
        if module in MULTI_DEVICE_MODULES:
            item.add_marker(pytest.mark.multi_device)
        if module in RELEASE_INDEPENDENT_MODULES or \
                getattr(item, "originalname", item.name) in RELEASE_INDEPENDENT.get(module, ()):
            item.add_marker(pytest.mark.release_independent)
        smoke = {item.name, getattr(item, "originalname", item.name)} & set(SMOKE.get(module, ()))
        if smoke:
            item.add_marker(pytest.mark.smoke)
            smoke_seen |= {(module, name) for name in smoke}
    # A smoke entry that matches no test (renamed, or its parameters changed) would shrink the tier unseen: where its
    # module was collected whole (no test named on the command line), the entry must have matched.
    collected = {item.module.__name__ for item in items} if not any("::" in arg for arg in config.args) else set()
    stale = [f"{module}::{name}" for module, names in SMOKE.items() if module in collected for name in names
             if (module, name) not in smoke_seen]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py SMOKE names tests that do not exist: {stale}")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_MODULES_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return shared_path()


# ---------------------------------------------------------------------------------------------------------------------
# Our code, golden checkpoints and tiny random models
# ---------------------------------------------------------------------------------------------------------------------
import importlib  # noqa: E402
import json  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from packaging.version import Version  # noqa: E402

TRANSFORMERS = Version(transformers.__version__)
GOLDEN_CASES = ("glm4-chat-tiny", "chatglm3-tiny", "chatglm2-tiny", "chatglm2-32k-tiny")
# P-tuning v2 cases: every golden case with a prefix-only layout (FORMAT.md, "P-tuning v2 cases").
PTUNING_CASES = tuple(sorted(p.parent.name for p in (SHARED / "golden").glob("*/prefix_only"))) or ("glm4-ptuning-tiny",)
FAMILIES = ("glm4", "chatglm3")


def dtype_kwarg(dtype) -> dict:
    """from_pretrained's dtype argument: `torch_dtype` until 4.56 renamed it `dtype`."""
    return {"dtype": dtype} if TRANSFORMERS >= Version("4.56") else {"torch_dtype": dtype}


def load_causal_lm(folder, **kwargs):
    """Load a checkpoint folder exactly as a user does (trust_remote_code, fp32 unless told otherwise)."""
    dtype = kwargs.pop("dtype", torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, **dtype_kwarg(dtype), **kwargs
    )
    return model.eval() if not isinstance(model, tuple) else model


@pytest.fixture(scope="session")
def chatglm(tmp_path_factory):
    """Our code imported as a package, the same files a user gets through trust_remote_code."""
    root = tmp_path_factory.mktemp("package")
    package = root / "chatglm_under_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    copy_code_into(package)
    sys.path.insert(0, str(root))
    return SimpleNamespace(
        ChatGLMConfig=importlib.import_module("chatglm_under_test.configuration_chatglm").ChatGLMConfig,
        modeling=importlib.import_module("chatglm_under_test.modeling_chatglm"),
        checks=importlib.import_module("chatglm_under_test.checks_chatglm"),  # the load checks (a companion file)
    )


@dataclass
class GoldenCase:
    """A checkpoint saved by the ORIGINAL code, with what the original computed on it (see testdata/golden)."""

    name: str
    folder: Path  # the checkpoint with our code files dropped in
    cases: dict
    expected: dict
    base_folder: Optional[Path] = None  # P-tuning cases: the base checkpoint, code files dropped in
    prefix_only: Optional[Path] = None  # P-tuning cases: the folder holding only the prefix (read in place)

    @property
    def family(self) -> str:
        return self.cases["family"]

    @property
    def gen_kwargs(self) -> dict:
        return dict(self.cases["generation"]["kwargs"])

    def load(self, **kwargs):
        kwargs.setdefault("attn_implementation", "eager")
        return load_causal_lm(self.folder, **kwargs)


def make_golden_case(name: str, tmp_root: Path) -> GoldenCase:
    from safetensors.torch import load_file

    source = shared_path("golden", name)
    # The remote-code module cache is keyed by folder name: one unique folder per case.
    folder = tmp_root / f"golden_{name.replace('-', '_')}"
    shutil.copytree(source / "checkpoint", folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    copy_code_into(folder)
    case = GoldenCase(
        name=name,
        folder=folder,
        cases=json.loads((source / "cases.json").read_text()),
        expected=load_file(str(source / "expected.safetensors")),
    )
    if (source / "base_checkpoint").exists():
        case.base_folder = tmp_root / f"golden_{name.replace('-', '_')}_base"
        shutil.copytree(source / "base_checkpoint", case.base_folder)
        for path in case.base_folder.iterdir():
            path.chmod(0o644)
        copy_code_into(case.base_folder)
        case.prefix_only = source / "prefix_only"
    return case


@pytest.fixture(scope="session", params=GOLDEN_CASES)
def golden(request, tmp_path_factory) -> GoldenCase:
    return make_golden_case(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session", params=PTUNING_CASES)
def ptuning(request, tmp_path_factory) -> GoldenCase:
    """A P-tuning v2 golden case: `folder` is the whole checkpoint, `base_folder` + `prefix_only` the classic pair."""
    return make_golden_case(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def golden_model(golden):
    """The golden checkpoint loaded as the original was run (eager attention, fp32)."""
    return golden.load()


# Small shapes that keep every feature in play: grouped-query attention, several layers, rotary on half a head.
TINY_SIZES = dict(hidden_size=64, num_attention_heads=4, kv_channels=16, ffn_hidden_size=96, padded_vocab_size=256,
                  num_layers=3, multi_query_group_num=2, seq_length=256)
# padded_vocab_size of the released checkpoints: tiny models that take the real tokenizers' ids.
REAL_VOCABULARY = {"glm4": 151552, "chatglm3": 65024}
FAMILY_CONFIGS = {"glm4": ("configs", "glm-4-9b-chat", "config.json"),
                  "chatglm3": ("configs", "chatglm3-6b", "config.json")}


def tiny_config_dict(family: str, **overrides) -> dict:
    """A family's real config.json with the sizes shrunk; every other field as the family ships it."""
    config = json.loads(shared_path(*FAMILY_CONFIGS[family]).read_text())
    config.update(TINY_SIZES)
    if "num_hidden_layers" in config:
        config["num_hidden_layers"] = config["num_layers"]
    config.update(eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    config.update(overrides)
    if "num_layers" in overrides and "num_hidden_layers" in config:
        config["num_hidden_layers"] = overrides["num_layers"]
    return config


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights large enough that attention is far from uniform and greedy choices are clear (as in the goldens)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # layernorms, and GLM-4V's projection norm1
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
                if name.endswith("bias"):
                    values -= 1.0
            elif "word_embeddings" in name or "prefix_encoder.embedding" in name:
                values = torch.randn(param.shape, generator=generator)
            else:
                values = 0.15 * torch.randn(param.shape, generator=generator)
            param.copy_(values.to(param.dtype))
    return model


@pytest.fixture(scope="session")
def tiny_model(chatglm):
    """tiny_model(family, seed=0, **config_overrides) -> an fp32 ChatGLMForConditionalGeneration in eval mode."""

    def build(family: str, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
        return random_model(chatglm, tiny_config_dict(family, **overrides), seed, attn_implementation)

    return build


def random_model(chatglm, config_dict: dict, seed: int, attn_implementation: str):
    """An fp32 ChatGLMForConditionalGeneration of our code in eval mode, with randomize_ weights."""
    config = chatglm.ChatGLMConfig(**config_dict)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = chatglm.modeling.ChatGLMForConditionalGeneration(config)
    return randomize_(model, seed).eval()


# ---------------------------------------------------------------------------------------------------------------------
# GLM-4V (glm-4v-9b): golden cases, tiny image models, prompts with an image
# ---------------------------------------------------------------------------------------------------------------------
GLM4V_CASES = ("glm4v-tiny", "glm4v-tiny-text")
# The golden checkpoints' remapped ids (FORMAT.md, "GLM-4V cases"): [gMASK] <sop> <|user|> "\n", the image
# placeholder, <|assistant|>; text ids are drawn from [3, TEXT_ID_STOP).
GLM4V_PREFIX, GLM4V_IMAGE, GLM4V_ASSISTANT = [500, 502, 505, 201], [508, 498, 509], [506]
TEXT_ID_STOP = 495


@pytest.fixture(scope="session")
def glm4v_golden(tmp_path_factory) -> dict:
    """name -> GoldenCase of the GLM-4V golden cases (one checkpoint: image and text-only prompts)."""
    return {name: make_golden_case(name, tmp_path_factory.mktemp(name)) for name in GLM4V_CASES}


@pytest.fixture(scope="session")
def glm4v_model(glm4v_golden):
    """The golden GLM-4V checkpoint loaded as the original ran (eager attention, fp32)."""
    return glm4v_golden["glm4v-tiny"].load()


def tiny_glm4v_config_dict(image_size: int = 8, **overrides) -> dict:
    """glm-4v-9b's config as the golden checkpoint has it (LM shrunk, remapped ids), with a small vision tower:
    patches of 2, so image_size 8 gives N = 4 image rows and 12 gives N = 9."""
    config = json.loads(shared_path("golden", "glm4v-tiny", "checkpoint", "config.json").read_text())
    grid = image_size // 2
    config["vision_config"].update(image_size=image_size, patch_size=2, hidden_size=16, num_heads=2,
                                   intermediate_size=32, num_hidden_layers=2, num_positions=grid * grid + 1)
    config.update(eos_token_id=2, pad_token_id=0, torch_dtype="float32")
    config.update(overrides)
    return config


@pytest.fixture(scope="session")
def tiny_glm4v(chatglm):
    """tiny_glm4v(seed=0, image_size=8, attn_implementation="sdpa", **config_overrides) -> an fp32 GLM-4V model."""

    def build(seed: int = 0, image_size: int = 8, attn_implementation: str = "sdpa", **overrides):
        return random_model(chatglm, tiny_glm4v_config_dict(image_size, **overrides), seed, attn_implementation)

    return build


def glm4v_prompt(text_length: int, generator: torch.Generator, image: bool = True) -> list:
    """A chat prompt in the golden checkpoints' ids: prefix, the image placeholder, text, <|assistant|>."""
    text = torch.randint(3, TEXT_ID_STOP, (text_length,), generator=generator).tolist()
    return GLM4V_PREFIX + (GLM4V_IMAGE if image else []) + text + GLM4V_ASSISTANT


def random_images(count: int, size: int, seed: int) -> torch.Tensor:
    return torch.randn(count, 3, size, size, generator=torch.Generator().manual_seed(seed))


def save_checkpoint(model, folder: Path) -> Path:
    """save_pretrained plus our code files: a folder a user can load with trust_remote_code."""
    model.save_pretrained(folder)
    return copy_code_into(folder)

class LoggedMessages(logging.Handler):
    """`with LoggedMessages(name) as log:` collects what the logger `name` (and its children) log in `log.messages`,
    `warning_once` messages included (its memory of earlier messages is cleared)."""

    def __init__(self, name: str):
        super().__init__()
        self.logger = logging.getLogger(name)

    def __enter__(self):
        logging.Logger.warning_once.cache_clear()
        self.messages = []
        self.logger.addHandler(self)
        return self

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


from tokenizer_fixtures import *  # noqa: E402,F401,F403  (tokenizer fixtures, shared by several test modules)
