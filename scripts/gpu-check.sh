#!/usr/bin/env bash
# GPU check: the parity suite and the LLM / speech benchmarks on MLX's CUDA backend.
#
# For a session lent a GPU machine. It
#   1. installs MLX's CUDA build at the pinned MLX version (requirements-dev.txt): mlx-cuda-13 where the
#      driver supports CUDA 13, else mlx-cuda-12, into a virtual environment ($VENV) that sees this
#      Python's packages (torch, executorch, ... as ./scripts/setup.sh installed them);
#   2. builds and installs mlx_delegate into that environment against it (its own build directory, so
#      the CPU build of an editable install is left alone, and that install's import hook is bypassed);
#   3. checks that MLX's default device is the GPU (so the delegate runs MLX's CUDA ops and not its
#      CPU kernels: the suite's CPU-kernel assertions follow `cpu_kernels_active()`);
#   4. runs the test suite ($TESTS) and benchmarks/llm.py and benchmarks/speech.py, and writes
#      everything under $OUT: summary.md (device, versions, pass/fail counts, commands, exit codes),
#      pytest.log, junit.xml, llm.txt / llm.json, speech.txt / speech.json.
# Record summary.md's figures in the docs the first time a GPU is lent.
#
# Environment (all optional):
#   PYTHON      the Python with the project's requirements (python3)
#   CUDA_MAJOR  12 or 13 (default: from nvidia-smi's "CUDA Version")
#   WHEELS      a directory of wheels (mlx, mlx-cuda-*, their nvidia-* dependencies) for a machine
#               without network access: pip then installs with --no-index --find-links "$WHEELS"
#   VENV        the virtual environment (.venv-gpu)
#   OUT         the results directory (gpu-check-results/<UTC date-time>)
#   TESTS       what pytest runs (tests)
#   JOBS        pytest-xdist workers (4; 0 runs in one process)
#   TEST_TIMEOUT seconds after which the test step is stopped (none), so the benchmarks still run
#   BENCHES     which benchmarks run ("llm speech"); LLM_ARGS / SPEECH_ARGS: extra arguments for them
#   QUICK=1     the benchmarks' --quick smoke mode
#   SKIP_TESTS=1 / SKIP_BENCH=1   leave out a part
# Exits non-zero when a step fails; the later steps still run and summary.md says which failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-gpu}
OUT=${OUT:-gpu-check-results/$(date -u +%Y%m%d-%H%M%S)}
TESTS=${TESTS:-tests}
JOBS=${JOBS:-4}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.md
status=0

die() { echo "gpu-check: $*" >&2; echo "**gpu-check stopped: $***" >>"$SUMMARY"; exit 1; }
note() { echo "$*" | tee -a "$SUMMARY"; }
# step NAME CMD...: runs CMD, records its exit code and duration in the summary.
step() {
  local name=$1; shift
  local start=$SECONDS rc=0
  echo "gpu-check: $name: $*" >&2
  "$@" || rc=$?
  note "| $name | \`$*\` | $rc | $((SECONDS - start)) s |"
  [ "$rc" -eq 0 ] || status=1
}

: >"$SUMMARY"
note "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
note ""
note "- revision: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"

command -v nvidia-smi >/dev/null || die "no nvidia-smi: this machine has no NVIDIA GPU (or no driver)"
note "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
if [ -z "${CUDA_MAJOR:-}" ]; then
  driver_cuda=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -1)
  [ -n "$driver_cuda" ] || die "cannot read the driver's CUDA version from nvidia-smi; set CUDA_MAJOR"
  CUDA_MAJOR=$([ "$driver_cuda" -ge 13 ] && echo 13 || echo 12)
fi
case $CUDA_MAJOR in 12|13) ;; *) die "CUDA_MAJOR must be 12 or 13, not $CUDA_MAJOR" ;; esac

# The MLX version the project pins (the Linux line of requirements-dev.txt).
MLX_VERSION=$(sed -n 's/^mlx\[cpu\]==\([0-9][0-9.]*\).*/\1/p' requirements-dev.txt | head -1)
[ -n "$MLX_VERSION" ] || die "no mlx[cpu]==X pin in requirements-dev.txt"
note "- MLX: mlx-cuda-$CUDA_MAJOR==$MLX_VERSION"

# 1. MLX's CUDA build in a venv over this Python's packages. --ignore-installed: pip would otherwise
# count the CPU build's mlx, visible through --system-site-packages, as already there.
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV" || die "cannot create $VENV"
case $VENV in /*) VPY=$VENV/bin/python ;; *) VPY=$ROOT/$VENV/bin/python ;; esac
VSITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# When $PY is itself a virtual environment, --system-site-packages reaches only its base interpreter:
# a .pth file makes $PY's own packages (torch, ...) visible too.
"$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' \
  && "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' >"$VSITE/_gpu_check_base.pth"
# MLX's CUDA libraries find cuBLAS, cuDNN, NVRTC, ... through an RPATH into the nvidia-* wheels next to
# them; where those wheels live in the base environment, link them in.
BASE_NVIDIA=$("$PY" -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null)
[ -n "$BASE_NVIDIA" ] && [ ! -e "$VSITE/nvidia" ] && ln -s "$BASE_NVIDIA" "$VSITE/nvidia"
PIP_SOURCE=()
# Offline: the wheels directory holds mlx and mlx-cuda; their nvidia-* dependencies must already be
# installed (step 3 checks that MLX's CUDA backend loads).
[ -n "${WHEELS:-}" ] && PIP_SOURCE=(--no-index --find-links "$WHEELS" --no-deps)
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
"$VPY" -m pip install -q "${PIP_SOURCE[@]}" --ignore-installed "mlx==$MLX_VERSION" "mlx-cuda-$CUDA_MAJOR==$MLX_VERSION" \
  || die "cannot install mlx-cuda-$CUDA_MAJOR==$MLX_VERSION (no network? set WHEELS)"

# MLX's CMake package looks for cuDNN; with the nvidia-cudnn wheel (no system cuDNN) point it there.
if [ -n "$BASE_NVIDIA" ] && [ -d "$BASE_NVIDIA/cudnn/include" ]; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCUDNN_INCLUDE_PATH=$BASE_NVIDIA/cudnn/include -DCUDNN_LIBRARY_PATH=$BASE_NVIDIA/cudnn/lib"
fi

# 2. mlx_delegate built against that MLX, in its own build directory. An editable install of the
# checkout in the base Python would still redirect `import mlx_delegate` to its CPU build: its import
# hook steps aside for the build directories named in SKBUILD_EDITABLE_SKIP.
"$VPY" -m pip install -q --no-build-isolation --no-deps --ignore-installed -C build-dir=build/gpu-check . \
  || die "cannot build mlx_delegate against mlx-cuda-$CUDA_MAJOR"
skip=$("$VPY" -c 'import sys; print(":".join(f.path for f in sys.meta_path
                                             if "mlx_delegate" in getattr(f, "known_source_files", {}) and f.path))')
export SKBUILD_EDITABLE_SKIP=${skip}${SKBUILD_EDITABLE_SKIP:+:$SKBUILD_EDITABLE_SKIP}
# Imports take the installed package, not ./mlx_delegate (which has no compiled runtime); test
# subprocesses (`python -c`) inherit this.
export PYTHONSAFEPATH=1

# 3. The delegate must run on the GPU.
"$VPY" - <<'EOF' >"$OUT/device.txt" 2>&1 || { cat "$OUT/device.txt" >&2; die "MLX's CUDA backend is not usable (see device.txt)"; }
import mlx_delegate  # first, as users do (it sets up MLX's CPU BLAS before libmlx loads)
import mlx.core as mx
from mlx_delegate import _runtime
from mlx_delegate.testing import cpu_kernels_active
print("mlx_delegate:", mlx_delegate.__file__)
print("mlx:", mx.__version__, mx.__file__)
print("cuda available:", mx.cuda.is_available() if hasattr(mx, "cuda") else "(no mx.cuda)")
print("default device:", mx.default_device())
print("cpu kernels enabled / active:", _runtime.cpu_kernels_enabled(), cpu_kernels_active())
assert mx.default_device() == mx.gpu, "MLX's default device is not the GPU"
assert not cpu_kernels_active()
assert not mlx_delegate.__file__.startswith(__import__("os").getcwd() + "/mlx_delegate"), "the source tree, not the build"
x = mx.arange(8, dtype=mx.float32)
mx.eval(x @ x)
EOF
sed 's/^/    /' "$OUT/device.txt" >>"$SUMMARY"
note ""
note "| step | command | exit | time |"
note "|---|---|---|---|"

# 4. The suite and the benchmarks on the GPU.
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  xdist=()
  [ "$JOBS" != 0 ] && xdist=(-n "$JOBS")
  # shellcheck disable=SC2086
  limit=()
  [ -n "${TEST_TIMEOUT:-}" ] && limit=(timeout "$TEST_TIMEOUT")
  step tests "${limit[@]}" bash -c "\"$VPY\" -m pytest ${xdist[*]} -q -rfE --junitxml=\"$OUT/junit.xml\" $TESTS >\"$OUT/pytest.log\" 2>&1"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  quick=()
  [ "${QUICK:-0}" = 1 ] && quick=(--quick)
  for b in ${BENCHES:-llm speech}; do
    case $b in llm) args=${LLM_ARGS:-} ;; speech) args=${SPEECH_ARGS:-} ;; *) die "unknown benchmark $b" ;; esac
    # The benchmarks import their own helpers from benchmarks/ (the script's folder), which
    # PYTHONSAFEPATH would drop from sys.path; the script's folder is not the source tree.
    step "$b" env -u PYTHONSAFEPATH bash -c "\"$VPY\" benchmarks/$b.py ${quick[*]} $args --json \"$OUT/$b.json\" >\"$OUT/$b.txt\" 2>\"$OUT/$b.err\""
  done
fi

note ""
if [ -f "$OUT/pytest.log" ]; then
  note "## Tests"
  note ""
  note '```'
  grep -E '^(FAILED|ERROR) |[0-9]+ (passed|failed)' "$OUT/pytest.log" | tail -60 | tee -a "$SUMMARY"
  note '```'
fi
for b in llm speech; do
  [ -f "$OUT/$b.txt" ] || continue
  note ""
  note "## benchmarks/$b.py"
  note ""
  note '```'
  tee -a "$SUMMARY" <"$OUT/$b.txt"
  note '```'
done
echo "gpu-check: results in $OUT (exit $status)" >&2
exit "$status"
