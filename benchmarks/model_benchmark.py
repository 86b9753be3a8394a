#!/usr/bin/env python
"""Speed and memory of the fork's model against transformers' own GlmForCausalLM holding the same weights.

    python benchmarks/model_benchmark.py                      # CPU: a random GLM-4-shaped model (155M), built here
    python benchmarks/model_benchmark.py --threads 1 --clock cpu      # on a machine shared with other work
    python benchmarks/model_benchmark.py --model /path/to/glm-4-9b-chat --device cuda
    python benchmarks/model_benchmark.py --preset glm-4-9b --device cuda --in-memory     # scripts/gpu_checks.sh

Both models load from checkpoints on disk (the fork's through trust_remote_code from a folder holding this repository's
code, the native one converted by tools/chatglm_tools/native_glm.py), or with --in-memory are built in device memory
from the same random weights (seconds for a 9B model on a GPU, where writing its checkpoints takes minutes and most of
the disk). They run in this process with `sdpa` attention, measured in interleaved rounds (fork first, then native
first, ...). Each line prints both medians and `ratio` = native cost / fork cost (time or bytes; for rates fork /
native): >= 1.00 means the fork is at least as fast or as small. `rounds` is the spread of the per-round ratios, the
noise a ratio is to be read against.

Sections: KV bytes the cache keeps alive (every storage counted once, against the theory); prefill time and peak
tensor memory; single-sequence decode at several contexts and how its cost grows with the context; batched decode;
generate() with dynamic and static caches (both models must produce the same tokens; the first call with a static
cache, in which transformers compiles on CUDA, apart); the operators and kernels of one batched decode step, and of one
layer in a bs=1 step; int4: the fork model stored as chatglm2-6b-int4 stores its weights, on each of its kernels,
against the same weights dequantized in the device's fastest float dtype (in that section the "native" column is that
twin: bytes held, decode and prefill time, and the previous int4 forward as a baseline); load and
long-prefill memory of fresh processes (RSS); decode against the memory bandwidth: weights + KV bytes read per step
over the step time, against a STREAM-like copy measured in the same run, against the model's own matrix-vector
products timed alone (what torch's kernels reach on these weights), and torch.compile'd decode, also replayed as CUDA
graphs. Decode steps run on caches filled with random keys and values to the wanted context (their values do not
change the work). weights: the NaN/inf check from_pretrained runs over every floating weight, timed against the
load it follows in the same run. --json writes every number; a Markdown table ends the output.
transformers < 4.46 has no GlmForCausalLM: the fork's numbers are printed alone.
"""
import argparse
import atexit
import contextlib
import gc
import inspect
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Remote code is imported from a fresh modules cache (set before transformers reads it), removed at exit.
_MODULES_CACHE = tempfile.mkdtemp(prefix="chatglm-benchmark-modules-")
os.environ["HF_MODULES_CACHE"] = _MODULES_CACHE
atexit.register(shutil.rmtree, _MODULES_CACHE, True)

import torch  # noqa: E402
import transformers  # noqa: E402
from packaging.version import Version  # noqa: E402

from chatglm_tools import CODE_FILES, held_bytes, kv_cache, native_glm  # noqa: E402

TRANSFORMERS = Version(transformers.__version__)
HAS_NATIVE = hasattr(transformers, "GlmForCausalLM")
PRESETS = {
    # GLM-4's shape (grouped keys/values, half-rotary, SwiGLU) at 155M parameters: 8 layers.
    "small": dict(num_layers=8, hidden_size=1024, num_attention_heads=16, kv_channels=64, multi_query_group_num=2,
                  ffn_hidden_size=2816, padded_vocab_size=32768, seq_length=8192),
    "glm-4-9b": {},  # config.json as it is (glm-4-9b-chat)
    # chatglm2-6b's sizes (6.24B) in GLM-4's config, for the int4 rows (chatglm2-6b-int4 stores these layers in 4 bits)
    "chatglm2-6b-int4": dict(num_layers=28, hidden_size=4096, num_attention_heads=32, kv_channels=128,
                             multi_query_group_num=2, ffn_hidden_size=13696, padded_vocab_size=65024, seq_length=32768),
    "tiny": dict(num_layers=2, hidden_size=128, num_attention_heads=4, kv_channels=32, multi_query_group_num=2,
                 ffn_hidden_size=256, padded_vocab_size=1024, seq_length=1024),  # --quick
}
MIB = 2 ** 20


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints and models


def dtype_kwarg(dtype) -> dict:
    return {"dtype": dtype} if TRANSFORMERS >= Version("4.56") else {"torch_dtype": dtype}


def with_code(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in CODE_FILES:
        shutil.copy(REPO / name, folder / name)
    return folder


def random_fork(folder: Path, preset: str, dtype, **from_config_kwargs):
    """This repository's model with random weights (every one explicit: 5.x leaves initialisation to loading), built
    from glm-4-9b-chat's config.json with `preset`'s sizes, which `folder` gets with the code files."""
    config = json.loads((REPO / "config.json").read_text())
    config.update(PRESETS[preset])
    config.update(num_hidden_layers=config["num_layers"], pad_token_id=0, eos_token_id=2)
    with_code(folder)
    (folder / "config.json").write_text(json.dumps(config))
    model_config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config, trust_remote_code=True, **dtype_kwarg(dtype),
                                                          **from_config_kwargs)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if "layernorm" in name else torch.randn_like(param) * 0.02)
    return model


def build_random_checkpoints(workdir: Path, preset: str, checkpoint_dtype) -> tuple:
    """A random checkpoint in the original layout with this repository's code, and its native twin."""
    fork = workdir / "fork"
    model = random_fork(fork, preset, checkpoint_dtype)
    model.save_pretrained(fork)  # config, generation config and code; the weights as the native twin's are:
    for written in fork.glob("model*.safetensors*"):  # one shard per layer, so that loading maps the same bytes
        written.unlink()
    native_glm.save_by_layer(model.state_dict(), fork)
    with_code(fork)
    return fork, save_native(model, workdir)


def build_in_memory(preset: str, dtype, device: str) -> dict:
    """--in-memory: both models built in device memory from the same random weights, no checkpoint written (a 9B
    model's three checkpoints cost minutes of disk I/O and most of a lent GPU machine's disk). The fork's class comes
    from a folder holding only config.json and this repository's code."""
    folder = Path(tempfile.mkdtemp(prefix="chatglm-benchmark-code-"))
    atexit.register(shutil.rmtree, folder, True)
    with torch.device(device), default_dtype(dtype):
        fork = random_fork(folder / "fork", preset, dtype, attn_implementation="sdpa").eval()
        models = {"fork": fork}
        if HAS_NATIVE:
            models["native"] = native_glm.native_glm(fork, attn_implementation="sdpa", dtype=dtype)
    return models


@contextlib.contextmanager
def default_dtype(dtype):
    """Parameters created inside are of `dtype` (a 9B model is never built in float32 first)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def link_checkpoint(source: Path, workdir: Path) -> tuple:
    """--model PATH: the checkpoint's files linked beside this repository's code, and a native conversion."""
    fork = workdir / "fork"
    fork.mkdir(parents=True)
    for item in source.iterdir():
        if item.suffix != ".py":
            (fork / item.name).symlink_to(item.resolve())
    with_code(fork)
    model = transformers.AutoModelForCausalLM.from_pretrained(fork, trust_remote_code=True, **dtype_kwarg("auto"))
    return fork, save_native(model, workdir)


def save_native(model, workdir: Path):
    if not HAS_NATIVE:
        return None
    return native_glm.save_native_checkpoint(model, workdir / "native")


def load(kind: str, folder: Path, dtype, device: str):
    kwargs = dict(dtype_kwarg(dtype), attn_implementation="sdpa")
    if device != "cpu":
        kwargs["device_map"] = device
    if kind == "fork":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs)
    else:
        model = transformers.GlmForCausalLM.from_pretrained(folder, **kwargs)
    return model.eval()


def kv_sizes(model):
    """(layers, key/value heads, head dim) from either model's config."""
    config = model.config
    if hasattr(config, "multi_query_group_num"):
        heads = config.multi_query_group_num if config.multi_query_attention else config.num_attention_heads
        return config.num_layers, heads, config.kv_channels
    return config.num_hidden_layers, config.num_key_value_heads, config.head_dim


def kv_theory(model, batch: int, length: int) -> int:
    layers, heads, dim = kv_sizes(model)
    return kv_cache.theory_bytes(layers, batch, heads, length, dim, model.dtype)


def new_cache(model, kind: str, batch: int, max_length: int):
    if kind == "static":
        return kv_cache.new_static_cache(model.config, batch, max_length, model.device, model.dtype)
    from transformers import DynamicCache

    if "config" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(config=model.config)
    return DynamicCache()


def filled_cache(model, kind: str, batch: int, context: int, max_length: int, generator):
    """A cache holding `context` positions of random keys and values, as a prefill of that length leaves it."""
    cache = new_cache(model, kind, batch, max_length)
    layers, heads, dim = kv_sizes(model)
    positions = torch.arange(context, device=model.device)
    for layer in range(layers):  # drawn where they are kept (a 9B model's caches would take seconds on the host)
        keys, values = (torch.randn(batch, heads, context, dim, generator=generator, device=generator.device,
                                    dtype=model.dtype) for _ in range(2))
        cache.update(keys, values, layer, {"cache_position": positions})
    return cache


def last_logit_kwargs(model) -> dict:
    params = inspect.signature(model.forward).parameters
    if "logits_to_keep" in params:
        return {"logits_to_keep": 1}
    return {"num_logits_to_keep": 1} if "num_logits_to_keep" in params else {}


def random_ids(batch: int, length: int, seed: int, device) -> torch.Tensor:
    return torch.randint(3, 1000, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)


# ---------------------------------------------------------------------------------------------------------------------
# Measuring


class Clock:
    """Seconds a call takes: wall time, or (`cpu`) the process's CPU time, which time slices given to other
    processes on a shared machine do not inflate (meaningful with --threads 1; wall time on CUDA)."""

    def __init__(self, device: str, kind: str):
        self.cuda = device.startswith("cuda")
        self.now = time.process_time if kind == "cpu" and not self.cuda else time.perf_counter

    def __call__(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        start = self.now()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        return self.now() - start


@contextlib.contextmanager
def peak_tensor_bytes(device: str):
    """Peak bytes of tensors allocated inside the block over what was allocated before it (CUDA: the allocator's
    statistics; CPU: the profiler's allocation events, which malloc's own caching does not blur)."""
    result = {}
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        yield result
        torch.cuda.synchronize()
        result["peak"] = torch.cuda.max_memory_allocated() - start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    result["peak"] = peak


def proc_status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak_rss():
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from the current RSS


def interleaved(rounds: int, models: dict, measure) -> dict:
    """measure(name, model) once per model per round, alternating which goes first."""
    names = list(models)
    values = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            values[name].append(measure(name, models[name]))
    return values


class Results:
    def __init__(self):
        self.rows = []

    def add(self, section, metric, unit, values: dict, higher_is_better=False, note=None, **extra):
        """values: per-model lists of per-round numbers (paired by round)."""
        fork = values["fork"]
        row = dict(section=section, metric=metric, unit=unit, fork=statistics.median(fork), fork_rounds=fork)
        native = values.get("native")
        if native:
            row.update(native=statistics.median(native), native_rounds=native)
            row["ratio"] = row["fork"] / row["native"] if higher_is_better else row["native"] / row["fork"]
            ratios = [(f / n if higher_is_better else n / f) for f, n in zip(fork, native) if f and n]
            row["noise"] = (min(ratios), max(ratios)) if len(ratios) > 1 else None
        if note:
            row["note"] = note
        row.update(extra)
        self.rows.append(row)
        print(format_row(row), flush=True)
        return row


def format_value(value, unit) -> str:
    if unit in ("MiB", "MB"):
        return f"{value:.1f}"
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"


def format_row(row) -> str:
    text = f"  {row['metric']:<50} fork {format_value(row['fork'], row['unit']):>7} {row['unit']:<8}"
    if "native" in row:
        text += f" native {format_value(row['native'], row['unit']):>7}  ratio {row['ratio']:.2f}"
        if row.get("noise"):
            text += f" (rounds {row['noise'][0]:.2f}..{row['noise'][1]:.2f})"
    return text + (f"  {row['note']}" if row.get("note") else "")


# ---------------------------------------------------------------------------------------------------------------------
# Sections


def kv_memory(results, models, args):
    """Storage the cache keeps alive after a prefill and after decode steps, against keys + values alone."""
    prompt, steps = args.prefill, 4
    ids = random_ids(1, prompt + steps, 1, args.device)
    for kind in ("dynamic", "static"):
        held = {}
        for name, model in models.items():
            cache = new_cache(model, kind, 1, prompt + steps)
            with torch.no_grad():
                cache = kv_cache.returned(model(input_ids=ids[:, :prompt], **kv_cache.argument(cache), use_cache=True,
                                                **last_logit_kwargs(model)))
                held[name] = [kv_cache.held_bytes(cache)]
                for step in range(prompt, prompt + steps):
                    cache = kv_cache.returned(model(input_ids=ids[:, step:step + 1], **kv_cache.argument(cache),
                                                    use_cache=True, **last_logit_kwargs(model)))
                held[name].append(kv_cache.held_bytes(cache))
            del cache
            gc.collect()
        fork = models["fork"]
        for index, when in enumerate(("after prefill", f"after {steps} decode steps")):
            length = prompt + steps if kind == "static" or index else prompt
            theory = kv_theory(fork, 1, length)
            note = "held / theory: " + ", ".join(f"{name} {held[name][index] / theory:.3f}" for name in models)
            results.add("KV memory", f"{kind} cache {when} {prompt} (theory {theory / 1e6:.2f} MB)", "MB",
                        {name: [held[name][index] / 1e6] for name in models}, note=note,
                        held_over_theory={name: held[name][index] / theory for name in models})


def prefill(results, models, args, clock):
    def run(model, ids):
        with torch.no_grad():
            return model(input_ids=ids, use_cache=True, **last_logit_kwargs(model))

    timed_ids = random_ids(1, args.prefill_timed, 2, args.device)
    for model in models.values():
        run(model, timed_ids)  # warm-up
    times = interleaved(args.rounds, models, lambda name, model: clock(lambda: run(model, timed_ids)) * 1e3)
    results.add("prefill", f"prefill {args.prefill_timed} tokens", "ms", times)

    ids = random_ids(1, args.prefill, 3, args.device)

    def peak(name, model):
        gc.collect()
        with peak_tensor_bytes(args.device) as measured:
            out = run(model, ids)
            del out
        return measured["peak"] / MIB

    results.add("prefill", f"prefill {args.prefill}: peak tensor memory (cache included)", "MiB",
                interleaved(1, models, peak))

    # A left-padded batch: the attention mask is materialised (issue 48: the original's float32 [batch, q, q] mask
    # was built beside it, for nothing); a quarter of three rows is padding.
    batch, length = 4, args.prefill // 4
    padded = random_ids(batch, length, 6, args.device)
    mask = torch.ones_like(padded)
    mask[1:, : length // 4] = 0

    def padded_peak(name, model):
        gc.collect()
        with peak_tensor_bytes(args.device) as measured, torch.no_grad():
            out = model(input_ids=padded, attention_mask=mask, use_cache=True, **last_logit_kwargs(model))
            del out
        return measured["peak"] / MIB

    results.add("prefill", f"prefill {batch} x {length}, left-padded: peak tensor memory (cache included)", "MiB",
                interleaved(1, models, padded_peak))


def decode_step_times(models, args, clock, kind, batch, context) -> dict:
    """Seconds per decode step on a cache holding `context` positions (the first step, which sets up lazily
    allocated state, untimed)."""
    generator = torch.Generator(device=args.device).manual_seed(4)
    tokens = random_ids(batch, args.steps, 5, args.device)

    def measure(name, model):
        cache = filled_cache(model, kind, batch, context, context + args.steps, generator)
        with torch.no_grad():
            model(input_ids=tokens[:, :1], **kv_cache.argument(cache), use_cache=True)
            seconds = clock(lambda: [model(input_ids=tokens[:, i:i + 1], **kv_cache.argument(cache), use_cache=True)
                                     for i in range(1, args.steps)])
        return seconds / (args.steps - 1)

    return interleaved(args.rounds, models, measure)


def decode(results, models, args, clock):
    for kind in ("dynamic", "static"):
        per_context = {}
        for context in args.contexts:
            times = decode_step_times(models, args, clock, kind, 1, context)
            per_context[context] = {name: [t * 1e3 for t in values] for name, values in times.items()}
            results.add("decode", f"decode bs=1, {kind} cache, context {context}", "ms/step", per_context[context])
        first, last = args.contexts[0], args.contexts[-1]
        growth = {name: [b / a for a, b in zip(per_context[first][name], per_context[last][name])] for name in models}
        results.add("decode", f"decode growth {last}/{first}, {kind} cache", "x", growth)
    for batch in args.batch:
        for kind in ("dynamic", "static"):
            times = decode_step_times(models, args, clock, kind, batch, args.batch_context)
            results.add("decode", f"batched decode bs={batch}, {kind} cache, context {args.batch_context}",
                        "tokens/s", {name: [batch / t for t in values] for name, values in times.items()},
                        higher_is_better=True)


QUANTIZED_LAYERS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")  # what the original quantizes


def int4_pair(model) -> dict:
    """The fork model with its blocks' linear layers stored as chatglm2-6b-int4 stores them (quantization_chatglm.py,
    the original's quantize(4) arithmetic), and beside it the same model holding those weights dequantized."""
    import copy

    modeling = sys.modules[type(model).__module__]
    QuantizedLinear = modeling.import_companion("quantization_chatglm", model.config).QuantizedLinear
    quantized, dequantized = copy.deepcopy(model), copy.deepcopy(model)
    for name, module in model.transformer.encoder.named_modules():
        if name.rsplit(".", 1)[-1] in QUANTIZED_LAYERS and isinstance(module, torch.nn.Linear):
            layer = QuantizedLinear.from_float(module, 4)
            parent, child = name.rsplit(".", 1)  # (Module.set_submodule arrived in torch 2.5)
            setattr(quantized.transformer.encoder.get_submodule(parent), child, layer)
            with torch.no_grad():
                dequantized.transformer.encoder.get_submodule(name).weight.copy_(
                    layer.dequantized_weight(module.weight.dtype))
    quantized.config.quantization_bit = 4
    return {"fork": quantized, "native": dequantized}


def dequantize_every_step(layer, x):
    """The int4 forward before issue 38: the whole [out, in] float weight rebuilt from the codes at every call."""
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return torch.nn.functional.linear(x, layer.dequantized_weight(x.dtype), bias)


def int4_variants(model, device: str) -> dict:
    """The int4 model's kernels and their twin, the same weights dequantized in the device's fastest float dtype
    (fp32 on a CPU without AMX, fp16 on a GPU): "today" (the forward before issue 38, in the twin's dtype), "exact"
    (the default in fp32), "packed bf16" (the default of a bf16 model) and on a CPU "packed fp32" (the fp32 opt-in)."""
    import copy
    import types

    pair = int4_pair(model)
    fast = torch.float16 if device.startswith("cuda") else torch.float32
    quantized = pair["fork"]
    variants = {"twin": pair["native"].to(fast)}
    today = copy.deepcopy(quantized).to(fast)
    for module in today.modules():
        if hasattr(module, "weight_scale"):
            module.forward = types.MethodType(dequantize_every_step, module)
    variants["today"] = today
    variants["exact"] = copy.deepcopy(quantized).to(fast)
    variants["exact"].use_quantized_kernel("exact")
    kernels = [("packed bf16", torch.bfloat16)] + ([("packed fp32", torch.float32)] if device == "cpu" else [])
    for name, dtype in kernels:
        variant = copy.deepcopy(quantized).to(dtype)
        if variant.use_quantized_kernel("packed"):  # ValueError where torch has no int4 kernel for the device
            variants[name] = variant
    del pair, quantized
    return variants


def int4(results, models, args, clock):
    """A pre-quantized int4 model (chatglm2-6b-int4's storage) on each kernel against its float twin (int4_variants),
    every ratio in one run: bytes held against the twin in fp16 (target <= 0.35x: ratio >= 2.86), decode bs=1 (target
    1.5x as fast as the twin for the packed kernel; exact >= 3x today's), prefill (target <= 1.5x the twin's time:
    ratio >= 0.67)."""
    try:
        variants = int4_variants(models["fork"], args.device)
    except ValueError as error:  # no int4 kernel in this torch for the device
        print(f"  skipped: {error}", flush=True)
        return
    twin = variants["twin"]
    fp16_bytes = sum(t.numel() * (2 if t.is_floating_point() else t.element_size())
                     for t in [*twin.parameters(), *twin.buffers()])
    for name, model in variants.items():
        if name.startswith("packed"):
            results.add("int4", f"int4 {name}: held (parameters, buffers, packed bytes) vs the same weights in fp16",
                        "MiB", {"fork": [held_bytes(model) / MIB], "native": [fp16_bytes / MIB]},
                        note="target ratio >= 2.86 (0.35x of fp16)")
    context = args.contexts[0]
    times = decode_step_times(variants, args, clock, "dynamic", 1, context)
    ms = {name: [t * 1e3 for t in values] for name, values in times.items()}
    for name in variants:
        if name != "twin":
            results.add("int4", f"int4 decode bs=1 {name} vs dequantized twin, context {context}", "ms/step",
                        {"fork": ms[name], "native": ms["twin"]}, note=f"twin: {twin.dtype}")
    results.add("int4", f"int4 decode bs=1 exact vs today's (dequantize every step), context {context}", "ms/step",
                {"fork": ms["exact"], "native": ms["today"]}, note="target ratio >= 3")
    ids = random_ids(1, args.prefill_timed, 2, args.device)

    def prefill_ms(name, model):
        with torch.no_grad():
            return clock(lambda: model(input_ids=ids, use_cache=True, **last_logit_kwargs(model))) * 1e3

    for model in variants.values():
        prefill_ms(None, model)  # warm-up
    prefill_times = interleaved(args.rounds, {name: variants[name] for name in variants if name != "today"},
                                prefill_ms)
    for name in prefill_times:
        if name != "twin":
            results.add("int4", f"int4 prefill {args.prefill_timed} tokens {name} vs dequantized twin", "ms",
                        {"fork": prefill_times[name], "native": prefill_times["twin"]},
                        note="target ratio >= 0.67 (1.5x the twin's time)")
    if args.device.startswith("cuda") and "compiled" in args.sections and "packed bf16" in variants:
        pair = {"fork": variants["packed bf16"], "native": twin}
        moved = {name: decode_weight_bytes(model) + kv_theory(model, 1, context) for name, model in pair.items()}
        bandwidth, _ = memory_bandwidth(args.device, clock, max(3, args.rounds))
        times = compiled_decode(results, pair, moved, args, clock, "int4 packed bf16 vs fp16 twin", bandwidth,
                                "reduce-overhead")
        if times is not None:  # the bandwidth line's ratio is of rates over different bytes: here the time per step
            results.add("int4", f"int4 decode bs=1 packed bf16 vs fp16 twin, CUDA graphs, context {context}", "ms/step",
                        {name: [t * 1e3 for t in values] for name, values in times.items()}, note="target ratio >= 1.5")
    del variants, twin
    gc.collect()


def weight_check(results, models, args, clock, fork_folder=None):
    """The cost of from_pretrained's NaN/inf check of every floating weight (`check_finite_weights`), against the
    load it follows in the same run: from_pretrained of the fork's checkpoint with the check off, then the check on
    the model just loaded (a checkpoint loaded in its own dtype stays memory-mapped on 5.x: the check is then the
    first read of its pages), medians of a few rounds; or with --in-memory, the check against the build of the
    models (no checkpoint is read)."""
    check = sys.modules[type(models["fork"]).__module__].import_companion("checks_chatglm").check_finite_weights
    rounds = max(args.rounds // 2, 1)
    if fork_folder is None:
        loads, what = [args.build_seconds], "building the models in memory"
        times = [clock(lambda: check(models["fork"], "benchmark")) for _ in range(rounds)]
    else:
        kwargs = dict(dtype_kwarg(getattr(torch, args.dtype)), attn_implementation="sdpa", check_finite_weights=False)
        if args.device != "cpu":
            kwargs["device_map"] = args.device
        loads, times, what = [], [], "from_pretrained of the checkpoint"
        for _ in range(rounds):
            loaded = []
            loads.append(clock(lambda: loaded.append(
                transformers.AutoModelForCausalLM.from_pretrained(fork_folder, trust_remote_code=True, **kwargs))))
            times.append(clock(lambda: check(loaded[0], "benchmark")))
            del loaded
            gc.collect()
    load_seconds = statistics.median(loads)
    share = statistics.median(times) / load_seconds
    results.add("weights", "NaN/inf weight check after loading", "ms", {"fork": [t * 1e3 for t in times]},
                note=f"{share:.1%} of {what} ({load_seconds:.2f} s)", share_of_load=share, load_seconds=load_seconds)


def generate(results, models, args, clock):
    ids = random_ids(1, args.gen_prompt, 6, args.device)
    kwargs = dict(max_new_tokens=args.gen_new, min_new_tokens=args.gen_new, do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    for kind in ("dynamic", "static"):
        extra = {"cache_implementation": "static"} if kind == "static" else {}
        outputs = {}

        def run(name, model):
            with torch.no_grad():
                outputs[name] = model.generate(ids, **kwargs, **extra)

        # The first call apart: on CUDA transformers compiles the forward for a static cache there.
        first = {name: [clock(lambda: run(name, model))] for name, model in models.items()}
        if kind == "static":
            results.add("generate", f"generate {args.gen_prompt}+{args.gen_new} tokens, static cache: first call",
                        "s", first, note="compiles on CUDA" if args.device.startswith("cuda") else None)
        ms = interleaved(args.rounds, models, lambda name, model: clock(lambda: run(name, model)) * 1e3 / args.gen_new)
        note = None
        if len(outputs) == 2:
            note = "same tokens" if torch.equal(outputs["fork"], outputs["native"]) else "TOKENS DIFFER"
        results.add("generate", f"generate {args.gen_prompt}+{args.gen_new} tokens, {kind} cache", "ms/token", ms,
                    note=note)


def child_memory(args):
    """In a fresh process: load in --load-dtype, then one long prefill; prints RSS growth (KiB), and CUDA memory
    (KiB), as JSON."""
    cuda = args.device.startswith("cuda")
    gc.collect()
    start = proc_status_kib("VmRSS")
    reset_peak_rss()
    model = load(args.child, Path(args.child_folder), getattr(torch, args.load_dtype), args.device)
    gc.collect()
    numbers = dict(load_kept=proc_status_kib("VmRSS") - start, load_peak=proc_status_kib("VmHWM") - start)
    if cuda:
        numbers["cuda_load"] = torch.cuda.memory_allocated() / 1024
    with torch.no_grad():
        model(input_ids=random_ids(1, 8, 7, args.device))  # touches every weight: resident before the peak
        gc.collect()
        before = proc_status_kib("VmRSS")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        reset_peak_rss()
        model(input_ids=random_ids(1, args.prefill, 8, args.device), use_cache=True, **last_logit_kwargs(model))
    numbers["prefill_peak"] = proc_status_kib("VmHWM") - before
    if cuda:
        numbers["cuda_prefill_peak"] = torch.cuda.max_memory_allocated() / 1024 - numbers["cuda_load"]
    print(json.dumps(numbers))


def process_memory(results, folders, args):
    def measure(name, folder):
        command = [sys.executable, __file__, "--child", name, "--child-folder", str(folder), "--load-dtype",
                   args.load_dtype,
                   "--device", args.device, "--prefill", str(args.prefill), "--threads", str(args.threads)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"the memory run of {name} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    runs = interleaved(args.memory_rounds, folders, measure)
    labels = {"load_kept": f"load as {args.load_dtype} ({args.checkpoint_dtype} checkpoint): RSS kept",
              "load_peak": f"load as {args.load_dtype}: peak RSS",
              "prefill_peak": f"{args.load_dtype} prefill {args.prefill}: peak RSS over the loaded model",
              "cuda_load": f"load as {args.load_dtype}: CUDA memory allocated",
              "cuda_prefill_peak": f"{args.load_dtype} prefill {args.prefill}: peak CUDA memory over the model"}
    for key, label in labels.items():
        if key in runs["fork"][0]:
            results.add("process memory", label, "MiB", {name: [r[key] / 1024 for r in rs] for name, rs in runs.items()})


def memory_bandwidth(device: str, clock, rounds: int) -> tuple:
    """Bytes per second of a STREAM 'Copy' (read + written) and of a read-only pass (a sum), best of `rounds`, on
    512 MiB arrays, far beyond the caches; timed with the clock the decode steps use."""
    src = torch.rand((512 * MIB) // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = 2 * src.nbytes / min(clock(lambda: dst.copy_(src)) for _ in range(rounds))
    read = src.nbytes / min(clock(lambda: src.sum()) for _ in range(rounds))
    return copy, read


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter but the embedding table, of which one row."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    return total + embedding.shape[1] * embedding.element_size()


def matrix_vector_seconds(model, batch: int, clock, prepacked: bool = False) -> Optional[float]:
    """The decode step's matrix products alone (every nn.Linear once, on a [batch, 1, in] input, through the module
    as the model calls it: a quantized or packed layer on its own kernel): what torch's kernels take to stream these
    weights, without attention, norms or Python around them. prepacked (CPU): through
    oneDNN with each weight reordered once into its blocked layout, as torch.compile's CPU freezing does: the best
    kernel torch ships for this dtype here, or None where this torch has no such op for it."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(batch, 1, m.in_features, device=model.device, dtype=model.dtype) for m in linears]
    if prepacked:
        try:
            mkldnn = torch.ops.mkldnn
            weights = [mkldnn._reorder_linear_weight(m.weight.detach(), batch) for m in linears]
            product = lambda x, w, m: mkldnn._linear_pointwise(x, w, m.bias, "none", [], "")  # noqa: E731
            product(inputs[0], weights[0], linears[0])
        except (AttributeError, RuntimeError):
            return None
    else:
        weights = [None] * len(linears)
        product = lambda x, w, m: m(x)  # noqa: E731

    def run():
        with torch.no_grad():
            for module, weight, x in zip(linears, weights, inputs):
                product(x, weight, module)

    run()
    return min(clock(run) for _ in range(3))


def hardware_limit(results, loaded, args, clock):
    """loaded(dtype name) -> the models in that dtype."""
    bandwidth, read = memory_bandwidth(args.device, clock, max(3, args.rounds))
    print(f"  copy {bandwidth / 1e9:.1f} GB/s, read {read / 1e9:.1f} GB/s", flush=True)
    context = args.contexts[0]
    for dtype_name in args.limit_dtypes:
        models = loaded(dtype_name)
        moved = {name: decode_weight_bytes(model) + kv_theory(model, 1, context) for name, model in models.items()}
        times = decode_step_times(models, args, clock, "dynamic", 1, context)
        rates = {name: [moved[name] / t / 1e9 for t in values] for name, values in times.items()}
        kernels = moved["fork"] / matrix_vector_seconds(models["fork"], 1, clock) / 1e9
        prepacked = matrix_vector_seconds(models["fork"], 1, clock, prepacked=True) if args.device == "cpu" else None
        prepacked = prepacked and moved["fork"] / prepacked / 1e9
        fork_rate = statistics.median(rates["fork"])
        note = (f"fork: {fork_rate * 1e9 / bandwidth:.0%} of copy ({bandwidth / 1e9:.1f} GB/s), "
                f"{fork_rate * 1e9 / read:.0%} of read ({read / 1e9:.1f} GB/s); its matrix-vector products alone "
                f"{kernels:.1f} GB/s ({kernels * 1e9 / bandwidth:.0%} of copy), the whole step {fork_rate / kernels:.0%} "
                "of that" + (prepacked and f"; oneDNN with prepacked weights {prepacked:.1f} GB/s "
                                           f"({prepacked * 1e9 / bandwidth:.0%} of copy)" or ""))
        results.add("memory bandwidth", f"decode bs=1 {dtype_name}, context {context}: (weights + KV) / step",
                    "GB/s", rates, higher_is_better=True, note=note, copy=bandwidth, read=read,
                    share_of_copy=fork_rate * 1e9 / bandwidth, kernels_share_of_copy=kernels * 1e9 / bandwidth,
                    prepacked_share_of_copy=prepacked and prepacked * 1e9 / bandwidth,
                    bytes_per_step=moved["fork"])
        if "compiled" in args.sections:
            for mode in ("default", "reduce-overhead"):
                compiled_decode(results, models, moved, args, clock, dtype_name, bandwidth, mode)
        del models
        gc.collect()


def compiled_decode(results, models, moved, args, clock, dtype_name, bandwidth, mode="default"):
    """bs=1 decode through torch.compile: one graph per model on a static cache (its positions run on through every
    round, so that no round recompiles), and on CPU inductor's freezing, which prepacks the weights for oneDNN, the
    fast bf16 path the eager matrix-vector product lacks. mode="reduce-overhead" replays each step as a CUDA graph:
    on a GPU, where an eager step is bound by kernel launches, the row that shows the hardware limit (the CPU has no
    CUDA graphs: the same as the default there). A machine without a C++ compiler prints why it skipped."""
    import torch._dynamo
    import torch._inductor.config

    context, total = args.contexts[0], 2 + args.rounds * args.steps
    generator = torch.Generator(device=args.device).manual_seed(4)
    tokens = random_ids(1, total, 5, args.device)
    state = {}
    for name, model in models.items():
        cache = filled_cache(model, "static", 1, context, context + total, generator)
        state[name] = dict(cache=cache, step=torch.compile(model.forward, dynamic=False, mode=mode), done=0)

    def advance(name):
        run = state[name]
        position = torch.tensor([context + run["done"]], device=args.device)
        kwargs = dict(position_ids=position[None], **kv_cache.argument(run["cache"]), use_cache=True)
        if "cache_position" in inspect.signature(models[name].forward).parameters:
            kwargs["cache_position"] = position
        run["step"](input_ids=tokens[:, run["done"]:run["done"] + 1], **kwargs)
        run["done"] += 1

    try:
        with torch.no_grad(), torch._inductor.config.patch(freezing=args.device == "cpu"):
            for name in models:  # compiles
                advance(name), advance(name)
            times = interleaved(args.rounds, models, lambda name, model: clock(
                lambda: [advance(name) for _ in range(args.steps)]) / args.steps)
    except Exception as error:  # noqa: BLE001 (inductor's errors have no common base; the reason is printed)
        print(f"  compiled decode {dtype_name} ({mode}): skipped ({type(error).__name__}: {str(error)[:200]})",
              flush=True)
        return None
    finally:
        torch._dynamo.reset()
    kv_average = {name: kv_theory(model, 1, context + total // 2) - kv_theory(model, 1, context)
                  for name, model in models.items()}
    rates = {name: [(moved[name] + kv_average[name]) / t / 1e9 for t in values] for name, values in times.items()}
    fork_rate = statistics.median(rates["fork"])
    graphs = ", CUDA graphs" if mode == "reduce-overhead" else ""
    note = (f"fork: {fork_rate * 1e9 / bandwidth:.0%} of copy, "
            f"{statistics.median(times['fork']) * 1e3:.2f} ms/token" + ("" if args.device.startswith("cuda") or
                                                                       not graphs else " (no CUDA graphs on a CPU)"))
    results.add("memory bandwidth", f"compiled decode bs=1 {dtype_name}, static cache{graphs}: (weights + KV) / step",
                "GB/s", rates, higher_is_better=True, note=note, share_of_copy=fork_rate * 1e9 / bandwidth,
                ms_per_token={name: statistics.median(values) * 1e3 for name, values in times.items()})
    return times


def step_profile(results, models, args, clock):
    """What one batched decode step runs (dynamic cache, the largest --batch): torch operators and, on CUDA, kernel
    launches per model, with the operators whose counts differ most. An eager GPU step of a small batch is bound by
    launches, so a difference in counts is a difference in time."""
    from collections import Counter
    from torch.profiler import ProfilerActivity, profile

    batch, context = max(args.batch), args.batch_context
    tokens = random_ids(batch, 2, 5, args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    counts = {}

    def count(model):
        generator = torch.Generator(device=args.device).manual_seed(4)
        cache = filled_cache(model, "dynamic", batch, context, context + 2, generator)
        with torch.no_grad():
            model(input_ids=tokens[:, :1], **kv_cache.argument(cache), use_cache=True)  # lazily set-up state
            with profile(activities=activities) as prof:
                model(input_ids=tokens[:, 1:], **kv_cache.argument(cache), use_cache=True)
        operators, kernels = Counter(), Counter()
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name] += 1
            elif event.name.startswith("aten::"):
                operators[event.name] += 1
        return operators, kernels

    for name, model in models.items():
        counts[name] = count(model)
    # Watched: a no-op forward hook on every module (what DeepSpeed ZeRO-3 and the profilers install) must not change
    # what the fork runs (issue 48).
    fork = models["fork"]
    handles = [module.register_forward_hook(lambda *hook_args: None) for module in fork.modules()]
    try:
        hooked = count(fork)
    finally:
        for handle in handles:
            handle.remove()
    results.add("profile", f"decode step bs={batch}, context {context}, a no-op hook on every module: torch "
                "operators, fork hooked / fork", "count",
                {"fork": [sum(hooked[0].values())], "native": [sum(counts["fork"][0].values())]})
    for index, what in enumerate(("torch operators", "CUDA kernels")):
        if index and not args.device.startswith("cuda"):
            break
        results.add("profile", f"decode step bs={batch}, context {context}: {what}", "count",
                    {name: [sum(c[index].values())] for name, c in counts.items()})
        if "native" in counts:
            fork, native = counts["fork"][index], counts["native"][index]
            differences = sorted(set(fork) | set(native), key=lambda k: -abs(fork[k] - native[k]))[:8]
            for key in differences:
                if fork[key] != native[key]:
                    print(f"    {key[:70]:<70} fork {fork[key]:>5} native {native[key]:>5}", flush=True)


# Operators that only describe other memory (or return their input unchanged): not counted as work.
VIEW_OPERATORS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "permute", "slice", "select",
                  "split", "split_with_sizes", "chunk", "unflatten", "flatten", "expand", "expand_as", "unsqueeze",
                  "squeeze", "as_strided", "t", "alias", "detach", "narrow", "unbind", "view_as", "lift_fresh",
                  "contiguous", "to", "type_as", "resolve_conj", "resolve_neg"}
COPYING_WHEN_NEEDED = {"reshape", "flatten", "contiguous", "to", "type_as"}  # counted where they do copy


def layer_operators(results, models, args, clock):
    """Operators of one decoder layer in a bs=1 decode step (dynamic cache, context --batch-context): the torch
    operators called by the layer itself, not those inside another operator, views and no-op casts left out; on CUDA
    also the kernels it launches. A launch-bound GPU step costs in proportion (targets: <= 24 operators on a CPU,
    <= 25 kernels)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    tokens = random_ids(1, 2, 6, args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    counts = {}
    for name, model in models.items():
        layer = model.transformer.encoder.layers[0] if hasattr(model, "transformer") else model.model.layers[0]
        generator = torch.Generator(device=args.device).manual_seed(4)
        cache = filled_cache(model, "dynamic", 1, args.batch_context, args.batch_context + 2, generator)
        scope = record_function("layer")

        def enter(*_):
            scope.__enter__()

        def leave(*_):
            scope.__exit__(None, None, None)

        hooks = [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
        try:
            with torch.no_grad():
                model(input_ids=tokens[:, :1], **kv_cache.argument(cache), use_cache=True)
                with profile(activities=activities) as prof:
                    model(input_ids=tokens[:, 1:], **kv_cache.argument(cache), use_cache=True)
        finally:
            for hook in hooks:
                hook.remove()
        counts[name] = count_layer_events(prof.events())
        del cache
    results.add("profile", "operators per layer, bs=1 decode step (views and no-op casts left out)", "count",
                {name: [c[0]] for name, c in counts.items()}, note="target <= 24 on a CPU")
    if args.device.startswith("cuda"):
        results.add("profile", "CUDA kernels per layer, bs=1 decode step", "count",
                    {name: [c[1]] for name, c in counts.items()}, note="target <= 25")


def count_layer_events(events) -> tuple:
    """(operators, kernel launches) under the profiler scope "layer"."""
    def inside_layer(event):
        while event is not None:
            if event.name == "layer":
                return True
            event = event.cpu_parent
        return False

    operators = launches = 0
    for event in events:
        if event.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC") and inside_layer(event):
            launches += 1
        if not event.name.startswith("aten::") or not inside_layer(event.cpu_parent):
            continue
        if event.cpu_parent.name.startswith("aten::"):  # inside another operator
            continue
        name = event.name[len("aten::"):]
        copies = name in COPYING_WHEN_NEEDED and any(not c.name[len("aten::"):] in VIEW_OPERATORS
                                                     for c in event.cpu_children)
        operators += name not in VIEW_OPERATORS or copies
    return operators, launches


# ---------------------------------------------------------------------------------------------------------------------


# The x86 instruction sets that decide a CPU's decode kernels (bf16/int8 dot products, AMX tiles); a VM often hides
# some of what the processor has, so they are read from the flags the guest sees.
INSTRUCTION_SETS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")


def instruction_sets() -> str:
    """The CPU's INSTRUCTION_SETS as the tables name them: 'avx2, avx512f; no avx512_bf16, amx_bf16, ...'; '' where
    /proc/cpuinfo is not there to read."""
    with contextlib.suppress(OSError, AttributeError):
        flags = set(re.search(r"flags\s*:\s*(.+)", Path("/proc/cpuinfo").read_text()).group(1).split())
        present = [name for name in INSTRUCTION_SETS if name in flags]
        missing = [name for name in INSTRUCTION_SETS if name not in flags]
        return "; ".join(filter(None, [", ".join(present), missing and "no " + ", ".join(missing)]))
    return ""


def cpu_class() -> str:
    """The CPU classes docs/speed-and-memory.md keeps a table for: 'AVX-512/AMX', 'AVX-512', 'AVX2 only'."""
    sets = instruction_sets().split(";")[0].split(", ")
    if "amx_bf16" in sets:
        return "AVX-512/AMX"
    return "AVX-512" if "avx512f" in sets else "AVX2 only" if "avx2" in sets else "no AVX2"


def machine_line(args) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, AttributeError):
        cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text()).group(1).strip()
        cpu += f" ({cpu_class()}: {instruction_sets()})"
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"{cpu}, {os.cpu_count()} CPUs"
    return (f"{device}; {torch.get_num_threads()} threads, {args.clock} clock; torch {torch.__version__}, "
            f"transformers {transformers.__version__}, Python {platform.python_version()}")


def markdown(results, args, header) -> str:
    lines = [f"{time.strftime('%Y-%m-%d')}, {header}. Compute dtype {args.dtype}; medians of {args.rounds} "
             "interleaved rounds; ratio = native cost / fork cost (rates: fork / native), >= 1.00 means the fork "
             "is at least as fast or as small.", "",
             "| metric | unit | fork | native Glm | ratio | per-round ratios | note |", "|---|---|---|---|---|---|---|"]
    for row in results.rows:
        native = format_value(row["native"], row["unit"]) if "native" in row else ""
        ratio = f"{row['ratio']:.2f}" if "ratio" in row else ""
        noise = f"{row['noise'][0]:.2f}..{row['noise'][1]:.2f}" if row.get("noise") else ""
        lines.append(f"| {row['metric']} | {row['unit']} | {format_value(row['fork'], row['unit'])} | {native} | "
                     f"{ratio} | {noise} | {row.get('note', '')} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a ChatGLM2/3 or GLM-4 checkpoint folder (default: random weights)")
    parser.add_argument("--preset", choices=["small", "glm-4-9b", "chatglm2-6b-int4"], default="small",
                        help="size of the random model (chatglm2-6b-int4: with --sections int4 --in-memory)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--checkpoint-dtype", default="float32", help="dtype the random checkpoint is saved in")
    parser.add_argument("--load-dtype", default="bfloat16", help="dtype of the fresh-process load and prefill")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: process CPU time, robust to other processes on a shared machine (use --threads 1)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per timing")
    parser.add_argument("--memory-rounds", type=int, default=3, help="fresh processes per model for the RSS lines")
    parser.add_argument("--contexts", default="128,2048", help="single-sequence decode contexts, comma-separated")
    parser.add_argument("--steps", type=int, default=9, help="decode steps per round (the first one untimed)")
    parser.add_argument("--batch", default="8", help="batched decode: sequences, comma-separated batch sizes")
    parser.add_argument("--batch-context", type=int, default=128, help="batched decode: context")
    parser.add_argument("--prefill", type=int, default=2048, help="long prefill (KV bytes, peak memory)")
    parser.add_argument("--prefill-timed", type=int, default=512, help="prefill length timed")
    parser.add_argument("--gen-prompt", type=int, default=32)
    parser.add_argument("--gen-new", type=int, default=64)
    parser.add_argument("--limit-dtypes", help="dtypes of the bandwidth lines (default: float32,bfloat16 on CPU)")
    parser.add_argument("--sections", default="kv,prefill,decode,generate,profile,int4,weights,memory,bandwidth,"
                                              "compiled",
                        help="compiled: bandwidth lines of a torch.compile'd decode (with bandwidth; with int4 on "
                             "CUDA the int4 model's CUDA-graph decode); profile: operators and kernels of one batched "
                             "decode step and per layer; int4: a pre-quantized int4 model on each kernel against the "
                             "same weights dequantized (bytes held, decode, prefill); weights: the NaN/inf weight "
                             "check against the load")
    parser.add_argument("--in-memory", action="store_true",
                        help="build both models in device memory from the same random weights, writing no checkpoint "
                             "(no fresh-process memory lines; the bandwidth lines in --dtype only)")
    parser.add_argument("--workdir", type=Path, help="where the checkpoints are written (default: a temporary folder)")
    parser.add_argument("--json", type=Path, help="also write every number to this file")
    parser.add_argument("--quick", action="store_true", help="a tiny model, short runs: checks that everything runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.limit_dtypes = (args.limit_dtypes or ("float32,bfloat16" if args.device == "cpu" else args.dtype)).split(",")
    if args.quick:
        args.preset = "tiny"
        args.rounds, args.memory_rounds, args.steps, args.prefill, args.prefill_timed = 2, 1, 3, 64, 32
        args.contexts, args.batch, args.batch_context, args.gen_prompt, args.gen_new = "16,64", "2,3", 16, 8, 8
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.batch = [int(b) for b in str(args.batch).split(",")]
    if args.in_memory:
        args.limit_dtypes = [args.dtype]  # the models are built once, in the compute dtype
    args.sections = set(args.sections.split(","))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        child_memory(args)
        return 0
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chatglm-benchmark-"))
    dtype = getattr(torch, args.dtype)
    folders = None
    if args.in_memory:
        if args.model is not None:
            raise SystemExit("--in-memory builds random weights: it does not take --model")
        started = time.perf_counter()
        models = build_in_memory(args.preset, dtype, args.device)
        args.build_seconds = time.perf_counter() - started
        header = f"random {args.preset} model, built in memory in {args.build_seconds:.1f} s"
    else:
        if args.model is not None:
            fork_folder, native_folder = link_checkpoint(args.model, workdir)
            args.checkpoint_dtype, header = "saved", args.model.name
        else:
            fork_folder, native_folder = build_random_checkpoints(workdir, args.preset,
                                                                  getattr(torch, args.checkpoint_dtype))
            header = f"random {args.preset} model"
        folders = {"fork": fork_folder, "native": native_folder} if native_folder else {"fork": fork_folder}
        models = {name: load(name, folder, dtype, args.device) for name, folder in folders.items()}
    clock = Clock(args.device, args.clock)
    header += f" ({sum(p.numel() for p in models['fork'].parameters()) / 1e6:.0f}M parameters); {machine_line(args)}"
    print(header if HAS_NATIVE else f"{header}\n(no GlmForCausalLM in transformers {transformers.__version__})",
          flush=True)
    results = Results()
    for section, run in (("kv", kv_memory), ("prefill", prefill), ("decode", decode), ("generate", generate),
                         ("profile", step_profile), ("profile", layer_operators), ("int4", int4)):
        if section in args.sections:
            print(f"{section}:", flush=True)
            run(results, models, args) if section == "kv" else run(results, models, args, clock)
    if "weights" in args.sections:
        print("weights:", flush=True)
        weight_check(results, models, args, clock, folders and folders["fork"])
    if folders is not None:
        del models
        gc.collect()
    if "memory" in args.sections:
        print("fresh processes:", flush=True)
        if folders is None:
            print("  skipped: --in-memory writes no checkpoint to load in a fresh process", flush=True)
        else:
            process_memory(results, folders, args)
    if "bandwidth" in args.sections:
        print("memory bandwidth:", flush=True)
        loaded = (lambda dtype_name: models) if folders is None else (  # noqa: E731
            lambda dtype_name: {name: load(name, folder, getattr(torch, dtype_name), args.device)
                                for name, folder in folders.items()})
        hardware_limit(results, loaded, args, clock)
    print("\n" + markdown(results, args, header))
    if args.json:
        args.json.write_text(json.dumps(dict(header=header, rows=results.rows), indent=1, default=str))
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
