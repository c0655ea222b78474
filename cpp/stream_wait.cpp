// Adaptive waiting on MLX's CPU stream thread; see stream_wait.h.
#include "stream_wait.h"

#include "kernels/cpu_parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include <mlx/primitives.h>
#include <mlx/scheduler.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mlxd::rt {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
// Evaluations at least this long (smoothed) lend the caller's OpenMP team to the kernel pool: shorter
// ones (a 100 Hz tiny graph) seldom split their work, and the team's worker would spin after each call.
constexpr double kOmpTeamMinCallUs = 200;
// ... and only while the calling thread works between calls (at least this share of the gap on the
// CPU: eager torch, a decode loop's sampling): after a lent call the team's worker spins (libgomp's
// GOMP_SPINCOUNT, ~10-15 ms) until the next parallel region, which only burns a core where the caller
// sleeps between calls (a 100 Hz timer: 2.4x the CPU per call of the demo block, 2026-11-26).
constexpr double kOmpTeamMinGapBusy = 0.5;
// ... and only where that work is at least this share of a call: eager torch between calls (the demo:
// ~1.6 ms of it around a 1.4 ms call) keeps the worker busy, and lent it is warm for both; a decode loop's
// few hundred microseconds of sampling and the stock runtime's clone of the logits leave it spinning
// idle, and pausing it is faster than lending it (a SmolLM2 Q4_1 step, separate runs: 5.9-6.7 against
// 6.2-7.9 ms, 2026-12-06).
constexpr double kOmpTeamMinGapWork = 0.25;
// ... and only within this of the start of a call whose own gap held such work: the worker that work woke
// spins for a few ms (see kOmpPauseMaxGapUs). The smoothed gap alone carried one long busy gap over a
// dozen calls: a decode loop after its prefill (which followed other work: llama.cpp's turn in llm.py)
// lent steps with nothing between them, each paying for a cold worker (SmolLM2 Q4_1 on an Ice Lake Xeon,
// paired in one process: 8.50 -> 7.59 ms and 9.30 -> 8.66 ms a step). The demo block alternating with
// eager torch lends as before (175 of 198 calls, level).
constexpr double kOmpTeamWarmUs = 4000;
// A call not lending the team pauses it (cpu_pool_pause_omp_team) when its evaluations lately took at
// least this long, so the ~50 us pause and the team's later restart are a small share of what a free
// core saves (a SmolLM2 decode step through the stock runtime, whose clone of the logits wakes the team:
// a 6.3 against 8.7 ms median step, 2026-12-06) ...
constexpr double kOmpPauseMinCallUs = 1000;
// ... and when the call follows the last one's end within this: the worker spins 4-7 ms after the
// caller's last parallel op, so only then is it surely spinning; asleep, pausing it would cost ~0.2 ms.
constexpr double kOmpPauseMaxGapUs = 4000;

// A waiting caller serves the kernel pool (eval_impl) where this graph's evaluations lately took at least
// this long: a tiny graph called at 100 Hz keeps its sleep (serving spins between jobs).
constexpr double kServeMinEvalUs = 30;
// Set while this thread's call lends its OpenMP team (eval_adaptive): the lent worker is the helper then.
thread_local bool tl_lending = false;

// The calling thread's CPU time (0 where the clock is missing: the caller then counts as idle).
int64_t thread_cpu_ns() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// One step of a spin. It yields the core rather than pausing: the thread
// being waited for is often runnable on this very core (the scheduler places a
// woken thread next to its waker), and a pure spin would keep it off the core
// until the time slice ends; on a quiet machine the yield returns at once.
void spin_step() { sched_yield(); }

int64_t env_linger_us() {
  const char* v = std::getenv("MLX_DELEGATE_LINGER_US");
  return v ? std::max(0L, std::strtol(v, nullptr, 10)) : 200;
}

bool env_park() {
  const char* v = std::getenv("MLX_DELEGATE_STREAM_PARK");
  return v == nullptr || std::string(v) != "0";
}

int env_gate() {
  const char* v = std::getenv("MLX_DELEGATE_STREAM_GATE");
  return v ? std::clamp(static_cast<int>(std::strtol(v, nullptr, 10)), 0, 2) : 1;
}

bool env_caller_serve() {
  const char* v = std::getenv("MLX_DELEGATE_CALLER_SERVE");
  return v == nullptr || std::string(v) != "0";
}

std::atomic<int64_t> g_linger_us{env_linger_us()};
std::atomic<bool> g_caller_serve{env_caller_serve()};
std::atomic<int> g_gate{env_gate()};
std::atomic<bool> g_park{env_park()};
std::atomic<uint64_t> g_calls{0}, g_held{0}, g_lingers{0}, g_spins{0}, g_spin_hits{0}, g_timeouts{0}, g_cut{0},
    g_parks{0}, g_gates{0}, g_stream_parks{0}, g_unparked{0}, g_park_timeouts{0}, g_serves{0},
    g_serve_timeouts{0};

// A caller holding the stream thread awake releases it within this time; past
// it the linger lets the queued tasks run anyway. MLX's eval can itself wait
// for the stream (its active-task throttle), which must never hang on a hold.
constexpr int64_t kMaxHoldNs = 500'000;

struct Park;  // below

// One per CPU stream: whether its thread is lingering, and the recent gaps
// between one call's result and the next call's evaluation.
struct Linger {
  // 0: no linger running; 1: a linger task spins for the next call;
  // 2 + token: a caller holds the thread awake while it enqueues.
  std::atomic<int64_t> state{0};
  std::atomic<int64_t> next_token{0};
  std::atomic<uint64_t> evaluations{0};  // evaluations begun on this stream (a linger's cue that it came late)
  std::atomic<int64_t> last_done_ns{0};  // when the previous result was seen; 0: never
  std::atomic<int64_t> last_gap_ns{kNever};  // the previous call's gap
  std::atomic<int64_t> linger_ns{0};  // chosen by the last call: follow-up evaluations in it reuse it
  Park* park = nullptr;  // set (once, before first use) for a delegate stream; never freed
  std::atomic<bool> long_gaps{false};  // the last two gaps were at least kParkMinGapNs (set by the last call)

  // Runs on the stream thread, after a call's tasks: stays awake until a
  // caller releases it (its tasks are queued behind), the linger time passes
  // with no caller, or a hold outlasts kMaxHoldNs. `seq`: `evaluations` when it
  // was enqueued. An evaluation begun since then that found no linger to hold
  // (this thread was descheduled between the previous result and the linger:
  // on 2 cores the woken caller and the pool's helper take both) has its tasks
  // queued behind this one: the linger ends at once instead of spinning its time
  // out in front of them (2/3 of a MobileNetV3 block's back-to-back calls
  // waited 100-200 us so, 2026-12-06).
  void linger(int64_t duration_ns, uint64_t seq) {
    const int64_t start = now_ns();
    if (evaluations.load(std::memory_order_acquire) != seq) {
      g_cut.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    state.store(1, std::memory_order_release);
    int64_t held_since = 0;
    for (int i = 0;; ++i) {
      int64_t s = state.load(std::memory_order_acquire);
      if (s == 0) return;  // released: the holder's tasks are queued
      if ((i & 3) == 0) {
        int64_t t = now_ns();
        const bool late = evaluations.load(std::memory_order_acquire) != seq;
        if (s == 1 && (late || t - start > duration_ns)) {
          if (state.compare_exchange_strong(s, 0)) {
            (late ? g_cut : g_timeouts).fetch_add(1, std::memory_order_relaxed);
            return;
          }
          continue;
        }
        if (s >= 2) {
          if (held_since == 0) held_since = t;
          if (t - held_since > kMaxHoldNs && state.compare_exchange_strong(s, 0)) return;
        }
      }
      spin_step();
    }
  }

  // Holds a lingering thread awake; the token to release it, or -1.
  int64_t try_hold() {
    int64_t expected = 1, token = 2 + next_token.fetch_add(1, std::memory_order_relaxed);
    return state.compare_exchange_strong(expected, token) ? token : -1;
  }
  void release(int64_t token) {
    if (token >= 0) state.compare_exchange_strong(token, 0);
  }
  void end() {
    int64_t expected = 1;
    state.compare_exchange_strong(expected, 0);
  }
};

// A small graph sent to a sleeping stream thread: MLX's encoder enqueues each
// task separately, and each enqueue finding the thread asleep wakes it (a futex
// wake and two context switches; four per call for a two-op compiled graph).
// The gate, enqueued first, is the only task that wakes it: the thread waits
// in it, spinning, until the caller has enqueued the rest, so it runs them all
// in one wake-up. Time-bounded like a hold. Mode 2 (opt-in) also has the caller
// spin (yielding) for the result, bounded by the graph's recent evaluation
// time, instead of sleeping until the last task wakes it: at a call every 10 ms
// (load 3-6) its best blocks of calls cost 10-43 % less CPU per call than with
// no gate, the medians -1 to 7 %, but on a quiet machine the spin would also
// cover the sleeping thread's wake-up latency, so it stays off until measured.
struct Gate {
  std::atomic<bool> open{false};
  void pass() const {
    const int64_t until = now_ns() + kMaxHoldNs;
    for (int i = 0; !open.load(std::memory_order_acquire); ++i) {
      if ((i & 3) == 0 && now_ns() > until) return;
      spin_step();
    }
  }
};

// A thread sleeping on a 32-bit word until another changes it and wakes it: the futex itself (Linux),
// not a condition variable, whose waiter re-takes its mutex marked contended, so every hand-off through
// one cost a second, empty futex wake (seen in strace). `sleepers` lets a waker skip the system call
// when nobody sleeps.
struct Sleeper {
  std::atomic<uint32_t> word{0};
  std::atomic<int> sleepers{0};

  // Sleeps while `done()` is false, at most until `deadline_ns`; whether done() became true.
  template <class Done>
  bool sleep_until(Done done, int64_t deadline_ns) {
    while (!done()) {
      const uint32_t w = word.load(std::memory_order_acquire);
      const int64_t left = deadline_ns - now_ns();
      if (left <= 0) return done();
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (!done()) {
#if defined(__linux__)
        timespec ts{static_cast<time_t>(left / 1'000'000'000), static_cast<long>(left % 1'000'000'000)};
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, w, &ts, nullptr, 0);
#endif
      }
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
    return true;
  }

  // After making done() true.
  void wake() {
    word.fetch_add(1, std::memory_order_seq_cst);
#if defined(__linux__)
    if (sleepers.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
#endif
  }
};

// The stream park (stream_wait.h), one per delegate stream. Park tasks are numbered in the order they are
// enqueued; a release lets every park up to a number return. Enqueueing and releasing happen under
// `enqueue`, so a caller that sees a park pending knows its tasks queue behind it.
constexpr int64_t kParkTimeoutNs = 100'000'000;
constexpr int64_t kParkMinGapNs = 1'000'000;
std::atomic<bool> g_exiting{false};

struct Park {
  std::mutex enqueue;
  uint64_t queued = 0;                // the last park enqueued (under `enqueue`)
  std::atomic<uint64_t> released{0};  // parks up to this one may return
  Sleeper sleeper;

  bool pending() const { return released.load(std::memory_order_acquire) < queued; }

  void raise(uint64_t upto) {
    uint64_t r = released.load(std::memory_order_relaxed);
    while (r < upto && !released.compare_exchange_weak(r, upto, std::memory_order_seq_cst)) {
    }
  }

  // On the stream thread: asleep until released, the time bound passes or the process exits.
  void wait(uint64_t seq) {
    auto ready = [&] { return released.load(std::memory_order_seq_cst) >= seq || g_exiting.load(); };
    if (sleeper.sleep_until(ready, now_ns() + kParkTimeoutNs)) return;
    g_park_timeouts.fetch_add(1, std::memory_order_relaxed);
    raise(seq);
  }

  void release(uint64_t upto) {
    raise(upto);
    sleeper.wake();
  }
};

// Whether a futex is there to park on.
constexpr bool kCanPark =
#if defined(__linux__)
    true;
#else
    false;
#endif

std::mutex g_parks_mutex;
std::vector<Park*>& all_parks() {
  static auto* parks = new std::vector<Park*>();
  return *parks;
}

// At exit MLX joins its stream threads: a parked one must not wait out its time bound first.
void release_all_parks() {
  g_exiting.store(true);
  std::lock_guard<std::mutex> lock(g_parks_mutex);
  for (Park* p : all_parks()) p->sleeper.wake();
}

// A forked child has none of the parent's threads (a linger state copied
// from the parent would be waited on forever): it evaluates plainly.
std::atomic<bool> g_forked{false};
[[maybe_unused]] const bool g_atfork = [] { return pthread_atfork(nullptr, nullptr, [] { g_forked.store(true); }) == 0; }();
bool in_fork_child() { return g_forked.load(std::memory_order_relaxed); }
std::mutex g_lingers_mutex;

// The stream's state (created on first use, never freed: a stream lives as
// long as the process in practice, and a running linger task holds a pointer).
Linger* linger_for(const mx::Stream& s) {
  static auto* map = new std::unordered_map<int, std::unique_ptr<Linger>>();
  std::lock_guard<std::mutex> lock(g_lingers_mutex);
  auto& p = (*map)[s.index];
  if (!p) p = std::make_unique<Linger>();
  return p.get();
}

// The calling thread's delegate stream (created on first use: a new MLX stream, with its own thread,
// that only delegate calls evaluate on).
mx::Stream make_delegate_stream() {
  mx::Stream s = mx::new_stream(mx::Device::cpu);
  auto* park = new Park();
  {
    std::lock_guard<std::mutex> lock(g_parks_mutex);
    // Registered after MLX's scheduler exists (new_stream built it), so it runs before its destructor.
    if (all_parks().empty()) std::atexit(release_all_parks);
    all_parks().push_back(park);
  }
  linger_for(s)->park = park;
  return s;
}

// The CPU stream the graph of `arrays` runs on (none: already evaluated, or
// another device).
std::optional<mx::Stream> cpu_stream(const std::vector<mx::array>& arrays) {
  // Inside mx::compile's trace an evaluation must fail as mx::eval fails (MLX rejects the trace).
  for (const auto& a : arrays)
    if (a.is_tracer()) return std::nullopt;
  for (const auto& a : arrays)
    if (a.status() == mx::array::Status::unscheduled && a.has_primitive()) {
      auto s = a.primitive().stream();
      if (s.device == mx::Device::cpu) return s;
      return std::nullopt;
    }
  return std::nullopt;
}

template <class Ready>
bool spin_until(Ready ready, int64_t limit_ns) {
  const int64_t until = now_ns() + limit_ns;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    if ((i & 3) == 0 && now_ns() > until) return false;
    spin_step();
  }
}

}  // namespace

int64_t linger_us() { return g_linger_us.load(std::memory_order_relaxed); }
void set_linger_us(int64_t us) { g_linger_us.store(std::max<int64_t>(us, 0)); }
bool caller_serve() { return g_caller_serve.load(std::memory_order_relaxed); }
void set_caller_serve(bool on) { g_caller_serve.store(on, std::memory_order_relaxed); }
int stream_gate() { return g_gate.load(std::memory_order_relaxed); }
bool stream_park() { return g_park.load(std::memory_order_relaxed); }
void set_stream_park(bool on) { g_park.store(on); }

std::optional<mx::Stream> delegate_stream() {
  if (!kCanPark || !stream_park() || in_fork_child() || g_exiting.load(std::memory_order_relaxed) ||
      mx::default_device() != mx::Device::cpu)
    return std::nullopt;
  thread_local std::optional<mx::Stream> stream;
  if (!stream) stream = make_delegate_stream();
  return stream;
}

DelegateStreamScope::DelegateStreamScope() {
  if (auto s = delegate_stream()) {
    previous_ = mx::default_stream(mx::Device::cpu);
    mx::set_default_stream(*s);
  }
}

DelegateStreamScope::~DelegateStreamScope() {
  if (previous_) mx::set_default_stream(*previous_);
}
void set_stream_gate(int mode) { g_gate.store(std::clamp(mode, 0, 2)); }

StreamWaitStats stream_wait_stats() {
  return {g_calls.load(),     g_held.load(),  g_lingers.load(),       g_spins.load(),
          g_spin_hits.load(), g_timeouts.load(), g_cut.load(),  g_parks.load(),     g_gates.load(),
          g_stream_parks.load(), g_unparked.load(), g_park_timeouts.load(), g_serves.load(),
          g_serve_timeouts.load(), cpu_pool_caller_serve_parts()};
}

void reset_stream_wait_stats() {
  for (auto* c : {&g_calls, &g_held, &g_lingers, &g_spins, &g_spin_hits, &g_timeouts, &g_cut, &g_parks, &g_gates,
                  &g_stream_parks, &g_unparked, &g_park_timeouts, &g_serves,
                  &g_serve_timeouts})
    c->store(0);
}

void end_linger() {
  if (in_fork_child()) return;
  auto s = mx::default_stream(mx::Device::cpu);
  Linger* L = linger_for(s);
  L->end();
  if (Park* P = L->park) {
    std::lock_guard<std::mutex> lock(P->enqueue);
    P->release(P->queued);
  }
}

namespace {

// pace: nullptr for a follow-up evaluation inside a call (an output copy, an
// item() read), which keeps the call's linger choice and gap history.
void eval_impl(std::vector<mx::array>& arrays, EvalPace* pace, bool small) {
  const int64_t cap_ns = linger_us() * 1000;
  auto stream = !in_fork_child() ? cpu_stream(arrays) : std::nullopt;
  if (stream && cap_ns == 0) {
    // The adaptive wait is off: a plain evaluation, which must not queue behind a park.
    if (Park* P = linger_for(*stream)->park) {
      std::lock_guard<std::mutex> lock(P->enqueue);
      P->release(P->queued);
    }
    stream.reset();
  }
  if (!stream) {
    mx::eval(arrays);
    return;
  }
  Linger* L = linger_for(*stream);
  const int64_t start = now_ns();
  int64_t linger_ns = L->linger_ns.load(std::memory_order_relaxed);
  if (pace) {
    g_calls.fetch_add(1, std::memory_order_relaxed);
    const int64_t last = L->last_done_ns.load(std::memory_order_relaxed);
    const int64_t gap = last ? start - last : kNever;
    const int64_t prev = L->last_gap_ns.exchange(gap, std::memory_order_relaxed);
    // The next call is expected about as soon after this one as the shorter of
    // the last two gaps; two long gaps in a row (a call every few ms) end it.
    const int64_t recent = std::min(gap, prev);
    linger_ns = recent < cap_ns ? std::min(cap_ns, 3 * recent + 20'000) : 0;
    L->linger_ns.store(linger_ns, std::memory_order_relaxed);
    L->long_gaps.store(recent >= kParkMinGapNs, std::memory_order_relaxed);
  }

  // A delegate stream's thread sleeping in a park: this call's tasks queue behind it without waking it,
  // and one release after the last wakes it once. A large graph releases it first instead, so the thread
  // starts on the first task (and MLX's throttle on active tasks never waits behind a park).
  Park* P = L->park;
  std::unique_lock<std::mutex> enqueue_lock;
  if (P) enqueue_lock = std::unique_lock<std::mutex>(P->enqueue);
  const bool parked = P && P->pending();
  if (parked && !small) P->release(P->queued);
  // The next call, milliseconds away, will find this thread parked. Gaps under a millisecond keep the
  // gate instead: it wakes the thread as the caller starts enqueueing, so the wake-up's latency overlaps
  // the enqueue, where a park's release comes after it (at load 8 the calls of overhead.py's interleaved
  // back-to-back rows, ~0.5 ms apart, took 94 us parked against 31 us gated).
  const bool park_next = P && small && linger_ns == 0 && L->long_gaps.load(std::memory_order_relaxed) &&
                         stream_park() && !g_exiting.load(std::memory_order_relaxed);

  // Small graphs enqueue in microseconds: keep a lingering thread awake
  // through it instead of letting it sleep and waking it for the first task.
  // A large graph lets it go now, so it starts on the first task enqueued.
  const int64_t token = small && !parked ? L->try_hold() : -1;
  if (!small) L->end();
  // After the hold: a linger that had not started yet sees this evaluation when it does, and ends.
  const uint64_t seq = L->evaluations.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (token >= 0 && pace) g_held.fetch_add(1, std::memory_order_relaxed);
  const int gate_mode = stream_gate();
  std::shared_ptr<Gate> gate;
  // Only for calls with long gaps (no linger chosen): back to back, a linger
  // that just ended is followed within microseconds by the next, and gating
  // there made the back-to-back median worse in overhead.py (a gated caller
  // spinning while the woken thread waited for a core on a loaded machine).
  if (small && !parked && token < 0 && gate_mode > 0 && linger_ns == 0) gate = std::make_shared<Gate>();
  // While calls come back to back, or behind a gate, the caller spins
  // (yielding) for its result when recent evaluations of this graph were
  // short: asleep, it would need a wake-up (and back to back, by the time it
  // ran again the linger for its next call could be over). Otherwise it sleeps.
  const bool spin = (linger_ns > 0 || (gate && gate_mode == 2)) && pace && pace->eval_us >= 0 &&
                    pace->eval_us * 1000 < cap_ns;
  // Behind a park, the caller sleeps on a futex of ours that a task after the graph's sets, rather than
  // on MLX's completion event (a condition variable: two futex calls more per hand-off).
  const bool sleep_done = P && small && !spin && linger_ns == 0 && stream_park();
  // A small graph's caller serves the kernel pool while it waits: the stream thread, the pool's helper and
  // the woken caller were three threads for two cores, and the scheduler often put all three on one core
  // while the other idled (a 960 x 1280 Linear at one row, back to back: 110-200 us a call against 57-64
  // serving, 2026-12-07). Not for large graphs: a decode step's caller spends two thirds of the step
  // enqueueing while the helper computes, and an encoder layer served ran 9 % slower.
  const bool serve = pace && small && caller_serve() && !tl_lending && pace->eval_us >= kServeMinEvalUs;
  struct Done {
    std::atomic<bool> flag{false}, served{false};
    Sleeper sleeper;
  };
  auto done = std::make_shared<Done>();
  const uint64_t parks_before = P ? P->queued : 0;
  // A large graph (a decode step: tens of products, other nodes between them) keeps the kernel pool's
  // helpers awake until its result is in, so no product waits for a helper's futex wake-up; the hold
  // ends with this call, so the idle time between calls costs nothing.
  const CpuPoolHold hold(!small && pool_hold_in_call());
  auto open = [&] {
    L->release(token);
    if (gate) gate->open.store(true, std::memory_order_release);
    if (parked && small) P->release(parks_before);
  };
  try {
    if (gate) {
      mx::scheduler::enqueue(*stream, [gate] { gate->pass(); });
      g_gates.fetch_add(1, std::memory_order_relaxed);
    }
    mx::async_eval(arrays);
    if (linger_ns > 0 || spin || sleep_done || serve) {
      g_lingers.fetch_add(linger_ns > 0, std::memory_order_relaxed);
      mx::scheduler::enqueue(*stream, [L, done, linger_ns, seq, serve] {
        done->flag.store(true, std::memory_order_seq_cst);
        done->sleeper.wake();
        if (serve) cpu_pool_stop_serving(done->served);
        if (linger_ns > 0) L->linger(linger_ns, seq);
      });
    }
    if (park_next) {
      const uint64_t seq = ++P->queued;
      mx::scheduler::enqueue(*stream, [P, seq] { P->wait(seq); });
      g_stream_parks.fetch_add(1, std::memory_order_relaxed);
    }
  } catch (...) {
    open();
    throw;
  }
  open();
  if (parked && small) g_unparked.fetch_add(1, std::memory_order_relaxed);
  if (enqueue_lock) enqueue_lock.unlock();
  const int64_t enqueued = now_ns();
  if (serve) {
    // Bounded like a park: mx::eval below remains the wait that counts.
    const int served = cpu_pool_serve_call(done->served, enqueued + kParkTimeoutNs);
    if (served != 0) (served > 0 ? g_serves : g_serve_timeouts).fetch_add(1, std::memory_order_relaxed);
  } else if (spin) {
    g_spins.fetch_add(1, std::memory_order_relaxed);
    const int64_t budget = std::min<int64_t>(cap_ns, static_cast<int64_t>(3000 * pace->eval_us) + 20'000);
    if (spin_until([&] { return done->flag.load(std::memory_order_acquire); }, budget))
      g_spin_hits.fetch_add(1, std::memory_order_relaxed);
  } else if (sleep_done) {
    // Bounded like a park: mx::eval below remains the wait that counts.
    done->sleeper.sleep_until([&] { return done->flag.load(std::memory_order_seq_cst); }, enqueued + kParkTimeoutNs);
  }
  mx::eval(arrays);  // waits (at once when the spin saw it done) and raises the graph's errors
  const int64_t end = now_ns();
  if (pace) {
    const double us = (end - enqueued) / 1000.0;
    pace->eval_us = pace->eval_us < 0 ? us : 0.75 * pace->eval_us + 0.25 * us;
  }
  if (pace) L->last_done_ns.store(end, std::memory_order_relaxed);
  // Calls milliseconds apart: the kernels' helper threads, spinning for a next
  // product that belongs to the next call, would only take a core from the
  // caller's work in between (eager torch's next call in the demo).
  if (pace && linger_ns == 0) {
    cpu_pool_park();
    g_parks.fetch_add(1, std::memory_order_relaxed);
  }
}

// Whether this call lends the caller's OpenMP team. Auto lends only while the caller works between
// calls (kOmpTeamMinGapBusy, kOmpTeamWarmUs), and then whichever mode this method's calls measured faster: where
// eager torch runs between calls (the demo, encoders) its OpenMP worker is warm and, lent, does the
// pool's parts (1.5x faster calls, 2026-11-26); where nothing else runs (a decode loop) a lent call pays
// the region's closing barrier, which waits for a sleeping worker to be scheduled (the 1.2B step's tail
// 4.7 -> 12.7 ms). The mode not chosen is probed for kProbeCalls calls now and then, less often while
// the choice holds.
// A probe's first call is not measured (the mode switch), so its other calls refill the window: the two
// medians then compare calls of the same recent stretch.
constexpr int kProbeCalls = EvalPace::kWindow + 1, kProbeEveryMin = 16, kProbeEveryMax = 256;
}  // namespace

double EvalPace::Recent::mean() const {
  if (n == 0) return -1;
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += us[i];
  return sum / n;
}

namespace {

bool choose_lend(EvalPace& pace, int64_t start_ns) {
  const OmpTeam mode = pool_omp_team();
  if (mode == OmpTeam::Off || pace.call_us < kOmpTeamMinCallUs) return false;
  if (mode == OmpTeam::Always) return true;
  if (pace.gap_busy < kOmpTeamMinGapBusy) return false;
  if (pace.gap_busy * pace.gap_us < kOmpTeamMinGapWork * pace.call_us) return false;
  if (start_ns - pace.work_gap_ns > kOmpTeamWarmUs * 1000) return false;
  // A method's first calls fill both windows, lent first: deciding on one or two samples of a mode
  // (a warm-up call's) settled a 60-call run on the slower mode, and probes grew rarer from there.
  if (pace.lent.n < EvalPace::kWindow) return true;
  if (pace.own.n < EvalPace::kWindow) return false;
  if (pace.probe_left > 0) {
    pace.decide = --pace.probe_left == 0;  // this call ends the probe: decide at the next
    return pace.probe_lent;
  }
  // The choice is made only where both windows are of one recent stretch: when they first fill, and
  // right after a probe has refilled the other mode's. Between probes the mode in use refreshes its
  // window every call and the other's is stale: compared on every call, a machine slowing down made the
  // mode in use look slower than the other's old figures, and a decode loop gave up lending (~25 %
  // faster there) for up to kProbeEveryMax calls (SmolLM2 Q4_1 through the stock runtime: 3 of 33 calls
  // lent in a round, 102-123 tok/s against 152-180).
  if (pace.decide || !pace.decided) {
    const bool prefer = pace.lent.mean() < pace.own.mean();
    pace.probe_every = pace.decided && prefer == pace.probe_prefer_lent
                           ? std::min(2 * pace.probe_every, kProbeEveryMax) : kProbeEveryMin;
    pace.probe_prefer_lent = prefer;
    pace.decided = true;
    pace.decide = false;
    pace.since_probe = 0;
  }
  if (++pace.since_probe < pace.probe_every) return pace.probe_prefer_lent;
  pace.since_probe = 0;
  pace.probe_lent = !pace.probe_prefer_lent;
  pace.probe_left = kProbeCalls - 1;
  return pace.probe_lent;
}

}  // namespace

void eval_adaptive(std::vector<mx::array>& arrays, EvalPace& pace, bool small) {
  // A call whose evaluations lately took long enough for the kernels to split their work: the caller,
  // which only waits here, may lend its OpenMP team to the kernel pool for the call (cpu_parallel.h).
  const int64_t start = now_ns(), start_cpu = thread_cpu_ns();
  const bool known = pace.last_end_ns > 0;  // not a method's first call (which may build its kernels)
  const double gap = known ? (start - pace.last_end_ns) / 1e3 : -1;
  if (known) {
    const double busy = std::clamp((start_cpu - pace.last_end_cpu_ns) / 1e3 / std::max(gap, 1.0), 0.0, 1.0);
    if (busy * gap >= kOmpTeamMinGapWork * pace.call_us) pace.work_gap_ns = start;
    pace.gap_busy = pace.gap_busy < 0 ? busy : 0.75 * pace.gap_busy + 0.25 * busy;
    pace.gap_us = pace.gap_us < 0 ? gap : 0.75 * pace.gap_us + 0.25 * gap;
  }
  // Only a graph on a CPU stream: on a GPU the pool has no parts to give a lent worker.
  const bool cpu = cpu_stream(arrays).has_value();
  const bool lent = cpu && choose_lend(pace, start) && cpu_pool_run_with_omp_team([&] {
    tl_lending = true;
    struct Reset {
      ~Reset() { tl_lending = false; }
    } reset;
    eval_impl(arrays, &pace, small);
  });
  if (!lent) {
    if (cpu && known && pace.call_us >= kOmpPauseMinCallUs && gap < kOmpPauseMaxGapUs) cpu_pool_pause_omp_team();
    eval_impl(arrays, &pace, small);
  }
  pace.last_end_ns = now_ns();
  pace.last_end_cpu_ns = thread_cpu_ns();
  if (known) {  // a method's first call may build its kernels
    const double call_us = (pace.last_end_ns - start) / 1e3;
    pace.call_us = pace.call_us < 0 ? call_us : 0.75 * pace.call_us + 0.25 * call_us;
  }
  // A call right after one in the other mode is not measured: after a lent call the team's worker spins
  // on (~10-15 ms) against the pool's helpers, and the first lent call may wake a sleeping worker.
  if (known && lent == pace.last_lent) (lent ? pace.lent : pace.own).add((pace.last_end_ns - start) / 1e3);
  pace.last_lent = lent;
}

void eval_follow_up(std::vector<mx::array> arrays) { eval_impl(arrays, nullptr, true); }

}  // namespace mlxd::rt
