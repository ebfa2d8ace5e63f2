"""Projection of speculative-decoding speedups to a GPU at several concurrencies: the
roofline round costs against arithmetic worked by hand on a one-layer model and a
round-number GPU; the best k falling as the concurrency grows once verify passes turn
compute-bound (and not without it); configs read into served models."""

import pytest

from infer_tool.common.errors import BadInput
from infer_tool.sizing.hf_config import shape_from_config
from infer_tool.sizing.presets import GpuPreset, gpu_preset, model_presets
from infer_tool.sizing.roofline import Efficiency
from infer_tool.sizing.shape import FULL, LayerSpec, LinearShape, ModelShape, ParamCount
from infer_tool.spec.acceptance import expected_tokens
from infer_tool.spec.costs import RooflineCosts
from infer_tool.spec.predict import sequence_prediction
from infer_tool.spec.projection import ProjectionRequest, project
from infer_tool.spec.roofline import (
    ServedModel,
    Serving,
    batch_times,
    describe,
    pass_times,
    served_model,
    truncated,
    weights_of,
)

# A GPU with round numbers, used at its peaks: 1e12 B/s, 1e14 FLOP/s.
ROUND_GPU = GpuPreset("round", "round-number GPU", 80 * 2**30, "test", hbm_bytes_per_s=1e12, bf16_flops=1e14)
SERVING = Serving(ROUND_GPU, Efficiency(hbm=1.0, mfu=1.0), prompt_len=100, output_len=200)  # mean context 200


def one_layer(name: str, k_in: int) -> ServedModel:
    """One full-attention layer with 1 KV head of dim 4 and 2 query heads; the linear
    weights are one (k_in x 1000) matrix: 1000·k_in parameters, nothing else."""
    layer = LayerSpec(FULL, kv_heads=1, head_dim=4, v_head_dim=4)
    shape = ModelShape(
        name, (layer,), num_attention_heads=2, hidden_size=8, params=ParamCount((LinearShape(k_in, 1000),), other=0)
    )
    return ServedModel(shape)


# Per sequence at context 200, by hand:
#   KV read: (K + V) 8 elements x 2 B x 200 tokens = 3,200 B
#   attention per new token: 2 FLOPs x 2 heads x (4 + 4) x 200 keys = 6,400 FLOPs
#   linear per token: 2 x params;  weights: 2 B x params
# target (1e6 params):
#   B=1:   memory (2e6 + 3,200) / 1e12 = 2.0032e-6 s;  compute q (2e6 + 6,400) / 1e14 = q 2.0064e-8 s
#   B=100: memory (2e6 + 320,000) / 1e12 = 2.32e-6 s;   compute q 100 (2,006,400) / 1e14 = q 2.0064e-6 s
# draft (1e5 params):
#   B=1:   memory (2e5 + 3,200) / 1e12 = 2.032e-7 s;  compute q (2e5 + 6,400) / 1e14 = q 2.064e-9 s
#   B=100: memory (2e5 + 320,000) / 1e12 = 5.2e-7 s;   compute q 100 (206,400) / 1e14 = q 2.064e-7 s
TARGET, DRAFT = one_layer("target", 1000), one_layer("draft", 100)


def test_pass_times_by_hand() -> None:
    assert pass_times(TARGET, SERVING, 1, 1) == (pytest.approx(2.0032e-6, rel=1e-12), "memory")
    assert pass_times(TARGET, SERVING, 1, 4)[0] == pytest.approx(2.0032e-6, rel=1e-12)  # 8.0e-8 of compute
    assert pass_times(TARGET, SERVING, 100, 1) == (pytest.approx(2.32e-6, rel=1e-12), "memory")
    assert pass_times(TARGET, SERVING, 100, 2) == (pytest.approx(2 * 2.0064e-6, rel=1e-12), "compute")
    assert pass_times(TARGET, SERVING, 100, 4) == (pytest.approx(4 * 2.0064e-6, rel=1e-12), "compute")
    assert pass_times(DRAFT, SERVING, 1, 2)[0] == pytest.approx(2.032e-7, rel=1e-12)
    assert pass_times(DRAFT, SERVING, 100, 1)[0] == pytest.approx(5.2e-7, rel=1e-12)
    assert pass_times(DRAFT, SERVING, 100, 2)[0] == pytest.approx(5.2e-7, rel=1e-12)  # 4.128e-7 of compute
    assert pass_times(DRAFT, SERVING, 100, 3)[0] == pytest.approx(3 * 2.064e-7, rel=1e-12)


def test_roofline_costs_by_hand() -> None:
    step, p = 2.32e-6, {0: 2.32e-6, 1: 2 * 2.0064e-6, 2: 3 * 2.0064e-6}
    costs = RooflineCosts(step, p, draft_step_s=5.2e-7, draft_catch_up_s=6e-7)
    assert costs.verify(0) == 1.0 and costs.verify(2) == pytest.approx(6.0192e-6 / 2.32e-6)
    assert costs.draft(0, True) == 0.0
    assert costs.draft(2, False) == pytest.approx(2 * 5.2e-7 / 2.32e-6)
    assert costs.draft(2, True) == pytest.approx((6e-7 + 5.2e-7) / 2.32e-6)


def request(
    serving: Serving, conc: tuple[int, ...], target: ServedModel, drafts: tuple, names: list[str], max_k: int
) -> ProjectionRequest:
    """What the CLI hands `profile`: sizing's pass times per concurrency and its inputs."""
    return ProjectionRequest(
        tuple(batch_times(serving, target, drafts, B, max_k) for B in conc),
        describe(serving, target, drafts, names, conc),
    )


def windows(alpha: float, k: int, n: int = 40) -> list[list[float]]:
    """One prompt's acceptance windows at constant acceptance α (n tokens generated)."""
    return [[alpha] * min(k, n - t - 1) for t in range(n)]


def test_projection_by_hand() -> None:
    alpha, ks = 0.8, [1, 2, 3]
    req = request(SERVING, (1, 100), TARGET, (DRAFT, None), ["draft", "lookup"], max(ks))
    acc = [{k: [windows(alpha, k)] for k in ks} for _ in range(2)]
    p = project(req, ["draft", "lookup"], [alpha, alpha], acc, ks)
    t1, t100 = p.target
    assert t1.step_ms == pytest.approx(2.0032e-3) and t1.verify_costs == pytest.approx({1: 1.0, 2: 1.0, 3: 1.0})
    v100 = {k: (k + 1) * 2.0064e-6 / 2.32e-6 for k in ks}  # 1.7297, 2.5945, 3.4593
    assert t100.verify_costs == pytest.approx(v100, rel=1e-9) and t100.bound == "memory"
    assert t100.verify_bound == {1: "compute", 2: "compute", 3: "compute"}
    c = {1: 2.032e-7 / 2.0032e-6, 100: 5.2e-7 / 2.32e-6}  # draft catch-up costs the same here
    v = {1: {k: 1.0 for k in ks}, 100: v100}
    model, lookup = p.drafts
    for B, row, free in [(B, r, f) for d, f in ((model, False), (lookup, True)) for B, r in zip((1, 100), d.rows)]:
        for r in row.per_k:
            draft = 0.0 if free else r.k * c[B]
            assert r.draft_cost == pytest.approx(draft, rel=1e-9, abs=1e-15)
            assert r.verify_cost == pytest.approx(v[B][r.k], rel=1e-9)
            assert r.alpha_speedup == pytest.approx(expected_tokens(alpha, r.k) / (draft + v[B][r.k]), rel=1e-9)
            # the sequence model over the same windows, with the same costs
            costs = RooflineCosts(
                *(2.0032e-6, {m: 2.0032e-6 for m in range(4)})
                if B == 1
                else (2.32e-6, {0: 2.32e-6, **{m: (m + 1) * 2.0064e-6 for m in ks}}),
                *((0.0, 0.0) if free else ((2.032e-7,) * 2 if B == 1 else (5.2e-7,) * 2)),
            )
            e = sequence_prediction(windows(alpha, r.k), r.k, costs)
            assert r.predicted_speedup == pytest.approx(e.tokens / e.cost, rel=1e-9)
        assert row.best_k == max(row.per_k, key=lambda r: (r.predicted_speedup, -r.k)).k
    # free draft, memory-bound: longer lookahead only helps; compute-bound at 100: k = 1 (1.8 / 1.73 > 2.44 / 2.59)
    assert [r.best_k for r in lookup.rows] == [3, 1]
    assert [r.best_k for r in model.rows] == [3, 1]


def preset(name: str) -> ServedModel:
    return served_model(model_presets()[name].config, name)


@pytest.mark.parametrize("flops, moves", [(None, True), (1e30, False)])
def test_best_k_falls_with_concurrency_when_verify_turns_compute_bound(flops, moves) -> None:
    """Llama-3.1-8B on an H100 with a free draft and its 4-layer truncation: memory-bound at
    batch 1 (v(k) = 1, a free draft's longest k wins), compute-bound verify passes at large
    batches push the best k down. With unlimited FLOP/s (the control) no pass is
    compute-bound and the free draft's best k stays the longest."""
    gpu = gpu_preset("H100-80GB")
    if flops is not None:
        gpu = GpuPreset(gpu.key, gpu.name, gpu.memory_bytes, gpu.source, gpu.hbm_bytes_per_s, flops, None, None)
    target = preset("llama-3.1-8b")
    alpha, ks, conc = 0.8, list(range(1, 9)), (1, 8, 32, 128, 512)
    req = request(
        Serving(gpu, Efficiency(), 512, 128), conc, target, (None, truncated(target, 4, "t4")), ["ngram", "t4"], 8
    )
    acc = [{k: [windows(alpha, k, 64)] for k in ks} for _ in range(2)]
    p = project(req, ["ngram", "t4"], [alpha, alpha], acc, ks)
    assert p.target[0].verify_costs[8] == pytest.approx(1.0, abs=0.01)  # batch 1: memory-bound
    assert not p.notes and all(r.fits for d in p.drafts for r in d.rows)
    free, t4 = ([r.best_k for r in d.rows] for d in p.drafts)
    if moves:
        for best in (free, t4):
            assert best == sorted(best, reverse=True) and best[-1] < best[0], best
        assert free[0] == 8 and p.target[-1].verify_bound[8] == "compute"
        assert p.target[-1].verify_costs[8] > 4  # nowhere near the v = 1 of the old model
    else:
        assert free == [8] * len(conc), free
        assert all(v == "memory" for t in p.target for v in t.verify_bound.values())


def test_too_many_sequences_are_flagged() -> None:
    target = preset("llama-3.1-8b")  # 16 GB of weights, 128 KiB of KV per token
    req = request(Serving(gpu_preset("H100-80GB"), Efficiency(), 4096, 4096), (1, 256), target, (None,), ["ngram"], 1)
    p = project(req, ["ngram"], [0.5], [{1: [windows(0.5, 1)]}], [1])
    assert [r.fits for r in p.drafts[0].rows] == [True, False]
    assert len(p.notes) == 1 and "concurrency 256" in p.notes[0] and "projected as if it fit" in p.notes[0]


def test_configs_to_served_models() -> None:
    cfg = dict(model_presets()["llama-3.1-8b"].config)
    ct = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 64}}},
    }
    assert weights_of(cfg) == ("bf16", 128)
    assert weights_of({"quantization_config": ct}) == ("int4", 64)
    fp8 = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}}
    assert weights_of({"quantization_config": fp8})[0] == "fp8"
    assert weights_of({"quantization_config": {"quant_method": "fp8"}})[0] == "fp8"
    assert weights_of({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}) == ("int4", 128)
    assert weights_of({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": -1}}) == ("int4", -1)
    for bad in ({"quant_method": "bitsandbytes"}, {"quant_method": "gptq", "bits": 3, "group_size": 128}):
        with pytest.raises(BadInput):
            weights_of({"quantization_config": bad})
    int4 = served_model({**cfg, "quantization_config": ct}, "int4")
    full = served_model(cfg, "full")
    assert int4.weights == "int4" and int4.weight_bytes < full.weight_bytes / 2.5
    # truncation against an independent route: the config itself with 4 layers
    four = shape_from_config({**cfg, "num_hidden_layers": 4}, "four")
    t4 = truncated(full, 4, "t4")
    assert t4.shape.num_layers == 4 and t4.shape.params == four.params and t4.shares_weights
    assert t4.weights == full.weights and not full.shares_weights
