// A CBLAS front for MLX's CPU matmuls, served by the optimized BLAS inside
// the torch wheel (MKL/OpenBLAS Fortran symbols in libtorch_cpu.so).
//
// The mlx-cpu wheel links a reference BLAS. mlx_delegate loads this library
// with RTLD_GLOBAL before libmlx.so is loaded, so libmlx's undefined
// cblas_sgemm/cblas_dgemm bind here instead. Until mlxd_blas_init succeeds,
// calls go to the reference implementation passed in as a fallback.
//
// It also resolves MKL's mixed-precision gemms (bf16 x bf16 -> fp32 and
// fp16 x fp16 -> fp32) and offers them as mlxd_gemm_lowp: the runtime finds
// that entry point with dlsym(RTLD_DEFAULT) and uses MLX's own matmul when it
// is absent (no shim, MLX_DELEGATE_BLAS=reference, or a torch without MKL).
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "sgemm_x86.h"

extern "C" {

enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112, CblasConjTrans = 113 };

using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*,
                          const float*, const int*, const float*, const int*, const float*, float*, const int*);
using dgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const double*,
                          const double*, const int*, const double*, const int*, const double*, double*,
                          const int*);
using cblas_sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                                float*, int);
using cblas_dgemm_fn = void (*)(int, int, int, int, int, int, double, const double*, int, const double*, int,
                                double, double*, int);
// MKL's cblas_gemm_bf16bf16f32 / cblas_gemm_f16f16f32 (LP64): 16-bit operands, fp32 alpha/beta and result.
using cblas_gemm_lowp_fn = void (*)(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int,
                                    float, float*, int);

static std::atomic<sgemm_fn> g_sgemm{nullptr};
static std::atomic<dgemm_fn> g_dgemm{nullptr};
static std::atomic<cblas_sgemm_fn> g_ref_sgemm{nullptr};
static std::atomic<cblas_dgemm_fn> g_ref_dgemm{nullptr};
static std::atomic<cblas_gemm_lowp_fn> g_gemm_lowp[2]{{nullptr}, {nullptr}};  // [0] bfloat16, [1] float16
static std::atomic<uint64_t> g_fast_calls{0};
static std::atomic<uint64_t> g_split_calls{0};  // sgemms cut into blocks on the runtime's pool
// Which tile serves single-threaded fp32 products (the pool's blocks, mlxd_sgemm_serial): 0 MKL, else
// own_sgemm's instruction set (sgemm_x86.h). By default the widest own tile, except on Intel processors
// with AVX-512, where MKL runs its own AVX-512 kernels; MLX_DELEGATE_SGEMM=own / own-avx2 / mkl chooses.
static std::atomic<int> g_own_sgemm{[] {
  const int best = mlxd::blas::own_sgemm_best();
  const char* e = std::getenv("MLX_DELEGATE_SGEMM");
  if (e && std::strcmp(e, "own") == 0) return best;
  if (e && std::strcmp(e, "own-avx2") == 0) return std::min(best, mlxd::blas::kOwnAvx2);
  if (e && std::strcmp(e, "mkl") == 0) return 0;
  return best == mlxd::blas::kOwnAvx512 && __builtin_cpu_is("intel") ? 0 : best;
}()};
// MKL's per-thread thread count (Fortran mkl_set_num_threads_local_, by
// pointer): small products run on the calling thread, since waking MKL's
// OpenMP team costs more than they do.
using set_threads_local_fn = int (*)(const int*);
static std::atomic<set_threads_local_fn> g_set_threads_local{nullptr};

// A parallel-for the runtime registers (its CPU helper pool): runs part(ctx, i)
// for i in [0, parts), each part claimed by whichever of the calling thread and
// the helpers is free, so a helper that is not scheduled never stalls a call.
// Part 0 is always the calling thread's (the balanced split relies on it).
using parallel_fn = void (*)(int parts, void (*part)(void*, int), void* ctx);
static std::atomic<parallel_fn> g_parallel{nullptr};
static std::atomic<int> g_parallel_threads{1};

int mlxd_blas_set_split_policy(int policy);

// Registers the runtime's parallel-for (nullptr: none); `threads` is its thread count.
__attribute__((visibility("default"))) void mlxd_blas_set_parallel(parallel_fn fn, int threads) {
  g_parallel_threads = threads;
  g_parallel = fn;
}

// Loads the Fortran gemm symbols from `fast_lib` and the reference CBLAS
// from `reference_lib`. Returns 1 when the fast path is active.
int mlxd_blas_init(const char* fast_lib, const char* reference_lib) {
  if (reference_lib != nullptr) {
    if (void* ref = dlopen(reference_lib, RTLD_NOW | RTLD_LOCAL)) {
      g_ref_sgemm = reinterpret_cast<cblas_sgemm_fn>(dlsym(ref, "cblas_sgemm"));
      g_ref_dgemm = reinterpret_cast<cblas_dgemm_fn>(dlsym(ref, "cblas_dgemm"));
    }
  }
  void* lib = fast_lib ? dlopen(fast_lib, RTLD_NOW | RTLD_NOLOAD) : nullptr;
  if (lib == nullptr && fast_lib != nullptr) lib = dlopen(fast_lib, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return 0;
  g_sgemm = reinterpret_cast<sgemm_fn>(dlsym(lib, "sgemm_"));
  g_dgemm = reinterpret_cast<dgemm_fn>(dlsym(lib, "dgemm_"));
  g_gemm_lowp[0] = reinterpret_cast<cblas_gemm_lowp_fn>(dlsym(lib, "cblas_gemm_bf16bf16f32"));
  g_gemm_lowp[1] = reinterpret_cast<cblas_gemm_lowp_fn>(dlsym(lib, "cblas_gemm_f16f16f32"));
  g_set_threads_local = reinterpret_cast<set_threads_local_fn>(dlsym(lib, "mkl_set_num_threads_local_"));
  // MLX_DELEGATE_BLAS_SPLIT=measured: split a product shape only when its recent calls timed it faster
  // (machines shared with busy processes); =balanced: size the calling thread's block by the helpers'
  // measured speed; =0 turns splitting off (cpu_parallel.cpp).
  const char* split = std::getenv("MLX_DELEGATE_BLAS_SPLIT");
  if (split && std::strcmp(split, "measured") == 0) mlxd_blas_set_split_policy(1);
  if (split && std::strcmp(split, "balanced") == 0) mlxd_blas_set_split_policy(3);
  return g_sgemm.load() != nullptr;
}

uint64_t mlxd_blas_fast_calls() { return g_fast_calls.load(); }
uint64_t mlxd_blas_split_calls() { return g_split_calls.load(); }

// Whether mlxd_gemm_lowp serves `dtype` (0 bfloat16, 1 float16).
__attribute__((visibility("default"))) int mlxd_gemm_lowp_ready(int dtype) {
  return (dtype == 0 || dtype == 1) && g_gemm_lowp[dtype].load() != nullptr;
}

// Row-major c[m, n] = op(a)[m, k] . op(b)[k, n] in fp32 from 16-bit operands
// (dtype 0 bfloat16, 1 float16); op transposes where trans_* is set. Returns 0
// (and does nothing) when the gemm for `dtype` is not available.
__attribute__((visibility("default"))) int mlxd_gemm_lowp(int dtype, int trans_a, int trans_b, int m, int n, int k,
                                                          const uint16_t* a, int lda, const uint16_t* b, int ldb,
                                                          float* c, int ldc) {
  if (!mlxd_gemm_lowp_ready(dtype)) return 0;
  g_fast_calls.fetch_add(1, std::memory_order_relaxed);
  g_gemm_lowp[dtype].load()(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                            m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
  return 1;
}

// Single-threaded fp32 products on MKL (0) or an own tile (sgemm_x86.h: kOwnAvx2, kOwnAvx512); a tile
// wider than the processor runs is capped at its widest (none: MKL). Returns the previous setting. For
// A/B runs in one process.
__attribute__((visibility("default"))) int mlxd_blas_set_own_sgemm(int isa) {
  return g_own_sgemm.exchange(std::clamp(isa, 0, mlxd::blas::own_sgemm_best()));
}

// Whether mlxd_sgemm_serial is served (torch's sgemm_ was found).
__attribute__((visibility("default"))) int mlxd_sgemm_ready() { return g_sgemm.load() != nullptr; }

}  // extern "C"

static char trans_char(int t) { return t == CblasNoTrans ? 'N' : 'T'; }

// Below this many multiply-adds a product runs on one thread (~50 us of work).
static constexpr double kSerialMacs = 1 << 20;

// Runs `call` with MKL limited to the calling thread when the product is small.
template <typename Call>
static void sized_call(int m, int n, int k, Call call) {
  auto set_local = g_set_threads_local.load();
  if (set_local == nullptr || static_cast<double>(m) * n * k >= kSerialMacs) return call();
  const int one = 1;
  const int previous = set_local(&one);  // 0: no thread-local setting before
  call();
  set_local(&previous);
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the
// operands and dimensions instead of transposing anything.
template <typename T, typename Fortran>
static void gemm(Fortran f, int order, int ta, int tb, int m, int n, int k, T alpha, const T* a, int lda,
                 const T* b, int ldb, T beta, T* c, int ldc) {
  char ca = trans_char(ta), cb = trans_char(tb);
  if (order == CblasRowMajor) f(&cb, &ca, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  else f(&ca, &cb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

static int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A large row-major sgemm cut into column (or row) blocks, each one
// single-threaded MKL call on the runtime's pool, instead of one call on MKL's
// OpenMP team. That team belongs to the calling thread (MLX's stream thread),
// and its workers spin-wait between products: on a loaded machine a worker
// that is not scheduled holds up the whole product at a barrier (a ~2 ms
// transformer block took 60-80 ms at load average 11), where the pool's
// parts are taken by whoever is running.
struct SplitSgemm {
  sgemm_fn f;
  int ta, tb, m, n, k;
  float alpha, beta;
  const float *a, *b;
  float* c;
  int lda, ldb, ldc, parts;
  bool by_rows;
  // The balanced split (policy 3): part 0, the calling thread's, ends at
  // `first` and the other parts share the rest evenly; 0: all parts even.
  int first = 0;
  // Per-part start / end times and whether the calling thread ran it (the
  // balanced split learns from them); only recorded when `timed`.
  static constexpr int kMaxParts = 32;
  bool timed = false;
  pthread_t caller{};
  int64_t start[kMaxParts]{}, end[kMaxParts]{};
  bool on_caller[kMaxParts]{};

  // Block boundaries, multiples of 16 (whole vector widths) except the end.
  int bound(int i, int extent) const {
    if (i >= parts) return extent;
    if (i == 0) return 0;
    int64_t x = first > 0 ? first + static_cast<int64_t>(extent - first) * (i - 1) / (parts - 1)
                          : static_cast<int64_t>(extent) * i / parts;
    return static_cast<int>(x - x % 16);
  }
  void run(int i) const {
    const int extent = by_rows ? m : n, lo = bound(i, extent), hi = bound(i + 1, extent);
    if (lo >= hi) return;
    if (const int isa = g_own_sgemm.load(std::memory_order_relaxed)) {
      const bool t_a = ta != CblasNoTrans, t_b = tb != CblasNoTrans;
      if (by_rows)
        mlxd::blas::own_sgemm(isa, t_a, t_b, hi - lo, n, k, alpha, t_a ? a + lo : a + static_cast<int64_t>(lo) * lda, lda,
                              b, ldb, beta, c + static_cast<int64_t>(lo) * ldc, ldc);
      else
        mlxd::blas::own_sgemm(isa, t_a, t_b, m, hi - lo, k, alpha, a, lda, t_b ? b + static_cast<int64_t>(lo) * ldb : b + lo,
                              ldb, beta, c + lo, ldc);
      return;
    }
    if (by_rows) {
      const float* ap = ta == CblasNoTrans ? a + static_cast<int64_t>(lo) * lda : a + lo;
      gemm(f, CblasRowMajor, ta, tb, hi - lo, n, k, alpha, ap, lda, b, ldb, beta, c + static_cast<int64_t>(lo) * ldc,
           ldc);
    } else {
      const float* bp = tb == CblasNoTrans ? b + lo : b + static_cast<int64_t>(lo) * ldb;
      gemm(f, CblasRowMajor, ta, tb, m, hi - lo, k, alpha, a, lda, bp, ldb, beta, c + lo, ldc);
    }
  }
  // Runs call() with MKL limited to the calling thread.
  template <typename Call>
  static void serial(Call call) {
    auto set_local = g_set_threads_local.load();
    const int one = 1;
    const int previous = set_local(&one);
    call();
    set_local(&previous);
  }
  static void part(void* self, int i) {
    auto* s = static_cast<SplitSgemm*>(self);
    const int64_t t0 = s->timed ? now_ns() : 0;
    serial([&] { s->run(i); });
    if (s->timed && i < kMaxParts) {
      s->start[i] = t0;
      s->end[i] = now_ns();
      s->on_caller[i] = pthread_equal(pthread_self(), s->caller) != 0;
    }
  }
};

// Whether a split pays is measured, not assumed: the pool's helper is only as
// good as the core it gets. With the other core free the split can nearly
// halve a product's time; with that core taken (another
// process, or eager torch's OpenMP workers spinning after their own product)
// the blocks (smaller, so less efficient, each re-packing the shared operand)
// end up on the caller one after another, or wait for a preempted helper, and
// the split took 1.3-2x as long as one call (128 x 256 x 256: 216 against
// 107 us at load ~5). So each product shape keeps the recent time of both
// ways, takes the faster (the split only when it saves a tenth: it burns a
// second core), and retries the other way every kExploreEvery-th call, so a
// core freed (or taken) later is noticed within a few calls. Opt-in: on a quiet
// machine, alternating with eager torch (the demo), the timings caught eager's
// spinning OpenMP workers and chose single calls: the demo block took 1.6-1.9
// ms against 1.40-1.46 ms always splitting (2026-11-26).
namespace {
constexpr uint32_t kExploreEvery = 16;
constexpr int kShapeSlots = 64;
struct ShapeTimes {
  std::atomic<uint64_t> key{0};
  std::atomic<uint32_t> calls{0};
  std::atomic<int64_t> ns[2]{{0}, {0}};  // smoothed wall time per call: [0] one serial call, [1] split; 0 unknown
  std::atomic<uint32_t> share{0};  // balanced split: the calling thread's share x 65536; 0 unknown (even)
};
ShapeTimes g_shapes[kShapeSlots];
// 0: never split; 1: by measured time; 2: always, even blocks (default); 3: always, the calling thread's
// block sized by the measured speed of the helpers (balanced).
std::atomic<int> g_split_policy{2};
std::atomic<uint64_t> g_serial_choices{0};  // products the measured choice ran as one call
std::atomic<int> g_parts_per_thread{1};  // blocks per pool thread (_blas.set_split_shape)
std::atomic<int> g_split_axis{0};         // 0 the longer output axis, 1 rows, 2 columns

uint64_t shape_key(bool ta, bool tb, int m, int n, int k) {
  return (static_cast<uint64_t>(m) << 40) ^ (static_cast<uint64_t>(n) << 20) ^ static_cast<uint64_t>(k) ^
         (static_cast<uint64_t>(ta) << 62) ^ (static_cast<uint64_t>(tb) << 63);
}
ShapeTimes& shape_slot(uint64_t key) { return g_shapes[(key * 0x9E3779B97F4A7C15ull) >> 58]; }

// The slot of one product shape (a different shape in the slot restarts it).
ShapeTimes& shape_times(int ta, int tb, int m, int n, int k) {
  const uint64_t key = shape_key(ta == CblasTrans, tb == CblasTrans, m, n, k);
  auto& s = shape_slot(key);
  if (s.key.load(std::memory_order_relaxed) != key) {
    s.ns[0].store(0, std::memory_order_relaxed);
    s.ns[1].store(0, std::memory_order_relaxed);
    s.calls.store(0, std::memory_order_relaxed);
    s.share.store(0, std::memory_order_relaxed);
    s.key.store(key, std::memory_order_relaxed);
  }
  return s;
}

// Which way to run this call: the split first, then one call, then the faster.
bool choose_split(ShapeTimes& s) {
  const uint32_t call = s.calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t serial = s.ns[0].load(std::memory_order_relaxed), split = s.ns[1].load(std::memory_order_relaxed);
  if (split == 0) return true;
  if (serial == 0) return false;
  const bool faster = 10 * split < 9 * serial;
  return call % kExploreEvery == 0 ? !faster : faster;
}

// A faster time is taken at once, a slower one smoothed in: the way not in use
// is timed only every kExploreEvery-th call, so one good retry must be enough
// to bring it back once a spell of load is over.
void record(ShapeTimes& s, bool split, int64_t ns) {
  auto& t = s.ns[split ? 1 : 0];
  const int64_t old = t.load(std::memory_order_relaxed);
  t.store(old == 0 || ns < old ? ns : (3 * old + ns) / 4, std::memory_order_relaxed);
}
// The balanced split. A helper is only as fast as the core it gets: with eager
// torch's OpenMP worker spinning on the other core after its own product (any
// process that runs torch beside the delegate, the stock runtime's output copy
// included) or another process there, the helper ran its half at a fraction of
// the calling thread's speed, or started late, and the caller waited for it at
// the product's end; an even split then took about as long as one call. So the
// caller's block (part 0; it is certainly running) is sized so that both ends
// meet by the last calls' timings: the caller's time for the whole product A,
// a helper's H (from its block's time) and how late the first helper started
// w give the share f with f A = w + (1 - f) H / helpers. Smoothed per shape; a
// call that no helper joined counts as kMaxShare. A helper that is fast again
// shows it in its (smaller) block, so the share comes back within a few calls.
constexpr double kMaxShare = 0.9;

double balanced_share(const ShapeTimes& t, int parts) {
  const uint32_t q = t.share.load(std::memory_order_relaxed);
  return q == 0 ? 1.0 / parts : q / 65536.0;
}

void rebalance(ShapeTimes& t, const SplitSgemm& s, int extent, int64_t job_start) {
  const int parts = std::min(s.parts, SplitSgemm::kMaxParts);
  const int first = s.bound(1, extent);
  if (!s.on_caller[0] || first <= 0 || first >= extent) return;  // a helper took part 0: nothing to learn
  const double caller_whole = static_cast<double>(s.end[0] - s.start[0]) * extent / first;
  double helper_whole = 0;
  int helped = 0;
  int64_t first_start = INT64_MAX;
  for (int i = 1; i < parts; ++i) {
    const int lo = s.bound(i, extent), hi = s.bound(i + 1, extent);
    if (hi <= lo || s.on_caller[i]) continue;
    helper_whole += static_cast<double>(s.end[i] - s.start[i]) * extent / (hi - lo);
    first_start = std::min(first_start, s.start[i]);
    ++helped;
  }
  double target = kMaxShare;
  if (helped > 0) {
    const double h = helper_whole / helped / (parts - 1), wake = static_cast<double>(first_start - job_start);
    target = (std::max(0.0, wake) + h) / (caller_whole + h);
  }
  target = std::clamp(target, 1.0 / parts, kMaxShare);
  const double smoothed = (3 * balanced_share(t, parts) + target) / 4;
  t.share.store(static_cast<uint32_t>(smoothed * 65536), std::memory_order_relaxed);
}
}  // namespace

// Splits the product over the runtime's pool when one is registered and the
// product is large; false: the caller runs it as one call.
static bool split_sgemm(sgemm_fn f, int order, int ta, int tb, int m, int n, int k, float alpha, const float* a,
                        int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  auto parallel = g_parallel.load();
  const int threads = g_parallel_threads.load();
  if (parallel == nullptr || threads < 2 || g_set_threads_local.load() == nullptr || order != CblasRowMajor ||
      static_cast<double>(m) * n * k < kSerialMacs)
    return false;
  // Cut the longer of the output's two axes, one part per thread by default: two per thread (to even
  // out a late thread) made smaller blocks, each re-packing the shared operand, and lost in the demo
  // block's products (2026-11-26, load ~5, two runs: 1.40 / 1.86 ms against 1.46 / 1.95 ms).
  const int axis = g_split_axis.load(std::memory_order_relaxed);
  const bool by_rows = axis == 0 ? m > n : axis == 1;
  const int extent = by_rows ? m : n;
  const int parts = std::min(g_parts_per_thread.load(std::memory_order_relaxed) * threads, extent / 32);
  if (parts < 2) return false;
  const int policy = g_split_policy.load(std::memory_order_relaxed);
  if (policy == 0) return false;
  // Balanced: one block per thread (with more blocks per thread the parts even themselves out).
  const bool balanced = policy == 3 && parts == threads && parts <= SplitSgemm::kMaxParts;
  ShapeTimes* times = policy == 1 || balanced ? &shape_times(ta, tb, m, n, k) : nullptr;
  const bool split = policy != 1 || choose_split(*times);
  const int64_t start = times ? now_ns() : 0;
  if (split) {
    SplitSgemm s{f, ta, tb, m, n, k, alpha, beta, a, b, c, lda, ldb, ldc, parts, by_rows};
    if (balanced) {
      const int x = static_cast<int>(extent * balanced_share(*times, parts));
      s.first = std::clamp(x - x % 16, 16, std::max(16, extent - 16));
      s.timed = true;
      s.caller = pthread_self();
    }
    g_split_calls.fetch_add(1, std::memory_order_relaxed);
    parallel(parts, &SplitSgemm::part, &s);
    if (balanced) {
      rebalance(*times, s, extent, start);
      return true;
    }
  } else {
    g_serial_choices.fetch_add(1, std::memory_order_relaxed);
    if (const int isa = g_own_sgemm.load(std::memory_order_relaxed))
      mlxd::blas::own_sgemm(isa, ta != CblasNoTrans, tb != CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    else
      SplitSgemm::serial([&] { gemm(f, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); });
  }
  if (times) record(*times, split, now_ns() - start);
  return true;
}

extern "C" {

__attribute__((visibility("default"))) void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                                                        const float* a, int lda, const float* b, int ldb,
                                                        float beta, float* c, int ldc) {
  if (auto f = g_sgemm.load()) {
    g_fast_calls.fetch_add(1, std::memory_order_relaxed);
    if (split_sgemm(f, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
    // Every product that runs on one thread takes the same gemm as the pool's blocks and the runtime's
    // kernels (mlxd_sgemm_serial), so a product gives the same bits through MLX's matmul and through
    // the linear kernel (a compiled graph and the node-by-node run must agree exactly). Only a large
    // product with splitting off keeps MKL's team.
    const bool one_thread = static_cast<double>(m) * n * k < kSerialMacs || g_parallel.load() != nullptr;
    const int isa = g_own_sgemm.load(std::memory_order_relaxed);
    if (order == CblasRowMajor && one_thread && isa) {
      mlxd::blas::own_sgemm(isa, ta != CblasNoTrans, tb != CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
    sized_call(m, n, k, [&] { gemm(f, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); });
  } else if (auto r = g_ref_sgemm.load()) {
    r(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// Row-major c = alpha op(a) op(b) + beta c in fp32 on the calling thread
// only (MKL's thread-local count set to 1 for the call): for kernels that
// split their own work across the cores and call this from each part, where
// MKL's OpenMP team would oversubscribe them. Returns 0 (and does nothing)
// when no fast sgemm is loaded.
__attribute__((visibility("default"))) int mlxd_sgemm_serial(int trans_a, int trans_b, int m, int n, int k,
                                                             float alpha, const float* a, int lda, const float* b,
                                                             int ldb, float beta, float* c, int ldc) {
  auto f = g_sgemm.load();
  if (f == nullptr) return 0;
  g_fast_calls.fetch_add(1, std::memory_order_relaxed);
  if (const int isa = g_own_sgemm.load(std::memory_order_relaxed)) {
    mlxd::blas::own_sgemm(isa, trans_a != 0, trans_b != 0, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return 1;
  }
  auto call = [&] {
    gemm(f, CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha,
         a, lda, b, ldb, beta, c, ldc);
  };
  auto set_local = g_set_threads_local.load();
  if (set_local == nullptr) {
    call();
    return 1;
  }
  const int one = 1;
  const int previous = set_local(&one);
  call();
  set_local(&previous);
  return 1;
}

// Weights laid out once for mlxd_sgemm_serial's own tile (sgemm_x86.h, own_pack_a): the floats a pack
// of op(a) [m, k] takes, 0 when MKL serves the products (nothing to pack for).
__attribute__((visibility("default"))) int64_t mlxd_sgemm_pack_a_floats(int m, int k) {
  return g_own_sgemm.load(std::memory_order_relaxed) ? mlxd::blas::own_pack_a_floats(m, k) : 0;
}

// Packs op(a) for the current tile into dst (mlxd_sgemm_pack_a_floats floats), for products of about
// m_hint x n_hint, written across when `across` (own_pack_a); returns 0 when MKL serves the products
// (nothing written).
__attribute__((visibility("default"))) int mlxd_sgemm_pack_a(int m, int k, int m_hint, int n_hint, int across,
                                                             const float* a, int lda, float* dst) {
  const int isa = g_own_sgemm.load(std::memory_order_relaxed);
  if (isa) mlxd::blas::own_pack_a(isa, m, k, m_hint, n_hint, across != 0, a, lda, dst);
  return isa;
}

// The multiple a packed product's first row must be.
__attribute__((visibility("default"))) int mlxd_sgemm_pack_align(const float* pack) {
  return mlxd::blas::own_pack_a_align(pack);
}

// Rows [r0, r0 + m) of a pack, column p times kscale[p], as a pack into dst (mlxd_sgemm_pack_a_floats(m,
// k) floats; own_pack_a_scaled). Returns 0 (nothing written) where the pack is not one of the current
// tile's or the rows do not fit.
__attribute__((visibility("default"))) int mlxd_sgemm_pack_a_scaled(const float* pack, int r0, int m,
                                                                    const float* kscale, float* dst) {
  const int isa = g_own_sgemm.load(std::memory_order_relaxed);
  if (isa == 0 || mlxd::blas::own_pack_a_isa(pack) != isa) return 0;
  return mlxd::blas::own_pack_a_scaled(pack, r0, m, kscale, dst) ? 1 : 0;
}

// mlxd_sgemm_serial with op(a) [., k] packed by mlxd_sgemm_pack_a, rows [r0, r0 + m) of it. Returns 0
// (doing nothing) when the pack does not fit (another k, rows outside it) or was made for another tile
// than the one serving products now (the kind was switched since): the caller runs mlxd_sgemm_serial
// on the plain weights.
__attribute__((visibility("default"))) int mlxd_sgemm_serial_packed(const float* pack, int r0, int m, int k,
                                                                    int trans_b, int n, float alpha, const float* b,
                                                                    int ldb, float beta, float* c, int ldc) {
  const int isa = g_own_sgemm.load(std::memory_order_relaxed);
  if (isa == 0 || mlxd::blas::own_pack_a_isa(pack) != isa) return 0;
  if (!mlxd::blas::own_sgemm_packed_a(pack, r0, m, k, trans_b != 0, n, alpha, b, ldb, beta, c, ldc)) return 0;
  g_fast_calls.fetch_add(1, std::memory_order_relaxed);
  return 1;
}

// Row-major c[m, n] = alpha a op(b) + beta c on the calling thread, op(b) [k, n] written panel by panel
// by fn (sgemm_x86.h, BPanelFn: quantized weights dequantized into the own tile's panels). The own
// tile serves it even where MKL serves plain products (it skips a float32 copy of the weights and MKL's
// packing of it). Returns 0 (nothing done) without an own tile. m 0: whether one serves.
__attribute__((visibility("default"))) int mlxd_sgemm_serial_b_source(int m, int n, int k, float alpha, const float* a,
                                                                      int lda, mlxd::blas::BPanelFn fn, void* ctx,
                                                                      float beta, float* c, int ldc) {
  int isa = g_own_sgemm.load(std::memory_order_relaxed);
  if (isa == 0) isa = mlxd::blas::own_sgemm_best();
  if (isa == 0) return 0;
  if (m <= 0) return 1;
  g_fast_calls.fetch_add(1, std::memory_order_relaxed);
  mlxd::blas::own_sgemm_b_source(isa, m, n, k, alpha, a, lda, {fn, ctx}, beta, c, ldc);
  return 1;
}

// mlxd_sgemm_serial_packed's product written across: ct [n, m], row stride ldct.
__attribute__((visibility("default"))) int mlxd_sgemm_serial_packed_ct(const float* pack, int r0, int m, int k,
                                                                       int trans_b, int n, float alpha,
                                                                       const float* b, int ldb, float beta, float* ct,
                                                                       int ldct) {
  const int isa = g_own_sgemm.load(std::memory_order_relaxed);
  if (isa == 0 || mlxd::blas::own_pack_a_isa(pack) != isa) return 0;
  if (!mlxd::blas::own_sgemm_packed_a_ct(pack, r0, m, k, trans_b != 0, n, alpha, b, ldb, beta, ct, ldct)) return 0;
  g_fast_calls.fetch_add(1, std::memory_order_relaxed);
  return 1;
}

__attribute__((visibility("default"))) void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha,
                                                        const double* a, int lda, const double* b, int ldb,
                                                        double beta, double* c, int ldc) {
  if (auto f = g_dgemm.load()) {
    g_fast_calls.fetch_add(1, std::memory_order_relaxed);
    sized_call(m, n, k, [&] { gemm(f, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); });
  } else if (auto r = g_ref_dgemm.load()) {
    r(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

}  // extern "C"

extern "C" {

// How large fp32 products use the runtime's pool: 0 never, 1 by measured time,
// 2 always (default), 3 always, balanced by the helpers' measured speed.
// Returns the previous policy.
__attribute__((visibility("default"))) int mlxd_blas_set_split_policy(int policy) {
  return g_split_policy.exchange(policy < 0 || policy > 3 ? 2 : policy);
}

// How large fp32 products are cut now: 0 not at all (no pool registered: MLX_DELEGATE_BLAS_SPLIT=0 or
// _runtime.set_blas_split(False), or the policy "never"), else the policy above. The runtime's fp32 linear
// kernel cuts its products evenly itself, so it steps aside unless this is 2 (always, even blocks).
__attribute__((visibility("default"))) int mlxd_blas_split_mode() {
  return g_parallel.load() == nullptr ? 0 : g_split_policy.load();
}

// The calling thread's share of a product shape under the balanced split
// (0-1; 0 when the shape has no measured share yet): for tests and benchmarks.
__attribute__((visibility("default"))) double mlxd_blas_balanced_share(int trans_a, int trans_b, int m, int n, int k) {
  const uint64_t key = shape_key(trans_a != 0, trans_b != 0, m, n, k);
  const auto& s = shape_slot(key);
  return s.key.load(std::memory_order_relaxed) == key ? s.share.load(std::memory_order_relaxed) / 65536.0 : 0.0;
}

// How a split product is cut: parts per pool thread (1-4) and the axis (0 the
// longer output axis, 1 rows, 2 columns). Returns the previous setting as
// 4 * parts_per_thread + axis.
__attribute__((visibility("default"))) int mlxd_blas_set_split_shape(int parts_per_thread, int axis) {
  const int previous = 4 * g_parts_per_thread.load() + g_split_axis.load();
  g_parts_per_thread = std::clamp(parts_per_thread, 1, 4);
  g_split_axis = std::clamp(axis, 0, 2);
  return previous;
}

// The current split shape, as mlxd_blas_set_split_shape returns it (the
// runtime's linear kernel cuts its products the same way).
__attribute__((visibility("default"))) int mlxd_blas_split_shape() {
  return 4 * g_parts_per_thread.load() + g_split_axis.load();
}

// Products that the measured choice ran as one single-threaded call.
__attribute__((visibility("default"))) uint64_t mlxd_blas_serial_choices() { return g_serial_choices.load(); }

}  // extern "C"
