"""The package's dependency direction (DESIGN.md §1), checked on the source:

- the module import graph (top-level and function-level imports alike) has no cycle;
- each top-level package imports only the packages below it:
  cli -> jobs -> spec -> evals -> calib -> packers -> kernels, with sizing and common beside them;
- a number format's package (`formats/<format>/`) spans the layers: its declaration (the
  package's `__init__.py` and `scheme.py`, with `formats/base.py` and `formats/registry.py`: "formats") sits
  beside schemes, which it may import, and every layer that asks a format may import it; its
  other modules ("formats.impl": activations as deployed, a new format's numerics, codecs and
  quantizers) sit above calib and are imported by jobs and cli only;
- packages stay free of the libraries they must not use (no typer/rich below cli; sizing
  is standard-library only);
- every module imports on its own, in a fresh set of `infer_tool` modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "sizing", "schemes", "formats", "kernels", "packers", "calib", "evals", "spec", "jobs", "cli")
# package (a format's declaration "formats", its other modules "formats.impl") -> the
# infer_tool packages it may import
ALLOWED = {
    "common": set(),
    "sizing": {"common"},
    "schemes": {"common", "formats"},
    "formats": {"common", "schemes", "formats"},
    "kernels": {"common"},
    "packers": {"common", "schemes", "formats", "kernels"},
    "calib": {"common", "schemes", "formats", "packers"},
    "formats.impl": {"common", "schemes", "formats", "formats.impl", "kernels", "packers", "calib"},
    "evals": {"common", "formats", "kernels", "packers", "calib"},
    "spec": {"common", "sizing", "calib", "evals"},
    "jobs": {"common", "sizing", "schemes", "formats", "formats.impl", "kernels", "packers", "calib", "evals", "spec"},
    "cli": {
        "common",
        "sizing",
        "schemes",
        "formats",
        "formats.impl",
        "kernels",
        "packers",
        "calib",
        "evals",
        "spec",
        "jobs",
    },
}
# package -> third-party libraries it must not import
BANNED = {
    "sizing": {"torch", "transformers", "triton", "datasets", "safetensors", "numpy", "typer", "rich"},
    "schemes": {
        "transformers",
        "triton",
        "datasets",
        "safetensors",
        "numpy",
        "typer",
        "rich",
    },  # torch: inside functions only
    "common": {
        "transformers",
        "triton",
        "datasets",
        "typer",
        "rich",
    },  # torch: inside functions only (common/device.py)
    "formats": {"torch", "transformers", "triton", "datasets", "safetensors", "numpy", "typer", "rich"},
    "formats.impl": {"typer", "rich"},
    "kernels": {"transformers", "datasets", "typer", "rich"},
    "packers": {"transformers", "datasets", "typer", "rich"},
    "calib": {"typer", "rich", "triton"},
    "evals": {"typer", "rich"},
    "spec": {"typer", "rich"},
    "jobs": {"typer", "rich"},
}


def modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the package."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out["infer_tool." + ".".join(parts)] = path
    return out


def imports_of(path: Path) -> set[str]:
    """Every module name imported anywhere in the file (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def layer_of(name: str) -> str:
    """The package of module `name` in ALLOWED: its top-level package, with a format's
    declaration ("formats": the formats package, its base and registry, each format's
    package itself) told from its other modules ("formats.impl")."""
    parts = name.split(".")
    if parts[1] != "formats":
        return parts[1]
    declaration = len(parts) <= 3 or parts[3] == "scheme" or parts[2] in ("base", "registry")
    return "formats" if declaration else "formats.impl"


def module_of(imported: str, mods: dict[str, Path]) -> str:
    """The module an import names (`a.b.c` of `from a.b import c` is a name in a.b, or a.b.c)."""
    while imported not in mods and "." in imported:
        imported = imported.rpartition(".")[0]
    return imported


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m in imports_of(path) if m in mods and m != name} for name, path in mods.items()}


def test_no_import_cycles() -> None:
    g = graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m) :] + [m]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)


def test_packages_import_only_what_lies_below() -> None:
    bad = []
    mods = modules()
    for name, path in mods.items():
        pkg = layer_of(name)
        for m in imports_of(path):
            top = m.split(".")[0]
            if top == "infer_tool":
                other = layer_of(module_of(m, mods))
                if other != pkg and other not in ALLOWED[pkg]:
                    bad.append(f"{name} imports {m}")
            elif top in BANNED.get(pkg, ()):
                bad.append(f"{name} imports {top}")
    assert not bad, bad


def test_every_module_imports_on_its_own() -> None:
    names = sorted(modules())
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m.startswith('infer_tool')]:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
