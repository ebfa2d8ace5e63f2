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
        gpu = {
            "gpu_mem_bytes": round(gib * GiB) if gib else LARGE_GPU,
            "gpu_compute_capability": case.get("compute_capability", ""),
        }
    weights = case.get("weights_gib")
    return PlanRequest(
        case["model"],
        **gpu,
        tp=e.get("tp", 1),
        pp=e.get("pp", 1),
        mem_util=e.get("mem_util"),
        weights_per_gpu_bytes=round(weights * GiB) if weights is not None else None,
        kv_dtype=e.get("kv_dtype", "bf16"),
        block_size=e.get("block_size", 16),
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
        "| case | role | GPU (CUDA total) | vLLM | runner | stage | requested | weights | activation peak "
        "| non-torch | CUDA graphs | predicted available | logged | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
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
                f"| {case['id']} | {case['role']} | {_total_label(case, r)} | {case['vllm_version']} "
                f"| {'V2' if r.fit.model_runner_v2() else 'V1'} | {stage} | {_gib(p.requested)} | {weights} "
                f"| {_gib(p.activation.bytes)} ({p.activation.where}) "
                f"| {p.non_torch_bytes / 2**20:.0f} MiB | {graphs} | {_gib(p.available)} | {lg:.2f} "
                f"| {_err(p.available / GiB, lg)} ({p.available / GiB - lg:+.2f} GiB) |"
            )
            miss = p.available / GiB - lg
            errors.append((case["role"], case["vllm_version"], miss / abs(lg), miss))
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
    needed = []
    for case in cases:
        lg = case["logged"]
        if lg.get("kv_needed_gib"):
            needed.append(case)
        if not lg.get("kv_tokens"):
            continue
        r = plan(_request(case, total_known=False))
        mml = case["engine"]["max_model_len"]
        budgets = [round(g * GiB) for g in lg["available_kv_gib"]]
        cap = r.fit.vllm_at(budgets, mml)
        kinds = _kinds(r)
        kv = " / ".join(f"{g:.2f}" for g in lg["available_kv_gib"])
        conc = lg.get("max_concurrency")
        conc_text = f"{conc:.2f}x | {_err(cap.max_concurrency_log, conc)}" if conc else "not logged | n/a"
        print(
            f"| {case['id']} | {kinds} | {case['vllm_version']} | {kv} | {mml:,} | {cap.kv_cache_tokens:,} "
            f"| {lg['kv_tokens']:,} | {_err(cap.kv_cache_tokens, lg['kv_tokens'])} "
            f"| {cap.max_concurrency_log:.2f}x | {conc_text} |"
        )
        # concurrency = tokens / max_model_len: its error is the tokens' error where vLLM logs only tokens
        tokens_err = (cap.kv_cache_tokens - lg["kv_tokens"]) / lg["kv_tokens"]
        ref = (cap.max_concurrency_log - conc) / conc if conc else tokens_err
        errors.append((case["id"], ref))
    print()
    if needed:
        print("### KV cache one request needs at max_model_len (vLLM's 'KV cache is needed' check)\n")
        print("| case | family | vLLM | max model len | predicted GiB | logged GiB | error |")
        print("|---|---|---|---|---|---|---|")
        for case in needed:
            r = plan(_request(case, total_known=False))
            mml = case["engine"]["max_model_len"]
            cap = r.fit.vllm_at([r.fit.bytes_per_block()] * len(r.fit.stages), mml)
            pred = cap.blocks_per_request * r.fit.bytes_per_block() / GiB
            lg = case["logged"]["kv_needed_gib"]
            print(
                f"| {case['id']} | {_kinds(r)} | {case['vllm_version']} | {mml:,} | {pred:.2f} | {lg:.2f} "
                f"| {_err(pred, lg)} |"
            )
            errors.append((case["id"], (pred - lg) / lg))
        print()
    return errors


def graph_table(cases: list[dict]) -> list[tuple[str, float]]:
    print("### CUDA-graph estimate at the logged graph counts\n")
    print(
        "| case | role | vLLM | TP | graphs (PIECEWISE + FULL, largest) | predicted GiB | logged estimate GiB "
        "| error | logged capture GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    errors = []
    for case in cases:
        g = case["logged"].get("cudagraphs")
        if not g or "piecewise" not in g:
            continue
        shape = resolve_model(case["model"]).shape
        tp = case["engine"].get("tp", 1)
        est = vllm_memory.graph_estimate(shape, range(shape.num_layers), tp, g["piecewise"], g["full"], g["largest"])
        pred = est.estimate_bytes / GiB
        actual = f"{g['actual_gib']:.2f}" if g.get("actual_gib") is not None else "not logged"
        print(
            f"| {case['id']} | {case['role']} | {case['vllm_version'] or 'unknown'} | {tp} "
            f"| {g['piecewise']} + {g['full']}, {g['largest']} "
            f"| {pred:.2f} | {g['estimate_gib']:.2f} | {_err(pred, g['estimate_gib'])} | {actual} |"
        )
        errors.append((case["role"], (pred - g["estimate_gib"]) / g["estimate_gib"]))
    print()
    print('### Modelled CUDA-graph estimate against the capture vLLM logs ("Graph capturing finished ... took")\n')
    print(
        "| case | vLLM | model runner | graphs modelled (PIECEWISE + FULL, largest) | predicted estimate GiB "
        "| logged capture GiB |"
    )
    print("|---|---|---|---|---|---|")
    for case in cases:
        g = case["logged"].get("cudagraphs")
        if not g or g.get("actual_gib") is None or "piecewise" in g or not _new(case["vllm_version"]):
            continue  # before 0.21 the graphs are captured outside the budget (and with other size lists)
        r = plan(_request(case))
        p = r.profiles[-1].cudagraphs
        runner = "V2" if r.fit.model_runner_v2() else "V1"
        print(
            f"| {case['id']} | {case['vllm_version']} | {runner} | {p.piecewise} + {p.full}, {p.largest} "
            f"| {p.estimate_bytes / GiB:.2f} | {g['actual_gib']:.2f} |"
        )
    print()
    return errors


def _kinds(r: Report) -> str:
    return ", ".join(
        f"{n} {k}" for k in ("full_attention", "sliding_attention", "mla", "linear_state") if (n := r.shape.count(k))
    )


def _worst(values: list[float]) -> str:
    return f"{max(abs(v) for v in values) * 100:.1f}% (n={len(values)})" if values else "none"


def _new(version: str | None) -> bool:
    return version is not None and tuple(int(x) for x in version.split(".")[:2]) >= (0, 21)


def _band(rows: list[tuple], goal: float) -> str:
    if not rows:
        return "none"
    worst_rel = max(abs(r[2]) for r in rows)
    worst_abs = max(abs(r[3]) for r in rows)
    within = sum(abs(r[2]) <= goal for r in rows)
    return f"worst {worst_rel * 100:.1f}% / {worst_abs:.2f} GiB, {within} of {len(rows)} within {goal:.0%}"


def main() -> None:
    cases = json.loads(LOGS.read_text())["cases"]
    avail = available_table(cases)
    conc = concurrency_table(cases)
    graphs = graph_table(cases)
    held = [a for a in avail if a[0] != "calibration"]
    print("### Summary\n")
    print(f"- available KV, vLLM >= 0.21, held out: {_band([a for a in held if _new(a[1])], 0.05)}")
    print(
        f"- available KV, vLLM >= 0.21, calibration logs: "
        f"{_band([a for a in avail if a[0] == 'calibration' and _new(a[1])], 0.05)}"
    )
    print(f"- available KV, vLLM < 0.21, held out: {_band([a for a in held if not _new(a[1])], 0.10)}")
    print(f"- max concurrency (or KV tokens) at the logged KV size: {_worst([e for _, e in conc])}")
    print(f"- CUDA-graph estimate, held out: {_worst([e for role, e in graphs if role != 'calibration'])}")
    print(f"- CUDA-graph estimate, calibration logs: {_worst([e for role, e in graphs if role == 'calibration'])}")


if __name__ == "__main__":
    main()
