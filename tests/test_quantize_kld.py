"""KL divergence in `quantize --eval` (on by default, `--no-kld` to skip) and its gate
`--max-kld`: the report's numbers equal `eval kld` of the written checkpoint against the
source model on the same windows; the gate exits 3 alone or beside `--max-ppl-increase`;
the fp final hidden states kept in the ppl cache replace the fp pass on a second run with
the same numbers; bad input exits 2; recipes take the gate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_quantize_cli import one_thread, quantize, run, tiny  # noqa: F401  (fixtures)

from infer_tool.evals import ppl_cache


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("INFER_TOOL_CACHE", str(root))
    monkeypatch.delenv(ppl_cache.DISABLE_ENV, raising=False)
    return root


def ev(tiny: dict[str, Path]) -> list[str]:  # noqa: F811
    return ["--eval", str(tiny["eval"]), "--eval-tokens", "512", "--eval-seq-len", "64"]


RTN2 = ("--method", "rtn", "--bits", "2", "--group-size", "32")  # hurts enough for a KL well above rounding
RTN4 = ("--method", "rtn", "--group-size", "-1")  # per channel: the kernels `eval kld` loads take 4 bits


def test_report_kld_equals_eval_kld_of_the_checkpoint(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "q"
    code, stdout, stderr = quantize(tiny, out, *RTN4, *ev(tiny), "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    ours = report["eval"]["kld"]
    assert ours["tokens"] == report["eval"]["tokens"] and ours["ppl"] == report["eval"]["ppl_after"]
    assert ours["reference_ppl"] == report["eval"]["ppl_before"]
    code, stdout, stderr = run(
        "eval",
        "kld",
        out,
        "--reference",
        tiny["model"],
        "--data",
        tiny["eval"],
        "--max-tokens",
        "512",
        "--seq-len",
        "64",
        "--json",
        "--no-progress",
    )
    assert code == 0, stderr
    theirs = json.loads(stdout)
    assert (theirs["tokens"], theirs["windows"]) == (ours["tokens"], ours["windows"])
    assert ours["kld"]["mean"]["mean"] > 1e-3  # per-channel RTN moves the distributions
    for key in ("median", "p90", "p99", "max"):
        assert math.isclose(ours["kld"][key], theirs["kld"][key], rel_tol=1e-3, abs_tol=1e-7), key
    assert math.isclose(ours["kld"]["mean"]["mean"], theirs["kld"]["mean"]["mean"], rel_tol=1e-4)
    assert abs(ours["same_top_token"]["mean"] - theirs["same_top_token"]["mean"]) <= 1 / ours["tokens"]
    assert math.isclose(ours["ppl"], theirs["ppl"], rel_tol=1e-5)
    assert math.isclose(ours["reference_ppl"], theirs["reference_ppl"], rel_tol=1e-6)


def test_max_kld_gate_exits_3_alone_or_with_the_ppl_gate(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    code, stdout, stderr = quantize(tiny, tmp_path / "a", *RTN2, *ev(tiny), "--json", "--max-kld", "10")
    assert code == 0, stderr
    report = json.loads(stdout)
    kld = report["eval"]["kld"]["kld"]["mean"]["mean"]
    assert report["kld_gate"] == {"max_kld": 10.0, "kld": kld, "passed": True}
    code, stdout, stderr = quantize(tiny, tmp_path / "b", *RTN2, *ev(tiny), "--json", "--max-kld", str(kld / 2))
    assert code == 3, stderr
    assert "mean KL divergence from the fp model" in stderr and "--max-kld" in stderr and "ppl rose" not in stderr
    assert json.loads(stdout)["kld_gate"]["passed"] is False and (tmp_path / "b" / "quantize_report.json").is_file()
    # with a ppl gate that holds, the KL gate alone fails the run; with both failing, both are named
    code, _, stderr = quantize(
        tiny, tmp_path / "c", *RTN2, *ev(tiny), "--max-kld", str(kld / 2), "--max-ppl-increase", "1000%"
    )
    assert code == 3 and "KL divergence" in stderr and "ppl rose" not in stderr, stderr
    code, _, stderr = quantize(
        tiny, tmp_path / "d", *RTN2, *ev(tiny), "--max-kld", str(kld / 2), "--max-ppl-increase", "0%"
    )
    assert code == 3 and "KL divergence" in stderr and "ppl rose" in stderr, stderr


def test_second_run_reads_the_fp_hidden_states(tiny: dict[str, Path], tmp_path: Path, cache: Path) -> None:  # noqa: F811
    first = json.loads(quantize(tiny, tmp_path / "a", *RTN2, *ev(tiny), "--json")[1])
    assert first["eval"]["ppl_before_cached"] is False
    assert len(list((cache / "ppl").glob(f"*{ppl_cache.HIDDEN_SUFFIX}"))) == 1
    second = json.loads(quantize(tiny, tmp_path / "b", *RTN2, *ev(tiny), "--json")[1])
    assert second["eval"]["ppl_before_cached"] is True
    assert second["eval"]["kld"]["kld"] == first["eval"]["kld"]["kld"]  # bit for bit: the same fp logits
    assert second["eval"]["ppl_after"] == first["eval"]["ppl_after"]
    off = json.loads(quantize(tiny, tmp_path / "c", *RTN2, *ev(tiny), "--json", "--no-kld")[1])
    assert off["eval"]["kld"] is None and off["eval"]["ppl_after"] == first["eval"]["ppl_after"]


def test_a_cached_ppl_without_hidden_states_runs_the_fp_pass(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
    cache: Path,
) -> None:
    first = json.loads(quantize(tiny, tmp_path / "a", *RTN2, *ev(tiny), "--json", "--no-kld")[1])
    assert not list((cache / "ppl").glob(f"*{ppl_cache.HIDDEN_SUFFIX}"))
    second = json.loads(quantize(tiny, tmp_path / "b", *RTN2, *ev(tiny), "--json")[1])
    assert second["eval"]["ppl_before_cached"] is True and second["eval"]["kld"] is not None
    assert second["eval"]["ppl_before"] == first["eval"]["ppl_before"]
    assert len(list((cache / "ppl").glob(f"*{ppl_cache.HIDDEN_SUFFIX}"))) == 1


def test_bad_gate_input_exits_2(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    cases = [
        (["--max-kld", "0.1"], "--max-kld needs --eval"),
        ([*ev(tiny), "--max-kld", "-1"], "--max-kld -1.0 must be >= 0"),
        ([*ev(tiny), "--max-kld", "0.1", "--no-kld"], "--max-kld needs the KL divergence"),
    ]
    for extra, needle in cases:
        code, _, stderr = quantize(tiny, tmp_path / "x", *RTN2, *extra)
        assert code == 2 and needle in stderr and "Traceback" not in stderr, (extra, stderr)
        assert not (tmp_path / "x").exists()


def test_a_recipe_takes_the_gate(tiny: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"method: rtn\nbits: 2\ngroup_size: 32\neval: {tiny['eval']}\neval_tokens: 512\n"
        "eval_seq_len: 64\nmax_kld: 0.000001\n"
    )
    code, _, stderr = quantize(tiny, tmp_path / "a", "--recipe", str(recipe))
    assert code == 3 and "--max-kld 1e-06" in stderr, stderr
    recipe.write_text(recipe.read_text().replace("max_kld: 0.000001", "max_kld: yes"))
    code, _, stderr = quantize(tiny, tmp_path / "b", "--recipe", str(recipe))
    assert code == 2 and "max_kld" in stderr, stderr
