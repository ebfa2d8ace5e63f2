"""`infer-tool spec-profile` end to end on tiny saved models with a word-level tokenizer."""

import json
import math
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from infer_tool.cli.app import app

V = 64
runner = CliRunner()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_tiny(directory: Path, seed: int, prefix: str = "w") -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[UNK]"] + [f"{prefix}{i}" for i in range(V - 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    LlamaForCausalLM(cfg).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    prompts = root / "prompts.txt"
    prompts.write_text("w1 w2 w3 w4 w1 w2 w3\n\nw9 w8 w7 w9 w8\nw5 w5 w6 w5 w5 w6 w5\n")
    empty = root / "empty.txt"
    empty.write_text("\n  \n")
    categories = root / "categories.jsonl"
    categories.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"text": "w1 w2 w3 w4 w1 w2 w3", "category": "code"},
                {"text": "w9 w8 w7 w9 w8", "category": "chat"},
                {"text": "w5 w5 w6 w5 w5 w6 w5", "category": "code"},
                {"text": "w3 w3 w4 w3"},
            ]
        )
        + "\n"
    )
    turns = root / "question.jsonl"  # Spec-Bench's layout
    turns.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"question_id": 1, "category": "writing", "turns": ["w1 w2 w3 w1 w2", "w4 w5"]},
                {"question_id": 2, "category": "math", "turns": ["w7 w8 w7 w8"]},
            ]
        )
        + "\n"
    )
    broken = root / "broken.jsonl"
    broken.write_text('{"text": "w1 w2"}\n{"text": \n')
    return {
        "target": save_tiny(root / "target", 0),
        "draft": save_tiny(root / "draft", 1),
        "alien": save_tiny(root / "alien", 1, prefix="x"),
        "prompts": prompts,
        "empty": empty,
        "categories": categories,
        "turns": turns,
        "broken": broken,
    }


def run(*args: str):
    return runner.invoke(app, ["spec-profile", "--device", "cpu", "--no-progress", *args])


def test_json_contract(files) -> None:
    res = run(
        "--target",
        str(files["target"]),
        "--draft",
        "truncated:1",
        "--draft",
        "ngram",
        "--draft",
        str(files["draft"]),
        "--prompts",
        str(files["prompts"]),
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "8",
        "--k",
        "1-2",
        "--json",
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["target"] == str(files["target"]) and report["basis"] == "measured"
    # v(0) is a ratio of two timings (about 1 on a quiet machine): only its sanity is a contract here
    v0 = report["verify_costs"]["0"]
    assert report["tokens_decoded"] == 3 * 7 and math.isfinite(v0) and v0 > 0
    assert [d["name"] for d in report["drafts"]] == ["truncated:1", "ngram:3", str(files["draft"])]
    for d in report["drafts"]:
        assert {"name", "alpha", "alpha_ci", "cost_ratio", "per_k", "best_k", "best_k_basis"} <= set(d)
        assert d["alpha_ci"][0] <= d["alpha"] <= d["alpha_ci"][1] and d["cost_source"] == "measured"
        assert [r["k"] for r in d["per_k"]] == [1, 2]
        for r in d["per_k"]:
            assert r["greedy_identical"] is True
            assert r["predicted_tokens"] == pytest.approx(r["measured_tokens"])  # T = 0
            assert r["error"] == pytest.approx(r["predicted_speedup"] / r["measured_speedup"] - 1)
            assert r["alpha_speedup"] == pytest.approx(r["alpha_tokens"] / (r["draft_cost"] + r["verify_cost"]))
            pred, meas = r["vllm_predicted"], r["vllm_measured"]
            assert len(pred["per_position"]) == len(meas["per_position"]) == r["k"]
            assert pred["mean_acceptance_length"] == pytest.approx(r["alpha_tokens"])
        best = max(d["per_k"], key=lambda r: (r["measured_speedup"], -r["k"]))
        assert d["best_k"] == best["k"] and d["best_k_basis"] == "measured"
        assert d["slower_than_plain"] == all(r["measured_speedup"] < 1 for r in d["per_k"])
    ranked = [r["measured_speedup"] for r in report["ranking"]]
    assert [r["rank"] for r in report["ranking"]] == [1, 2, 3] and ranked == sorted(ranked, reverse=True)
    assert report["settings"]["num_prompts"] == 3 and report["settings"]["clock"] == "wall"


def test_cost_ratio_override_and_table(files) -> None:
    res = run(
        "--target",
        str(files["target"]),
        "--draft",
        "truncated:2",
        "--prompts",
        str(files["prompts"]),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "6",
        "--k",
        "1,3",
        "--cost-ratio",
        "0.5",
        "--json",
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)["drafts"][0]
    assert d["cost_ratio"] == 0.5 and d["cost_source"] == "given"
    a = d["alpha"]
    for r in d["per_k"]:
        k = r["k"]
        assert r["draft_cost"] == pytest.approx(0.5 * k) and r["cost_ratio"] == pytest.approx(0.5)
        expected = sum(a**i for i in range(k + 1)) / (0.5 * k + r["verify_cost"])
        assert r["alpha_speedup"] == pytest.approx(expected)
    res = run(
        "--target",
        str(files["target"]),
        "--draft",
        "prompt-lookup:2",
        "--prompts",
        str(files["prompts"]),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "6",
        "--k",
        "2",
        "--threads",
        "1",
    )
    assert res.exit_code == 0, res.output
    for needle in (
        "prompt-lookup:2",
        "accepted drafted tokens per target pass",
        "vLLM's metrics",
        "mean acceptance length",
        "ranking (by measured speedup",
        "v(k)",
    ):
        assert needle in " ".join(res.stdout.split())


def test_no_loop_screening_ranks_by_prediction(files) -> None:
    res = run(
        "--target",
        str(files["target"]),
        "--draft",
        "truncated:1",
        "--draft",
        "ngram",
        "--prompts",
        str(files["prompts"]),
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "8",
        "--k",
        "1-3",
        "--no-loop",
        "--json",
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["basis"] == "predicted" and report["baseline_seconds"] is None
    for d in report["drafts"]:
        assert all(r["measured_speedup"] is None and r["error"] is None for r in d["per_k"])
        assert d["best_k"] == max(d["per_k"], key=lambda r: (r["predicted_speedup"], -r["k"]))["k"]
    assert all(r["basis"] == "predicted" for r in report["ranking"])
    ranked = [r["predicted_speedup"] for r in report["ranking"]]
    assert ranked == sorted(ranked, reverse=True)
    res = run(
        "--target",
        str(files["target"]),
        "--draft",
        "truncated:1",
        "--prompts",
        str(files["prompts"]),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "6",
        "--k",
        "1",
        "--no-loop",
    )
    assert res.exit_code == 0 and "--no-loop: nothing measured" in " ".join(res.stdout.split())


def test_per_category_and_identical_draft(files) -> None:
    res = run(
        "--target",
        str(files["target"]),
        "--draft",
        "truncated:2",
        "--draft",
        str(files["target"]),
        "--prompts",
        str(files["categories"]),
        "--num-prompts",
        "10",
        "--max-new-tokens",
        "6",
        "--k",
        "1,2",
        "--json",
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["settings"]["num_prompts"] == 4
    truncated, itself = report["drafts"]
    cats = truncated["per_category"]
    assert [c["category"] for c in cats] == ["(none)", "chat", "code"]
    assert [c["prompts"] for c in cats] == [1, 1, 2]
    # every continuation has the same length, so the overall alpha is the prompt-weighted mean
    assert sum(c["alpha"] * c["prompts"] for c in cats) / 4 == pytest.approx(truncated["alpha"])
    assert all(c["best_k"] in (1, 2) for c in cats)
    assert itself["alpha"] == 1.0
    assert any("has the target's own weights" in n for n in report["notes"])
    assert not any("own weights" in n and "truncated" in n for n in report["notes"])


def test_spec_bench_turns_field(files) -> None:
    res = run(
        "--target",
        str(files["target"]),
        "--draft",
        "ngram",
        "--prompts",
        str(files["turns"]),
        "--text-field",
        "turns",
        "--max-new-tokens",
        "4",
        "--k",
        "1",
        "--no-loop",
        "--json",
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["settings"]["num_prompts"] == 2
    assert [c["category"] for c in report["drafts"][0]["per_category"]] == ["math", "writing"]


def test_job_runs_as_a_library(files) -> None:
    """`jobs.spec_profile` without the CLI: options in, the report the CLI prints out."""
    from infer_tool.jobs.spec_profile import SpecProfileOptions, spec_profile

    opts = SpecProfileOptions(
        target=str(files["target"]),
        drafts=["truncated:1", "ngram"],
        prompts=str(files["prompts"]),
        num_prompts=2,
        max_new_tokens=6,
        k="1,2",
        loop=False,
        device="cpu",
    )
    tasks: list[str] = []
    report = spec_profile(opts, progress=lambda task, done, total, **info: tasks.append(task))
    assert [d.name for d in report.profile.drafts] == ["truncated:1", "ngram:3"]
    assert report.profile.basis == "predicted" and report.profile.tokens == 2 * 5
    assert report.settings["k"] == [1, 2] and report.settings["loop"] is False and report.settings["num_prompts"] == 2
    assert {"target decode", "acceptance", "cost timing"} <= set(tasks)
    res = run(
        "--target",
        str(files["target"]),
        "--draft",
        "truncated:1",
        "--draft",
        "ngram",
        "--prompts",
        str(files["prompts"]),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "6",
        "--k",
        "1,2",
        "--no-loop",
        "--json",
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [d["alpha"] for d in doc["drafts"]] == [d.acceptance.alpha for d in report.profile.drafts]  # T = 0
    assert doc["settings"] == report.settings and doc["notes"] == report.notes


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if the command gets as far as loading a model."""
    import infer_tool.evals.load_model as load_model

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(load_model, "load_for_eval", refuse)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--cost-ratio", "-1"], "--cost-ratio"),
        (["--temperature", "-0.5"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--prompt-len", "0"], "--prompt-len"),
        (["--max-new-tokens", "1"], "--max-new-tokens"),
        (["--max-new-tokens", "100000000"], "--max-new-tokens"),
        (["--seed", "-1"], "--seed"),
        (["--seed", str(10**30)], "--seed"),
        (["--threads", "0"], "--threads"),
        (["--clock", "cpu"], "--clock cpu needs"),
        (["--clock", "sundial"], "--clock"),
        (["--dtype", "float8"], "--dtype"),
        (["--device", "tpu"], "--device"),
        (["--k", "0"], "--k"),
        (["--k", "a-b"], "--k"),
        (["--k", "5-3"], "--k"),
        (["--k", "1-10**12"], "--k"),
        (["--k", "1-1000000000000"], "--k"),
        (["--k", "1," + "9" * 5000], "--k"),
        (["--draft", "ngrm"], "did you mean ngram"),
        (["--draft", "./no-such-draft"], "does not exist"),
        (["--draft", "truncated:x"], "truncated:N"),
        (["--draft", "ngram:0"], "ngram:N"),
        (["--target", "./no-such-model"], "does not exist"),
        (["--prompts", "no-such-file.txt"], "does not exist"),
        (["--prompts", "EMPTY"], "is empty"),
        (["--prompts", "BROKEN"], "is not a JSON record"),
        (["--prompts", "CATEGORIES", "--text-field", "body"], "no text field 'body'"),
        (["--gpu", "H10"], "--gpu 'H10' is not a GPU preset; did you mean: H200, A10G, H100-80GB"),
        (["--gpu", "T4"], "no speed model"),
        (["--gpu", "H100-80GB", "--concurrency", "0"], "--concurrency '0'"),
        (["--gpu", "H100-80GB", "--concurrency", "eight"], "--concurrency 'eight'"),
        (["--gpu", "H100-80GB", "--concurrency", "1..100000000:1"], "--concurrency"),
        (["--gpu", "H100-80GB", "--mfu", "1.5"], "--mfu 1.5"),
        (["--concurrency", "8"], "--concurrency: used only by the projection; give --gpu"),
        (["--mfu", "0.4"], "give --gpu"),
        (["--batch-sizes", "1,2", "--no-loop"], "--batch-sizes with --engine ours runs our loop batched"),
        (["--draft", "suffix:min_token_prob=2"], "min_token_prob='2' out of range"),
    ],
)
def test_bad_input_refused_before_loading(files, no_model_loads, args, needle) -> None:
    """(NaN, inf and non-ASCII numbers are refused while the flags are parsed:
    tests/test_spec_hostile.py, through the real entry point.)"""
    names = {"EMPTY": "empty", "BROKEN": "broken", "CATEGORIES": "categories"}
    args = [str(files[names[a]]) if a in names else a for a in args]
    base = {"--target": str(files["target"]), "--draft": "ngram", "--prompts": str(files["prompts"])}
    for flag in base:
        if flag not in args:
            args = [flag, base[flag], *args]
    t0 = time.perf_counter()
    res = run("--max-new-tokens", "4", *args) if "--max-new-tokens" not in args else run(*args)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert "Traceback" not in res.output and res.stdout == ""
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize(
    "draft,needle",
    [
        ("alien", "does not share the target's vocabulary"),
        ("truncated:3", "truncated:N"),
    ],
)
def test_bad_draft_for_this_target_exits_2(files, draft, needle) -> None:
    res = run(
        "--target",
        str(files["target"]),
        "--draft",
        str(files.get(draft, draft)),
        "--prompts",
        str(files["prompts"]),
        "--max-new-tokens",
        "4",
    )
    assert res.exit_code == 2, res.output
    assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.output


def test_projection_and_kv_budget_reads_the_report(files, tmp_path) -> None:
    """--gpu adds a projection per concurrency (the roofline's costs with the measured
    acceptance); kv-budget --spec-profile reads the real report, with and without one."""
    common = [
        "--target",
        str(files["target"]),
        "--draft",
        "truncated:1",
        "--draft",
        "ngram",
        "--draft",
        str(files["draft"]),
        "--prompts",
        str(files["prompts"]),
        "--num-prompts",
        "2",
        "--max-new-tokens",
        "6",
        "--no-loop",
    ]
    res = run(*common, "--k", "1,2", "--gpu", "h100-80gb", "--concurrency", "1,64", "--mfu", "0.4", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    proj = report["projection"]
    inputs = proj["inputs"]
    assert inputs["gpu"] == "H100-80GB" and inputs["concurrencies"] == [1, 64]
    assert inputs["efficiency"]["mfu"] == 0.4 and inputs["efficiency"]["hbm"] == 0.8  # Efficiency's default
    assert inputs["output_len"] == 6 and inputs["kv_dtype"] == "bf16"
    models = {m["name"]: m for m in inputs["models"]}
    assert models[str(files["target"])]["role"] == "target" and models[str(files["target"])]["layers"] == 3
    assert models["truncated:1"]["layers"] == 1 and models["truncated:1"]["shares_target_weights"]
    assert models["ngram:3"]["free"] and models[str(files["draft"])]["weights"] == "bf16"
    assert [t["concurrency"] for t in proj["target"]] == [1, 64]
    for d, profiled in zip(proj["drafts"], report["drafts"]):
        assert d["name"] == profiled["name"] and d["alpha"] == profiled["alpha"]
        for row in d["rows"]:
            for r in row["per_k"]:
                tokens = sum(d["alpha"] ** i for i in range(r["k"] + 1))
                assert r["alpha_speedup"] == pytest.approx(tokens / (r["draft_cost"] + r["verify_cost"]))
                assert (r["draft_cost"] == 0) == (d["name"] == "ngram:3")
            assert row["best_k"] == max(row["per_k"], key=lambda r: (r["predicted_speedup"], -r["k"]))["k"]
    with_gpu = tmp_path / "with_gpu.json"
    with_gpu.write_text(res.stdout)
    res = run(*common, "--k", "1,2", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["projection"] is None
    without = tmp_path / "without.json"
    without.write_text(res.stdout)

    def kv(*extra: str) -> dict:
        r = runner.invoke(app, ["kv-budget", "llama-3.1-8b", "--context", "8k", "--concurrency", "1", "--json", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    for path, source in ((with_gpu, "roofline projection on H100-80GB at concurrency 1"), (without, "measured on cpu")):
        doc = json.loads(path.read_text())
        top = next(d for d in doc["drafts"] if d["name"] == doc["ranking"][0]["name"])
        if doc["projection"]:
            proj_draft = next(d for d in doc["projection"]["drafts"] if d["name"] == top["name"])
            c = next(r for r in proj_draft["rows"][0]["per_k"] if r["k"] == top["best_k"])["cost_ratio"]
        else:
            c = top["cost_ratio"]
        got = kv("--spec-profile", str(path))
        note = next(n for n in got["notes"] if "--spec-profile" in n)
        assert f"draft {top['name']}" in note and source in note and f"k {top['best_k']}" in note
        same = kv("--spec", f"{top['alpha']!r},{top['best_k']},{c!r}")
        assert got["rows"][0]["speed"] == same["rows"][0]["speed"]

    res = run(*common, "--k", "1", "--gpu", "H100-80GB", "--concurrency", "1,100m")  # 100m: more than fits
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    for needle in (
        "PROJECTION to H100-80GB",
        "PROJECTED speedup",
        "conc 104857600",
        "inputs: NVIDIA H100 80GB HBM3",
        "HBM efficiency 0.8 and MFU 0.5",
        "truncated:1 bf16 (1 layer,",
        "the target's weights",
        "ngram:3 free",
        "assumes: one GPU",
        "* !",
        "!: does not fit",
        "ngram:3 at concurrency 104857600: target + draft need",
    ):
        assert needle in text, needle


def test_loop_table_by_batch_size(files) -> None:
    """--batch-sizes with our loop: the table measured by our loop batched, each sequence as
    alone at T=0, the best k per size the fastest measured (no speculation included)."""
    args = ["--target", str(files["target"]), "--draft", "truncated:1", "--draft", "ngram"]
    args += ["--prompts", str(files["prompts"]), "--num-prompts", "3", "--max-new-tokens", "6", "--k", "1,2"]
    res = run(*args, "--batch-sizes", "1,2", "--json")
    assert res.exit_code == 0, res.output
    t = json.loads(res.stdout)["loop_table"]
    assert t["batch_sizes"] == [1, 2] and t["ks"] == [1, 2]
    assert {(c["draft"], c["batch"], c["k"]) for c in t["cells"]} == {
        (d, b, k) for d in ("truncated:1", "ngram:3") for b in (1, 2) for k in (1, 2)
    }
    assert all(c["as_alone"] is True for c in t["cells"])
    for d, by_size in t["best_k"].items():
        for b, k in by_size.items():
            options = [(1.0, 0)] + [
                (c["speedup"], c["k"]) for c in t["cells"] if c["draft"] == d and c["batch"] == int(b)
            ]
            assert k == max(options)[1]
        assert t["schedule"][d][0][0] == 1 and t["schedule"][d][-1][1] == 2
    res = run(*args, "--batch-sizes", "2")
    assert res.exit_code == 0, res.output
    assert "measured by OUR LOOP batched" in res.stdout and "num_speculative_tokens_per_batch_size" in res.stdout


def test_threads_are_restored_after_the_run(files) -> None:
    """`--threads` holds for the profile only: an in-process caller (a notebook, this test run)
    keeps its own thread count afterwards."""
    torch.set_num_threads(2)
    try:
        res = run(
            "--target",
            str(files["target"]),
            "--draft",
            "ngram",
            "--prompts",
            str(files["prompts"]),
            "--num-prompts",
            "1",
            "--max-new-tokens",
            "4",
            "--k",
            "1",
            "--threads",
            "1",
        )
        assert res.exit_code == 0, res.output
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
