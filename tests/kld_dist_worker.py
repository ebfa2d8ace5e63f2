"""Worker for test_kld.py: the same tiny model pair and ids in every process; rank 0 writes
the result. Run alone (one process) or under `accelerate launch` (two)."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny import make_llama

from infer_tool.evals.kld import evaluate_kld

torch.manual_seed(0)
model, reference = make_llama(300, seed=0), make_llama(300, seed=1)
ids = torch.randint(0, 300, (900,))
r = evaluate_kld(model, reference, ids, 128)
world = int(os.environ.get("WORLD_SIZE", "1"))
if int(os.environ.get("RANK", "0")) == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"world": world, **r.to_dict()}, f)
if world > 1:
    from infer_tool.evals.ppl import finish_distributed

    finish_distributed()
