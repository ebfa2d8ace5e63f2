"""A `--model-free` checkpoint read back by others: transformers + compressed-tensors loads it
and computes the logits of a model holding the dequantized weights. (vLLM's CPU build loading
and scoring one is measured, not tested here: with vLLM's start it took over two minutes on this
2-core machine, more than a fast or lean slow test may; docs and /work/notes/issue-63.md.)

FP8 is not here: compressed-tensors runs FP8 checkpoints with dynamic FP8 activations, so its
logits are not a weight-only model's; model-free FP8 tensors equal the pipeline's bit for bit
(tests/test_model_free.py), whose FP8 checkpoints tests/test_fp8_formats.py reads back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tiny import save_tiny_llama  # noqa: E402

from infer_tool.cli.app import app  # noqa: E402

SCHEMES = {
    "int4": ("--scheme", "W4A16", "--group-size", "32"),
    "int8": ("--scheme", "W8A16", "--group-size", "32"),
    "nvfp4": ("--scheme", "NVFP4A16"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", tie=False)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_transformers_with_compressed_tensors_loads_a_model_free_checkpoint(
    name: str, tiny: Path, tmp_path: Path
) -> None:
    """transformers decompresses the checkpoint itself (compressed-tensors' own readers); its
    logits equal a model holding our dequantized weights: INT in float32 to a relative norm of
    1e-4, FP4 in bfloat16 (the only dtype its FP4 decompression writes) to 1e-3 of the
    largest logit."""
    from transformers import AutoModelForCausalLM

    from infer_tool.packers.checkpoint import read_checkpoint

    out = tmp_path / name
    r = CliRunner().invoke(
        app, ["quantize", str(tiny), "--model-free", "--out", str(out), "--no-progress", *SCHEMES[name]]
    )
    assert r.exit_code == 0, r.output
    dtype = torch.bfloat16 if name == "nvfp4" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    _, layers, rest = read_checkpoint(out)
    assert len(layers) == 14
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=dtype)
    for n, w in layers.items():
        ref.get_submodule(n).weight.data = w.dequantize(dtype)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf(ids).logits.float(), ref(ids).logits.float()
        c = AutoModelForCausalLM.from_pretrained(tiny, dtype=dtype)(ids).logits.float()
    if dtype == torch.float32:
        assert float((a - b).norm() / b.norm()) < 1e-4
    else:
        assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())
    assert float((a - c).abs().max()) > 1e-3 * float(c.abs().max())  # the weights were quantized
