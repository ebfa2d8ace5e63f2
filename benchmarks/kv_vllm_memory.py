"""kv-budget's model of vLLM's start-up memory against vLLM's own start-up logs.

Reads the log facts in benchmarks/kv_vllm_logs.json (collected from public issues and
pages, each with its source) and prints three markdown tables:

1. the KV memory vLLM makes available ("Available KV cache memory"), predicted from the
   model, GPU, vLLM version and engine arguments the log ran with, term by term;
2. the KV cache size in tokens and the maximum concurrency at the KV memory the log
   reports (the block accounting alone, as `--kv-cache-memory` gives it);
3. the CUDA-graph estimate for the graph counts a log reports.

Nothing is fitted here: the predictions come from sizing/vllm_memory.py; the rows whose
log set one of its constants say so (role "calibration") and are summarised apart.

    python benchmarks/kv_vllm_memory.py
"""

from __future__ import annotations

import json
from pathlib import Path

from infer_tool.jobs.kv_budget import PlanRequest, Report, plan
from infer_tool.sizing import vllm_memory
from infer_tool.sizing.resolve import resolve_model

GiB = 2**30
LOGS = Path(__file__).with_name("kv_vllm_logs.json")
LARGE_GPU = 4096 * GiB  # for the accounting-only rows: room for any weights


def _request(case: dict, *, total_known: bool = True) -> PlanRequest:
    e = case["engine"]
    gpu: dict = {"gpu": case["gpu"]} if case.get("gpu") else {}
    if not gpu:
        gib = case.get("gpu_memory_gib") if total_known else None
        gpu = {"gpu_mem_bytes": round(gib * GiB) if gib else LARGE_GPU}
    weights = case.get("weights_gib")
    return PlanRequest(
        case["model"],
        **gpu,
        tp=e.get("tp", 1),
        pp=e.get("pp", 1),
        mem_util=e.get("mem_util"),
        weights_per_gpu_bytes=round(weights * GiB) if weights is not None else None,
        kv_dtype=e.get("kv_dtype", "bf16"),
        contexts=(e["max_model_len"],),
        concurrencies=(1,),
        vllm_version=case["vllm_version"] or "0.32.0",
        max_num_batched_tokens=e.get("max_num_batched_tokens"),
        max_num_seqs=e.get("max_num_seqs"),
        enforce_eager=e.get("enforce_eager", False),
    )


def _gib(b: float) -> str:
    return f"{b / GiB:.2f}"


def _err(pred: float, logged: float) -> str:
    if logged == 0:
        return "n/a"
    return f"{(pred - logged) / abs(logged) * 100:+.1f}%"


def _total_label(case: dict, r: Report) -> str:
    return f"{case.get('gpu_label') or r.gpu.name} ({_gib(r.gpu.total_bytes)} GiB)"


def available_table(cases: list[dict]) -> list[tuple[str, str, float]]:
    print("### Available KV cache memory per GPU (the default path: vLLM's profile, modelled)\n")
    print(
        "| case | role | GPU (CUDA total) | vLLM | stage | requested | weights | activation peak | non-torch "
        "| CUDA graphs | predicted available | logged | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for case in cases:
        logged = case["logged"].get("available_kv_gib")
        if not logged or case["role"] == "kv-accounting":
            continue
        r = plan(_request(case))
        assert r.profiles is not None
        for i, (p, lg) in enumerate(zip(r.profiles, logged)):
            stage = f"{i + 1}/{len(r.profiles)}"
            weights = _gib(p.weights) + ("" if case.get("weights_gib") is not None else " (predicted)")
            graphs = _gib(p.cudagraphs.subtracted_bytes)
            if not p.cudagraphs.in_budget and p.cudagraphs.estimate_bytes:
                graphs += " (not subtracted)"
            print(
                f"| {case['id']} | {case['role']} | {_total_label(case, r)} | {case['vllm_version']} | {stage} "
                f"| {_gib(p.requested)} | {weights} | {_gib(p.activation.bytes)} ({p.activation.where}) "
                f"| {p.non_torch_bytes / 2**20:.0f} MiB | {graphs} | {_gib(p.available)} | {lg:.2f} "
                f"| {_err(p.available / GiB, lg)} ({p.available / GiB - lg:+.2f} GiB) |"
            )
            errors.append((case["role"], case["vllm_version"], (p.available / GiB - lg) / abs(lg)))
    print()
    return errors


def concurrency_table(cases: list[dict]) -> list[tuple[str, float]]:
    print("### KV cache size and maximum concurrency at the logged KV memory (block accounting)\n")
    print(
        "| case | family | vLLM | logged KV GiB / GPU | max model len | predicted tokens | logged tokens | error "
        "| predicted concurrency | logged | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for case in cases:
        lg = case["logged"]
        if not lg.get("kv_tokens"):
            continue
        r = plan(_request(case, total_known=False))
        mml = case["engine"]["max_model_len"]
        budgets = [round(g * GiB) for g in lg["available_kv_gib"]]
        cap = r.fit.vllm_at(budgets, mml)
        kinds = ", ".join(
            f"{n} {k}"
            for k in ("full_attention", "sliding_attention", "mla", "linear_state")
            if (n := r.shape.count(k))
        )
        kv = " / ".join(f"{g:.2f}" for g in lg["available_kv_gib"])
        print(
            f"| {case['id']} | {kinds} | {case['vllm_version']} | {kv} | {mml:,} | {cap.kv_cache_tokens:,} "
            f"| {lg['kv_tokens']:,} | {_err(cap.kv_cache_tokens, lg['kv_tokens'])} "
            f"| {cap.max_concurrency_log:.2f}x | {lg['max_concurrency']:.2f}x "
            f"| {_err(cap.max_concurrency_log, lg['max_concurrency'])} |"
        )
        errors.append(
            (
                case["id"],
                (cap.max_concurrency_log - lg["max_concurrency"]) / lg["max_concurrency"],
            )
        )
    print()
    return errors


def graph_table(cases: list[dict]) -> list[tuple[str, float]]:
    print("### CUDA-graph estimate at the logged graph counts\n")
    print("| case | role | TP | graphs (PIECEWISE + FULL, largest) | predicted GiB | logged GiB | error |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    for case in cases:
        g = case["logged"].get("cudagraphs")
        if not g:
            continue
        shape = resolve_model(case["model"]).shape
        tp = case["engine"].get("tp", 1)
        est = vllm_memory.graph_estimate(shape, range(shape.num_layers), tp, g["piecewise"], g["full"], g["largest"])
        pred = est.estimate_bytes / GiB
        print(
            f"| {case['id']} | {case['role']} | {tp} | {g['piecewise']} + {g['full']}, {g['largest']} "
            f"| {pred:.2f} | {g['estimate_gib']:.2f} | {_err(pred, g['estimate_gib'])} |"
        )
        errors.append((case["role"], (pred - g["estimate_gib"]) / g["estimate_gib"]))
    print()
    return errors


def _worst(values: list[float]) -> str:
    return f"{max(abs(v) for v in values) * 100:.1f}% (n={len(values)})" if values else "none"


def main() -> None:
    cases = json.loads(LOGS.read_text())["cases"]
    avail = available_table(cases)
    conc = concurrency_table(cases)
    graphs = graph_table(cases)

    def new(v: str) -> bool:
        return tuple(int(x) for x in v.split(".")[:2]) >= (0, 21)

    print("### Summary (largest absolute error)\n")
    print(
        f"- available KV, vLLM >= 0.21, held out: {_worst([e for role, v, e in avail if new(v) and role != 'calibration'])}"
    )
    print(
        f"- available KV, vLLM >= 0.21, calibration logs: {_worst([e for role, v, e in avail if new(v) and role == 'calibration'])}"
    )
    print(f"- available KV, vLLM < 0.21, held out: {_worst([e for role, v, e in avail if not new(v)])}")
    print(f"- max concurrency at the logged KV size: {_worst([e for _, e in conc])}")
    print(f"- CUDA-graph estimate, held out: {_worst([e for role, e in graphs if role != 'calibration'])}")
    print(f"- CUDA-graph estimate, calibration logs: {_worst([e for role, e in graphs if role == 'calibration'])}")


if __name__ == "__main__":
    main()
