"""Which implementation a kernel call runs: compiled Triton, the Triton interpreter, or
the pure-torch reference.

- CUDA tensors run the compiled Triton kernels.
- CPU tensors run the pure-torch reference, unless `TRITON_INTERPRET=1` is set in the
  environment *at call time* (tests do this per test), in which case the same Triton
  kernels run under Triton's CPU interpreter.

Triton decides between compiling and interpreting when `@triton.jit` decorates a
function, i.e. at import (of our modules, and of `triton.language.standard` itself).
`resolve` re-wraps a compiled kernel as an interpreted one when interpretation is
requested later, so TRITON_INTERPRET never has to be set process-wide (which would send
every CPU caller in the test run through the slow interpreter) and the import order of
test modules does not matter. The `@triton.jit` helpers a kernel calls by a name of its
own module are re-wrapped with it (`_interpreted`). The price: kernels call no jit
functions of `triton.language.standard` (`tl.cdiv`/`tl.zeros`/`tl.sum`/`tl.max`), which
stay compiled. Reductions call `tl.reduce` with the combine function `tl.sum`/`tl.max`
use (`tl.standard._sum_combine`, `_elementwise_max`): the same compiled code, and the
interpreter recognises them and reduces with numpy instead of one Python call per element.
"""

from __future__ import annotations

import functools
import os
import types
from dataclasses import dataclass
from typing import Any

import torch

TRITON = "triton"
INTERPRETER = "triton-interpreter"
REFERENCE = "torch-reference"


def interpret_requested() -> bool:
    """True when TRITON_INTERPRET is set to a true value right now."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def backend_name(device: torch.device | str) -> str:
    """The path a kernel call on `device` takes: "triton", "triton-interpreter" or
    "torch-reference" (what `eval ppl` reports)."""
    device = torch.device(device)
    if device.type == "cuda":
        return TRITON
    if interpret_requested():
        return INTERPRETER
    return REFERENCE


def use_triton(x: torch.Tensor) -> bool:
    """Whether a call on `x` runs a Triton kernel (compiled or interpreted)."""
    return backend_name(x.device) != REFERENCE


def resolve(kernel: Any) -> Any:
    """The launchable form of a `@triton.jit` kernel for the current mode."""
    if interpret_requested():
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(kernel, InterpretedFunction):
            return _interpreted(kernel)
    return kernel


@functools.cache
def _interpreted(kernel: Any) -> Any:
    """The interpreted twin of a compiled `@triton.jit` function. The jit functions its
    code names among its module's globals (our helpers) are replaced by their interpreted
    twins in a copy of those globals; the module itself is left as it is."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    fn = kernel.fn
    helpers = {
        name: _interpreted(value)
        for name in fn.__code__.co_names
        if isinstance(value := fn.__globals__.get(name), JITFunction)
    }
    if helpers:
        twin = types.FunctionType(
            fn.__code__, {**fn.__globals__, **helpers}, fn.__name__, fn.__defaults__, fn.__closure__
        )
        for attr in ("__annotations__", "__kwdefaults__", "__qualname__", "__module__", "__doc__"):
            setattr(twin, attr, getattr(fn, attr))
        fn = twin
    return InterpretedFunction(fn)


def empty_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel's output (a seam tests replace to poison outputs)."""
    return torch.empty(shape, dtype=dtype, device=device)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device (a small stand-in elsewhere), used to
    size split-K so that small-M launches fill the GPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@dataclass
class Launch:
    """One kernel launch, built by an op's planner and run (or compiled) here.

    `args` are the positional runtime arguments (tensors, ints, floats) in the kernel's
    order; `meta` the constexpr meta-parameters plus `num_warps`/`num_stages`."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    meta: dict[str, Any]

    def run(self) -> Any:
        """Launch; returns what Triton's launch returns (the compiled kernel on a GPU, whose
        `n_spills` / `n_regs` the autotuning sweep reads)."""
        return resolve(self.kernel)[self.grid](*self.args, **self.meta)

    def compile_for(self, arch: int = 90) -> Any:
        """Compile for CUDA compute capability `arch` (e.g. 90 = Hopper) without a GPU:
        catches what the interpreter cannot (layouts, dot shapes, fp8 instructions)."""
        import triton
        from triton.backends.compiler import BaseBackend, GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import native_specialize_impl

        fn = self.kernel.fn if hasattr(self.kernel, "fn") else self.kernel
        names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
        options = {k: self.meta[k] for k in ("num_warps", "num_stages") if k in self.meta}
        constexprs = {k: v for k, v in self.meta.items() if k not in options}
        signature, attrs = {}, {}
        indices = {name: i for i, name in enumerate(names)}
        for name, arg in zip(names, self.args):
            # As the JIT specializes a launch: ints equal to 1 become constants, and
            # pointers / ints divisible by 16 are marked so (vector loads need it).
            kind, spec = native_specialize_impl(BaseBackend, arg, False, True, True)
            if kind == "constexpr":
                constexprs[name] = spec
                continue
            signature[name] = kind
            if spec:
                attrs[(indices[name],)] = BaseBackend.parse_attr(spec)
        signature.update({name: "constexpr" for name in constexprs})
        src = ASTSource(
            fn=self.kernel,
            signature=signature,
            constexprs={(indices[k],): v for k, v in constexprs.items()},
            attrs=attrs,
        )
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def resource_usage(compiled: Any) -> dict[str, int]:
    """Per-thread registers, stack (where spills land) and static shared memory of a
    kernel compiled by `Launch.compile_for`, read with the cuobjdump shipped in Triton."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {text[-200:]!r}")
    return {"registers": int(found[1]), "stack": int(found[2]), "shared": int(found[3])}
