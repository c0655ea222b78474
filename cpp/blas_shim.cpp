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

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>

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
// MKL's per-thread thread count (Fortran mkl_set_num_threads_local_, by
// pointer): small products run on the calling thread, since waking MKL's
// OpenMP team costs more than they do.
using set_threads_local_fn = int (*)(const int*);
static std::atomic<set_threads_local_fn> g_set_threads_local{nullptr};

// A parallel-for the runtime registers (its CPU helper pool): runs part(ctx, i)
// for i in [0, parts), each part claimed by whichever of the calling thread and
// the helpers is free, so a helper that is not scheduled never stalls a call.
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
  // (machines shared with busy processes); =0 turns splitting off (cpu_parallel.cpp).
  const char* split = std::getenv("MLX_DELEGATE_BLAS_SPLIT");
  if (split && std::strcmp(split, "measured") == 0) mlxd_blas_set_split_policy(1);
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

  // Block boundaries, multiples of 16 (whole vector widths) except the end.
  int bound(int i, int extent) const {
    if (i >= parts) return extent;
    int x = static_cast<int>(static_cast<int64_t>(extent) * i / parts);
    return x - x % 16;
  }
  void run(int i) const {
    const int extent = by_rows ? m : n, lo = bound(i, extent), hi = bound(i + 1, extent);
    if (lo >= hi) return;
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
    serial([&] { static_cast<SplitSgemm*>(self)->run(i); });
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
};
ShapeTimes g_shapes[kShapeSlots];
// 0: never split; 1: by measured time; 2: always (default).
std::atomic<int> g_split_policy{2};
std::atomic<uint64_t> g_serial_choices{0};  // products the measured choice ran as one call
std::atomic<int> g_parts_per_thread{1};  // blocks per pool thread (_blas.set_split_shape)
std::atomic<int> g_split_axis{0};         // 0 the longer output axis, 1 rows, 2 columns

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The slot of one product shape (a different shape in the slot restarts it).
ShapeTimes& shape_times(int ta, int tb, int m, int n, int k) {
  const uint64_t key = (static_cast<uint64_t>(m) << 40) ^ (static_cast<uint64_t>(n) << 20) ^ static_cast<uint64_t>(k) ^
                       (static_cast<uint64_t>(ta == CblasTrans) << 62) ^ (static_cast<uint64_t>(tb == CblasTrans) << 63);
  auto& s = g_shapes[(key * 0x9E3779B97F4A7C15ull) >> 58];
  if (s.key.load(std::memory_order_relaxed) != key) {
    s.ns[0].store(0, std::memory_order_relaxed);
    s.ns[1].store(0, std::memory_order_relaxed);
    s.calls.store(0, std::memory_order_relaxed);
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
  ShapeTimes* times = policy == 1 ? &shape_times(ta, tb, m, n, k) : nullptr;
  const bool split = times == nullptr || choose_split(*times);
  const int64_t start = times ? now_ns() : 0;
  if (split) {
    SplitSgemm s{f, ta, tb, m, n, k, alpha, beta, a, b, c, lda, ldb, ldc, parts, by_rows};
    g_split_calls.fetch_add(1, std::memory_order_relaxed);
    parallel(parts, &SplitSgemm::part, &s);
  } else {
    g_serial_choices.fetch_add(1, std::memory_order_relaxed);
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
// 2 always (default). Returns the previous policy.
__attribute__((visibility("default"))) int mlxd_blas_set_split_policy(int policy) {
  return g_split_policy.exchange(policy < 0 || policy > 2 ? 2 : policy);
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
