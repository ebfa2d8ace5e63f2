"""Data-free quantization without calibration text (`quantize --no-layer-error`).

A data-free scheme reads no activations: its calibration tokens only measure the reported
layer errors. Without them (`quantize_model(model, None, ...)`) every weight, scale and
packed byte must be what the run with tokens writes; schemes that read activations are
refused before any work.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TEXT, make_llama, save_tiny_llama  # noqa: E402
from tiny_moe import FAMILIES, make_moe, save_moe  # noqa: E402

from infer_tool.calib.pipeline import quantize_model  # noqa: E402
from infer_tool.cli.app import app  # noqa: E402
from infer_tool.common.errors import BadInput  # noqa: E402
from infer_tool.schemes.registry import make_scheme  # noqa: E402

V = 300
# name -> make_scheme arguments of every data-free scheme
DATA_FREE = {
    "int4 rtn sym": ("rtn", {"group_size": 32}),
    "int4 rtn asym": ("rtn", {"group_size": 32, "symmetric": False}),
    "w8a8 rtn dynamic": ("rtn", {"bits": 8, "group_size": -1, "int8_activations": "dynamic"}),
    "w8a16 rtn": ("rtn", {"bits": 8, "group_size": 32}),
    "fp8 channel dynamic": ("fp8", {}),
    "fp8 block": ("fp8", {"granularity": "block"}),
    "nvfp4a16 rtn": ("rtn", {"fp4": "nvfp4"}),
    "mxfp4a16 rtn": ("rtn", {"fp4": "mxfp4"}),
}
# schemes that read activations: refused without tokens
READS_DATA = {
    "gptq": ("gptq", {"group_size": 32}),
    "w8a8 rtn static": ("rtn", {"bits": 8, "group_size": -1, "int8_activations": "static"}),
    "smoothquant rtn": ("rtn", {"bits": 8, "group_size": -1, "int8_activations": "dynamic", "smoothquant": 0.5}),
    "fp8 static": ("fp8", {"activations": "static"}),
    "nvfp4 w4a4 rtn": ("rtn", {"fp4": "nvfp4", "fp4_activations": "fp4"}),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # noqa: ANN201
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def fields(w: object) -> dict[str, object]:
    """A recorded weight's fields (tensors, scales, info) as comparable values."""
    out = {}
    for f in dataclasses.fields(w):  # type: ignore[arg-type]
        v = getattr(w, f.name)
        out[f.name] = (v.dtype, v.shape, v.view(-1).view(torch.uint8).tolist()) if torch.is_tensor(v) else repr(v)
    return out


def assert_same_quantization(model: torch.nn.Module, method: str, kw: dict) -> None:
    scheme = make_scheme(method, **kw)
    ids = torch.randint(0, V, (6, 24), generator=torch.Generator().manual_seed(1))
    with_text, without = copy.deepcopy(model), copy.deepcopy(model)
    a = quantize_model(with_text, ids, scheme, batch_size=4, device="cpu")
    b = quantize_model(without, None, scheme, device="cpu")
    assert a.layer_errors and not b.layer_errors and b.tokens == 0
    assert list(a.quantized) == list(b.quantized)  # same linears, written in the same order
    for name in a.quantized:
        assert fields(a.quantized[name]) == fields(b.quantized[name]), name
    sa, sb = with_text.state_dict(), without.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k  # the dequantized model too, bit for bit


@pytest.mark.parametrize("name", sorted(DATA_FREE))
def test_dense_without_tokens_is_the_run_with_tokens(name: str) -> None:
    method, kw = DATA_FREE[name]
    assert_same_quantization(make_llama(V, seed=2), method, kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["int4 rtn sym", "fp8 channel dynamic", "nvfp4a16 rtn"])
def test_moe_without_tokens_is_the_run_with_tokens(family: str, name: str) -> None:
    """Every expert quantized (routers left out), the shared global scales of w1/w3 kept."""
    method, kw = DATA_FREE[name]
    assert_same_quantization(make_moe(family, vocab_size=V), method, kw)


@pytest.mark.parametrize("name", sorted(READS_DATA))
def test_schemes_reading_activations_need_tokens(name: str) -> None:
    method, kw = READS_DATA[name]
    with pytest.raises(BadInput, match="reads calibration activations"):
        quantize_model(make_llama(V), None, make_scheme(method, **kw), device="cpu")


# ---------------------------------------------------------------- the CLI

TINY = ("--num-samples", "8", "--seq-len", "32", "--no-progress", "--device", "cpu", "--json")


def invoke(*args: object):  # noqa: ANN201
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize(
    ("kind", "flags"),
    [
        ("dense", ("--method", "rtn", "--group-size", "32")),
        ("dense", ("--method", "rtn", "--fp4", "mxfp4")),
        ("dense", ("--scheme", "FP8_DYNAMIC")),
        ("moe", ("--method", "rtn", "--fp4", "nvfp4")),
    ],
)
def test_no_layer_error_writes_the_checkpoint_without_reading_text(kind: str, flags: tuple, tmp_path: Path) -> None:
    path = tmp_path / "model"
    model = save_tiny_llama(path, tie=False) if kind == "dense" else save_moe(path, "mixtral")
    (tmp_path / "corpus.txt").write_text(TEXT * 4)
    r = invoke("quantize", model, "--calib", tmp_path / "corpus.txt", "--out", tmp_path / "a", *TINY, *flags)
    assert r.exit_code == 0, r.output
    # a corpus that does not exist: never read
    r2 = invoke(
        "quantize", model, "--calib", tmp_path / "none.txt", "--out", tmp_path / "b", "--no-layer-error", *TINY, *flags
    )
    assert r2.exit_code == 0, r2.output
    a, b = json.loads(r.stdout), json.loads(r2.stdout)
    assert a["layer_error_mean"] is not None and b["layer_error_mean"] is None and b["layer_errors"] == []
    assert b.get("calibration") is None and any("--no-layer-error" in n for n in b["notes"])
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "b").glob("*.safetensors"))
    for s in shards:
        assert (tmp_path / "a" / s).read_bytes() == (tmp_path / "b" / s).read_bytes(), s
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()


@pytest.mark.parametrize(
    "flags",
    [
        ("--method", "gptq", "--group-size", "32"),
        ("--method", "awq", "--group-size", "32"),
        ("--scheme", "W8A8", "--int8-activations", "static"),
        ("--method", "rtn", "--fp4", "nvfp4", "--fp4-activations", "fp4"),
    ],
)
def test_no_layer_error_refused_where_the_method_reads_activations(flags: tuple, tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model", tie=False)
    r = invoke("quantize", model, "--out", tmp_path / "out", "--no-layer-error", *TINY, *flags)
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "--no-layer-error" in line and "reads calibration activations" in line, line
    assert "Traceback" not in r.output and not (tmp_path / "out").exists()
