// Plumbing for the CPU element-wise and row kernels; see cpu_parallel.h.
#include "kernels/cpu_parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

namespace mlxd::rt {
namespace mx = mlx::core;

namespace {
// The cores this process may run on: its CPU affinity (taskset, a container's
// cpuset), not the machine's count that hardware_concurrency() gives. A pool
// sized by the machine under `taskset -c 1` handed every kernel's halves to a
// helper on the same core, so each call waited for a context switch.
unsigned usable_cores() {
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return static_cast<unsigned>(n);
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// Off by default: with eager torch's OpenMP workers spinning in the same
// process (the demo's alternation), a helper that yielded lost its core to them
// for a time slice: the demo block took 1.9-2.0 ms instead of 1.40-1.45 (quiet,
// 2026-11-26). MLX_DELEGATE_SPIN_YIELD=1 turns it on for machines shared with
// other busy processes.
std::atomic<bool> g_spin_yield{[] {
  const char* v = std::getenv("MLX_DELEGATE_SPIN_YIELD");
  return v && std::strcmp(v, "1") == 0;
}()};
}  // namespace

void set_pool_spin_yield(bool on) { g_spin_yield.store(on, std::memory_order_relaxed); }
bool pool_spin_yield() { return g_spin_yield.load(std::memory_order_relaxed); }

namespace {

// Open holds (cpu_pool_hold_open) and whether large calls open one: off by default. At load 3-4 a
// held helper, yielding while it waits, got its core back later than one woken from sleep (the woken
// thread is favoured by the scheduler): it joined 21 % of a 1.2B int4 decode step's product parts
// against 47 %, and the step took 127 against 123 ms (benchmarks/decode_split.py, 2026-11-26 17:24).
std::atomic<int> g_pool_holds{0};
std::atomic<bool> g_hold_in_call{[] {
  const char* v = std::getenv("MLX_DELEGATE_POOL_HOLD");
  return v && std::strcmp(v, "1") == 0;
}()};

// The opt-in job counters (CpuPoolStats); relaxed: they are sums read between calls.
std::atomic<bool> g_pool_stats{false};
std::atomic<uint64_t> g_ps_jobs{0}, g_ps_caller_parts{0}, g_ps_helper_parts{0}, g_ps_caller_wait_ns{0},
    g_ps_helper_late_ns{0}, g_ps_helper_missed{0}, g_ps_helper_sleeps{0};

// Calls that lent their OpenMP team to the pool, and the parts its workers ran (cpu_pool_omp_team_stats).
std::atomic<uint64_t> g_omp_team_calls{0}, g_omp_team_parts{0}, g_omp_team_pauses{0};
std::atomic<uint64_t> g_caller_serve_parts{0};  // parts run by waiting callers (cpu_pool_serve_call)

int64_t pool_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Persistent helper threads, one per extra core (at most 7). A call cuts its
// work into parts that every thread claims from a shared counter, the calling
// thread included: on a loaded machine a helper that is not scheduled in time
// just finds nothing left, so a call never waits for a thread that has not
// started (the caller does the work itself). One call at a time: a concurrent
// call (another stream) runs its parts serially rather than queue.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: helpers may be parked at exit
    return *pool;
  }
  int size() const { return static_cast<int>(helpers_) + 1; }
  // False in a forked child, which has none of the helper threads.
  bool owned() const { return getpid() == owner_; }
  // A thread of another runtime (an OpenMP team's worker) helping with jobs until `stop`.
  // `serving` counts this lend's threads inside serve().
  void lend(const std::atomic<bool>& stop, std::atomic<int>& serving) {
    serving.fetch_add(1, std::memory_order_acq_rel);
    serve(stop, std::numeric_limits<int64_t>::max(), g_omp_team_parts);
    serving.fetch_sub(1, std::memory_order_acq_rel);
  }
  // The thread that waits for a call's result (stream_wait.cpp) helping until `stop` (stop_serving()) or
  // `deadline_ns`; while it serves, the pool's own helpers sleep rather than spin beside it.
  bool serve_call(const std::atomic<bool>& stop, int64_t deadline_ns) {
    callers_serving_.fetch_add(1, std::memory_order_acq_rel);
    serve(stop, deadline_ns, g_caller_serve_parts, /*sleep_beside=*/true);
    callers_serving_.fetch_sub(1, std::memory_order_acq_rel);
    return stop.load(std::memory_order_acquire);
  }
  void stop_serving(std::atomic<bool>& stop) {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop.store(true, std::memory_order_release);
    }
    served_wake_.notify_all();
  }
  // Ends the lent threads' service: sets `stop`, wakes those asleep in serve(), and waits, yielding,
  // until they have left it. The region's closing barrier waits without yielding: a worker woken onto
  // the caller's core waited behind it for a time slice (a decode step lent on every call: its tail
  // 0.11 -> 0.84-0.93 ms, llm.py's loop 150 -> 107 tok/s; with this wait, level with unlent calls).
  void end_lend(std::atomic<bool>& stop, const std::atomic<int>& serving) {
    {
      std::lock_guard<std::mutex> lock(m_);  // serve() checks stop under m_ before it sleeps: no lost wake-up
      stop.store(true, std::memory_order_release);
    }
    served_wake_.notify_all();
    while (serving.load(std::memory_order_acquire) > 0) sched_yield();
  }

  // Ends the helpers' spins now: the work that kept them awake is over and
  // nothing follows soon (a call whose next call is milliseconds away); a spin
  // would only take the core from whatever runs next.
  void park() { parks_.fetch_add(1, std::memory_order_release); }

  void run(int parts, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    // A forked child has none of the helper threads: it runs serially.
    if (!busy || parts <= 1 || parts > kMaxParts || helpers_ == 0 || getpid() != owner_) {
      for (int i = 0; i < parts; ++i) fn(i);
      return;
    }
    const uint64_t tag = ((state_.load(std::memory_order_relaxed) >> kTagShift) + 1) & kTagMask;
    // Close the last job's word before this job's parts_ / fn_ / completed_
    // are written: a helper still claiming from the last job (it just finished
    // a part there) read the new parts_ against the old word's counts, took a
    // part that did not exist in the old job, ran this job's fn on it and
    // counted it in this job's completed_, so completed_ overshot `parts` and
    // the caller waited forever (a demo-block loop hung after ~4000 jobs, a
    // 2-part product followed by an 8-part row kernel), or reached it early
    // and the caller returned while a part still ran. The closed word carries
    // the new tag with every part taken: old-tag claims fail on the tag,
    // new-tag ones on the count, until the job is published below.
    state_.store(tag << kTagShift | kCountMask << kCountBits, std::memory_order_seq_cst);
    fn_.store(&fn, std::memory_order_relaxed);
    completed_.store(0, std::memory_order_relaxed);
    parts_.store(parts, std::memory_order_release);  // after the close: see claim()
    caller_cpu_.store(sched_getcpu(), std::memory_order_relaxed);
    const bool stats = g_pool_stats.load(std::memory_order_relaxed);
    job_helper_parts_.store(0, std::memory_order_relaxed);
    published_ns_.store(stats ? pool_now_ns() : 0, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(m_);
      // Part 0 is the caller's before any helper can look: a sleeping helper
      // woken below is often put on this very core and runs before the caller
      // does again; it then took every part, and the product ran on one core
      // after a context switch.
      state_.store(tag << kTagShift | uint64_t{1} << kCountBits, std::memory_order_release);
      generation_.fetch_add(1, std::memory_order_release);
    }
    // Helpers still spinning after their last job see the new generation
    // without a wake-up; only sleeping ones need the futex call.
    // With an OpenMP team serving (a lent team's worker spins for jobs), the pool's own sleeping helpers
    // stay asleep: woken, they would only compete with it for the same cores.
    if (sleeping_.load(std::memory_order_acquire) > 0 && served_.load(std::memory_order_acquire) == 0)
      wake_.notify_all();
    if (served_sleeping_.load(std::memory_order_acquire) > 0) served_wake_.notify_all();
    int mine = 0;
    for (int i = 0; i >= 0; i = claim(tag, true)) {
      fn(i);
      ++mine;
      completed_.fetch_add(1, std::memory_order_acq_rel);
    }
    // Counts the job when the caller's wait below is over, however it ends.
    struct JobStats {
      bool on;
      int mine;
      int64_t start;
      std::atomic<int>& helper_parts;
      ~JobStats() {
        if (!on) return;
        g_ps_jobs.fetch_add(1, std::memory_order_relaxed);
        g_ps_caller_parts.fetch_add(mine, std::memory_order_relaxed);
        g_ps_caller_wait_ns.fetch_add(pool_now_ns() - start, std::memory_order_relaxed);
        if (helper_parts.load(std::memory_order_relaxed) == 0) g_ps_helper_missed.fetch_add(1, std::memory_order_relaxed);
      }
    } job_stats{stats, mine, stats ? pool_now_ns() : 0, job_helper_parts_};
    // Wait for the parts that helpers took, and only those: a helper that woke
    // and found nothing left holds up nothing (it used to register as a user of
    // the job, and one preempted there, on a loaded machine or beside eager
    // torch's spinning OpenMP worker, held the product for a time slice: a
    // 128 x 256 x 256 split product took 200 us against 100 us as one call).
    // A helper still on its last part finishes within the part's time: spin
    // for it rather than sleep (the futex round trip costs more than a part).
    auto all_done = [&] { return completed_.load(std::memory_order_acquire) == parts; };
    if (spin_until(all_done)) return;
    std::unique_lock<std::mutex> lock(m_);
    done_.wait(lock, all_done);
  }

 private:
  // The job's claims, one word: its tag (which job) and the parts taken from
  // the front (by the calling thread, from 0 up) and from the back (by helpers,
  // from the last part down). A claim is a compare-and-swap on the word, so a
  // helper that is late for a job, or looks at a job that has ended, takes
  // nothing from the next one, and the job's state can live in the pool (no
  // helper ever touches a caller's stack after the job). Part 0 is reserved
  // for the caller when the job is published: a kernel that cuts its work
  // unevenly (the BLAS shim's balanced split) knows who gets which.
  static constexpr int kTagShift = 40, kCountBits = 20;
  static constexpr uint64_t kTagMask = (uint64_t{1} << 24) - 1, kCountMask = (uint64_t{1} << kCountBits) - 1;
  static constexpr int kMaxParts = static_cast<int>(kCountMask);

  // The next part of job `tag` for the caller (front) or a helper (back); -1
  // when that job has none left or is over.
  int claim(uint64_t tag, bool caller) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      if ((s >> kTagShift) != tag) return -1;
      // parts_ is this job's: it is written before the tag is published, and
      // a later job closes the word before it writes parts_ (run()): a
      // parts_ of the later job read here (acquire) makes the swap below see
      // the closed word and fail.
      const uint64_t parts = static_cast<uint64_t>(parts_.load(std::memory_order_acquire));
      const uint64_t front = (s >> kCountBits) & kCountMask, back = s & kCountMask;
      if (front + back >= parts) return -1;
      const uint64_t next = s + (caller ? uint64_t{1} << kCountBits : uint64_t{1});
      if (state_.compare_exchange_weak(s, next, std::memory_order_acq_rel, std::memory_order_acquire))
        return static_cast<int>(caller ? front : parts - 1 - back);
    }
  }

  Pool() : owner_(getpid()) {
    unsigned hw = usable_cores();
    helpers_ = hw > 1 ? std::min(hw, 8u) - 1 : 0;
    for (unsigned i = 0; i < helpers_; ++i) std::thread([this] { loop(); }).detach();
  }

  // Back-to-back kernels (a decode step's projections) come microseconds
  // apart: a helper spins that long for the next job before it sleeps, so the
  // next call neither pays a futex wake-up nor waits for the scheduler.
  // MLX_DELEGATE_SPIN_US sets it (0: always sleep, for machines shared with
  // other busy processes).
  static std::chrono::microseconds spin_time() {
    static const auto us = [] {
      const char* v = std::getenv("MLX_DELEGATE_SPIN_US");
      return std::chrono::microseconds(v ? std::max(0L, std::strtol(v, nullptr, 10)) : 100);
    }();
    return us;
  }

  // How long a wait pauses on its core before it starts yielding it
  // (MLX_DELEGATE_SPIN_PAUSE_US, default 30). The gaps between the parts of one
  // call are shorter than this: a helper that yielded there handed its core to
  // whatever else was runnable (eager torch's spinning OpenMP workers in the
  // same process, say) and lost it for a whole time slice: the demo block took
  // 1.9 instead of 1.45 ms. Longer waits yield (below).
  static std::chrono::microseconds pause_time() {
    static const auto us = [] {
      const char* v = std::getenv("MLX_DELEGATE_SPIN_PAUSE_US");
      return std::chrono::microseconds(v ? std::max(0L, std::strtol(v, nullptr, 10)) : 30);
    }();
    return us;
  }

  // Polls `ready` for up to spin_time(); true as soon as it holds. `holdable` (the helpers' wait for a
  // job): past spin_time() it goes on, yielding, while a hold is open (cpu_pool_hold_open).
  template <class Ready>
  static bool spin_until(Ready ready, bool holdable = false) {
    const auto start = std::chrono::steady_clock::now();
    const auto until = start + spin_time(), pause_until = start + pause_time();
    bool yielding = false;
    for (int i = 0;; ++i) {
      if (ready()) return true;
      if ((i & 63) == 0) {
        const auto now = std::chrono::steady_clock::now();
        if (now > until) {
          if (!holdable || g_pool_holds.load(std::memory_order_acquire) == 0) return false;
          yielding = true;
        } else {
          yielding = pool_spin_yield() && now > pause_until;
        }
      }
      cpu_relax(yielding);
    }
  }

  // Yielding (when on, past pause_time()) lets the process's other threads
  // (the caller replaying the graph, MLX's stream thread) have the core while
  // the helper waits: on a shared 2-core machine a pausing spin held a core
  // through a whole decode step (16 % of its samples) and the step took ~1.5x
  // longer. On an idle core the yield returns at once, so the helper still
  // sees a job within about a microsecond.
  static void cpu_relax(bool yield) {
    if (yield) {
      sched_yield();
      return;
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  void loop() {
#if defined(__APPLE__)
    pthread_setname_np("mlxd-pool");  // what `top -H` and the tests see
#else
    pthread_setname_np(pthread_self(), "mlxd-pool");
#endif
    uint64_t seen = 0;
    bool on_callers_core = false;
    for (;;) {
      const uint64_t parks = parks_.load(std::memory_order_acquire);
      // A helper that ran its parts on the caller's own core (woken onto it:
      // the scheduler often places a woken thread beside its waker) sleeps at
      // once instead of spinning: the caller is waiting behind it for that
      // core, and a spin kept it off for the whole spin time (a split
      // 128 x 256 x 256 product after an idle gap took 200 us, the helper
      // running both parts and then spinning 100 us, against 85 us as one call).
      bool spun = !on_callers_core && spin_until([&] {
        return generation_.load(std::memory_order_acquire) != seen || parks_.load(std::memory_order_relaxed) != parks ||
               callers_serving_.load(std::memory_order_relaxed) > 0;
      }, /*holdable=*/true) && generation_.load(std::memory_order_acquire) != seen;
      if (!spun) {
        std::unique_lock<std::mutex> lock(m_);
        ++sleeping_;
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_relaxed) != seen; });
        --sleeping_;
      }
      seen = generation_.load(std::memory_order_acquire);
      on_callers_core = work(state_.load(std::memory_order_acquire) >> kTagShift, spun);
    }
  }

  // Runs the parts of job `tag` that this helper can claim; whether it ran one on the caller's core.
  bool work(uint64_t tag, bool spun, uint64_t* ran = nullptr) {
    bool on_callers_core = false, first = true;
    for (int i; (i = claim(tag, false)) >= 0;) {
      if (ran) ++*ran;
      on_callers_core = sched_getcpu() == caller_cpu_.load(std::memory_order_relaxed);
      if (const int64_t published = published_ns_.load(std::memory_order_relaxed); published != 0) {
        // Stats on for this job (published_ns_ is the job's while this helper holds one of its parts).
        g_ps_helper_parts.fetch_add(1, std::memory_order_relaxed);
        job_helper_parts_.fetch_add(1, std::memory_order_relaxed);
        if (first) {
          g_ps_helper_late_ns.fetch_add(pool_now_ns() - published, std::memory_order_relaxed);
          if (!spun) g_ps_helper_sleeps.fetch_add(1, std::memory_order_relaxed);
        }
      }
      first = false;
      // Safe to read: the job cannot end while this helper holds one of its parts.
      const int parts = parts_.load(std::memory_order_relaxed);
      (*fn_.load(std::memory_order_relaxed))(i);
      if (completed_.fetch_add(1, std::memory_order_acq_rel) + 1 == parts) {
        std::lock_guard<std::mutex> lock(m_);  // the caller checks all_done under m_: no lost wake-up
        done_.notify_one();
      }
    }
    return on_callers_core;
  }

  // An OpenMP team's worker lent to the pool for one call (cpu_pool_run_with_omp_team): claims parts as a
  // helper until `stop` (set by end_lend()). Between jobs it spins as the pool's helpers do
  // (MLX_DELEGATE_SPIN_US), then sleeps until the next job or the call's end: at load 4 a worker that
  // kept yielding its core instead got it back later than a woken one.
  void serve(const std::atomic<bool>& stop, int64_t deadline_ns, std::atomic<uint64_t>& parts_run,
             bool sleep_beside = false) {
    served_.fetch_add(1, std::memory_order_acq_rel);
    uint64_t ran = 0;
    for (uint64_t seen = generation_.load(std::memory_order_acquire);;) {
      const bool beside = work(state_.load(std::memory_order_acquire) >> kTagShift, true, &ran) ||
                          (sleep_beside && sched_getcpu() == caller_cpu_.load(std::memory_order_relaxed));
      auto next = [&] {
        return generation_.load(std::memory_order_acquire) != seen || stop.load(std::memory_order_acquire);
      };
      // On the publishing thread's core a spin would keep that thread off it (as loop() does for helpers).
      if ((beside && sleep_beside) || !spin_until(next)) {
        std::unique_lock<std::mutex> lock(m_);
        ++served_sleeping_;
        bool woke = true;
        if (deadline_ns == std::numeric_limits<int64_t>::max()) {
          served_wake_.wait(lock, next);
        } else {
          const auto until = std::chrono::steady_clock::time_point(std::chrono::nanoseconds(deadline_ns));
          woke = served_wake_.wait_until(lock, until, next);
        }
        --served_sleeping_;
        if (!woke) break;
      }
      if (stop.load(std::memory_order_acquire)) break;
      seen = generation_.load(std::memory_order_acquire);
    }
    parts_run.fetch_add(ran, std::memory_order_relaxed);
    served_.fetch_sub(1, std::memory_order_acq_rel);
  }

  pid_t owner_;
  unsigned helpers_ = 0;
  std::mutex busy_, m_;
  std::condition_variable wake_, done_, served_wake_;
  std::atomic<const std::function<void(int)>*> fn_{nullptr};  // the current job
  std::atomic<int> parts_{0};
  std::atomic<int> completed_{0};  // parts of the current job finished, by anyone
  std::atomic<uint64_t> state_{0};  // tag | front | back (claim())
  std::atomic<int> caller_cpu_{-1};  // where the current job's caller published it
  std::atomic<int64_t> published_ns_{0};  // when the current job was published; 0 with the stats off
  std::atomic<int> job_helper_parts_{0};  // parts of the current job run by helpers (stats on)
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0};  // helpers waiting on wake_ (changed under m_)
  std::atomic<uint64_t> parks_{0};  // bumped by park()
  std::atomic<int> served_{0};  // OpenMP workers serving the pool now (serve())
  std::atomic<int> served_sleeping_{0};  // ... of them asleep on served_wake_ (changed under m_)
  std::atomic<int> callers_serving_{0};  // of those, waiting callers (serve_call())
};

// The BLAS shim's parallel-for (blas_shim.cpp: large sgemms cut into blocks
// on this pool rather than on MKL's OpenMP team of the calling thread).
void pool_parallel(int parts, void (*part)(void*, int), void* ctx) {
  Pool::get().run(parts, [&](int i) { part(ctx, i); });
}
using BlasSetParallel = void (*)(void (*)(int, void (*)(void*, int), void*), int);

BlasSetParallel blas_set_parallel() {
  static auto fn = reinterpret_cast<BlasSetParallel>(dlsym(RTLD_DEFAULT, "mlxd_blas_set_parallel"));
  return fn;
}

int pool_threads() {
  unsigned hw = usable_cores();
  return hw > 1 ? static_cast<int>(std::min(hw, 8u)) : 1;
}

// On unless MLX_DELEGATE_BLAS_SPLIT=0; applied when the extension loads (the
// shim, when used, is loaded before it).
[[maybe_unused]] const bool g_blas_split_init = [] {
  const char* v = std::getenv("MLX_DELEGATE_BLAS_SPLIT");
  set_blas_split(!(v && std::strcmp(v, "0") == 0));
  return true;
}();

std::atomic<bool> g_enabled{true};
std::mutex g_counts_mutex;
// Keyed by the name's address (callers pass literals or static tables' names): no std::string is built
// and no map of strings walked per note (63 notes a MobileNetV3 call); equal names merge when read.
std::unordered_map<const char*, uint64_t>& counts() {
  static auto* c = new std::unordered_map<const char*, uint64_t>();
  return *c;
}

bool cpu_has_avx2_fma() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

template <typename T>
void load_as(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void store_as(const float* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

}  // namespace

CpuKernelMode cpu_kernel_mode() {
  static const CpuKernelMode mode = [] {
    const char* v = std::getenv("MLX_DELEGATE_CPU_KERNELS");
    if (v && std::strcmp(v, "0") == 0) return CpuKernelMode::off;
    return v && std::strcmp(v, "portable") == 0 ? CpuKernelMode::portable : CpuKernelMode::best;
  }();
  return mode;
}

bool set_blas_split(bool on) {
  auto set = blas_set_parallel();
  if (set == nullptr) return false;
  set(on ? &pool_parallel : nullptr, on ? pool_threads() : 1);
  return on;
}

bool cpu_kernels_active() { return cpu_kernels_enabled() && mx::default_device() == mx::Device::cpu; }

void set_cpu_kernels_enabled(bool on) { g_enabled.store(on, std::memory_order_relaxed); }

bool cpu_kernels_enabled() {
  return cpu_kernel_mode() != CpuKernelMode::off && g_enabled.load(std::memory_order_relaxed);
}

bool cpu_use_avx2() {
  static const bool avx2 = cpu_kernel_mode() == CpuKernelMode::best && cpu_has_avx2_fma();
  return avx2;
}

bool cpu_use_avx512() {
  static const bool avx512 = [] {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    const char* v = std::getenv("MLX_DELEGATE_CPU_KERNELS");
    return cpu_use_avx2() && !(v && std::strcmp(v, "avx2") == 0) && __builtin_cpu_supports("avx512f");
#else
    return false;
#endif
  }();
  return avx512;
}

int cpu_weight_streams() {
  static const int streams = [] {
    const char* e = std::getenv("MLX_DELEGATE_GEMV_STREAMS");
    int n = 1;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    n = __builtin_cpu_is("intel") ? 4 : 1;
#endif
    if (e) n = std::atoi(e);
    return n >= 4 ? 4 : n >= 2 ? 2 : 1;
  }();
  return streams;
}

bool cpu_kernel_dtype_ok(const mx::array& x) {
  auto t = x.dtype();
  return x.size() > 0 && (t == mx::float32 || t == mx::bfloat16 || t == mx::float16);
}

void cpu_parallel_for(int64_t n, int64_t cost_per_item, int64_t align,
                      const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  auto& pool = Pool::get();
  // Four parts per thread: whoever is running claims the next, which evens out
  // a thread that starts late or is preempted on a shared machine.
  int64_t parts = n * cost_per_item >= kCpuMinParallel ? std::min<int64_t>(4 * pool.size(), n) : 1;
  auto bound = [&](int64_t i) {
    if (i >= parts) return n;
    int64_t b = n * i / parts;
    return std::min(n, b - b % align);
  };
  pool.run(static_cast<int>(parts), [&](int i) {
    int64_t b = bound(i), e = bound(i + 1);
    if (b < e) fn(b, e);
  });
}

void cpu_pool_park() { Pool::get().park(); }
int cpu_pool_serve_call(const std::atomic<bool>& stop, int64_t deadline_ns) {
  auto& pool = Pool::get();
  if (pool.size() <= 1 || !pool.owned()) return 0;
  return pool.serve_call(stop, deadline_ns) ? 1 : -1;
}
void cpu_pool_stop_serving(std::atomic<bool>& stop) { Pool::get().stop_serving(stop); }
uint64_t cpu_pool_caller_serve_parts() { return g_caller_serve_parts.load(std::memory_order_relaxed); }

namespace {
// Where the process has an OpenMP runtime loaded (torch's libgomp, with RTLD_GLOBAL): its entry points.
struct OmpRuntime {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;  // GOMP_parallel
  int (*thread_num)() = nullptr;
  int (*max_threads)() = nullptr;
  int (*in_parallel)() = nullptr;
  int (*pause_all)(int) = nullptr;  // omp_pause_resource_all (OpenMP 5.0); optional
};
const OmpRuntime* omp_runtime() {
  static const OmpRuntime rt = [] {
    OmpRuntime r;
    r.parallel = reinterpret_cast<decltype(r.parallel)>(dlsym(RTLD_DEFAULT, "GOMP_parallel"));
    r.thread_num = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "omp_get_thread_num"));
    r.max_threads = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
    r.in_parallel = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "omp_in_parallel"));
    r.pause_all = reinterpret_cast<int (*)(int)>(dlsym(RTLD_DEFAULT, "omp_pause_resource_all"));
    return r;
  }();
  return rt.parallel && rt.thread_num && rt.max_threads && rt.in_parallel ? &rt : nullptr;
}

std::atomic<int> g_omp_team{[] {
  const char* v = std::getenv("MLX_DELEGATE_OMP_TEAM");
  if (v && (std::strcmp(v, "off") == 0 || std::strcmp(v, "0") == 0)) return int(OmpTeam::Off);
  if (v && std::strcmp(v, "always") == 0) return int(OmpTeam::Always);
  return int(OmpTeam::Auto);
}()};
std::atomic<bool> g_omp_pause{[] {
  const char* v = std::getenv("MLX_DELEGATE_OMP_PAUSE");
  return !(v && std::strcmp(v, "0") == 0);
}()};
}  // namespace

void set_pool_omp_pause(bool on) { g_omp_pause.store(on, std::memory_order_relaxed); }
bool pool_omp_pause() { return g_omp_pause.load(std::memory_order_relaxed); }

bool cpu_pool_pause_omp_team() {
  if (!pool_omp_pause()) return false;
  const OmpRuntime* omp = omp_runtime();
  if (omp == nullptr || omp->pause_all == nullptr || omp->in_parallel()) return false;
  auto& pool = Pool::get();
  if (pool.size() <= 1 || !pool.owned()) return false;
  constexpr int kOmpPauseSoft = 1;  // omp_pause_soft: the runtime may end its idle threads; state is kept
  if (omp->pause_all(kOmpPauseSoft) != 0) return false;
  g_omp_team_pauses.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void set_pool_omp_team(OmpTeam mode) { g_omp_team.store(int(mode), std::memory_order_relaxed); }
OmpTeam pool_omp_team() { return OmpTeam(g_omp_team.load(std::memory_order_relaxed)); }
OmpTeamStats cpu_pool_omp_team_stats() {
  return {g_omp_team_calls.load(), g_omp_team_parts.load(), g_omp_team_pauses.load()};
}

bool cpu_pool_run_with_omp_team(const std::function<void()>& body) {
  const OmpRuntime* omp = pool_omp_team() != OmpTeam::Off ? omp_runtime() : nullptr;
  if (omp == nullptr) return false;
  auto& pool = Pool::get();
  if (pool.size() <= 1 || !pool.owned() || omp->in_parallel()) return false;
  const int threads = std::min(pool.size(), omp->max_threads());
  if (threads <= 1) return false;
  struct Team {
    const std::function<void()>* body;
    const OmpRuntime* omp;
    Pool* pool;
    std::atomic<bool> stop{false};
    std::atomic<int> serving{0};
    std::exception_ptr error;
  } team{&body, omp, &pool};
  // Thread 0 is the caller (an exception must not leave the parallel region: it is rethrown after it).
  omp->parallel(
      [](void* p) {
        auto* t = static_cast<Team*>(p);
        if (t->omp->thread_num() != 0) {
          t->pool->lend(t->stop, t->serving);
          return;
        }
        try {
          (*t->body)();
        } catch (...) {
          t->error = std::current_exception();
        }
        t->pool->end_lend(t->stop, t->serving);
      },
      &team, static_cast<unsigned>(threads), 0);
  g_omp_team_calls.fetch_add(1, std::memory_order_relaxed);
  if (team.error) std::rethrow_exception(team.error);
  return true;
}

void cpu_pool_hold_open() { g_pool_holds.fetch_add(1, std::memory_order_acq_rel); }
void cpu_pool_hold_close() { g_pool_holds.fetch_sub(1, std::memory_order_acq_rel); }
void set_pool_hold_in_call(bool on) { g_hold_in_call.store(on, std::memory_order_relaxed); }
bool pool_hold_in_call() { return g_hold_in_call.load(std::memory_order_relaxed); }

void cpu_pool_set_stats(bool on) { g_pool_stats.store(on, std::memory_order_relaxed); }
bool cpu_pool_stats_enabled() { return g_pool_stats.load(std::memory_order_relaxed); }

CpuPoolStats cpu_pool_stats() {
  return {g_ps_jobs.load(), g_ps_caller_parts.load(), g_ps_helper_parts.load(), g_ps_caller_wait_ns.load(),
          g_ps_helper_late_ns.load(), g_ps_helper_missed.load(), g_ps_helper_sleeps.load()};
}

void cpu_pool_reset_stats() {
  for (auto* c : {&g_ps_jobs, &g_ps_caller_parts, &g_ps_helper_parts, &g_ps_caller_wait_ns, &g_ps_helper_late_ns,
                  &g_ps_helper_missed, &g_ps_helper_sleeps})
    c->store(0);
}

void cpu_parallel_parts(int parts, const std::function<void(int)>& fn) { Pool::get().run(parts, fn); }

int cpu_pool_threads() { return Pool::get().size(); }

void cpu_kernel_note_call(const char* name) {
  std::lock_guard<std::mutex> lock(g_counts_mutex);
  ++counts()[name];
}

std::map<std::string, uint64_t> cpu_kernel_call_counts() {
  std::lock_guard<std::mutex> lock(g_counts_mutex);
  std::map<std::string, uint64_t> out;
  for (const auto& [name, n] : counts()) out[name] += n;
  return out;
}

void cpu_load_f32(const void* src, mx::Dtype dtype, int64_t offset, int64_t n, float* dst) {
  if (dtype == mx::float32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
  } else if (dtype == mx::bfloat16) {
    load_as(static_cast<const mx::bfloat16_t*>(src) + offset, n, dst);
  } else {
    load_as(static_cast<const mx::float16_t*>(src) + offset, n, dst);
  }
}

void cpu_store_f32(const float* src, mx::Dtype dtype, int64_t offset, int64_t n, void* dst) {
  if (dtype == mx::float32) {
    std::memcpy(static_cast<float*>(dst) + offset, src, n * sizeof(float));
  } else if (dtype == mx::bfloat16) {
    store_as(src, n, static_cast<mx::bfloat16_t*>(dst) + offset);
  } else {
    store_as(src, n, static_cast<mx::float16_t*>(dst) + offset);
  }
}

void cpu_copy_strided(const void* src, size_t itemsize, const mx::Shape& shape, const mx::Strides& strides,
                      void* dst) {
  const int nd = static_cast<int>(shape.size());
  int64_t total = 1;
  for (int d = 0; d < nd; ++d) total *= shape[d];
  if (total == 0) return;
  const auto* s = static_cast<const char*>(src);
  auto* o = static_cast<char*>(dst);
  // Innermost axis as one run (a memcpy when its stride is 1); an odometer over the others.
  const int64_t inner = nd ? shape[nd - 1] : 1, inner_stride = nd ? strides[nd - 1] : 1;
  std::vector<int64_t> index(std::max(nd - 1, 0), 0);
  for (int64_t done = 0; done < total; done += inner) {
    int64_t offset = 0;
    for (int d = 0; d + 1 < nd; ++d) offset += index[d] * strides[d];
    const char* row = s + offset * static_cast<int64_t>(itemsize);
    if (inner_stride == 1) {
      std::memcpy(o, row, inner * itemsize);
    } else {
      for (int64_t i = 0; i < inner; ++i) std::memcpy(o + i * itemsize, row + i * inner_stride * itemsize, itemsize);
    }
    o += inner * itemsize;
    for (int d = nd - 2; d >= 0 && ++index[d] == shape[d]; --d) index[d] = 0;
  }
}

CpuRowMajor::CpuRowMajor(const void* data, size_t itemsize, const mx::Shape& shape, const mx::Strides& strides,
                         bool contiguous)
    : data_(data) {
  if (contiguous) return;
  int64_t total = 1;
  for (auto s : shape) total *= s;
  copy_.resize(static_cast<size_t>(total) * itemsize);
  cpu_copy_strided(data, itemsize, shape, strides, copy_.data());
  data_ = copy_.data();
}

F32RowMajor::F32RowMajor(const mx::array& a)
    : raw_(a.data<void>(), a.itemsize(), a.shape(), a.strides(), a.flags().row_contiguous), dtype_(a.dtype()) {
  if (dtype_ == mx::float32) return;
  converted_.resize(a.size());
  cpu_load_f32(raw_.data(), dtype_, 0, static_cast<int64_t>(a.size()), converted_.data());
}

}  // namespace mlxd::rt
