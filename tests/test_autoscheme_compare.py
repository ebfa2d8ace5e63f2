"""benchmarks/autoscheme_compare.py's own accounting, on a tiny Llama: an AutoScheme-style
per-linear assignment written by our writer (`write_assignment`), its stored bits read from the
safetensors headers (`header_bits`) against the tensors loaded back by safetensors and against
the format's byte layout by hand, the bits our accounting predicts for the assignment before
writing (`assignment_bits`), and the count of fused linears whose shards differ."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny import save_tiny_llama  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_autoscheme_compare", BENCH / "autoscheme_compare.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_autoscheme_compare", bench)
    spec.loader.exec_module(bench)
    return bench


def plan(layers: int = 2) -> dict[str, str]:
    """Layer 0's q/k/v split across options (what AutoScheme may choose); the rest whole."""
    out = {}
    for i in range(layers):
        p = f"model.layers.{i}"
        qkv = ("W4A16G64", "W8A16G64", "FP8_CHANNEL") if i == 0 else ("W8A16G64",) * 3
        out.update(zip((f"{p}.self_attn.{s}" for s in ("q_proj", "k_proj", "v_proj")), qkv))
        out[f"{p}.self_attn.o_proj"] = "FP8_CHANNEL"
        out[f"{p}.mlp.gate_proj"] = out[f"{p}.mlp.up_proj"] = "W4A16G64"
        out[f"{p}.mlp.down_proj"] = "W4A16G64" if i == 0 else "W8A16G64"
    return out


def by_hand(option: str, n: int, k: int) -> int:
    """Bytes the compressed-tensors layouts store for one (N, K) linear in a bfloat16 checkpoint
    (shared/DESIGN.md): INT4 g64 sym: codes int32 (N, K/8) + bf16 scales (N, K/64) + weight_shape
    int64 (2,); W8A16 g64: the same with 8-bit codes (int32 (N, K/4)); FP8 per channel: e4m3
    (N, K) + a float32 scale per output channel."""
    if option == "W4A16G64":
        return n * k // 2 + n * (k // 64) * 2 + 16
    if option == "W8A16G64":
        return n * k + n * (k // 64) * 2 + 16
    if option == "FP8_CHANNEL":
        return n * k + n * 4
    raise AssertionError(option)


def test_written_bits_match_the_headers_the_tensors_and_the_layouts(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    bench = load(monkeypatch)
    src = save_tiny_llama(tmp_path / "src", hidden=64, layers=2)
    assign = plan()
    args = argparse.Namespace(model=str(src), dtype="bfloat16")
    out = tmp_path / "out"
    bench.write_assignment(args, assign, out)

    shapes = bench.source_shapes(src)
    names = sorted(assign)
    written = load_file(str(out / "model.safetensors"))
    for n in names:  # the header parser against safetensors' own loader
        loaded = sum(
            t.numel() * t.element_size() for k, t in written.items() if k.startswith(n + ".") and "bias" not in k
        )
        assert bench.linear_bytes(bench.checkpoint_tensors(out), n) == loaded > 0, n
    weights = sum(shapes[n][0] * shapes[n][1] for n in names)
    hand = 8.0 * sum(by_hand(assign[n], *shapes[n]) for n in names) / weights
    got = bench.header_bits(out, names, shapes)
    assert got == pytest.approx(hand, rel=1e-12)
    assert bench.assignment_bits(assign, shapes, "bfloat16") == pytest.approx(got, rel=1e-12)
    assert 4.0 < got < 8.2  # a mix of 4- and 8-bit codes, scales counted


def test_fused_shards_with_different_options_are_counted(monkeypatch):
    bench = load(monkeypatch)
    assert bench.split_fused(plan()) == (1, 4)  # layer 0's q/k/v; gate/up always whole
    whole = {n: "W4A16G64" for n in plan()}
    assert bench.split_fused(whole) == (0, 4)


def test_unknown_option_is_named(monkeypatch):
    bench = load(monkeypatch)
    with pytest.raises(SystemExit, match="NVFP4"):
        bench.our_candidate("NVFP4", "bfloat16")


def test_the_autoround_side_imports_nothing_of_infer_tool():
    tree = ast.parse((BENCH / "autoscheme_pypi.py").read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "auto_round" in {m.split(".")[0] for m in modules}
    assert not [m for m in modules if m.startswith("infer_tool")]
