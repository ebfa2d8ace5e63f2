"""One prepared run on a CUDA machine: the kernels' correctness on the GPU, their tuned
configs and speed, the demo's quantize and `eval ppl` on CUDA against the CPU reference, and
an 8B-shaped model through GPTQ and `eval ppl`.

Steps (each time-boxed, results written as each finishes; `--steps` picks them, in order):

- `env`: GPU, driver, CUDA, torch / triton / transformers versions, CPU.
- `correct`: every Triton kernel path on CUDA (W4A16 sym / asym / act-order at groups 32, 64,
  128 and per channel; FP8 W8A8 dynamic and static, W8A16, per tensor / channel / 128x128 block;
  NVFP4A16 and MXFP4A16) at M from 1 to 4096, bf16 / fp16 / fp32 activations, outputs poisoned
  with NaN before each launch, against a float64 product built here from the codes (not from
  our dequantizers). Tolerance, relative Frobenius error: fp32 2e-5, fp16 2e-3, bf16 1e-2.
  On CUDA also: an `Int4Linear` replayed from a captured CUDA graph and compiled with
  `torch.compile(fullgraph=True)` gives the eager result bit for bit.
- `tune`: `kernel_speed.py --tune`: each kernel's config space swept per shape and M bucket
  (CUDA-graph time, correct and spill-free configs only), winners written to
  `kernels/tuned/<gpu>.json` (copied into DIR/tuned/) as they come.
- `speed`: `kernel_speed.py` with that table: correctness, then plain and CUDA-graph timings
  (shapes 4096x14336, 14336x4096, 8192x28672; M = 1, 16, 2048; bf16; group 128).
- `demo`: the main job (bare `infer-tool quantize`) on CUDA; GPTQ, FP8 and NVFP4A16 RTN
  checkpoints of the demo model; `eval ppl` of each on CUDA (Triton) and on the CPU (torch
  reference) on the same windows: they must agree within 0.1% (fp32; the two differ only in
  float summation order).
- `large`: a Llama-3-8B-shaped model (32 decoder layers of 4096 / 14336, 32 / 8 heads; the
  demo's tokenizer and vocabulary) with random bf16 weights built on the device; `eval ppl`
  of it in bf16; `quantize --method gptq` (128 x 2048 calibration tokens) streamed on the GPU;
  `eval ppl` of the INT4 checkpoint in bf16: its tokens/s against the bf16 model's.

    python benchmarks/gpu_check.py --out DIR [--steps env,correct,speed] [--deadline-s 540]
    python benchmarks/gpu_check.py --dry-run --out DIR   # CPU rehearsal: interpreter, tiny shapes

Writes `summary.json` and each step's files into DIR. Exit 1 if any check failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REL_TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}
PPL_REL_TOL = 1e-3  # same checkpoint, CUDA (Triton) vs CPU (torch reference), fp32
MAIN_JOB_REL_TOL = 0.01  # main job's ppl made on CUDA vs the CPU record (README: 25.2954 / 25.2401)
MAIN_JOB_CPU_PPL = {"AMD EPYC (no AMX)": 25.2954, "Intel Xeon with AMX": 25.2401}
# -P: the working directory (the repository root on the device) is not put on sys.path, where
# its `kernels/` folder would shadow the PyPI package `kernels` that transformers imports.
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []
CLI = [sys.executable, *SAFE_PATH, "-c", "from infer_tool.cli.app import main; main()"]
STEPS = ("env", "correct", "tune", "speed", "demo", "large")
# Seconds each step may take at most (the deadline caps them too): the whole run fits the
# 9 minutes of one device call with `--deadline-s 540`.
CAPS = {"correct": 60.0, "tune": 110.0, "speed": 100.0, "demo": 120.0}


class Clock:
    """Seconds left before the deadline; every step's timeout is capped by it."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- env ---------------------------------------------------------------------------------------


def step_env(out: Path, device: str) -> dict[str, Any]:
    import torch
    import transformers
    import triton

    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name,
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 2),
        )
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run(
                [smi, "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            info["nvidia_smi"] = q.stdout.strip()
    (out / "env.json").write_text(json.dumps(info, indent=2))
    log(f"env: {info}")
    return {"ok": True, **info}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# --- correct -----------------------------------------------------------------------------------


def _rel(out: Any, ref: Any) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _e2m1_table(torch: Any, device: Any) -> Any:
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    return torch.tensor(mags + [-m for m in mags], dtype=torch.float64, device=device)


def correctness_cases(device: str, dry: bool) -> list[tuple[str, Any]]:
    """(name, thunk) pairs; a thunk runs one kernel call and returns (out, float64 reference).
    The name ends with the activations' dtype."""
    import torch

    from infer_tool.kernels.fp4 import fp4_matmul
    from infer_tool.kernels.fp8 import fp8_matmul
    from infer_tool.kernels.layout import pack_int4_k
    from infer_tool.kernels.w4a16 import w4a16_matmul

    dtypes = [torch.float16, torch.float32] if dry else [torch.bfloat16, torch.float16, torch.float32]
    if dry:
        plan = [((352, 200), (1, 5, 80), dtypes)]
    else:
        plan = [
            ((1056, 200), (1, 3, 5, 33, 64, 100), dtypes),
            ((4096, 4096), (1, 4, 16, 64, 65, 256, 4096), [torch.bfloat16, torch.float32]),
        ]
    cases: list[tuple[str, Any]] = []
    for (K, N), ms, dts in plan:
        g = torch.Generator(device="cpu").manual_seed(K + N)
        # W4A16: codes q (K, N), scales per (group, N), zeros, act-order permutation.
        q = torch.randint(0, 16, (K, N), generator=g, dtype=torch.uint8)
        qw = pack_int4_k(q).to(device)
        for group, asym, actorder in (
            (32, True, True),
            (32, False, False),
            (64, True, False),
            (128, False, False),
            (K, True, False),
        ):
            G = -(-K // group)
            s = torch.rand(G, N, generator=g, dtype=torch.float64) * 0.02 + 0.005
            z = torch.randint(0, 16, (G, N), generator=g, dtype=torch.uint8) if asym else None
            g_idx = (torch.arange(K) // group)[torch.randperm(K, generator=g)].to(torch.int32) if actorder else None
            groups = g_idx.long() if actorder else torch.arange(K) // group
            zf = z.double()[groups] if asym else torch.full((K, N), 8.0, dtype=torch.float64)
            W = ((q.double() - zf) * s[groups]).to(device)  # (K, N)
            tag = f"w4a16 {'asym' if asym else 'sym'}{' act-order' if actorder else ''} g{group}"
            for dt_ in dts:
                for M in ms:

                    def run(M=M, dt_=dt_, s=s, z=z, g_idx=g_idx, W=W, group=group, K=K, g=g, qw=qw):
                        x = torch.randn(M, K, generator=g).to(device=device, dtype=dt_)
                        out = w4a16_matmul(
                            x,
                            qw,
                            s.to(device=device, dtype=dt_),
                            None if z is None else z.to(device),
                            None if g_idx is None else g_idx.to(device),
                            group,
                        )
                        return out, x.double() @ W

                    cases.append((f"{tag} K{K} N{N} M{M} {str(dt_)[6:]}", run))
        # FP8: e4m3 weights (N, K), scales per tensor / channel / 128x128 block.
        w = torch.randn(N, K, generator=g) * 0.05
        for gran in ("tensor", "channel", "block"):
            if gran == "tensor":
                scale, block = (w.abs().amax() / 448).reshape(1), None
                s_full = scale.double().expand(N, K)
            elif gran == "channel":
                scale, block = w.abs().amax(dim=1, keepdim=True) / 448, None
                s_full = scale.double().expand(N, K)
            else:
                block = (128, 128)
                nb, kb = -(-N // 128), -(-K // 128)
                pad = torch.zeros(nb * 128, kb * 128)
                pad[:N, :K] = w.abs()
                scale = pad.unflatten(0, (nb, 128)).unflatten(2, (kb, 128)).amax(dim=(1, 3)) / 448
                s_full = scale.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
            scale = scale.float().clamp(min=1e-12)
            wq = (w / s_full.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
            Wd = (wq.double() * s_full).t().contiguous().to(device)  # (K, N)
            wq, scale = wq.to(device), scale.to(device)
            for mode, static in (("w8a8", False), ("w8a8", True), ("w8a16", False)):
                tag = f"fp8 {mode}{' static' if static else ''} per-{gran}"
                for dt_ in dts:
                    for M in ms:

                        def run(
                            M=M, dt_=dt_, mode=mode, static=static, wq=wq, scale=scale, block=block, Wd=Wd, K=K, g=g
                        ):
                            x = torch.randn(M, K, generator=g).to(device=device, dtype=dt_)
                            xf = x.float()
                            a_in = (xf.abs().amax() / 448).reshape(1) if static else None
                            out = fp8_matmul(x, wq, scale, mode, block, a_in)
                            if mode == "w8a16":
                                return out, x.double() @ Wd
                            a = (
                                a_in.expand(M, 1)
                                if static
                                else (xf.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1 / (448 * 512))
                            )
                            xq = (xf / a).clamp(-448, 448).to(torch.float8_e4m3fn)
                            return out, (xq.double() * a.double()) @ Wd

                        cases.append((f"{tag} K{K} N{N} M{M} {str(dt_)[6:]}", run))
        # FP4: codes (N, K), two per byte (code 2j low nibble); NVFP4 e4m3 per 16 + global,
        # MXFP4 e8m0 per 32.
        codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(device)
        vals = _e2m1_table(torch, "cpu")[codes.long()]
        for fmt, group in (("nvfp4", 16), ("mxfp4", 32)):
            if K % group:
                continue
            if fmt == "nvfp4":
                sc = (torch.rand(N, K // group, generator=g) * 447 + 1).to(torch.float8_e4m3fn)
                gs = torch.tensor([448.0 * 6 / 0.1])
                eff = sc.double() / gs.double()
                ops = (sc.to(device), gs.to(device))
            else:
                sc = torch.randint(119, 124, (N, K // group), generator=g, dtype=torch.uint8)
                eff = torch.pow(2.0, sc.double() - 127)
                ops = (sc.to(device), None)
            Wd = (vals * eff.repeat_interleave(group, dim=1)).t().contiguous().to(device)  # (K, N)
            for dt_ in dts:
                for M in ms:

                    def run(M=M, dt_=dt_, ops=ops, Wd=Wd, K=K, g=g, packed=packed):
                        x = torch.randn(M, K, generator=g).to(device=device, dtype=dt_)
                        return fp4_matmul(x, packed, *ops), x.double() @ Wd

                    cases.append((f"{fmt}-a16 K{K} N{N} M{M} {str(dt_)[6:]}", run))
    cases += module_cases(device, dry)

    def order(case: tuple[str, Any]) -> tuple[int, int]:
        """Shape, then M: every family is checked at small M before any at large M, so a
        time-boxed step that stops early has still covered every kernel."""
        name = case[0]
        shape = 0 if " K" not in name or name.split(" K")[1].startswith(str(plan[0][0][0])) else 1
        m = int(name.split(" M")[1].split(" ")[0]) if " M" in name else 0
        return shape, m

    return sorted(cases, key=order)


def module_cases(device: str, dry: bool) -> list[tuple[str, Any]]:
    """`Int4Linear` as it is served: replayed from a CUDA graph (CUDA only) and compiled with
    `torch.compile(fullgraph=True)`, each against the same layer's eager output, bit for bit
    (names end "exact": the step requires a relative error of 0)."""
    import torch

    from infer_tool.kernels.quant_linear import Int4Linear

    K, N = (256, 72) if dry else (4096, 4096)
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scale = torch.rand(N, K // 128, generator=g) * 0.02 + 0.005
    dt_ = torch.float16 if dry else torch.bfloat16
    layer = Int4Linear.from_unpacked(q, scale.to(dt_), None, None, 128).to(device)
    cases: list[tuple[str, Any]] = []
    for M in (1, 16):
        x = torch.randn(M, K, generator=g).to(device=device, dtype=dt_)

        def compiled(x=x):
            torch._dynamo.reset()
            eager = layer(x)
            # the CPU rehearsal traces with aot_eager (inductor's C++ build takes a minute there)
            out = torch.compile(layer, fullgraph=True, backend="aot_eager" if dry else "inductor")(x)
            return out, eager.double()

        cases.append((f"int4linear torch.compile K{K} N{N} M{M} exact", compiled))
        if device == "cuda":

            def replay(x=x):
                eager = layer(x)
                static_x = x.clone()
                layer(static_x)  # warm-up outside capture (compile, split-K counters)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = layer(static_x)
                graph.replay()
                torch.cuda.synchronize()
                return out.clone(), eager.double()

            cases.append((f"int4linear cuda-graph replay K{K} N{N} M{M} exact", replay))
    return cases


def step_correct(out: Path, device: str, dry: bool, clock: Clock, cap: float, only: str | None) -> dict[str, Any]:
    import torch

    from infer_tool.kernels import backend

    def poisoned(shape: Any, dtype: Any, dev: Any) -> Any:
        return torch.full(shape, float("nan"), dtype=dtype, device=dev)

    real_empty, backend.empty_output = backend.empty_output, poisoned  # unwritten outputs fail the check
    try:
        rows, failed, t0 = [], [], time.monotonic()
        cases = [c for c in correctness_cases(device, dry) if only is None or all(w in c[0] for w in only.split("&"))]
        for name, run in cases:
            if clock.left() < 5 or time.monotonic() - t0 > cap:
                log(f"correct: out of time after {len(rows)} of {len(cases)} cases")
                break
            try:
                res, ref = run()
                err = _rel(res, ref) if torch.isfinite(res).all() else float("inf")
            except Exception as e:  # one broken case is a failed case, not a lost step
                log(f"correct: {name}: {type(e).__name__}: {e}")
                err = float("inf")
            dtype = name.rsplit(" ", 1)[1]
            tol = 0.0 if dtype == "exact" else REL_TOL[dtype]
            ok = err == 0.0 if dtype == "exact" else err < tol
            rows.append({"case": name, "rel_err": err, "tol": tol, "ok": ok})
            if not ok:
                failed.append(name)
                log(f"correct: FAIL {name}: rel err {err:.3e} (tolerance {tol})")
    finally:
        backend.empty_output = real_empty
    seconds = time.monotonic() - t0
    worst: dict[str, float] = {}
    for r in rows:
        fam = r["case"].split(" K")[0] + " " + r["case"].rsplit(" ", 1)[1]
        worst[fam] = max(worst.get(fam, 0.0), r["rel_err"])
    md = ["| kernel, variant | activations | cases | worst rel. err | tolerance |", "|---|---|---|---|---|"]
    for fam, err in worst.items():
        kind, dtype = fam.rsplit(" ", 1)
        n = sum(1 for r in rows if r["case"].startswith(kind + " K") and r["case"].endswith(dtype))
        tol = "bitwise" if dtype == "exact" else f"{REL_TOL[dtype]:.0e}"
        md.append(f"| {kind} | {dtype} | {n} | {err:.2e} | {tol} |")
    (out / "correct.md").write_text("\n".join(md) + "\n")
    (out / "correct.json").write_text(json.dumps({"rows": rows, "seconds": seconds}, indent=1))
    log(f"correct: {len(rows) - len(failed)} of {len(rows)} cases within tolerance ({seconds:.0f} s)")
    return {
        "ok": not failed and len(rows) == len(cases),
        "cases": len(rows),
        "of": len(cases),
        "failed": failed,
        "seconds": round(seconds, 1),
    }


# --- speed -------------------------------------------------------------------------------------


def step_tune(out: Path, dry: bool, clock: Clock, cap: float) -> dict[str, Any]:
    """`kernel_speed.py --tune` into the repository's table (the speed and demo steps then
    run with it); the table is copied into OUT/tuned/. The dry run tunes the tiny shapes
    on the interpreter into OUT/tuned/ only."""
    from infer_tool.kernels import tuning

    table_dir = out / "tuned" if dry else tuning.TUNED_DIR
    budget = max(5.0, min(cap, clock.left()) - 20)  # leave the child time to write and exit
    cmd = [sys.executable, str(Path(__file__).with_name("kernel_speed.py")), "--out", str(out)]
    cmd += ["--tune", str(table_dir), "--tune-budget-s", str(round(budget))]
    cmd += ["--dry-run", "--shapes", "160x72", "--ms", "1,16", "--tune-max", "3"] if dry else []
    r = _run(cmd, min(cap, clock.left()), out / "tune.log")
    if not dry:
        (out / "tuned").mkdir(exist_ok=True)
        for f in table_dir.glob("*.json"):
            shutil.copy(f, out / "tuned" / f.name)
    doc = r.get("json") or {}
    return {"ok": r["rc"] == 0 and doc.get("keys", 0) > 0, "table_dir": str(table_dir), **r}


def step_speed(out: Path, dry: bool, clock: Clock, cap: float, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).with_name("kernel_speed.py")), "--out", str(out), *extra]
    cmd += ["--dry-run", "--shapes", "160x72"] if dry else []
    r = _run(cmd, min(cap, clock.left()), out / "speed.log")
    return {"ok": r["rc"] == 0, **r}


# --- demo --------------------------------------------------------------------------------------


def _run(cmd: list[str], timeout: float, log_path: Path | None = None) -> dict[str, Any]:
    """Run cmd with a timeout; stdout kept (JSON), stderr appended to log_path."""
    if timeout < 5:
        log(f"skipped (no time left): {' '.join(cmd[len(CLI) :] if cmd[: len(CLI)] == CLI else cmd)}")
        return {"rc": None, "skipped": "deadline"}
    t0 = time.monotonic()
    log("run: " + " ".join(cmd[len(CLI) :] if cmd[: len(CLI)] == CLI else cmd[1:]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the dry run's, not theirs
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        if log_path:
            with log_path.open("a") as f:
                f.write(err)
        log(f"  timed out after {timeout:.0f} s")
        return {"rc": 124, "seconds": round(time.monotonic() - t0, 1), "timed_out": True}
    if log_path:
        with log_path.open("a") as f:
            f.write(p.stderr)
    res: dict[str, Any] = {"rc": p.returncode, "seconds": round(time.monotonic() - t0, 1)}
    try:
        res["json"] = json.loads(p.stdout)
    except json.JSONDecodeError:
        res["stdout_tail"] = p.stdout[-2000:]
    if p.returncode:
        res["stderr_tail"] = p.stderr[-1500:]
        log(f"  rc={p.returncode}: {p.stderr[-400:]}")
    else:
        log(f"  done in {res['seconds']} s")
    return res


def _ppl(res: dict[str, Any]) -> float | None:
    doc = res.get("json") or {}
    for key in ("ppl", "perplexity"):
        if isinstance(doc.get(key), (int, float)):
            return float(doc[key])
    return None


def step_demo(out: Path, work: Path, device: str, dry: bool, clock: Clock) -> dict[str, Any]:
    """Quantize the demo on `device`, then `eval ppl` each checkpoint on `device` and on the CPU."""
    dlog = out / "demo.log"
    calib = ["--num-samples", "4", "--seq-len", "128"] if dry else ["--num-samples", "32"]
    eval_tokens = "2048" if dry else "16384"
    res: dict[str, Any] = {"runs": {}, "ppl": {}}
    main_out = work / "main-awq"
    main_cmd = ["quantize", "--device", device, "--out", str(main_out), "--json"]
    if dry:  # the CPU rehearsal only checks the script: a tiny version of the main job
        main_cmd += ["--num-samples", "4", "--seq-len", "128", "--eval-tokens", "2048"]
    runs = {"main job (AWQ g64, bare quantize)": (main_cmd, main_out)}
    for name, flags in (
        ("GPTQ W4 g64 sym", ["--method", "gptq", "--group-size", "64", "--sym"]),
        ("NVFP4A16 RTN", ["--fp4", "nvfp4", "--method", "rtn"]),
        ("FP8 W8A8 dynamic", ["--method", "fp8"]),
    ):
        ckpt = work / name.split()[0].lower()
        runs[name] = (
            ["quantize", "smollm2-135m", *flags, *calib, "--device", device, "--out", str(ckpt), "--json"],
            ckpt,
        )
    ok = True
    for name, (cmd, ckpt) in runs.items():
        shutil.rmtree(ckpt, ignore_errors=True)
        r = _run(CLI + cmd, min(240 * (5 if dry else 1), clock.left()), dlog)
        res["runs"][name] = r
        if r.get("rc") != 0:
            ok = False
            continue
        row: dict[str, Any] = {}
        for dev in (device, "cpu"):
            e = _run(
                CLI
                + ["eval", "ppl", str(ckpt), "--device", dev, "--max-tokens", eval_tokens, "--no-progress", "--json"],
                min(180 * (5 if dry else 1), clock.left()),
                dlog,
            )
            doc = e.get("json") or {}
            row[dev] = {
                "ppl": _ppl(e),
                "seconds": e.get("seconds"),
                "rc": e.get("rc"),
                "backend": doc.get("backend"),
                "tokens_per_second": doc.get("tokens_per_second"),
            }
        a, b = row[device]["ppl"], row["cpu"]["ppl"]
        if a is not None and b is not None:
            row["rel_diff"] = abs(a - b) / b
            row["ok"] = row["rel_diff"] <= PPL_REL_TOL
            ok &= row["ok"]
        else:
            ok = False
        res["ppl"][name] = row
        log(f"demo: {name}: ppl {device} {a} vs cpu {b}")
    main = res["runs"]["main job (AWQ g64, bare quantize)"].get("json") or {}
    res["main_job_report"] = {k: main.get(k) for k in ("eval", "seconds", "memory", "layer_error_mean") if k in main}
    after = (main.get("eval") or {}).get("ppl_after")
    if not dry:  # the CPU records are for the full main job; the dry run's is a tiny one
        near = {cpu: abs(after - v) / v for cpu, v in MAIN_JOB_CPU_PPL.items()} if after else {}
        res["main_job_vs_cpu_record"] = {"ppl_after": after, "rel_diff": near}
        ok &= bool(near) and min(near.values()) <= MAIN_JOB_REL_TOL
    res["ok"] = ok
    (out / "demo.json").write_text(json.dumps(res, indent=1))
    return res


# --- large -------------------------------------------------------------------------------------


def step_large(
    out: Path, work: Path, device: str, dry: bool, clock: Clock, layers: int, tokenizer: Path | None
) -> dict[str, Any]:
    """A Llama-3-8B-shaped model (random bf16 weights, `layers` decoder layers, the demo's
    tokenizer and vocabulary: from `tokenizer` or the demo step's checkpoint) built on
    `device`; `eval ppl` of it in bf16; GPTQ (128 x 2048 calibration tokens) streamed on
    `device`; `eval ppl` of the INT4 checkpoint. Results are written after each part."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    demo_dirs = [work / d for d in ("main-awq", "gptq", "nvfp4a16", "fp8")]
    found = [d for d in demo_dirs if (d / "tokenizer.json").exists()]
    tok_src = tokenizer or (found[0] if found else demo_dirs[0])
    if not (tok_src / "tokenizer.json").exists():
        return {"ok": False, "skipped": f"no tokenizer.json in {tok_src} (run the demo step first, or --tokenizer)"}
    model_dir = work / "llama8b-shape"
    shutil.rmtree(model_dir, ignore_errors=True)
    dims = (
        dict(hidden_size=256, intermediate_size=896, num_attention_heads=4, num_key_value_heads=2)
        if dry
        else dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    )
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        vocab_size=49152,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **dims,
    )
    res: dict[str, Any] = {"layers": layers, "dims": dims}

    def save() -> None:
        (out / "large.json").write_text(json.dumps(res, indent=1, default=str))

    t0 = time.monotonic()
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of 8B parameters
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(model_dir)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    for f in tok_src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, model_dir / f.name)
    res["build_seconds"] = round(time.monotonic() - t0, 1)
    save()
    log(f"large: built and saved in {res['build_seconds']} s")
    tokens = "2048" if dry else "8192"
    evals = {}

    def ppl(name: str, path: Path, timeout: float) -> None:
        e = _run(
            CLI
            + ["eval", "ppl", str(path), "--device", device, "--dtype", "bfloat16" if not dry else "float32"]
            + ["--max-tokens", tokens, "--no-progress", "--json"],
            timeout,
            out / "large.log",
        )
        doc = e.get("json") or {}
        evals[name] = {k: doc.get(k) for k in ("ppl", "tokens_per_second", "backend", "tokens")}
        evals[name].update(rc=e.get("rc"), seconds=e.get("seconds"))
        res["eval"] = evals
        save()

    ppl("bf16", model_dir, min(90, clock.left() - 10))
    ckpt = work / "llama8b-shape-gptq"
    shutil.rmtree(ckpt, ignore_errors=True)
    calib = ["--num-samples", "4", "--seq-len", "128"] if dry else ["--num-samples", "128", "--seq-len", "2048"]
    r = _run(
        CLI
        + ["quantize", str(model_dir), "--method", "gptq", *calib, "--device", device, "--out", str(ckpt), "--json"],
        clock.left() - (60 if not dry else 5),  # the INT4 eval's share
        out / "large.log",
    )
    res["gptq"] = r
    save()
    if r.get("rc") == 0:
        ppl("int4", ckpt, clock.left() - 5)
    bf16_tps = (evals.get("bf16") or {}).get("tokens_per_second")
    int4_tps = (evals.get("int4") or {}).get("tokens_per_second")
    if bf16_tps and int4_tps:
        res["int4_over_bf16_tokens_per_second"] = round(int4_tps / bf16_tps, 3)
    res["ok"] = r.get("rc") == 0 and all(v.get("rc") == 0 for v in evals.values()) and len(evals) == 2
    save()
    return res


# --- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=None, help="checkpoints and models (default: OUT/../gpu_work)")
    p.add_argument("--steps", default=",".join(STEPS))
    p.add_argument("--deadline-s", type=float, default=540.0, help="stop starting work after this many seconds")
    p.add_argument("--correct-cap", type=float, default=CAPS["correct"], help="seconds the correct step may take")
    p.add_argument("--tune-cap", type=float, default=CAPS["tune"], help="seconds the tune step may take")
    p.add_argument("--large-layers", type=int, default=32)
    p.add_argument("--tokenizer", type=Path, default=None, help="large: folder with the demo's tokenizer.json")
    p.add_argument("--correct-only", default=None, help="correct: only cases whose name holds every '&'-joined part")
    p.add_argument("--speed-args", default="", help="speed: extra kernel_speed.py arguments, e.g. '--cudagraph'")
    p.add_argument("--dry-run", action="store_true", help="CPU rehearsal: interpreter, tiny shapes and runs")
    args = p.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        p.error(f"unknown step {bad[0]!r}; accepted: {', '.join(STEPS)}")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --dry-run to rehearse on the CPU", file=sys.stderr)
        return 2
    clock = Clock(args.deadline_s)
    if args.dry_run:  # the CPU is slower than the GPU by far: the rehearsal's caps are 5x
        for k in CAPS:
            CAPS[k] *= 5
        args.correct_cap, args.tune_cap = args.correct_cap * 5, args.tune_cap * 5
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out.resolve().parent / "gpu_work"
    work.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for step in steps:
        t0 = time.monotonic()
        log(f"== {step} ({clock.left():.0f} s left)")
        try:
            if step == "env":
                r = step_env(args.out, device)
            elif step == "correct":
                r = step_correct(args.out, device, args.dry_run, clock, cap=args.correct_cap, only=args.correct_only)
            elif step == "tune":
                r = step_tune(args.out, args.dry_run, clock, cap=args.tune_cap)
            elif step == "speed":
                r = step_speed(args.out, args.dry_run, clock, cap=CAPS["speed"], extra=args.speed_args.split())
            elif step == "demo":
                r = step_demo(args.out, work, device, args.dry_run, Clock(min(CAPS["demo"], clock.left())))
            else:
                layers = min(args.large_layers, 2) if args.dry_run else args.large_layers
                r = step_large(args.out, work, device, args.dry_run, clock, layers, args.tokenizer)
        except Exception as e:  # one broken step must not lose the others' results
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            log(f"{step}: {r['error']}")
        r["step_seconds"] = round(time.monotonic() - t0, 1)
        summary[step] = r
        summary_path.write_text(json.dumps(summary, indent=1, default=str))
    ok = all(summary[s].get("ok") for s in steps)
    failed = [s for s in steps if not summary[s].get("ok")]
    log("summary: " + ("all checks passed" if ok else "FAILED: " + ", ".join(failed)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
