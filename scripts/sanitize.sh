#!/usr/bin/env bash
# Build the runtime extension with a sanitizer into its own build directory and
# run the runtime tests under it:
#
#   ./scripts/sanitize.sh thread    # TSAN: tests/runtime/test_threads.py
#   ./scripts/sanitize.sh address   # ASAN + LSAN: tests/runtime (bad inputs, program, threads, fuzz seeds)
#
# The editable install (build/cp311-*, site-packages) is not touched: the
# sanitized _runtime is built in build/sanitize-<mode> and picked up through
# scripts/sanitize/sitecustomize.py (MLXD_RUNTIME_OVERRIDE), with the sanitizer
# runtime preloaded because python itself is not instrumented. Extra pytest
# arguments replace the default test selection.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:?usage: scripts/sanitize.sh thread|address [pytest args...]}"
shift
# The real interpreter, not a wrapper script (pyenv shims are bash: no preloading into those).
PY="$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')"
case "$MODE" in
  thread) TESTS=(tests/runtime/test_threads.py) ;;
  address) TESTS=(tests/runtime/test_bad_inputs.py tests/runtime/test_program.py tests/runtime/test_threads.py) ;;
  *) echo "mode must be thread or address" >&2; exit 2 ;;
esac
[ $# -gt 0 ] && TESTS=("$@")

BUILD="build/sanitize-$MODE"
SUPP="$PWD/scripts/sanitize"
"$PY" -m cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMLXD_SANITIZE="$MODE" \
  -DPython_EXECUTABLE="$PY" >/dev/null
"$PY" -m cmake --build "$BUILD" --target _runtime mlxd_blas

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
case "$MODE" in thread) LIB="$(gcc -print-file-name=libtsan.so)" ;; address) LIB="$(gcc -print-file-name=libasan.so)" ;; esac
export MLXD_RUNTIME_OVERRIDE="$(ls "$PWD/$BUILD"/_runtime*.so)"
export PYTHONPATH="$SUPP${PYTHONPATH:+:$PYTHONPATH}"
# The module's RPATH points at the wheels beside site-packages/mlx_delegate.
export LD_LIBRARY_PATH="$SITE/executorch/lib:$SITE/mlx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MLX_DELEGATE_BLAS=reference  # keep torch's BLAS out of MLX's calls: one fewer uninstrumented library

if [ "$MODE" = thread ]; then
  export TSAN_OPTIONS="suppressions=$SUPP/tsan.supp halt_on_error=1 second_deadlock_stack=1 report_signal_unsafe=0"
  # gcc 12's TSAN cannot map its shadow with the kernel's default ASLR entropy.
  RUN=(setarch "$(uname -m)" -R)
else
  export ASAN_OPTIONS="halt_on_error=1 detect_leaks=1 alloc_dealloc_mismatch=0 suppressions=$SUPP/asan.supp"
  # CPython, torch and friends leave tens of thousands of allocations at exit
  # (not leaks of ours, and too many to suppress by pattern in reasonable time),
  # so LSAN writes its report to a file and the check below fails only on a
  # leak whose allocation stack passes through our runtime.
  rm -f "$BUILD"/lsan.*
  export LSAN_OPTIONS="exitcode=0 log_path=$PWD/$BUILD/lsan malloc_context_size=16 suppressions=$SUPP/lsan.supp"
  # libstdc++ must be loaded before ASAN resolves its __cxa_throw interceptor
  # (python itself does not link it): otherwise the first C++ throw aborts.
  LIB="$LIB $(gcc -print-file-name=libstdc++.so.6)"
  RUN=()
fi
echo "sanitize: $MODE build $MLXD_RUNTIME_OVERRIDE; tests: ${TESTS[*]}"
LD_PRELOAD="$LIB" "${RUN[@]}" "$PY" -m pytest -q -p no:xdist "${TESTS[@]}"
if [ "$MODE" = address ]; then
  ours="$(cat "$BUILD"/lsan.* 2>/dev/null | awk '/^(Direct|Indirect) leak/{b=$0; o=0} /_runtime\.cpython|mlxd::/{o=1} /^$/{if(o)print b; o=0}')"
  echo "LSAN: $(cat "$BUILD"/lsan.* 2>/dev/null | grep -c '^\(Direct\|Indirect\) leak') leak records at exit, $(printf '%s' "$ours" | grep -c leak) through the runtime"
  [ -z "$ours" ] || { echo "$ours"; exit 1; }
fi
