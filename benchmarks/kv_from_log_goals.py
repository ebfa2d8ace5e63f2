"""`kv-budget --from-log` against issue 60's goals on every raw public start-up log in
tests/fixtures/kv_logs (sources in its SOURCES.json): prints the markdown table of
docs/kv-budget-memory.md ("Replaying a start-up log").

    python benchmarks/kv_from_log_goals.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from infer_tool.jobs.kv_budget import replay_log

LOGS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kv_logs"
CASES = Path(__file__).with_name("kv_vllm_logs.json")
GiB = 2**30
KEYS = {
    "tp": "tp",
    "pp": "pp",
    "max_model_len": "max_model_len",
    "gpu_memory_utilization": "mem_util",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_num_seqs": "max_num_seqs",
    "enforce_eager": "enforce_eager",
    "kv_cache_dtype": "kv_dtype",
}


def main() -> None:
    sources = json.loads((LOGS / "SOURCES.json").read_text())["logs"]
    cases = {c["id"]: c for c in json.loads(CASES.read_text())["cases"]}
    print(
        "| log | vLLM (replayed as) | family | settings read = recorded | max concurrency at logged KV "
        "(predicted / logged) | available KV GiB (predicted / logged) | goal | term named | time |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, meta in sources.items():
        text = (LOGS / name).read_text()
        t = time.perf_counter()
        rep = replay_log(text, model=meta["model"], vllm_version=meta.get("vllm_version"))
        ms = (time.perf_counter() - t) * 1e3
        engine = cases[meta["case"]]["engine"]
        read = [(k, v) for k, (v, where) in rep.settings.items() if k in KEYS and where.startswith("log")]
        same = sum(engine.get(KEYS[k]) in (None, v) for k, v in read)
        conc = f"{rep.concurrency_at_logged:.2f} / {rep.log.concurrency[1]:.2f}"
        conc += f" ({(rep.concurrency_at_logged / rep.log.concurrency[1] - 1) * 100:+.2f}%)"
        avail = next(x for x in rep.terms if x.term == "available KV")
        share = (avail.predicted - avail.logged) / avail.logged
        minor = int(rep.settings["vllm_version"][0].split(".")[1])
        if "available" in meta["checks"]:
            goal = 0.05 if minor >= 21 else 0.10
            verdict = f"±{goal:.0%}: {'met' if abs(share) <= goal else 'missed'}"
            av = f"{avail.predicted / GiB:.2f} / {avail.logged / GiB:.2f} ({share * 100:+.1f}%)"
        else:
            verdict, av = "total not logged (unified memory)", f"({avail.logged / GiB:.2f} logged)"
        carried = [line.split(":")[0][len("carried by ") :] for line in rep.explanation if "carried by" in line]
        named = carried[0] if carried else "-"
        if abs(share) <= 0.02:
            named = "within 2%"
        version = f"{rep.log.version or 'not logged'} ({rep.settings['vllm_version'][0]})"
        print(
            f"| {name} | {version} | {meta['family']} | {same} of {len(read)} | {conc} | {av} | {verdict} "
            f"| {named} | {ms:.0f} ms |"
        )


if __name__ == "__main__":
    main()
