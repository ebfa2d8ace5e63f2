"""The smallest deployments that serve a target: GPU preset x GPU count x TP/PP split
(TP dividing the attention heads and fitting the KV heads, PP at most the layers, the
rest data-parallel replicas) x weight dtype x KV dtype, each checked with `fit.Fit` and,
given a latency target, `roofline`. Ranked by GPUs, then KV headroom, then TPOT.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from infer_tool.common.errors import BadInput
from infer_tool.sizing import roofline
from infer_tool.sizing.capacity import Deployment, validate
from infer_tool.sizing.defaults import DEFAULT_OUTPUT_LEN
from infer_tool.sizing.fit import Fit
from infer_tool.sizing.kv import ceil_div, kv_dtype
from infer_tool.sizing.presets import GpuPreset
from infer_tool.sizing.shape import ModelShape
from infer_tool.sizing.vllm_kv import EngineArgs
from infer_tool.sizing.weights import weight_bytes

GPU_COUNTS = (1, 2, 4, 8, 16)  # 16 = two 8-GPU nodes
MAX_TP = 8  # tensor parallelism stays inside one node
SOLVE_WEIGHTS = ("bf16", "fp8", "int4")
SOLVE_KV = ("bf16", "fp8")


@dataclass(frozen=True)
class Target:
    context: int
    concurrency: int
    max_tpot_s: float | None = None
    max_ttft_s: float | None = None
    prompt_len: int | None = None  # None: the context less the output
    output_len: int = DEFAULT_OUTPUT_LEN


@dataclass(frozen=True)
class Candidate:
    gpu: str
    num_gpus: int
    tp: int
    pp: int
    weights: str
    kv_dtype: str
    headroom: float  # share of the KV budget left at the target
    max_concurrency: int  # at the target context
    speed: roofline.StepTimes | None

    @property
    def dp(self) -> int:
        return self.num_gpus // (self.tp * self.pp)

    def flags(self) -> str:
        return (
            f"--gpu {self.gpu} --num-gpus {self.num_gpus} --tp {self.tp} --pp {self.pp} "
            f"--weights {self.weights} --kv-dtype {self.kv_dtype}"
        )


def splits(shape: ModelShape, num_gpus: int) -> list[tuple[int, int]]:
    """(tp, pp) pairs with tp x pp dividing num_gpus that vLLM accepts for this model."""
    out = []
    for tp in (t for t in (1, 2, 4, 8) if t <= MAX_TP):
        for pp in (p for p in (1, 2, 4, 8, 16) if tp * p <= num_gpus and num_gpus % (tp * p) == 0):
            try:
                validate(shape, Deployment(1, num_gpus, tp, pp, kv_dtype("bf16")))
            except BadInput:
                continue
            out.append((tp, pp))
    return out


def speed_of(
    shape: ModelShape,
    gpu: GpuPreset,
    target: Target,
    *,
    weights: str,
    kv: str,
    tp: int,
    pp: int,
    dp: int,
    weight_total: int,
    spec: roofline.Speculation | None = None,
    eff: roofline.Efficiency = roofline.Efficiency(),
) -> roofline.StepTimes | None:
    """Step times at the target (None for a GPU without datasheet speed figures)."""
    if not gpu.has_speed:
        return None
    output = min(target.output_len, max(1, target.context - 1))
    prompt = target.prompt_len or max(1, target.context - output)
    work = roofline.Workload(prompt, output, ceil_div(target.concurrency, dp), spec)
    return roofline.step_times(
        shape,
        roofline.Hardware.from_preset(gpu),
        work,
        weights=weights,
        kv=kv,
        tp=tp,
        pp=pp,
        weight_total=weight_total,
        eff=eff,
    )


def solve(
    shape: ModelShape,
    gpus: list[GpuPreset],
    target: Target,
    base: Deployment,
    *,
    accounting: str = "vllm",
    engine: EngineArgs = EngineArgs(),
    weight_dtypes: tuple[str, ...] = SOLVE_WEIGHTS,
    kv_dtypes: tuple[str, ...] = SOLVE_KV,
    counts: tuple[int, ...] = GPU_COUNTS,
    group_size: int = 128,
    spec: roofline.Speculation | None = None,
    eff: roofline.Efficiency = roofline.Efficiency(),
    limit: int = 10,
) -> list[Candidate]:
    """Deployments that serve `target`, smallest first. `base` carries the memory
    settings (mem_util, reserve or None for vLLM's profile, block size, prefix) every
    candidate keeps; each candidate's GPU total is the one CUDA reports."""
    if shape.params is None:
        raise BadInput(f"{shape.name}: parameter count unknown; --solve needs it to size each weight dtype")
    latency = target.max_tpot_s is not None or target.max_ttft_s is not None
    found: list[Candidate] = []
    for n in counts:  # ranked by GPUs first: stop once enough smaller deployments serve
        if len(found) >= limit:
            break
        for gpu in gpus:
            if latency and not gpu.has_speed:
                continue
            for tp, pp in splits(shape, n):
                for w in weight_dtypes:
                    total = weight_bytes(shape.params, w, group_size).total
                    for k in kv_dtypes:
                        dep = replace(
                            base,
                            gpu_memory_bytes=gpu.total_bytes,
                            num_gpus=n,
                            tp=tp,
                            pp=pp,
                            kv=kv_dtype(k),
                            kv_cache_memory_bytes=None,
                        )
                        fit = Fit(shape, dep, total, accounting=accounting, engine=engine, gpu=gpu)
                        if not fit.fits(target.context, target.concurrency):
                            continue
                        speed = speed_of(
                            shape,
                            gpu,
                            target,
                            weights=w,
                            kv=k,
                            tp=tp,
                            pp=pp,
                            dp=dep.dp,
                            weight_total=total,
                            spec=spec,
                            eff=eff,
                        )
                        if target.max_tpot_s is not None and (speed is None or speed.tpot_s > target.max_tpot_s):
                            continue
                        if target.max_ttft_s is not None and (speed is None or speed.ttft_s > target.max_ttft_s):
                            continue
                        headroom = fit.headroom(target.context, target.concurrency)
                        found.append(
                            Candidate(gpu.key, n, tp, pp, w, k, headroom, fit.max_concurrency(target.context), speed)
                        )
    found.sort(key=lambda c: (c.num_gpus, -round(c.headroom, 3), c.speed.tpot_s if c.speed else float("inf")))
    return found[:limit]
