"""One rank of the tensor-parallel checks, launched by tests/test_parallel.py with torchrun (CPU, gloo).

Every rank compares its tensor-parallel model with the unsharded model it loads itself from the same checkpoint, and
writes what it found to RESULTS/rank<N>.json; the test module asserts on those files. Every collective is wrapped
first (guard_collectives) so that a non-contiguous tensor handed to one raises. Not collected by pytest (no test_
prefix); it imports nothing from conftest, which would make a modules cache of its own.

Usage: torchrun --nproc-per-node N tests/parallel_worker.py SPEC.json RESULTS_DIR
"""
import functools
import importlib.util
import json
import os
import sys
import traceback
from collections import Counter
from pathlib import Path

# A modules cache per rank, set before transformers reads it: ranks copying the same remote code into one cache at
# the same moment can import a half-written file.
os.environ["HF_MODULES_CACHE"] = os.path.join(os.environ["HF_MODULES_CACHE"], f"rank{os.environ['LOCAL_RANK']}")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402
import transformers  # noqa: E402
import transformers.cache_utils  # noqa: E402
from packaging.version import Version  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------------
# Contiguity guard: the Python entry points of the collectives, both torch.distributed's and the functional ones that
# DTensor's redistributions call (on gloo).
# ----------------------------------------------------------------------------------------------------------------------

FUNCTIONAL_COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_tensor", "reduce_scatter_single",
                          "reduce_scatter_tensor", "all_to_all_single", "broadcast", "all_reduce_coalesced",
                          "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "permute_tensor")
C10D_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                    "all_to_all", "all_to_all_single", "broadcast", "reduce", "scatter", "gather",
                    "all_reduce_coalesced")
CALLS = Counter()


class NonContiguousCollectiveInput(RuntimeError):
    pass


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _guard(owner, name, label):
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_contiguity_guard", False):
        return

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        for tensor in _tensors(list(args) + list(kwargs.values())):
            if not tensor.is_contiguous():
                raise NonContiguousCollectiveInput(
                    f"{label}.{name} got a non-contiguous tensor: shape {tuple(tensor.shape)}, stride {tensor.stride()}"
                )
        CALLS[f"{label}.{name}"] += 1
        return original(*args, **kwargs)

    guarded._contiguity_guard = True
    setattr(owner, name, guarded)


def guard_collectives():
    for name in FUNCTIONAL_COLLECTIVES:
        _guard(funcol, name, "funcol")
    for name in C10D_COLLECTIVES:
        _guard(dist, name, "dist")
        _guard(c10d, name, "c10d")


def guard_rejects_non_contiguous() -> bool:
    """The guard raises before any communication, so this is safe on every rank."""
    try:
        funcol.all_reduce(torch.ones(4, 6).t(), "sum", list(range(dist.get_world_size())))
    except NonContiguousCollectiveInput:
        return True
    return False


# ----------------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------------

TRANSFORMERS = Version(transformers.__version__)
ATTENTION = {"glm4": "sdpa", "chatglm3": "eager", "chatglm3-mha": "eager", "glm4v": "sdpa", "chatglm2-32k": "sdpa"}


def load(folder, variant, **kwargs):
    dtype = {"dtype": torch.float32} if TRANSFORMERS >= Version("4.56") else {"torch_dtype": torch.float32}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, attn_implementation=ATTENTION[variant], **dtype, **kwargs
    )
    return model.eval()


def import_parallel(path):
    """parallel_chatglm.py from its file: the explicit API needs nothing from the modeling file."""
    spec = importlib.util.spec_from_file_location("parallel_chatglm_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------------------------
# Inputs and comparisons
# ----------------------------------------------------------------------------------------------------------------------


def inputs(seed, vocab):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 10), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding in the second row
    return ids, mask


def max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def close(a, b, atol, rtol) -> dict:
    try:
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
        return {"ok": True, "detail": f"max |diff| {max_diff(a, b):.2e}"}
    except AssertionError as error:
        return {"ok": False, "detail": str(error)[:800]}


class Checks:
    """Results of one variant: name -> {"ok": bool, "detail": str}. A check that raises is recorded as failed."""

    def __init__(self):
        self.results = {}

    def run(self, name, function, *args):
        try:
            result = function(*args)
        except Exception:  # recorded; the test names the check and shows the traceback
            result = {"ok": False, "detail": traceback.format_exc()[-3000:]}
        self.results[name] = result
        return result


def logits_match(reference, model, vocab):
    ids, mask = inputs(1, vocab)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits
    return close(got, expected, atol=1e-5, rtol=1e-5)


def generation_identical(reference, model, vocab):
    ids, mask = inputs(2, vocab)
    greedy = dict(do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=mask, **greedy).tolist()
        got = model.generate(ids, attention_mask=mask, **greedy).tolist()
    return {"ok": got == expected, "detail": f"tensor parallel {got} vs single process {expected}"}


# Static caches size their layers from the first keys they get (the rank's heads) since 4.57; before, from the
# config's full head count, which a sharded model does not have.
STATIC_CACHE_FOLLOWS_KEYS = hasattr(getattr(transformers.cache_utils, "StaticLayer", None), "lazy_initialization")


def static_generation_identical(reference, model, vocab):
    ids, mask = inputs(4, vocab)
    greedy = dict(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=mask, **greedy).tolist()
        got = model.generate(ids, attention_mask=mask, **greedy).tolist()
    return {"ok": got == expected, "detail": f"tensor parallel {got} vs single process {expected}"}


# GLM-4V: prompts with the image placeholder (the golden checkpoints' ids: [gMASK] <sop> <|user|> "\n", boi,
# placeholder, eoi, text, <|assistant|>), left-padded, one image each. The vision tower stays replicated.
IMAGE_PROMPT_HEAD, IMAGE_PROMPT_TAIL = [500, 502, 505, 201, 508, 498, 509], [506]


def image_inputs(seed, image_size):
    generator = torch.Generator().manual_seed(seed)
    rows = [IMAGE_PROMPT_HEAD + torch.randint(3, 495, (n,), generator=generator).tolist() + IMAGE_PROMPT_TAIL
            for n in (2, 6)]
    length = max(len(row) for row in rows)
    ids = torch.tensor([[0] * (length - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (length - len(row)) + [1] * len(row) for row in rows])
    images = torch.randn(2, 3, image_size, image_size, generator=generator)
    return ids, mask, images


def image_logits_match(reference, model, image_size):
    ids, mask, images = image_inputs(5, image_size)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, images=images).logits
        got = model(input_ids=ids, attention_mask=mask, images=images).logits
    return close(got, expected, atol=1e-5, rtol=1e-5)


def image_generation_identical(reference, model, image_size):
    ids, mask, images = image_inputs(6, image_size)
    greedy = dict(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=mask, images=images, **greedy).tolist()
        got = model.generate(ids, attention_mask=mask, images=images, **greedy).tolist()
    return {"ok": got == expected, "detail": f"tensor parallel {got} vs single process {expected}"}


def image_training_step_gradients(reference, model, parallel, image_size):
    """The loss with images and every gradient, the replicated vision tower's included."""
    ids, mask, images = image_inputs(7, image_size)
    labels = ids.masked_fill(mask == 0, -100)
    return training_step_gradients(reference, model, parallel, None, (ids, mask, labels, images))


def per_rank_sizes(model, parallel):
    """Each attention module holds the rank's head counts, and the sharded weights have the matching shapes."""
    config, tp = model.config, model._chatglm_tp.sizes.tp_size
    sizes = model._chatglm_tp.sizes
    attention = model.transformer.encoder.layers[0].self_attention
    rank = model._chatglm_tp.mesh.get_local_rank()
    expected_kv = max(config.num_key_value_heads // tp, 1)
    qkv_rows = (sizes.num_heads + 2 * expected_kv) * config.kv_channels
    mlp = model.transformer.encoder.layers[0].mlp
    facts = {
        "heads": (attention.sizes.num_heads, config.num_attention_heads // tp),
        "kv_heads": (attention.sizes.num_kv_heads, expected_kv),
        "qkv_rows": (attention.query_key_value.weight.shape[0], qkv_rows),
        "dense_columns": (attention.dense.weight.shape[1], config.num_attention_heads * config.kv_channels // tp),
        "gate_up_rows": (mlp.dense_h_to_4h.weight.shape[0], 2 * config.ffn_hidden_size // tp),
        "down_columns": (mlp.dense_4h_to_h.weight.shape[1], config.ffn_hidden_size // tp),
        "kv_group": (parallel.kv_heads_of_rank(rank, config.num_key_value_heads, tp)[0],
                     rank * config.num_key_value_heads // tp),
    }
    bad = {k: v for k, v in facts.items() if v[0] != v[1]}
    return {"ok": not bad, "detail": f"rank {rank}: {facts}"}


def state_dict_round_trip(reference, model, parallel):
    """The shards reassemble into the checkpoint's tensors exactly (what save_pretrained(state_dict=...) writes)."""
    full = parallel.full_state_dict(model)
    expected = reference.state_dict()
    wrong = [k for k in expected if k not in full or full[k].shape != expected[k].shape
             or not torch.equal(full[k], expected[k])]
    return {"ok": not wrong and set(full) == set(expected), "detail": f"differing keys: {wrong[:5]}"}


def save_and_reload(reference, model, folder, variant):
    """save_pretrained on every rank writes the checkpoint layout once; a plain load of it is the reference model."""
    model.save_pretrained(folder)
    reloaded = load(folder, variant)
    same = all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), reference.state_dict().values()))
    return {"ok": same and reloaded.state_dict().keys() == reference.state_dict().keys(), "detail": str(folder)}


def training_step_gradients(reference, model, parallel, vocab, batch=None):
    if batch is None:
        ids, mask = inputs(3, vocab)
        batch = (ids, mask, ids.masked_fill(mask == 0, -100), None)
    ids, mask, labels, images = batch
    extra = {"images": images} if images is not None else {}
    losses = []
    for m in (reference, model):
        m.train()
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, attention_mask=mask, labels=labels, **extra)
        out.loss.backward()
        losses.append(out.loss.detach())
        m.eval()
    expected = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}  # (no image: no vision)
    got = parallel.full_gradients(model)
    problems = [] if set(got) == set(expected) else [f"keys differ: {set(got) ^ set(expected)}"]
    worst = 0.0
    for name, grad in expected.items():
        if name in got:
            result = close(got[name], grad, atol=1e-5, rtol=1e-4)
            worst = max(worst, max_diff(got[name], grad))
            if not result["ok"]:
                problems.append(f"{name}: {result['detail']}")
    loss = close(losses[1], losses[0], atol=1e-6, rtol=1e-6)
    if not loss["ok"]:
        problems.append(f"loss: {loss['detail']}")
    return {"ok": not problems, "detail": f"worst |diff| {worst:.2e}; " + "; ".join(problems)[:2000]}


def replicas_agree(model):
    """With more ranks than key/value heads, the ranks sharing a head hold the same rows and, after backward, the same
    gradient for them."""
    sizes, mesh = model._chatglm_tp.sizes, model._chatglm_tp.mesh
    if sizes.kv_replicas == 1:
        return {"ok": True, "detail": "no replicated key/value heads at this size"}
    qkv = model.transformer.encoder.layers[0].self_attention.query_key_value
    kv_rows = slice(sizes.num_heads * model.config.kv_channels, None)
    tp, kv_heads = sizes.tp_size, model.config.num_key_value_heads
    problems = []
    for label, tensor in (("weight", qkv.weight.detach()), ("grad", qkv.weight.grad)):
        shards = [torch.empty_like(tensor) for _ in range(tp)]
        dist.all_gather(shards, tensor.contiguous(), group=mesh.get_group())
        for rank in range(tp):
            holder = rank * kv_heads // tp
            first = next(r for r in range(tp) if r * kv_heads // tp == holder)
            if not torch.equal(shards[rank][kv_rows], shards[first][kv_rows]):
                problems.append(f"{label}: rank {rank} differs from rank {first}")
    return {"ok": not problems, "detail": "; ".join(problems) or f"{sizes.kv_replicas} ranks per key/value head agree"}


# ----------------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------------


def check_variant(variant, folder, vocab, parallel, mesh, grid_size, scratch, image_size=None):
    checks = Checks()
    reference = load(folder, variant)

    # 1. from_pretrained(tp_plan="auto"): the loading path under torchrun (it initialises the process group itself).
    loaded = {}

    def load_auto():
        loaded["model"] = load(folder, variant, tp_plan="auto")
        sharded = getattr(loaded["model"], "_chatglm_tp", None) is not None
        return {"ok": sharded, "detail": f"{type(loaded['model']).__name__}, sharded: {sharded}"}

    auto = checks.run("auto_loads", load_auto)
    if not dist.is_initialized():  # the auto path failed before initialising it: the explicit API still runs
        dist.init_process_group("gloo")
    if auto["ok"]:
        checks.run("auto_sizes", per_rank_sizes, loaded["model"], parallel)
        checks.run("auto_logits", logits_match, reference, loaded["model"], vocab)
        checks.run("auto_generation", generation_identical, reference, loaded["model"], vocab)

    # 2. The explicit API on a model loaded normally.
    mesh = mesh or parallel.make_tp_mesh(None, "cpu")
    model = parallel.tensor_parallel(load(folder, variant), mesh)
    checks.run("sizes", per_rank_sizes, model, parallel)
    checks.run("logits", logits_match, reference, model, vocab)
    checks.run("generation", generation_identical, reference, model, vocab)
    if STATIC_CACHE_FOLLOWS_KEYS:
        checks.run("static_generation", static_generation_identical, reference, model, vocab)
    checks.run("state_dict", state_dict_round_trip, reference, model, parallel)
    checks.run("save", save_and_reload, reference, model, scratch / f"saved_{variant.replace('-', '_')}", variant)
    checks.run("gradients", training_step_gradients, reference, model, parallel, vocab)
    checks.run("replicas", replicas_agree, model)
    if image_size:  # GLM-4V: the same language-model plan, images spliced in, the vision tower replicated
        checks.run("image_logits", image_logits_match, reference, model, image_size)
        checks.run("image_generation", image_generation_identical, reference, model, image_size)
        checks.run("image_gradients", image_training_step_gradients, reference, model, parallel, image_size)

    # 3. A (data parallel x tensor parallel) grid: tp_size smaller than the world.
    if grid_size:
        grid = load(folder, variant, tp_plan="auto", tp_size=grid_size) if auto["ok"] else \
            parallel.tensor_parallel(load(folder, variant), grid_size)
        checks.run("grid_logits", logits_match, reference, grid, vocab)
    return checks.results, mesh


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    results_dir = Path(sys.argv[2])
    guard_collectives()
    parallel = import_parallel(spec["parallel_file"])
    results, mesh = {}, None
    for variant, info in spec["variants"].items():
        results[variant], mesh = check_variant(variant, info["folder"], info["vocab"], parallel, mesh,
                                               spec.get("grid_size"), results_dir, info.get("image_size"))
    results["guard"] = {"rejects_non_contiguous": guard_rejects_non_contiguous(), "calls": dict(CALLS)}
    rank = dist.get_rank()
    (results_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
