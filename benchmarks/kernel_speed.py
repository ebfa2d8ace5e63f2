"""Benchmark the fused W4A16, FP8 and FP4 (NVFP4A16, MXFP4A16) kernels against bf16
`torch.matmul` on a GPU, and tune their launch configs.

For every Llama-class weight shape K x N and batch M it first checks correctness
against the fp32 torch reference, then times each kernel two ways:

- plain calls: `triton.testing.do_bench` (median; do_bench clears a 256 MB buffer before
  every run, so the weights come from HBM, not L2; the time includes our Python launcher
  whenever it is longer than the kernel);
- CUDA-graph replay, as vLLM serves decode: one graph of many calls, replayed, its GPU
  time divided by the calls (median of 10 replays). The calls rotate over copies of the
  weights that together exceed twice the L2, so each call still reads its weights from
  HBM (a graph has no room for L2 flushes).

Reported per row: both times, effective bandwidth (bytes of packed weights, scales,
activations and outputs over the graph time, else the plain one), TFLOP/s and the
speedups over bf16 timed the same way; the issue's targets are checked on the graph
times. The table is written as markdown and JSON.

`--tune DIR` sweeps each kernel's config space (`kernels/tuning.config_space`) per shape
and M bucket instead, keeps the fastest correct config without register spills, and
writes them to `DIR/<gpu>.json` as it goes (the table `kernels/tuning.py` reads).

    python benchmarks/kernel_speed.py --out benchmarks/results          # on a CUDA machine
    python benchmarks/kernel_speed.py --tune kernels/tuned   # fill the table
    python benchmarks/kernel_speed.py --dry-run                          # CPU: interpreter,
        # tiny shapes, correctness only (checks the script itself before a GPU run)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GPU_SHAPES = ((4096, 14336), (14336, 4096), (8192, 28672))  # (K, N)
GPU_MS = (1, 16, 2048)
DRY_SHAPES = ((352, 200), (160, 72))  # not tile multiples; K a multiple of the FP4 groups (32)
DRY_MS = (1, 16, 80)
GROUP_SIZE = 128
HOPPER_SMS = 132  # H100 SXM and H200: sizes split-K in the --resources report
REL_TOL = {"bfloat16": 1e-2, "float16": 2e-3}  # relative Frobenius error vs fp32 reference

L2_BYTES = 64 << 20  # above an H100's (50 MB) and H200's L2: graph calls rotate over 2x this
MAX_COPIES = 16

# (kernel, M, metric, threshold) from issue 64 (H100 or H200, CUDA-graph times): metric
# "speedup" (x bf16, at least), "vs_w4a16" (time over W4A16's on the same shape and M, at
# most; every M). M None: every M.
TARGETS = (
    ("w4a16", 1, "speedup", 2.5),
    ("w4a16", 16, "speedup", 1.5),
    ("w4a16", 2048, "speedup", 0.8),
    ("fp8-w8a16", 1, "speedup", 1.8),
    ("fp8-w8a8", 2048, "speedup", 1.3),
    ("nvfp4-a16", None, "vs_w4a16", 1.2),
    ("mxfp4-a16", None, "vs_w4a16", 1.2),
)


@dataclass
class Row:
    kernel: str
    K: int
    N: int
    M: int
    rel_err: float | None
    correct: bool | None
    ms: float | None = None
    tbps: float | None = None
    tflops: float | None = None
    speedup: float | None = None
    config: str = ""
    ms_graph: float | None = None
    speedup_graph: float | None = None


@dataclass
class Case:
    """One kernel on one shape: how to run it (`run(x, config=None, copy=0)`: copy picks
    one of `copies` identical weight copies), its reference, the bytes its weights occupy,
    its launch config for x (tuned or default), its tuning family and the launch plan
    (`plan(x, config)` -> Launch) the tuner compiles."""

    kernel: str
    run: Callable[..., Any]
    reference: Callable[[Any], Any] | None
    weight_bytes: int
    config: Callable[[Any], Any]
    copies: int = 1
    family: str | None = None
    plan: Callable[..., Any] | None = None
    group: int = 0  # the tuned-table key's group size


# Sweep: variations of the default config tried per (shape, M) with --sweep.
SWEEP = {
    "gemv": (
        {"BLOCK_N": 32},
        {"BLOCK_N": 128},
        {"BLOCK_N": 256},
        {"SPLIT_K": 2.0},
        {"SPLIT_K": 0.5},
        {"num_warps": 8},
        {"num_warps": 2},
    ),
    "splitk": (
        {"BLOCK_N": 32},
        {"BLOCK_N": 128},
        {"BLOCK_K": 128},
        {"SPLIT_K": 2.0},
        {"SPLIT_K": 0.5},
        {"num_stages": 4},
        {"num_warps": 8},
    ),
    "tiled": ({"BLOCK_M": 64}, {"BLOCK_N": 256}, {"BLOCK_K": 32}, {"num_stages": 4}, {"num_warps": 4}, {"GROUP_M": 16}),
}


def sweep_configs(default: Any) -> list[Any]:
    """The default config and its variations (SPLIT_K deltas are factors)."""
    from dataclasses import replace

    path = getattr(default, "path", "tiled" if default.SPLIT_K == 1 else "splitk")
    out = [default]
    for delta in SWEEP[path]:
        change = {k: max(1, int(default.SPLIT_K * v)) if k == "SPLIT_K" else v for k, v in delta.items()}
        cfg = replace(default, **change)
        if cfg not in out:
            out.append(cfg)
    return out


def copies_for(weight_bytes: int, device: str) -> int:
    """Weight copies a CUDA-graph timing rotates over: together more than twice the L2."""
    if device != "cuda":
        return 1
    return max(2, min(MAX_COPIES, -(-2 * L2_BYTES // weight_bytes)))


def make_cases(K: int, N: int, device: Any, dtype: Any) -> list[Case]:
    import torch

    from infer_tool.kernels import fp4 as fp4_mod
    from infer_tool.kernels import fp8 as fp8_mod
    from infer_tool.kernels import w4a16 as w4_mod
    from infer_tool.kernels.backend import sm_count
    from infer_tool.kernels.fp4 import fp4_matmul, fp4_reference
    from infer_tool.kernels.fp4_layout import GROUP_SIZE as FP4_GROUP
    from infer_tool.kernels.fp8 import FP8_MAX, fp8_matmul, fp8_reference
    from infer_tool.kernels.layout import pack_int4_k
    from infer_tool.kernels.tuning import lookup
    from infer_tool.kernels.w4_layout import prepare

    g = torch.Generator(device="cpu").manual_seed(K * 31 + N)
    w = torch.randn(N, K, generator=g) * 0.02  # (N, K) an nn.Linear weight
    w_bf16 = w.t().contiguous().to(device=device, dtype=dtype)  # (K, N) for x @ W

    G = -(-K // GROUP_SIZE)
    q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.uint8)
    qweight = pack_int4_k(q).to(device)  # (K/8, N) int32, canonical
    scales = (torch.rand(G, N, generator=g) * 0.002 + 0.001).to(device=device, dtype=dtype)
    w4 = prepare(qweight, scales, None, None, GROUP_SIZE, K)  # planar-128, once (as Int4Linear)

    w_scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).float()  # (N, 1) per channel
    w_fp8 = (w / w_scale).to(torch.float8_e4m3fn).to(device)
    w_scale = w_scale.to(device)
    sms = sm_count(torch.device(device))
    dev = torch.device(device)

    def copies(tensors: tuple[Any, ...], nbytes: int) -> list[tuple[Any, ...]]:
        n = copies_for(nbytes, device)
        return [tensors] + [tuple(None if t is None else t.clone() for t in tensors) for _ in range(n - 1)]

    bf16_bytes = K * N * x_bytes(dtype)
    bf16_copies = copies((w_bf16,), bf16_bytes)
    int4_bytes = K * N // 2 + G * N * x_bytes(dtype)
    int4_copies = copies((w4.qweight, w4.scales), int4_bytes)
    fp8_bytes = K * N + N * 4
    fp8_copies = copies((w_fp8, w_scale), fp8_bytes)

    def int4(x, config=None, copy=0):
        qw, sc = int4_copies[copy]
        return w4_mod.w4a16_prepared(x, replace_w4(w4, qw, sc), config=config)

    def int4_ref(x):
        return w4_mod.w4a16_reference(x, qweight, scales, None, None, GROUP_SIZE)

    def int4_config(x):
        M = x.shape[0]
        return w4_mod.tuned_config(dev, M, N, K, GROUP_SIZE) or w4_mod.choose_config(M, N, K, sms)

    def fp4_config(x, fmt):
        found = lookup(dev, fmt, x.shape[0], N, K, FP4_GROUP[fmt])
        return fp4_mod.Fp4Config(**found) if found else fp4_mod.choose_config(x.shape[0], N, K, sms)

    def fp8_config(x, mode):
        found = lookup(dev, f"fp8-{mode}", x.shape[0], N, K, 0)
        return fp8_mod.Fp8Config(**found) if found else fp8_mod.choose_config(x.shape[0], N, K, sms)

    cases = [
        Case(
            "bf16" if dtype == torch.bfloat16 else "fp16",
            lambda x, config=None, copy=0: x @ bf16_copies[copy][0],
            None,
            bf16_bytes,
            lambda x: None,
            copies=len(bf16_copies),
        ),
        Case(
            "w4a16",
            int4,
            int4_ref,
            int4_bytes,
            int4_config,
            copies=len(int4_copies),
            family="w4a16",
            plan=lambda x, config: w4_mod.plan_prepared(x, w4, config=config)[0],
            group=GROUP_SIZE,
        ),
    ]
    for mode in ("w8a8", "w8a16"):
        cases.append(
            Case(
                f"fp8-{mode}",
                lambda x, config=None, copy=0, mode=mode: fp8_matmul(
                    x, fp8_copies[copy][0], fp8_copies[copy][1], mode, config=config
                ),
                lambda x, mode=mode: fp8_reference(x, w_fp8, w_scale, mode),
                fp8_bytes,
                lambda x, mode=mode: fp8_config(x, mode),
                copies=len(fp8_copies),
                family=f"fp8-{mode}",
                plan=lambda x, config, mode=mode: fp8_mod.plan(x, w_fp8, w_scale, mode, None, None, config=config)[0],
            )
        )
    for fmt, fp4_ops in fp4_weights(K, N, g, device).items():
        if fp4_ops[0] is None:
            continue
        nbytes = K * N // 2 + N * (K // FP4_GROUP[fmt]) + (4 if fp4_ops[2] is not None else 0)
        fp4_copies = copies(fp4_ops, nbytes)
        cases.append(
            Case(
                f"{fmt}-a16",
                lambda x, config=None, copy=0, c=fp4_copies: fp4_matmul(x, *c[copy], config=config),
                lambda x, a=fp4_ops: fp4_reference(x, *a),
                nbytes,
                lambda x, fmt=fmt: fp4_config(x, fmt),
                copies=len(fp4_copies),
                family=fmt,
                plan=lambda x, config, a=fp4_ops: fp4_mod.plan(x, *a, config=config)[0],
                group=FP4_GROUP[fmt],
            )
        )
    return cases


def replace_w4(w4: Any, qweight: Any, scales: Any) -> Any:
    """The prepared W4A16 weight with another copy of its tensors."""
    from dataclasses import replace

    return replace(w4, qweight=qweight, scales=scales)


def fp4_weights(K: int, N: int, g: Any, device: Any) -> dict[str, tuple[Any, Any, Any]]:
    """Random NVFP4 and MXFP4 checkpoint operands `(w_packed, w_scale, global_scale)` of an
    (N, K) weight with entries up to about 0.1; `(None, None, None)` where K is not a
    multiple of the format's group."""
    import torch

    from infer_tool.kernels.fp4_layout import GROUP_SIZE as FP4_GROUP
    from infer_tool.kernels.fp4_layout import pack_fp4

    out = {}
    for fmt, group in FP4_GROUP.items():
        if K % group:
            out[fmt] = (None, None, None)
            continue
        packed = pack_fp4(torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)).to(device)
        if fmt == "nvfp4":
            scale = (torch.rand(N, K // group, generator=g) * 447 + 1).to(torch.float8_e4m3fn).to(device)
            out[fmt] = (packed, scale, torch.tensor([448.0 * 6 / 0.1], device=device))
        else:
            scale = torch.randint(119, 123, (N, K // group), generator=g, dtype=torch.uint8).to(device)
            out[fmt] = (packed, scale, None)
    return out


def x_bytes(dtype: Any) -> int:
    return dtype.itemsize


def _short(cfg: Any) -> str:
    if cfg is None:
        return "torch.matmul"
    d = asdict(cfg)
    path = d.pop("path", "")
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")
    return (path + " " if path else "") + "x".join(str(d[k]) for k in keys) + f" w{d['num_warps']}"


def rel_error(out: Any, ref: Any) -> float:
    diff = (out.float() - ref.float()).norm()
    return float(diff / ref.float().norm())


def time_ms(fn: Callable[[], Any], device: str, cudagraph: bool = False) -> float:
    """Median milliseconds of fn: do_bench on CUDA (L2 flushed before every run; the time
    includes the Python launch overhead whenever it exceeds the GPU's), or with `cudagraph`
    do_bench_cudagraph (fn replayed from a CUDA graph: GPU time only, L2 not flushed). On
    the CPU dry run a plain wall-clock median, only to exercise the script's arithmetic."""
    if device == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if cudagraph:
            return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    import statistics
    import time

    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def time_graph_ms(call: Callable[[int], Any], copies: int, device: str, calls: int = 96) -> float | None:
    """GPU milliseconds per call replayed from one CUDA graph of about `calls` calls that
    rotate over the `copies` weight copies (`call(copy)`), median of 10 replays: how vLLM
    serves decode, with each call's weights coming from HBM. None off CUDA."""
    if device != "cuda":
        return None
    import statistics

    import torch

    for c in range(copies):  # compile, and allocate what persists (split-K tile counters)
        call(c)
    torch.cuda.synchronize()
    n = copies * max(1, -(-calls // copies))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            call(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    del graph
    return statistics.median(times)


def run(
    shapes: tuple[tuple[int, int], ...],
    ms: tuple[int, ...],
    *,
    device: str,
    sweep: bool,
    log: Callable[[str], None],
    cudagraph: bool = False,
    graph: bool = True,
    on_row: Callable[[list[Row]], Any] | None = None,
) -> list[Row]:
    """Correctness and timings of every case; `graph`: CUDA-graph times beside the plain
    ones (`cudagraph`: the plain column from do_bench_cudagraph instead, the old mode)."""
    import torch

    from infer_tool.kernels.fp4_layout import GROUP_SIZE as FP4_GROUP

    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # interpreter: no bf16
    tol = REL_TOL[str(dtype).removeprefix("torch.")]
    rows: list[Row] = []
    for K, N in shapes:
        cases = make_cases(K, N, device, dtype)
        for fmt, group in FP4_GROUP.items():
            if K % group:
                log(f"{fmt}-a16: skipped on K={K}, not a multiple of its group of {group}")
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=dtype)
            base_ms = base_graph = None
            for case in cases:
                default = case.config(x)
                configs = [default] + (sweep_configs(default)[1:] if sweep and default is not None else [])
                ref = case.reference(x) if case.reference is not None else None
                best: Row | None = None
                for i, cfg in enumerate(configs):
                    err = ok = None
                    if ref is not None:
                        try:
                            err = rel_error(case.run(x, config=cfg), ref)
                        except ValueError as e:  # a sweep variation the kernel does not take
                            if i == 0:
                                raise
                            log(f"{case.kernel}: skipped {_short(cfg)}: {e}")
                            continue
                        ok = err < tol
                    row = Row(case.kernel if i == 0 else case.kernel + "*", K, N, M, err, ok, config=_short(cfg))
                    row.ms = time_ms(lambda case=case, x=x, cfg=cfg: case.run(x, config=cfg), device, cudagraph)
                    if graph:
                        row.ms_graph = time_graph_ms(
                            lambda c, case=case, x=x, cfg=cfg: case.run(x, config=cfg, copy=c), case.copies, device
                        )
                    t = row.ms_graph if row.ms_graph is not None else row.ms
                    moved = case.weight_bytes + M * K * x.element_size() + M * N * x.element_size()
                    row.tbps = moved / (t * 1e-3) / 1e12
                    row.tflops = 2.0 * M * N * K / (t * 1e-3) / 1e12
                    if base_ms is None:
                        base_ms, base_graph = row.ms, row.ms_graph
                    row.speedup = base_ms / row.ms
                    if row.ms_graph is not None and base_graph is not None:
                        row.speedup_graph = base_graph / row.ms_graph
                    if i == 0:
                        rows.append(row)
                        log(_line(row))
                        if on_row is not None:
                            on_row(rows)
                    elif ok is not False and (best is None or row.ms < best.ms):
                        best = row
                if best is not None and best.ms < rows[-1].ms:
                    rows.append(best)  # "kernel*": the fastest correct sweep config
                    log(_line(best))
    return rows


def tune(
    shapes: tuple[tuple[int, int], ...],
    ms: tuple[int, ...],
    *,
    directory: Path,
    max_configs: int,
    budget_s: float,
    log: Callable[[str], None],
    device: str = "cuda",
) -> dict[str, Any]:
    """Sweep the config space of each tunable kernel per (shape, M bucket); keep the
    fastest correct config whose compiled kernel spills no registers (CUDA-graph time);
    write the winners to the GPU's table as each key finishes. Returns a summary. On the
    CPU (the dry run: interpreter, wall-clock times that mean nothing) the table is named
    "cpu-dry-run"."""
    import time
    from dataclasses import asdict

    import torch

    from infer_tool.kernels import tuning

    t_end = time.monotonic() + budget_s
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu-dry-run"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    tol = REL_TOL[str(dtype).removeprefix("torch.")]
    done: dict[str, Any] = {}
    for M in ms:  # decode first: the table's most valuable rows
        for K, N in shapes:
            x = torch.randn(M, K, device=device, dtype=dtype)
            for case in make_cases(K, N, device, dtype):
                if case.family is None:
                    continue
                if time.monotonic() > t_end:
                    log(f"tune: out of time; {len(done)} keys written")
                    return {"gpu": gpu, "keys": len(done), "complete": False, "winners": done}
                default = case.config(x)
                base = asdict(default)
                path = base.get("path")  # FP8's dot path is "splitk" or "tiled" by M here
                if path not in ("gemv", "splitk", "tiled"):
                    path = "tiled" if M > 64 else "splitk"
                space = tuning.config_space(case.family, path, M, base)
                space = space[:1] + space[1:][:: max(1, -(-(len(space) - 1) // max(1, max_configs - 1)))]
                ref = case.reference(x)
                best, best_ms, tried = None, None, 0
                for cand in space:
                    if time.monotonic() > t_end:
                        break
                    cfg = type(default)(**cand)
                    try:
                        kernel = case.plan(x, cfg).run()
                        spills = getattr(kernel, "n_spills", 0)
                        err = rel_error(case.run(x, config=cfg), ref)
                        if spills or not err < tol:
                            continue
                        call = lambda c, cfg=cfg, case=case, x=x: case.run(x, config=cfg, copy=c)  # noqa: E731
                        t = time_graph_ms(call, case.copies, device, 48)
                        if t is None:  # CPU dry run
                            t = time_ms(lambda call=call: call(0), device)
                    except Exception as e:  # out of shared memory, bad layout: not a candidate
                        log(f"tune: {case.family} {cand}: {type(e).__name__}")
                        continue
                    tried += 1
                    if best_ms is None or t < best_ms:
                        best, best_ms = cand, t
                if best is None:
                    continue
                key = tuning.key(case.family, M, N, K, case.group)
                done[key] = {"config": best, "ms": best_ms, "tried": tried}
                tuning.write_table(gpu, {key: best}, directory)
                log(f"tune: {key}: {best_ms * 1e3:.1f} us over {tried} configs: {best}")
    return {"gpu": gpu, "keys": len(done), "complete": True, "winners": done}


def check_targets(rows: list[Row]) -> list[dict[str, Any]]:
    """Every target on every shape, on CUDA-graph times where measured: value, threshold, met."""
    results = []
    by_key = {(r.kernel, r.K, r.N, r.M): r for r in rows}

    def t(r: Row) -> float:
        return r.ms_graph if r.ms_graph is not None else r.ms

    for kernel, M, metric, threshold in TARGETS:
        for r in rows:
            if r.kernel != kernel or (M is not None and r.M != M) or r.ms is None:
                continue
            if metric == "vs_w4a16":
                ref = by_key.get(("w4a16", r.K, r.N, r.M))
                if ref is None:
                    continue
                value, met = t(r) / t(ref), t(r) / t(ref) <= threshold
            else:
                value = r.speedup_graph if r.speedup_graph is not None else r.speedup
                met = value >= threshold
            results.append(
                {
                    "kernel": r.kernel,
                    "K": r.K,
                    "N": r.N,
                    "M": r.M,
                    "metric": metric,
                    "value": round(value, 3),
                    "threshold": threshold,
                    "met": met,
                }
            )
    return results


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _line(r: Row) -> str:
    return (
        f"{r.kernel:<10} K={r.K:<6} N={r.N:<6} M={r.M:<5} err={_fmt(r.rel_err, '.1e')} "
        f"ms={_fmt(r.ms, '.4f')} graph ms={_fmt(r.ms_graph, '.4f')} TB/s={_fmt(r.tbps, '.2f')} "
        f"TFLOP/s={_fmt(r.tflops, '.1f')} x{_fmt(r.speedup, '.2f')} graph x{_fmt(r.speedup_graph, '.2f')} "
        f"[{r.config}]"
    )


def markdown(meta: dict[str, Any], rows: list[Row], targets: list[dict[str, Any]]) -> str:
    lines = [
        f"### Kernel benchmark — {meta['device']} — {meta['date']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, activations {meta['dtype']}, "
        f"INT4 group size {GROUP_SIZE} (symmetric), FP8 per-channel weight scales, "
        "NVFP4 (E4M3 scales per 16 + global) and MXFP4 (E8M0 per 32) weights-only; "
        + (
            "DRY RUN: CPU interpreter wall-clock, the timings mean nothing; "
            if meta["dry_run"]
            else "plain: median of `do_bench_cudagraph` (replayed from a CUDA graph: GPU time, L2 not flushed); "
            if meta.get("cudagraph")
            else "plain: median of `do_bench` with L2 flushed (includes Python launch overhead where it exceeds "
            "GPU time); graph: GPU time per call of a CUDA graph of calls rotating over weight copies larger than "
            "twice the L2 (median of 10 replays); "
        )
        + f"speedups vs `torch.matmul` ({meta['dtype']}) timed the same way; TB/s and TFLOP/s from the graph "
        "time where measured; `kernel*` rows: fastest correct config of `--sweep`.",
        "",
        "| kernel | K x N | M | rel. err | plain (ms) | graph (ms) | eff. TB/s | TFLOP/s | speedup plain | "
        "speedup graph | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = _fmt(r.rel_err, ".1e") + ("" if r.correct in (None, True) else " FAIL")
        lines.append(
            f"| {r.kernel} | {r.K}x{r.N} | {r.M} | {err} | {_fmt(r.ms, '.4f')} | {_fmt(r.ms_graph, '.4f')} | "
            f"{_fmt(r.tbps, '.2f')} | {_fmt(r.tflops, '.1f')} | {_fmt(r.speedup, '.2f')} | "
            f"{_fmt(r.speedup_graph, '.2f')} | {r.config} |"
        )
    if targets:
        lines += ["", "| target | K x N | value | threshold | met |", "|---|---|---|---|---|"]
        for t in targets:
            lines.append(
                f"| {t['kernel']} M={t['M']} {t['metric']} | {t['K']}x{t['N']} | "
                f"{t['value']} | {t['threshold']} | {'yes' if t['met'] else 'NO'} |"
            )
    return "\n".join(lines) + "\n"


def resources(shapes: tuple[tuple[int, int], ...], ms: tuple[int, ...], arch: int, log: Callable[[str], None]) -> str:
    """Markdown table of the default configs (as chosen on a 132-SM H100/H200) compiled
    for `arch` without a GPU: registers and stack (spills) per thread, from the cubin."""
    import torch

    from infer_tool.kernels import fp4, fp8, w4a16
    from infer_tool.kernels.backend import resource_usage
    from infer_tool.kernels.layout import pack_int4_k

    lines = ["| kernel | K x N | M | config | registers | stack (spills) |", "|---|---|---|---|---|---|"]
    for K, N in shapes:
        qweight = pack_int4_k(torch.zeros(K, N, dtype=torch.uint8))
        scales = torch.ones(-(-K // GROUP_SIZE), N, dtype=torch.bfloat16)
        w_fp8 = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
        w_scale = torch.ones(N, 1)
        for M in ms:
            x = torch.zeros(M, K, dtype=torch.bfloat16)  # CPU tensors: only dtypes matter
            w4_cfg = w4a16.choose_config(M, N, K, HOPPER_SMS, group_size=GROUP_SIZE)
            fp8_cfg = fp8.choose_config(M, N, K, HOPPER_SMS)
            plans = [("w4a16", w4a16.plan(x, qweight, scales, None, None, GROUP_SIZE, config=w4_cfg)[0])]
            plans += [
                (f"fp8-{mode}", fp8.plan(x, w_fp8, w_scale, mode, None, None, config=fp8_cfg)[0])
                for mode in ("w8a8", "w8a16")
            ]
            fp4_cfg = fp4.choose_config(M, N, K, HOPPER_SMS)
            plans += [
                (f"{fmt}-a16", fp4.plan(x, *ops, config=fp4_cfg)[0])
                for fmt, ops in fp4_weights(K, N, torch.Generator().manual_seed(0), "cpu").items()
                if ops[0] is not None
            ]
            for name, launch in plans:
                use = resource_usage(launch.compile_for(arch))
                m = launch.meta
                cfg = (
                    f"{m['BLOCK_M']}x{m['BLOCK_N']}x{m.get('BLOCK_K', 128)} split {m['SPLIT_K']} "
                    f"w{m['num_warps']} s{m['num_stages']}"
                )
                line = f"| {name} | {K}x{N} | {M} | {cfg} | {use['registers']} | {use['stack']} |"
                lines.append(line)
                log(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes, correctness only")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for kernels_<device>.md/.json")
    p.add_argument("--shapes", default=None, help="comma list of KxN, e.g. 4096x4096,4096x14336")
    p.add_argument("--ms", default=None, help="comma list of M, e.g. 1,16,64,2048")
    p.add_argument(
        "--resources",
        type=int,
        metavar="ARCH",
        default=None,
        help="no GPU needed: compile the default configs for compute capability "
        "ARCH (90 = H100/H200) and print registers and spills per thread",
    )
    p.add_argument(
        "--sweep", action="store_true", help="also time variations of each default config; 'kernel*' rows show the best"
    )
    p.add_argument(
        "--cudagraph",
        action="store_true",
        help="time the plain column with do_bench_cudagraph (GPU time without Python launch overhead; L2 not flushed)",
    )
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph column (rotating weight copies)")
    p.add_argument(
        "--tune", type=Path, metavar="DIR", default=None, help="sweep the config spaces, write DIR/<gpu>.json"
    )
    p.add_argument("--tune-max", type=int, default=12, help="--tune: configs tried per key, default first")
    p.add_argument("--tune-budget-s", type=float, default=150.0, help="--tune: stop starting keys after this")
    args = p.parse_args(argv)

    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read by our launchers at call time
    import torch
    import triton

    if args.resources is not None:
        shapes = (
            tuple(tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(","))
            if args.shapes
            else GPU_SHAPES
        )
        ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else GPU_MS
        print(resources(shapes, ms, args.resources, log=lambda s: None))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    shapes = DRY_SHAPES if args.dry_run else GPU_SHAPES
    if args.shapes:
        shapes = tuple(tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(","))
    ms = DRY_MS if args.dry_run else GPU_MS
    if args.ms:
        ms = tuple(int(m) for m in args.ms.split(","))

    if args.cudagraph and args.dry_run:
        p.error("--cudagraph needs a GPU; --dry-run runs on the CPU")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.tune is not None:
        summary = tune(
            shapes,
            ms,
            directory=args.tune,
            max_configs=args.tune_max,
            budget_s=args.tune_budget_s,
            log=log,
            device=device,
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps({k: v for k, v in summary.items() if k != "winners"}))
        return 0
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU interpreter ({platform.machine()})"
    meta = {
        "device": name,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": "bfloat16" if device == "cuda" else "float16",
        "dry_run": args.dry_run,
        "cudagraph": args.cudagraph,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    slug = "dry_run" if args.dry_run else name.lower().replace(" ", "_") + ("_cudagraph" if args.cudagraph else "")

    def write(rows: list[Row]) -> str:
        """The tables so far (rewritten after every row: a run stopped by a timeout keeps them)."""
        targets = [] if args.dry_run else check_targets(rows)  # interpreter timings mean nothing
        md = markdown(meta, rows, targets)
        doc = {"meta": meta, "rows": [asdict(r) for r in rows], "targets": targets}
        for suffix, text in ((".md", md), (".json", json.dumps(doc, indent=2))):
            path = args.out / f"kernels_{slug}{suffix}"
            tmp = path.with_suffix(suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(path)
        return md

    rows = run(
        shapes,
        ms,
        device=device,
        sweep=args.sweep,
        log=log,
        cudagraph=args.cudagraph,
        graph=not args.no_graph and device == "cuda",
        on_row=write,
    )
    md = write(rows)
    print(md)
    bad = [r for r in rows if r.correct is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
