"""Writing what a command produces: one clear line when a path cannot be written, and never a lost result.

A run can take minutes; finding out at its end that ``--json`` names a directory or a folder nobody may
write to must not throw its results away.  :func:`unwritable` lets the command line refuse such a path
before any work starts; :func:`write_text` writes atomically (a temporary file in the same folder, then
a rename, so a reader never sees half a file) and, when the path still cannot be written, saves the text
to a temporary file and raises a one-line error that says where it went.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from .errors import TunelabError


def json_loads(text: str | bytes) -> Any:
    """``json.loads``, with JSON nested too deeply to parse (which ``json`` raises as RecursionError)
    raised as the ValueError every other malformed document gives."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to read") from None


JSON_MAX_BYTES = 256 << 20  # larger than any file tunelab writes by far; /dev/zero would fill memory


def read_json(path: Path | str) -> Any:
    """The JSON document in the file at ``path`` (UTF-8, a byte-order mark allowed): OSError where it
    cannot be read, ValueError where it is not UTF-8, not JSON, nested too deeply, or longer than
    ``JSON_MAX_BYTES`` (read that far and no further: a pipe, ``<(...)``, is read as it comes)."""
    with open(path, "rb") as f:
        data = f.read(JSON_MAX_BYTES + 1)
    if len(data) > JSON_MAX_BYTES:
        raise ValueError(f"longer than {JSON_MAX_BYTES >> 20} MiB: not a file tunelab wrote")
    return json_loads(data.decode("utf-8-sig"))


def unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be written as a file (None when it looks writable): it is a directory, or the
    nearest folder that exists on its way is not a folder or not writable (missing folders are made)."""
    if str(path) == "":
        return "an empty path"
    if path.is_dir():
        return "it is a directory"
    if path.exists():  # a file, a link to one, or a device such as /dev/null: written where it is
        return None if os.access(path, os.W_OK) else "the file is not writable"
    if path.is_symlink():  # a link to nothing: written through the link, into its target's folder
        target = path.resolve()
        return None if target.parent.is_dir() and _can_create_in(target.parent) else \
            f"it is a link to {target}, which cannot be created"
    folder = path.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK) or not _can_create_in(folder):
        return f"{folder} is not writable"
    return None


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be made in ``folder`` (tried: permissions say yes on /proc and read-only mounts)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def write_text(path: Path, text: str, rescue: bool = True) -> Path:
    """Write ``text`` to ``path`` (folders made as needed): a new or regular file atomically, keeping an
    existing file's permissions; a symbolic link, a device (``/dev/stdout``) or a pipe in place.  When
    that fails: TunelabError in one line and, with ``rescue``, the text saved to a temporary file that
    the error names."""
    path = Path(path)
    tmp = path.with_name(f".{path.name[:200]}.{os.getpid()}.tmp")
    try:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        if path.exists():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        os.replace(tmp, path)
        return path
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if not isinstance(exc, OSError):
            raise  # (an interrupt, say: the temporary file is gone, the error goes on)
        reason = exc.strerror or type(exc).__name__
        if not rescue:
            raise TunelabError(f"cannot write {path}: {reason}") from None
        try:
            fd, saved = tempfile.mkstemp(prefix=f"tunelab-{path.stem[:40] or 'output'}-", suffix=path.suffix or ".txt")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as again:
            raise TunelabError(f"cannot write {path}: {reason}; nor a temporary copy: "
                               f"{again.strerror or again}") from None
        raise TunelabError(f"cannot write {path}: {reason}; its contents were saved to {saved}") from None
