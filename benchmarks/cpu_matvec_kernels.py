#!/usr/bin/env python
"""What torch's CPU kernels reach on one row (single-sequence decode), against a copy of memory in the same process.

    .venv/bin/python benchmarks/cpu_matvec_kernels.py               # 1 and 2 threads, the 1.4B model's matrices
    .venv/bin/python benchmarks/cpu_matvec_kernels.py --quick       # small matrices: checks that everything runs

Every matrix of the GLM-4-shaped 1.4B model of benchmarks/llamacpp_benchmark.py (16 blocks: query_key_value,
dense, dense_h_to_4h, dense_4h_to_h; and the 151552 x 2048 output layer), random, each multiplied by one row back to
back; the median of --rounds passes. Printed: ms per pass, GB/s of weight bytes read, and that rate over the copy's
(benchmarks/model_benchmark.py's memory_bandwidth, measured just before each thread count). It says how far a decode
step on torch's kernels can go on this CPU, whatever the model around them does; llamacpp_benchmark.py's "matrix
products alone" is the same measure on the model's own layers.

Kernels: bf16 F.linear (the eager model), torch.mv (use_cpu_packed_weights' one-row path), oneDNN on a blocked copy
(its few-row path); int8 weight-only `_weight_int8pack_mm` (int8 checkpoints, quantize(8, storage="original")),
int8 x int8 `torch._int_mm` (activations quantized too, as llama.cpp's Q8_0 does; not used by the model); int4
`_weight_int4pack_mm_for_cpu` with groups of 64 (quantize(4, storage="original")). A kernel this torch lacks is
skipped and says why.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_benchmark as mb  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {  # (out, in) of one block's four layers, the block count, the output layer
    "glm-4-1.4b": ([(2304, 2048), (2048, 2048), (13696, 2048), (2048, 6848)], 16, (151552, 2048)),
    "quick": ([(384, 256), (256, 256), (1024, 256), (256, 512)], 2, (4096, 256)),
}
GROUP = 64  # int4 group size: divides every input width above


def kernels(shapes: list) -> dict:
    """name -> (a builder of the pass over every matrix, the weight bytes one pass reads). Built one at a time, so
    that only one kernel's weights are held."""
    rows = {k: torch.randn(1, k, dtype=torch.bfloat16) for _, k in shapes}

    def bf16_weights():
        return [torch.randn(n, k, dtype=torch.bfloat16) * 0.02 for n, k in shapes]

    def linear():
        weights = bf16_weights()
        return lambda: [F.linear(rows[w.shape[1]], w) for w in weights]

    def matrix_vector():
        weights = bf16_weights()
        return lambda: [torch.mv(w, rows[w.shape[1]][0]) for w in weights]

    def onednn():
        weights = [(torch.ops.mkldnn._reorder_linear_weight(w, 1), w.shape[1]) for w in bf16_weights()]
        return lambda: [torch.ops.mkldnn._linear_pointwise(rows[k], p, None, "none", [], "") for p, k in weights]

    def int8_codes():
        return [torch.randint(-127, 128, (n, k), dtype=torch.int8) for n, k in shapes]

    def int8_weight_only():
        layers = [(c, torch.rand(c.shape[0], dtype=torch.bfloat16)) for c in int8_codes()]
        return lambda: [torch.ops.aten._weight_int8pack_mm(rows[c.shape[1]], c, s) for c, s in layers]

    def int8_int8():
        quantized = {k: torch.randint(-127, 128, (1, k), dtype=torch.int8) for _, k in shapes}
        codes = [c.t() for c in int8_codes()]  # [in, out]: _int_mm's second operand
        return lambda: [torch._int_mm(quantized[c.shape[0]], c) for c in codes]

    def int4():
        convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        layers = [(convert(torch.randint(0, 16, (n, k), dtype=torch.int32), 1),
                   torch.rand(k // GROUP, n, 2, dtype=torch.bfloat16), k) for n, k in shapes]
        return lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(rows[k], p, GROUP, s) for p, s, k in layers]

    bf16, int8 = sum(n * k * 2 for n, k in shapes), sum(n * k for n, k in shapes)
    return {"bf16 F.linear (eager)": (linear, bf16), "bf16 torch.mv": (matrix_vector, bf16),
            "bf16 oneDNN blocked copy": (onednn, bf16), "int8 _weight_int8pack_mm": (int8_weight_only, int8),
            "int8 x int8 torch._int_mm": (int8_int8, int8), f"int4 _weight_int4pack_mm (groups of {GROUP})":
            (int4, int8 // 2 + sum(n * k // GROUP * 4 for n, k in shapes))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=7, help="passes per kernel (the median is printed)")
    parser.add_argument("--quick", action="store_true", help="small matrices, 2 rounds")
    args = parser.parse_args(argv)
    block, count, head = SHAPES["quick" if args.quick else "glm-4-1.4b"]
    shapes = block * count + [head]
    rounds = 2 if args.quick else args.rounds
    print(f"{time.strftime('%Y-%m-%d')}; {mb.machine_line(argparse.Namespace(device='cpu', clock='wall'))}; "
          f"{len(shapes)} matrices, one row each; medians of {rounds} passes")
    print("| kernel | threads | ms per pass | GB/s of weights | share of the copy |\n|---|---|---|---|---|")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        clock = mb.Clock("cpu", "wall")
        copy = mb.memory_bandwidth("cpu", clock, 5)[0]
        print(f"| copy | {threads} | | {copy / 1e9:.1f} | 100% |", flush=True)
        for name, (build, nbytes) in kernels(shapes).items():
            try:
                run = build()
                run()  # warm-up
                seconds = statistics.median(clock(run) for _ in range(rounds))
            except (AttributeError, RuntimeError, NotImplementedError) as error:  # not in this torch, or not here
                print(f"| {name} | {threads} | skipped: {type(error).__name__}: {str(error)[:120]} | | |", flush=True)
                continue
            print(f"| {name} | {threads} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.1f} | "
                  f"{nbytes / seconds / copy:.0%} |", flush=True)
            del run
    return 0


if __name__ == "__main__":
    sys.exit(main())
