"""Speculative-decoding settings for the speed model: `--spec ALPHA,K,C` text, or the
top-ranked draft of a `spec-profile --json` report at its best k.

From a report: α and k are the draft's (`alpha`, `best_k`, chosen on the report's
`best_k_basis`). The draft cost c per drafted token comes from the report's roofline
projection when it has one (`projection.drafts[].rows[]`, at its lowest concurrency and
that k: the draft's GPU steps against the target's), else from `cost_ratio`, which is
measured on the machine the profile ran on (or given with `--cost-ratio`); a CPU's c
says little about a GPU, and the note says which one was used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.sizing.roofline import Speculation
from infer_tool.spec.ascii_numbers import ascii_float, ascii_int


def parse_spec(text: str) -> Speculation:
    """`ALPHA,K,C`, e.g. `0.8,4,0.05`: acceptance rate, drafts per pass, draft/target cost."""
    parts = text.split(",")
    alpha, k, c = (
        (ascii_float(parts[0]), ascii_int(parts[1]), ascii_float(parts[2])) if len(parts) == 3 else (None,) * 3
    )
    if alpha is None or k is None or c is None:
        raise BadInput(
            f"--spec {text!r} is not ALPHA,K,C; accepted: three finite numbers in ASCII digits, e.g. 0.8,4,0.05"
        )
    try:
        return Speculation(alpha, k, c)
    except BadInput as e:
        raise BadInput(f"--spec {text!r}: {e}") from None


def _projected(doc: dict[str, Any], name: str, k: int) -> tuple[float, str] | None:
    """(c, where from) from the report's projection for draft `name` at k, if any."""
    proj = doc.get("projection")
    if not proj:
        return None
    d = next(d for d in proj["drafts"] if d["name"] == name)
    rows = sorted(d["rows"], key=lambda r: int(r["concurrency"]))
    r = next(r for r in rows[0]["per_k"] if int(r["k"]) == k)
    best = ", ".join(f"{row['concurrency']}: k={row['best_k']}" for row in rows)
    gpu = proj["inputs"]["gpu"]
    how = (
        f"from the report's roofline projection on {gpu} at concurrency {rows[0]['concurrency']}; "
        f"that projection's best k per concurrency: {best}"
    )
    return float(r["cost_ratio"]), how


def from_report(path: str | Path) -> tuple[Speculation, str]:
    """The top-ranked draft of a spec-profile JSON report as a `Speculation`, and a note
    saying which draft and where each figure came from."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
        name = doc["ranking"][0]["name"]
        d = next(d for d in doc["drafts"] if d["name"] == name)
        alpha, k, basis = float(d["alpha"]), int(d["best_k"]), str(d.get("best_k_basis", "its"))
        projected = _projected(doc, name, k)
        if projected is not None:
            c, how = projected
        else:
            c = float(d["cost_ratio"])
            where = (doc.get("settings") or {}).get("device", "the profiling machine")
            how = (
                "given with --cost-ratio"
                if d.get("cost_source") == "given"
                else f"measured on {where} in its target steps (profile with --gpu for a roofline c)"
            )
        slower = bool(d.get("slower_than_plain", False))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"--spec-profile {p}: cannot read ({e.__class__.__name__}: {e})") from None
    except (KeyError, IndexError, TypeError, ValueError, StopIteration, AttributeError) as e:
        raise BadInput(
            f"--spec-profile {p}: not a spec-profile --json report (needs ranking[0].name and that draft's "
            f"alpha, best_k, cost_ratio; {e.__class__.__name__}: {e})"
        ) from None
    try:
        spec = Speculation(alpha, k, c)
    except BadInput as e:
        raise BadInput(f"--spec-profile {p}: draft {name}: {e}") from None
    note = (
        f"speculative decoding from --spec-profile: draft {name}, alpha {alpha:.3f}, k {k} (best by {basis} "
        f"speedup), c {c:.3g} {how}"
    )
    if slower:
        note += f"; the report found this draft slower than plain decoding at every k ({basis})"
    return spec, note
