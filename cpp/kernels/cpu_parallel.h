// Shared plumbing for the CPU element-wise / row kernels (unary_cpu, rows_cpu):
// the on/off switch, CPU feature detection, a two-way (one part per core)
// parallel loop on persistent helper threads, and per-kernel call counters.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/mlx.h>

namespace mlxd::rt {

// MLX_DELEGATE_CPU_KERNELS: "0" turns the kernels off, "portable" uses the
// scalar (libm) code even where the CPU has AVX2 + FMA, anything else: on.
enum class CpuKernelMode { off, best, portable };
CpuKernelMode cpu_kernel_mode();

// Whether a custom CPU kernel may replace MLX's op right now: kernels on (the
// switch above and set_cpu_kernels_enabled) and the default device is the CPU
// (MLX keeps its own kernels for GPUs). Read while a graph is built: a graph
// already compiled keeps the choice it was traced with.
bool cpu_kernels_active();

// Process-wide override for A/B measurements in one process (on by default;
// cannot turn on what MLX_DELEGATE_CPU_KERNELS=0 turned off).
void set_cpu_kernels_enabled(bool on);
bool cpu_kernels_enabled();

// Large fp32 products on the BLAS shim (MLX's cblas_sgemm served by torch's
// MKL) cut into single-threaded blocks on this pool instead of MKL's OpenMP
// team. On unless MLX_DELEGATE_BLAS_SPLIT=0; this switch is for A/B runs in
// one process. Returns whether splitting is now on (false without the shim).
bool set_blas_split(bool on);

// How the kernel pool's helpers wait between jobs (MLX_DELEGATE_SPIN_US long):
// pausing on the core (the default), or, past MLX_DELEGATE_SPIN_PAUSE_US,
// yielding it at each step (MLX_DELEGATE_SPIN_YIELD=1). Process-wide; this
// switch is for A/B runs in one process.
void set_pool_spin_yield(bool on);
bool pool_spin_yield();

// Whether the vector (AVX2 + FMA) code runs: mode best and the CPU has both.
bool cpu_use_avx2();

// Whether AVX-512F code runs: cpu_use_avx2(), the CPU has AVX-512F and
// MLX_DELEGATE_CPU_KERNELS is not "avx2" (which caps the kernels at AVX2, to
// test that code on CPUs with more).
bool cpu_use_avx512();

// Weight rows a thread streams at once in a one-row product (a decode step's GEMVs): 4 on Intel
// processors, 1 elsewhere. A row at a time is one sequential stream, which Zen 4's prefetchers follow
// best; an Ice Lake Xeon's core reads one stream at ~12 GB/s and four in different pages at ~17
// (plain reads, one thread; two threads ~20 against ~27). MLX_DELEGATE_GEMV_STREAMS=1 / 2 / 4 overrides.
int cpu_weight_streams();

// Rows n0 .. n1 of a one-row product, NB at a time, the NB of a step a 1 / NB of the range apart so
// each walks its own sequential stream through its own pages: block(n, stride, NB) takes rows
// n + j * stride (j < NB); the rows left over go one at a time (NB 1).
template <int NB, typename Block>
void cpu_stream_rows(int64_t n0, int64_t n1, Block&& block) {
  const int64_t steps = (n1 - n0) / NB;
  for (int64_t i = 0; i < steps; ++i) block(n0 + i, steps, std::integral_constant<int, NB>{});
  for (int64_t n = n0 + steps * NB; n < n1; ++n) block(n, int64_t{1}, std::integral_constant<int, 1>{});
}

// Whether x's dtype is one the kernels read and write (float32, bfloat16,
// float16; math in float32) and x is non-empty.
bool cpu_kernel_dtype_ok(const mlx::core::array& x);

// Runs fn(begin, end) over [0, n) split into one contiguous part per core,
// the first part on the calling thread. Work below `min_parallel` elements in
// total (`n * cost_per_item`) stays on the calling thread: waking a helper
// costs more than it saves. `align` rounds part boundaries (vector widths).
void cpu_parallel_for(int64_t n, int64_t cost_per_item, int64_t align,
                      const std::function<void(int64_t, int64_t)>& fn);
constexpr int64_t kCpuMinParallel = 1 << 14;

// Runs fn(i) for i in [0, parts) on the pool, each part claimed by whichever
// thread is free (the calling thread included): for kernels that size their
// own parts (a product cut into as many blocks as threads). Part 0 is always
// the calling thread's; it claims further parts from the front and the
// helpers from the last part down.
void cpu_parallel_parts(int parts, const std::function<void(int)>& fn);
// Threads the pool computes with: the calling thread and its helpers.
int cpu_pool_threads();

// Holds the helpers awake between jobs: while at least one hold is open, a helper whose spin
// (MLX_DELEGATE_SPIN_US) ran out keeps waiting for the next job, yielding its core at each step,
// instead of going to sleep, so the next job needs no futex wake-up. For the span of one large
// call's evaluation (stream_wait.cpp), whose products come at uneven gaps; holds nest, and the
// caller must close each one (CpuPoolHold). Opt-in: set_pool_hold_in_call(true) (or
// MLX_DELEGATE_POOL_HOLD=1 at start-up) makes large calls open one.
void cpu_pool_hold_open();
void cpu_pool_hold_close();
void set_pool_hold_in_call(bool on);
bool pool_hold_in_call();
class CpuPoolHold {
 public:
  explicit CpuPoolHold(bool on) : on_(on) {
    if (on_) cpu_pool_hold_open();
  }
  ~CpuPoolHold() {
    if (on_) cpu_pool_hold_close();
  }
  CpuPoolHold(const CpuPoolHold&) = delete;
  CpuPoolHold& operator=(const CpuPoolHold&) = delete;

 private:
  bool on_;
};

// The calling thread's OpenMP team (torch's libgomp, when the process has one loaded) as the pool's
// helpers for the span of one call: runs body() on the calling thread, which waits there for the call's
// evaluation on MLX's stream thread, while the team's other threads claim the pool's parts as its
// helpers do. After an eager torch call that team's worker spins (GOMP_SPINCOUNT) into the delegate's
// call and held the second core from the pool's own helper; lent to the pool, the spinning worker is the
// helper. Returns false without running body() when off (set_pool_omp_team), when no OpenMP runtime is
// loaded, the pool has no helpers, OpenMP allows one thread, or the caller is inside a parallel region
// already.
bool cpu_pool_run_with_omp_team(const std::function<void()>& body);
// Off; auto (the default): eval_adaptive lends the team where calls follow each other closely and lent
// calls measure faster than unlent ones (stream_wait.cpp); always: every call long enough to split its
// work (A/B runs, tests). MLX_DELEGATE_OMP_TEAM=off|auto|always at start-up.
enum class OmpTeam : int { Off = 0, Auto = 1, Always = 2 };
void set_pool_omp_team(OmpTeam mode);
OmpTeam pool_omp_team();
// Ends the calling thread's OpenMP team's idle threads now (omp_pause_resource_all, soft) rather than
// letting them spin: after an eager torch op (the stock runtime's clone of a returned tensor is one) the
// team's worker spins for 4-7 ms (GOMP_SPINCOUNT), through most of a decode step, on the core the pool's
// helper needs. The team's next parallel region starts its threads again (~0.1-0.2 ms). False, doing
// nothing, where the pause is off (set_pool_omp_pause, MLX_DELEGATE_OMP_PAUSE=0), the runtime has no such
// call, the caller is in a parallel region or the pool has no helpers. Independent of lending
// (set_pool_omp_team): stream_wait.cpp pauses a call's team when it does not lend it (eval_adaptive).
bool cpu_pool_pause_omp_team();
void set_pool_omp_pause(bool on);
bool pool_omp_pause();
// Calls run with a lent team so far, the parts its workers took, and the team's pauses (tests, benchmarks).
struct OmpTeamStats {
  uint64_t calls, parts, pauses;
};
OmpTeamStats cpu_pool_omp_team_stats();

// Opt-in counters of the pool's jobs (off by default: two clock reads per job when on), for
// benchmarks that split a decode step's time (benchmarks/decode_split.py). Jobs counted are those
// that ran on the helpers (more than one part, helpers present, not a concurrent call's serial run).
struct CpuPoolStats {
  uint64_t jobs = 0;
  uint64_t caller_parts = 0, helper_parts = 0;  // parts run by the calling thread / by helpers
  uint64_t caller_wait_ns = 0;  // the caller's time from its last part to the job's end: waiting for helpers
  uint64_t helper_late_ns = 0;  // from a job's publication to a helper's first part of it, summed
  uint64_t helper_missed = 0;   // jobs in which no helper ran a part (all on the caller)
  uint64_t helper_sleeps = 0;   // helper parts reached from sleep (a futex wake-up) rather than a spin
};
void cpu_pool_set_stats(bool on);
bool cpu_pool_stats_enabled();
CpuPoolStats cpu_pool_stats();
void cpu_pool_reset_stats();

// Sends the helper threads to sleep now instead of at the end of their spin
// (MLX_DELEGATE_SPIN_US): for the end of a call when the next is not expected
// soon, so the spin does not take a core from other work in the meantime.
void cpu_pool_park();

// The thread waiting for a call's result takes parts of the pool's jobs as a helper until `stop` is set
// through cpu_pool_stop_serving() or the clock (steady, ns) passes `deadline_ns`; the pool's own helpers
// sleep meanwhile. 1 when it ended by `stop`, -1 by the deadline, 0 at once where the pool has no helpers.
// Parts so run: cpu_pool_caller_serve_parts.
int cpu_pool_serve_call(const std::atomic<bool>& stop, int64_t deadline_ns);
void cpu_pool_stop_serving(std::atomic<bool>& stop);
uint64_t cpu_pool_caller_serve_parts();

// Where a CPU kernel primitive sends its task: MLX's CPU encoder for the stream, or, while a kernel
// chain records its members on this thread (CpuTaskRecording), the chain's list, run as one task.
class CpuTaskSink {
 public:
  template <class F>
  void dispatch(F&& f) {
    if (recorded_) {
      recorded_->emplace_back(std::forward<F>(f));
    } else {
      encoder_->dispatch(std::forward<F>(f));
    }
  }

 private:
  friend CpuTaskSink& cpu_task_sink(const mlx::core::Stream& s);
  mlx::core::cpu::CommandEncoder* encoder_ = nullptr;
  std::vector<std::function<void()>>* recorded_ = nullptr;
};
CpuTaskSink& cpu_task_sink(const mlx::core::Stream& s);

// While alive, the tasks this thread's kernels dispatch go to `tasks` instead of MLX's encoder.
class CpuTaskRecording {
 public:
  explicit CpuTaskRecording(std::vector<std::function<void()>>& tasks);
  ~CpuTaskRecording();
  CpuTaskRecording(const CpuTaskRecording&) = delete;
  CpuTaskRecording& operator=(const CpuTaskRecording&) = delete;

 private:
  std::vector<std::function<void()>>* saved_;
};

// The start of every CPU kernel primitive's eval_cpu: gives `out` a buffer of
// its own unless it already has one (an input's, donated); the task goes to the
// returned sink. MLX keeps the inputs and output alive until it has run.
CpuTaskSink& begin_cpu_task(const mlx::core::Stream& s, const std::vector<mlx::core::array>& in,
                            mlx::core::array& out, bool has_buffer = false);

// Kernels a chain may record (kernel_chain.h), by their primitive's name: each eval_cpu dispatches
// only through cpu_task_sink and reads no input's values before its task runs (pointers, shapes and
// strides only). Each kernel file registers its own with a static ChainableKernel.
// `in_place`: (output, input) pairs the kernel updates in place when, as a chain member, it finds that
// output already holding that input's buffer (the chain hands over a KV cache nothing else reads).
bool cpu_kernel_chainable(const char* primitive_name);
const std::vector<std::pair<int, int>>& cpu_kernel_in_place(const char* primitive_name);
struct ChainableKernel {
  explicit ChainableKernel(const char* primitive_name, std::vector<std::pair<int, int>> in_place = {});
};
// Whether this thread is recording a chain member's tasks (its eval_cpu runs inside the chain's task).
bool cpu_task_recording();

// A kept (thread_local) scratch vector holding at least n elements, contents unspecified. It never shrinks:
// resized down and back up, layer after layer of other sizes, a vector zero-fills the regrown part on
// every call (memset on the calling thread: ~20 us of a 2.2 ms MobileNetV3-Large call, 2026-11-28).
template <typename T>
T* at_least(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

// Call counters by kernel name ("softmax", "silu", ...): tests prove which code ran. `name` must live
// as long as the process (a literal).
void cpu_kernel_note_call(const char* name);
std::map<std::string, uint64_t> cpu_kernel_call_counts();

// Reads float32 / bfloat16 / float16 elements as float32 and back (dtype of
// the array the pointer came from).
void cpu_load_f32(const void* src, mlx::core::Dtype dtype, int64_t offset, int64_t n, float* dst);
void cpu_store_f32(const float* src, mlx::core::Dtype dtype, int64_t offset, int64_t n, void* dst);

// Copies a strided view (`src` at its first element, strides in elements)
// into `dst` in row-major order. Kernels take any layout through it instead of
// asking for an mx::contiguous node, which costs a graph node per call even
// when the input is contiguous already.
void cpu_copy_strided(const void* src, size_t itemsize, const mlx::core::Shape& shape,
                      const mlx::core::Strides& strides, void* dst);

// An input as a row-major buffer: `data` itself when row-contiguous, else a
// packed copy held by the object. Built inside a kernel's dispatched task
// (the input's data is ready there).
class CpuRowMajor {
 public:
  CpuRowMajor(const void* data, size_t itemsize, const mlx::core::Shape& shape, const mlx::core::Strides& strides,
              bool contiguous);
  const void* data() const { return data_; }

 private:
  std::vector<char> copy_;
  const void* data_;
};

// An input as row-major float32 inside a kernel's task: in place when it already
// is, else packed (strided views) and widened (bfloat16 / float16) here, so the
// graph needs no contiguous or astype node per call.
class F32RowMajor {
 public:
  explicit F32RowMajor(const mlx::core::array& a);
  const float* data() const {
    return dtype_ == mlx::core::float32 ? static_cast<const float*>(raw_.data()) : converted_.data();
  }

 private:
  CpuRowMajor raw_;
  mlx::core::Dtype dtype_;
  std::vector<float> converted_;
};

// Row-major c = alpha op(a) op(b) + beta c on the calling thread, served by the
// BLAS shim (blas_shim.cpp: mlxd_sgemm_serial); nullptr when the shim is not
// loaded or found no fast sgemm.
using SerialSgemmFn = int (*)(int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                              const float* b, int ldb, float beta, float* c, int ldc);
SerialSgemmFn serial_sgemm();

// serial_sgemm's c = alpha a op(b) + beta c (a row-major [m, k]) with op(b) [k, n] written panel by
// panel by fn (the shim's own tile: sgemm_x86.h, BPanelFn), so quantized weights are dequantized
// straight into the tile's panels. nullptr without the shim or an own tile.
using SgemmPanelFn = void (*)(void* ctx, int j, int nr, int pc, int kc, float* dst, int width);
using SerialSgemmBSourceFn = int (*)(int m, int n, int k, float alpha, const float* a, int lda, SgemmPanelFn fn,
                                     void* ctx, float beta, float* c, int ldc);
SerialSgemmBSourceFn serial_sgemm_b_source();

// The products a pack is made for: about m rows and n columns, written across (serial_sgemm_packed_ct)
// when `across`.
struct SgemmPackHints {
  int m = 0, n = 0;
  bool across = false;
};
// `count` matrices op(a) [m, k] (row-major, consecutive) laid out once for serial_sgemm's tile (the
// BLAS shim's own gemm: mlxd_sgemm_pack_a), for the hinted products: a float32 array [count, floats per
// matrix]. std::nullopt where the products run on MKL or without the shim, or MLX_DELEGATE_WEIGHT_PACKS=0
// (read at each call: A/B runs in one process).
std::optional<mlx::core::array> serial_sgemm_pack(const float* a, int count, int m, int k, SgemmPackHints hints);
// Matrix `index` of such a pack.
const float* serial_sgemm_pack_at(const mlx::core::array& pack, int index);
// serial_sgemm's c = alpha a[r0 : r0 + m] op(b) + beta c with a [., k] from a pack. False, doing
// nothing, where the pack does not fit (another k, the shim's tile switched since, r0 not a multiple
// of serial_sgemm_pack_align): the caller runs serial_sgemm on the plain operand.
bool serial_sgemm_packed(const float* pack, int r0, int m, int k, bool trans_b, int n, float alpha, const float* b,
                         int ldb, float beta, float* c, int ldc);
// The same product written across: ct [n, m] (row stride ldct) = (a[r0 : r0 + m] op(b))^T + beta ct.
bool serial_sgemm_packed_ct(const float* pack, int r0, int m, int k, bool trans_b, int n, float alpha, const float* b,
                            int ldb, float beta, float* ct, int ldct);
int serial_sgemm_pack_align(const float* pack);
// Rows [r0, r0 + m) of such a pack (r0 a multiple of its align) with column p (of k) times kscale[p], as a
// pack of their own in `buffer` (grown as needed): its address, or nullptr where the pack does not fit.
const float* serial_sgemm_pack_scaled(const float* pack, int r0, int m, int k, const float* kscale,
                                      std::vector<float>& buffer);

}  // namespace mlxd::rt
