"""Worker for test_ppl.py: the same tiny model and ids in every process; rank 0 writes
the result. Run alone (one process) or under `accelerate launch` (two)."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny import make_llama  # noqa: E402

from infer_tool.evals.ppl import evaluate_ppl  # noqa: E402

torch.manual_seed(0)
model = make_llama(300)
ids = torch.randint(0, 300, (900,))
r = evaluate_ppl(model, ids, 128)
world = int(os.environ.get("WORLD_SIZE", "1"))
if int(os.environ.get("RANK", "0")) == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"world": world, "nll_sum": r.nll_sum, "tokens": r.tokens, "windows": r.windows}, f)
if world > 1:
    from infer_tool.evals.ppl import finish_distributed

    finish_distributed()
