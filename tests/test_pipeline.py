"""The calibration pipeline on tiny random models of every architecture in the table.

References are independent of the pipeline: the model's own forward (hooks on its last
decoder layer), Hessians recomputed from inputs captured by plain hooks, and the block
output before/after folding AWQ scales.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from infer_tool.calib.architectures import ARCHITECTURES, architecture_for
from infer_tool.calib.layers import decoder_layers, linear_shapes, weight_nk
from infer_tool.calib.pipeline import collect_stats, quantize_from_stats, quantize_model
from infer_tool.calib.quantizers.awq import fold_scales, smooth_channels
from infer_tool.calib.stats import StatsAccumulator, load_stats, relative_output_error, save_stats
from infer_tool.common.errors import BadInput
from infer_tool.schemes.registry import make_scheme

V, T, B = 96, 24, 6


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # noqa: ANN201
    """Tiny tensors: a thread pool's barriers cost more than they save, and stall badly
    when the cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _config(model_type: str):  # noqa: ANN202
    import transformers as tf

    common = dict(vocab_size=V, num_hidden_layers=2)
    llama_like = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **common)
    if model_type == "llama":
        return tf.LlamaConfig(**llama_like)
    if model_type == "mistral":
        return tf.MistralConfig(**llama_like, sliding_window=None)
    if model_type == "qwen2":
        return tf.Qwen2Config(**llama_like)
    if model_type == "qwen3":
        return tf.Qwen3Config(**llama_like, head_dim=16)
    if model_type == "gemma2":
        return tf.Gemma2Config(**llama_like, head_dim=16, sliding_window=8)
    if model_type == "gemma3_text":
        return tf.Gemma3TextConfig(
            **llama_like, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
        )
    if model_type == "phi3":  # MHA: the fused qkv -> o_proj mapping applies
        return tf.Phi3Config(**{**llama_like, "num_key_value_heads": 4}, pad_token_id=0)
    if model_type == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=64)
    if model_type == "opt":
        return tf.OPTConfig(
            hidden_size=64,
            ffn_dim=128,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=V,
            word_embed_proj_dim=64,
            max_position_embeddings=64,
            pad_token_id=1,
        )
    raise KeyError(model_type)


def tiny_model(model_type: str, seed: int = 0) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(model_type), attn_implementation="eager").eval()
    # Real LLMs have a few input channels with large activations (what AWQ protects):
    # give the norms feeding the first linears such outliers, deterministically.
    arch = architecture_for(model_type)
    with torch.no_grad():
        for layer in decoder_layers(model, arch):
            norm = layer.get_submodule(arch.mappings[0].smooth)
            boost = torch.ones_like(norm.weight)
            boost[::16] = 8.0
            norm.weight.mul_(boost) if arch.norm_offset == 0 else norm.weight.copy_((1 + norm.weight) * boost - 1)
    return model


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def last_layer_output(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    arch = architecture_for(model.config.model_type)
    outs = []
    layer = decoder_layers(model, arch)[-1]
    h = layer.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        model(input_ids=input_ids, use_cache=False)
    h.remove()
    return outs[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


TYPES = sorted(k for k, v in ARCHITECTURES.items() if v.moe is None)  # MoE families: tests/test_moe*.py


@pytest.mark.parametrize("model_type", TYPES)
def test_fp_propagation_matches_model_forward(model_type: str) -> None:
    """Capture + layer-by-layer replay, chunked (batch 4 of 6: an uneven last chunk), gives
    the model's own last-layer output (masks, rotary tables, sliding windows per layer)."""
    model = tiny_model(model_type)
    x = ids()
    ref = last_layer_output(model, x)
    result = collect_stats(model, x, batch_size=4, device="cpu")
    assert not result.quantized
    # The pipeline leaves the model untouched in calibrate mode: re-running it still matches.
    got = []
    layer = decoder_layers(model, architecture_for(model_type))[-1]
    h = layer.register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
    from infer_tool.calib.layers import capture_inputs, run_layer

    arch = architecture_for(model_type)
    X, calls = capture_inputs(model, arch, x, 4, torch.device("cpu"))
    for i, lay in enumerate(decoder_layers(model, arch)):
        X = run_layer(lay, X, calls[i])
    h.remove()
    assert rel(torch.cat(X), ref) < 1e-5
    # Every linear in the table got statistics with the right width and token count.
    for name, st in result.stats.items():
        assert st.tokens == B * T, name
        assert st.H is not None and st.H.shape == (st.in_features, st.in_features)


@pytest.mark.parametrize("model_type", TYPES)
def test_awq_fold_keeps_block_function(model_type: str) -> None:
    """Folding random scales (norm, Gemma's 1 + w norm, fused-qkv part, Conv1D) leaves each
    decoder layer's output unchanged to fp32 rounding."""
    model = tiny_model(model_type)
    arch = architecture_for(model_type)
    x = ids()
    ref = last_layer_output(model, x)
    g = torch.Generator().manual_seed(3)
    folded = 0
    for layer in decoder_layers(model, arch):
        for m in arch.mappings:
            smooth = layer.get_submodule(m.smooth)
            balance = [layer.get_submodule(b) for b in m.balance]
            K = weight_nk(balance[0], arch.conv1d).shape[1]
            if smooth_channels(smooth, arch) != K * (m.part[1] if m.part else 1):
                continue
            s = torch.rand(K, generator=g) * 3 + 0.25
            fold_scales(smooth, balance, s, m, arch)
            folded += 1
    assert folded >= 2 * 2
    assert rel(last_layer_output(model, x), ref) < 1e-4


@pytest.mark.parametrize("model_type", TYPES)
def test_quantize_all_methods_run_and_gptq_beats_rtn(model_type: str) -> None:
    x = ids()
    ref = last_layer_output(tiny_model(model_type), x)
    errors = {}
    for method in ("rtn", "gptq", "awq"):
        model = tiny_model(model_type)
        scheme = make_scheme(method, group_size=32)
        r = quantize_model(model, x, scheme, batch_size=4, device="cpu")
        arch = architecture_for(model_type)
        assert len(r.quantized) == 2 * len(arch.linears)
        for name, qw in r.quantized.items():
            # the model now holds exactly the dequantized weights
            W = weight_nk(model.get_submodule(name), arch.conv1d)
            assert torch.equal(W, qw.dequantize(W.dtype)), name
        errors[method] = rel(last_layer_output(model, x), ref)
        assert r.layer_errors[-1].relative_output_error > 0
    assert errors["gptq"] < errors["rtn"], errors
    assert errors["awq"] < errors["rtn"], errors


def test_data_free_rtn_runs_only_the_error_samples() -> None:
    """RTN reads no activations: the weights equal RTN of the fp weights whatever the
    batch, and only ERROR_SAMPLES sequences go through the layers (the error's)."""
    from infer_tool.calib.pipeline import ERROR_SAMPLES
    from infer_tool.packers.rtn import quantize_rtn

    x = torch.randint(0, V, (ERROR_SAMPLES + 8, 16), generator=torch.Generator().manual_seed(3))
    model = tiny_model("llama")
    scheme = make_scheme("rtn", group_size=32)
    fp = {
        n: weight_nk(model.get_submodule(n), False).detach().clone()
        for n in linear_shapes(model, architecture_for("llama"))
    }
    r = quantize_model(model, x, scheme, batch_size=4, device="cpu")
    assert r.tokens == ERROR_SAMPLES * 16
    for name, qw in r.quantized.items():
        assert torch.equal(qw.q, quantize_rtn(fp[name], None, scheme).q), name


def test_gptq_true_sequential_hessians() -> None:
    """o_proj's Hessian is measured after q/k/v were quantized, and down_proj's after
    gate/up: recomputed here from the model with those weights replaced by hand."""
    model = tiny_model("llama")
    fp = copy.deepcopy(model)
    x = ids()
    r = quantize_model(model, x, make_scheme("gptq", group_size=32), batch_size=4, device="cpu")
    arch = architecture_for("llama")
    p = "model.layers.0"
    # Layer 0 inputs are fp; set q/k/v (and for down: q/k/v/o/gate/up) to the quantized values.
    for upto, probe in (
        (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.o_proj"),
        (
            (
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "mlp.gate_proj",
                "mlp.up_proj",
            ),
            "mlp.down_proj",
        ),
    ):
        m = copy.deepcopy(fp)
        with torch.no_grad():
            for n in upto:
                m.get_submodule(f"{p}.{n}").weight.copy_(r.quantized[f"{p}.{n}"].dequantize())
        acc = StatsAccumulator(m.get_submodule(f"{p}.{probe}").in_features)
        h = m.get_submodule(f"{p}.{probe}").register_forward_pre_hook(lambda mod, a, acc=acc: acc.add(a[0]))
        with torch.no_grad():
            m(input_ids=x, use_cache=False)
        h.remove()
        H_ref = acc.result().H
        assert rel(r.stats[f"{p}.{probe}"].H, H_ref) < 1e-5, probe
        # and it differs from the fp Hessian (the test would pass vacuously otherwise)
        acc_fp = StatsAccumulator(H_ref.shape[0])
        h = fp.get_submodule(f"{p}.{probe}").register_forward_pre_hook(lambda mod, a, acc_fp=acc_fp: acc_fp.add(a[0]))
        with torch.no_grad():
            fp(input_ids=x, use_cache=False)
        h.remove()
        assert rel(acc_fp.result().H, H_ref) > 1e-4, probe
    assert arch.groups[0] == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def test_stats_roundtrip_and_reuse(tmp_path) -> None:  # noqa: ANN001
    model = tiny_model("qwen2")
    x = ids()
    cal = collect_stats(model, x, batch_size=4, device="cpu")
    save_stats(cal.stats, tmp_path / "stats", meta={"model": "tiny"})
    with pytest.raises(BadInput):
        save_stats(cal.stats, tmp_path / "stats", meta={})
    loaded, meta = load_stats(tmp_path / "stats")
    assert meta == {"model": "tiny"}
    assert set(loaded) == set(cal.stats)
    for name, st in cal.stats.items():
        assert torch.equal(loaded[name].H, st.H) and torch.equal(loaded[name].act_abs_mean, st.act_abs_mean)
        assert loaded[name].tokens == st.tokens and loaded[name].act_abs_max == st.act_abs_max
    q = "model.layers.0.self_attn.q_proj"
    assert loaded[q] is loaded["model.layers.0.self_attn.v_proj"]  # shared input, stored once

    # Hessian against a direct computation: H = 2 XᵀX / T of q_proj's inputs
    xs = []
    h = model.get_submodule(q).register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, 64)))
    with torch.no_grad():
        model(input_ids=x, use_cache=False)
    h.remove()
    X = torch.cat(xs).double()
    assert rel(loaded[q].H.double(), 2 * X.T @ X / X.shape[0]) < 1e-6
    assert rel(loaded[q].act_abs_mean.double(), X.abs().mean(0)) < 1e-6

    # Reuse: GPTQ from saved stats; layer 0's first group saw fp inputs in both runs,
    # so its result equals the live pipeline's; later groups differ (true-sequential lost).
    reused = quantize_from_stats(copy.deepcopy(model), loaded, make_scheme("gptq", group_size=32), device="cpu")
    live = quantize_model(copy.deepcopy(model), x, make_scheme("gptq", group_size=32), batch_size=4, device="cpu")
    assert torch.equal(reused.quantized[q].q, live.quantized[q].q)
    d = "model.layers.1.mlp.down_proj"
    assert not torch.equal(reused.quantized[d].q, live.quantized[d].q)
    assert set(reused.linear_errors) == set(reused.quantized)
    with pytest.raises(BadInput, match="AWQ"):
        quantize_from_stats(model, loaded, make_scheme("awq", group_size=32))


def test_relative_output_error_from_hessian() -> None:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(500, 32, generator=g)
    W, W_hat = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    H = 2 * X.T @ X / 500
    direct = float((X @ (W_hat - W).T).norm() / (X @ W.T).norm())
    assert abs(relative_output_error(W, W_hat, H) - direct) < 1e-4 * direct


def test_unknown_architecture_and_bad_group_size() -> None:
    model = tiny_model("llama")
    model.config.model_type = "mamba"
    with pytest.raises(BadInput, match="calib/architectures.py"):
        quantize_model(model, ids(), make_scheme("rtn"))
    model.config.model_type = "llama"
    with pytest.raises(BadInput, match="does not divide"):
        quantize_model(model, ids(), make_scheme("rtn", group_size=48))


def test_ignore_patterns_leave_layers_unquantized() -> None:
    model = tiny_model("llama")
    before = model.get_submodule("model.layers.1.mlp.down_proj").weight.clone()
    r = quantize_model(
        model, ids(), make_scheme("awq", group_size=32), ignore=("*.1.mlp.down_proj", "re:layers\\.0\\.self_attn\\.o")
    )
    assert "model.layers.1.mlp.down_proj" not in r.quantized and "model.layers.0.self_attn.o_proj" not in r.quantized
    assert r.ignored == ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"]
    assert torch.equal(model.get_submodule("model.layers.1.mlp.down_proj").weight, before)
    assert any(e.get("skipped", "").startswith("a balance layer") for e in r.method_report["awq"])


@pytest.mark.parametrize("model_type", TYPES)
def test_gptq_replay_changes_nothing(model_type: str, monkeypatch) -> None:  # noqa: ANN001
    """Replaying attention / MLP outputs from cache once their last linear is quantized gives
    bit-identical GPTQ results to re-running them (replay off: no replay points found)."""
    from infer_tool.calib.layers import capture_inputs, run_layer
    from infer_tool.calib.quantizers import gptq
    from infer_tool.calib.replay import replay_points

    x = ids()
    scheme = make_scheme("gptq", group_size=32)
    arch = architecture_for(model_type)
    model = tiny_model(model_type)
    X, calls = capture_inputs(model, arch, x, 4, torch.device("cpu"))
    layer = decoder_layers(model, arch)[0]
    _, points = replay_points(layer, arch, X, calls[0])
    # Every architecture replays its attention; MLPs that are a sub-block replay too (OPT's fc1/fc2 are not).
    parents = {arch.groups[g][0].rpartition(".")[0] for g in points}
    assert "self_attn" in parents or "attn" in parents, parents
    if model_type != "opt":
        assert "mlp" in parents, parents

    replayed = quantize_model(tiny_model(model_type), x, scheme, batch_size=4, device="cpu")
    monkeypatch.setattr(gptq, "replay_points", lambda layer, arch, X, calls: (run_layer(layer, X, calls), {}))
    plain = quantize_model(tiny_model(model_type), x, scheme, batch_size=4, device="cpu")
    assert replayed.quantized.keys() == plain.quantized.keys()
    for name, qw in replayed.quantized.items():
        assert torch.equal(qw.q, plain.quantized[name].q), name
        assert torch.equal(qw.scale, plain.quantized[name].scale), name
        assert torch.equal(replayed.stats[name].H, plain.stats[name].H), name
    assert replayed.layer_errors == plain.layer_errors


@pytest.mark.parametrize("K, block", [(300, 64), (64, 256), (96, 32)])
def test_stats_accumulator_against_fp64(K: int, block: int) -> None:
    """The block-triangular Hessian sum, mirrored, equals 2·XᵀX/T computed in fp64 in one go
    (K not a multiple of the block, chunks that split the tokens unevenly)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 11, K, generator=g) * torch.rand(K, generator=g) * 4  # uneven channel scales
    acc = StatsAccumulator(K, chunk_tokens=7, block=block)
    acc.add(x[:2])
    acc.add(x[2])
    st = acc.result()
    flat = x.reshape(-1, K).double()
    H_ref = 2 * flat.T @ flat / flat.shape[0]
    assert st.tokens == 33
    assert torch.allclose(st.H.double(), H_ref, rtol=1e-5, atol=1e-5 * float(H_ref.abs().max()))
    assert torch.equal(st.H, st.H.T)
    assert torch.allclose(st.act_abs_mean.double(), flat.abs().mean(0), rtol=1e-6)
    assert st.act_abs_max == pytest.approx(float(flat.abs().max()), rel=1e-7)
    assert torch.equal(st.act_abs_max_channel, x.reshape(-1, K).abs().amax(0))  # a max is exact
    assert st.act_abs_max == float(st.act_abs_max_channel.max())


def test_saved_stats_keep_channel_maxima_and_version_1_still_loads(tmp_path) -> None:  # noqa: ANN001
    """Statistics version 2 stores max |x_j| per channel; a version-1 directory (no such tensor)
    still loads, with `act_abs_max_channel` None."""
    import json

    from safetensors.torch import load_file, save_file

    from infer_tool.calib.stats import STATS_INDEX, saved_version

    cal = collect_stats(tiny_model("llama"), ids(), batch_size=4, device="cpu")
    out = save_stats(cal.stats, tmp_path / "v2", meta={})
    assert saved_version(out) == 2
    loaded, _ = load_stats(out)
    for name, st in cal.stats.items():
        assert torch.equal(loaded[name].act_abs_max_channel, st.act_abs_max_channel)
    # the same directory as version 1 wrote it
    index = json.loads((out / STATS_INDEX).read_text())
    index["version"] = 1
    (out / STATS_INDEX).write_text(json.dumps(index))
    tensors = {
        k: v for k, v in load_file(str(out / "stats.safetensors")).items() if not k.endswith("act_abs_max_channel")
    }
    save_file(tensors, str(out / "stats.safetensors"))
    old, _ = load_stats(out)
    assert saved_version(out) == 1
    assert all(st.act_abs_max_channel is None for st in old.values())
    assert all(torch.equal(old[n].H, st.H) for n, st in cal.stats.items())
    index["version"] = 3
    (out / STATS_INDEX).write_text(json.dumps(index))
    with pytest.raises(BadInput, match="version 3 is not one of"):
        load_stats(out)


def test_stats_of_divided_inputs_are_exact() -> None:
    """`LayerStats.divided(s)`: the statistics of x / s equal those measured on x / s."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 48, generator=g) * torch.rand(48, generator=g) * 3
    s = torch.rand(48, generator=g) * 4 + 0.1
    a, b = StatsAccumulator(48), StatsAccumulator(48)
    a.add(x)
    b.add(x / s)
    got, want = a.result().divided(s), b.result()
    assert rel(got.H.double(), want.H.double()) < 1e-5
    assert rel(got.act_abs_mean.double(), want.act_abs_mean.double()) < 1e-6
    torch.testing.assert_close(got.act_abs_max_channel, want.act_abs_max_channel, rtol=1e-6, atol=0)
    assert got.act_abs_max == pytest.approx(want.act_abs_max, rel=1e-6) and got.tokens == 200


def test_flushed_denormals_flush_inside_and_restore_after() -> None:
    """Inside `flushed_denormals` a float32 subnormal reads as zero; after it (even after an
    error inside), subnormals are kept again."""
    from infer_tool.calib.pipeline import flushed_denormals

    subnormal = torch.tensor([1e-39], dtype=torch.float32)
    assert float(subnormal * 1.0) != 0.0
    with flushed_denormals():
        assert float(subnormal * 1.0) == 0.0
    assert float(subnormal * 1.0) != 0.0
    with pytest.raises(RuntimeError), flushed_denormals():
        raise RuntimeError("inside")
    assert float(subnormal * 1.0) != 0.0
