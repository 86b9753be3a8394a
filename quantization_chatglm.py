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

The weights stay quantized in memory; each forward dequantizes them into the input's dtype (the original's CPU path
computes in fp32 and equals this to the bit; its CUDA kernels work in fp16) and multiplies as a linear layer.
"""

import torch
import torch.nn.functional as F
from torch import nn

QUANTIZED_WIDTHS = (4, 8)


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
        codes = self.weight
        if self.bits == 4:  # int8 shifts are arithmetic: each nibble comes out sign-extended
            codes = torch.stack((codes >> 4, (codes << 4) >> 4), dim=-1).flatten(-2)
        return codes.to(dtype) * self.weight_scale.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def reset_parameters(self):  # nn.Linear's would draw float values into the int8 codes
        nn.init.zeros_(self.weight)
        nn.init.ones_(self.weight_scale)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


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
