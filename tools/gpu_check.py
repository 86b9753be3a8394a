"""The device tests on real devices: a tiny ChatGLM2/3 and GLM-4 split between cpu and cuda:0 (and over all visible
GPUs), in fp32 and bf16, against the same model on one device. Prints a table; exits 1 if a row fails.

    python tools/gpu_check.py                      # cpu+cuda:0, all GPUs, cpu+all GPUs
    python tools/gpu_check.py --splits cpu,cuda:0 --dtypes bfloat16

Each row: forward logits and loss on a left-padded batch, the gradients of one backward, greedy and batched greedy
generation (with a repetition penalty, which reads ids beside the scores; tokens may part only at a near tie, where the
one-device model's two best scores are within twice the logits tolerance), and where each layer's KV cache lives
after prefill and a decode step. Inputs start on the CPU, as a tokenizer returns them; any warning about devices
fails the row, and is printed under it. Shares its checks with the test suite's virtual-device tests (tools/chatglm_tools/device_check.py).
"""
import argparse
import importlib
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import torch

from chatglm_tools import REPO, device_check

FAMILY_FIELDS = {  # the fields that differ between the families' real configs, at tiny sizes
    "glm4": dict(rope_ratio=500, layernorm_epsilon=1.5625e-07),
    "chatglm3": dict(rope_ratio=1, layernorm_epsilon=1e-05),
}
# fp32 differs between CPU and GPU kernels by rounding only; bf16 by its 8-bit mantissa.
TOLERANCES = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (0.25, 0.5)}


def import_repository_code(root: Path):
    """The repository's modeling code as a package (it imports its config relatively, as remote code does), copied
    into the folder `root`."""
    package = root / "chatglm_gpu_check"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("configuration_chatglm.py", "modeling_chatglm.py"):
        shutil.copy(REPO / name, package / name)
    sys.path.insert(0, str(root))
    return importlib.import_module("chatglm_gpu_check.modeling_chatglm")


def tiny_model(modeling, family: str, num_layers: int, attn: str, dtype):
    config = modeling.ChatGLMConfig(
        num_layers=num_layers, padded_vocab_size=512, hidden_size=128, ffn_hidden_size=256, kv_channels=32,
        num_attention_heads=4, multi_query_attention=True, multi_query_group_num=2, add_qkv_bias=True,
        seq_length=1024, pad_token_id=0, eos_token_id=2, **FAMILY_FIELDS[family],
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = modeling.ChatGLMForConditionalGeneration(config)
    with torch.no_grad():  # large enough weights that greedy choices are clear
        for name, param in model.named_parameters():
            if "layernorm" not in name:
                param.normal_(0.0, 1.0 if "word_embeddings" in name else 0.15)
    return model.to(dtype).eval()


def default_splits():
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if not gpus:
        raise SystemExit("no CUDA device visible: run this on a GPU machine (or pass --splits cpu,cpu to try it)")
    splits = [["cpu", gpus[0]]]
    if len(gpus) > 1:
        splits += [gpus, ["cpu"] + gpus]
    return splits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--splits", nargs="*", help="comma-separated device lists, e.g. cpu,cuda:0 cuda:0,cuda:1")
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--attn", nargs="*", default=["sdpa", "eager"])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    splits = [s.split(",") for s in args.splits] if args.splits else default_splits()
    # The copy of the model code goes in one temporary folder, removed at the end, also after an error, Ctrl-C or a
    # kill (SIGTERM), as in examples/demo.py.
    workdir = Path(tempfile.mkdtemp(prefix="chatglm-gpu-check-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args, splits, import_repository_code(workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args, splits: list, modeling) -> int:
    rows, failed = [], False
    header = f"{'family':9} {'dtype':9} {'attn':6} {'devices':28} {'logits':>9} {'grads':>9} greedy batch cache  ok"
    print(header)
    print("-" * len(header))
    for devices in splits:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for attn in args.attn:
                for family in FAMILY_FIELDS:
                    num_layers = max(3, len(devices))
                    model = tiny_model(modeling, family, num_layers, attn, dtype)
                    device_map = device_check.spread_device_map(num_layers, devices)
                    reference = next((d for d in devices if d != "cpu"), devices[0])
                    report = device_check.run(model, device_map, reference_device=reference)
                    ok = report.ok(*TOLERANCES[dtype])
                    failed |= not ok
                    rows.append(dict(family=family, dtype=dtype_name, attn=attn, devices=devices, ok=ok,
                                     **report.__dict__))
                    print(f"{family:9} {dtype_name:9} {attn:6} {'+'.join(devices):28} "
                          f"{report.logits_max_diff:9.2e} {report.grad_max_diff:9.2e} "
                          f"{str(report.greedy_same):6} {str(report.batch_greedy_same):5} "
                          f"{str(report.cache_on_layer_devices):5} {'PASS' if ok else 'FAIL'}")
                    for message in report.device_warnings:  # counted against the row: say which
                        print(f"    warning: {' '.join(message.split())}")
                    if report.divergence is not None:
                        name, row, step, margin = report.divergence
                        tie = "a near tie" if margin <= 2 * TOLERANCES[dtype][0] else "NOT a near tie"
                        print(f"    {name} greedy differs from new token {step} of row {row}: the one-device model's "
                              f"two best scores there are {margin:.3g} apart ({tie}: the limit is twice the "
                              f"logits tolerance, {2 * TOLERANCES[dtype][0]:g})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
