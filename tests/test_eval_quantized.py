"""Our loader for `eval ppl`: every checkpoint format we write is rebuilt with the
kernels' quantized modules and gives the logits of the model with dequantized weights."""

import json

import pytest
import torch
from tiny import TEXT, make_llama, make_tokenizer
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.evals.load_model import backend_of, load_for_eval
from infer_tool.kernels.quant_linear import Fp8Linear, Int4Linear
from infer_tool.packers.checkpoint import read_checkpoint, write_checkpoint
from infer_tool.packers.fp8 import Fp8Scheme, quantize_fp8_weight
from infer_tool.packers.rtn import quantize_rtn
from infer_tool.schemes.registry import make_scheme

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(model, fn):
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS:
            out[name] = fn(m.weight.detach())
    return out


def _dequantized_copy(model, quantized):
    ref = make_llama(model.config.vocab_size, tie=model.config.tie_word_embeddings)
    ref.load_state_dict(model.state_dict())
    for name, w in quantized.items():
        ref.get_submodule(name).weight.data = w.dequantize(torch.float32)
    return ref


CASES = {
    "compressed-tensors-sym": ("int", "compressed-tensors", dict(symmetric=True)),
    "compressed-tensors-asym": ("int", "compressed-tensors", dict(symmetric=False)),
    "awq": ("int", "awq", dict(symmetric=False)),
    "gptq": ("int", "gptq", dict(symmetric=True)),
    "fp8-ct-channel": ("fp8", "compressed-tensors", dict(granularity="channel")),
    "fp8-native-block": ("fp8", "fp8", dict(granularity="block", block_size=(32, 32))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_loads_with_quantized_modules_and_matches_dequantized_model(tmp_path, case):
    kind, fmt, kw = CASES[case]
    tok = make_tokenizer()
    torch.manual_seed(0)
    model = make_llama(len(tok), tie=(case != "awq"))
    if kind == "int":
        scheme = make_scheme("rtn", group_size=32, **kw)
        quantized = _quantize(model, lambda w: quantize_rtn(w, None, scheme))
        module_type = Int4Linear
    else:
        scheme = Fp8Scheme(**kw)
        quantized = _quantize(model, lambda w: quantize_fp8_weight(w, scheme))
        module_type = Fp8Linear
    src = tmp_path / "src"
    tok.save_pretrained(src)
    out = write_checkpoint(model, quantized, fmt, scheme, tmp_path / "q", src_dir=src)
    loaded = load_for_eval(str(out))
    mods = [m for m in loaded.model.modules() if isinstance(m, module_type)]
    assert len(mods) == len(quantized)
    assert backend_of(loaded.model) != "torch-cpu (unquantized)"
    # reference: the stored weights (AWQ/GPTQ keep fp16 scales), dequantized in fp32
    ref = _dequantized_copy(model, read_checkpoint(out)[1])
    ids = torch.tensor([tok(TEXT[:200])["input_ids"]])
    with torch.no_grad():
        got = loaded.model(input_ids=ids).logits
        want = ref(input_ids=ids).logits
    if kind == "int":  # W4A16: the same arithmetic up to fp32 summation order
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:  # W8A8 quantizes activations too: compare by relative error
        rel = (got - want).norm() / want.norm()
        assert rel < 0.05, rel


def test_eval_ppl_cli_on_our_checkpoint_reports_the_backend(tmp_path):
    tok = make_tokenizer()
    model = make_llama(len(tok))
    scheme = make_scheme("rtn", group_size=32)
    quantized = _quantize(model, lambda w: quantize_rtn(w, None, scheme))
    src = tmp_path / "src"
    tok.save_pretrained(src)
    model.save_pretrained(src, safe_serialization=True)
    out = write_checkpoint(model, quantized, "compressed-tensors", scheme, tmp_path / "q", src_dir=src)
    (tmp_path / "c.txt").write_text(TEXT)
    r = CliRunner().invoke(
        app,
        [
            "eval",
            "ppl",
            str(out),
            "--baseline",
            str(src),
            "--data",
            str(tmp_path / "c.txt"),
            "--seq-len",
            "64",
            "--json",
            "--no-progress",
            "--device",
            "cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert "reference" in doc["backend"] and "unquantized" in doc["baseline"]["backend"]
    assert doc["tokens"] == doc["baseline"]["tokens"]
