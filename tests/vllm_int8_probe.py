"""Probe vLLM's CPU INT8 activation kernels and compare them with `kernels/int8_act.py` and
`kernels/w4a8.py` (a script, not a test; phase B turns it into one).

Two halves, two interpreters:

    .venv-vllm/bin/python tests/vllm_int8_probe.py record OUT.safetensors
    .venv/bin/python      tests/vllm_int8_probe.py compare OUT.safetensors [--json]

`record` imports vLLM (and nothing of infer-tool), runs its ops on crafted inputs and saves
inputs and outputs; `compare` recomputes every case with our references and prints, per case,
the fraction of codes (or output elements) that differ and the largest difference.

Cases (each input in fp32, bf16 and fp16 where the op takes it):
- `dyn.*`    `scaled_int8_quant(x)`: per-token symmetric (oneDNN-path `dynamic_scaled_int8_quant`);
- `dynasym.*` the same with `symmetric=False` (scale and azp per token);
- `static.*` / `staticazp.*` `scaled_int8_quant(x, scale[, azp])`;
- `sgl.*`    `int8_scaled_mm_with_quant` (the AMX-path W8A8 GEMM, which quantizes per token
  itself) against an identity int8 weight: its output is bf16(q * scale), which pins q;
- `w4a8.*`   `int4_scaled_mm_cpu` (the AMX W4A8 GEMM) on random INT4 weights;
- `onednn.*` the whole oneDNN W8A8 linear (`onednn_scaled_mm`), compared with our fake-quant
  activations times the dequantized weight (float tolerance, not bits), and with oneDNN's
  int16-saturating GEMM on a CPU without VNNI (`saturating_u8s8`).
The inputs: random rows at magnitudes 1e-30 .. 1e30, rows of exact ties (k + 0.5 after
scaling), all-zero rows, outlier channels, lengths that are not a multiple of 16.
A case the op refuses on this CPU is recorded with its error and reported as such: vLLM's AVX2
build (`_C_AVX2`, loaded without AVX-512) has no `sgl` and `w4a8` ops at all. The `onednn`
cases are compared with the rounding of the build that ran them (`kernels/int8_act.py`).
"""

from __future__ import annotations

import json
import sys

DTYPES = ("float32", "bfloat16", "float16")


# ---------------------------------------------------------------- inputs (both halves)


def activation_rows(torch, K: int, seed: int):
    """(M, K) fp32 rows: random at many magnitudes, ties, zeros, outliers, tiny and huge."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(K, generator=g) * 10.0 ** float(e) for e in range(-30, 31, 5)]
    rows += [torch.randn(K, generator=g) for _ in range(24)]
    out = torch.randn(K, generator=g)
    out[torch.randint(0, K, (3,), generator=g)] *= 300.0  # outlier channels
    rows.append(out)
    ties = torch.arange(K, dtype=torch.float32) % 254 - 127 + 0.5  # k + 0.5 in [-126.5, 126.5]
    ties[0] = 127.0  # amax 127 -> scale 1, inv 1: every other value a tie
    rows.append(ties)
    rows.append(ties * 2.0)  # scale 2, inv 0.5
    rows.append(ties * 0.1)  # inexact scale: near-ties
    rows.append(torch.zeros(K))
    one_hot = torch.zeros(K)
    one_hot[K // 2] = -3.0
    rows.append(one_hot)
    rows.append(torch.full((K,), 1e-38))  # subnormal scale
    rows.append(torch.rand(K, generator=g) + 5.0)  # all positive (asymmetric range)
    return torch.stack(rows)


def static_inputs(torch, K: int, seed: int):
    """(M, K) fp32 rows for a static scale of 0.05: in range, ties, saturating both ways."""
    g = torch.Generator().manual_seed(seed)
    scale = 0.05
    rows = [torch.randn(K, generator=g) * 3.0 for _ in range(8)]
    rows.append((torch.arange(K, dtype=torch.float32) % 254 - 127 + 0.5) * scale)
    rows.append(torch.randn(K, generator=g) * 100.0)  # saturates
    rows.append(torch.zeros(K))
    return torch.stack(rows), scale


# ---------------------------------------------------------------- record (vLLM's interpreter)


def vllm_build(torch) -> str:
    """Which of its x86 libraries vLLM's CPU build loads here (`vllm.platforms.cpu.import_kernels`):
    "_C" (AVX-512 BF16), "_C_AVX512" or "_C_AVX2" (no AVX-512: no AMX ops in it)."""
    if not torch.cpu._is_avx512_supported():
        return "_C_AVX2"
    return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"


def record(path: str) -> None:
    import os

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from safetensors.torch import save_file
    from vllm import _custom_ops as ops

    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, dict] = {}

    def run(name: str, fn, info: dict) -> None:
        try:
            outs = fn()
        except Exception as exc:  # noqa: BLE001 (an op this CPU refuses is the finding)
            meta[name] = {**info, "error": f"{type(exc).__name__}: " + " ".join(str(exc).split())[:300]}
            return
        for k, v in outs.items():
            tensors[f"{name}.{k}"] = v.contiguous().clone()
        meta[name] = info

    for K in (4096, 100, 17):
        base = activation_rows(torch, K, seed=K)
        for dt in DTYPES:
            x = base.to(getattr(torch, dt))
            x = x[torch.isfinite(x).all(dim=-1)]  # fp16 overflows the largest rows

            def dyn(x=x):
                q, s, _ = ops.scaled_int8_quant(x)
                return {"x": x, "q": q, "scale": s}

            def dynasym(x=x):
                q, s, azp = ops.scaled_int8_quant(x, symmetric=False)
                return {"x": x, "q": q, "scale": s, "azp": azp}

            run(f"dyn.{dt}.K{K}", dyn, {"op": "dyn", "dtype": dt})
            run(f"dynasym.{dt}.K{K}", dynasym, {"op": "dynasym", "dtype": dt})
        xs, scale = static_inputs(torch, K, seed=K + 1)
        for dt in DTYPES:
            x = xs.to(getattr(torch, dt))
            s = torch.tensor([scale], dtype=torch.float32)
            azp = torch.tensor([7], dtype=torch.int32)

            def static(x=x, s=s):
                q, _, _ = ops.scaled_int8_quant(x, scale=s)
                return {"x": x, "q": q, "scale": s}

            def staticazp(x=x, s=s, azp=azp):
                q, _, _ = ops.scaled_int8_quant(x, scale=s, azp=azp, symmetric=False)
                return {"x": x, "q": q, "scale": s, "azp": azp}

            run(f"static.{dt}.K{K}", static, {"op": "static", "dtype": dt})
            run(f"staticazp.{dt}.K{K}", staticazp, {"op": "staticazp", "dtype": dt})

    # AMX-path W8A8 GEMM with an identity weight: out = bf16((q * scale) * 1)
    for K in (256, 4096):
        x = activation_rows(torch, K, seed=7 * K).to(torch.bfloat16)
        eye = torch.eye(K, dtype=torch.int8)

        def sgl(x=x, eye=eye, K=K):
            packed = torch.ops._C.convert_weight_packed(eye)
            ones = torch.ones(K, dtype=torch.float32)
            out = torch.ops._C.int8_scaled_mm_with_quant(x, packed, ones, None, torch.bfloat16, True)
            return {"x": x, "out": out}

        run(f"sgl.bfloat16.K{K}", sgl, {"op": "sgl", "dtype": "bfloat16"})

    # AMX W4A8 GEMM on random INT4 weights (AWQ-packed as CPUWNA16LinearKernel repacks them)
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        pack_quantized_values_into_int32,
    )
    from vllm.scalar_type import scalar_types

    for K, N, group, M, sym in (
        (256, 64, 64, 3, True),
        (256, 64, 128, 4, False),
        (512, 96, 512, 1, True),
        (256, 64, 64, 37, False),
        (256, 256, 32, 4, False),
        (512, 256, 64, 64, True),
    ):
        for dt in ("bfloat16", "float16"):
            g = torch.Generator().manual_seed(K + N + M)
            rows = torch.randn(M, K, generator=g) * 2.0
            ties = torch.arange(K, dtype=torch.float32) % 254 - 127 + 0.5
            ties[0] = 127.0  # scale 1: ties at every other channel
            rows[-1] = ties
            if M > 2:
                rows[-2] = ties * 2.0
            x = rows.to(getattr(torch, dt))
            q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int32)
            G = K // group
            zeros = (
                torch.full((G, N), 8, dtype=torch.int32)
                if sym
                else torch.randint(0, 16, (G, N), generator=g, dtype=torch.int32)
            )
            scales = (torch.rand(G, N, generator=g) * 0.02 + 0.001).to(x.dtype)
            bias = torch.randn(N, generator=g).to(x.dtype)

            def w4a8(x=x, q=q, zeros=zeros, scales=scales, bias=bias, K=K, N=N, G=G):
                order = (0, 2, 4, 6, 1, 3, 5, 7)  # as `_process_gptq_weights_w4a8`
                u4 = scalar_types.uint4
                w = pack_quantized_values_into_int32(q.view(K, N // 8, 8)[:, :, order].reshape(K, N), u4, 1)
                z = pack_quantized_values_into_int32(zeros.view(G, N // 8, 8)[:, :, order].reshape(G, N), u4, 1)
                bw, bz, bs = ops.convert_weight_packed_scale_zp(
                    w.contiguous(), z.contiguous(), scales, ops.CPUQuantAlgo.AWQ
                )
                out = ops.int4_scaled_mm_cpu(x=x, w=bw, w_zeros=bz, w_scales=bs, bias=bias.float())
                return {
                    "x": x,
                    "q": q.to(torch.uint8),
                    "zeros": zeros.to(torch.uint8),
                    "scales": scales,
                    "bias": bias,
                    "out": out,
                }

            run(
                f"w4a8.{dt}.M{M}.K{K}.N{N}.g{group}.{'sym' if sym else 'asym'}",
                w4a8,
                {"op": "w4a8", "dtype": dt, "group": group},
            )

    # the whole oneDNN W8A8 linear (per-token dynamic, static), as CPUInt8ScaledMMLinearKernel runs it
    for static in (False, True):
        g = torch.Generator().manual_seed(11 + static)
        M, K, N = 9, 256, 128
        x = (torch.randn(M, K, generator=g) * 3.0).to(torch.bfloat16)
        w = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        w_s = (torch.rand(N, 1, generator=g) * 0.01 + 0.001).float()
        i_s = torch.tensor([0.05], dtype=torch.float32) if static else None

        def onednn(x=x, w=w, w_s=w_s, i_s=i_s):
            wt = w.t()  # (K, N), column-major
            handler = ops.create_onednn_scaled_mm(wt, w_s, x.dtype, i_s is None, False, 32)
            azp_adj = wt.sum(dim=0, keepdim=True, dtype=torch.float32) * w_s.squeeze()
            x_q, x_s, x_zp = ops.onednn_scaled_int8_quant(x, i_s, None, True)
            out = torch.empty((x.shape[0], handler.n), dtype=x.dtype)
            ops.onednn_scaled_mm(handler, x_q, out, x_s, x_zp, azp_adj, None)
            res = {"x": x, "w": w, "w_s": w_s, "out": out}
            if i_s is not None:
                res["input_scale"] = i_s
            return res

        run(f"onednn.{'static' if static else 'dynamic'}", onednn, {"op": "onednn", "dtype": "bfloat16"})

    host = {
        "amx": bool(torch.cpu._is_amx_tile_supported()),
        "build": vllm_build(torch),
        "vnni": bool(torch.cpu._is_vnni_supported()),
        "torch": torch.__version__,
    }
    try:
        import vllm

        host["vllm"] = vllm.__version__
    except ImportError:  # the version is informative only
        pass
    save_file(tensors, path, metadata={"cases": json.dumps(meta), "host": json.dumps(host)})
    print(
        json.dumps(
            {"host": host, "cases": len(meta), "errors": {k: v["error"] for k, v in meta.items() if "error" in v}},
            indent=1,
        )
    )


# ---------------------------------------------------------------- compare (our interpreter)


def saturating_u8s8(x, input_scale, w, kernel: str):
    """oneDNN's int8 GEMM on an x86 CPU without VNNI (its "Nuances of int8 computations"): the
    s8 activation codes q (M, K) are shifted to u8 (q + 128), multiplied with the s8 weight
    w (N, K) in pairs along K whose sums saturate to int16 (`vpmaddubsw`), then accumulated in
    int32 and the shift compensated (-128 * sum_k w); times the activation scale. float64
    (M, N), before the weight scales."""
    from infer_tool.kernels.int8_act import quantize_per_token, quantize_static

    if input_scale is None:
        q, scale, _ = quantize_per_token(x, kernel=kernel)
    else:
        q, scale = quantize_static(x, input_scale, kernel=kernel), input_scale.reshape(1, 1)
    u, W = q.long() + 128, w.long()
    pairs = (u[:, None, :] * W[None, :, :]).unflatten(-1, (-1, 2)).sum(-1).clamp(-(2**15), 2**15 - 1)
    acc = pairs.sum(-1) - 128 * W.sum(dim=1)[None, :]
    return acc.double() * scale.double()


def compare(path: str) -> dict:
    import torch
    from safetensors import safe_open

    from infer_tool.kernels.int8_act import (
        fake_quantize,
        quantize_per_token,
        quantize_static,
    )
    from infer_tool.kernels.layout import pack_int4_k
    from infer_tool.kernels.w4a8 import w4a8_reference

    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["cases"])
        host = json.loads(f.metadata()["host"])
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    rows = []
    onednn = "onednn_avx2" if host.get("build") == "_C_AVX2" else "onednn"  # the build's rounding
    for name, info in meta.items():
        row = {"case": name}
        if "error" in info:
            rows.append({**row, "error": info["error"]})
            continue

        def get(k, name=name):
            return t[f"{name}.{k}"]

        op = info["op"]
        if op in ("dyn", "dynasym", "static", "staticazp"):
            x = get("x")
            if op == "dyn":
                q, s, _ = quantize_per_token(x, kernel=onednn)
                row["scale_bits_differ"] = int((s != get("scale")).sum())
            elif op == "dynasym":
                q, s, azp = quantize_per_token(x, symmetric=False, kernel=onednn)
                row["scale_bits_differ"] = int((s != get("scale")).sum())
                row["azp_differ"] = int((azp != get("azp")).sum())
            else:
                q = quantize_static(x, get("scale"), get("azp") if op == "staticazp" else None, kernel=onednn)
            ref = get("q")
            diff = (q.int() - ref.int()).abs()
            row.update(codes=ref.numel(), codes_differ=int((diff > 0).sum()), max_code_diff=int(diff.max()))
            if row["codes_differ"]:
                bad = (diff > 0).any(dim=-1).nonzero().flatten().tolist()
                row["rows_differ"] = bad[:10]
        elif op == "sgl":
            x = get("x")
            q, s, _ = quantize_per_token(x, kernel="sgl")
            mine = (q.float() * s).to(torch.bfloat16)
            ref = get("out")
            row.update(outputs=ref.numel(), outputs_differ=int((mine != ref).sum()))
        elif op == "w4a8":
            x, q, zeros, scales, bias = get("x"), get("q"), get("zeros"), get("scales"), get("bias")
            out = w4a8_reference(x, pack_int4_k(q), scales, zeros, info["group"], bias.float())
            ref = get("out")
            row.update(
                outputs=ref.numel(),
                outputs_differ=int((out != ref).sum()),
                max_rel=float(((out.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-6)).max()),
            )
            # the evaluation's cheaper form: fake-quant activations times the dequantized weight
            g = torch.arange(q.shape[0]) // info["group"]
            wd = (q.float() - zeros[g].float()) * scales.float()[g]
            fq = (fake_quantize(x, kernel="sgl") @ wd + bias.float()).to(x.dtype)
            row["fakequant_outputs_differ"] = int((fq != ref).sum())
        elif op == "onednn":
            x, w, w_s = get("x"), get("w"), get("w_s")
            i_s = t.get(f"{name}.input_scale")
            xa = fake_quantize(x, i_s, kernel=onednn)
            out = (xa.double() @ (w.double() * w_s.double()).T).float()
            ref = get("out").float()
            rel = (out - ref).abs() / ref.abs().clamp_min(1e-3)
            sat = (saturating_u8s8(x, i_s, w, onednn) * w_s.double().T).float()
            row.update(
                outputs=ref.numel(),
                max_rel=float(rel.max()),
                bf16_outputs_differ=int((out.to(torch.bfloat16) != get("out")).sum()),
                row_rel=float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max()),
                saturating_row_rel=float(((sat - ref).norm(dim=-1) / ref.norm(dim=-1)).max()),
            )
        rows.append(row)
    return {"host": host, "rows": rows}


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "record":
        record(argv[1])
        return 0
    if len(argv) >= 2 and argv[0] == "compare":
        res = compare(argv[1])
        if "--json" in argv:
            print(json.dumps(res, indent=1))
        else:
            print(f"host: {res['host']}")
            for r in res["rows"]:
                print(json.dumps(r))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
