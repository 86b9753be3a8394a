#!/usr/bin/env python
"""What each route to a CPU's one-row products (single-sequence decode) reaches, against a copy of memory in the same
process.

    .venv/bin/python benchmarks/cpu_matvec_kernels.py               # 1 and 2 threads, the 1.4B model's matrices
    .venv/bin/python benchmarks/cpu_matvec_kernels.py --quick       # small matrices: checks that everything runs
    .venv/bin/python benchmarks/cpu_matvec_kernels.py --classes int8,int4 --threads 2

Every matrix of the GLM-4-shaped 1.4B model of benchmarks/llamacpp_benchmark.py (16 blocks: query_key_value,
dense, dense_h_to_4h, dense_4h_to_h; and the 151552 x 2048 output layer), random, each multiplied by one row back to
back; the median of --rounds passes. Printed: ms per pass, GB/s of weight bytes read, and that rate over the copy's
(benchmarks/model_benchmark.py's memory_bandwidth, measured just before each thread count). It says how far a decode
step can go on each route on this CPU, whatever the model around the products does; llamacpp_benchmark.py's "matrix
products alone" is the same measure on the model's own layers, and its `kernels` section runs this table.

Routes, per weight class (the model's own path is named; the others are the ones tried for issue 50):
  fp32  F.linear (the eager model); torch.mv; torch.mv over blocks of rows, one per thread (use_cpu_packed_weights()
        in fp32: quantization_chatglm.split_matrix_vector); inductor's code for the one-row product (torch.compile)
  bf16  F.linear (the eager model); torch.mv (use_cpu_packed_weights(), one row); the same over blocks of rows;
        oneDNN on a blocked copy (its few-row path); inductor's code (bf16 read, fp32 sums)
  int8  `_weight_int8pack_mm` (int8 checkpoints, quantize(8, storage="original")); the same over blocks of rows;
        int8 x int8 `torch._int_mm` (activations quantized too, as llama.cpp's Q8_0 does); inductor's code with the
        codes turned into floats in the reduction, as int8 loads or four codes per int32 word; inductor's
        weight-only GEMM template (max-autotune, freezing); torchao's int8 weight-only layout
  int4  `_weight_int4pack_mm_for_cpu` in groups of 64 (quantize(4, storage="original")); the same over blocks of
        rows; inductor's code unpacking the original's nibbles in the reduction (eight per int32 word); torchao's
        int4 weight-only layout for a CPU
Each route's product on the first matrix is checked against the float product of the same weights before it is
timed: one that misses it by more than 2% of the largest output is not timed, and its line says "wrong" and by how
much. A route this torch (or torchao, or a missing C++ compiler) lacks is skipped and says why.
"""
import argparse
import contextlib
import importlib.util
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
    # --quick: two shapes (each compiled route compiles once per shape)
    "quick": ([(256, 256), (1024, 256)], 2, (1024, 256)),
}
CLASSES = ("fp32", "bf16", "int8", "int4")
GROUP = 64  # int4 group size: divides every input width above


def companion():
    """quantization_chatglm.py of this checkout (split_matrix_vector, row_blocks: the model's own code)."""
    spec = importlib.util.spec_from_file_location("quantization_chatglm", mb.REPO / "quantization_chatglm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


Q = companion()


# ---------------------------------------------------------------------------------------------------------------------
# The weights of each class, and the float product each route is checked against


def weights(kind: str, shapes: list) -> list:
    """Per matrix, what the class's routes read: fp32/bf16 the weight; int8 (codes int8 [out, in], per-row scale);
    int4 (the original's codes int8 [out, in / 2], two a byte, the even column high; per-row scale)."""
    generator = torch.Generator().manual_seed(0)
    made = []
    for n, k in shapes:
        if kind in ("fp32", "bf16"):
            made.append((torch.randn(n, k, generator=generator) * 0.02).to(torch.float32 if kind == "fp32"
                                                                          else torch.bfloat16))
            continue
        levels = 127 if kind == "int8" else 7
        codes = torch.randint(-levels, levels + 1, (n, k), dtype=torch.int8, generator=generator)
        if kind == "int4":
            codes = (codes[:, 0::2] << 4) | (codes[:, 1::2] & 15)
        made.append((codes, torch.rand(n, generator=generator).to(torch.bfloat16) * 0.01))
    return made


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """The original's int4 codes [out, in / 2] as signed values int8 [out, in]."""
    return torch.stack((codes >> 4, (codes << 4) >> 4), dim=-1).flatten(-2)


def float_weight(kind: str, weight) -> torch.Tensor:
    if kind in ("fp32", "bf16"):
        return weight.float()
    codes, scale = weight
    return (codes if kind == "int8" else nibbles(codes)).float() * scale.float()[:, None]


def weight_bytes(kind: str, weight) -> int:
    if kind in ("fp32", "bf16"):
        return weight.numel() * weight.element_size()
    codes, scale = weight
    return codes.numel() + scale.numel() * scale.element_size()


# ---------------------------------------------------------------------------------------------------------------------
# The routes: each a builder (the class's weights, the input rows by width) -> a pass (returns the products)


def compiled(function, **options):
    """torch.compile of `function` for fixed sizes (one graph per matrix shape, as a static cache gives). The fp32 and
    bf16 routes share a function, and so its recompilations: the limit raised so that no shape runs eagerly."""
    for limit in ("recompile_limit", "cache_size_limit"):  # (its name until torch 2.6, and after)
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, max(64, getattr(torch._dynamo.config, limit)))
    return torch.compile(function, dynamic=False, **options)


def split_products(rows: int, row_bytes: int, product, dtype) -> torch.Tensor:
    """product(start, stop) -> the outputs of rows [start, stop), run over quantization_chatglm's row blocks, one per
    thread (the route use_cpu_packed_weights() takes for one fp32 row, tried here on the other kernels)."""
    out = torch.empty(rows, dtype=dtype)

    def block(start, stop):
        out[start:stop] = product(start, stop).reshape(-1)

    if not Q.split_rows(rows, row_bytes, block):
        block(0, rows)
    return out


def float_routes() -> dict:
    def linear(ws, xs):
        return lambda: [F.linear(xs[w.shape[1]], w) for w in ws]

    def matrix_vector(ws, xs):
        return lambda: [torch.mv(w, xs[w.shape[1]][0]) for w in ws]

    def split(ws, xs):
        return lambda: [Q.split_matrix_vector(w, xs[w.shape[1]][0], None) for w in ws]

    def split_any(ws, xs):  # the same blocks for a dtype other than fp32
        return lambda: [split_products(w.shape[0], w.shape[1] * w.element_size(),
                                       lambda a, b, w=w: torch.mv(w[a:b], xs[w.shape[1]][0]), w.dtype) for w in ws]

    def inductor(ws, xs):
        product = compiled(lambda w, x: (w.float() * x.float()).sum(-1))
        return lambda: [product(w, xs[w.shape[1]]) for w in ws]

    def onednn(ws, xs):
        packed = [(torch.ops.mkldnn._reorder_linear_weight(w, 1), w.shape[1]) for w in ws]
        return lambda: [torch.ops.mkldnn._linear_pointwise(xs[k], p, None, "none", [], "") for p, k in packed]

    return {
        "fp32": {"F.linear (eager)": linear, "torch.mv": matrix_vector,
                 "torch.mv, rows split over threads (use_cpu_packed_weights)": split,
                 "compiled one-row product (inductor)": inductor},
        "bf16": {"F.linear (eager)": linear, "torch.mv (use_cpu_packed_weights, one row)": matrix_vector,
                 "torch.mv, rows split over threads": split_any, "oneDNN blocked copy": onednn,
                 "compiled one-row product (inductor, fp32 sums)": inductor},
    }


def int8_routes() -> dict:
    def weight_only(ws, xs):
        return lambda: [torch.ops.aten._weight_int8pack_mm(xs[c.shape[1]], c, s) for c, s in ws]

    def split(ws, xs):
        return lambda: [split_products(c.shape[0], c.shape[1], lambda a, b, c=c, s=s: torch.ops.aten._weight_int8pack_mm(
            xs[c.shape[1]], c[a:b], s[a:b]), torch.bfloat16) for c, s in ws]

    def int8_int8(ws, xs):
        transposed = [(c.t(), s) for c, s in ws]  # [in, out]: _int_mm's second operand

        def run():
            outs = []
            for c, s in transposed:
                x = xs[c.shape[0]].float()
                step = x.abs().amax() / 127
                outs.append(torch._int_mm(torch.round(x / step).to(torch.int8), c).float() * step * s.float())
            return outs
        return run

    def in_reduction(ws, xs):
        product = compiled(lambda c, s, x: (c.float() * x.float()).sum(-1) * s.float())
        return lambda: [product(c, s, xs[c.shape[1]]) for c, s in ws]

    def words(ws, xs):
        # four codes per int32 word: byte j of word m is column 4m + j (little-endian), sign-extended by shifts;
        # the row is laid out to match ([4, in / 4]), so that every load is a whole vector
        def product(c, s, x):
            w = c.view(torch.int32)
            return sum(((w << (24 - 8 * j)) >> 24).float() * x[j] for j in range(4)).sum(-1) * s.float()

        product = compiled(product)
        rows = {k: x.float().view(-1, 4).t().contiguous() for k, x in xs.items()}
        return lambda: [product(c, s, rows[c.shape[1]]) for c, s in ws]

    def template(ws, xs):  # inductor's CPU weight-only GEMM template: the weights frozen into the graph
        class Layer(torch.nn.Module):
            def __init__(self, codes, scale):
                super().__init__()
                self.register_buffer("codes", codes)
                self.register_buffer("scale", scale)

            def forward(self, x):
                return F.linear(x, self.codes.to(x.dtype)) * self.scale

        layers = [compiled(Layer(c, s), mode="max-autotune") for c, s in ws]
        with torch._inductor.config.patch(freezing=True), torch.no_grad():
            for layer, (c, _) in zip(layers, ws):
                layer(xs[c.shape[1]])  # compiles here, with freezing

        def run():
            with torch.no_grad():
                return [layer(xs[c.shape[1]]) for layer, (c, _) in zip(layers, ws)]
        return run

    def torchao(ws, xs):
        return torchao_layers(ws, xs, "int8")

    return {"_weight_int8pack_mm (int8 checkpoints, quantize(8))": weight_only,
            "_weight_int8pack_mm, rows split over threads": split, "int8 x int8 torch._int_mm (W8A8)": int8_int8,
            "compiled: codes x scale in the reduction (inductor)": in_reduction,
            "compiled: four codes per int32 word (inductor)": words,
            "compiled max-autotune, freezing (inductor's weight-only template)": template,
            "torchao int8 weight-only": torchao}


def int4_routes() -> dict:
    def packed_blocks(ws, blocks_of):
        """The kernel's packed weight and its scales per row block of each matrix (the kernel takes whole rows)."""
        convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        made = []
        for codes, scale in ws:
            n, k = codes.shape[0], codes.shape[1] * 2
            q = (nibbles(codes) + 8).to(torch.int32)
            pairs = torch.stack((scale.expand(k // GROUP, -1), torch.zeros_like(scale).expand(k // GROUP, -1)), -1)
            made.append((k, n, [(start, stop, convert(q[start:stop].contiguous(), 1),
                                 pairs[:, start:stop].contiguous()) for start, stop in blocks_of(n, k // 2)]))
        return made

    def weight_only(ws, xs):
        layers = packed_blocks(ws, lambda n, row_bytes: [(0, n)])
        return lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], p, GROUP, s)
                        for k, _, [(_, _, p, s)] in layers]

    def split(ws, xs):
        layers = packed_blocks(ws, Q.row_blocks)

        def run():
            outs = []
            for k, n, blocks in layers:
                parts = {start: (p, s) for start, _, p, s in blocks}
                outs.append(split_products(n, k // 2, lambda a, b, parts=parts, k=k: (
                    torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], parts[a][0], GROUP, parts[a][1])),
                    torch.bfloat16))
            return outs
        return run

    def words(ws, xs):
        # eight codes per int32 word: nibble j (bits 4j..4j+3) of word m holds column 8m + 2 (j // 2) + (1 - j % 2)
        # (byte j // 2, the even column in the high nibble); the row laid out to match ([8, in / 8])
        def product(c, s, x):
            w = c.view(torch.int32)
            return sum(((w << (28 - 4 * j)) >> 28).float() * x[j] for j in range(8)).sum(-1) * s.float()

        product = compiled(product)
        order = [2 * (j // 2) + 1 - j % 2 for j in range(8)]
        rows = {k: x.float().view(-1, 8)[:, order].t().contiguous() for k, x in xs.items()}
        return lambda: [product(c, s, rows[c.shape[1] * 2]) for c, s in ws]

    def torchao(ws, xs):
        return torchao_layers(ws, xs, "int4")

    return {f"_weight_int4pack_mm, groups of {GROUP} (quantize(4))": weight_only,
            "_weight_int4pack_mm, rows split over threads": split,
            "compiled: eight codes per int32 word unpacked in the reduction (inductor)": words,
            "torchao int4 weight-only, CPU layout": torchao}


def torchao_layers(ws, xs, kind: str):
    """torchao's weight-only layout for a CPU (its own quantization of the same float weights, per-row int8 or
    groups of 64 in int4): the versions this repository's environments have (0.6.1 with torch 2.4, the newest
    later) name it differently; none found: ImportError, and the route is skipped."""
    import torchao.quantization as ao

    if kind == "int8":
        config = ao.Int8WeightOnlyConfig() if hasattr(ao, "Int8WeightOnlyConfig") else ao.int8_weight_only()
    elif hasattr(ao, "Int4WeightOnlyConfig"):
        try:
            from torchao.dtypes import Int4CPULayout
            config = ao.Int4WeightOnlyConfig(group_size=GROUP, layout=Int4CPULayout(), version=1)
        except ImportError:  # the newest: a packing format per device
            config = ao.Int4WeightOnlyConfig(group_size=GROUP)
    else:
        raise ImportError(f"torchao {getattr(torchao_module(), '__version__', '?')}: no int4 weight-only CPU layout")
    layers = []
    for weight in ws:
        dense = float_weight(kind, weight).to(torch.bfloat16)
        layer = torch.nn.Linear(dense.shape[1], dense.shape[0], bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(dense)
        ao.quantize_(layer, config)
        layers.append(layer)

    def run():
        with torch.no_grad():
            return [layer(xs[layer.in_features]) for layer in layers]
    return run


def torchao_module():
    import torchao
    return torchao


def routes() -> dict:
    """class -> route name -> builder (the class's weights, the input rows by width) -> a pass returning the
    products."""
    return {**float_routes(), "int8": int8_routes(), "int4": int4_routes()}


# ---------------------------------------------------------------------------------------------------------------------
# Timing


class WrongProduct(Exception):
    pass


def check(outs: list, kind: str, ws: list, xs: dict):
    """The route's product of the first matrix against the float product of the same weights (bf16 activations and
    sums of 2048+ terms: within 2% of the largest output): a route that computes something else is not timed, and
    its line says by how much it missed."""
    weight = float_weight(kind, ws[0])
    expected = F.linear(xs[weight.shape[1]].float(), weight).reshape(-1)
    got = outs[0].float().reshape(-1)
    if got.shape != expected.shape:
        raise WrongProduct(f"its product has the shape {tuple(got.shape)}, not {tuple(expected.shape)}")
    missed = (got - expected).abs().max().item() / expected.abs().max().item()
    if missed > 0.02:
        raise WrongProduct(f"its product differs from the float one by {missed:.1%} of the largest output")


def measure(shapes: list, threads: list, rounds: int, classes=CLASSES, clock=None) -> list:
    """Rows {kind (the class), route, threads, ms, gbs, share, copy_gbs} or {..., skipped: why}, a {kind: "copy",
    gbs} row before each thread count's, printed as they come."""
    clock = clock or mb.Clock("cpu", "wall")
    rows = []
    for count in threads:
        torch.set_num_threads(count)
        copy = mb.memory_bandwidth("cpu", clock, 5)[0]
        rows.append(dict(kind="copy", route="", threads=count, gbs=copy / 1e9, share=1.0))
        print(format_row(rows[-1]), flush=True)
        for kind in classes:
            ws = weights(kind, shapes)
            nbytes = sum(weight_bytes(kind, w) for w in ws)
            widths = {k for _, k in shapes}
            xs = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(
                torch.float32 if kind == "fp32" else torch.bfloat16) for k in widths}
            for name, build in routes()[kind].items():
                row = dict(kind=kind, route=name, threads=count, copy_gbs=copy / 1e9)
                try:
                    run = build(ws, xs)
                    check(run(), kind, ws, xs)  # also the warm-up (a compiled route compiles here)
                    seconds = statistics.median(clock(run) for _ in range(rounds))
                except WrongProduct as error:
                    row["skipped"] = f"wrong: {error}"
                except Exception as error:  # not in this torch or torchao, no C++ compiler, not on this CPU
                    row["skipped"] = f"{type(error).__name__}: {str(error).splitlines()[0][:140]}"
                else:
                    row.update(ms=seconds * 1e3, gbs=nbytes / seconds / 1e9, share=nbytes / seconds / copy)
                rows.append(row)
                print(format_row(row), flush=True)
                run = None
            del ws
    return rows


def format_row(row) -> str:
    if row["kind"] == "copy":
        return f"| copy | | {row['threads']} | | {row['gbs']:.1f} | 100% |"
    if "skipped" in row:
        return f"| {row['kind']} | {row['route']} | {row['threads']} | skipped: {row['skipped']} | | |"
    return (f"| {row['kind']} | {row['route']} | {row['threads']} | {row['ms']:.1f} | {row['gbs']:.1f} | "
            f"{row['share']:.0%} |")


HEADER = "| class | route | threads | ms per pass | GB/s of weights | share of the copy |\n|---|---|---|---|---|---|"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--classes", default=",".join(CLASSES), help="comma-separated, of " + ", ".join(CLASSES))
    parser.add_argument("--rounds", type=int, default=7, help="passes per route (the median is printed)")
    parser.add_argument("--quick", action="store_true", help="small matrices, 2 rounds")
    args = parser.parse_args(argv)
    block, count, head = SHAPES["quick" if args.quick else "glm-4-1.4b"]
    shapes = block * count + [head]
    rounds = 2 if args.quick else args.rounds
    print(f"{time.strftime('%Y-%m-%d')}; {mb.machine_line(argparse.Namespace(device='cpu', clock='wall'))}; "
          f"{len(shapes)} matrices, one row each; medians of {rounds} passes")
    print(HEADER)
    with contextlib.suppress(BrokenPipeError):
        measure(shapes, [int(t) for t in args.threads.split(",")], rounds, [c for c in args.classes.split(",") if c])
    return 0


if __name__ == "__main__":
    sys.exit(main())
