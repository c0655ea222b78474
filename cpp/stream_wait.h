// Adaptive waiting on MLX's CPU stream thread.
//
// MLX runs a CPU graph on a per-stream thread: evaluation enqueues the tasks,
// which wakes that thread, and the caller sleeps until the last task signals
// it. On a small VM each of those two hand-offs is a futex wake-up and a
// context switch, most of a tiny call's cost. Spinning instead of sleeping
// removes them but burns a core while nothing comes (a model called at 100 Hz
// paid 66x eager's CPU time per call with an unconditional spin).
//
// So the wait adapts to what each stream has seen lately:
// - calls arriving microseconds after the previous one finished (back to
//   back): after each call's tasks, a "linger" task keeps the stream thread
//   awake, spinning, for a short time bounded by the recent gaps (at most
//   linger_us()), and a call that finds the thread lingering holds it awake
//   while it enqueues, then spins for its result when the graph is small;
// - calls with long gaps (an app polling at 100 Hz): no linger, so an idle
//   process burns nothing between calls; a small graph is "gated" (one task
//   enqueued first holds the woken stream thread until all its tasks are
//   queued, so it is woken once rather than once per task); the caller
//   sleeps for its result (or, opt-in, spins as long as this graph's
//   evaluations took lately).
// Everything that can wait (the linger, the caller's spin) is time-bounded, and
// other work sent to the stream (an mx::eval elsewhere) waits at most one
// linger; runtime code that evaluates mid-graph uses eval_follow_up().
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <mlx/mlx.h>

namespace mlxd::rt {

namespace mx = mlx::core;

// Per-method hint, kept by the caller across calls: how long its evaluations
// took recently (decides whether the caller spins for the result).
struct EvalPace {
  double eval_us = -1;  // smoothed wall time from enqueue to result; < 0 before the first call
  // smoothed wall time of the whole evaluation, enqueueing included (the stream thread runs the first
  // nodes while later ones are enqueued, so eval_us can be a fraction of it); < 0 before the first call
  double call_us = -1;
  // smoothed share of the time from one evaluation's result to the next one's start that the calling
  // thread spent on the CPU; < 0 until known
  double gap_busy = -1;
  double gap_us = -1;  // smoothed wall time from one evaluation's result to the next one's start
  int64_t last_end_ns = 0, last_end_cpu_ns = 0;
  int64_t work_gap_ns = 0;  // the start of the last call after a gap with work (kOmpTeamMinGapWork)
  // The OpenMP team's lending, chosen by measurement (stream_wait.cpp, eval_adaptive): recent wall times
  // of an evaluation with the team lent and without (compared by their means: unlent calls alternating
  // with eager torch are fast or slow by whether its worker still spins, and a median of five picked
  // the fast third by chance), and the probes of the mode not chosen.
  static constexpr int kWindow = 5;
  struct Recent {
    double us[kWindow];
    int n = 0, next = 0;
    void add(double v) {
      us[next] = v, next = (next + 1) % kWindow, n = n < kWindow ? n + 1 : kWindow;
    }
    double mean() const;  // < 0 while empty
  } lent, own;
  bool last_lent = false;
  int probe_left = 0, since_probe = 0, probe_every = 16;
  bool probe_lent = false;  // the mode the current probe runs
  bool probe_prefer_lent = false;  // the choice in force between probes
  bool decided = false, decide = false;  // a choice made yet; a probe just ended (choose again)
};

// Evaluates `arrays` (like mx::eval) with the adaptive wait above. `small`:
// the graph enqueues quickly (few nodes), so holding the stream thread awake
// while it is enqueued costs less than waking it afterwards.
void eval_adaptive(std::vector<mx::array>& arrays, EvalPace& pace, bool small);

// A further evaluation inside the same call (an output copy, an item() read
// mid-graph): goes ahead of the linger the call's main evaluation left, and
// leaves it lingering again, without counting as a call.
void eval_follow_up(std::vector<mx::array> arrays);

// Ends a linger on the calling thread's default CPU stream at once, so work
// about to be evaluated outside eval_adaptive (an item() read mid-graph, the
// profiler) does not queue behind it.
void end_linger();

// Longest linger (µs): MLX_DELEGATE_LINGER_US at start-up (default 200), 0 off.
int64_t linger_us();
void set_linger_us(int64_t us);

// Whether a caller waiting for its result takes parts of the kernel pool's jobs meanwhile, in place of
// the pool's helper (on by default; MLX_DELEGATE_CALLER_SERVE=0 at start-up turns it off). Only for small
// graphs whose evaluations last long enough to split their work (stream_wait.cpp).
bool caller_serve();
void set_caller_serve(bool on);

// Whether a small graph sent to a sleeping stream thread is gated (see Gate in
// stream_wait.cpp): 0 off, 1 on (default), 2 on and the caller spins for the
// result as it does back to back. MLX_DELEGATE_STREAM_GATE sets it at start-up.
int stream_gate();
void set_stream_gate(int mode);

// The stream park: while it is on (default; MLX_DELEGATE_STREAM_PARK=0 at start-up turns it off) and the
// default device is the CPU, delegate calls run on a CPU stream of their own per calling thread, and a
// small graph called with long gaps leaves that stream's thread blocked in a "park" task of ours (asleep
// on our condition variable, not MLX's) after its result. The next call's tasks then queue behind the park
// without waking the thread (MLX's enqueue finds no waiter), and one release after the last task wakes it
// once: no gate spinning through the enqueue, no futex hand-offs per task. Nothing but delegate work (whose
// evaluations all release the park) runs on that stream, and a park left alone ends after
// 100 ms (or at exit) anyway, so no work can be held up for longer.
bool stream_park();
void set_stream_park(bool on);

// The calling thread's delegate stream while the park is on and the default device is the CPU.
std::optional<mx::Stream> delegate_stream();

// Makes delegate_stream() the calling thread's default stream for its lifetime (a delegate call); a
// no-op when there is none.
class DelegateStreamScope {
 public:
  DelegateStreamScope();
  ~DelegateStreamScope();
  DelegateStreamScope(const DelegateStreamScope&) = delete;
  DelegateStreamScope& operator=(const DelegateStreamScope&) = delete;

 private:
  std::optional<mx::Stream> previous_;
};

// Process-wide counters (tests and benchmarks).
struct StreamWaitStats {
  uint64_t calls = 0;        // evaluations through eval_adaptive on a CPU stream
  uint64_t held = 0;         // ... that found the stream thread lingering and kept it awake
  uint64_t lingers = 0;      // linger tasks enqueued
  uint64_t spins = 0;        // calls whose caller spun for the result
  uint64_t spin_hits = 0;    // ... and got it within the spin
  uint64_t linger_timeouts = 0;  // lingers that ended with no call (spin time wasted)
  uint64_t lingers_cut = 0;      // lingers that started after the next evaluation had begun, and ended
  uint64_t parks = 0;        // calls with no linger that sent the kernels' helper threads to sleep at their end
  uint64_t gates = 0;        // evaluations that gated a small graph for a sleeping stream thread
  uint64_t stream_parks = 0;     // park tasks enqueued on a delegate stream
  uint64_t unparked = 0;         // evaluations enqueued behind a park and released it (one wake-up)
  uint64_t park_timeouts = 0;    // parks that ended by their time bound, unreleased
  uint64_t serves = 0;           // evaluations whose caller served the kernel pool while it waited
  uint64_t serve_timeouts = 0;   // ... that the result did not end by its time bound (never expected)
  uint64_t served_parts = 0;     // parts of the pool's jobs those callers ran (not reset)
};
StreamWaitStats stream_wait_stats();
void reset_stream_wait_stats();

}  // namespace mlxd::rt
