"""Small filesystem helpers shared by the data pipeline: cache dir, atomic writes, hashing, locks.

Atomicity contract: every file the pipeline publishes is first written to a temp file in the
*same* directory and then `os.replace`d onto its final name, so a reader never sees a half
written file (rename is atomic within one filesystem; a temp file elsewhere could cross one).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_REPO_ROOT = Path(__file__).resolve().parents[2]
_HASH_CHUNK = 1 << 22  # 4 MiB: big enough that hashing is disk-bound, small enough to stream


def repo_root() -> Path:
    """The checkout this package lives in (falls back to the working dir for an installed wheel)."""
    if (_REPO_ROOT / "msar_train").is_dir() and ((_REPO_ROOT / ".git").exists() or (_REPO_ROOT / "pyproject.toml").exists()):
        return _REPO_ROOT
    return Path.cwd()


def resolve_cache_dir(value: str | os.PathLike[str] | None = None) -> Path:
    """Return the absolute cache directory.

    Order: an explicit `value`; else env `MSAR_CACHE`; else `<repo>/.cache/msar`. A value that is
    still an unresolved OmegaConf interpolation (``${oc.env:...}``, e.g. a raw `DataConfig()` that
    never went through Hydra) counts as unset. Relative paths are taken relative to the repo root
    (not the cwd) so every entry point shares one cache.
    """
    raw = None if value is None else str(value)
    if raw is None or raw == "" or raw.startswith("${"):
        raw = os.environ.get("MSAR_CACHE") or ".cache/msar"
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = repo_root() / path
    return path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes (streamed, constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def make_temp(path: Path) -> tuple[int, str]:
    """`mkstemp` next to `path`, with the permissions a plain `open` would give (mkstemp uses 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp file next to `path`; on clean exit fsync it and `os.replace` it onto `path`.

    On an exception the temp file is removed and `path` is left untouched.
    """
    path = Path(path)
    fd, tmp = make_temp(path)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write `obj` as pretty JSON (sorted keys, trailing newline) to `path` atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Load a JSON object; `what` names the file's role in the error messages."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{what} {path} must hold a JSON object, got {type(obj).__name__}")
    return obj


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on `path` (created if missing); blocks until acquired.

    Why: several ranks on one node may call `build_data` at once; only one may prepare the cache.
    flock is per node and unreliable on some network filesystems, so multi-node jobs on a shared
    FS should prepare the data once beforehand (``msar-prepare-data``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
