"""The int4 storage check on a real device: layers of chatglm2-6b's shapes stored as chatglm2-6b-int4 stores them,
packed for torch's int4 kernel on the device (quantization_chatglm.py), must hold one copy of the codes and give the
original's codes back bit for bit wherever something reads them. Prints a table; exits 1 if a row fails.

    python tools/int4_check.py --device cuda       # in scripts/gpu_checks.sh; seconds
    python tools/int4_check.py --device cpu --shapes 256x128

Each row, for one layer [out, in]: the layout learned for the device's kernel (tile rows x columns; none: the codes are
kept beside the packed copy), the bytes held against the codes alone, the codes read back and the state dict against
the original codes, a prompt's weight (on a GPU dequantized from the packed bytes by one compiled kernel) against the
codes' bit for bit, a prompt's and a decode row's products against the exact path on the codes (within bf16's
rounding), and the codes after a move to the CPU and back and after a deepcopy.
"""
import argparse
import copy
import json
import sys

import torch

from chatglm_tools import REPO

CHATGLM2_6B_SHAPES = ("4608x4096", "4096x4096", "27392x4096", "4096x13696")  # query_key_value .. dense_4h_to_h


def held_bytes(layer) -> int:
    """Bytes of the layer's distinct storages: parameters and the packed copy (which may share the weight's)."""
    tensors = [*layer.parameters()]
    if layer.packed is not None:
        tensors += [layer.packed.weight, layer.packed.scales_and_zeros]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="*", default=list(CHATGLM2_6B_SHAPES), help="out x in of each layer")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import quantization_chatglm as quantization

    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    rows = [check_layer(quantization, *map(int, shape.split("x")), args.device) for shape in args.shapes]
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
