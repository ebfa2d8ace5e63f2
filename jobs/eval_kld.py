"""The `eval kld` job: KL divergence of a model (a quantized checkpoint, typically) from a
reference model on the windows `eval ppl` scores, as a library function,
`evaluate(KldOptions) -> KldReport`.

Both models are loaded as `eval ppl` loads a model (`evals.load_model.load_for_eval`: whole,
on one device; `eval ppl` does not stream a model larger than memory, and neither does
this) and stay resident for the window loop; one window's logits of each are held at a
time. The token ids are the model's tokenizer's, as in `eval ppl`; the reference must have
the same vocabulary (token by token) and tokenize the corpus to the same ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.common.progress import Progress, no_progress
from infer_tool.jobs.eval_ppl import EvalOptions


@dataclass
class KldOptions:
    model: str
    reference: str
    data: str = EvalOptions.data
    text_field: str = EvalOptions.text_field
    seq_len: int = EvalOptions.seq_len
    max_tokens: int | None = EvalOptions.max_tokens
    stride: int | None = EvalOptions.stride
    dtype: str = EvalOptions.dtype
    device: str = EvalOptions.device
    kv_cache_dtype: str = EvalOptions.kv_cache_dtype  # the model's (see `eval ppl`); the reference's stays auto
    allow_pickle: bool = EvalOptions.allow_pickle
    trust_remote_code: bool = EvalOptions.trust_remote_code


@dataclass
class KldReport:
    model: str
    reference: str
    corpus: str
    result: Any  # evals.kld.KldResult
    backend: str
    reference_backend: str
    dtype: str
    device: str
    protocol: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """One flat document: the result's fields beside the run's."""
        d = asdict(self)
        return {
            "model": d["model"],
            "reference": d["reference"],
            "corpus": d["corpus"],
            **d["result"],
            **{k: d[k] for k in ("backend", "reference_backend", "dtype", "device", "protocol", "notes")},
        }


def check(opts: KldOptions) -> None:
    """Every option checked before any model is loaded (as `eval ppl` checks its own)."""
    from infer_tool.jobs.eval_ppl import check as check_ppl

    check_ppl(
        EvalOptions(
            opts.model,
            opts.data,
            opts.text_field,
            opts.seq_len,
            opts.max_tokens,
            opts.stride,
            opts.reference,
            opts.dtype,
            opts.device,
            opts.kv_cache_dtype,
            opts.allow_pickle,
            opts.trust_remote_code,
        )
    )


def first_vocab_difference(vocab: dict[str, int], other: dict[str, int]) -> tuple[int, str | None, str | None] | None:
    """(the lowest token id whose token differs, its token in `vocab`, in `other`), or None
    when the two token -> id maps are equal. A missing id is None."""
    if vocab == other:
        return None
    a, b = {i: t for t, i in vocab.items()}, {i: t for t, i in other.items()}
    for i in sorted(a.keys() | b.keys()):
        if a.get(i) != b.get(i):
            return i, a.get(i), b.get(i)
    raise AssertionError("unequal vocabularies with the same id -> token maps")  # unreachable for dicts


def _check_same_tokens(opts: KldOptions, tokenizer: Any, ref_tokenizer: Any, ids: Any, text: str) -> None:
    """Refuse a reference whose vocabulary or tokenization of the corpus differs, naming the first difference."""
    from infer_tool.calib.corpora import tokenize

    diff = first_vocab_difference(tokenizer.get_vocab(), ref_tokenizer.get_vocab())
    if diff is not None:
        i, mine, theirs = diff
        raise BadInput(
            f"--reference {opts.reference} has a different tokenizer than {opts.model}: token id {i} is "
            f"{mine!r} in {opts.model} but {theirs!r} in the reference; KL divergence needs one vocabulary"
        )
    ref_ids = tokenize(text, ref_tokenizer, opts.max_tokens)
    n = min(ids.numel(), ref_ids.numel())
    differ = (ids[:n] != ref_ids[:n]).nonzero()
    if differ.numel() or ids.numel() != ref_ids.numel():
        k = int(differ[0]) if differ.numel() else n
        mine = tokenizer.convert_ids_to_tokens(int(ids[k])) if k < ids.numel() else None
        theirs = ref_tokenizer.convert_ids_to_tokens(int(ref_ids[k])) if k < ref_ids.numel() else None
        raise BadInput(
            f"--reference {opts.reference} tokenizes {opts.data} differently from {opts.model}: token {k} is "
            f"{mine!r} in {opts.model} but {theirs!r} in the reference; KL divergence needs the same tokens"
        )


def evaluate(opts: KldOptions, *, progress: Progress | None = None) -> KldReport:
    """Load both models, tokenize, check they share the tokens, run the windows; the report."""
    check(opts)
    progress = progress or no_progress
    from infer_tool.calib.corpora import load_text, tokenize
    from infer_tool.calib.models import load_tokenizer, resolve_model_dir
    from infer_tool.common.device import pick_device, torch_dtype
    from infer_tool.evals.kld import PROTOCOL, evaluate_kld
    from infer_tool.evals.load_model import backend_of, load_for_eval
    from infer_tool.evals.ppl import finish_distributed

    dt, dev = torch_dtype(opts.dtype), pick_device(opts.device)
    loaded = load_for_eval(
        opts.model,
        dtype=dt,
        device=dev,
        allow_pickle=opts.allow_pickle,
        trust_remote_code=opts.trust_remote_code,
        kv_cache_dtype=opts.kv_cache_dtype,
    )
    text = load_text(opts.data, opts.text_field)
    ids = tokenize(text, loaded.tokenizer, opts.max_tokens)
    ref_dir, _ = resolve_model_dir(opts.reference, opts.allow_pickle)
    _check_same_tokens(opts, loaded.tokenizer, load_tokenizer(ref_dir, opts.trust_remote_code), ids, text)
    del text
    ref = load_for_eval(
        opts.reference, dtype=dt, device=dev, allow_pickle=opts.allow_pickle, trust_remote_code=opts.trust_remote_code
    )
    sizes = {getattr(m.model.config, "vocab_size", None) for m in (loaded, ref)}
    if len(sizes) != 1:
        raise BadInput(
            f"--reference {opts.reference} has vocab_size {ref.model.config.vocab_size} but {opts.model} "
            f"has {loaded.model.config.vocab_size}: the distributions are over different vocabularies"
        )
    notes = list(loaded.notes) + [f"reference: {n}" for n in ref.notes]
    seq_len = opts.seq_len
    contexts = [c for m in (loaded, ref) if (c := getattr(m.model.config, "max_position_embeddings", None))]
    if contexts and seq_len > min(contexts):
        notes.append(f"--seq-len {seq_len} capped at the models' context {min(contexts)}")
        seq_len = min(contexts)

    def labelled(task: str, done: int, total: int, **info: float) -> None:
        progress(f"{task} {opts.model}", done, total, **info)

    result = evaluate_kld(loaded.model, ref.model, ids, seq_len, stride=opts.stride, progress=labelled)
    finish_distributed()
    return KldReport(
        model=opts.model,
        reference=opts.reference,
        corpus=opts.data,
        result=result,
        backend=backend_of(loaded.model),
        reference_backend=backend_of(ref.model),
        dtype=opts.dtype,
        device=dev,
        protocol=PROTOCOL,
        notes=notes,
    )
