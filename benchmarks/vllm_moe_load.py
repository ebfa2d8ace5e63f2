"""Load quantized MoE checkpoints in vLLM and generate a few tokens (issue 14).

Runs under a Python that has vLLM installed (its pins differ from ours), so it imports
nothing of infer-tool:

    VLLM_PYTHON benchmarks/vllm_moe_load.py CKPT [CKPT ...]

Prints one JSON line per checkpoint: loaded or not, the error on one line when vLLM
refuses it, and the greedy continuation of a short prompt when it loads.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    import vllm
    from vllm import LLM, SamplingParams

    for path in sys.argv[1:]:
        rec = {"checkpoint": path, "vllm": vllm.__version__, "loaded": False}
        try:
            llm = LLM(model=path, dtype="bfloat16", max_model_len=256, max_num_seqs=1, enforce_eager=True, seed=0)
            rec["loaded"] = True
            out = llm.generate(["The state of the union is"], SamplingParams(max_tokens=8, temperature=0))
            rec["text"] = out[0].outputs[0].text
            del llm
        except Exception as exc:  # vLLM's refusal is the result being recorded
            rec["error"] = f"{type(exc).__name__}: " + " ".join(str(exc).split())
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
