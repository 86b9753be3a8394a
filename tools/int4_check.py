"""The int4 storage check on a real device: layers of chatglm2-6b's shapes stored as chatglm2-6b-int4 stores them,
packed for torch's int4 kernel on the device (quantization_chatglm.py), must hold one copy of the codes and give the
original's codes back bit for bit wherever something reads them. Prints a table; exits 1 if a row fails.

    python tools/int4_check.py --device cuda       # in scripts/gpu_checks.sh; seconds
    python tools/int4_check.py --device cpu --shapes 256x128
    python tools/int4_check.py --device cpu --whole-model   # + chatglm2-6b's whole model: bytes held against fp16

Each row, for one layer [out, in]: the layout learned for the device's kernel (tile rows x columns; none: the codes are
kept beside the packed copy), the bytes held against the codes alone, the codes read back and the state dict against
the original codes, a prompt's weight (on a GPU dequantized from the packed bytes by one compiled kernel) against the
codes' bit for bit, a prompt's and a decode row's products against the exact path on the codes (within bf16's
rounding), and the codes after a move to the CPU and back and after a deepcopy.
"""
import argparse
import copy
import json
import shutil
import sys
from pathlib import Path

import torch

from chatglm_tools import REPO, held_bytes, repository_module

CHATGLM2_6B_SHAPES = ("4608x4096", "4096x4096", "27392x4096", "4096x13696")  # query_key_value .. dense_4h_to_h
CHATGLM2_6B = dict(num_layers=28, hidden_size=4096, num_attention_heads=32, kv_channels=128, multi_query_group_num=2,
                   ffn_hidden_size=13696, padded_vocab_size=65024, seq_length=32768)


def check_layer(quantization, out: int, inputs: int, device: str) -> dict:
    torch.manual_seed(0)
    dense = torch.nn.Linear(inputs, out, device=device, dtype=torch.bfloat16)
    layer = quantization.QuantizedLinear.from_float(dense, 4)
    del dense
    codes = layer.weight.detach().clone()
    x_prompt = torch.randn(2, 40, inputs, device=device, dtype=torch.bfloat16)
    x_decode = torch.randn(1, 1, inputs, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        exact_prompt, exact_decode = layer(x_prompt), layer.exact_forward(x_decode, layer.bias)
        scale = layer.weight_scale.to(torch.bfloat16)
        dequantized = layer.dequantized_weight(torch.bfloat16)
        packed_ready = layer.use_kernel("packed")
        layout = layer.packed.layout if packed_ready else None
        row = {"shape": f"{out}x{inputs}", "packed": packed_ready,
               "layout": f"{layout.rows}x{layout.cols}" if layout is not None else "none",
               "held / codes": held_bytes(layer) / codes.numel(),
               "codes read back": torch.equal(layer.codes(), codes),
               "state dict": torch.equal(layer.state_dict()["weight"], codes)}
        # a prompt's weight: on a GPU the compiled dequantization of the packed bytes, else the codes read back
        fused = layout is not None and torch.device(device).type in quantization.FUSED_DEVICES
        weight = (quantization.fused_dequantize(layout, layer.weight, scale, out, inputs, torch.bfloat16) if fused
                  else layer.dequantized_weight(torch.bfloat16))
        row["prompt weight"] = weight is not None and torch.equal(weight, dequantized)
        row["prompt vs exact"] = relative_difference(layer(x_prompt), exact_prompt)  # one product against two
        row["decode vs exact"] = relative_difference(layer(x_decode), exact_decode)
        layer.cpu()
        row["to cpu"] = torch.equal(layer.codes(), codes.cpu())
        layer.to(device)
        row["and back"] = torch.equal(layer.codes(), codes) and (layer.packed is not None) == packed_ready
        row["deepcopy"] = torch.equal(copy.deepcopy(layer).codes(), codes)
    row["ok"] = (packed_ready and all(row[key] for key in ("codes read back", "state dict", "prompt weight", "to cpu",
                                                             "and back", "deepcopy"))
                 and row["prompt vs exact"] < 0.05 and row["decode vs exact"] < 0.05)
    return row


def relative_difference(value: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest difference, against the reference's largest magnitude (bf16: about 1e-2)."""
    return (value.float() - reference.float()).abs().max().item() / reference.float().abs().max().item()


def whole_model(device: str) -> dict:
    """chatglm2-6b's whole model (6.24B parameters) stored as chatglm2-6b-int4 stores it, random codes, in bf16 and
    packed as from_pretrained leaves it: the bytes it holds against the same weights in fp16, counted from the shapes
    (the fp16 twin is not built: 12 GB)."""
    import tempfile

    import transformers
    from chatglm_tools import copy_code_into

    folder = Path(tempfile.mkdtemp(prefix="chatglm-int4-check-"))
    try:
        config = json.loads((REPO / "config.json").read_text())
        config.update(CHATGLM2_6B, num_hidden_layers=CHATGLM2_6B["num_layers"], quantization_bit=4)
        (folder / "config.json").write_text(json.dumps(config))
        copy_code_into(folder)
        model = transformers.AutoModel.from_config(
            transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True), trust_remote_code=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    layers = [m for m in model.modules() if hasattr(m, "weight_scale")]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers:
            layer.weight.random_(-128, 128, generator=generator)
            layer.weight_scale.uniform_(1e-3, 1e-2, generator=generator)
    model.to(device=device, dtype=torch.bfloat16)
    model.use_quantized_kernel("auto")  # as from_pretrained does
    quantized = {id(layer.weight) for layer in layers} | {id(layer.weight_scale) for layer in layers}
    fp16 = sum(2 * p.numel() for p in model.parameters() if id(p) not in quantized)
    fp16 += sum(2 * layer.in_features * layer.out_features for layer in layers)
    held = held_bytes(model)
    packed = sum(layer.packed_storage() is not None for layer in layers)
    return {"parameters": sum(p.numel() for p in model.parameters()) - sum(layer.weight.numel() for layer in layers)
            + sum(layer.in_features * layer.out_features for layer in layers),
            "int4 layers": len(layers), "packed bytes as storage": packed,
            "held MiB": held / 2 ** 20, "fp16 MiB": fp16 / 2 ** 20, "held / fp16": held / fp16}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="*", default=list(CHATGLM2_6B_SHAPES), help="out x in of each layer")
    parser.add_argument("--whole-model", action="store_true",
                        help="also the bytes held by chatglm2-6b's whole model in int4 against fp16 (about 5 GB of "
                             "host memory on a CPU; target <= 0.35)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    quantization = repository_module("quantization_chatglm")

    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    rows = [check_layer(quantization, *map(int, shape.split("x")), args.device) for shape in args.shapes]
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys), flush=True)
    ok = all(row["ok"] for row in rows)
    if args.whole_model:
        model_row = whole_model(args.device)
        print("whole model: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in model_row.items()), flush=True)
        ok = ok and model_row["held / fp16"] <= 0.35
        rows.append(model_row)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
