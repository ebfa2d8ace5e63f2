"""Speculative-decoding settings for the speed model: `--spec ALPHA,K,C` text, or the
best draft of a `spec-profile --json` report (its top-ranked draft at its best k)."""

from __future__ import annotations

import json
from pathlib import Path

from infer_tool.common.errors import BadInput
from infer_tool.sizing.roofline import Speculation


def parse_spec(text: str) -> Speculation:
    """`ALPHA,K,C`, e.g. `0.8,4,0.05`: acceptance rate, drafts per pass, draft/target cost."""
    parts = text.split(",")
    try:
        alpha, k, c = float(parts[0]), int(parts[1]), float(parts[2])
        if len(parts) != 3:
            raise ValueError
    except (ValueError, IndexError):
        raise BadInput(f"--spec {text!r} is not ALPHA,K,C; accepted: e.g. 0.8,4,0.05") from None
    return Speculation(alpha, k, c)


def from_report(path: str | Path) -> tuple[Speculation, str]:
    """The top-ranked draft of a spec-profile JSON report, and its name."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
        name = doc["ranking"][0]["name"]
        d = next(d for d in doc["drafts"] if d["name"] == name)
        return Speculation(float(d["alpha"]), int(d["best_k"]), float(d["cost_ratio"])), str(name)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"--spec-profile {p}: cannot read ({e.__class__.__name__}: {e})") from None
    except (KeyError, IndexError, TypeError, ValueError, StopIteration) as e:
        raise BadInput(
            f"--spec-profile {p}: not a spec-profile --json report (needs ranking[0].name and that draft's "
            f"alpha, best_k, cost_ratio; {e.__class__.__name__}: {e})"
        ) from None
