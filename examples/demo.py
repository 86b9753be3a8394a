"""Offline demo: load a ChatGLM / GLM-4 checkpoint the way a user does and generate.

With no argument it builds a small random-weight checkpoint from this repository's own config.json (glm-4-9b-chat,
scaled down) with glm-4-9b-chat's real tokenizer files (testdata/tokenizers), so it runs on a fresh clone with no
download: the text is gibberish, the pipeline is real (chat template -> ids -> generate -> decode, through
AutoModelForCausalLM with trust_remote_code=True).

    python examples/demo.py                     # the embedded tiny checkpoint
    python examples/demo.py --model /path/to/glm-4-9b-chat --prompt "你好"
"""
import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from chatglm_tools import CODE_FILES, shared_path  # noqa: E402  (the files a user copies, the reference data)

# Shrinks glm-4-9b-chat; the vocabulary stays whole so that real tokenizer ids fit.
DEMO_SIZES = dict(num_layers=2, num_hidden_layers=2, hidden_size=128, ffn_hidden_size=256, kv_channels=32,
                  num_attention_heads=4, multi_query_group_num=2, seq_length=4096, torch_dtype="float32")


def build_tiny_checkpoint(folder: Path, seed: int) -> Path:
    """Random weights, the repository's config scaled down, our code files beside them: a checkpoint folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((REPO / "config.json").read_text())
    config.update(DEMO_SIZES)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in CODE_FILES:
        if (REPO / name).exists():
            shutil.copy(REPO / name, folder / name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=True),
                                             trust_remote_code=True)
    with torch.no_grad():  # larger than the default init, so that the greedy choices are not all ties
        for name, param in model.named_parameters():
            if "layernorm" not in name:
                param.normal_(0.0, 1.0 if "word_embeddings" in name else 0.1)
    model.save_pretrained(folder)
    # After save_pretrained, which writes a generation config derived from the model config: the real one has
    # glm-4-9b-chat's stop ids and sampling defaults.
    shutil.copy(REPO / "generation_config.json", folder / "generation_config.json")
    shutil.copy(shared_path("tokenizers", "glm-4-9b-chat", "tokenizer.model"), folder / "tokenizer.model")
    shutil.copy(REPO / "tokenizer_config.json", folder / "tokenizer_config.json")
    return folder


def quantized(folder: Optional[Path]) -> bool:
    """Whether a checkpoint folder holds quantized weights (its config.json has a quantization_config)."""
    config = folder / "config.json" if folder is not None else None
    return config is not None and config.is_file() and "quantization_config" in json.loads(config.read_text())


def without_unused_quantization_backend():
    """transformers 5 imports torchao on its first model load whenever torchao is installed (its quantizer registry,
    transformers.quantizers.auto), and torchao prints load failures of its CUDA kernels and torch warnings on import.
    The demo quantizes nothing: marking the package absent for this process keeps it from being imported."""
    sys.modules.setdefault("torchao", None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint folder (copy this repository's .py files into it first)")
    parser.add_argument("--prompt", default="Write one sentence about the sea.")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--device", default="cpu", help="cpu, cuda, or auto (accelerate device_map)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    # Everything the demo writes (the tiny checkpoint, transformers' copy of the remote code) goes in one folder,
    # removed at the end, also after an error, Ctrl-C or a kill (SIGTERM).
    workdir = Path(tempfile.mkdtemp(prefix="chatglm-demo-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args, workdir: Path) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_MODULES_CACHE", str(workdir / "modules"))
    if not quantized(Path(args.model) if args.model else None):
        without_unused_quantization_backend()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.model:
        folder = Path(args.model)
    else:
        transformers.utils.logging.disable_progress_bar()  # a one-file, 40 MB checkpoint: no bar to watch
        print(f"building a random-weight checkpoint: glm-4-9b-chat's config.json with {DEMO_SIZES['num_layers']} "
              f"layers of {DEMO_SIZES['hidden_size']}", flush=True)
        folder = build_tiny_checkpoint(workdir / "glm4_tiny_demo", args.seed)
    load = {"device_map": "auto"} if args.device == "auto" else {}
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **load)
    if args.device != "auto":
        model = model.to(args.device)
    model.eval()
    print(f"loaded {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters) "
          f"with transformers {transformers.__version__}, torch {torch.__version__}")

    tokenizer = None
    if (folder / "tokenizer.model").exists():
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    if tokenizer is not None:
        messages = [{"role": "user", "content": args.prompt}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_tensors="pt", return_dict=True)
        print(f"prompt: {args.prompt!r} -> ids {inputs['input_ids'][0].tolist()}")
    else:
        ids = torch.tensor([[151331, 151333, 151336, 198, 9707, 151337]])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        print(f"prompt: ids {ids[0].tolist()} ({folder} has no tokenizer.model: ids only)")
    inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
    # Greedy, from the checkpoint's generation_config.json otherwise (glm-4-9b-chat's: its stop ids). That file bounds
    # the whole sequence (max_length=128000), which transformers 5 counts as set by the caller, warning when
    # max_new_tokens is given as well: the demo bounds the whole sequence too, the prompt and --max-new-tokens. Its
    # sampling settings are unset for greedy search (transformers 4 warns about them otherwise).
    max_length = inputs["input_ids"].shape[1] + args.max_new_tokens
    with torch.no_grad():
        output = model.generate(**inputs, max_length=max_length, do_sample=False, temperature=None, top_p=None)
    new_tokens = output[0, inputs["input_ids"].shape[1]:]
    if tokenizer is not None:
        answer = repr(tokenizer.decode(new_tokens, skip_special_tokens=True))
        print(f"answer: {answer} <- ids {new_tokens.tolist()}" + ("" if args.model else " (random weights: no meaning)"))
    else:
        print(f"answer: ids {new_tokens.tolist()}")
    print("demo: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
