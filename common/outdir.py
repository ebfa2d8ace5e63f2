"""Where a command may write: the `--out` policy, checked before any work and again by
the writers just before they replace anything, and the file modes of what they write.

`--overwrite` replaces only an empty directory or one this tool wrote, never a file, never
the current directory or one of its parents, never the source model's directory. A
directory is ours when it holds the owner record `.infer-tool.json` that `sign` writes
last into every output (`{"writer": "infer-tool", "kind", "files": {path: bytes}}`) and
nothing else than the files it lists, at their sizes, and the writer's `marker` document
(quantize_report.json: a run rewrites it after signing, so the record leaves it out). A
directory written before owner records existed is ours when its marker parses as the
writer's document and every name in it is one that writer writes. Anything else there is
named in the refusal, and nothing is touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput

OWNER = ".infer-tool.json"
WRITER = "infer-tool"
_MAX_OWNER_BYTES = 64 * 2**20
_MAX_LISTED = 5


def _within(path: Path, other: Path) -> bool:
    """True when `path` is `other` or one of its parents (replacing it would delete `other`)."""
    return path == other or path in other.parents


def check_out_dir(
    out: str | os.PathLike[str],
    *,
    overwrite: bool,
    marker: str,
    protected: Iterable[Path] = (),
    legacy: re.Pattern[str] | None = None,
    legacy_keys: Iterable[str] = (),
) -> None:
    """Refuse an output directory this run must not write (see the module docstring), and
    one whose parent is not writable (a probe file is created and removed there).
    marker: the writer's own document (quantize_report.json); legacy: the names that writer
    writes, and legacy_keys the keys its marker holds, for a directory without owner record."""
    path = Path(out)
    resolved = path.resolve()
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise BadInput(f"output directory {str(out)!r} already exists; pass --overwrite to replace it")
        if path.is_symlink():
            raise BadInput(
                f"--out {str(out)!r} is a symbolic link; --overwrite replaces only a directory this tool wrote: "
                "name the directory itself"
            )
        if not path.is_dir():
            raise BadInput(f"--out {str(out)!r} is a file; --overwrite replaces only a directory this tool wrote")
        if _within(resolved, Path.cwd().resolve()):
            raise BadInput(f"--out {str(out)!r} is the current directory or one of its parents; name a new directory")
        for src in protected:
            if _within(resolved, Path(src).resolve()):
                raise BadInput(f"--out {str(out)!r} holds the source model ({src}); write the result elsewhere")
        foreign = foreign_files(path, marker, legacy, tuple(legacy_keys))
        if foreign:
            raise BadInput(
                f"--out {str(out)!r} holds files this tool did not write ({foreign}); --overwrite replaces only an "
                "empty directory or one of our outputs: move those files, or name another --out"
            )
    parent = resolved.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise BadInput(f"--out {str(out)!r}: {parent} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".infer-tool-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise BadInput(f"--out {str(out)!r}: cannot write in {parent} ({e.strerror})") from None


def make_readable(directory: Path) -> None:
    """Give `directory` and everything in it the modes a plain file / mkdir would get under
    the umask (safetensors and mkdtemp create owner-only files), so a server running as
    another user can read a checkpoint."""
    mask = os.umask(0)
    os.umask(mask)
    for root, _dirs, files in os.walk(directory):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _entries(directory: Path) -> list[Path]:
    """Every file, link and folder under `directory` (links are not followed)."""
    out: list[Path] = []
    for root, dirs, files in os.walk(directory):
        out += [Path(root, n) for n in (*dirs, *files)]
    return sorted(out)


def _json(path: Path) -> Any:
    """The JSON document in the regular file `path` (not a link, at most 64 MiB), or None."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_OWNER_BYTES:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def _read_owner(directory: Path) -> dict[str, int] | None:
    """The files `directory`'s owner record lists ({relative path: bytes}), or None when it
    has no record that `sign` wrote."""
    doc = _json(directory / OWNER)
    files = doc.get("files") if isinstance(doc, dict) and doc.get("writer") == WRITER else None
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in files.items()
    ):
        return None
    return files


def _is_writers_document(path: Path, keys: tuple[str, ...]) -> bool:
    doc = _json(path)
    return isinstance(doc, dict) and all(k in doc for k in keys)


def foreign_files(
    directory: Path, marker: str, legacy: re.Pattern[str] | None = None, legacy_keys: tuple[str, ...] = ()
) -> str:
    """'' when everything in `directory` is ours (see the module docstring), else the foreign
    entries named (the first few, and how many)."""
    entries = _entries(directory)
    if not entries:
        return ""
    files = _read_owner(directory)
    foreign: list[str] = []
    for p in entries:
        rel = p.relative_to(directory).as_posix()
        if rel in (OWNER, marker) and files is not None:
            continue
        if p.is_symlink():
            foreign.append(rel)
        elif p.is_dir():
            if files is None or not any(f.startswith(f"{rel}/") for f in files):
                foreign.append(f"{rel}/")
        elif files is not None:
            if rel not in files or p.stat().st_size != files[rel]:
                foreign.append(rel)
        elif legacy is None or not legacy.fullmatch(rel):
            foreign.append(rel)
    if files is None and not foreign and not _is_writers_document(directory / marker, legacy_keys):
        foreign.append(f"{marker}, not a document this tool wrote" if (directory / marker).exists() else f"no {OWNER}")
    shown = ", ".join(foreign[:_MAX_LISTED])
    return shown + (f" and {len(foreign) - _MAX_LISTED} more" if len(foreign) > _MAX_LISTED else "")


def sign(directory: Path, kind: str, marker: str) -> None:
    """Write the owner record into `directory` (see the module docstring): call it last,
    when every other file is in place."""
    files = {
        rel: p.stat().st_size
        for p in _entries(directory)
        if p.is_file() and not p.is_symlink() and (rel := p.relative_to(directory).as_posix()) not in (OWNER, marker)
    }
    doc = {"writer": WRITER, "kind": kind, "files": files}
    (directory / OWNER).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def replace_dir(
    tmp: Path, out: Path, marker: str, legacy: re.Pattern[str] | None = None, legacy_keys: Iterable[str] = ()
) -> None:
    """Rename the finished `tmp` to `out`. An existing `out` is checked once more (files may
    have appeared there during the run), moved aside, and removed only after `tmp` took its
    place; a refusal leaves both as they were."""
    if out.exists() or out.is_symlink():
        if out.is_symlink() or not out.is_dir():
            raise BadInput(f"--out {str(out)!r} is no longer a directory; nothing was replaced")
        foreign = foreign_files(out, marker, legacy, tuple(legacy_keys))
        if foreign:
            raise BadInput(
                f"--out {str(out)!r} gained files this tool did not write during the run ({foreign}); nothing was "
                "replaced: move those files and run again"
            )
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
