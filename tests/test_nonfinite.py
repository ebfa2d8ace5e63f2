"""NaN is a failure, not a number: a model whose logits are NaN or infinite makes `eval ppl`,
`eval kld` (as the model or as the reference) and `quantize`'s evaluation exit 2 naming the
window, never exit 0 with a NaN score."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import TEXT, save_tiny_llama
from typer.testing import CliRunner

from infer_tool.cli.app import app

runner = CliRunner()


def _poison(src: Path, dst: Path, tensor: str, value: float) -> Path:
    """A copy of the saved model `src` with `tensor` set to `value`."""
    import shutil

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    weights = load_file(path)
    weights[tensor].fill_(value)
    save_file(weights, path, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("nonfinite")
    save_tiny_llama(d / "ok", seed=0)
    _poison(d / "ok", d / "nan", "model.norm.weight", math.nan)
    _poison(d / "ok", d / "nan-layer", "model.layers.1.input_layernorm.weight", math.nan)
    (d / "corpus.txt").write_text(TEXT)
    return d


def _run(*args: object) -> tuple[int, str]:
    r = runner.invoke(app, [*[str(a) for a in args], "--no-progress", "--device", "cpu"])
    return r.exit_code, r.output


def _quantize(model: Path, out: Path, method: str, calib: Path, *extra: object) -> tuple[int, str]:
    """`quantize` of `model` into `out` with `method`, group 32, 2 x 32 calibration tokens of `calib`."""
    return _run(
        "quantize",
        model,
        "--out",
        out,
        "--method",
        method,
        "--group-size",
        "32",
        "--calib",
        calib,
        "--num-samples",
        "2",
        "--seq-len",
        "32",
        *extra,
    )


def test_eval_ppl_of_a_nan_model_exits_2_naming_the_window(models: Path) -> None:
    code, out = _run("eval", "ppl", models / "nan", "--data", models / "corpus.txt", "--seq-len", "64", "--json")
    assert code == 2, out
    assert "the model gives NaN or infinite logits in the window of tokens 0..64" in out
    assert "Traceback" not in out


def test_eval_kld_names_the_model_or_the_reference(models: Path) -> None:
    data = ("--data", models / "corpus.txt", "--seq-len", "64")
    code, out = _run("eval", "kld", models / "nan", "--reference", models / "ok", *data)
    assert code == 2 and "the model gives NaN or infinite logits" in out, out
    code, out = _run("eval", "kld", models / "ok", "--reference", models / "nan", *data)
    assert code == 2 and "the reference model gives NaN or infinite logits" in out, out
    code, out = _run("eval", "kld", models / "ok", "--reference", models / "ok", *data, "--json")
    assert code == 0, out  # the healthy pair still scores


def test_quantize_evaluation_of_an_overflowing_model_exits_2(models: Path, tmp_path: Path) -> None:
    code, out = _quantize(
        models / "nan",
        tmp_path / "q",
        "rtn",
        models / "corpus.txt",
        "--eval",
        models / "corpus.txt",
        "--eval-tokens",
        "128",
        "--eval-seq-len",
        "64",
    )
    assert code == 2 and "NaN or infinite logits in the window of tokens 0..64" in out, out
    assert not (tmp_path / "q").exists()


class _Logits(torch.nn.Module):
    """A stand-in model: logits (1, L, V) from the ids, inf at the positions holding `bad`."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> object:
        logits = torch.nn.functional.one_hot(input_ids, 16).float()
        logits[input_ids == self.bad] = math.inf

        class Out:
            pass

        out = Out()
        out.logits = logits
        return out


def test_quantize_names_the_first_layer_whose_outputs_are_not_finite(models: Path, tmp_path: Path) -> None:
    code, out = _quantize(models / "nan-layer", tmp_path / "q", "gptq", models / "corpus.txt")
    assert code == 2, out
    assert "model.layers.1: the fp layer's outputs on the calibration text are NaN or infinite" in out, out
    assert not (tmp_path / "q").exists()


def test_the_first_non_finite_position_is_named() -> None:
    """The first scored position whose logits are not finite is named by the token it predicts."""
    from infer_tool.common.errors import BadInput
    from infer_tool.evals.ppl import Window, window_logits

    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    with pytest.raises(BadInput, match=r"tokens 0\.\.8 \(first where it predicts token 5\)"):
        window_logits(_Logits(bad=5), ids, Window(begin=0, end=8, scored=7))
    logits, _ = window_logits(_Logits(bad=8), ids, Window(begin=0, end=8, scored=7))  # position 7 is not scored
    assert torch.isfinite(logits).all()
