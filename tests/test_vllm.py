"""The real serving engine checks every format we write: each row of
tests/vllm_formats.py is quantized from the demo model, loaded by vLLM's CPU build
(`vllm.LLM`, in `.venv-vllm`) and scored on one 2048-token window of sotu:eval, against
`infer-tool eval ppl --dtype bfloat16` on the same window (within 1%). A format vLLM's CPU
build refuses must give exactly the refusal its row names, so that a vLLM that starts
accepting it fails this test until the row and the README are updated.

No skip: without the vLLM environment (`make vllm-env`, which `make test` runs first)
every test that needs it fails and says how to build it.
"""

from __future__ import annotations

import pytest
import vllm_formats
from vllm_formats import ROWS, Row

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> vllm_formats.Run:
    try:
        return vllm_formats.run(tmp_path_factory.mktemp("vllm"))
    except vllm_formats.VllmEnvMissing as exc:
        pytest.fail(str(exc))


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_format_in_vllm(run: vllm_formats.Run, row: Row) -> None:
    (res,) = [r for r in run.results if r.row.id == row.id]
    assert vllm_formats.problems(res, run.host) == []


def test_rows_cover_every_format_we_write(run: vllm_formats.Run) -> None:
    """Every registered checkpoint format, every FP8 weight granularity it carries, and KV
    scales in both FP8 formats have a row: read back from the written config.json."""
    import json

    from infer_tool.packers.checkpoint import all_formats, format_of

    seen, strategies, kv = set(), set(), set()
    for res in run.results:
        qc = json.loads((res.path / "config.json").read_text())["quantization_config"]
        fmt = format_of(qc)
        seen.add((fmt.name, fmt.kind))
        if fmt.kind == "fp8":
            if fmt.name == "compressed-tensors":
                strategy = qc["config_groups"]["group_0"]["weights"]["strategy"]
            else:
                strategy = "block" if qc.get("weight_block_size") else "tensor"
            strategies.add((fmt.name, strategy))
            if vllm_formats.checkpoint_kv_scales(res.path):
                kv.add(fmt.name)
    assert seen == {(f.name, f.kind) for f in all_formats()}
    assert strategies == {("compressed-tensors", s) for s in ("tensor", "channel", "block")} | {
        ("fp8", "tensor"), ("fp8", "block")}
    assert kv == {"compressed-tensors", "fp8"}


def _result(row_id: str, vllm: dict, ours: float | None = None, scales: dict | None = None) -> vllm_formats.Result:
    (row,) = [r for r in ROWS if r.id == row_id]
    return vllm_formats.Result(row, vllm_formats.ROOT, vllm, ours, scales or {})


NO_AMX_HOST = {"amx": False}


@pytest.mark.parametrize(
    "res,host,complaint",
    [
        (_result("awq-gemm", {"ppl": 25.3, "stage": "score"}, ours=24.8), NO_AMX_HOST, "over 1%"),
        (_result("awq-gemm", {"error": "ValueError: x", "stage": "load"}), NO_AMX_HOST, "did not run it"),
        (_result("fp8-tensor", {"ppl": 21.0, "stage": "score"}, ours=21.0), NO_AMX_HOST, "now runs this format"),
        (_result("fp8-tensor", {"error": "RuntimeError: other", "stage": "load"}), NO_AMX_HOST, "expected vLLM's refusal"),
        (_result("ct-fp8-channel-static", {"error": vllm_formats.NARROW_0DIM, "stage": "load"}), NO_AMX_HOST, "at score"),
        (_result("ct-fp8-block-gate-up", {"error": vllm_formats.NO_AMX, "stage": "load"}), {"amx": True}, "did not run it"),
        (_result("ct-fp8-channel-kv", {"ppl": 20.8, "stage": "score", "kv_cache_dtype": "fp8",
                                       "kv_scales": {"a": [0.02, 0.002]}}, ours=20.8, scales={"a": [0.02, 0.004]}),
         NO_AMX_HOST, "other k/v scales"),
        (_result("ct-fp8-channel-kv", {"ppl": 20.8, "stage": "score", "kv_cache_dtype": "auto", "kv_scales": {}},
                 ours=20.8, scales={"a": [0.02, 0.004]}), NO_AMX_HOST, "not fp8"),
    ],
)
def test_problems_catch_each_miss(res: vllm_formats.Result, host: dict, complaint: str) -> None:
    """The checks themselves, on made-up outcomes: each kind of miss is reported."""
    found = vllm_formats.problems(res, host)
    assert found and complaint in " ".join(found), found


def test_problems_accept_expected_outcomes() -> None:
    ok = [
        (_result("awq-gemm", {"ppl": 24.9, "stage": "score"}, ours=24.8), NO_AMX_HOST),
        (_result("fp8-tensor", {"error": vllm_formats.STATIC_FP8_QUANT, "stage": "load"}), NO_AMX_HOST),
        (_result("ct-fp8-block-gate-up", {"ppl": 20.7, "stage": "score"}, ours=20.75), {"amx": True}),
        (_result("ct-fp8-channel-kv", {"ppl": 20.8, "stage": "score", "kv_cache_dtype": "fp8",
                                       "kv_scales": {"a": [0.02, 0.004]}}, ours=20.8, scales={"a": [0.02, 0.004]}),
         NO_AMX_HOST),
    ]
    for res, host in ok:
        assert vllm_formats.problems(res, host) == [], res.row.id
