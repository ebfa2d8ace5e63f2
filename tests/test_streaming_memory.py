"""A model whose weights are larger than the memory the process may use is quantized by
streaming it layer by layer; loading it whole under the same limit fails.

The limit is RLIMIT_DATA, set in the child process before it imports anything: it caps the
process's private writable memory (heap, anonymous maps, thread stacks: what holds tensors)
and leaves read-only file mappings out. The model (random weights, fp32, 1.2 GB) is bigger
than the limit (800 MiB, of which the runtime takes about 450). Only q_proj is quantized
(the other linears are --ignore'd and copied as they are), on 8 x 64 tokens, so the run is
mostly reading and writing. (Activations churn malloc's heap, which keeps freed space as
address space: RLIMIT_DATA counts that, RSS does not; small ones keep the test about the
weights.)
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny import TEXT, make_tokenizer

LIMIT_MIB = 800
LAYERS, HIDDEN, INTER = 18, 1024, 4096  # 16.8 M parameters (67 MB) a layer: 1.21 GB in all

LIMITED = textwrap.dedent("""
    import resource, sys
    limit = int(sys.argv[1]) * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    from infer_tool.cli.app import main
    main(sys.argv[2:])
""")


def _write_random_llama(path: Path) -> int:
    """A Llama with N(0, 0.02) weights written one tensor at a time (this process never
    holds the model either); returns the bytes of its weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from infer_tool.packers.safetensors_stream import TensorSpec, write_streamed

    tok = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    specs = [TensorSpec(n, torch.float32, tuple(t.shape)) for n, t in model.state_dict().items()]
    shapes = {s.name: s.shape for s in specs}
    g = torch.Generator().manual_seed(0)

    def load(name: str) -> torch.Tensor:
        return (
            torch.ones(shapes[name]) if name.endswith("norm.weight") else torch.randn(shapes[name], generator=g) * 0.02
        )

    path.mkdir()
    write_streamed(path / "model.safetensors", specs, load, {"format": "pt"})
    config.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(s.nbytes for s in specs)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = tmp_path_factory.mktemp("big")
    assert _write_random_llama(w / "model") > 1.4 * LIMIT_MIB * 2**20
    (w / "calib.txt").write_text(TEXT * 10)
    (w / "limited.py").write_text(LIMITED)
    return w


def _quantize(w: Path, out: str, *extra: str) -> subprocess.CompletedProcess:
    argv = [
        "quantize",
        str(w / "model"),
        "--out",
        str(w / out),
        "--calib",
        str(w / "calib.txt"),
        "--method",
        "rtn",
        "--group-size",
        "128",
        "--ignore",
        "*.mlp.*",
        "--ignore",
        "re:self_attn\\.[kvo]_proj",
        "--no-progress",
        "--device",
        "cpu",
        "--max-memory",
        "100GiB",
        "--num-samples",
        "8",
        "--seq-len",
        "64",
        *extra,
    ]
    return subprocess.run(
        [sys.executable, str(w / "limited.py"), str(LIMIT_MIB), *argv], capture_output=True, text=True, timeout=900
    )


def test_whole_model_does_not_fit_the_limit(big):
    proc = _quantize(big, "whole", "--no-stream")
    assert proc.returncode != 0
    assert "allocate" in proc.stderr or "memory" in proc.stderr.lower(), proc.stderr


def test_streamed_model_fits_the_limit(big):
    from safetensors import safe_open

    from infer_tool.packers.checkpoint import read_checkpoint

    proc = _quantize(big, "streamed")
    assert proc.returncode == 0, proc.stderr
    config, layers, rest = read_checkpoint(big / "streamed")
    assert sorted(layers) == [f"model.layers.{i}.self_attn.q_proj" for i in sorted(range(LAYERS), key=str)]
    with safe_open(str(big / "model" / "model.safetensors"), "pt") as src:
        for i in (0, LAYERS - 1):  # an ignored linear is copied bit for bit; q_proj is RTN of the source
            name = f"model.layers.{i}.mlp.down_proj.weight"
            assert torch.equal(rest[name], src.get_tensor(name))
            w = src.get_tensor(f"model.layers.{i}.self_attn.q_proj.weight")
            err = (layers[f"model.layers.{i}.self_attn.q_proj"].dequantize() - w).norm() / w.norm()
            assert err < 0.15  # 4-bit RTN of a Gaussian in 128-groups: about 0.1
        assert torch.equal(rest["lm_head.weight"], src.get_tensor("lm_head.weight"))
