"""The PyPI auto-round side of `benchmarks/autoscheme_compare.py`: `AutoScheme` + quantization.

Runs under a Python that has auto-round installed (0.16.1: `pip install torch==2.13.0
auto-round==0.16.1`, in its own venv), so it imports nothing of infer-tool:

    PYTHON benchmarks/autoscheme_pypi.py --model-dir DIR --ids calib.safetensors \\
        --avg-bits 4.5 --options W4A16G64,W8A16G64,FP8_CHANNEL --iters 0 --out OUT

`AutoScheme(avg_bits, options)` scores every option on every linear (its delta loss: one forward
and backward pass per option over the calibration data, `auto_scheme/delta_loss.py`), chooses one
option per linear by its dynamic programme under the bit budget, then `AutoRound` quantizes each
linear with its option (`--iters 0`: round to nearest, as our RTN candidates; `--iters N`: its
sign-gradient tuning). auto-round 0.16's `iters=0` is by default an "optimized RTN" (a scale
search per group weighted by an activation importance matrix; about 50 s per decoder layer of
the demo model on two loaded cores); plain RTN (`disable_opt_rtn=True`) unless `--opt-rtn`.

Options are auto-round preset names, plus `FP8_CHANNEL`: per-output-channel e4m3 weights with
16-bit activations (`bits 8, data_type fp, group_size -1, act_bits 16`), the weights of our `FP8`
candidate (auto-round's `FPW8A16` preset is per tensor).

Calibration: the exact token ids infer-tool calibrates on (`input_ids` (B, T) int64 in a
safetensors file). AutoScheme takes its data only as a dataset *name* (a string, loaded from the
hub), so this script replaces auto-round's `get_dataloader` with one over those ids (all B rows,
T tokens each, batches of `--batch`, in order); AutoScheme's `nsamples` and `seqlen` are set to B
and T. Its per-scheme score cache (`AR_AUTO_SCHEME_CACHE`) is pointed at `--cache` (default: a
fresh temporary directory, so every run scores cold; give the same directory to a second run
at another `--avg-bits` to reuse the scores, whose time is then not a search's).

`--shared fused` passes `shared_layers` = q/k/v and gate/up of each block (one option per fused
linear, as vLLM loads it); the default `none` is AutoScheme's own default (each linear alone,
auto-round issue #2174).

Writes to `--out`:
- `model.safetensors` + `config.json` + tokenizer files: the model with every quantized linear's
  weight replaced by its dequantized value (what auto-round's quantization computed, read back
  from the model after `quantize()`), float32, no `quantization_config`: a plain checkpoint that
  `infer-tool eval kld` / `eval ppl` read. It computes the same logits as the packed checkpoint
  would under a dequantize-then-matmul kernel (what our evaluator does for packed checkpoints).
- `autoscheme.json`: per linear its option, auto-round's own bits for it, the chosen options'
  counts, AutoScheme's average bits (its accounting: `compute_layer_bits`), peak RSS, and times:
  `quantize_s` (AutoRound's constructor + `quantize()`: the search and the quantization) and
  `search_s` (AutoScheme's `get_layer_config` alone: scoring + its DP), wall and CPU seconds.

Prints one JSON line (the same summary without the per-linear table).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

FP8_CHANNEL = {"bits": 8, "group_size": -1, "sym": True, "data_type": "fp", "act_bits": 16}
FUSED = [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]


def option(name: str):
    """An auto-round option: a preset name, or FP8_CHANNEL (a QuantizationScheme)."""
    from auto_round.schemes import QuantizationScheme

    return QuantizationScheme.from_dict(FP8_CHANNEL) if name.upper() == "FP8_CHANNEL" else name.upper()


def ids_dataloader(ids, batch: int):
    """`get_dataloader`'s replacement: the calibration ids as auto-round's batches."""
    import torch
    from torch.utils.data import DataLoader

    rows = [{"input_ids": ids[i], "attention_mask": torch.ones_like(ids[i])} for i in range(ids.shape[0])]

    def collate(b):
        return {
            "input_ids": torch.stack([r["input_ids"] for r in b]),
            "attention_mask": torch.stack([r["attention_mask"] for r in b]),
        }

    return DataLoader(rows, batch_size=batch, shuffle=False, collate_fn=collate)


def layer_bits(cfg: dict, shape: tuple[int, int], ignore_scale_zp_bits: bool) -> float:
    """auto-round's own bits for a linear of weight `shape` (N, K) under scheme `cfg`: its
    `compute_layer_bits` on a weightless nn.Linear carrying the scheme's attributes."""
    import torch
    from auto_round.auto_scheme.utils import compute_layer_bits

    layer = torch.nn.Linear(shape[1], shape[0], bias=False, device="meta")
    for key in ("bits", "group_size", "data_type", "sym", "super_bits", "super_group_size"):
        setattr(layer, key, cfg.get(key))
    return compute_layer_bits(layer, ignore_scale_zp_bits)[0]


def scheme_key(cfg: dict) -> tuple:
    return (cfg.get("bits"), cfg.get("group_size"), cfg.get("data_type"), cfg.get("sym"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--ids", required=True)
    p.add_argument("--avg-bits", type=float, default=4.5)
    p.add_argument("--options", default="W4A16G64,W8A16G64,FP8_CHANNEL")
    p.add_argument("--iters", type=int, default=0, help="0: round to nearest; else AutoRound's tuning")
    p.add_argument(
        "--opt-rtn",
        action="store_true",
        help="with --iters 0, auto-round's default optimized RTN (an imatrix-weighted scale search per group); "
        "without it, plain RTN (disable_opt_rtn=True), the method of our RTN candidates",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--shared", choices=("none", "fused"), default="none")
    p.add_argument("--ignore-scale-zp-bits", action="store_true", help="AutoScheme's option of that name")
    p.add_argument("--cache", help="AutoScheme's score cache directory (default: a fresh temporary one)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    cache = args.cache or tempfile.mkdtemp(prefix="autoscheme-cache-")
    os.environ["AR_AUTO_SCHEME_CACHE"] = cache
    os.environ.setdefault("AR_ENABLE_AUTO_SCHEME_PARALLEL", "0")  # one CPU process, no GPU workers

    import auto_round.auto_scheme.delta_loss as delta_loss
    import auto_round.auto_scheme.gen_auto_scheme as gen_auto_scheme
    import auto_round.calib_dataset as calib_dataset
    import torch
    from auto_round import AutoRound, AutoScheme
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    ids = load_file(args.ids)["input_ids"]
    n, seq_len = ids.shape
    calls: list[tuple] = []

    def get_dataloader(tokenizer, seqlen, dataset_name=None, seed=42, bs=8, nsamples=512):
        calls.append((seqlen, bs, nsamples))
        if seqlen != seq_len or nsamples != n:
            raise RuntimeError(f"auto-round asked for {nsamples} x {seqlen} tokens; the ids are {n} x {seq_len}")
        return ids_dataloader(ids, bs)

    delta_loss.get_dataloader = get_dataloader
    calib_dataset.get_dataloader = get_dataloader
    search: dict[str, float] = {}
    get_layer_config = gen_auto_scheme.GenScheme.get_layer_config

    def timed_get_layer_config(self):  # AutoScheme's search alone: scoring + its DP
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            return get_layer_config(self)
        finally:
            search.update(search_s=time.perf_counter() - w0, search_cpu_s=time.process_time() - c0)

    gen_auto_scheme.GenScheme.get_layer_config = timed_get_layer_config

    src = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    original = {k: v.clone() for k, v in src.state_dict().items()}
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    options = [option(o) for o in args.options.split(",") if o.strip()]
    scheme = AutoScheme(
        avg_bits=args.avg_bits,
        options=options,
        shared_layers=FUSED if args.shared == "fused" else None,
        ignore_scale_zp_bits=args.ignore_scale_zp_bits,
        nsamples=n,
        seqlen=seq_len,
        batch_size=args.batch,
        device_map="cpu",
        enable_torch_compile=False,
    )
    cpu0, t0 = time.process_time(), time.perf_counter()
    ar = AutoRound(
        src,
        tok,
        scheme=scheme,
        dataset="infer-tool-calibration-ids",  # a name only: get_dataloader above serves the ids
        iters=args.iters,
        nsamples=n,
        seqlen=seq_len,
        batch_size=args.batch,
        device_map="cpu",
        enable_torch_compile=False,
        amp=False,
        **({} if args.iters or args.opt_rtn else {"disable_opt_rtn": True}),
    )
    model, layer_config = ar.quantize()
    t1, cpu1 = time.perf_counter(), time.process_time()

    # the dequantized weights as the quantization left them (qdq in place: no format given, so no packing)
    state = model.state_dict()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tensors, changed = {}, []
    for k, v in original.items():
        if k not in state:
            raise SystemExit(f"the quantized model has no tensor {k!r}: auto-round packed or renamed it")
        w = state[k].detach().to(torch.float32).contiguous()
        if not torch.equal(w, v.to(torch.float32)):
            changed.append(k)
        tensors[k] = w
    if getattr(src.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in Path(args.model_dir).iterdir():
        if f.is_file() and (
            f.name.startswith(("tokenizer", "special_tokens", "generation_config")) or f.suffix == ".jinja"
        ):
            shutil.copy(f, out / f.name)

    linears, counts = {}, {}
    labels = {}
    for o, o_name in zip(options, [x.strip().upper() for x in args.options.split(",") if x.strip()]):
        from dataclasses import asdict

        from auto_round.schemes import preset_name_to_scheme

        d = asdict(preset_name_to_scheme(o)) if isinstance(o, str) else asdict(o)
        labels[scheme_key(d)] = o_name
    total_bits = total_params = 0
    for name, c in sorted(layer_config.items()):
        bits = c.get("bits", 16)
        if bits is None or bits >= 16:
            continue
        lb = layer_bits(c, tuple(original[f"{name}.weight"].shape), args.ignore_scale_zp_bits)
        label = labels.get(scheme_key(c), json.dumps({k: c.get(k) for k in ("bits", "group_size", "data_type", "sym")}))
        linears[name] = {
            "option": label,
            "bits": c.get("bits"),
            "group_size": c.get("group_size"),
            "data_type": c.get("data_type"),
            "sym": c.get("sym"),
            "autoround_bits_per_weight": lb / original[f"{name}.weight"].numel(),
            "changed": f"{name}.weight" in changed,
        }
        counts[label] = counts.get(label, 0) + 1
        total_bits += lb
        total_params += original[f"{name}.weight"].numel()
    summary = {
        "avg_bits_target": args.avg_bits,
        "options": [x.strip().upper() for x in args.options.split(",") if x.strip()],
        "shared": args.shared,
        "iters": args.iters,
        "rtn": None if args.iters else ("optimized (auto-round's default)" if args.opt_rtn else "plain"),
        "ignore_scale_zp_bits": args.ignore_scale_zp_bits,
        "calibration": {"samples": n, "seq_len": seq_len, "dataloader_calls": calls},
        "autoround_avg_bits": total_bits / total_params if total_params else None,
        "quantized_linears": len(linears),
        "weights_changed": len(changed),
        "counts": counts,
        "quantize_s": t1 - t0,
        "quantize_cpu_s": cpu1 - cpu0,
        **search,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "cache": cache,
        "auto_round": __import__("auto_round").__version__,
        "torch": torch.__version__,
    }
    (out / "autoscheme.json").write_text(json.dumps({**summary, "linears": linears}, indent=2))
    if not args.cache:
        shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
