"""Where a command may write: the `--out` policy, checked before any work and again by
the writers, and the file modes of what they write.

`--overwrite` replaces only an empty directory or one this tool wrote (it holds the
writer's marker file, e.g. quantize_report.json), never a file, never the current
directory or one of its parents, never the source model's directory.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from infer_tool.common.errors import BadInput


def _within(path: Path, other: Path) -> bool:
    """True when `path` is `other` or one of its parents (replacing it would delete `other`)."""
    return path == other or path in other.parents


def check_out_dir(out: str | os.PathLike[str], *, overwrite: bool, marker: str, protected: Iterable[Path] = ()) -> None:
    """Refuse an output directory this run must not write (see the module docstring), and
    one whose parent is not writable (a probe file is created and removed there)."""
    path = Path(out)
    resolved = path.resolve()
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise BadInput(f"output directory {str(out)!r} already exists; pass --overwrite to replace it")
        if not path.is_dir():
            raise BadInput(f"--out {str(out)!r} is a file; --overwrite replaces only a directory this tool wrote")
        if _within(resolved, Path.cwd().resolve()):
            raise BadInput(f"--out {str(out)!r} is the current directory or one of its parents; name a new directory")
        for src in protected:
            if _within(resolved, Path(src).resolve()):
                raise BadInput(f"--out {str(out)!r} holds the source model ({src}); write the result elsewhere")
        if any(path.iterdir()) and not (path / marker).is_file():
            raise BadInput(
                f"--out {str(out)!r} holds files this tool did not write (no {marker}); --overwrite replaces only "
                "an empty directory or one of our outputs"
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
