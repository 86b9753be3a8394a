"""Pre-quantized weights: the storage of chatglm2-6b-int4 / codegeex2-6b-int4 and of every checkpoint the original's
`model.quantize(4 or 8)` + `save_pretrained` wrote (`quantization_bit: 4` or `8` in config.json).

A companion file of modeling_chatglm.py, imported only for such a checkpoint and for quantizing a float model:
quantize(bits) (through torchao or optimum-quanto, or in the original's storage with storage="original"),
quantize_output_layer(bits), and use_cpu_packed_weights() (oneDNN's blocked layout for 16-bit weights on a CPU; see the
end of this file). Not named
quantization.py: the int4 folders ship the original's own quantization.py (cpm_kernels), which this file does not
replace.

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
  packed  torch's weight-only matrix products, bf16 activations: 4 bits, the int4 one (tinygemm on CUDA, its CPU
          twin) on the codes packed for it at load; 8 bits, `_weight_int8pack_mm` (x @ codes.T * scale, the
          original's per-row scale) on the codes as they are stored, no copy. For a few rows (decode), where the
          exact path spends its time turning codes into floats; more rows (prefill) take the exact path. The
          default for a bf16/fp16 model where the running torch has the kernel for the device; an opt-in for fp32
          (ChatGLMPreTrainedModel.use_quantized_kernel), with bf16's rounding of the activations (docs/quantized-checkpoints.md: measured
          deviation).
Where the kernel's layout can be read back exactly (learned once per device type by packing a probe, then checked on
each layer), the packed bytes replace the codes in `weight`'s storage: the model holds one copy, about a quarter of
fp16's bytes for these layers. The codes are rebuilt from them where something reads them: the exact path (prompts,
the grad path; on a GPU one compiled kernel dequantizes the whole weight), the state dict (so save_pretrained and PEFT
see the original's storage), pickling, a move to another device (whose kernel packs them again). Elsewhere the packed
copy is a plain attribute beside the codes.
"""

import warnings
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
# Devices where a prompt on the packed storage dequantizes the whole weight in one compiled kernel (fused_dequantize):
# on a GPU the block path's passes over the unpacked codes cost more than the product. A CPU runs the block path.
FUSED_DEVICES = ("cuda",)
HALF_TYPES = (torch.bfloat16, torch.float16)  # where "auto" packs
# The activations of torch's int8 kernel: on a CPU its bf16 path is 5x faster than its fp32 one and 10x than its fp16
# one (the benchmark's 1.4B model, one thread), and bf16 is what the int4 kernel takes.
INT8_ACTIVATIONS = torch.bfloat16


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
        # The state dict holds the original's storage: the codes (rebuilt where the packed bytes replaced them) and
        # float16 scales, whatever dtype the model runs in.
        self._register_state_dict_hook(original_storage)
        self.kernel = "auto"
        self.packed: Optional[Int4Packed] = None  # see use_kernel

    @classmethod
    def from_float(cls, linear: nn.Linear, bits: int) -> "QuantizedLinear":
        """`linear` quantized as the original's `quantize(bits)` stores it: per row, in fp16,
        q = round(w / (max|w| / (2^(bits-1) - 1))); for 4 bits two codes a byte, the even column high. Converted a
        block of rows at a time: a 151552-row output layer never has a second float copy."""
        levels = 2 ** (bits - 1) - 1
        rows = max(1, EXACT_BLOCK // linear.in_features)
        codes, scale = [], []
        for start in range(0, linear.out_features, rows):
            weight = linear.weight.detach()[start:start + rows].half()
            scale.append(weight.abs().amax(dim=-1) / levels)
            codes.append(torch.round(weight / scale[-1][:, None]).to(torch.int8))
            if bits == 4:
                codes[-1] = (codes[-1][:, 0::2] << 4) | (codes[-1][:, 1::2] & 15)
        codes, scale = torch.cat(codes), torch.cat(scale)
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

    # ---- the codes, wherever they are held ----

    def packed_storage(self) -> Optional["Int4Packed"]:
        """The packed copy when its bytes are `weight`'s storage (the codes are then not held), else None. A weight
        moved or replaced behind the layer's back (accelerate's set_module_tensor_to_device) is told apart by its
        first bytes: the packed ones moved, or codes put there."""
        packed = self.packed
        if packed is None or packed.layout is None:
            return None
        if self.weight.data_ptr() == packed.weight.data_ptr():
            return packed
        moved = self.weight.device.type != "meta" and torch.equal(leading_bytes(self.weight), packed.leading)
        return packed if moved else None

    def codes(self) -> torch.Tensor:
        """The original's codes, read back from the packed bytes where those replaced them."""
        packed = self.packed_storage()
        return self.weight if packed is None else packed.layout.unpack(self.weight, self.out_features, self.in_features)

    def block_columns(self, start: int, stop: int, packed: Optional["Int4Packed"]) -> tuple:
        """code_columns of rows [start, stop), read from the packed bytes `packed` where they are the storage."""
        if packed is None:
            return self.code_columns(self.weight[start:stop])
        q = packed.layout.values(self.weight, self.out_features, self.in_features, start, stop)
        signed = q.view(torch.int8) - 8
        return signed[:, 0::2], signed[:, 1::2]

    def code_columns(self, codes: Optional[torch.Tensor] = None) -> tuple:
        """The signed codes of `codes` (rows of the weight; all by default) as int8 [rows, in] (8 bits), or as the
        even and the odd columns [rows, in / 2] (4 bits)."""
        codes = self.codes() if codes is None else codes
        if self.bits == 8:
            return (codes,)
        # int8 shifts are arithmetic: each nibble comes out sign-extended
        return codes >> 4, (codes << 4) >> 4

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [out, in] the codes stand for, in `dtype`."""
        return torch.stack(self.code_columns(), dim=-1).flatten(-2).to(dtype) * self.weight_scale.to(dtype)[:, None]

    # ---- the kernel ----

    def use_kernel(self, kernel: str, dtype: Optional[torch.dtype] = None) -> bool:
        """Choose the kernel ("auto": packed for a model computing in bf16/fp16 (`dtype`, by default the scales')
        where torch has it, else exact; see the module docstring) and pack the codes for it where it may run.
        Returns whether the packed kernel is ready."""
        if kernel not in KERNELS:
            raise ValueError(f"kernel={kernel!r}: choose one of {KERNELS}.")
        self.release_packed()
        self.kernel = kernel
        half = (dtype or self.weight_scale.dtype) in HALF_TYPES
        wanted = kernel == "packed" or (kernel == "auto" and half)
        if wanted and self.weight.device.type != "meta":
            self.packed = pack_int4(self) if self.bits == 4 else pack_int8(self)
            if self.packed is not None and self.packed.layout is not None:  # the packed bytes become the storage
                self.weight.data = self.packed.weight.view(-1).view(torch.int8).view(self.weight.shape)
        return self.packed is not None

    def release_packed(self):
        """Drop the packed copy, the codes back in `weight` where its bytes were the storage."""
        with torch.no_grad():
            if self.packed_storage() is not None:
                self.weight.data = self.codes()
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if not self.runs_packed(x):
            return self.exact_forward(x, bias)
        out = self.packed.multiply(x, self.weight).to(x.dtype)
        return out if bias is None else out + bias

    def runs_packed(self, x: torch.Tensor) -> bool:
        packed = self.packed
        return (packed is not None and packed.device == x.device and x.numel() <= PACKED_MAX_ROWS * x.shape[-1]
                and (self.kernel == "packed" or x.dtype != torch.float32)
                and not (x.requires_grad and torch.is_grad_enabled()))  # torch's int4/int8 kernels have no backward

    def exact_forward(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The original's arithmetic on the codes, without building the [out, in] float weight: each code column set
        multiplies its own input columns (4 bits: even and odd), a block of rows at a time (EXACT_BLOCK), the
        per-row scale applied to the product in fp32 and to the weight in a half type (whose range the unscaled
        sums could leave)."""
        scale = self.weight_scale.to(x.dtype)
        packed = self.packed_storage()
        if packed is not None and x.device.type in FUSED_DEVICES:
            weight = fused_dequantize(packed.layout, self.weight, scale, self.out_features, self.in_features, x.dtype)
            if weight is not None:  # the whole weight from the packed bytes in one compiled kernel, one product
                out = F.linear(x, weight) * scale if x.dtype == torch.float32 else F.linear(x, weight)
                return out if bias is None else out + bias
        inputs = (x,) if self.bits == 8 else (x[..., 0::2], x[..., 1::2])
        # CPU: blocks that stay in cache; a GPU streams the whole weight (blocks would only add kernel launches)
        rows = max(1, EXACT_BLOCK // self.weight.shape[1]) if x.device.type == "cpu" else self.out_features
        blocks = []
        for start in range(0, self.out_features, rows):
            block_scale = scale[start:start + rows]
            columns = [c.to(x.dtype) for c in self.block_columns(start, start + rows, packed)]
            if x.dtype != torch.float32:
                columns = [c * block_scale[:, None] for c in columns]
            products = [F.linear(part, c) for part, c in zip(inputs, columns)]
            blocks.append(products[0] if len(products) == 1 else products[0] + products[1])
        out = torch.cat(blocks, dim=-1) if len(blocks) > 1 else blocks[0]
        out = out * scale if x.dtype == torch.float32 else out
        return out if bias is None else out + bias

    # ---- nn.Module's storage operations, kept consistent with the packed bytes ----

    def _apply(self, fn, recurse=True):
        """A move (or a dtype change that switches "auto") packs again for where the layer is now: a packed layout
        is its device's kernel's, and the codes are read back from the bytes moved."""
        stored, before = self.packed_storage(), self.storage_state()
        super()._apply(fn, recurse)
        if self.storage_state() == before:
            return self
        with torch.no_grad():
            if stored is not None:
                self.weight.data = stored.layout.unpack(self.weight, self.out_features, self.in_features)
            self.packed = None
            self.use_kernel(self.kernel)
        return self

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """New codes replace the packed copy, which is made again from them."""
        packed = self.packed is not None and prefix + "weight" in state_dict
        if packed:
            self.release_packed()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if packed:
            self.use_kernel(self.kernel)

    def __getstate__(self):
        """Pickled (torch.save, deepcopy) with the codes, not the packed bytes, whose layout is this machine's
        kernel's (a CPU's depends on its vector width): unpickling packs them again."""
        state = dict(self.__dict__)
        if self.packed_storage() is not None:
            parameters = state["_parameters"] = dict(state["_parameters"])
            parameters["weight"] = nn.Parameter(self.codes(), requires_grad=False)
            state["packed"], state["_pack_again"] = None, True
        return state

    def __setstate__(self, state):
        pack_again = state.pop("_pack_again", False)
        super().__setstate__(state)
        if pack_again:
            self.use_kernel(self.kernel)

    def storage_state(self) -> tuple:
        """What a move or a dtype change alters that the packing depends on."""
        return self.weight.device, self.weight.data_ptr(), self.weight_scale.dtype in HALF_TYPES

    def reset_parameters(self):  # nn.Linear's would draw float values into the int8 codes
        self.release_packed()
        nn.init.zeros_(self.weight)
        nn.init.ones_(self.weight_scale)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def original_storage(module, state_dict, prefix, local_metadata):
    key = prefix + "weight"
    if key in state_dict and module.packed_storage() is not None:
        state_dict[key] = module.codes()
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

    def convert(self, q: torch.Tensor) -> torch.Tensor:
        """The packed weight of q = code + 8 (uint8 [out, in], 0..15)."""
        return self.convert_packed_input(nibble_pairs(q) if self.layout == "bytes" else q.to(torch.int32))

    def convert_packed_input(self, codes: torch.Tensor) -> torch.Tensor:
        return getattr(torch.ops.aten, self.convert_name)(codes.contiguous(), self.inner_k_tiles)

    def matmul(self, *args) -> torch.Tensor:
        return getattr(torch.ops.aten, self.matmul_name)(*args)


class Int4Layout(NamedTuple):
    """Where a kernel's packing puts each 4-bit value, learned by packing a probe (learn_layout): the packed bytes are
    tiles of `rows` x `cols` values, in row-major order over the weight, each tile's values in the same order:
    `order[r * cols + c]` is the nibble (low nibble first) of the tile holding its value (r, c)."""

    rows: int
    cols: int
    order: torch.Tensor

    def unpack(self, packed: torch.Tensor, out: int, inputs: int, start: int = 0, stop: Optional[int] = None):
        """The original's codes (int8 [stop - start, inputs / 2]) of rows [start, stop) of `packed`."""
        q = self.values(packed, out, inputs, start, stop)
        return (nibble_pairs(q) ^ 0x88).view(torch.int8)

    def values(self, packed: torch.Tensor, out: int, inputs: int, start: int = 0, stop: Optional[int] = None):
        """q = code + 8 (uint8 [stop - start, inputs]) of rows [start, stop) of `packed`: the tile rows holding them
        turned into nibbles, each tile's moved to the end so that gathering its values in order copies whole rows."""
        stop = out if stop is None else min(stop, out)
        first, last = start // self.rows, -(-stop // self.rows)
        tile_row_bytes = self.rows * inputs // 2
        data = packed.reshape(-1).view(torch.uint8)[first * tile_row_bytes:last * tile_row_bytes]
        tiles = nibbles(data).view(last - first, inputs // self.cols, self.rows * self.cols).transpose(1, 2)
        ordered = tiles.contiguous().index_select(1, self.order.to(data.device))
        q = ordered.view(last - first, self.rows, self.cols, -1).permute(0, 1, 3, 2).reshape(-1, inputs)
        return q[start - first * self.rows:stop - first * self.rows]

    def fits(self, out: int, inputs: int) -> bool:
        return out % self.rows == 0 and inputs % self.cols == 0


def dequantize_tiles(data: torch.Tensor, order: torch.Tensor, scale: torch.Tensor, rows: int, cols: int, out: int,
                     inputs: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, inputs] in `dtype` of packed bytes `data` in an Int4Layout, each value found by its tile and
    nibble. Written for torch.compile, which makes it one kernel (compiled_dequantize); eager, it builds [out, inputs]
    index tensors. In fp32 the scale is left to the product, as the exact path does."""
    row = torch.arange(out, device=data.device)[:, None]
    col = torch.arange(inputs, device=data.device)[None, :]
    slot = (row // rows * (inputs // cols) + col // cols) * (rows * cols) + order[row % rows * cols + col % cols]
    q = (data[slot // 2] >> slot % 2 * 4) & 15
    weight = q.to(dtype) - 8
    return weight if dtype == torch.float32 else weight * scale[:, None]


class NotCompiled(RuntimeError):
    """compiled_dequantize ran eagerly: torch.compile gave up on it (its limit of recompilations, say)."""


def compiled_dequantize(*args) -> torch.Tensor:
    if not torch.compiler.is_compiling():  # eager, dequantize_tiles would take several times the weight's memory
        raise NotCompiled
    return dequantize_tiles(*args)


_FUSED = {}  # "dequantize": compiled_dequantize compiled, or None where compiling failed once


def fused_dequantize(layout, weight, scale, out, inputs, dtype) -> Optional[torch.Tensor]:
    """dequantize_tiles in one compiled kernel (a GPU's prompt: the block path's passes over the unpacked codes would
    cost more than the product), or None where torch.compile cannot make it (no Triton, say: a warning, once) or
    gives up on a shape: the block path then runs. One kernel per layer shape and dtype: sizes known when compiling
    make the index arithmetic about twice as fast as symbolic ones."""
    if "dequantize" not in _FUSED:
        _FUSED["dequantize"] = torch.compile(compiled_dequantize, dynamic=False)
    compiled = _FUSED["dequantize"]
    if compiled is None:
        return None
    data = weight.reshape(-1).view(torch.uint8)
    try:
        # (a plain tensor, not the scale Parameter itself, which torch.compile would guard as a parameter)
        return compiled(data, layout.order.to(data.device), scale.detach(), layout.rows, layout.cols, out, inputs,
                        dtype)
    except NotCompiled:
        return None
    except Exception as error:  # torch.compile's failures (a missing compiler, an unsupported GPU) have many types
        _FUSED["dequantize"] = None
        warnings.warn(f"int4 prompts take the slower exact path: torch.compile failed ({type(error).__name__}: "
                      f"{str(error)[:200]})")
        return None


class Int4Packed(NamedTuple):
    """A layer's codes packed for an Int4Kernel: w = (q - 8) * scale + 0, the per-row scale repeated per group.
    `layout`: how to read the codes back (None: not known, the codes are kept beside); `leading`: the first bytes."""

    kernel: Int4Kernel
    weight: torch.Tensor
    group_size: int
    scales_and_zeros: torch.Tensor
    layout: Optional[Int4Layout]
    leading: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def multiply(self, x: torch.Tensor, codes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x @ w.T (`codes`: unused, the product reads the packed copy)."""
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = self.kernel.matmul(rows, self.weight, self.group_size, self.scales_and_zeros)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def code_values(codes: torch.Tensor) -> torch.Tensor:
    """q = code + 8 (uint8 [rows, in], 0..15) of the original's 4-bit storage (int8 [rows, in / 2])."""
    return torch.stack(((codes >> 4) + 8, ((codes << 4) >> 4) + 8), dim=-1).flatten(-2).to(torch.uint8)


def nibble_pairs(q: torch.Tensor) -> torch.Tensor:
    """Each two columns of `q` in one byte, the even one high (q ^ 0x88 of it: the original's codes)."""
    return (q[:, 0::2] << 4) | q[:, 1::2]


def nibbles(data: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of uint8 `data`, each byte's low one first."""
    return torch.stack((data & 15, data >> 4), dim=-1).view(-1)


def leading_bytes(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(-1).view(torch.uint8)[:64].cpu()


GROUP_SIZES = (256, 128, 64, 32)  # what the kernels accept; the per-row scale is the same in every group
_KERNELS = {}  # device type -> Int4Kernel or None, found once per process
_LAYOUTS = {}  # (Int4Kernel, device type) -> Int4Layout or None


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
    return packed_if_agrees(kernel, QuantizedLinear.from_float(probe, 4), layout=None) is not None


def int4_layout(kernel: Int4Kernel, device: torch.device) -> Optional[Int4Layout]:
    if (kernel, device.type) not in _LAYOUTS:
        _LAYOUTS[kernel, device.type] = learn_layout(kernel, device)
    return _LAYOUTS[kernel, device.type]


def learn_layout(kernel: Int4Kernel, device: torch.device, out: int = 128, inputs: int = 256) -> Optional[Int4Layout]:
    """Where `kernel`'s packing puts each value, from packing a probe whose values spell their own position (a base-16
    digit at a time); the smallest tiling that explains it. None where packing is not a rearrangement of the values
    in tiles (the codes are then kept beside the packed copy)."""
    position = torch.arange(out * inputs, device=device)
    source = torch.zeros_like(position)
    digit = 0
    while 16 ** digit < out * inputs:
        q = ((position >> 4 * digit) & 15).to(torch.uint8).view(out, inputs)
        source |= nibbles(kernel.convert(q).reshape(-1).view(torch.uint8)).long() << 4 * digit
        digit += 1
    if not torch.equal(source.sort().values, position):
        return None
    row, col = source // inputs, source % inputs
    tilings = sorted(((rows, cols) for rows in range(1, out + 1) if out % rows == 0
                      for cols in range(1, inputs + 1) if inputs % cols == 0 and rows * cols < out * inputs),
                     key=lambda tiling: tiling[0] * tiling[1])
    for rows, cols in tilings:
        size = rows * cols
        if not torch.equal(position // size, row // rows * (inputs // cols) + col // cols):
            continue  # the tiles are not stored in row-major order
        within = (row % rows * cols + col % cols).view(-1, size)
        if torch.equal(within, within[:1].expand_as(within)):  # every tile in the same order
            order = torch.empty(size, dtype=torch.long, device=device)
            order[within[0]] = torch.arange(size, device=device)
            layout = Int4Layout(rows, cols, order)
            # a packing that also changed the values (q ^ 1, say) would spell positions too: random codes tell
            codes = torch.randint(-128, 128, (out, inputs // 2), dtype=torch.int8,
                                  generator=torch.Generator().manual_seed(0)).to(device)
            unpacked = layout.unpack(kernel.convert(code_values(codes)), out, inputs)
            return layout if torch.equal(unpacked, codes) else None
    return None


def probe_values(shape, device) -> torch.Tensor:
    """Random values that leave the caller's random state alone."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)


def agrees(packed, layer: QuantizedLinear) -> bool:
    """Whether a packed kernel (Int4Packed, Int8Packed) gives the exact path's product (within bf16's rounding) on two
    random rows."""
    x = probe_values((2, layer.in_features), layer.weight.device)
    expected = layer.exact_forward(x, None)
    got = packed.multiply(x, layer.weight).float()
    return torch.allclose(got, expected, rtol=0.05, atol=0.05 * expected.abs().max().item())


def pack_int4(layer: QuantizedLinear) -> Optional[Int4Packed]:
    """`layer`'s codes packed for the kernel of its device, or None where there is none or its sizes do not fit
    (checked against the exact path on two rows: a layout mistake would not pass unnoticed). The packed copy knows
    its layout where the layer's codes read back from it exactly."""
    kernel = int4_kernel(layer.weight.device)
    if kernel is None:
        return None
    layout = int4_layout(kernel, layer.weight.device)
    layout = layout if layout is not None and layout.fits(layer.out_features, layer.in_features) else None
    return packed_if_agrees(kernel, layer, layout)


def packed_if_agrees(kernel: Int4Kernel, layer: QuantizedLinear, layout: Optional[Int4Layout]):
    """`layer` packed for `kernel` if the kernel takes it and gives the exact path's product, else None; its layout
    kept where the first and the last rows' codes read back from the packed bytes."""
    try:
        packed = pack_with(kernel, layer)
    except (RuntimeError, NotImplementedError):  # a kernel not built for this device or layout; sizes it does not
        return None  # take (out not a multiple of 16 on CPU, 8 on CUDA)
    if packed is None or not agrees(packed, layer):
        return None
    if layout is not None:
        ends = [(0, layout.rows), (layer.out_features - layout.rows, layer.out_features)]
        if not all(torch.equal(layout.unpack(packed.weight, layer.out_features, layer.in_features, start, stop),
                               layer.weight[start:stop]) for start, stop in ends):
            layout = None
    return packed._replace(layout=layout)


def pack_with(kernel: Int4Kernel, layer: QuantizedLinear) -> Optional[Int4Packed]:
    group_size = next((size for size in GROUP_SIZES if layer.in_features % size == 0), None)
    if group_size is None:
        return None
    with torch.no_grad():
        if kernel.layout == "bytes":  # (code & 15) ^ 8 == code + 8 for a 4-bit signed code: both nibbles at once
            weight = kernel.convert_packed_input(layer.weight.view(torch.uint8) ^ 0x88)
        else:
            weight = kernel.convert(code_values(layer.weight))
        scale = layer.weight_scale.to(torch.bfloat16)
        groups = layer.in_features // group_size
        scales_and_zeros = torch.stack((scale.expand(groups, -1), torch.zeros_like(scale).expand(groups, -1)), dim=-1)
    return Int4Packed(kernel, weight, group_size, scales_and_zeros.contiguous(), None, leading_bytes(weight))


# ---- torch's weight-only int8 kernel ----


class Int8Packed(NamedTuple):
    """What torch's int8 kernel needs beside a layer's codes, which it takes as they are stored (int8 [out, in]):
    the per-row scale in the kernel's activation dtype. Nothing replaces the codes (`layout` None)."""

    scale: torch.Tensor
    layout = None

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def multiply(self, x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """x @ (codes * scale).T, accumulated by the kernel from bf16 activations."""
        rows = x.reshape(-1, x.shape[-1]).to(INT8_ACTIVATIONS)
        out = torch.ops.aten._weight_int8pack_mm(rows, codes, self.scale)
        return out.reshape(*x.shape[:-1], out.shape[-1])


_INT8_WORKS = {}  # device type -> whether torch's int8 kernel gives the exact path's product there


def pack_int8(layer: QuantizedLinear) -> Optional[Int8Packed]:
    """The int8 kernel's scale for `layer`, or None where the running torch has no working kernel for its device
    (found once per device type by trying it on a probe layer against the exact path: the operator arrived for CPUs
    in torch 2.3, other devices got it later or not at all)."""
    device = layer.weight.device
    if device.type not in _INT8_WORKS:
        _INT8_WORKS[device.type] = int8_kernel_works(device)
    if not _INT8_WORKS[device.type]:
        return None
    return Int8Packed(layer.weight_scale.detach().to(INT8_ACTIVATIONS))


def int8_kernel_works(device: torch.device) -> bool:
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    probe = torch.nn.utils.skip_init(nn.Linear, 256, 64, device=device)
    with torch.no_grad():
        probe.weight.copy_(probe_values(probe.weight.shape, device))
    layer = QuantizedLinear.from_float(probe, 8)
    try:
        return agrees(Int8Packed(layer.weight_scale.detach().to(INT8_ACTIVATIONS)), layer)
    except (RuntimeError, NotImplementedError):  # not built for this device or dtype
        return False


# ---- quantizing a float model: the blocks (quantize(bits)), the output layer (opt-in) ----

QUANTIZE_STORAGES = ("library", "original")


def quantize(transformer: nn.Module, bits: int, storage: str = "library"):
    """The original's quantize(bits) of the base model (ChatGLMModel): the blocks' linear layers, weight-only, through a
    maintained library (torchao, else optimum-quanto) or in the original's own storage ("original"); 0 leaves the
    model as it is."""
    if storage not in QUANTIZE_STORAGES:
        raise ValueError(f"quantize(storage={storage!r}): choose 'library' (torchao or optimum-quanto) or 'original' "
                         "(the original's int8 codes and per-row scales, run by torch's int8/int4 kernels).")
    if bits == 0:
        return
    if getattr(transformer.config, "quantization_bit", 0):
        raise ValueError(
            f"quantize({bits}): this model is already quantized (quantization_bit="
            f"{transformer.config.quantization_bit} in config.json: it was loaded from a pre-quantized checkpoint such "
            "as chatglm2-6b-int4, whose layers are quantized as stored). Call quantize() only on a model with float "
            "weights."
        )
    if bits not in QUANTIZED_WIDTHS:
        raise ValueError(f"quantize(bits={bits!r}): the supported widths are 4 and 8 (0 leaves the model as it is).")
    if storage == "original":
        quantize_as_stored(transformer, bits)
    else:
        quantize_with_library(transformer.encoder, bits)


def quantize_with_library(module: nn.Module, bits: int):
    """Weight-only `bits`-bit quantization of the nn.Linear layers in `module`: torchao first (int8 on CPU and
    CUDA; int4 where torchao has a kernel for the device, e.g. CUDA in bf16), then optimum-quanto."""
    def plain_linears():
        return [m for m in module.modules() if type(m) is nn.Linear and type(m.weight) in (nn.Parameter, torch.Tensor)]

    errors, before = [], len(plain_linears())
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        quantize_(module, Int8WeightOnlyConfig() if bits == 8 else Int4WeightOnlyConfig(group_size=128))
        if len(plain_linears()) < before:
            return
        errors.append("torchao: quantized no layer (sizes not a multiple of its group size)")
    except Exception as error:  # not installed, or no kernel for this width and device: try the next library
        errors.append(f"torchao: {type(error).__name__}: {error}")
    try:
        from optimum.quanto import freeze, qint4, qint8, quantize as quanto_quantize

        quanto_quantize(module, weights=qint8 if bits == 8 else qint4)
        freeze(module)
        return
    except Exception as error:
        errors.append(f"optimum-quanto: {type(error).__name__}: {error}")
    raise ImportError(
        f"quantize({bits}) needs torchao (`pip install torchao`) or optimum-quanto (`pip install optimum-quanto`), "
        "and neither could quantize here (" + "; ".join(errors) + "). Or quantize while loading: "
        "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True)) on CUDA, "
        "TorchAoConfig(...) or QuantoConfig(weights='int8')."
    )


QUANTIZED_LAYERS = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")  # what the original quantizes


def quantize_as_stored(transformer: nn.Module, bits: int):
    """The original's quantize(bits) on a float model (ChatGLMModel): each block's linear layers become
    QuantizedLinear.from_float, one at a time (the float weight freed as it goes), on the kernel "auto" chooses;
    config.quantization_bit is set as the original sets it, so that save_pretrained writes a checkpoint that loads
    pre-quantized, here and in the original."""
    encoder = transformer.encoder
    for name, module in list(encoder.named_modules()):
        parent, _, child = name.rpartition(".")
        if child in QUANTIZED_LAYERS and type(module) is nn.Linear:
            layer = QuantizedLinear.from_float(module, bits)
            layer.use_kernel("auto", module.weight.dtype)
            setattr(encoder.get_submodule(parent), child, layer)  # (Module.set_submodule arrived in torch 2.5)
    transformer.config.quantization_bit = bits


class QuantizedHead(QuantizedLinear):
    """The output layer quantized on request (quantize_output_layer). Checkpoints keep it in floats, so its state
    dict holds the float weight its codes stand for under the original's key (no weight_scale)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._register_state_dict_hook(float_storage)


def float_storage(module, state_dict, prefix, local_metadata):
    state_dict.pop(prefix + "weight_scale", None)
    if prefix + "weight" in state_dict:
        state_dict[prefix + "weight"] = module.dequantized_weight(module.weight_scale.dtype)
    return state_dict


def quantize_output_layer(transformer: nn.Module, bits: int) -> QuantizedHead:
    """ChatGLMForConditionalGeneration.quantize_output_layer, an opt-in: `transformer.output_layer` (the logits,
    151552 x 4096 for GLM-4) replaced by its `bits`-bit codes (the original's per-row arithmetic), on torch's packed
    kernel where it has one for the device (any compute dtype: bf16 activations), else the exact path. For checkpoints
    that keep it in 16 bits (chatglm2-6b-int4 keeps it in fp16), where it is most of the bytes a decode step reads. It
    moves the logits (docs/speed-and-memory.md: measured deviation); save_pretrained writes it as float weights again,
    the values of the codes. Refused where the output layer is tied to the input embedding
    (quantizing it would untie them) or is quantized already."""
    head = transformer.output_layer
    if bits not in QUANTIZED_WIDTHS:
        raise ValueError(f"quantize_output_layer(bits={bits!r}): choose 8 or 4.")
    if isinstance(head, QuantizedLinear) or type(head) is not nn.Linear:
        raise ValueError(f"quantize_output_layer({bits}): the output layer is a {type(head).__name__} already; it "
                         "quantizes a float nn.Linear output layer once.")
    if head.weight is transformer.embedding.word_embeddings.weight:
        raise ValueError(f"quantize_output_layer({bits}): this model's output layer shares its weight with the input "
                         "embedding (tie_word_embeddings): quantizing it would untie them.")
    layer = QuantizedHead.from_float(head, bits)
    if not layer.use_kernel("packed"):
        layer.use_kernel("auto", head.weight.dtype)
    transformer.output_layer = layer
    return layer


def use_model_kernel(model: nn.Module, kernel: str = "packed") -> int:
    """model.use_quantized_kernel(kernel): "packed", torch's int4 or int8 weight-only kernel on bf16 activations for
    decode (the default in bf16/fp16 models, where torch has it for the device; an opt-in in fp32,
    docs/quantized-checkpoints.md: its deviation), "exact" (the original's arithmetic), "auto" (what from_pretrained
    chose). A move to another device keeps the choice (the layers pack again there). Returns how many layers run
    packed."""
    bits = getattr(model.config, "quantization_bit", 0)
    if not bits:
        raise ValueError(
            f"use_quantized_kernel({kernel!r}): this model's weights are not pre-quantized (quantization_bit={bits}); "
            "it applies to checkpoints such as chatglm2-6b-int4.")
    packed = use_kernel(model, kernel, model.dtype)
    if kernel == "packed" and not packed:
        raise ValueError(
            f"use_quantized_kernel('packed'): torch {torch.__version__} has no int{bits} kernel for "
            f"{model.device.type} that takes this model's quantized layers: use 'exact', or a newer torch.")
    return packed


def use_kernel(model: nn.Module, kernel: str, dtype: torch.dtype) -> int:
    """`QuantizedLinear.use_kernel` on each of `model`'s quantized layers (`dtype`: the model's compute dtype);
    returns how many run packed."""
    return sum(module.use_kernel(kernel, dtype) for module in model.modules() if isinstance(module, QuantizedLinear))


# ---- float weights on a CPU's decode (use_cpu_packed_weights): oneDNN's blocked layout for 16 bits, one fp32 row
# over every thread ----


class OneDnnLinear(nn.Linear):
    """An nn.Linear (the class of each chosen layer swapped in place: same parameters, same state dict) with faster
    paths for a CPU's decode (calls of a few rows, without autograd):
      bf16/fp16  its weight also reordered into oneDNN's blocked layout, made at the first call that can use it and
                 again after the weight changes (a move, a load, an optimizer step): torch's eager 16-bit
                 matrix-vector product reads a row-major weight at a fraction of the memory bandwidth that the
                 blocked one reaches. A single bf16 row takes torch's matrix-vector kernel instead (matrix_vector),
                 about as fast, with no copy made. Where this torch has no oneDNN linear for the CPU, F.linear.
      fp32       a single row: torch's matrix-vector kernel over blocks of output rows, one per thread
                 (split_matrix_vector), no copy: on some CPUs torch's fp32 one-row product runs on one thread.
    The copy is not pickled (deepcopy, torch.save)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch.compile: the plain product, which its CPU freezing packs on its own (it cannot trace the reorder, and
        # a step on its generated matrix-vector code was 1.6x slower than a frozen one on the benchmark's model)
        if not self.takes_packed(x) or torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        if x.numel() == x.shape[-1] and x.dtype != torch.float16:
            return self.matrix_vector(x)
        if x.dtype == torch.float32 or not onednn_works():
            return F.linear(x, self.weight, self.bias)
        weight = self.weight
        packed = self.__dict__.get("onednn")
        if packed is None or packed[1:] != (weight.data_ptr(), weight._version):
            self.onednn = None  # the stale copy goes before the new one is made
            with torch.no_grad():
                self.onednn = (torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1), weight.data_ptr(),
                               weight._version)
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn[0], self.bias, "none", [], "")

    def matrix_vector(self, x: torch.Tensor) -> torch.Tensor:
        """One bf16 or fp32 row (single-sequence decode): torch's matrix-vector kernel on the row-major weight. In
        bf16 it reads the weight as fast as oneDNN's blocked copy does with torch 2.13 (1.1x slower with 2.4) and
        needs no copy; it accumulates in fp32 as F.linear does, in its own order (docs/speed-and-memory.md:
        cpu_matvec_kernels.py). Its fp16 kernel is 2-4x slower than the copy's: fp16 rows take the copy. fp32 rows
        are split over the threads (split_matrix_vector)."""
        row = x.reshape(-1)
        if x.dtype == torch.float32:
            out = split_matrix_vector(self.weight, row, self.bias)
        else:
            out = torch.mv(self.weight, row) if self.bias is None else torch.addmv(self.bias, self.weight, row)
        return out.reshape(*x.shape[:-1], -1)

    def takes_packed(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype == self.weight.dtype and x.dtype in PACKED_CPU_TYPES
                and x.numel() <= PACKED_MAX_ROWS * x.shape[-1]
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                and not torch.is_autocast_enabled("cpu"))  # autocast computes F.linear in its own dtype

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("onednn", None)
        return state


PACKED_CPU_TYPES = (torch.float32, *HALF_TYPES)
# Weight bytes per thread below which split_matrix_vector runs the whole product in the calling thread: handing a
# block to another thread costs tens of microseconds, the time a core takes to read about 1 MiB of weights.
SPLIT_MIN_BYTES = 2 ** 21
# Row blocks start at multiples of this many rows: each row then lies at the alignment it has in the whole weight,
# and torch's kernel gives it the same sum (bit for bit, on the CPUs measured) as for the whole weight.
SPLIT_ALIGN = 64
_SPLIT_POOL = {}  # (process id, workers) -> the thread pool of split_matrix_vector


def split_matrix_vector(weight: torch.Tensor, row: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """weight @ row (+ bias) with the output rows shared out over the threads (split_rows). torch's fp32
    matrix-vector kernel (MKL's sgemv) ran on one thread on an AVX2 AMD EPYC: the same time at 1 and 2 threads, where
    two blocks at once read the weights at 2 threads' bandwidth (docs/speed-and-memory.md)."""
    out = torch.empty(weight.shape[0], dtype=row.dtype, device=row.device)
    # The other threads do not share the caller's grad and inference modes (each thread has its own): the tensors
    # detached, the caller's inference mode taken along (an inference tensor takes writes only inside it).
    weight, row, bias = weight.detach(), row.detach(), None if bias is None else bias.detach()
    inference = torch.is_inference_mode_enabled()

    def block(start: int, stop: int):
        with torch.inference_mode(inference):
            if bias is None:
                torch.mv(weight[start:stop], row, out=out[start:stop])
            else:
                torch.addmv(bias[start:stop], weight[start:stop], row, out=out[start:stop])

    if not split_rows(weight.shape[0], weight.shape[1] * weight.element_size(), block):
        block(0, weight.shape[0])
    return out


def split_rows(rows: int, row_bytes: int, block) -> bool:
    """Runs block(start, stop) over each of row_blocks(rows, row_bytes), each on its own Python thread (torch
    releases the GIL inside its kernels), the first in the calling one. Returns False, having run nothing, where
    there is one block."""
    blocks = row_blocks(rows, row_bytes)
    if len(blocks) < 2:
        return False
    pool = split_pool(len(blocks) - 1)
    others = [pool.submit(block, start, stop) for start, stop in blocks[1:]]
    block(*blocks[0])
    for other in others:
        other.result()
    return True


def row_blocks(rows: int, row_bytes: int) -> list:
    """[(start, stop)]: [0, rows) in one block of rows per torch thread (torch.get_num_threads()), each starting at a
    multiple of SPLIT_ALIGN; one block where there is one thread or the blocks would be too small to share
    (SPLIT_MIN_BYTES)."""
    threads = torch.get_num_threads()
    per_thread = -(-rows // threads)
    per_thread = -(-per_thread // SPLIT_ALIGN) * SPLIT_ALIGN
    if threads < 2 or per_thread >= rows or per_thread * row_bytes < SPLIT_MIN_BYTES:
        return [(0, rows)]
    return [(start, min(start + per_thread, rows)) for start in range(0, rows, per_thread)]


def split_pool(workers: int):
    """The worker threads of split_matrix_vector, made on first use, again in a forked child (whose copy has no
    threads) and for another thread count."""
    import concurrent.futures
    import os

    key = (os.getpid(), workers)
    if key not in _SPLIT_POOL:
        for stale in list(_SPLIT_POOL):
            _SPLIT_POOL.pop(stale).shutdown(wait=False)
        _SPLIT_POOL[key] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="chatglm-rows")
    return _SPLIT_POOL[key]


_ONEDNN_WORKS = []  # [whether torch's oneDNN linear with a prepacked weight gives F.linear's product], found once


def onednn_works() -> bool:
    """Whether this torch has oneDNN's prepacked linear on this CPU and it computes F.linear's bf16 product (checked on
    a probe: the operators are internal to torch, used by its compiler's CPU freezing)."""
    if not _ONEDNN_WORKS:
        try:
            probe = torch.nn.utils.skip_init(nn.Linear, 256, 64, dtype=torch.bfloat16)
            with torch.no_grad():
                probe.weight.copy_(probe_values(probe.weight.shape, "cpu"))
                probe.bias.copy_(probe_values(64, "cpu"))
                x = probe_values((2, 256), "cpu").to(torch.bfloat16)
                packed = torch.ops.mkldnn._reorder_linear_weight(probe.weight, 1)
                got = torch.ops.mkldnn._linear_pointwise(x, packed, probe.bias, "none", [], "").float()
                expected = probe(x).float()
            _ONEDNN_WORKS.append(torch.allclose(got, expected, rtol=0.02, atol=0.02 * expected.abs().max().item()))
        except (AttributeError, RuntimeError, NotImplementedError):  # no mkldnn build, no such operator, no bf16 here
            _ONEDNN_WORKS.append(False)
    return _ONEDNN_WORKS[0]


def use_cpu_packed_weights(model: nn.Module, enable: bool = True) -> int:
    """ChatGLMPreTrainedModel.use_cpu_packed_weights: every plain nn.Linear of `model` (the blocks' layers and the
    output layer; not quantized ones) made a OneDnnLinear, or back to nn.Linear (the copies dropped). Returns how
    many layers are OneDnnLinear now. bf16/fp16: calls of up to 32 rows without autograd multiply by the weight in
    oneDNN's blocked layout (one bf16 row takes torch's matrix-vector kernel instead, and no copy); the copy costs those
    weights' bytes again. Refused for a 16-bit model where torch has no oneDNN linear on this CPU (AVX2 without
    AVX-512: its paths would be the eager ones). fp32: one row's product over blocks of output rows, one per torch
    thread, no copy (torch's fp32 one-row product ran on one thread on an AVX2 AMD EPYC). Measured:
    docs/speed-and-memory.md. The parameters and the state dict stay as they are."""
    if enable and model.dtype != torch.float32 and not onednn_works():
        raise ValueError(f"use_cpu_packed_weights(): torch {torch.__version__} has no working oneDNN linear with "
                         "prepacked weights on this CPU (torch.backends.mkldnn, torch.ops.mkldnn._linear_pointwise) "
                         f"for this {model.dtype} model; an fp32 model takes its own path without it.")
    count = 0
    for module in model.modules():
        if enable and type(module) is nn.Linear:
            module.__class__ = OneDnnLinear
        elif not enable and type(module) is OneDnnLinear:
            module.__dict__.pop("onednn", None)
            module.__class__ = nn.Linear
        count += type(module) is OneDnnLinear
    return count
