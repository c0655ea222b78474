"""The lowered-program cache: one .pte per (model files, options, this package's code)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def cache_dir() -> Path:
    """$MLX_DELEGATE_CACHE, else ~/.cache/mlx_delegate (created on demand)."""
    path = Path(os.environ.get("MLX_DELEGATE_CACHE") or Path.home() / ".cache" / "mlx_delegate")
    path.mkdir(parents=True, exist_ok=True)
    return path


def code_fingerprint() -> str:
    """Lowered programs depend on the handlers, patterns and runtime: any change invalidates the cache."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".so", ".fbs") and "__pycache__" not in f.parts:
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


@dataclass(frozen=True)
class CacheKey:
    name: str
    files: tuple[Path, ...]  # what the weights are read from (path, size and mtime go in the key)
    options: tuple[tuple[str, Any], ...]

    def path(self) -> Path:
        h = hashlib.sha256()
        for part in (*map(_file_identity, self.files), repr(self.options), code_fingerprint()):
            h.update(part.encode())
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.name)
        return cache_dir() / f"{safe}-{h.hexdigest()[:16]}.pte"


def cached_pte(key: CacheKey, build: Callable[[Path], None], *, refresh: bool = False) -> tuple[Path, bool]:
    """(path of the .pte, whether it was built now); when missing, `build(path)` writes it."""
    path = key.path()
    if path.exists() and not refresh:
        return path, False
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        build(tmp)
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    finally:
        tmp.unlink(missing_ok=True)
    return path, True
