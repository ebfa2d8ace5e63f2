"""Checkpoints as other tools write them, built here from each producer's published layout
(never through our writers or packers), with the weights those layouts dequantize to.

Each builder takes float weights `{linear name: W (N, K) float32}` and returns
`(tensors, quantization_config, dequantized)`: the tensors that replace `name.weight`, the
config.json `quantization_config`, and `{name: W' (N, K) float32}` computed by the producer's
own dequantization formula (stated per builder).

- AutoAWQ GEMM (`WQLinear_GEMM`): qweight int32 (K, N/8), W transposed, 8 nibbles per word
  along the output dim, nibble i of word j = column 8j + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros
  int32 (G, N/8) the same packing; scales fp16 (G, N). W' = (q - z) * s.
- GPTQ v1 (AutoGPTQ / GPTQModel `checkpoint_format: gptq`): qweight int32 (K/8, N), rows 8r..8r+7
  of W^T in word r at bits 4i; qzeros int32 (G, N/8) holding zero - 1, sequential along N;
  scales fp16 (G, N); g_idx int32 (K,) (act-order: the group of column k is its rank in the
  visiting order // g). W'[:, k] = (q - z[g_idx[k]]) * s[g_idx[k]].
- native FP8 (`quant_method: fp8`, vLLM's Fp8Config, DeepSeek-V3 style): block: weight e4m3,
  weight_scale_inv float32 (ceil(N/bn), ceil(K/bk)), a multiplier; per tensor: weight_scale
  float32 scalar. W' = float(q) * scale.
- ModelOpt NVFP4 (`NVFP4QTensor`): weight uint8 (N, K/2), code 2j low nibble, 2j+1 high;
  weight_scale e4m3 (N, K/16); weight_scale_2 float32 scalar amax / 2688; input_scale float32
  scalar. W' = value(code) * (float(s) * weight_scale_2).
- ModelOpt FP8 (quant_algo `FP8`, `FP8QTensor`): weight e4m3 (N, K) = W / weight_scale, weight_scale
  float32 scalar amax / 448 (a multiplier), input_scale float32 scalar amax(x) / 448 (static
  per-tensor activations). W' = float(q) * weight_scale.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _words(nibbles: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """(R, C) values 0..15 -> int32 (R, C/8): word j holds value 8j + order[i] at bits 4i."""
    r, c = nibbles.shape
    v = nibbles.astype(np.uint32).reshape(r, c // 8, 8)
    out = np.zeros((r, c // 8), dtype=np.uint32)
    for i, col in enumerate(order):
        out |= v[:, :, col] << np.uint32(4 * i)
    return out.view(np.int32)


def _minmax_int4(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale fp16, zero) per row of w (R, g): AutoGPTQ/AutoAWQ's min-max rule, 4 bits."""
    lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    scale = ((hi - lo) / 15).clamp(min=1e-5).half()
    zero = torch.full_like(scale, 8, dtype=torch.int64) if sym else (-lo / scale.float()).round().clamp(1, 15).long()
    return scale, zero


def awq_gemm(weights: dict[str, torch.Tensor], g: int = 32) -> tuple[dict, dict, dict]:
    tensors, deq = {}, {}
    for name, w in weights.items():
        n, k = w.shape
        grouped = w.reshape(n, k // g, g).reshape(-1, g)
        scale, zero = _minmax_int4(grouped, sym=False)
        q = (grouped / scale.float()[:, None]).round().add(zero[:, None]).clamp(0, 15).long()
        deq[name] = ((q - zero[:, None]).float() * scale.float()[:, None]).reshape(n, k)
        q = q.reshape(n, k)
        scale, zero = scale.reshape(n, k // g), zero.reshape(n, k // g)
        tensors[f"{name}.qweight"] = torch.from_numpy(_words(q.T.numpy(), AWQ_ORDER))  # (K, N/8)
        tensors[f"{name}.qzeros"] = torch.from_numpy(_words(zero.T.numpy(), AWQ_ORDER))  # (G, N/8)
        tensors[f"{name}.scales"] = scale.T.contiguous()  # (G, N) fp16
    config = {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True, "version": "gemm"}
    return tensors, config, deq


def gptq_v1(
    weights: dict[str, torch.Tensor], g: int = 32, sym: bool = True, act_order: bool = False, seed: int = 0
) -> tuple[dict, dict, dict]:
    gen = torch.Generator().manual_seed(seed)
    tensors, deq = {}, {}
    for name, w in weights.items():
        n, k = w.shape
        order = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[order] = torch.arange(k) // g  # column order[r] is visited r-th
        scale = torch.empty(k // g, n, dtype=torch.float16)
        zero = torch.empty(k // g, n, dtype=torch.long)
        for j in range(k // g):
            cols = (g_idx == j).nonzero().flatten()
            s, z = _minmax_int4(w[:, cols], sym)
            scale[j], zero[j] = s, z
        s_full, z_full = scale.float()[g_idx].T, zero[g_idx].T  # (N, K)
        q = (w / s_full).round().add(z_full).clamp(0, 15).long()
        deq[name] = (q - z_full).float() * s_full
        tensors[f"{name}.qweight"] = torch.from_numpy(_words(q.numpy())).T.contiguous()  # (K/8, N): along K
        tensors[f"{name}.qzeros"] = torch.from_numpy(_words((zero - 1).numpy()))  # (G, N/8)
        tensors[f"{name}.scales"] = scale
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
    config = {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": 4,
        "group_size": g,
        "sym": sym,
        "desc_act": act_order,
        "static_groups": False,
    }
    return tensors, config, deq


def fp8_native(weights: dict[str, torch.Tensor], block: tuple[int, int] | None = (32, 32)) -> tuple[dict, dict, dict]:
    tensors, deq = {}, {}
    for name, w in weights.items():
        n, k = w.shape
        if block is None:
            scale = (w.abs().amax() / 448.0).float()
            full = scale.expand(n, k)
            tensors[f"{name}.weight_scale"] = scale.reshape(())
        else:
            bn, bk = block
            pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
            pad[:n, :k] = w.abs()
            amax = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax((1, 3))
            scale = (amax / 448.0).clamp(min=1e-12)
            full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
            tensors[f"{name}.weight_scale_inv"] = scale.float()
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[f"{name}.weight"] = q
        deq[name] = q.float() * full
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    config["weight_block_size"] = list(block) if block else None
    return tensors, config, deq


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """ModelOpt's `_cast_fp4`: searchsorted on the bounds, ties at 0.75 / 1.75 / 2.5 go up."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    a = x.abs()
    idx = torch.searchsorted(bounds, a.contiguous())
    idx += (a.unsqueeze(-1) == bounds[[1, 3, 5]]).any(-1).long()
    return idx + 8 * (x < 0).long()


def modelopt_nvfp4(weights: dict[str, torch.Tensor], w4a4: bool = False, input_amax: float = 3.0) -> tuple:
    tensors, deq = {}, {}
    for name, w in weights.items():
        n, k = w.shape
        ws2 = (w.abs().amax().float() / (6.0 * 448.0)).reshape(())
        blocks = w.reshape(n, k // 16, 16)
        s = blocks.abs().amax(-1) / (6.0 * ws2)
        s[s == 0] = 1.0
        s = s.clamp(min=2**-9).to(torch.float8_e4m3fn)
        codes = _e2m1_codes(blocks / (s.float() * ws2).unsqueeze(-1)).reshape(n, k)
        values = E2M1[codes % 8] * torch.where(codes >= 8, -1.0, 1.0)
        deq[name] = (values.reshape(n, k // 16, 16) * (s.float() * ws2).unsqueeze(-1)).reshape(n, k)
        tensors[f"{name}.weight"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        tensors[f"{name}.weight_scale"] = s
        tensors[f"{name}.weight_scale_2"] = ws2.float()
        if w4a4:
            tensors[f"{name}.input_scale"] = torch.tensor(input_amax / (6.0 * 448.0), dtype=torch.float32)
    algo = "NVFP4" if w4a4 else "W4A16_NVFP4"
    config = {
        "quant_method": "modelopt",
        "quantization": {
            "quant_algo": algo,
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ["lm_head"],
        },
    }
    return tensors, config, deq


def modelopt_fp8(weights: dict[str, torch.Tensor], input_amax: float = 3.0) -> tuple:
    tensors, deq = {}, {}
    for name, w in weights.items():
        scale = (w.abs().amax().float() / 448.0).reshape(())
        q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        deq[name] = q.float() * scale
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale"] = scale
        tensors[f"{name}.input_scale"] = torch.tensor(input_amax / 448.0, dtype=torch.float32)
    config = {
        "quant_method": "modelopt",
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
    }
    return tensors, config, deq


BUILDERS = {
    "awq-gemm": lambda w: awq_gemm(w),
    "gptq-sym": lambda w: gptq_v1(w, sym=True),
    "gptq-asym": lambda w: gptq_v1(w, sym=False),
    "gptq-act-order": lambda w: gptq_v1(w, sym=True, act_order=True),
    "fp8-block": lambda w: fp8_native(w, (32, 32)),
    "fp8-tensor": lambda w: fp8_native(w, None),
    "modelopt-nvfp4": lambda w: modelopt_nvfp4(w, w4a4=True),
    "modelopt-w4a16": lambda w: modelopt_nvfp4(w, w4a4=False),
    "modelopt-fp8": lambda w: modelopt_fp8(w),
}


def write_producer(model_dir: Path, out: Path, producer: str, *, legacy_modelopt: bool = False) -> tuple[Path, Path]:
    """(checkpoint dir, float reference dir) of `model_dir` (an HF Llama saved as one
    model.safetensors) in `producer`'s layout: every `*_proj` linear quantized, the rest kept; the
    reference holds the dequantized weights in float32. `legacy_modelopt`: the ModelOpt config in
    hf_quant_config.json only (older exports), not in config.json."""
    state = load_file(str(model_dir / "model.safetensors"))
    linears = {k.removesuffix(".weight"): v.float() for k, v in state.items() if k.endswith("proj.weight")}
    tensors, qcfg, deq = BUILDERS[producer](linears)
    ckpt, ref = out / producer, out / f"{producer}-ref"
    for d in (ckpt, ref):
        shutil.copytree(model_dir, d)
    kept = {k: v for k, v in state.items() if k.removesuffix(".weight") not in linears}
    save_file({**kept, **tensors}, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    save_file(
        {**{k: v.float() for k, v in kept.items()}, **{f"{n}.weight": w for n, w in deq.items()}},
        str(ref / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = json.loads((model_dir / "config.json").read_text())
    if legacy_modelopt:
        (ckpt / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, **qcfg}))
    else:
        config["quantization_config"] = qcfg
    (ckpt / "config.json").write_text(json.dumps(config))
    ref_config = dict(json.loads((model_dir / "config.json").read_text()), torch_dtype="float32")
    (ref / "config.json").write_text(json.dumps(ref_config))
    return ckpt, ref
