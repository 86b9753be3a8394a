"""Tool checks, on demand (not part of CI): do the tools that patch or replay the original's modules work on ours?

scripts/tools_check.sh builds the environments and runs `python scripts/tools_check.py run` in the OpenVINO
environment, which
  1. builds, per family (GLM-4, ChatGLM3, ChatGLM2), a random-weight checkpoint with head size 128, two query groups,
     the real vocabulary and tokenizer files, weights of a trained model's scale (std 0.02, norms 1) and the code
     files of --code (default: this repository) beside them; with --original-code FAMILY=DIR, a twin with the same
     weights and DIR's files (the original THUDM files, which this repository does not hold);
  2. runs each tool in its own process and environment:
       (a) OpenVINO (optimum-intel): `optimum-cli export openvino --task text-generation-with-past` with
           `--weight-format fp32` and `int8`, and `OVModelForCausalLM.from_pretrained(folder, export=True)`; each
           export runs with `ov_config={"INFERENCE_PRECISION_HINT": "f32"}` on a padded batch of two prompts, against
           what PyTorch gives through transformers (trust_remote_code) in the same environment: greedy tokens and the
           prefill logits of every real (not padding) position;
           (the alone twin: the two optimum-cli exports);
       (b) GPTQModel, 4-bit, group size 32, on the CPU: load, quantize, save, reload, generate (also GPTQModel's own
           generate() without a generation config); how far the reloaded model's logits are from the float model's;
           with an original twin, its quantized tensors against ours;
       (c) AutoRound (the GPTQ environment), 4-bit, group size 32: quantize, save in its own format and in the GPTQ
           format, reload each through transformers, generate; the same distances;
       (d) llm-compressor (its own environment), GPTQ W4A16 (group size 128) with `oneshot`'s default pipeline (the
           sequential one, which traces the model with torch.fx into one subgraph per layer), save compressed, reload
           through transformers, generate; the same distances, and how many subgraphs it traced;
     each fitted method (b-d) must come closer to the float model than plain rounding to its grid on its own
     calibration rows, which it does only when its layer replay gave every layer the inputs the model gives it;
  3. prints one table and exits non-zero when a check of our files fails (the original twin's rows are information).
"""
import argparse
import json
import os
import re
import shutil
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from engines import (FAMILIES as ENGINE_FAMILIES, build_checkpoint, family_sources, run_step,  # noqa: E402
                     table_verdict, worker_result)
from chatglm_tools import CODE_FILES, SHARED  # noqa: E402  (engines put tools/ on the path)

NEW_TOKENS = 16
PROMPTS = ["你好，请介绍一下你自己。", "What is 2 + 2? Explain briefly, in one sentence, and then say goodbye."]
FAMILIES = [*ENGINE_FAMILIES, "chatglm2"]
F32 = {"INFERENCE_PRECISION_HINT": "f32"}
# OpenVINO at f32 against PyTorch: greedy tokens equal and logits within float rounding of a different kernel order.
OPENVINO_LOGITS_TOLERANCE = 1e-3
GPTQ_BITS, GPTQ_GROUP_SIZE = 4, 32
LLMCOMPRESSOR_GROUP_SIZE = 128  # the W4A16 preset's
CALIBRATION_LENGTH = 96
TOOLS = ["openvino", "gptq", "autoround", "llmcompressor"]
# The install route of copying modeling_chatglm.py alone matters where the checkpoint's own configuration file lacks
# fields ours has (rope_ratio): chatglm3-6b and chatglm2-6b.
ALONE_FAMILIES = ("chatglm3", "chatglm2")


def sources(family: str) -> tuple:
    """(config, tokenizer folder, generation config) of the family's real checkpoint. chatglm2-6b's config.json is
    not in shared/configs: the ChatGLM2 golden's (chatglm2-6b's fields, tiny sizes) with the real vocabulary."""
    if family in ENGINE_FAMILIES:
        return family_sources(family)
    config = json.loads((SHARED / "golden" / "chatglm2-tiny" / "checkpoint" / "config.json").read_text())
    config.update(padded_vocab_size=65024, seq_length=32768)
    return config, SHARED / "tokenizers" / "chatglm2-6b", None


def trained_scale_weights(name: str, shape, generator):
    """A trained model's scale, as benchmarks/model_benchmark.py's: what quantization tools are made for."""
    import torch

    if "layernorm" in name:
        return torch.ones(shape)
    return 0.02 * torch.randn(shape, generator=generator)


# ---------------------------------------------------------------------------------------------------------------------
# Shared by the tool processes
# ---------------------------------------------------------------------------------------------------------------------
def prompt_batch(folder: Path):
    """The tokenizer and a left-padded batch of PROMPTS (one row padded)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    return tokenizer, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def greedy(model, batch) -> list:
    """NEW_TOKENS greedy tokens per row, no stop token (every run is asked for exactly as many). The model's own
    generation config goes in explicitly (OpenVINO's model takes it so on every release); the settings go as
    arguments, since generate() replaces a passed config's values that equal the library defaults (do_sample=False)
    with the checkpoint's (glm-4-9b-chat samples)."""
    import torch

    settings = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                    pad_token_id=0, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        out = model.generate(**batch, generation_config=model.generation_config, **settings)
    return out[:, batch["input_ids"].shape[1]:].tolist()


def real_logits(logits, batch):
    """The logits of the positions that are not padding, float32."""
    return logits.float()[batch["attention_mask"].bool()]


def float_model(folder: Path):
    """The folder's code through transformers, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()


def logits_of(model, batch):
    import torch

    with torch.no_grad():
        return real_logits(model(**batch).logits, batch)


def distance(logits, reference) -> dict:
    """Max and mean absolute difference; the max relative to the reference's largest magnitude."""
    gap = (logits - reference).abs()
    return {"max_abs": gap.max().item(), "relative": gap.max().item() / reference.abs().max().item(),
            "mean_abs": gap.mean().item()}


def equal_tokens(tokens: list, reference: list) -> str:
    """'32/32': how many greedy tokens equal the reference's, position by position."""
    same = sum(a == b for row, ref in zip(tokens, reference) for a, b in zip(row, ref))
    return f"{same}/{sum(len(row) for row in reference)}"


def staged(stages: dict, name: str, step):
    """Run one stage of a tool; its traceback under `name` in `stages` when it fails (then None)."""
    try:
        return step()
    except Exception:
        stages[name] = traceback.format_exc()
        return None


# ---------------------------------------------------------------------------------------------------------------------
# (a) OpenVINO (the OpenVINO environment)
# ---------------------------------------------------------------------------------------------------------------------
def check_openvino(args) -> dict:
    import importlib.metadata as metadata

    from optimum.intel import OVModelForCausalLM

    folder, work = Path(args.model), Path(args.work)
    _, batch = prompt_batch(folder)
    reference = float_model(folder)
    reference_tokens, reference_logits = greedy(reference, batch), logits_of(reference, batch)
    del reference
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in ("optimum-intel", "openvino", "transformers"))
    cli = Path(sys.executable).with_name("optimum-cli")
    exports = {
        "OpenVINO, optimum-cli fp32": ("cli", "fp32"),
        "OpenVINO, optimum-cli int8": ("cli", "int8"),
        "OpenVINO, from_pretrained(export=True) fp32": ("api", "fp32"),
    }
    results = {"versions": versions}
    for label, (route, weights) in exports.items():
        if route not in args.routes:
            continue
        out = work / f"openvino-{route}-{weights}"
        shutil.rmtree(out, ignore_errors=True)
        stages = {}
        if route == "cli":
            error = run_step([cli, "export", "openvino", "--model", folder, "--trust-remote-code", "--task",
                              "text-generation-with-past", "--weight-format", weights, out], work / f"{out.name}.log")
            if error:  # the whole log: its traceback's first exception line is the cause
                stages["export"] = (work / f"{out.name}.log").read_text(errors="replace")
            else:
                model = staged(stages, "load", lambda: OVModelForCausalLM.from_pretrained(
                    out, ov_config=F32, trust_remote_code=True, compile=True))
        else:
            model = staged(stages, "export", lambda: OVModelForCausalLM.from_pretrained(
                folder, export=True, trust_remote_code=True, load_in_8bit=weights == "int8", ov_config=F32))
        if stages:
            results[label] = {"error": stages}
            continue
        tokens = staged(stages, "generate", lambda: greedy(model, batch))
        logits = staged(stages, "forward", lambda: real_logits(model(**batch).logits, batch))
        if stages:
            results[label] = {"error": stages}
            continue
        results[label] = {"tokens": tokens, "equal_tokens": equal_tokens(tokens, reference_tokens),
                          "greedy_equal": tokens == reference_tokens, "weights": weights,
                          **distance(logits, reference_logits)}
    return results


def openvino_rows(result: dict) -> list:
    """(label, result, notes, ok) of each export: fp32 must give PyTorch's greedy tokens and logits; int8 must
    export and run (its numbers are shown)."""
    rows = []
    for label, outcome in result.items():
        if label == "versions":
            continue
        if "error" in outcome:
            rows.append((label, "FAILED", failure(outcome["error"]), False))
            continue
        numbers = (f"greedy {outcome['equal_tokens']} tokens equal to PyTorch's; logits max abs "
                   f"{outcome['max_abs']:.2e} (relative {outcome['relative']:.2e})")
        exact = outcome["greedy_equal"] and outcome["max_abs"] <= OPENVINO_LOGITS_TOLERANCE
        if outcome["weights"] == "int8":
            rows.append((label, "works", numbers, True))
        else:
            rows.append((label, "equal" if exact else "DIFFERENT", numbers, exact))
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# (b) GPTQModel (the GPTQ environment)
# ---------------------------------------------------------------------------------------------------------------------
def calibration(count: int = 16, length: int = CALIBRATION_LENGTH) -> list:
    """Token ids every family's vocabulary has, as GPTQModel takes calibration rows."""
    import torch

    ids = torch.randint(100, 60000, (count, length), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row.tolist(), "attention_mask": [1] * length} for row in ids]


def as_batch(rows: list) -> dict:
    import torch

    return {key: torch.tensor([row[key] for row in rows]) for key in ("input_ids", "attention_mask")}


def round_to_nearest_(model, group_size: int = GPTQ_GROUP_SIZE) -> None:
    """Every layer's linear weight rounded to GPTQ's grid (4-bit, symmetric, `group_size` columns a scale) without
    GPTQ's error compensation, in place."""
    import torch

    top = 2 ** GPTQ_BITS - 1
    zero = (top + 1) // 2
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                groups = module.weight.reshape(-1, group_size)
                scale = (2 * groups.abs().amax(dim=1, keepdim=True) / top).clamp(min=1e-8)
                codes = (groups / scale + zero).round().clamp(0, top)
                module.weight.copy_(((codes - zero) * scale).reshape(module.weight.shape))


def check_gptq(args) -> dict:
    """Quantize, save, reload, generate; logits on the prompts and on calibration rows, against the float model's
    and against round-to-nearest on the same grid. GPTQ fits each layer's rounding to the inputs it saw in
    calibration: on those rows it beats round-to-nearest when the tool's layer replay gave every layer the inputs
    the model really gives it, not otherwise."""
    import importlib.metadata as metadata

    import gptqmodel

    folder, out = Path(args.model), Path(args.work) / "gptq"
    shutil.rmtree(out, ignore_errors=True)
    rows = calibration()
    prompts, batches, reference_tokens, reference, rounded = float_references(folder, rows, GPTQ_GROUP_SIZE)
    # GPTQModel sizes its CPU thread pool from the core count; on 2 cores its default pool cannot run the
    # quantization (the tool's own limit, not the model's).
    gptqmodel._default_cpu_workers = lambda: 2
    from gptqmodel import GPTQModel, QuantizeConfig

    stages = {}
    result = {"versions": ", ".join(f"{name} {metadata.version(name)}" for name in ("gptqmodel", "transformers")),
              "stages": stages, "out": {"GPTQ format": str(out)}, "round_to_nearest": rounded}
    quantize_config = QuantizeConfig(bits=GPTQ_BITS, group_size=GPTQ_GROUP_SIZE)
    model = staged(stages, "load", lambda: GPTQModel.load(str(folder), quantize_config, trust_remote_code=True,
                                                          device="cpu"))
    if model is None:
        return result
    for name, step in (("quantize", lambda: model.quantize(rows, batch_size=1)),
                       ("save", lambda: model.save(str(out)))):
        staged(stages, name, step)
        if stages:
            return result
    del model
    quantized = staged(stages, "reload", lambda: GPTQModel.load(str(out), trust_remote_code=True, device="cpu"))
    if quantized is None:
        return result
    logits = staged(stages, "forward", lambda: {name: logits_of(quantized.model, batch)
                                                for name, batch in batches.items()})
    tokens = staged(stages, "generate", lambda: greedy(quantized.model, prompts))
    # The tool's own generate() as its README calls it, no generation config: GPTQModel's load maps a ChatGLM
    # config's `max_length` to `seq_length`, which transformers 5's generate() refused as a generation setting.
    staged(stages, "generate() without a generation config",
           lambda: quantized.generate(**prompts, max_new_tokens=2, do_sample=False))
    if not stages:
        result.update(fitted={"GPTQ format": {name: distance(logits[name], reference[name]) for name in batches}},
                      equal_tokens={"GPTQ format": equal_tokens(tokens, reference_tokens)})
    return result


def float_references(folder: Path, rows: list, group_size: int) -> tuple:
    """What a quantizer's result is measured against: the prompts, the batches logits are compared on (the padded
    prompts, two calibration rows), the float model's greedy tokens and logits, and how far plain rounding to the
    tool's grid (4-bit, `group_size`) moves the logits."""
    _, prompts = prompt_batch(folder)
    batches = {"prompts": prompts, "calibration": as_batch(rows[:2])}
    model = float_model(folder)
    reference_tokens = greedy(model, prompts)
    reference = {name: logits_of(model, batch) for name, batch in batches.items()}
    round_to_nearest_(model, group_size)
    rounded = {name: distance(logits_of(model, batch), reference[name]) for name, batch in batches.items()}
    return prompts, batches, reference_tokens, reference, rounded


def reloaded_checks(stages: dict, result: dict, label: str, folder: Path, batches: dict, prompts: dict,
                    reference: dict, reference_tokens: list, **load) -> None:
    """A quantized folder reloaded through transformers (trust_remote_code), as a user loads it: its logits on
    `batches` against the float model's, its greedy tokens, and generate() without a generation config."""
    from transformers import AutoModelForCausalLM

    model = staged(stages, f"reload ({label})", lambda: AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, **load).eval())
    if model is None:
        return
    logits = staged(stages, f"forward ({label})", lambda: {name: logits_of(model, batch)
                                                           for name, batch in batches.items()})
    tokens = staged(stages, f"generate ({label})", lambda: greedy(model, prompts))
    staged(stages, f"generate() without a generation config ({label})",
           lambda: model.generate(**prompts, max_new_tokens=2, do_sample=False))
    if logits is not None and tokens is not None:
        result.setdefault("fitted", {})[label] = {name: distance(logits[name], reference[name]) for name in batches}
        result.setdefault("equal_tokens", {})[label] = equal_tokens(tokens, reference_tokens)


# ---------------------------------------------------------------------------------------------------------------------
# (c) AutoRound (the GPTQ environment)
# ---------------------------------------------------------------------------------------------------------------------
AUTOROUND_FORMATS = {"AutoRound format": "auto_round", "GPTQ format": "auto_gptq"}


def check_autoround(args) -> dict:
    """AutoRound 4-bit, group size 32: it caches layer 0's inputs by replacing the layer's forward during a
    calibration forward, then tunes each layer's rounding by replaying it on those inputs (every argument that is a
    tensor, list, tuple, string, bool or None: anything else is dropped). Saved in its own format and in the GPTQ
    format, each reloaded through transformers."""
    import importlib.metadata as metadata

    import torch
    from auto_round import AutoRound

    folder, work = Path(args.model), Path(args.work)
    rows = calibration()
    prompts, batches, reference_tokens, reference, rounded = float_references(folder, rows, GPTQ_GROUP_SIZE)
    stages = {}
    result = {"versions": ", ".join(f"{name} {metadata.version(name)}" for name in ("auto-round", "transformers")),
              "stages": stages, "round_to_nearest": rounded, "out": {}}
    tokenizer, _ = prompt_batch(folder)
    model = float_model(folder)
    dataset = [{key: torch.tensor([row[key]]) for key in ("input_ids", "attention_mask")} for row in rows]
    autoround = staged(stages, "set up", lambda: AutoRound(
        model, tokenizer, bits=GPTQ_BITS, group_size=GPTQ_GROUP_SIZE, sym=True, dataset=dataset,
        seqlen=CALIBRATION_LENGTH, nsamples=len(rows), batch_size=4, device_map="cpu", seed=0))
    if autoround is None or staged(stages, "quantize", autoround.quantize) is None:
        return result
    for label, name in AUTOROUND_FORMATS.items():
        out = work / f"autoround-{name}"
        shutil.rmtree(out, ignore_errors=True)
        staged(stages, f"save ({label})", lambda: autoround.save_quantized(str(out), format=name, inplace=False))
        if stages:
            return result
        result["out"][label] = str(out)
    del autoround, model
    for label, out in result["out"].items():
        reloaded_checks(stages, result, label, Path(out), batches, prompts, reference, reference_tokens,
                        device_map="cpu")
    return result


# ---------------------------------------------------------------------------------------------------------------------
# (d) llm-compressor (its own environment)
# ---------------------------------------------------------------------------------------------------------------------
def check_llmcompressor(args) -> dict:
    """GPTQ W4A16 through `oneshot` with its default pipeline: for GPTQ the sequential one, which traces the model
    with torch.fx (its tracer steps into the ancestors of the layers, with their forwards rewritten to wrap what fx
    cannot trace) and calibrates one layer's subgraph at a time. Saved compressed, reloaded through transformers."""
    import importlib.metadata as metadata

    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.pipelines.sequential import pipeline as sequential

    folder, out = Path(args.model), Path(args.work) / "llmcompressor"
    shutil.rmtree(out, ignore_errors=True)
    rows = calibration()
    prompts, batches, reference_tokens, reference, rounded = float_references(folder, rows, LLMCOMPRESSOR_GROUP_SIZE)
    stages = {}
    result = {"versions": ", ".join(f"{name} {metadata.version(name)}" for name in ("llmcompressor", "transformers")),
              "stages": stages, "round_to_nearest": rounded, "out": {"compressed-tensors": str(out)}}
    traced = sequential.trace_subgraphs

    def counted(*arguments, **keywords):  # how many subgraphs the default pipeline traced
        subgraphs = traced(*arguments, **keywords)
        result["subgraphs"] = len(subgraphs)
        return subgraphs

    sequential.trace_subgraphs = counted
    tokenizer, _ = prompt_batch(folder)
    model = float_model(folder)
    recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=["transformer.output_layer"])
    staged(stages, "oneshot", lambda: oneshot(model=model, processor=tokenizer, dataset=Dataset.from_list(rows),
                                              recipe=recipe, max_seq_length=CALIBRATION_LENGTH,
                                              num_calibration_samples=len(rows), trust_remote_code_model=True))
    if stages:
        return result
    staged(stages, "save", lambda: (model.save_pretrained(out, save_compressed=True), tokenizer.save_pretrained(out)))
    if stages:
        return result
    del model
    reloaded_checks(stages, result, "compressed-tensors", out, batches, prompts, reference, reference_tokens)
    return result


def quantized_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def compare_quantized(ours: Path, original: Path) -> str:
    """How GPTQModel's output for our files compares with its output for the original files."""
    mine, theirs = quantized_tensors(ours), quantized_tensors(original)
    if set(mine) != set(theirs):
        return (f"tensor names differ: only ours {sorted(set(mine) - set(theirs))[:4]}, only the original's "
                f"{sorted(set(theirs) - set(mine))[:4]}")
    differing = [name for name in mine if not (mine[name].shape == theirs[name].shape
                                               and mine[name].dtype == theirs[name].dtype
                                               and bool((mine[name] == theirs[name]).all()))]
    if not differing:
        return f"quantized tensors identical to the original files' ({len(mine)} tensors)"
    scales = [name for name in differing if name.endswith(".scales")]
    worst = max(((mine[name].float() - theirs[name].float()).abs().max().item() for name in scales), default=0.0)
    return (f"{len(differing)} of {len(mine)} quantized tensors differ from the original files' (e.g. "
            f"{differing[0]}; scales max abs {worst:.2e})")


def fitted_rows(tool: str, result: dict, group_size: int) -> list:
    """(label, verdict, notes, ok) of each saved format of a fitted 4-bit method: it must reload, generate, and come
    closer to the float model than round-to-nearest on the same grid on its own calibration rows."""
    if result.get("stages"):
        return [(tool, "FAILED", failure(result["stages"]), False)]
    rows = []
    rounded = result["round_to_nearest"]
    for label, fitted in result["fitted"].items():
        notes = (f"reloaded 4-bit g{group_size} logits vs float, prompts: max abs {fitted['prompts']['max_abs']:.3f} "
                 f"(relative {fitted['prompts']['relative']:.3f}), mean abs {fitted['prompts']['mean_abs']:.4f} "
                 f"(round-to-nearest {rounded['prompts']['mean_abs']:.4f}); calibration rows: mean abs "
                 f"{fitted['calibration']['mean_abs']:.4f} (round-to-nearest "
                 f"{rounded['calibration']['mean_abs']:.4f}); greedy {result['equal_tokens'][label]} tokens equal "
                 "to the float model's")
        if "subgraphs" in result:
            notes += f"; default pipeline: traced {result['subgraphs']} subgraphs"
        closer = fitted["calibration"]["mean_abs"] < rounded["calibration"]["mean_abs"]
        if not closer:
            notes += " (NOT closer than round-to-nearest on its own calibration rows: did the layers see their inputs?)"
        rows.append((f"{tool}, {label}", "works" if closer else "WORSE", notes, closer))
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Orchestration (the OpenVINO environment)
# ---------------------------------------------------------------------------------------------------------------------
def failure(error) -> str:
    """What a failure says, briefly: its stage (for a dict of stages) and the first and last exception lines of its
    traceback (the cause and what the tool made of it)."""
    if isinstance(error, dict):
        stage, error = next(iter(error.items()))
        return f"{stage}: {failure(error)}"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip(" ^~\t")]
    raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
    if not raised:
        return lines[-1] if lines else "?"
    return raised[0] if raised[0] == raised[-1] else f"{raised[0]} (then {raised[-1]})"


def original_twin(ours: Path, folder: Path, code: Path) -> None:
    """`ours`'s checkpoint with the files of `code` (the original's) instead of ours."""
    shutil.copytree(ours, folder, ignore=shutil.ignore_patterns(*CODE_FILES, "__pycache__"))
    for path in code.glob("*.py"):
        shutil.copy(path, folder / path.name)


def alone_twin(ours: Path, folder: Path) -> None:
    """`ours`'s checkpoint as a downloaded chatglm3-6b / chatglm2-6b folder after copying our modeling_chatglm.py
    alone into it: the checkpoint's own configuration_chatglm.py (tests/original_code.py's stand-in of chatglm3-6b's;
    chatglm2-6b's has the same fields, no rope_ratio), our other files where the original's are not at hand."""
    sys.path.insert(0, str(REPO / "tests"))
    from original_code import original_configuration_source

    shutil.copytree(ours, folder, ignore=shutil.ignore_patterns("configuration_chatglm.py", "__pycache__"))
    (folder / "configuration_chatglm.py").write_text(original_configuration_source("chatglm3"))


def run_tool(tool: str, python: str, folder: Path, base: Path, env: dict, *options) -> dict:
    """One tool's process; what it wrote, or its error."""
    out, work = base / f"{tool}-{folder.name}.json", base / f"{tool}-{folder.name}"
    work.mkdir(exist_ok=True)
    error = run_step([python, Path(__file__).resolve(), tool, "--model", folder, "--work", work, "--out", out,
                      *options], base / f"{tool}-{folder.name}.log", env)
    return json.loads(out.read_text()) if out.exists() else {"process": error or "no result"}


def tool_rows(tool: str, family: str, files: str, result: dict, counted: bool) -> list:
    """The table's rows of one tool's result on one folder (a failure of a folder that is not ours is not counted)."""
    names = {"openvino": "OpenVINO", "gptq": f"GPTQModel {GPTQ_BITS}-bit", "autoround": f"AutoRound {GPTQ_BITS}-bit",
             "llmcompressor": "llm-compressor GPTQ W4A16"}
    if "process" in result:
        rows = [(names[tool], "FAILED", failure(result["process"]), False)]
    elif tool == "openvino":
        rows = openvino_rows(result)
    else:
        rows = fitted_rows(names[tool], result,
                           LLMCOMPRESSOR_GROUP_SIZE if tool == "llmcompressor" else GPTQ_GROUP_SIZE)
    return [(label, family, files, verdict, f"{notes} ({result.get('versions')})", ok or not counted)
            for label, verdict, notes, ok in rows]


def orchestrate(args) -> int:
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_MODULES_CACHE=str(work / "modules"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    os.environ.update(env)
    code = Path(args.code).resolve()
    originals = {family: Path(folder).resolve() for family, folder in
                 (item.split("=", 1) for item in args.original_code)}
    pythons = {"openvino": sys.executable, "gptq": args.gptq_python, "autoround": args.gptq_python,
               "llmcompressor": args.llmcompressor_python}
    os.chdir(work)  # the tools write logs into the working directory
    rows = []
    for family in args.families:
        base = work / family
        shutil.rmtree(base, ignore_errors=True)  # each run from scratch: nothing of an earlier run is compared
        base.mkdir()
        folders = {"ours": base / "ours"}
        print(f"== {family}: checkpoint with the files of {code} in {folders['ours']}", flush=True)
        build_checkpoint(family, folders["ours"], seed=FAMILIES.index(family), code=code,
                         weights=trained_scale_weights, sources=sources(family))
        if family in ALONE_FAMILIES and "openvino" in args.tools:
            folders["alone"] = base / "alone"
            alone_twin(folders["ours"], folders["alone"])
        if family in originals:
            folders["original"] = base / "original"
            original_twin(folders["ours"], folders["original"], originals[family])
        saved = {}  # (tool, format) -> {files: folder} of what each fitted method wrote
        for files, folder in folders.items():
            for tool in args.tools:
                if files == "alone" and tool != "openvino":
                    continue  # the quantizers load the same model whichever configuration file made its config
                options = ["--routes", "cli"] if files == "alone" else []
                result = run_tool(tool, pythons[tool], folder, base, env, *options)
                rows += tool_rows(tool, family, files, result, counted=files != "original")
                if tool == "openvino" or "process" in result or result.get("stages"):
                    continue
                for label, out in result["out"].items():
                    saved.setdefault((tool, label), {})[files] = Path(out)
        for (tool, label), outs in saved.items():
            if {"ours", "original"} <= set(outs):
                rows.append((f"{tool} {label}, ours vs original", family, "both", "info",
                             compare_quantized(outs["ours"], outs["original"]), True))
    return table_verdict(rows, "tools", "every check of our files passed",
                         header=("tool", "family", "files", "result", "notes"))


CHECKS = {"openvino": check_openvino, "gptq": check_gptq, "autoround": check_autoround,
          "llmcompressor": check_llmcompressor}


def tool_main(args) -> int:
    return worker_result(CHECKS[args.command], args, failure_key="process")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="build the checkpoints, run every tool, print the table")
    run.add_argument("--work", default=str(REPO / ".venv-tools" / "work"))
    run.add_argument("--gptq-python", required=True, help="python of the GPTQModel environment")
    run.add_argument("--code", default=str(REPO), help="folder with the code files to check (default: this "
                                                       "repository; e.g. another branch's worktree)")
    run.add_argument("--original-code", action="append", default=[], metavar="FAMILY=DIR",
                     help="also run each tool on a twin checkpoint with DIR's files (the original THUDM files)")
    run.add_argument("--llmcompressor-python", required=True, help="python of the llm-compressor environment")
    run.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    run.add_argument("--tools", nargs="+", default=TOOLS, choices=TOOLS)
    for tool in TOOLS:
        one = sub.add_parser(tool, help=f"one {tool} check (run by `run` in the tool's environment)")
        one.add_argument("--model", required=True)
        one.add_argument("--work", required=True)
        one.add_argument("--out", required=True)
        if tool == "openvino":
            one.add_argument("--routes", nargs="+", default=["cli", "api"], choices=["cli", "api"],
                             help="cli: optimum-cli export (fp32, int8); api: from_pretrained(export=True)")
    args = parser.parse_args(argv)
    if args.command == "run":
        bad = [item for item in args.original_code if item.split("=", 1)[0] not in FAMILIES or "=" not in item]
        if bad:
            parser.error(f"--original-code takes FAMILY=DIR with FAMILY one of {FAMILIES}: {bad}")
        return orchestrate(args)
    return tool_main(args)


if __name__ == "__main__":
    sys.exit(main())
