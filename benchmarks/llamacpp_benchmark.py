#!/usr/bin/env python
"""Decode speed against llama.cpp on the CPU: the same random weights, the same process, interleaved rounds.

    scripts/llamacpp_benchmark.sh                        # the GLM-4-shaped 1.4B model, 1 and 2 threads, every class
    scripts/llamacpp_benchmark.sh --threads 1 --classes int4,int8
    python benchmarks/llamacpp_benchmark.py --quick      # a tiny model: checks that everything runs (no llama.cpp
                                                         # needed: without llama_cpp our side runs alone)

The model: glm-4-9b-chat's config.json at 1.445B parameters (hidden 2048, 16 layers, 16 heads x 128, 2 key/value
groups, ffn 6848, the real 151552 vocabulary), random weights (randn x 0.02, as benchmarks/model_benchmark.py makes
them), saved in the original layout with this repository's code and GLM-4's tokenizer files. llama.cpp's GGUFs are
made by our route: tools/export_to_native_glm.py, llama.cpp's convert_hf_to_gguf.py (--convert; F32), then
llama_model_quantize to F16, Q8_0 and Q4_0. llama.cpp runs through llama-cpp-python (the environment
scripts/engines.sh builds, which scripts/llamacpp_benchmark.sh uses), its prompt fed one token at a time (on CPUs with
AMX, llama.cpp 0.3.36's Q8_0/Q4_0 multi-token prompt crashes).

Classes (ours / llama.cpp's):
  fp32   fp32 weights; "packed": use_cpu_packed_weights() (one row's products over every thread)
                                                            / F32
  bf16   bf16 weights, eager; "packed": use_cpu_packed_weights(); "compiled": torch.compile with inductor's freezing
         on a static cache (docs/speed-and-memory.md's recipe; one compilation, before the timed rounds) / F16
  int8   bf16, blocks quantize(8, storage="original") (torch's int8 kernel); "+ packed bf16 head": the bf16 output
         layer on use_cpu_packed_weights()'s paths; "+ int8 head": quantize_output_layer(8)
                                                            / Q8_0
  int4   bf16, blocks quantize(4, storage="original") (torch's int4 kernel), the output layer in bf16 as
         chatglm2-6b-int4 keeps it; "+ packed bf16 head", "+ int8 head" / "+ int4 head": as for int8, or
         quantize_output_layer(4)                           / Q4_0 (its output layer is Q6_K)
"matrix products alone": the same step's linear layers (the blocks' and the output layer, on the kernels the model
chose) fed one row back to back: the kernels' share of the step.
Decode ms/token: batch 1, greedy, from the first generated token to the 65th (64 steps, --steps) after an 8-token
prompt; ours through generate(), llama.cpp through Llama.generate(); the median of --rounds rounds, ours and llama.cpp's
alternating which goes first. "% of copy": the weight bytes a step reads (everything but the input embedding, of
which one row; ours: parameters and packed copies, llama.cpp: the GGUF's tensors) per step time, against a STREAM-like
copy measured in the same run (benchmarks/model_benchmark.py's memory_bandwidth). ratio = ours / llama.cpp's ms/token:
<= 1.00 means we are at least as fast.

Kernels (ours only, no llama.cpp needed): benchmarks/cpu_matvec_kernels.py's table on the same model's matrices, in
the same run: each route tried for a CPU's one-row products (torch's kernels, blocks of rows over threads, inductor's
generated code and weight-only template, torchao's layouts) with its share of the copy bandwidth.

Deviation of the fast paths (ours only, no llama.cpp needed): each against its exact twin on the same weights, over
the twin's 64 greedy tokens fed back (teacher forcing): the largest logit difference (absolute, and relative to the
largest logit), and at how many of the 64 steps the top token is the same. Random weights make a poor proxy for a
real model's logit margins: read the agreement as an order of magnitude.

A shared machine: medians and ratios of interleaved rounds hold up, absolute times do not; the load average is
printed. --json writes every number; a Markdown table ends the output.
"""
import argparse
import contextlib
import gc
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
import model_benchmark as mb  # noqa: E402  (sets up tools/ on sys.path, an offline hub and a fresh modules cache)
import cpu_matvec_kernels  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

from chatglm_tools import held_bytes, shared_path  # noqa: E402

REPO = mb.REPO
SIZES = {
    "glm-4-1.4b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, kv_channels=128,
                       multi_query_group_num=2, ffn_hidden_size=6848, padded_vocab_size=151552, seq_length=8192),
    # --quick: tiny layers, the real vocabulary (llama.cpp's converter reads the real tokenizer)
    "quick": dict(num_layers=2, hidden_size=256, num_attention_heads=2, kv_channels=128, multi_query_group_num=2,
                  ffn_hidden_size=512, padded_vocab_size=151552, seq_length=1024),
}
CLASSES = ("fp32", "bf16", "int8", "int4")
LLAMA_TYPES = {"fp32": "F32", "bf16": "F16", "int8": "Q8_0", "int4": "Q4_0"}
LLAMA_FTYPES = {"F16": 1, "Q8_0": 7, "Q4_0": 2}  # llama_ftype: LLAMA_FTYPE_MOSTLY_*
PROMPT = 8


# ---------------------------------------------------------------------------------------------------------------------
# The weights: our checkpoint, and llama.cpp's GGUFs made from it by our route


def build_checkpoint(folder: Path, preset: str) -> Path:
    """The random model saved in the original layout (fp32) with our code and GLM-4's tokenizer files."""
    mb.PRESETS.setdefault(preset, SIZES[preset])
    model = mb.random_fork(folder, preset, torch.float32)
    model.save_pretrained(folder)
    mb.with_code(folder)
    for path in shared_path("tokenizers", "glm-4-9b-chat").iterdir():
        shutil.copy(path, folder / path.name)
    del model
    gc.collect()
    return folder


def run_step(command: list, what: str):
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def make_ggufs(fork: Path, workdir: Path, convert: Path, types: list) -> dict:
    """GGUF type -> file: the native export, llama.cpp's converter to F32, llama_model_quantize to the others."""
    import llama_cpp

    native = workdir / "native"
    run_step([sys.executable, REPO / "tools" / "export_to_native_glm.py", fork, native], "the native export")
    files = {"F32": workdir / "model-F32.gguf"}
    run_step([sys.executable, convert, native, "--outfile", files["F32"], "--outtype", "f32"], "convert_hf_to_gguf")
    shutil.rmtree(native)
    for kind in types:
        if kind == "F32":
            continue
        files[kind] = workdir / f"model-{kind}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = LLAMA_FTYPES[kind], os.cpu_count() or 1
        with native_stderr_to(workdir / f"quantize-{kind}.log") as log:
            failed = llama_cpp.llama_model_quantize(str(files["F32"]).encode(), str(files[kind]).encode(), params)
        if failed:
            raise RuntimeError(f"llama_model_quantize to {kind} failed:\n{log.read_text()[-3000:]}")
    return {kind: files[kind] for kind in types}


@contextlib.contextmanager
def native_stderr_to(path: Path):
    """llama.cpp's C code writes a line per tensor to file descriptor 2, which Python's sys.stderr does not hold:
    that descriptor goes to `path` for the block (the table stays readable; the file keeps the lines)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "w") as log:
            os.dup2(log.fileno(), 2)
            yield path
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def gguf_step_bytes(path: Path, convert: Path) -> int:
    """Bytes of the GGUF's tensors a decode step reads: all but the token embedding, of which one row."""
    sys.path.insert(0, str(convert.parent / "gguf-py"))
    from gguf import GGUFReader

    total = 0
    for tensor in GGUFReader(str(path)).tensors:
        if tensor.name == "token_embd.weight":
            total += int(tensor.n_bytes) // int(tensor.shape[-1])  # (GGUF shapes: the row count last)
        else:
            total += int(tensor.n_bytes)
    return total


# ---------------------------------------------------------------------------------------------------------------------
# Our models and llama.cpp's, and how a decode is timed


def our_variants(fork: Path, kind: str) -> dict:
    """name -> (a builder of) our model for the class."""
    def load(dtype):
        return mb.load("fork", fork, dtype, "cpu")

    if kind == "fp32":
        def split():  # one row's products over every thread (quantization_chatglm.split_matrix_vector)
            model = load(torch.float32)
            model.use_cpu_packed_weights()
            return model

        return {"fp32": lambda: load(torch.float32), "fp32 packed": split}
    if kind == "bf16":
        def packed():
            model = load(torch.bfloat16)
            model.use_cpu_packed_weights()  # ValueError where torch has no oneDNN linear here: the line is skipped
            return model

        def compiled():  # docs/speed-and-memory.md's recipe: freezing prepacks the weights for oneDNN
            torch._inductor.config.freezing = True
            model = load(torch.bfloat16)
            model.forward = torch.compile(model.forward)
            return model

        return {"bf16 eager": lambda: load(torch.bfloat16), "bf16 packed": packed, "bf16 compiled": compiled}
    bits = 8 if kind == "int8" else 4
    heads = [None, "packed", 8] if bits == 8 else [None, "packed", 8, 4]

    def build(head):
        model = load(torch.bfloat16).quantize(bits, storage="original")
        if head == "packed":  # the bf16 head as it is, on use_cpu_packed_weights()'s paths
            model.use_cpu_packed_weights()
            return model
        return model if head is None else model.quantize_output_layer(head)

    names = {None: "", "packed": " + packed bf16 head", 8: " + int8 head", 4: " + int4 head"}
    return {f"int{bits}{names[head]}": (lambda head=head: build(head)) for head in heads}


class Stamps(transformers.StoppingCriteria):
    """generate() calls it after each new token: the time of each."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def our_decode(model, ids, threads: int, steps: int) -> tuple:
    """(ms per decode step over `steps` steps, the generated tokens). A compiled model decodes on a static cache, as
    the recipe says (one graph for every position)."""
    torch.set_num_threads(threads)
    stamps = Stamps()
    static = {"cache_implementation": "static"} if is_compiled(model) else {}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                             eos_token_id=None, pad_token_id=0, stopping_criteria=[stamps], **static)
    return (stamps.times[steps] - stamps.times[0]) / steps * 1e3, out[0, ids.shape[1]:].tolist()


def is_compiled(model) -> bool:
    """Whether the model's forward is torch.compile's wrapper: it then decodes on a static cache."""
    return hasattr(model.forward, "_torchdynamo_orig_callable")


def llama_decode(llm, ids, steps: int) -> tuple:
    times, tokens = [], []
    for token in llm.generate(ids[0].tolist(), temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter())
        tokens.append(int(token))
        if len(tokens) == steps + 1:
            break
    return (times[steps] - times[0]) / steps * 1e3, tokens


def new_llama(path: Path, threads: int, steps: int):
    from llama_cpp import Llama

    # n_batch 1: the prompt one token at a time (llama.cpp's AMX path crashes on a multi-token Q8_0/Q4_0 batch)
    return Llama(model_path=str(path), n_ctx=PROMPT + steps + 8, n_batch=1, n_ubatch=1, n_threads=threads,
                 n_threads_batch=threads, seed=0, verbose=False)


def products_ms(model, threads: int) -> float:
    """ms for the step's matrix products alone (model_benchmark.matrix_vector_seconds: every linear layer of the
    blocks and the output layer on its own kernel, fed one row, back to back): beside the whole step it splits the
    time into the kernels' share and the rest (attention, norms, generate())."""
    torch.set_num_threads(threads)
    return mb.matrix_vector_seconds(model, 1, mb.Clock("cpu", "wall")) * 1e3


def our_step_bytes(model) -> int:
    """mb.decode_weight_bytes plus the packed copies that are not the weights' own storage."""
    plain = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in [*model.parameters(), *model.buffers()]}.values())
    return mb.decode_weight_bytes(model) + held_bytes(model) - plain


# ---------------------------------------------------------------------------------------------------------------------
# Sections


def speed(args, fork: Path, ggufs: dict, bandwidth: dict, rows: list):
    ids = mb.random_ids(1, PROMPT, 0, "cpu")
    for kind in args.classes:
        gguf = ggufs.get(LLAMA_TYPES[kind])
        llamas = {threads: new_llama(gguf, threads, args.steps) for threads in args.threads} if gguf else {}
        llama_bytes = gguf and gguf_step_bytes(gguf, args.convert)
        for name, build in our_variants(fork, kind).items():
            try:
                model = build()
            except ValueError as error:
                print(f"  {name}: skipped ({error})", flush=True)
                continue
            moved = our_step_bytes(model)
            for threads in args.threads:
                engines = {"ours": lambda: our_decode(model, ids, threads, args.steps)}
                if llamas:
                    engines["llama"] = lambda: llama_decode(llamas[threads], ids, args.steps)
                try:
                    for run in engines.values():  # warm-up (a compiled model compiles here)
                        run()
                except RuntimeError as error:  # inductor without a C++ compiler, say: the compiled line is skipped
                    if not is_compiled(model):
                        raise
                    print(f"  {name}: skipped ({type(error).__name__}: {str(error)[:200]})", flush=True)
                    break
                runs = mb.interleaved(args.rounds, engines, lambda who, run: run())
                row = dict(variant=name, llama=gguf and LLAMA_TYPES[kind], threads=threads, ours_bytes=moved,
                           copy_gbs=bandwidth[threads] / 1e9, ours_rounds=[t for t, _ in runs["ours"]])
                row["ours_ms"] = statistics.median(row["ours_rounds"])
                row["ours_copy"] = moved / (row["ours_ms"] / 1e3) / bandwidth[threads]
                if not is_compiled(model):  # a compiled step's products are not the modules' eager ones
                    row["products_ms"] = products_ms(model, threads)
                    row["products_copy"] = moved / (row["products_ms"] / 1e3) / bandwidth[threads]
                if llamas:
                    row.update(llama_bytes=llama_bytes, llama_rounds=[t for t, _ in runs["llama"]])
                    row["llama_ms"] = statistics.median(row["llama_rounds"])
                    row["llama_copy"] = llama_bytes / (row["llama_ms"] / 1e3) / bandwidth[threads]
                    row["ratio"] = row["ours_ms"] / row["llama_ms"]
                    row["same_tokens"] = sum(a == b for a, b in zip(runs["ours"][0][1], runs["llama"][0][1]))
                rows.append(row)
                print(format_speed(row, args.steps), flush=True)
            del model
            gc.collect()
        del llamas
        gc.collect()


def teacher_forced(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The last-position logits (fp32) of `steps` decode steps, ids[:, :PROMPT] as the prompt and the later ids fed
    one at a time."""
    logits = []
    with torch.no_grad():
        out = model(ids[:, :PROMPT], use_cache=True, logits_to_keep=1)
        logits.append(out.logits[0, -1].float())
        cache = out.past_key_values
        for i in range(PROMPT, PROMPT + steps - 1):
            out = model(ids[:, i:i + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits.append(out.logits[0, -1].float())
    return torch.stack(logits)


def deviation(args, fork: Path, rows: list):
    """Each fast path against its exact twin (see the module docstring)."""
    torch.set_num_threads(max(args.threads))
    prompt = mb.random_ids(1, PROMPT, 0, "cpu")

    def int8_exact():
        model = mb.load("fork", fork, torch.bfloat16, "cpu").quantize(8, storage="original")
        model.use_quantized_kernel("exact")
        return model

    def packed(dtype):
        model = mb.load("fork", fork, dtype, "cpu")
        model.use_cpu_packed_weights()
        return model

    def quantized(bits, head=None):
        model = mb.load("fork", fork, torch.bfloat16, "cpu").quantize(bits, storage="original")
        return model if head is None else model.quantize_output_layer(head)

    pairs = []
    if "fp32" in args.classes:
        pairs += [("fp32 packed", lambda: packed(torch.float32), "fp32", lambda: mb.load("fork", fork, torch.float32,
                                                                                       "cpu"))]
    if "int8" in args.classes:
        pairs += [("int8 kernel (bf16)", lambda: quantized(8), "int8 exact path (bf16)", int8_exact),
                  ("int8 + int8 head", lambda: quantized(8, 8), "int8, bf16 head", lambda: quantized(8))]
    if "int4" in args.classes:
        pairs += [("int4 + int8 head", lambda: quantized(4, 8), "int4, bf16 head", lambda: quantized(4)),
                  ("int4 + int4 head", lambda: quantized(4, 4), "int4, bf16 head", lambda: quantized(4))]
    references = {}
    for name, build, reference_name, build_reference in pairs:
        if reference_name not in references:
            reference = build_reference()
            with torch.no_grad():
                tokens = reference.generate(prompt, max_new_tokens=args.steps, do_sample=False, eos_token_id=None,
                                            pad_token_id=0)
            references[reference_name] = (tokens, teacher_forced(reference, tokens, args.steps))
            del reference
            gc.collect()
        tokens, expected = references[reference_name]
        model = build()
        got = teacher_forced(model, tokens, args.steps)
        with torch.no_grad():
            free = model.generate(prompt, max_new_tokens=args.steps, do_sample=False, eos_token_id=None, pad_token_id=0)
        del model
        gc.collect()
        diverged = next((i for i, (a, b) in enumerate(zip(free[0, PROMPT:].tolist(), tokens[0, PROMPT:].tolist()))
                         if a != b), args.steps)
        row = dict(variant=name, reference=reference_name, max_abs=(got - expected).abs().max().item(),
                   largest=expected.abs().max().item(), top1_same=int((got.argmax(-1) == expected.argmax(-1)).sum()),
                   steps=args.steps, greedy_same_until=diverged)
        row["max_rel"] = row["max_abs"] / row["largest"]
        rows.append(row)
        print(f"  {name:<22} vs {reference_name:<24} max |dlogit| {row['max_abs']:.3g} ({row['max_rel']:.2%} of the "
              f"largest), top token same at {row['top1_same']}/{args.steps} steps, free greedy same "
              f"for {diverged}/{args.steps} tokens", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# Output


def format_speed(row, steps: int) -> str:
    text = (f"  {row['variant']:<18} {row['threads']} thr: ours {row['ours_ms']:7.1f} ms/token "
            f"({row['ours_copy']:.0%} of copy; matrix products alone {products(row)})")
    if "llama_ms" in row:
        text += (f"  llama.cpp {row['llama']:<4} {row['llama_ms']:7.1f} ({row['llama_copy']:.0%})  ratio "
                 f"{row['ratio']:.2f}  same greedy tokens {row['same_tokens']}/{steps + 1}")
    return text


def products(row) -> str:
    return f"{row['products_ms']:.1f} ({row['products_copy']:.0%})" if "products_ms" in row else "-"


def markdown(speed_rows, deviation_rows, kernel_rows, header) -> str:
    lines = [header, "", f"CPU class: {mb.cpu_class()} ({mb.instruction_sets()})", "", "| ours | llama.cpp | threads | ours ms/token (% of copy) | ours, matrix products alone | "
             "llama.cpp ms/token (% of copy) | ratio ours / llama.cpp | MB read per token, ours / llama.cpp |",
             "|---|---|---|---|---|---|---|---|"]
    for row in speed_rows:
        llama = "llama_ms" in row
        theirs = f"{row['llama_ms']:.1f} ({row['llama_copy']:.0%}) | {row['ratio']:.2f} " if llama else "| "
        lines.append(
            f"| {row['variant']} | {row['llama'] or ''} | {row['threads']} | {row['ours_ms']:.1f} "
            f"({row['ours_copy']:.0%}) | {products(row)} | {theirs}"
            f"| {row['ours_bytes'] / 1e6:.0f}" + (f" / {row['llama_bytes'] / 1e6:.0f} |" if llama else " |"))
    if deviation_rows:
        lines += ["", "| fast path | against | max abs logit diff (of the largest) | top token same | free greedy "
                  "same for |", "|---|---|---|---|---|"]
        lines += [f"| {r['variant']} | {r['reference']} | {r['max_abs']:.3g} ({r['max_rel']:.2%}) | "
                  f"{r['top1_same']}/{r['steps']} | {r['greedy_same_until']}/{r['steps']} tokens |"
                  for r in deviation_rows]
    if kernel_rows:
        lines += ["", "Routes to the one-row products (benchmarks/cpu_matvec_kernels.py, the same model's matrices):",
                  "", cpu_matvec_kernels.HEADER] + [cpu_matvec_kernels.format_row(row) for row in kernel_rows]
    return "\n".join(lines)


def default_converter() -> str:
    """llama.cpp's convert_hf_to_gguf.py in the sources scripts/engines.sh unpacks, if there."""
    found = sorted(glob.glob(str(REPO / ".venv-engines" / "src" / "*" / "vendor" / "llama.cpp" /
                                 "convert_hf_to_gguf.py")))
    return found[-1] if found else None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", default=",".join(CLASSES), help="comma-separated, of " + ", ".join(CLASSES))
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (both engines)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per line")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed (and compared, for the deviation)")
    parser.add_argument("--sections", default="speed,deviation,kernels", help="speed: against llama.cpp (ours "
                        "alone without llama_cpp); deviation: the fast paths against their exact twins; kernels: the "
                        "routes to the one-row products (cpu_matvec_kernels.py)")
    parser.add_argument("--convert", type=Path, default=default_converter(),
                        help="llama.cpp's convert_hf_to_gguf.py (default: the one scripts/engines.sh unpacks)")
    parser.add_argument("--workdir", type=Path, help="where the checkpoint and the GGUFs go (default: temporary, "
                        "removed); one holding them from an earlier run is reused")
    parser.add_argument("--json", type=Path, help="also write every number to this file")
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round: checks that everything runs")
    args = parser.parse_args(argv)
    args.classes = [c for c in args.classes.split(",") if c]
    unknown = set(args.classes) - set(CLASSES)
    if unknown:
        parser.error(f"--classes: unknown {sorted(unknown)}; choose from {', '.join(CLASSES)}")
    args.threads = [int(t) for t in args.threads.split(",")]
    args.sections = set(args.sections.split(","))
    args.preset = "quick" if args.quick else "glm-4-1.4b"
    if args.quick:
        args.rounds, args.steps = 1, 8
    return args


def llama_available(args) -> str:
    """'' where llama.cpp can be measured, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama_cpp is not importable here (scripts/llamacpp_benchmark.sh runs in scripts/engines.sh's env)"
    if args.convert is None or not Path(args.convert).exists():
        return "no convert_hf_to_gguf.py (--convert)"
    return ""


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chatglm-llamacpp-"))
    fork = workdir / "fork"
    try:
        if not (fork / "config.json").exists():
            build_checkpoint(fork, args.preset)
        without = llama_available(args) if "speed" in args.sections else "not asked for"
        ggufs = {}
        if not without:
            wanted = [LLAMA_TYPES[kind] for kind in args.classes]
            ggufs = {kind: workdir / f"model-{kind}.gguf" for kind in ["F32"] + wanted}
            if not all(path.exists() for path in ggufs.values()):
                ggufs = make_ggufs(fork, workdir, args.convert, wanted)
            import llama_cpp
            version = f"llama-cpp-python {llama_cpp.__version__}"
        else:
            version = f"llama.cpp not measured: {without}"
        bandwidth = {}
        for threads in args.threads:
            torch.set_num_threads(threads)
            bandwidth[threads] = mb.memory_bandwidth("cpu", mb.Clock("cpu", "wall"), 5)[0]
        load = os.getloadavg()
        machine = mb.machine_line(argparse.Namespace(device="cpu", clock="wall"))
        copies = ", ".join(f"{bandwidth[t] / 1e9:.1f} GB/s with {t} thread(s)" for t in args.threads)
        header = (f"{time.strftime('%Y-%m-%d')}, random GLM-4-shaped {args.preset} model; {machine}; {version}; "
                  f"copy {copies}; load average at start {load[0]:.1f}; medians of {args.rounds} interleaved rounds")
        print(header, flush=True)
        speed_rows, deviation_rows, kernel_rows = [], [], []
        if "speed" in args.sections:
            print(f"decode (ms/token, token 1 to {args.steps + 1}):", flush=True)
            speed(args, fork, ggufs, bandwidth, speed_rows)
        if "deviation" in args.sections:
            print("deviation of the fast paths:", flush=True)
            deviation(args, fork, deviation_rows)
        if "kernels" in args.sections:
            print("routes to the one-row products:\n" + cpu_matvec_kernels.HEADER, flush=True)
            block, count, head = cpu_matvec_kernels.SHAPES[args.preset]
            kernel_rows = cpu_matvec_kernels.measure(block * count + [head], args.threads, args.rounds, args.classes)
        print("\n" + markdown(speed_rows, deviation_rows, kernel_rows, header))
        if args.json:
            args.json.write_text(json.dumps(dict(header=header, cpu_class=mb.cpu_class(), speed=speed_rows,
                                                 deviation=deviation_rows, kernels=kernel_rows), indent=1))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
