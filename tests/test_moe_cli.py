"""`infer-tool quantize` on tiny MoE checkpoints of every family, end to end: the report's
expert token counts and fallbacks, every expert written under the original checkpoint's
tensor names in every format, read back by our loader (`eval ppl` equals the in-memory
ppl `--eval` reported), by transformers + compressed-tensors, and by `spec-profile`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TEXT  # noqa: E402
from tiny_moe import FAMILIES, save_moe  # noqa: E402

from infer_tool.cli.app import app  # noqa: E402

runner = CliRunner()
TINY = ("--num-samples", "8", "--seq-len", "32", "--no-progress", "--device", "cpu", "--json")
SUFFIXES = {  # per quantized linear, by format
    "compressed-tensors": {"weight_packed", "weight_scale", "weight_shape"},
    "awq": {"qweight", "qzeros", "scales"},
    "gptq": {"qweight", "qzeros", "scales", "g_idx"},
}
FP8_SUFFIXES = {"weight", "weight_scale"}  # both FP8 formats


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # noqa: ANN201
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:  # noqa: ANN001
    root = tmp_path_factory.mktemp("moe")
    (root / "corpus.txt").write_text(TEXT * 4)
    for family in FAMILIES:
        save_moe(root / family, family, starve=3 if family == "deepseek_v3" else None)
    return root


def quantize(root: Path, family: str, out: str, *args: str) -> dict:
    res = runner.invoke(
        app,
        [
            "quantize",
            str(root / family),
            "--calib",
            str(root / "corpus.txt"),
            "--out",
            str(root / out),
            "--eval",
            str(root / "corpus.txt"),
            "--eval-tokens",
            "256",
            "--eval-seq-len",
            "64",
            *TINY,
            *args,
        ],
    )
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def eval_ppl(path: Path, corpus: Path) -> float:
    res = runner.invoke(
        app,
        [
            "eval",
            "ppl",
            str(path),
            "--data",
            str(corpus),
            "--max-tokens",
            "256",
            "--seq-len",
            "64",
            "--json",
            "--no-progress",
            "--device",
            "cpu",
        ],
    )
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["ppl"]


def tensor_names(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def expert_names(source: Path) -> set[str]:
    """Every expert linear of the source checkpoint, by its original name (no `.weight`)."""
    return {k.removesuffix(".weight") for k in tensor_names(source) if re.search(r"\.experts\.\d+\.", k)}


CASES = [  # family, method, format, extra flags
    ("mixtral", "gptq", "compressed-tensors", ("--sym",)),
    ("qwen2_moe", "awq", "awq", ()),
    ("qwen3_moe", "rtn", "gptq", ("--sym",)),
    ("deepseek_v3", "gptq", "compressed-tensors", ("--sym", "--moe-calibration", "routed", "--moe-min-tokens", "4")),
    ("qwen3_moe", "fp8", "compressed-tensors", ()),
    ("mixtral", "fp8", "fp8", ("--fp8-granularity", "tensor", "--fp8-activations", "static")),
]


@pytest.mark.parametrize("family, method, fmt, extra", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_checkpoint_names_report_and_our_loader(root: Path, family: str, method: str, fmt: str, extra: tuple) -> None:
    out = f"{family}-{method}-{fmt}"
    group = ("--group-size", "32") if method != "fp8" else ()
    rep = quantize(root, family, out, "--method", method, "--format", fmt, *group, *extra)
    ckpt = root / out
    # every expert of the source, under its original name, with the format's tensors
    experts = expert_names(root / family)
    names = tensor_names(ckpt)
    suffixes = FP8_SUFFIXES if method == "fp8" else SUFFIXES[fmt]
    for e in experts:
        assert {f"{e}.{s}" for s in suffixes} <= names, e
    if method != "fp8":
        assert not any(k.endswith(".weight") and re.search(r"\.experts\.\d+\.", k) for k in names)
    # the routers are stored unquantized and named in the config's ignore list
    config = json.loads((ckpt / "config.json").read_text())
    qc = config["quantization_config"]
    ignore = qc.get("ignore") or qc.get("modules_to_not_convert") or qc.get("ignored_layers")
    routers = {k.removesuffix(".weight") for k in names if re.search(r"\.(gate|block_sparse_moe\.gate)\.weight$", k)}
    assert routers and routers <= set(ignore)
    # the report
    moe = rep["moe"]
    assert moe["expert_linears_quantized"] == len(experts) == sum(".experts." in n for n in map(str, experts))
    assert (
        moe["moe_layers"]
        == len(moe["tokens"])
        == len({e.split(".mlp")[0].split(".block_sparse_moe")[0] for e in experts})
    )
    for t in moe["tokens"]:
        assert sum(t["counts"]) == 2 * t["tokens"]
    if family == "deepseek_v3":  # expert 3 is never routed to
        assert moe["calibration"] == "routed"
        assert moe["fallback_experts"] == ["model.layers.1.mlp.experts.3", "model.layers.2.mlp.experts.3"]
        assert rep["fallback_count"] == 6 and all(t["counts"][3] == 0 for t in moe["tokens"])
    else:
        assert moe["calibration"] == "all" and rep["fallback_count"] == 0
    # our loader (what eval ppl runs) reproduces the ppl measured in memory after quantizing
    assert eval_ppl(ckpt, root / "corpus.txt") == pytest.approx(rep["eval"]["ppl_after"], rel=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_transformers_reads_int4_experts(root: Path, family: str) -> None:
    """transformers + compressed-tensors (its own MoE converter merges our per-expert
    tensors into the fused experts) gives the logits of our loader's model."""
    from transformers import AutoModelForCausalLM

    from infer_tool.evals.load_quantized import load_quantized

    out = f"{family}-ct-sym"
    quantize(root, family, out, "--method", "rtn", "--sym", "--group-size", "32")
    ids = torch.randint(0, 250, (2, 20), generator=torch.Generator().manual_seed(0))
    ours, _ = load_quantized(root / out)
    hf = AutoModelForCausalLM.from_pretrained(root / out, dtype=torch.float32)
    with torch.no_grad():
        a, b = ours(ids).logits, hf(ids).logits
    assert float((a - b).abs().max()) < 1e-4 * float(b.abs().max())


def test_transformers_reads_fp8_experts(root: Path) -> None:
    """FP8 experts: transformers folds each expert's scale into its fused weights; they equal
    our reader's dequantized e4m3 experts."""
    from transformers import AutoModelForCausalLM

    from infer_tool.packers.checkpoint import read_checkpoint

    quantize(root, "qwen2_moe", "qwen2-fp8", "--method", "fp8")
    _, layers, _ = read_checkpoint(root / "qwen2-fp8")
    hf = AutoModelForCausalLM.from_pretrained(root / "qwen2-fp8", dtype=torch.float32)
    experts = hf.model.layers[1].mlp.experts
    inter = experts.down_proj.shape[-1]
    p = "model.layers.1.mlp.experts"
    for j in (0, 3):
        assert torch.equal(experts.gate_up_proj[j, :inter], layers[f"{p}.{j}.gate_proj"].dequantize(torch.float32))
        assert torch.equal(experts.gate_up_proj[j, inter:], layers[f"{p}.{j}.up_proj"].dequantize(torch.float32))
        assert torch.equal(experts.down_proj[j], layers[f"{p}.{j}.down_proj"].dequantize(torch.float32))


def test_spec_profile_with_quantized_moe_draft(root: Path) -> None:
    quantize(root, "qwen3_moe", "qwen3-draft", "--method", "rtn", "--group-size", "32")
    (root / "prompts.txt").write_text("The state of the union\nWe the people, in order to form\n")
    res = runner.invoke(
        app,
        [
            "spec-profile",
            "--target",
            str(root / "qwen3_moe"),
            "--draft",
            str(root / "qwen3-draft"),
            "--prompts",
            str(root / "prompts.txt"),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "6",
            "--k",
            "2",
            "--device",
            "cpu",
            "--no-progress",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    draft = json.loads(res.stdout)["drafts"][0]
    assert 0.0 <= draft["alpha"] <= 1.0 and draft["per_k"][0]["greedy_identical"] is True


def test_unknown_moe_type_and_bad_mode_exit_2(root: Path, tmp_path: Path) -> None:
    from tiny import make_tokenizer
    from transformers import OlmoeConfig, OlmoeForCausalLM

    tok = make_tokenizer()
    OlmoeForCausalLM(
        OlmoeConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
        )
    ).save_pretrained(tmp_path / "olmoe")
    tok.save_pretrained(tmp_path / "olmoe")
    res = runner.invoke(
        app,
        [
            "quantize",
            str(tmp_path / "olmoe"),
            "--out",
            str(tmp_path / "o"),
            "--calib",
            str(root / "corpus.txt"),
            "--group-size",
            "32",
            *TINY,
        ],
    )
    assert res.exit_code == 2
    assert "'olmoe' is a mixture of experts" in res.output and "calib/architectures.py" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "o").exists()
    res = runner.invoke(
        app, ["quantize", str(root / "mixtral"), "--out", str(tmp_path / "m"), "--moe-calibration", "most", *TINY]
    )
    assert res.exit_code == 2 and "--moe-calibration 'most'" in res.output
