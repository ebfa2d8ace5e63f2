"""`nn.Module`s holding quantized weights for inference: `Int4Linear` (W4A16, canonical
packed-along-K layout, or W4A8 as vLLM's CPU build runs it on AMX), `Int8Linear` (int8
weights, W8A8 or W8A16), `Fp8Linear` (e4m3 weights, W8A8 or W8A16) and `Fp4Linear` (NVFP4 /
MXFP4 weights in compressed-tensors' packed layout, weights-only or W4A4).

Int8 activations are rounded as the named vLLM kernel rounds them (`kernels/int8_act.py`)
and multiplied in float32 as their dequantized values ("fake quant"): the same products as
the int32 GEMM up to float32 summation order.

`forward` accepts any leading batch dims `(..., K) -> (..., N)`. The products are
`torch.library` custom ops (`kernels/ops.py`), so `torch.compile(fullgraph=True)` and
CUDA-graph capture see one node per linear. On CUDA they run the fused Triton kernels;
on CPU the pure-torch reference (one dequantisation per forward, vectorised), or the
Triton interpreter when TRITON_INTERPRET=1. `backend_name(device)` says which path a
forward on `device` takes. The modules know nothing about checkpoint formats or model
architectures: loaders translate into these operands.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from infer_tool.kernels import ops
from infer_tool.kernels.backend import backend_name, use_triton
from infer_tool.kernels.fp4 import fp4_format
from infer_tool.kernels.fp4_act import mxfp4_qdq_activations, nvfp4_qdq_activations
from infer_tool.kernels.fp8 import MODES, scale_blocks
from infer_tool.kernels.int8_act import KERNELS, fake_quantize
from infer_tool.kernels.layout import pack_int4_k
from infer_tool.kernels.w4_layout import prepare

__all__ = ["Fp4Linear", "Fp8Linear", "Int4Linear", "Int8Linear", "backend_name"]
INT8_ACTIVATIONS = ("none", "int8")


def _apply_fixed(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool) -> nn.Module:
    """`nn.Module._apply` with the module's `_FIXED_DTYPE` buffers hidden behind same-width
    integer views while `fn` runs: `model.half()` / `model.to(dtype)` move them between
    devices but never cast them (fp8 and fp32 are floating types)."""
    real = {}
    for name, view in module._FIXED_DTYPE.items():
        buf = module._buffers.get(name)
        if buf is not None:
            real[name] = buf.dtype
            module._buffers[name] = buf.view(view)
    try:
        return nn.Module._apply(module, fn, recurse)
    finally:
        for name, dtype in real.items():
            module._buffers[name] = module._buffers[name].view(dtype)


def _flatten(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.shape[-1] != K:
        raise ValueError(f"expected input with last dim {K}, got shape {tuple(x.shape)}")
    return x.reshape(-1, K)


class _FixedDtypeBuffers(nn.Module):
    """A module whose buffers named in `_FIXED_DTYPE` keep their dtype: `model.half()` /
    `model.to(dtype)` move them between devices but never cast them."""

    _FIXED_DTYPE: dict[str, torch.dtype] = {}  # buffer name -> a same-width integer dtype to hide it behind

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        """Hide the fixed-dtype buffers behind same-width integer views while `fn` runs."""
        real = {}
        for name, view in self._FIXED_DTYPE.items():
            buf = self._buffers.get(name)
            if buf is not None:
                real[name] = buf.dtype
                self._buffers[name] = buf.view(view)
        try:
            return super()._apply(fn, recurse)
        finally:
            for name, dtype in real.items():
                self._buffers[name] = self._buffers[name].view(dtype)


class Int4Linear(nn.Module):
    """`y = x @ W + b` with `W (K, N)` stored as packed INT4 in the canonical layout.

    Buffers: `qweight` int32 `(ceil(K/8), N)`; `scales` `(G, N)`; `zeros` uint8 `(G, N)`
    or None (symmetric, zero point 8); `g_idx` int32 `(K,)` or None; `bias` `(N,)` or None.
    `activations` "int8": W4A8, each token quantized to int8 as vLLM's AMX kernel does
    (`kernel` "sgl", `kernels/w4a8.py`), the product in float32; "none": W4A16.

    The Triton kernels read the weight in the planar-128 layout (`kernels/w4_layout.py`):
    `prepare_kernel()` repacks it once into non-persistent buffers `_kqweight`, `_kg_idx`,
    `_kperm` (not in the state dict). It runs when the layer moves to a CUDA device, when a
    state dict is loaded into a prepared layer, and at the first kernel call otherwise.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        g_idx: torch.Tensor | None,
        bias: torch.Tensor | None,
        group_size: int,
        in_features: int,
        out_features: int,
        activations: str = "none",
        kernel: str = "sgl",
    ) -> None:
        super().__init__()
        _check_activations(activations, kernel)
        self.activations, self.kernel = activations, kernel
        if qweight.shape != (-(-in_features // 8), out_features):
            raise ValueError(
                f"Int4Linear: qweight {tuple(qweight.shape)} does not match "
                f"in_features={in_features}, out_features={out_features}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("g_idx", g_idx)
        self.register_buffer("bias", bias)
        for name in self._KERNEL_BUFFERS:
            self.register_buffer(name, None, persistent=False)
        self.register_load_state_dict_post_hook(_reprepare)
        if qweight.is_cuda:
            self.prepare_kernel()

    _KERNEL_BUFFERS = ("_kqweight", "_kg_idx", "_kperm")

    def prepare_kernel(self) -> None:
        """Repack the canonical weight for the Triton kernels (planar-128, act-order sorted)."""
        w = prepare(self.qweight, self.scales, self.zeros, self.g_idx, self.group_size, self.in_features)
        self._kqweight, self._kg_idx, self._kperm = w.qweight, w.g_idx, w.perm

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Int4Linear:
        out = super()._apply(fn, recurse)
        if self.qweight.is_cuda and (self._kqweight is None or self._kqweight.device != self.qweight.device):
            self.prepare_kernel()
        return out

    @classmethod
    def from_unpacked(
        cls,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        g_idx: torch.Tensor | None,
        group_size: int,
        bias: torch.Tensor | None = None,
        activations: str = "none",
        kernel: str = "sgl",
    ) -> Int4Linear:
        """Build from the `nn.Linear` orientation: `q` uint8 `(N, K)` values 0..15,
        `scale` `(N, G)`, `zero` uint8 `(N, G)` or None (the canonical QuantizedWeight)."""
        N, K = q.shape
        zeros = zero.t().contiguous().to(torch.uint8) if zero is not None else None
        g = g_idx.to(torch.int32) if g_idx is not None else None
        return cls(pack_int4_k(q.t()), scale.t().contiguous(), zeros, g, bias, group_size, K, N, activations, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = _flatten(x, self.in_features)
        if not torch.compiler.is_compiling() and self._kqweight is None and use_triton(x2):
            self.prepare_kernel()  # once (CPU tensors under TRITON_INTERPRET=1)
        kernel = (self._kqweight, self._kg_idx, self._kperm)
        if self.activations == "int8":
            a = fake_quantize(x2, kernel=self.kernel)
            y = ops.w4a16_mm(a, self.qweight, self.scales.float(), self.zeros, self.g_idx, self.group_size, *kernel)
            y = y.to(x.dtype)
        else:
            y = ops.w4a16_mm(x2, self.qweight, self.scales, self.zeros, self.g_idx, self.group_size, *kernel)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, symmetric={self.zeros is None}, "
            f"act_order={self.g_idx is not None}, activations={self.activations}"
        )

    @property
    def int8_kernel(self) -> str | None:
        """The kernel whose int8 rounding its activations follow, or None (W4A16)."""
        return self.kernel if self.activations == "int8" else None

    def activations_label(self) -> str | None:
        """What it does to its input, e.g. "int8 per token, W4A8 (sgl)"; None: unquantized."""
        return f"int8 per token, W4A8 ({self.kernel})" if self.activations == "int8" else None


def _reprepare(module: Int4Linear, incompatible_keys: object) -> None:
    """After `load_state_dict`: the kernel copy of a prepared layer follows the new weight."""
    if module._kqweight is not None:
        module.prepare_kernel()


def _check_activations(activations: str, kernel: str) -> None:
    if activations not in INT8_ACTIVATIONS:
        raise ValueError(f"unknown activations {activations!r}; expected one of {INT8_ACTIVATIONS}")
    if kernel not in KERNELS:
        raise ValueError(f"unknown int8 kernel {kernel!r}; expected one of {KERNELS}")


class Int8Linear(_FixedDtypeBuffers):
    """`y = a(x) @ (weight * weight_scale)ᵀ + b` with int8 weights `(N, K)`.

    `weight` int8 `(N, K)`; `weight_scale` fp32 `(N, G)`, G groups of K/G inputs (1: per
    channel); `input_scale` fp32 `(1,)` (static activations) or None; `activations` "int8"
    (W8A8: per token, or with the static `input_scale`; the "sgl" kernel, vLLM's AMX path,
    reads no static scale and quantizes per token) or "none" (W8A16); `kernel` one of
    `kernels/int8_act.KERNELS`. The product is computed in float32 and returned in x's dtype.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        activations: str = "int8",
        kernel: str = "onednn",
    ) -> None:
        super().__init__()
        _check_activations(activations, kernel)
        if weight.dtype != torch.int8 or weight.dim() != 2:
            raise ValueError(f"Int8Linear: weight must be int8 (N, K), got {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        G = weight_scale.shape[1] if weight_scale.dim() == 2 else 0
        if weight_scale.shape[0] != self.out_features or G == 0 or self.in_features % G:
            raise ValueError(
                f"Int8Linear: weight_scale {tuple(weight_scale.shape)} does not give groups over "
                f"{self.out_features} x {self.in_features}"
            )
        self.activations, self.kernel = activations, kernel
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1))
        self.register_buffer("bias", bias)

    _FIXED_DTYPE = {"weight_scale": torch.int32, "input_scale": torch.int32}  # fp32 whatever the model's dtype

    def dequantized(self) -> torch.Tensor:
        """(N, K) fp32: weight * weight_scale."""
        G = self.weight_scale.shape[1]
        return (self.weight.float().view(self.out_features, G, -1) * self.weight_scale.view(-1, G, 1)).view(
            self.out_features, self.in_features
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = _flatten(x, self.in_features)
        if self.activations == "int8":
            static = None if self.kernel == "sgl" else self.input_scale
            a = fake_quantize(x2, static, kernel=self.kernel)
        else:
            a = x2.float()
        y = a @ self.dequantized().T
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"groups={self.weight_scale.shape[1]}, activations={self.activations}, kernel={self.kernel}, "
            f"static_input_scale={self.input_scale is not None}"
        )

    @property
    def int8_kernel(self) -> str | None:
        """The kernel whose int8 rounding its activations follow, or None (W8A16)."""
        return self.kernel if self.activations == "int8" else None

    def activations_label(self) -> str | None:
        """ "int8 per token (onednn)", "int8 static input_scale (onednn)"; None: unquantized."""
        if self.activations != "int8":
            return None
        static = self.input_scale is not None and self.kernel != "sgl"
        return f"int8 {'static input_scale' if static else 'per token'} ({self.kernel})"


class Fp8Linear(_FixedDtypeBuffers):
    """`y = x @ (w_fp8 * weight_scale)ᵀ + b` with e4m3 weights `(N, K)`.

    `weight_scale` fp32 `(1,)`, `(N, 1)` or `(ceil(N/bn), ceil(K/bk))` with
    `block_size=(bn, bk)`; `input_scale` fp32 `(1,)` static activation scale (w8a8) or
    None for dynamic per-token activation scales; `mode` "w8a8" or "w8a16".
    """

    def __init__(
        self,
        weight_fp8: torch.Tensor,
        weight_scale: torch.Tensor,
        input_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        block_size: tuple[int, int] | None = None,
        mode: str = "w8a8",
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"Fp8Linear: unknown mode {mode!r}; expected one of {MODES}")
        if weight_fp8.dtype != torch.float8_e4m3fn or weight_fp8.dim() != 2:
            raise ValueError(f"Fp8Linear: weight must be float8_e4m3fn (N, K), got {weight_fp8.dtype}")
        self.out_features, self.in_features = weight_fp8.shape
        scale_blocks(weight_scale, self.out_features, self.in_features, block_size)  # validates
        if input_scale is not None and mode != "w8a8":
            raise ValueError("Fp8Linear: input_scale is only used with mode='w8a8'")
        self.mode = mode
        self.block_size = tuple(block_size) if block_size is not None else None
        self.register_buffer("weight", weight_fp8)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale.float().reshape(1) if input_scale is not None else None)
        self.register_buffer("bias", bias)

    # Buffers whose dtype is part of the format (fp8 and fp32 are floating types).
    _FIXED_DTYPE = {"weight": torch.uint8, "weight_scale": torch.int32, "input_scale": torch.int32}

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp8Linear:
        return _apply_fixed(self, fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        bn, bk = self.block_size or (0, 0)
        y = ops.fp8_mm(
            _flatten(x, self.in_features),
            self.weight.view(torch.uint8),
            self.weight_scale,
            self.mode,
            bn,
            bk,
            self.input_scale,
        )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, "
            f"block_size={self.block_size}, static_input_scale={self.input_scale is not None}"
        )

    int8_kernel = None  # its activations are e4m3, never int8

    def activations_label(self) -> str | None:
        """ "fp8 (e4m3)" in W8A8 mode; None: unquantized (W8A16)."""
        return "fp8 (e4m3)" if self.mode == "w8a8" else None


class Fp4Linear(nn.Module):
    """`y = a(x) @ dequantize(w)ᵀ + b` with FP4 weights `(N, K)` as compressed-tensors stores
    them (`kernels/fp4.py`): `w_packed` uint8 `(N, K/2)`; `w_scale` `(N, K/16)` float8_e4m3fn
    with `global_scale` float32 `(1,)` (NVFP4) or `(N, K/32)` uint8 E8M0 (MXFP4, no global scale).

    `w4a4`: a(x) quantize-dequantizes the input as vLLM's emulation does (`kernels/fp4_act.py`:
    NVFP4 with the static `input_global_scale` float32 `(1,)` and dynamic per-16 scales, MXFP4
    dynamic per 32); otherwise a(x) = x (weights only). The product runs the Triton kernel on
    CUDA, the torch reference on CPU.
    """

    def __init__(
        self,
        w_packed: torch.Tensor,
        w_scale: torch.Tensor,
        global_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        *,
        w4a4: bool = False,
        input_global_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.fmt = fp4_format(w_scale, global_scale)  # validates the pair
        if w_packed.dtype != torch.uint8 or w_packed.dim() != 2:
            raise ValueError(
                f"Fp4Linear: w_packed must be uint8 (N, K/2), got {w_packed.dtype} {tuple(w_packed.shape)}"
            )
        self.out_features, self.in_features = int(w_packed.shape[0]), 2 * int(w_packed.shape[1])
        if w4a4 and self.fmt == "nvfp4" and input_global_scale is None:
            raise ValueError("Fp4Linear: NVFP4 W4A4 needs the input_global_scale")
        if input_global_scale is not None and not (w4a4 and self.fmt == "nvfp4"):
            raise ValueError("Fp4Linear: an input_global_scale belongs to NVFP4 W4A4 only")
        self.w4a4 = w4a4
        self.register_buffer("w_packed", w_packed)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("global_scale", None if global_scale is None else global_scale.float().reshape(1))
        self.register_buffer(
            "input_global_scale", None if input_global_scale is None else input_global_scale.float().reshape(1)
        )
        self.register_buffer("bias", bias)

    # Buffers whose dtype is part of the format: moved between devices, never cast (as Fp8Linear's).
    _FIXED_DTYPE = {"w_scale": torch.uint8, "global_scale": torch.int32, "input_global_scale": torch.int32}

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp4Linear:
        return _apply_fixed(self, fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = _flatten(x, self.in_features)
        if self.w4a4:
            x = nvfp4_qdq_activations(x, self.input_global_scale) if self.fmt == "nvfp4" else mxfp4_qdq_activations(x)
        e4m3 = self.w_scale.dtype == torch.float8_e4m3fn
        y = ops.fp4_mm(x, self.w_packed, self.w_scale.view(torch.uint8), e4m3, self.global_scale)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}, "
            f"activations={'fp4' if self.w4a4 else 'unquantized'}"
        )

    int8_kernel = None  # its activations are FP4 or unquantized, never int8

    def activations_label(self) -> str | None:
        """ "nvfp4 W4A4 (vLLM's emulation)" with W4A4; None: unquantized."""
        return f"{self.fmt} W4A4 (vLLM's emulation)" if self.w4a4 else None
