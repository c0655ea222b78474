"""The wheel, installed into a fresh virtual environment, runs a lowered model.

Builds the wheel the way `pip install .` does (pip's default build isolation:
the build requirements come from `[build-system]`, not from this environment),
installs it into a new venv (no system site-packages) with its declared
dependencies, and runs a small model through `MLXPartitioner` and the stock
`executorch.runtime` from a directory outside the source tree, with `python -I`
(no PYTHONPATH, no user site, no script directory games) and no
LD_LIBRARY_PATH, so the extension must find libexecutorch.so and libmlx.so
through its own RPATH.

`MLX_DELEGATE_WHEEL=path/to.whl` tests that wheel instead of building one (CI
builds it once, in the wheel job). Takes about 3 minutes on the 2-core
development machine: building ~1.5 min, venv install ~1 min, the run ~10 s.
"""

from __future__ import annotations

import os
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
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"{time.perf_counter() - t0:6.1f} s  {' '.join(map(str, cmd))}")
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def _wheel(tmp: Path, env: dict[str, str]) -> Path:
    given = os.environ.get("MLX_DELEGATE_WHEEL")
    if given:
        return Path(given).resolve()
    out = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
         cwd=tmp, env=env, timeout=1800)
    (wheel,) = out.glob("mlx_delegate-*.whl")
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
