"""Pre-quantized weights: the storage of chatglm2-6b-int4 / codegeex2-6b-int4 and of every checkpoint the original's
`model.quantize(4 or 8)` + `save_pretrained` wrote (`quantization_bit: 4` or `8` in config.json).

A companion file of modeling_chatglm.py, imported only for such a checkpoint. Not named quantization.py: the int4
folders ship the original's own quantization.py (cpm_kernels), which this file does not replace.

Storage, per quantized linear layer (each block's query_key_value, dense, dense_h_to_4h, dense_4h_to_h), as the
original writes it:
  <module>.weight        int8 [out, in] (8 bits), or [out, in / 2] (4 bits: two signed 4-bit values per byte, the
                         even column in the high nibble)
  <module>.weight_scale  float16 [out]: max |w| of the row / 127 (8 bits) or / 7 (4 bits)
  <module>.bias          as the layer's (the query_key_value bias), unquantized

The weights stay quantized in memory. Two ways to multiply by them (`QuantizedLinear.kernel`):
  exact   the original's arithmetic, the default in fp32: the codes are turned into floats a block of rows at a
          time and multiplied, the per-row scale applied to the product in fp32 (the sum regrouped: within 1e-6
          relative of the original's CPU path, which scales the weight first), to the weight in fp16/bf16 (whose
          range the unscaled sums could leave).
  packed  int4 only: torch's weight-only int4 matrix product (tinygemm on CUDA, its CPU twin) on a copy of the codes
          packed for it at load, bf16 activations. For a few rows (decode), where the exact path spends its time
          turning codes into floats; more rows (prefill) take the exact path. The default for a bf16/fp16 model
          where the running torch has the kernel for the device; an opt-in for fp32 (ChatGLMPreTrainedModel.
          use_quantized_kernel), with bf16's rounding of the activations (README: measured deviation).
The packed copy is a plain attribute, not a parameter or buffer: the state dict, save_pretrained and PEFT see the
original's storage only.
"""

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZED_WIDTHS = (4, 8)
KERNELS = ("auto", "exact", "packed")
# Rows of one call up to which the packed kernel runs: a decode step, or a small batch of them. Beyond, tinygemm's
# few-row tiles lose to a dense product of dequantized weights (at 2048 rows on an H100: 27.9 ms against 3.1).
PACKED_MAX_ROWS = 32
# Codes the exact path turns into floats at a time on a CPU: 2 MiB of fp32 stays in a core's cache for its product,
# where a whole layer's would go out to memory and back (one decode row: 2-6x faster on a 2-core EPYC).
EXACT_BLOCK = 2 ** 19


class QuantizedLinear(nn.Linear):
    """nn.Linear whose weight is stored as int8 codes and a per-row scale (see the module docstring). An nn.Linear,
    so that PEFT wraps it with LoRA adapters as it wraps any linear layer; its own weight never trains."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int, device=None,
                 dtype=None):
        nn.Module.__init__(self)  # not nn.Linear's: no float weight of the full size is ever made
        if bits not in QUANTIZED_WIDTHS:
            raise ValueError(f"quantization_bit={bits!r}: pre-quantized checkpoints store 4 or 8 bits.")
        if bits == 4 and in_features % 2:
            raise ValueError(f"quantization_bit=4 packs two columns per byte: in_features={in_features} is odd.")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        codes = in_features * bits // 8
        self.weight = nn.Parameter(torch.zeros(out_features, codes, dtype=torch.int8, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        # The original's files hold float16 scales whatever dtype the model runs in.
        self._register_state_dict_hook(float16_scales)
        self.kernel = "auto"
        self.packed: Optional[Int4Packed] = None  # see use_kernel
        # New codes (load_state_dict) make a packed copy stale: it is packed again. A copy left on another device by
        # a move is not used (runs_packed): the exact path runs there until use_kernel packs it there.
        self.register_load_state_dict_post_hook(pack_again)

    @classmethod
    def from_float(cls, linear: nn.Linear, bits: int) -> "QuantizedLinear":
        """`linear` quantized as the original's `quantize(bits)` stores it: per row, in fp16,
        q = round(w / (max|w| / (2^(bits-1) - 1))); for 4 bits two codes a byte, the even column high."""
        levels = 2 ** (bits - 1) - 1
        weight = linear.weight.detach().half()
        scale = weight.abs().amax(dim=-1) / levels
        codes = torch.round(weight / scale[:, None]).to(torch.int8)
        if bits == 4:
            codes = (codes[:, 0::2] << 4) | (codes[:, 1::2] & 15)
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, bits=bits,
                    device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(codes)
            layer.weight_scale.copy_(scale)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [out, in] the codes stand for, in `dtype`."""
        return torch.stack(self.code_columns(), dim=-1).flatten(-2).to(dtype) * self.weight_scale.to(dtype)[:, None]

    def code_columns(self, codes: Optional[torch.Tensor] = None) -> tuple:
        """The signed codes of `codes` (rows of the weight; all by default) as int8 [rows, in] (8 bits), or as the
        even and the odd columns [rows, in / 2] (4 bits)."""
        codes = self.weight if codes is None else codes
        if self.bits == 8:
            return (codes,)
        # int8 shifts are arithmetic: each nibble comes out sign-extended
        return codes >> 4, (codes << 4) >> 4

    def use_kernel(self, kernel: str, dtype: Optional[torch.dtype] = None) -> bool:
        """Choose the kernel ("auto": packed for a model computing in bf16/fp16 (`dtype`, by default the scales')
        where torch has it, else exact; see the module docstring) and pack the codes for it where it may run.
        Returns whether the packed kernel is ready."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r}: choose one of {KERNELS}.")
        self.kernel, self.packed = kernel, None
        half = (dtype or self.weight_scale.dtype) in (torch.bfloat16, torch.float16)
        wanted = kernel == "packed" or (kernel == "auto" and half)
        if wanted and self.bits == 4 and self.weight.device.type != "meta":
            self.packed = pack_int4(self)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if not self.runs_packed(x):
            return self.exact_forward(x, bias)
        out = self.packed.multiply(x).to(x.dtype)
        return out if bias is None else out + bias

    def runs_packed(self, x: torch.Tensor) -> bool:
        packed = self.packed
        return (packed is not None and packed.weight.device == x.device and x.numel() <= PACKED_MAX_ROWS * x.shape[-1]
                and (self.kernel == "packed" or x.dtype != torch.float32)
                and not (x.requires_grad and torch.is_grad_enabled()))  # torch's int4 kernels have no backward

    def exact_forward(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The original's arithmetic on the codes, without building the [out, in] float weight: each code column set
        multiplies its own input columns (4 bits: even and odd), a block of rows at a time (EXACT_BLOCK), the
        per-row scale applied to the product in fp32 and to the weight in a half type (whose range the unscaled
        sums could leave)."""
        inputs = (x,) if self.bits == 8 else (x[..., 0::2], x[..., 1::2])
        scale = self.weight_scale.to(x.dtype)
        # CPU: blocks that stay in cache; a GPU streams the whole weight (blocks would only add kernel launches)
        rows = max(1, EXACT_BLOCK // self.weight.shape[1]) if x.device.type == "cpu" else self.out_features
        blocks = []
        for codes, block_scale in zip(self.weight.split(rows), scale.split(rows)):
            columns = [c.to(x.dtype) for c in self.code_columns(codes)]
            if x.dtype != torch.float32:
                columns = [c * block_scale[:, None] for c in columns]
            products = [F.linear(part, c) for part, c in zip(inputs, columns)]
            blocks.append(products[0] if len(products) == 1 else products[0] + products[1])
        out = torch.cat(blocks, dim=-1) if len(blocks) > 1 else blocks[0]
        out = out * scale if x.dtype == torch.float32 else out
        return out if bias is None else out + bias

    def reset_parameters(self):  # nn.Linear's would draw float values into the int8 codes
        nn.init.zeros_(self.weight)
        nn.init.ones_(self.weight_scale)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def pack_again(module, incompatible_keys):
    if module.packed is not None:
        module.packed = pack_int4(module)


def float16_scales(module, state_dict, prefix, local_metadata):
    key = prefix + "weight_scale"
    if key in state_dict:
        state_dict[key] = state_dict[key].to(torch.float16)
    return state_dict


def quantized_linear(bits: int):
    """The linear-layer constructor of a model stored with `bits`-bit weights (nn.Linear's signature)."""

    def make(in_features, out_features, bias=True, device=None, dtype=None):
        return QuantizedLinear(in_features, out_features, bias, bits=bits, device=device, dtype=dtype)

    return make


# ---- torch's weight-only int4 kernels ----


class Int4Kernel(NamedTuple):
    """One of torch's int4 kernel pairs (aten operator names: a model holding them still pickles) and the layout of
    codes its packing operator takes."""

    convert_name: str  # (codes in `layout`, inner_k_tiles) -> the packed weight
    matmul_name: str  # (x bf16 [rows, in], packed, group_size, scales_and_zeros bf16 [in / group, out, 2])
    layout: str  # "bytes": uint8 [out, in / 2], q = code + 8, the even column high; "int32": q as int32 [out, in]
    inner_k_tiles: int

    def convert(self, codes: torch.Tensor) -> torch.Tensor:
        return getattr(torch.ops.aten, self.convert_name)(codes, self.inner_k_tiles)

    def matmul(self, *args) -> torch.Tensor:
        return getattr(torch.ops.aten, self.matmul_name)(*args)


class Int4Packed(NamedTuple):
    """A layer's codes packed for an Int4Kernel: w = (q - 8) * scale + 0, the per-row scale repeated per group."""

    kernel: Int4Kernel
    weight: torch.Tensor
    group_size: int
    scales_and_zeros: torch.Tensor

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = self.kernel.matmul(rows, self.weight, self.group_size, self.scales_and_zeros)
        return out.reshape(*x.shape[:-1], out.shape[-1])


GROUP_SIZES = (256, 128, 64, 32)  # what the kernels accept; the per-row scale is the same in every group
_KERNELS = {}  # device type -> Int4Kernel or None, found once per process


def int4_kernel(device: torch.device) -> Optional[Int4Kernel]:
    """The int4 kernel pair that works on `device`'s type with the running torch, found by trying each candidate on a
    small layer and comparing with the exact path (op names and input layouts changed across torch releases: 2.4's
    CUDA packing took int32 codes, later ones uint8; the CPU pair got its own names in 2.6). None: the exact path."""
    if device.type not in _KERNELS:
        _KERNELS[device.type] = next((kernel for kernel in kernel_candidates(device) if kernel_works(kernel, device)),
                                     None)
    return _KERNELS[device.type]


def kernel_candidates(device: torch.device) -> list:
    aten = torch.ops.aten
    pairs = [("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu", 1)] if device.type == "cpu" else []
    pairs.append(("_convert_weight_to_int4pack", "_weight_int4pack_mm", 8))
    return [Int4Kernel(convert, matmul, layout, tiles)
            for convert, matmul, tiles in pairs if hasattr(aten, convert) and hasattr(aten, matmul)
            for layout in ("bytes", "int32")]


def kernel_works(kernel: Int4Kernel, device: torch.device) -> bool:
    probe = torch.nn.utils.skip_init(nn.Linear, 256, 64, device=device)
    with torch.no_grad():
        probe.weight.copy_(probe_values(probe.weight.shape, device))
    return packed_if_agrees(kernel, QuantizedLinear.from_float(probe, 4)) is not None


def probe_values(shape, device) -> torch.Tensor:
    """Random values that leave the caller's random state alone."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)


def agrees(packed: Int4Packed, layer: QuantizedLinear) -> bool:
    """Whether the packed kernel gives the exact path's product (within bf16's rounding) on two random rows."""
    x = probe_values((2, layer.in_features), layer.weight.device)
    expected = layer.exact_forward(x, None)
    return torch.allclose(packed.multiply(x).float(), expected, rtol=0.05, atol=0.05 * expected.abs().max().item())


def pack_int4(layer: QuantizedLinear) -> Optional[Int4Packed]:
    """`layer`'s codes packed for the kernel of its device, or None where there is none or its sizes do not fit
    (checked against the exact path on two rows: a layout mistake would not pass unnoticed)."""
    kernel = int4_kernel(layer.weight.device)
    return None if kernel is None else packed_if_agrees(kernel, layer)


def packed_if_agrees(kernel: Int4Kernel, layer: QuantizedLinear) -> Optional[Int4Packed]:
    """`layer` packed for `kernel` if the kernel takes it and gives the exact path's product, else None."""
    try:
        packed = pack_with(kernel, layer)
    except (RuntimeError, NotImplementedError):  # a kernel not built for this device or layout; sizes it does not
        return None  # take (out not a multiple of 16 on CPU, 8 on CUDA)
    return packed if packed is not None and agrees(packed, layer) else None


def pack_with(kernel: Int4Kernel, layer: QuantizedLinear) -> Optional[Int4Packed]:
    group_size = next((size for size in GROUP_SIZES if layer.in_features % size == 0), None)
    if group_size is None:
        return None
    with torch.no_grad():
        if kernel.layout == "bytes":  # (code & 15) ^ 8 == code + 8 for a 4-bit signed code: both nibbles at once
            codes = layer.weight.view(torch.uint8) ^ 0x88
        else:
            codes = torch.stack(layer.code_columns(), dim=-1).flatten(-2).to(torch.int32) + 8
        weight = kernel.convert(codes.contiguous())
        scale = layer.weight_scale.to(torch.bfloat16)
        groups = layer.in_features // group_size
        scales_and_zeros = torch.stack((scale.expand(groups, -1), torch.zeros_like(scale).expand(groups, -1)), dim=-1)
    return Int4Packed(kernel, weight, group_size, scales_and_zeros.contiguous())


def use_kernel(model: nn.Module, kernel: str, dtype: torch.dtype) -> int:
    """`QuantizedLinear.use_kernel` on each of `model`'s quantized layers (`dtype`: the model's compute dtype);
    returns how many run packed."""
    return sum(module.use_kernel(kernel, dtype) for module in model.modules() if isinstance(module, QuantizedLinear))
