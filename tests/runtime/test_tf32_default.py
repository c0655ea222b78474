"""float32 stays float32 on MLX's CUDA backend unless the user opts into TF32.

MLX runs float32 products in TF32 on CUDA by default (`MLX_ENABLE_TF32`), ~1e-3 relative error; on an
H100 that failed seven fp32 zoo rows against eager. The runtime sets the variable to 0 when it registers,
before MLX's first product, and keeps a value the user set. Checked here through the C environment (what
MLX reads; Python's `os.environ` is a copy taken at start-up), in fresh processes."""
import os
import subprocess
import sys

import pytest

PROBE = (
    "import ctypes, mlx_delegate; "
    "v = ctypes.CDLL(None).getenv; v.restype = ctypes.c_char_p; "
    "print((v(b'MLX_ENABLE_TF32') or b'unset').decode())"
)


@pytest.mark.parametrize("preset, expected", [(None, "0"), ("1", "1"), ("0", "0")])
def test_tf32_off_unless_the_user_set_it(preset: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    if preset is not None:
        env["MLX_ENABLE_TF32"] = preset
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected
