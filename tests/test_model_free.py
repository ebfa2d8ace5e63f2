"""`quantize --model-free`: the shards quantized tensor by tensor without the model class.

The oracle of "same algorithm, same bytes" is the layer pipeline itself (`quantize --method rtn
--no-layer-error`, which builds the transformers model): every tensor model-free writes must
equal its tensor bit for bit. Other tests check the selection by name, the fused NVFP4 global
scales, 3-D experts, FP8 sources, resume and the output-directory rules.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tiny import save_tiny_llama  # noqa: E402

from infer_tool.cli.app import app  # noqa: E402
from infer_tool.common.safetensors_header import tensor_headers  # noqa: E402

SCHEMES = {
    "int4": ("--scheme", "W4A16", "--group-size", "32"),
    "int4 asym": ("--scheme", "W4A16_ASYM", "--group-size", "32"),
    "int8": ("--scheme", "W8A16", "--group-size", "32"),
    "fp8 channel": ("--scheme", "FP8_DYNAMIC"),
    "fp8 block": ("--scheme", "FP8_BLOCK"),
    "nvfp4": ("--scheme", "NVFP4A16"),
    "mxfp4": ("--scheme", "MXFP4A16"),
    "mxfp8": ("--scheme", "MXFP8A16"),
    "mxfp8 w8a8": ("--scheme", "MXFP8"),
    "w8a8 dynamic": ("--scheme", "W8A8", "--method", "rtn"),
}


def invoke(*args: object):  # noqa: ANN201
    return CliRunner().invoke(app, [str(a) for a in args])


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", tie=False)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_model_free_writes_the_pipelines_tensors(name: str, tiny: Path, tmp_path: Path) -> None:
    flags = SCHEMES[name]
    method = () if "FP8" in flags[1] else ("--method", "rtn")
    r = invoke("quantize", tiny, "--out", tmp_path / "pipe", "--no-layer-error", "--no-progress", *method, *flags)
    assert r.exit_code == 0, r.output
    r = invoke("quantize", tiny, "--model-free", "--out", tmp_path / "free", "--no-progress", "--json", *flags)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    a, b = tensors(tmp_path / "pipe"), tensors(tmp_path / "free")
    assert sorted(a) == sorted(b)
    for k in a:
        assert same(a[k], b[k]), k
    assert report["quantized"] == 14 and report["ignore"] == ["lm_head"]
    qa = json.loads((tmp_path / "pipe" / "config.json").read_text())["quantization_config"]
    qb = json.loads((tmp_path / "free" / "config.json").read_text())["quantization_config"]
    assert qa["config_groups"] == qb["config_groups"] and qa["format"] == qb["format"]
    assert (tmp_path / "free" / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def _write(path: Path, tensors: dict[str, torch.Tensor], config: dict, files: dict[str, str] | None = None) -> Path:
    """A checkpoint directory of `tensors` split in two shards with an index."""
    path.mkdir(parents=True)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return path


def _invented(tmp_path: Path) -> Path:
    """An architecture transformers does not know: fused 3-D experts, an MTP layer, a router."""
    g = torch.Generator().manual_seed(0)
    H, I, E = 64, 32, 4

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": r(100, H), "lm_head.weight": r(100, H), "model.norm.weight": r(H)}
    for i in range(3):  # layer 2 is the MTP layer (num_hidden_layers 2)
        p = f"model.layers.{i}"
        t |= {
            f"{p}.self_attn.q_proj.weight": r(H, H),
            f"{p}.self_attn.k_proj.weight": r(H // 2, H) * 4,
            f"{p}.self_attn.v_proj.weight": r(H // 2, H),
            f"{p}.self_attn.o_proj.weight": r(H, H),
            f"{p}.input_layernorm.weight": r(H),
            f"{p}.mlp.gate.weight": r(E, H),
            f"{p}.mlp.experts.gate_up_proj": r(E, 2 * I, H),
            f"{p}.mlp.experts.down_proj": r(E, H, I),
        }
    t["model.layers.2.eh_proj.weight"] = r(H, 2 * H)
    config = {
        "model_type": "zebra_moe",
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16",
    }
    return _write(tmp_path / "zebra", t, config, {"modeling_zebra.py": "raise SystemExit('never run')\n"})


def test_invented_architecture_selection_and_fused_scales(tmp_path: Path) -> None:
    src = _invented(tmp_path)
    r = invoke(
        "quantize", src, "--model-free", "--scheme", "NVFP4A16", "--out", tmp_path / "out", "--json", "--no-progress"
    )
    assert r.exit_code == 0, r.output
    out = tensors(tmp_path / "out")
    original = tensors(src)
    # kept as they were: embeddings, lm_head, norms, the router, the MTP layer
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight"):
        assert same(out[k], original[k]), k
    assert "model.layers.2.self_attn.q_proj.weight" in out and "model.layers.2.eh_proj.weight" in out
    # quantized: attention and the fused 3-D experts, expert by expert
    assert out["model.layers.0.mlp.experts.gate_up_proj.weight_packed"].shape == (4, 64, 32)
    assert out["model.layers.0.mlp.experts.down_proj.weight_scale"].shape == (4, 64, 2)
    # q/k/v share one global scale, that of their largest |w| (k's, scaled up 4x): 448*6/amax
    gq, gk, gv = (out[f"model.layers.0.self_attn.{n}_proj.weight_global_scale"] for n in "qkv")
    assert torch.equal(gq, gk) and torch.equal(gk, gv)
    amax = max(original[f"model.layers.0.self_attn.{n}_proj.weight"].float().abs().max() for n in "qkv")
    assert torch.allclose(gq, torch.tensor([448 * 6 / amax]), rtol=1e-2)
    assert not torch.equal(gq, out["model.layers.0.self_attn.o_proj.weight_global_scale"])
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]
    assert "model.layers.0.mlp.gate" in ignore and "lm_head" in ignore and "model.embed_tokens" not in ignore
    assert (tmp_path / "out" / "modeling_zebra.py").read_text() == "raise SystemExit('never run')\n"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out)
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_fp8_block_source_is_dequantized_first(tmp_path: Path) -> None:
    """A DeepSeek-V3-style FP8 block checkpoint -> NVFP4: the weight is dequantized (e4m3 x
    weight_scale_inv per 128x128 block) before it is quantized: the result equals NVFP4 of the
    dequantized bf16 checkpoint."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 128, generator=g) * 0.02
    q = (w / 0.001).clamp(-448, 448).to(torch.float8_e4m3fn)
    inv = torch.tensor([[0.001], [0.002]], dtype=torch.float32)  # (ceil(256/128), ceil(128/128))
    deq = (q.float() * inv.repeat_interleave(128, 0)).to(torch.bfloat16)
    base = {
        "model.norm.weight": torch.ones(128, dtype=torch.bfloat16),
        "model.layers.0.mlp.up_proj.input_scale": torch.ones(()),
    }
    fp8_cfg = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    fp8 = _write(
        tmp_path / "fp8",
        base | {"model.layers.0.mlp.up_proj.weight": q, "model.layers.0.mlp.up_proj.weight_scale_inv": inv},
        {"model_type": "deepseek_v9", "torch_dtype": "bfloat16", "quantization_config": fp8_cfg},
    )
    bf16 = _write(
        tmp_path / "bf16",
        {"model.norm.weight": base["model.norm.weight"], "model.layers.0.mlp.up_proj.weight": deq},
        {"model_type": "deepseek_v9", "torch_dtype": "bfloat16"},
    )
    for src, out in ((fp8, "a"), (bf16, "b")):
        r = invoke("quantize", src, "--model-free", "--scheme", "NVFP4A16", "--out", tmp_path / out, "--no-progress")
        assert r.exit_code == 0, r.output
    a, b = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert sorted(a) == sorted(b) and "model.layers.0.mlp.up_proj.weight_scale_inv" not in a
    for k in a:
        assert same(a[k], b[k]), k
    assert json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]["format"] == (
        "nvfp4-pack-quantized"
    )


def test_resume_keeps_finished_shards_and_gives_the_same_bytes(tmp_path: Path) -> None:
    src = _invented(tmp_path)
    args = ("--model-free", "--scheme", "W4A16", "--group-size", "32", "--no-progress")
    r = invoke("quantize", src, "--out", tmp_path / "full", *args)
    assert r.exit_code == 0, r.output
    # an interrupted run: the first shard finished, the second half-written
    import infer_tool.jobs.model_free as mf

    partial = tmp_path / ".part.partial"
    partial.mkdir()
    opts = mf.ModelFreeOptions(model=str(src), out=str(tmp_path / "part"), scheme=_w4())
    key_doc = {"key": mf.run_key(mf.open_source(src), opts, "bfloat16"), "version": mf.VERSION}
    (partial / mf.STATE).write_text(json.dumps(key_doc))
    first = "model-00001-of-00002.safetensors"
    (partial / first).write_bytes((tmp_path / "full" / first).read_bytes())
    (partial / "model-00002-of-00002.safetensors.tmp").write_bytes(b"half")
    r = invoke("quantize", src, "--out", tmp_path / "part", *args)
    assert r.exit_code == 2 and "--resume" in r.output
    r = invoke("quantize", src, "--out", tmp_path / "part", *args, "--resume", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["resumed_shards"] == 1 and not partial.exists()
    for f in sorted(p.name for p in (tmp_path / "full").iterdir() if p.suffix == ".safetensors"):
        assert (tmp_path / "part" / f).read_bytes() == (tmp_path / "full" / f).read_bytes(), f
    # the progress of other options: refused, nothing touched
    partial.mkdir()
    (partial / mf.STATE).write_text(json.dumps(key_doc))
    r = invoke(
        "quantize", src, "--out", tmp_path / "part", "--model-free", "--scheme", "NVFP4A16", "--resume", "--overwrite"
    )
    assert r.exit_code == 2 and "other options" in r.output, r.output
    assert (partial / mf.STATE).is_file() and (tmp_path / "part" / first).is_file()


def _w4():  # noqa: ANN202
    from infer_tool.schemes.registry import make_scheme

    return make_scheme("rtn", bits=4, group_size=32, symmetric=True)


def test_output_files_are_valid_safetensors_written_in_one_pass(tiny: Path, tmp_path: Path) -> None:
    r = invoke("quantize", tiny, "--model-free", "--scheme", "NVFP4A16", "--out", tmp_path / "o", "--no-progress")
    assert r.exit_code == 0, r.output
    header, start = tensor_headers(tmp_path / "o" / "model.safetensors")
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert start + spans[-1][1] == (tmp_path / "o" / "model.safetensors").stat().st_size


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--method", "gptq"), "data-free"),
        (("--scheme", "FP8"), "data-free"),
        (("--scheme", "NVFP4"), "data-free"),
        (("--eval", "sotu:eval"), "--eval"),
        (("--format", "awq"), "compressed-tensors"),
        (("--ignore", "re:("), "regular expression"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(flags: tuple, needle: str, tiny: Path, tmp_path: Path) -> None:
    r = invoke("quantize", tiny, "--model-free", "--out", tmp_path / "o", "--no-progress", *flags)
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()


def test_no_default_ignore_without_model_free_is_refused(tiny: Path, tmp_path: Path) -> None:
    r = invoke("quantize", tiny, "--method", "rtn", "--no-default-ignore", "--out", tmp_path / "o", "--no-progress")
    assert r.exit_code == 2 and "--model-free" in r.output and not (tmp_path / "o").exists()


def test_out_rules_as_quantize(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "mine.txt").write_text("keep")
    args = ("quantize", tiny, "--model-free", "--scheme", "W4A16", "--group-size", "32", "--no-progress")
    r = invoke(*args, "--out", tmp_path / "o")
    assert r.exit_code == 2 and "--overwrite" in r.output
    r = invoke(*args, "--out", tmp_path / "o", "--overwrite")
    assert r.exit_code == 2 and (tmp_path / "o" / "mine.txt").read_text() == "keep"
    r = invoke(*args, "--out", tmp_path / "p")
    assert r.exit_code == 0, r.output
    r = invoke(*args, "--out", tmp_path / "p", "--overwrite")  # ours: replaced
    assert r.exit_code == 0, r.output


def test_unknown_architecture_refusal_suggests_model_free(tmp_path: Path) -> None:
    from infer_tool.calib.architectures import architecture_for
    from infer_tool.common.errors import BadInput

    with pytest.raises(BadInput, match="--model-free"):
        architecture_for("zebra_moe")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("name", ["int4", "nvfp4", "fp8 block"])
def test_moe_model_free_writes_the_pipelines_tensors(family: str, name: str, tmp_path: Path) -> None:
    """Per-expert weights quantized, routers kept, each expert's w1/w3 (gate/up) sharing the
    NVFP4 global scale, as the pipeline writes them."""
    from tiny_moe import save_moe

    src = save_moe(tmp_path / "moe", family)
    flags = SCHEMES[name]
    method = () if "FP8" in flags[1] else ("--method", "rtn")
    r = invoke("quantize", src, "--out", tmp_path / "pipe", "--no-layer-error", "--no-progress", *method, *flags)
    assert r.exit_code == 0, r.output
    r = invoke("quantize", src, "--model-free", "--out", tmp_path / "free", "--no-progress", *flags)
    assert r.exit_code == 0, r.output
    a, b = tensors(tmp_path / "pipe"), tensors(tmp_path / "free")
    assert sorted(a) == sorted(b)
    for k in a:
        assert same(a[k], b[k]), k
    qa = json.loads((tmp_path / "pipe" / "config.json").read_text())["quantization_config"]
    qb = json.loads((tmp_path / "free" / "config.json").read_text())["quantization_config"]
    assert sorted(qa["ignore"]) == sorted(qb["ignore"])


def test_two_processes_write_the_one_process_bytes(tmp_path: Path) -> None:
    """Two ranks (threads here, as `torchrun --nproc-per-node 2` runs processes) split the
    shards; process 0 assembles; every file equals the one-process run's."""
    import threading

    from infer_tool.jobs.model_free import ModelFreeOptions, assign_shards, quantize_model_free
    from infer_tool.schemes.registry import make_scheme

    src = _invented(tmp_path)
    scheme = make_scheme("rtn", fp4="nvfp4")  # fused groups whose shards both ranks read
    quantize_model_free(ModelFreeOptions(str(src), str(tmp_path / "one"), scheme), rank=0, world=1)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            quantize_model_free(ModelFreeOptions(str(src), str(tmp_path / "two"), scheme), rank=r, world=2)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    files = sorted(p.name for p in (tmp_path / "one").iterdir() if p.name != "quantize_report.json")
    assert files == sorted(p.name for p in (tmp_path / "two").iterdir() if p.name != "quantize_report.json")
    for f in files:
        if f != ".infer-tool.json":
            assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    assert sorted(assign_shards({"a": 3, "b": 2, "c": 2, "d": 1}, 2).items()) == [
        ("a", 0),
        ("b", 1),
        ("c", 1),
        ("d", 0),
    ]
