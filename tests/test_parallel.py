"""Tensor parallelism (parallel_chatglm.py) on CPU with gloo, under torchrun.

torchrun starts once per TP size (2 and 4 processes) and tests/parallel_worker.py runs every check inside, for both
families and a multi-head-attention variant; the tests below read what each rank found. TP=4 on the tiny configs
(4 heads, 2 key/value groups) puts one query head on each rank and each key/value group on two ranks.
"""
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, TRANSFORMERS, load_causal_lm, save_checkpoint, shared_path

WORKER = Path(__file__).with_name("parallel_worker.py")
PARALLEL_FILE = REPO / "parallel_chatglm.py"
# TP=2 on every transformers version; TP=4 (shared key/value heads, the 2 x 2 grid) on the matrix ends only.
TP_SIZES = (2, pytest.param(4, marks=pytest.mark.matrix_ends))
# family, config overrides. The last one covers the per-head [q|k|v] layout (no multi-query attention), a bias on
# the row-parallel layers, and a vocabulary that no TP size divides (replicated embedding and output layer).
VARIANTS = {
    "glm4": ("glm4", {}),
    "chatglm3": ("chatglm3", {}),
    "chatglm3-mha": ("chatglm3", dict(multi_query_attention=False, add_bias_linear=True, padded_vocab_size=255)),
    "glm4v": ("glm4v", {}),  # GLM-4V: the language model sharded by the same plan, the vision tower replicated
    # chatglm2-6b-32k: positions divided by rope_ratio on every rank (the reading travels in config.json)
    "chatglm2-32k": ("chatglm3", dict(rope_ratio=16, chatglm_variant="chatglm2-6b-32k")),
}
RUN_TIMEOUT_S = 300


def copy_parallel_file(folder: Path) -> Path:
    shutil.copy(PARALLEL_FILE, folder / PARALLEL_FILE.name)
    return folder


@pytest.fixture(scope="module")
def parallel(chatglm):
    """parallel_chatglm imported from the same package as the model under test."""
    copy_parallel_file(Path(chatglm.modeling.__file__).parent)
    return importlib.import_module("chatglm_under_test.parallel_chatglm")


@pytest.fixture(scope="module")
def checkpoints(tiny_model, tiny_glm4v, tmp_path_factory):
    """One saved checkpoint per variant, with the code files (parallel_chatglm.py included)."""
    root = tmp_path_factory.mktemp("tp_checkpoints")
    saved = {}
    for name, (family, overrides) in VARIANTS.items():
        model = tiny_glm4v(seed=7, **overrides) if family == "glm4v" else tiny_model(family, seed=7, **overrides)
        folder = copy_parallel_file(save_checkpoint(model, root / f"tp_{name.replace('-', '_')}"))
        saved[name] = {"folder": str(folder), "vocab": model.config.padded_vocab_size}
        if family == "glm4v":
            saved[name]["image_size"] = model.transformer.vision.sizes.image_size
    return saved


def run_torchrun(tp_size: int, checkpoints: dict, tmp: Path) -> dict:
    spec = {"variants": checkpoints, "parallel_file": str(PARALLEL_FILE), "grid_size": 2 if tp_size == 4 else None}
    (tmp / "spec.json").write_text(json.dumps(spec))
    results = tmp / "results"
    results.mkdir()
    modules_cache = tempfile.mkdtemp(prefix="chatglm-tp-modules-")
    env = dict(os.environ, HF_MODULES_CACHE=modules_cache, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp_size}",
               str(WORKER), str(tmp / "spec.json"), str(results)]
    # Its own process group, so that a hung run is ended with all its ranks.
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        log, _ = process.communicate(timeout=RUN_TIMEOUT_S)
        returncode = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        log, _ = process.communicate()
        returncode, log = "timeout", f"torchrun ran past {RUN_TIMEOUT_S} s\n{log}"
    finally:
        shutil.rmtree(modules_cache, ignore_errors=True)
    ranks = [json.loads(path.read_text()) for path in sorted(results.glob("rank*.json"))]
    return {"tp_size": tp_size, "returncode": returncode, "log": log[-6000:], "ranks": ranks}


@pytest.fixture(scope="module")
def tp_runs(checkpoints, tmp_path_factory):
    """tp_runs(n) -> what the n ranks of one torchrun found; torchrun starts once per size."""
    runs = {}

    def run(tp_size):
        if tp_size not in runs:
            runs[tp_size] = run_torchrun(tp_size, checkpoints, tmp_path_factory.mktemp(f"tp{tp_size}"))
        return runs[tp_size]

    return run


def rank_results(run: dict) -> list:
    assert run["returncode"] == 0 and len(run["ranks"]) == run["tp_size"], (
        f"torchrun with {run['tp_size']} processes failed (exit {run['returncode']}, {len(run['ranks'])} rank "
        f"reports):\n{run['log']}"
    )
    return run["ranks"]


def assert_checks(run: dict, variant: str, *names: str):
    failures = []
    for rank, results in enumerate(rank_results(run)):
        for name in names:
            result = results[variant].get(name, {"ok": False, "detail": "not run (an earlier step failed)"})
            if not result["ok"]:
                failures.append(f"rank {rank} {variant} {name}: {result['detail']}")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------------------------------------------
# Parity under torchrun (each test reads one check of every rank)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_from_pretrained_tp_plan_auto_matches_single_process(tp_runs, tp_size, variant):
    assert_checks(tp_runs(tp_size), variant, "auto_loads", "auto_sizes", "auto_logits", "auto_generation")


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_rank_holds_its_heads_and_shared_kv_heads_agree(tp_runs, tp_size, variant):
    assert_checks(tp_runs(tp_size), variant, "sizes", "replicas")


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_the_single_process_model(tp_runs, tp_size, variant):
    assert_checks(tp_runs(tp_size), variant, "logits")


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_with_cache_is_identical(tp_runs, tp_size, variant):
    assert_checks(tp_runs(tp_size), variant, "generation")


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_with_a_static_cache_is_identical(tp_runs, tp_size, variant):
    run = tp_runs(tp_size)
    if "static_generation" not in rank_results(run)[0][variant]:
        pytest.skip(f"transformers {TRANSFORMERS} < 4.57 preallocates static caches for the full head count")
    assert_checks(run, variant, "static_generation")


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_training_step_gradients_equal_the_single_process_model(tp_runs, tp_size, variant):
    assert_checks(tp_runs(tp_size), variant, "gradients")


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_shards_reassemble_into_the_checkpoint_and_save_pretrained_writes_it(tp_runs, tp_size, variant):
    assert_checks(tp_runs(tp_size), variant, "state_dict", "save")


@pytest.mark.matrix_ends
def test_tp_size_smaller_than_the_world_makes_a_data_by_tensor_parallel_grid(tp_runs):
    """In the 4-process run, tp_size=2: two tensor-parallel groups of 2 ranks."""
    for variant in VARIANTS:
        assert_checks(tp_runs(4), variant, "grid_logits")


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_glm4v_with_images_equals_the_single_process_model(tp_runs, tp_size):
    """Left-padded prompts with one image each: logits, greedy generation, the loss and every gradient (the
    replicated vision tower's included) as in one process."""
    assert_checks(tp_runs(tp_size), "glm4v", "image_logits", "image_generation", "image_gradients")


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_collectives_only_ever_received_contiguous_tensors(tp_runs, tp_size):
    """Every check above ran with the collectives' entry points wrapped to raise on a non-contiguous tensor."""
    for rank, results in enumerate(rank_results(tp_runs(tp_size))):
        guard = results["guard"]
        assert guard["rejects_non_contiguous"], f"rank {rank}: the guard let a non-contiguous tensor through"
        calls = guard["calls"]
        # The forward's all-reduces and the logits' all-gather go through the wrapped functional collectives (the
        # gather as all_gather_single, or as all_gather_tensor on torch 2.4).
        gathers = calls.get("funcol.all_gather_single", 0) + calls.get("funcol.all_gather_tensor", 0)
        assert calls.get("funcol.all_reduce", 0) > 0 and gathers > 0, calls


# ----------------------------------------------------------------------------------------------------------------------
# Sizes and errors (one process)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["glm-4-9b-chat", "chatglm3-6b"])
def test_supported_sizes_of_the_real_configs(chatglm, parallel, name):
    config = chatglm.ChatGLMConfig(**json.loads(shared_path("configs", name, "config.json").read_text()))
    assert parallel.valid_tensor_parallel_sizes(config) == [1, 2, 4, 8, 16, 32]
    sizes = parallel.check_tensor_parallel_size(config, 8)  # 2 key/value groups on 8 ranks: each on 4 ranks
    assert (sizes.num_heads, sizes.num_kv_heads, sizes.kv_replicas, sizes.vocab_sharded) == (4, 1, 4, True)


BAD_SIZES = [
    (dict(num_attention_heads=4, multi_query_group_num=2), 3, r"does not divide num_attention_heads=4"),
    (dict(num_attention_heads=12, hidden_size=96, multi_query_group_num=4, ffn_hidden_size=96), 6,
     r"the 4 key/value heads .* must divide one another"),
    (dict(num_attention_heads=12, hidden_size=96, multi_query_group_num=3, ffn_hidden_size=96), 2,
     r"the 3 key/value heads .* must divide one another"),
    (dict(ffn_hidden_size=90), 4, r"does not divide ffn_hidden_size=90"),
    (dict(), 0, r"positive integer"),
]


@pytest.mark.parametrize("overrides,tp_size,message", BAD_SIZES)
def test_sizes_that_cannot_work_raise_value_error_naming_them(chatglm, parallel, overrides, tp_size, message):
    from conftest import tiny_config_dict

    config = chatglm.ChatGLMConfig(**tiny_config_dict("glm4", **overrides))
    with pytest.raises(ValueError, match=message) as error:
        parallel.check_tensor_parallel_size(config, tp_size)
    if tp_size:
        assert f"size {tp_size}" in str(error.value) and "Sizes that work" in str(error.value)


def test_tensor_parallel_rejects_a_bad_size_before_any_collective(tiny_model, parallel):
    model = tiny_model("glm4")  # 4 heads; no process group exists in this process
    with pytest.raises(ValueError, match=r"Tensor parallel size 3 .*num_attention_heads=4.*\[1, 2, 4\]"):
        parallel.tensor_parallel(model, 3)


def test_tensor_parallel_rejects_a_model_dispatched_with_a_device_map(tiny_model, parallel):
    model = tiny_model("glm4")
    model.hf_device_map = {"transformer.embedding": 0, "transformer.encoder": 1}
    with pytest.raises(ValueError, match="device_map"):
        parallel.tensor_parallel(model, 2)


def test_tensor_parallel_without_a_process_group_says_how_to_launch(tiny_model, parallel):
    with pytest.raises(RuntimeError, match="torchrun"):
        parallel.tensor_parallel(tiny_model("glm4"), 2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp_plan="auto", device_map="cpu"), r"tp_plan='auto' cannot be combined with device_map='cpu'"),
    (dict(tp_plan="auto", tp_size=3), r"Tensor parallel size 3 .*num_attention_heads=4"),
    (dict(tp_plan={"transformer.output_layer": "colwise"}), r"pass tp_plan='auto'"),
])
def test_from_pretrained_rejects_what_cannot_work(checkpoints, kwargs, message):
    """Through the model's from_pretrained, before any process group or checkpoint read."""
    with pytest.raises(ValueError, match=message):
        load_causal_lm(checkpoints["glm4"]["folder"], **kwargs)


def test_distributed_config_asking_for_other_parallelism_is_rejected(parallel):
    def never(*args, **kwargs):
        raise AssertionError("must fail before loading")

    with pytest.raises(ValueError, match=r"fsdp_size.*tensor parallelism only"):
        parallel.from_pretrained_tensor_parallel(never, "folder", distributed_config={"tp_size": 2, "fsdp_size": 2})
    # No tensor parallelism asked for: transformers' own from_pretrained runs, without the TP arguments.
    passed = lambda *args, **kwargs: (args, kwargs)  # noqa: E731
    assert parallel.from_pretrained_tensor_parallel(passed, "folder", tp_size=1) == (("folder",), {})
    assert parallel.from_pretrained_tensor_parallel(passed, "folder", distributed_config={"tp_size": None}) == (
        ("folder",), {})


def test_the_model_method_is_the_explicit_api(tiny_model, parallel):
    """model.tensor_parallel(mesh_or_size) runs parallel_chatglm.tensor_parallel (here, as far as its size check)."""
    model = tiny_model("glm4")
    assert callable(getattr(model, "tensor_parallel", None)), (
        "ChatGLMPreTrainedModel.tensor_parallel(mesh_or_size) is missing: the hook into parallel_chatglm.py"
    )
    with pytest.raises(ValueError, match=r"Tensor parallel size 3 .*num_attention_heads=4"):
        model.tensor_parallel(3)
