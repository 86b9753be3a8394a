"""Serving-engine checks, on demand (not part of CI): do vLLM and llama.cpp serve a checkpoint exactly as our code does?

scripts/engines.sh builds the environments and runs `python scripts/engines.py run` in the llama.cpp environment
(transformers + llama-cpp-python), which
  1. builds, per family (GLM-4, ChatGLM3), a random-weight checkpoint with head size 128, the real vocabulary and the
     real tokenizer files, our code files beside them (the folder a user has after copying our files in); its config is
     the released one with the sizes shrunk (epsilon, context length, rope_ratio as released), its weights at a real
     model's scale (randn * 0.02, as benchmarks/model_benchmark.py makes them), where a wrong norm epsilon moves the
     logits by ~1e-2 (with std-1 embeddings the two epsilons give the same numbers);
  2. records what OUR code gives through transformers (trust_remote_code): greedy tokens, their logits and
     log-probabilities, and the chat prompt ids of `tokenizer.apply_chat_template(..., add_generation_prompt=True)`
     for a few conversations;
  3. exports the folder with tools/export_to_native_glm.py and converts that to GGUF with llama.cpp's
     convert_hf_to_gguf.py (f32, so that nothing is lost in the conversion);
  4. runs each engine in its own process and environment, which reports what it declares and the tokens it produced:
       (a) vLLM, `LLM(model=folder with our files, trust_remote_code=True)`
       (b) vLLM, `LLM(model=native export)` (no remote code)
       (c) llama.cpp (llama-cpp-python), `Llama(model_path=the GGUF)`
     greedy: the engine continues our chat prompt ids; chat ids: vLLM's `llm.chat()` prompt ids (vLLM renders with
     `tokenizer.apply_chat_template(conversation, tools=..., chat_template=..., tokenize=True, return_dict=False)`),
     llama.cpp's tokenization of our rendered chat text (`llm.tokenize(text, add_bos=False, special=True)`);
     logits: llama.cpp's whole logit rows along our greedy continuation (f32 KV cache), vLLM's log-probabilities of
     the greedy tokens, each against ours within LOGIT_TOLERANCE;
     declared: what the GGUF's metadata says (gguf-py, as llama.cpp reads it) and what vLLM's model config derives
     (context length, norm epsilon, rope base, heads, key/value groups, head size, rotated dimensions), each against
     the config we started from;
  5. prints one table and exits non-zero on any mismatch or failure.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from chatglm_tools import CODE_FILES, SHARED  # noqa: E402  (stdlib only: importable in every environment)

NEW_TOKENS = 16
CONTEXT = 512
# Largest |difference| of a logit (llama.cpp) or of a greedy token's log-probability (vLLM) from ours: fp32 engines
# differ by rounding (~1e-5); GLM-4's epsilon read as 1e-5 instead of 1.5625e-07 moves them by ~1e-2 at this scale.
LOGIT_TOLERANCE = 1e-3

# Head size 128 (vLLM's CPU attention refuses the tiny tests' 16), two query groups as the real checkpoints have.
SIZES = dict(num_layers=2, hidden_size=512, ffn_hidden_size=1024, kv_channels=128, num_attention_heads=4,
             multi_query_group_num=2, torch_dtype="float32")
FAMILIES = {
    # family: (config and generation config of the real checkpoint, its tokenizer files)
    "glm4": ("glm-4-9b-chat", "glm-4-9b-chat"),
    "chatglm3": ("chatglm3-6b", "chatglm3-6b"),
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def conversations(family: str) -> list:
    """(messages, tools) pairs whose prompt ids every engine must build as we do."""
    convs = [
        ([{"role": "user", "content": "你好，请介绍一下你自己。 Hello!"}], None),
        ([{"role": "system", "content": "You are a careful assistant."},
          {"role": "user", "content": "What is 2 + 2?"},
          {"role": "assistant", "content": "2 + 2 = 4."},
          {"role": "user", "content": "And   3 * 7?\n  Explain\tbriefly."}], None),
    ]
    if family == "glm4":  # tools through the `tools=` argument (llm.chat(tools=...)), as OpenAI-style clients send them
        convs.append(([{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL]))
    return convs


# ---------------------------------------------------------------------------------------------------------------------
# Our side (the environment with transformers and llama-cpp-python)
# ---------------------------------------------------------------------------------------------------------------------
def family_sources(family: str) -> tuple:
    """(config.json as a dict, tokenizer folder, generation_config.json) of the family's real checkpoint."""
    config_name, tokenizer_name = FAMILIES[family]
    configs = SHARED / "configs" / config_name
    return (json.loads((configs / "config.json").read_text()), SHARED / "tokenizers" / tokenizer_name,
            configs / "generation_config.json")


def engine_weights(name: str, shape, generator):
    """A real model's scale (model_benchmark's randn * 0.02), where a wrong norm epsilon shows (std-1 embeddings hid
    one); norm weights not all 1, so that a misplaced one shows."""
    import torch

    if "layernorm" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    return 0.02 * torch.randn(shape, generator=generator)


def build_checkpoint(family: str, folder: Path, seed: int = 0, code: Path = REPO, weights=engine_weights,
                     sources: tuple = None) -> None:
    """The family's real config.json shrunk to SIZES, random weights (`weights(name, shape, generator)`), real
    tokenizer files, the code files of `code`. `sources`: another (config, tokenizer folder, generation config) than
    the family's (family_sources)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config, tokenizer, generation_config = sources or family_sources(family)
    config = dict(config, **SIZES)
    if "num_hidden_layers" in config:
        config["num_hidden_layers"] = SIZES["num_layers"]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in CODE_FILES:
        shutil.copy(Path(code) / name, folder / name)
    for path in tokenizer.iterdir():
        shutil.copy(path, folder / path.name)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=True),
                                             trust_remote_code=True)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights(name, param.shape, generator).to(param.dtype))
    model.save_pretrained(folder)
    # save_pretrained rewrote config.json; a downloaded checkpoint has the original's (llama.cpp's converter, for
    # one, reads its `_name_or_path`).
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if generation_config and generation_config.exists():  # save_pretrained wrote one from the model config
        shutil.copy(generation_config, folder / "generation_config.json")


def original_declares(config: dict) -> dict:
    """What every engine must declare for the checkpoint: the values of the original config.json."""
    return {"context length": config.get("seq_length", 2048), "epsilon": config.get("layernorm_epsilon", 1e-5),
            "rope base": 10000.0 * config.get("rope_ratio", 1), "heads": config["num_attention_heads"],
            "key/value groups": config["multi_query_group_num"], "head size": config["kv_channels"],
            "rotated dims": config["kv_channels"] // 2}


def our_outputs(folder: Path, family: str, logits_file: Path) -> dict:
    """Our code through transformers, as a user runs it: chat ids, the rendered chat text, greedy tokens; the logit
    rows that chose them go to `logits_file` (numpy), their log-probabilities into the result."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    chat_ids, rendered = [], []
    for messages, tools in conversations(family):
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # a BatchEncoding on transformers 5 when return_dict is left to its default
            ids = ids["input_ids"]
        chat_ids.append(list(ids))
        rendered.append(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=False))
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    # No stop token: every engine is asked for exactly NEW_TOKENS tokens (vLLM ignore_eos, llama.cpp's raw loop).
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([chat_ids[0]])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=0)
    greedy = out[0, prompt.shape[1]:].tolist()
    if len(greedy) != NEW_TOKENS:
        raise RuntimeError(f"our generate stopped after {len(greedy)} tokens")
    with torch.no_grad():  # the rows that chose each greedy token, in one forward over the prompt and the tokens
        logits = model(out[:, :-1]).logits[0, prompt.shape[1] - 1:].float()
    numpy_save(logits_file, logits.numpy())
    logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(greedy)[:, None])[:, 0].tolist()
    return {"chat_ids": chat_ids, "rendered": rendered, "greedy_prompt": chat_ids[0], "greedy": greedy,
            "greedy_logprobs": logprobs, "logits_file": str(logits_file)}


def numpy_save(path: Path, array) -> None:
    import numpy

    with open(path, "wb") as handle:  # a file object: numpy.save appends .npy to a name without it
        numpy.save(handle, array)


# ---------------------------------------------------------------------------------------------------------------------
# The engines, each run as its own process (`engines.py vllm|llama ...`); each writes what it produced to --out
# ---------------------------------------------------------------------------------------------------------------------
def check_vllm(args) -> dict:
    import vllm
    from vllm import LLM, SamplingParams

    reference = json.loads(Path(args.reference).read_text())
    declared = vllm_declares(args)
    llm = LLM(model=args.model, trust_remote_code=args.trust_remote_code, dtype="float32", max_model_len=CONTEXT,
              enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    greedy = llm.generate({"prompt_token_ids": reference["greedy_prompt"]}, params, use_tqdm=False)
    generated = greedy[0].outputs[0]
    logprobs = [step[token].logprob for token, step in zip(generated.token_ids, generated.logprobs)]
    chat_ids, chat_greedy = [], []
    for messages, tools in conversations(args.family):
        out = llm.chat(messages, params, tools=tools, add_generation_prompt=True, use_tqdm=False)[0]
        chat_ids.append(list(out.prompt_token_ids))
        chat_greedy.append(list(out.outputs[0].token_ids))
    return {"greedy": list(generated.token_ids), "greedy_logprobs": logprobs, "chat_ids": chat_ids,
            "chat_greedy_first": chat_greedy[0], "version": f"vllm {vllm.__version__}", "declared": declared,
            "tokenizer": type(llm.get_tokenizer()).__name__}


def vllm_declares(args) -> dict:
    """What vLLM derives from the checkpoint's config, read from its ModelConfig (built without max_model_len, so that
    the context length is vLLM's own reading), in the fields its model class for the architecture takes: its ChatGLM
    (remote-code config) reads layernorm_epsilon and 10000 * rope_ratio, its Glm rms_norm_eps and the rope base."""
    from vllm.config import ModelConfig

    config = ModelConfig(model=args.model, trust_remote_code=args.trust_remote_code, dtype="float32")
    text = config.hf_text_config
    declared = {"context length": config.max_model_len, "heads": text.num_attention_heads,
                "key/value groups": config.get_total_num_kv_heads(), "head size": config.get_head_size()}
    if getattr(text, "model_type", "") == "chatglm":
        declared.update(epsilon=text.layernorm_epsilon, **{"rope base": 10000.0 * getattr(text, "rope_ratio", 1.0)})
    else:
        rope = getattr(text, "rope_parameters", None) or {"rope_theta": getattr(text, "rope_theta", None)}
        declared.update(epsilon=text.rms_norm_eps, **{"rope base": rope["rope_theta"]})
    return declared


def check_llama(args) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    import numpy

    reference = json.loads(Path(args.reference).read_text())
    # The KV cache in f32 (its default is f16): the logits are compared at fp32 rounding.
    llm = Llama(model_path=args.model, n_ctx=CONTEXT, n_threads=2, seed=0, verbose=False, logits_all=True,
                type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    chat_ids = [llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) for text in reference["rendered"]]
    greedy = []
    for token in llm.generate(reference["greedy_prompt"], temp=0.0, top_k=1, reset=True):
        greedy.append(int(token))
        if len(greedy) == NEW_TOKENS:
            break
    # The logit rows along OUR greedy continuation, as ours were computed: comparable even where a token differs.
    prompt = reference["greedy_prompt"]
    llm.reset()
    llm.eval(prompt + reference["greedy"][:-1])
    theirs = llm.scores[len(prompt) - 1:len(prompt) - 1 + NEW_TOKENS]
    ours = numpy.load(reference["logits_file"])
    return {"greedy": greedy, "chat_ids": chat_ids, "version": f"llama-cpp-python {llama_cpp.__version__}",
            "logit_difference": float(numpy.abs(theirs - ours).max())}


def worker_result(check, args, failure_key: str = "error") -> int:
    """A worker process's end: what `check(args)` found, or its traceback under failure_key, written to args.out as
    JSON for the orchestrating process (scripts/tools_check.py's workers end the same way)."""
    try:
        result = check(args)
    except Exception:
        result = {failure_key: traceback.format_exc()}
    Path(args.out).write_text(json.dumps(result))
    return 0 if failure_key not in result else 1


def engine_main(args) -> int:
    return worker_result(check_vllm if args.engine == "vllm" else check_llama, args)


# ---------------------------------------------------------------------------------------------------------------------
# The orchestration (the llama.cpp environment)
# ---------------------------------------------------------------------------------------------------------------------
def run_step(command: list, log: Path, env=None) -> str:
    """Run a step, its output to `log`; '' when it succeeded, else the last lines of its output."""
    print("+", " ".join(str(c) for c in command), flush=True)
    with open(log, "w") as out:
        code = subprocess.call([str(c) for c in command], stdout=out, stderr=subprocess.STDOUT, env=env)
    if code == 0:
        return ""
    # The last two lines that say something (a traceback's ^~~~ markers say nothing).
    tail = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip(" ^~\t")][-2:]
    return f"exit {code}: " + " / ".join(tail)


def gguf_declares(path: Path, gguf_py: Path) -> dict:
    """What a GGUF declares, read with the gguf-py that ships with the converter; the head size is the key length, or
    the embedding length / heads where it gives none, and the rope base 10000 where it gives none (llama.cpp's
    rules)."""
    if str(gguf_py) not in sys.path:
        sys.path.insert(0, str(gguf_py))
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def value(key, default=None):
        field = reader.get_field(key)
        return default if field is None else field.contents()

    arch = value("general.architecture")
    heads = value(f"{arch}.attention.head_count")
    return {"context length": value(f"{arch}.context_length"),
            "epsilon": value(f"{arch}.attention.layer_norm_rms_epsilon"),
            "rope base": value(f"{arch}.rope.freq_base", 10000.0), "heads": heads,
            "key/value groups": value(f"{arch}.attention.head_count_kv", heads),
            "head size": value(f"{arch}.attention.key_length", value(f"{arch}.embedding_length") // heads),
            "rotated dims": value(f"{arch}.rope.dimension_count")}


def declared_differences(original: dict, declared: dict) -> list:
    """'name: engine's value, original's value' for each value the engine declares otherwise (floats as stored in
    float32 by a GGUF: relative 1e-6)."""
    def shown(value):
        return f"{value:g}" if isinstance(value, float) else str(value)

    differences = []
    for name, value in declared.items():
        want = original[name]
        if value is None or abs(float(value) - float(want)) > 1e-6 * abs(float(want)):
            differences.append(f"{name} {'not declared' if value is None else shown(value)} (original {shown(want)})")
    return differences


def logit_difference(ours: dict, theirs: dict):
    """Largest difference from ours: the engine's own over whole logit rows (llama.cpp), else that of the greedy
    tokens' log-probabilities while its tokens are ours (vLLM); None when it reports neither."""
    if "logit_difference" in theirs:
        return theirs["logit_difference"]
    pairs = [(a, b) for a, b, x, y in zip(ours["greedy_logprobs"], theirs.get("greedy_logprobs") or [],
                                          ours["greedy"], theirs["greedy"]) if x == y]
    return max(abs(a - b) for a, b in pairs) if pairs else None


def compare(ours: dict, theirs: dict) -> tuple:
    """(greedy equal, logits within LOGIT_TOLERANCE, chat ids equal, notes) of one engine's result against ours."""
    greedy_equal = theirs["greedy"] == ours["greedy"]
    chat_equal = theirs["chat_ids"] == ours["chat_ids"]
    difference = logit_difference(ours, theirs)
    logits_close = difference is not None and difference <= LOGIT_TOLERANCE
    notes = []
    if difference is None:
        notes.append("no logits to compare")
    if not greedy_equal:
        notes.append(f"greedy ours {ours['greedy']} theirs {theirs['greedy']}")
    for i, (a, b) in enumerate(zip(ours["chat_ids"], theirs["chat_ids"])):
        if a != b:
            first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            notes.append(f"chat {i}: first difference at {first}: ours {a[first:first + 4]} theirs {b[first:first + 4]}")
    if "chat_greedy_first" in theirs and theirs["chat_greedy_first"] != ours["greedy"]:
        greedy_equal = False
        notes.append("llm.chat's generation differs from ours")
    logits = "-" if difference is None else f"{'yes' if logits_close else 'NO'} ({difference:.1e})"
    return greedy_equal, logits_close, logits, chat_equal, notes


def gguf_hints(folder: Path) -> list:
    """What llama.cpp's converter reads differently from transformers, when `folder`'s config.json trips it."""
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    hints = []
    scaling = rope.get("rope_type") or (config.get("rope_scaling") or {}).get("rope_type")
    if scaling not in (None, "default"):  # chatglm2-6b-32k's export: positions divided by rope_ratio
        hints.append(f"convert_hf_to_gguf reads no {scaling} rope scaling for Glm: a chatglm2-6b-32k export has no GGUF "
                     "route (the exporter says so)")
    if "rope_ratio" not in config and float(theta) != 10000.0:
        hints.append(f"convert_hf_to_gguf takes the rotary base from config.json's rope_ratio only (this one has "
                     f"rope_theta {theta:g} and no rope_ratio, so the GGUF gets 10000)")
    if "layernorm_epsilon" not in config and "rms_norm_eps" in config:
        hints.append(f"convert_hf_to_gguf takes the norm epsilon from config.json's layernorm_epsilon only (this one "
                     f"has rms_norm_eps {config['rms_norm_eps']:g} and no layernorm_epsilon, so the GGUF gets 1e-5)")
    if "seq_length" not in config and "max_position_embeddings" in config:
        hints.append(f"convert_hf_to_gguf takes the context length from config.json's seq_length only (this one has "
                     f"max_position_embeddings {config['max_position_embeddings']} and no seq_length, so the GGUF "
                     f"gets the hidden size {config.get('hidden_size')})")
    return hints


def convert_to_gguf(args, folder: Path, gguf: Path, log: Path, env: dict) -> str:
    """'' when llama.cpp's convert_hf_to_gguf.py wrote `gguf` (f32: nothing lost), else why not."""
    error = run_step([sys.executable, args.convert, folder, "--outfile", gguf, "--outtype", "f32"], log, env)
    if "pre-tokenizer was not recognized" in error:
        # Its ChatGLM class takes the SentencePiece route when hparams' _name_or_path contains the name; for a
        # config that loads without remote code that is the folder's path, not config.json's field.
        error += (" (convert_hf_to_gguf reads ChatGLM3's SentencePiece vocabulary only when _name_or_path contains"
                  " THUDM/chatglm3-6b: config.json's for a remote-code config, the folder's path for a native one;"
                  " any other tokenizer.json must be a BPE whose pre-tokenizer it knows by hash)")
    return error and f"GGUF conversion failed: {error}"


def orchestrate(args) -> int:
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_MODULES_CACHE=str(work / "modules"), VLLM_CPU_KVCACHE_SPACE="1")
    os.environ.update(env)
    rows = []
    for family in args.families:
        base = work / family
        ours_folder, native = base / "ours", base / "native"
        shutil.rmtree(base, ignore_errors=True)  # each run from scratch: nothing of an earlier run is compared
        base.mkdir()
        print(f"== {family}: checkpoint with our files in {ours_folder}", flush=True)
        build_checkpoint(family, ours_folder)
        ours = our_outputs(ours_folder, family, base / "ours-logits.npy")
        (base / "ours.json").write_text(json.dumps(ours))
        print(f"   ours: greedy {ours['greedy']}", flush=True)
        original = original_declares(json.loads((ours_folder / "config.json").read_text()))
        exporter = REPO / "tools" / "export_to_native_glm.py"
        if exporter.exists():
            export_error = run_step([sys.executable, exporter, ours_folder, native], base / "export.log", env)
            export_error = export_error and f"export failed: {export_error}"
        else:
            export_error = f"no exporter: {exporter.relative_to(REPO)} is missing"
        # (label, engine, model, extra arguments, why it cannot run, counted in the exit status)
        # llama.cpp's converter takes GLM-4 as a Glm export (its ChatGLM path needs `vocab_size`, which the original
        # config.json lacks) and ChatGLM3 as the original folder (its Glm path does not know the pre-tokenizer of a
        # BPE derived from SentencePiece): each family's working route counts, the other is shown as information.
        export_for_llama = family == "glm4"
        checks = [
            ("vLLM, trust_remote_code", "vllm", ours_folder, ["--trust-remote-code"], "", True),
            ("vLLM, native export", "vllm", native, [], export_error, True),
            ("llama.cpp, GGUF of native export" + ("" if export_for_llama else " (info)"), "llama", native, [],
             export_error, export_for_llama),
            ("llama.cpp, GGUF of folder with our files" + (" (info)" if export_for_llama else ""), "llama",
             ours_folder, [], "", not export_for_llama),
        ]
        for label, engine, model, extra, cannot, counted in checks:
            if args.engines and engine not in args.engines:
                continue
            name, source = f"{engine}-{model.name}", model
            if not cannot and engine == "llama":
                gguf = base / f"{family}-{model.name}-f32.gguf"
                cannot = convert_to_gguf(args, model, gguf, base / f"convert-{model.name}.log", env)
                model = gguf
            if cannot:
                rows.append((label, family, "-", "-", "-", "-", cannot, not counted))
                continue
            python = args.vllm_python if engine == "vllm" else sys.executable
            out = base / f"{name}.json"
            error = run_step([python, __file__, engine, "--family", family, "--model", model, "--reference",
                              base / "ours.json", "--out", out, *extra], base / f"{name}.log", env)
            theirs = json.loads(out.read_text()) if out.exists() else {"error": error}
            if "error" in theirs:
                last = [line for line in theirs["error"].strip().splitlines() if line.strip()][-1:]
                rows.append((label, family, "-", "-", "-", "-", f"failed: {' '.join(last)} (log: {base / name}.log)",
                             not counted))
                continue
            greedy_equal, logits_close, logits, chat_equal, notes = compare(ours, theirs)
            declared = gguf_declares(model, Path(args.convert).parent / "gguf-py") if engine == "llama" else \
                theirs["declared"]
            differences = declared_differences(original, declared)
            notes.insert(0, theirs["version"])
            if differences:
                notes.append(("GGUF declares " if engine == "llama" else "vLLM derives ") + ", ".join(differences))
            if engine == "llama" and not (greedy_equal and logits_close and not differences):
                notes += gguf_hints(source)
            passed = greedy_equal and logits_close and chat_equal and not differences
            rows.append((label, family, "NO" if differences else "yes", "yes" if greedy_equal else "NO", logits,
                         "yes" if chat_equal else "NO", "; ".join(notes), passed or not counted))
    return table_verdict(rows, "engines", "every counted check equal to ours")


def table_verdict(rows: list, who: str, all_passed: str, **table) -> int:
    """Print the table, then the verdict: the exit status of a check whose rows end with their pass flag."""
    print_table(rows, **table)
    failed = [row for row in rows if not row[-1]]
    if failed:
        print(f"{who}: {len(failed)} of {len(rows)} checks FAILED", file=sys.stderr)
        return 1
    print(f"{who}: {all_passed} ({len(rows)} rows)")
    return 0


def print_table(rows: list, header=("engine", "family", "declares the original's", "greedy equal",
                                      f"logits within {LOGIT_TOLERANCE:g}", "chat ids equal", "notes")) -> None:
    """A markdown table of the rows' first len(header) cells."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in row[:len(header)]) + " |")
    print(flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="build the checkpoints, run every engine, print the table")
    run.add_argument("--work", default=str(REPO / ".venv-engines" / "work"))
    run.add_argument("--vllm-python", required=True, help="python of the vLLM environment")
    run.add_argument("--convert", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    run.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    run.add_argument("--engines", nargs="+", choices=["vllm", "llama"], help="only these engines (default: all)")
    for engine in ("vllm", "llama"):
        one = sub.add_parser(engine, help=f"one {engine} check (run by `run` in the {engine} environment)")
        one.add_argument("--family", required=True, choices=list(FAMILIES))
        one.add_argument("--model", required=True)
        one.add_argument("--reference", required=True)
        one.add_argument("--out", required=True)
        one.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "run":
        return orchestrate(args)
    args.engine = args.command
    return engine_main(args)


if __name__ == "__main__":
    sys.exit(main())
