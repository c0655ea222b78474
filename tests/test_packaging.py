"""The wheel, installed into a fresh virtual environment, runs a lowered model.

Builds the wheel the way `pip install .` does (pip's default build isolation:
the build requirements come from `[build-system]`, not from this environment),
installs it into a new venv (no system site-packages) with its declared
dependencies, and runs a small model through `MLXPartitioner` and the stock
`executorch.runtime` from a directory outside the source tree, with `python -I`
(no PYTHONPATH, no user site, no script directory games) and no
LD_LIBRARY_PATH, so the extension must find libexecutorch.so and libmlx.so
through its own RPATH.

`MLX_DELEGATE_WHEEL=path/to.whl` tests that wheel instead of building one. A
wheel built here is kept under $MLX_DELEGATE_CACHE/wheels/<hash of the sources
and build files> and reused while they are unchanged. On the 2-core development
machine at load average ~4: building 3-4.5 min (about 1.5 min when quiet),
venv install ~45 s (no byte-compiling), the runs ~40 s.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMOKE = ROOT / "tests" / "packaging_smoke.py"

# What `import mlx_delegate` and lowering must not print (mlx_delegate/_quiet.py).
NOISE = ("Failed to load", "is an Enum subclass", "FutureWarning", "Traceback")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "MLX_DELEGATE_")) and k not in ("LD_LIBRARY_PATH", "VIRTUAL_ENV")}
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    # No byte-compiling of torch & co. at install (the build env's and the venv's): it halves the
    # install time, and the one run compiles only what it imports.
    env["PIP_COMPILE"] = "0"
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"{time.perf_counter() - t0:6.1f} s  {' '.join(map(str, cmd))}")
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def _source_key() -> str:
    """A hash of everything the wheel is built from (and the interpreter it is built for)."""
    h = hashlib.sha256(f"{sys.version_info[:2]}".encode())
    files = [ROOT / "pyproject.toml", ROOT / "CMakeLists.txt", ROOT / "README.md"]
    for folder in ("cmake", "cpp", "schema", "mlx_delegate"):
        files += (p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".so", ".pyc"))
    for path in sorted(files):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _wheel(tmp: Path, env: dict[str, str]) -> Path:
    """MLX_DELEGATE_WHEEL, else a wheel built from these exact sources before, else a new build.

    Built wheels are kept under $MLX_DELEGATE_CACHE/wheels/<source hash> (default
    ~/.cache/mlx_delegate), so the suite rebuilds only after a change to the package or its build.
    """
    given = os.environ.get("MLX_DELEGATE_WHEEL")
    if given:
        return Path(given).resolve()
    cache = Path(os.environ.get("MLX_DELEGATE_CACHE") or Path.home() / ".cache" / "mlx_delegate")
    out = cache / "wheels" / _source_key()
    found = sorted(out.glob("mlx_delegate-*.whl"))
    if found:
        print(f"reusing {found[0]} (built from these sources)")
        return found[0]
    build = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(build), str(ROOT)],
         cwd=tmp, env=env, timeout=1800)
    (wheel,) = build.glob("mlx_delegate-*.whl")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(wheel, out / wheel.name)
    return wheel


@pytest.mark.slow
def test_wheel_runs_a_lowered_model_in_a_fresh_venv(tmp_path: Path) -> None:
    env = _clean_env()
    wheel = _wheel(tmp_path, env)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=env, timeout=300)
    py = venv / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", str(wheel)], cwd=tmp_path, env=env, timeout=1800)

    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "smoke.py").write_text(SMOKE.read_text())  # a copy: nothing of the tree on sys.path
    r = _run([str(py), "-I", "smoke.py"], cwd=work, env=env, timeout=600)
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert r.stdout.splitlines()[-1] == "ok"
    for key in ("mlx_delegate", "runtime"):
        assert Path(lines[key]).is_relative_to(venv), (key, lines[key])
    assert not any(word in r.stderr for word in NOISE), r.stderr

    # The console script, as a user would first call it.
    r = _run([str(venv / "bin" / "mlx-delegate"), "ops"], cwd=work, env=env, timeout=600)
    assert "Supported ops" in r.stdout
    assert not any(word in r.stderr for word in NOISE), r.stderr
