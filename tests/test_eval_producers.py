"""`eval ppl` and `eval kld` read checkpoints other tools wrote: AutoAWQ GEMM, GPTQ v1 (sym,
asym, act-order g_idx), native FP8 (block `weight_scale_inv`, per tensor) and ModelOpt NVFP4
(W4A4 and W4A16; config.json and the legacy hf_quant_config.json), each built in
tests/producers.py from the producer's published layout, not by our writers.

Oracle: a float32 model holding the weights each producer's own formula dequantizes to
(`--baseline` / `--reference`). Weights only (`--activations none` for the FP8 and W4A4 ones,
whose activations are quantized as served otherwise), the two perplexities agree within a
relative 1e-4 (float32 summation order; ModelOpt's global scale is carried as a divisor,
at most one float32 ulp off in the effective scale) and KL(reference || checkpoint) is below
1e-6 per token for the weight-only formats.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from producers import BUILDERS, write_producer  # noqa: E402
from tiny import TEXT, save_tiny_llama  # noqa: E402

from infer_tool.cli.app import app  # noqa: E402

ACTIVATIONS_QUANTIZED = {"fp8-block", "fp8-tensor", "modelopt-nvfp4", "modelopt-fp8"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("producers")
    model = save_tiny_llama(d / "model", tie=True)
    (d / "corpus.txt").write_text(TEXT)
    return model, d


def _eval(*args: object) -> dict:
    r = CliRunner().invoke(app, [str(a) for a in args] + ["--json", "--no-progress", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize("producer", sorted(BUILDERS))
def test_eval_ppl_reads_the_producers_checkpoint(producer: str, built: tuple[Path, Path]) -> None:
    model, d = built
    ckpt, ref = write_producer(model, d, producer)
    corpus = d / "corpus.txt"
    args = ["eval", "ppl", ckpt, "--baseline", ref, "--data", corpus, "--seq-len", "64"]
    weights_only = ["--activations", "none"] if producer in ACTIVATIONS_QUANTIZED else []
    doc = _eval(*args, *weights_only)
    assert doc["tokens"] == doc["baseline"]["tokens"] > 100
    assert abs(doc["ppl"] / doc["baseline"]["ppl"] - 1) < 1e-4, (doc["ppl"], doc["baseline"]["ppl"])
    assert "unquantized" not in doc["backend"]
    if producer in ACTIVATIONS_QUANTIZED:  # as served: activations quantized, close to the oracle still
        served = _eval(*args)
        assert served["activations"] != "unquantized", served["activations"]
        assert served["ppl"] != doc["ppl"] and abs(served["ppl"] / doc["ppl"] - 1) < 0.05


@pytest.mark.parametrize("producer", ["awq-gemm", "gptq-act-order", "modelopt-w4a16"])
def test_eval_kld_reads_the_producers_checkpoint(producer: str, built: tuple[Path, Path]) -> None:
    model, d = built
    ckpt, ref = write_producer(model, d / "kld", producer)
    doc = _eval("eval", "kld", ckpt, "--reference", ref, "--data", d / "corpus.txt", "--seq-len", "64")
    assert doc["tokens"] > 100
    assert abs(doc["kld"]["mean"]["mean"]) < 1e-6 and doc["kld"]["max"] < 1e-5, doc["kld"]


def test_eval_reads_a_legacy_modelopt_export(built: tuple[Path, Path]) -> None:
    """Older ModelOpt exports carry their config in hf_quant_config.json only."""
    model, d = built
    ckpt, ref = write_producer(model, d / "legacy", "modelopt-w4a16", legacy_modelopt=True)
    assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())
    doc = _eval("eval", "ppl", ckpt, "--baseline", ref, "--data", d / "corpus.txt", "--seq-len", "64")
    assert abs(doc["ppl"] / doc["baseline"]["ppl"] - 1) < 1e-4
