// Fused decode attention on the CPU. Each query row: scores against the keys
// it may see (hidden keys are skipped, so a fixed-size cache under a position
// mask costs only its filled part), a max-shifted softmax, then the weighted
// sum of the value rows. Rows are split across the cores; operands are read
// through their strides, widening half types one row at a time.
#include "kernels/attention_cpu.h"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/vec_math_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool fits_int(int64_t x) { return x <= std::numeric_limits<int>::max(); }

// A rank-4 operand as the kernel reads it: its first element, dtype and
// element strides (0 along broadcast axes).
struct View4 {
  const void* data = nullptr;
  mx::Dtype dtype = mx::float32;
  int64_t stride[4] = {0, 0, 0, 0};

  int64_t at(int64_t i0, int64_t i1, int64_t i2) const { return i0 * stride[0] + i1 * stride[1] + i2 * stride[2]; }
};

// a read as shape [B, H, N, E]; a lower-rank a (a mask) is aligned to the
// right and broadcast along its missing and size-1 axes.
View4 view_of(const mx::array& a) {
  View4 t{a.data<void>(), a.dtype(), {}};
  const int lead = 4 - static_cast<int>(a.ndim());
  for (int i = lead; i < 4; ++i) t.stride[i] = a.shape(i - lead) == 1 ? 0 : a.strides()[i - lead];
  return t;
}

// n elements of t's last axis from element offset `at`, as float32.
void load_f32(const View4& t, int64_t at, int64_t n, float* dst) {
  if (t.stride[3] == 1) {
    cpu_load_f32(t.data, t.dtype, at, n, dst);
    return;
  }
  for (int64_t i = 0; i < n; ++i) cpu_load_f32(t.data, t.dtype, at + i * t.stride[3], 1, dst + i);
}

// The row as float32: in place when it is contiguous float32 already, else widened into buf.
const float* row_f32(const View4& t, int64_t at, int64_t n, float* buf) {
  if (t.dtype == mx::float32 && t.stride[3] == 1) return static_cast<const float*>(t.data) + at;
  load_f32(t, at, n, buf);
  return buf;
}

// A mask row as an additive bias: bool false -> -inf.
void load_bias(const View4& m, int64_t at, int64_t n, float* dst) {
  if (m.dtype != mx::bool_) {
    load_f32(m, at, n, dst);
    return;
  }
  const bool* keep = static_cast<const bool*>(m.data) + at;
  for (int64_t i = 0; i < n; ++i) dst[i] = keep[i * m.stride[3]] ? 0.f : kNegInf;
}

// The vector loops of one row, portable or AVX2.
struct VecOps {
  float (*dot)(const float* a, const float* b, int64_t n);
  void (*axpy)(float* y, float a, const float* x, int64_t n);  // y += a x
  float (*exp_sum)(float* x, int64_t n, float shift);         // x = exp(x - shift); returns the sum
  float (*max)(const float* x, int64_t n);                     // -inf when n == 0
  void (*add)(float* y, const float* x, int64_t n);            // y += x (a float mask row)
  void (*keep)(float* y, const bool* keep, int64_t n);         // y = keep ? y : -inf (a bool mask row)
};

float dot_portable(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy_portable(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

float exp_sum_portable(float* x, int64_t n, float shift) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += (x[i] = std::exp(x[i] - shift));
  return s;
}

float max_portable(const float* x, int64_t n) {
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

void add_portable(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void keep_portable(float* y, const bool* keep, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = keep[i] ? y[i] : kNegInf;
}

constexpr VecOps kPortable{dot_portable, axpy_portable, exp_sum_portable, max_portable, add_portable, keep_portable};

#ifdef MLXD_CPU_X86
MLXD_AVX2 void axpy_avx2(float* y, float a, const float* x, int64_t n) {
  const __m256 av = vmath::set1(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// exp(x) for softmax on eight lanes, where x = score - row max is <= 0, -inf
// or NaN: exp8 without its overflow clamp and its three blends (the blocked
// path spent ~14 % of its time in the softmax at L = S = 1500 on an AVX2-only
// core). x is clamped below at exp8's low end, where 2^n's exponent field is
// 0, so -inf gives exactly 0. max_ps(lo, x) returns x when x is NaN, which
// stays NaN.
MLXD_AVX2 inline __m256 softmax_exp8(__m256 x) {
  return vmath::exp8_core(_mm256_max_ps(vmath::set1(-87.3365448f), x));
}

MLXD_AVX2 float exp_sum_avx2(float* x, int64_t n, float shift) {
  const __m256 sv = vmath::set1(shift);
  __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // two, so consecutive adds do not wait
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int u = 0; u < 2; ++u) {
      const __m256 e = softmax_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8 * u), sv));
      _mm256_storeu_ps(x + i + 8 * u, e);
      sums[u] = _mm256_add_ps(sums[u], e);
    }
  __m256 acc = _mm256_add_ps(sums[0], sums[1]);
  for (; i + 8 <= n; i += 8) {
    __m256 e = softmax_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sv));
    acc = _mm256_add_ps(acc, e);
    _mm256_storeu_ps(x + i, e);
  }
  if (i < n) {
    const int lanes = static_cast<int>(n - i);
    __m256 e = softmax_exp8(_mm256_sub_ps(vmath::load_partial(x + i, lanes, kNegInf), sv));
    acc = _mm256_add_ps(acc, e);
    vmath::store_partial(x + i, e, lanes);
  }
  return vmath::hsum8(acc);
}

MLXD_AVX2 float max_avx2(const float* x, int64_t n) {
  __m256 m = vmath::set1(kNegInf);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  float r = vmath::hmax8(m);
  for (; i < n; ++i) r = std::max(r, x[i]);
  return r;
}

constexpr auto dot_avx2 = vmath::dot2<vmath::LoadF32, float>;  // two FMA chains
constexpr VecOps kAvx2{dot_avx2, axpy_avx2, exp_sum_avx2, max_avx2, add_portable, keep_portable};

// Softmax's exp and max on sixteen lanes (the blocked path spent ~20 % of a
// block's time there: 6.4 us of 31 at 128 x 128); dot and axpy stay on AVX2.
//
// exp(x) for softmax, where x = score - row max is <= 0, -inf (a hidden key)
// or NaN: exp16's reduction and polynomial without its overflow clamp and the
// two edge blends. x is clamped from below at -110 instead of -87.3, so that
// scalef's 2^n (n <= -159 there) underflows to exactly 0 for -inf; x in
// (-110, -87.3) gives the denormal exp(x) instead of 0. NaN passes through
// (max_ps returns its second operand when one is NaN). 13 vector ops instead
// of 19.
MLXD_AVX512 inline __m512 softmax_exp16(__m512 x) {
  return vmath::exp16_core(_mm512_max_ps(_mm512_set1_ps(-110.f), x));
}

// Full vectors unmasked, two sums so consecutive adds do not wait on each
// other, then one masked tail.
MLXD_AVX512 float exp_sum_avx512(float* x, int64_t n, float shift) {
  const __m512 sv = _mm512_set1_ps(shift);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 e0 = softmax_exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), sv));
    const __m512 e1 = softmax_exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), sv));
    _mm512_storeu_ps(x + i, e0);
    _mm512_storeu_ps(x + i + 16, e1);
    acc0 = _mm512_add_ps(acc0, e0);
    acc1 = _mm512_add_ps(acc1, e1);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = vmath::first_lanes(n - i);
    const __m512 e = softmax_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), sv));
    acc0 = _mm512_mask_add_ps(acc0, m, acc0, e);
    _mm512_mask_storeu_ps(x + i, m, e);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

MLXD_AVX512 float max_avx512(const float* x, int64_t n) {
  __m512 m0 = _mm512_set1_ps(kNegInf), m1 = m0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + i));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + i + 16));
  }
  for (; i < n; i += 16) {
    const __mmask16 k = vmath::first_lanes(n - i);
    m0 = _mm512_mask_max_ps(m0, k, m0, _mm512_maskz_loadu_ps(k, x + i));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}

MLXD_AVX512 void add_avx512(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = vmath::first_lanes(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + i), _mm512_maskz_loadu_ps(m, x + i)));
  }
}

// Sixteen bools (one byte each) widened to lanes: -inf where the byte is 0.
MLXD_AVX512 void keep_avx512(float* y, const bool* keep, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i k = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keep + i)));
    _mm512_mask_storeu_ps(y + i, _mm512_cmpeq_epi32_mask(k, _mm512_setzero_si512()), neg_inf);
  }
  keep_portable(y + i, keep + i, n - i);
}

constexpr VecOps kAvx512{dot_avx2, axpy_avx2, exp_sum_avx512, max_avx512, add_avx512, keep_avx512};
#endif

const VecOps& pick_ops() {
#ifdef MLXD_CPU_X86
  if (cpu_use_avx512()) return kAvx512;
  if (cpu_use_avx2()) return kAvx2;
#endif
  return kPortable;
}

// One call: q [B, Hq, L, D], k [B, Hk, S, D], v [B, Hk, S, Dv], the optional
// mask [B, Hq, L, S], out [B, Hq, L, Dv] row-major in out_type.
struct Problem {
  View4 q, k, v, mask;
  bool has_mask, causal;
  bool lowp;  // bfloat16 q / k / v may take the 16-bit products (blocked path)
  float scale;
  int64_t Hq, group, L, S, D, Dv;  // group: query heads per key head
  void* out;
  mx::Dtype out_type;
};

// A row's key and value loops where k and v are float32 rows with a contiguous last axis and D, Dv
// are multiples of 16 up to 128 (64 and 128 in Llama-like models): q and the output stay in AVX-512
// registers across the keys, where the VecOps loops make a call per key and load and store the
// output row for each. Null where they do not apply.
struct RowLoops {
  // scores[j] += q . k_j for the keys not hidden (-inf); returns their max.
  float (*scores)(const float* q, const float* k, int64_t k_stride, float* scores, int64_t n);
  // out = inv_sum * sum_j w[j] v_j over the keys with w[j] != 0.
  void (*wsum)(const float* w, float inv_sum, const float* v, int64_t v_stride, int64_t n, float* out);
};

#ifdef MLXD_CPU_X86
#include "kernels/attention_rows_avx512.inc"
#endif

std::atomic<bool> g_row_loops{true};

const RowLoops* pick_row_loops(const View4& k, const View4& v, int64_t D, int64_t Dv) {
  if (!g_row_loops.load(std::memory_order_relaxed)) return nullptr;
#ifdef MLXD_CPU_X86
  static constexpr auto table = row_loops_table(std::make_integer_sequence<int, 8>{});
  const bool rows_ok = k.dtype == mx::float32 && v.dtype == mx::float32 && k.stride[3] == 1 && v.stride[3] == 1;
  if (cpu_use_avx512() && rows_ok && D == Dv && D % 16 == 0 && D >= 16 && D <= 128) return &table[D / 16 - 1];
#endif
  return nullptr;
}

// Per-thread float32 rows: the scaled query, a widened key / value row, the scores, the output.
struct Scratch {
  explicit Scratch(const Problem& p) : buf(2 * p.D + 2 * p.Dv + p.S), rows(pick_row_loops(p.k, p.v, p.D, p.Dv)) {}
  float* q() { return buf.data(); }
  float* kv(const Problem& p) { return buf.data() + p.D; }  // max(D, Dv) floats
  float* scores(const Problem& p) { return buf.data() + 2 * p.D + p.Dv; }
  float* acc(const Problem& p) { return buf.data() + 2 * p.D + p.Dv + p.S; }
  std::vector<float> buf;
  const RowLoops* rows;
};

// One past the last key of a mask row [0, n) that is visible, looking no
// lower than `floor`: hidden keys at the end of a row (an LLM's fixed-size
// cache under a position mask) are never computed. Contiguous bool rows are
// scanned 8 bytes at a time.
int64_t visible_end(const View4& m, int64_t at, int64_t n, int64_t floor) {
  const int64_t st = m.stride[3];
  int64_t j = n;
  if (m.dtype == mx::bool_) {
    const bool* keep = static_cast<const bool*>(m.data) + at;
    if (st == 1) {
      for (uint64_t word = 0; j - 8 >= floor; j -= 8) {
        std::memcpy(&word, keep + j - 8, 8);
        if (word != 0) break;
      }
    }
    while (j > floor && !keep[(j - 1) * st]) --j;
  } else if (m.dtype == mx::float32) {
    const float* bias = static_cast<const float*>(m.data) + at;
    while (j > floor && bias[(j - 1) * st] == kNegInf) --j;
  } else {  // bfloat16 / float16: compare with -inf's bit pattern
    const uint16_t neg_inf = m.dtype == mx::bfloat16 ? 0xFF80 : 0xFC00;
    const uint16_t* bias = static_cast<const uint16_t*>(m.data) + at;
    while (j > floor && bias[(j - 1) * st] == neg_inf) --j;
  }
  return j;
}

// scores[j] = q . k_j * scale + bias_j for the keys query row (b, h, l) may
// see; returns how many keys it considers (causal rows stop at l) and their max.
std::pair<int64_t, float> score_row(const Problem& p, const VecOps& ops, int64_t b, int64_t h, int64_t l,
                                    Scratch& s) {
  float* q = s.q();
  load_f32(p.q, p.q.at(b, h, l), p.D, q);
  for (int64_t i = 0; i < p.D; ++i) q[i] *= p.scale;
  int64_t keys = p.causal ? std::min(p.S, l + 1) : p.S;
  // Keys hidden at the end of the row (a fixed-size cache under a position mask) are cut off here:
  // every loop below is over `keys`, and with the whole cache each cost O(cache) per row (SmolLM2's
  // decode attention at a 1024-position cache: ~1.8 ms of a 15 ms step at position ~60).
  if (p.has_mask) keys = visible_end(p.mask, p.mask.at(b, h, l), keys, 0);
  float* scores = s.scores(p);
  if (p.has_mask && p.mask.dtype == mx::bool_ && p.mask.stride[3] == 1) {  // a decode step's position mask
    std::fill(scores, scores + keys, 0.f);
    ops.keep(scores, static_cast<const bool*>(p.mask.data) + p.mask.at(b, h, l), keys);
  } else if (p.has_mask) {
    load_bias(p.mask, p.mask.at(b, h, l), keys, scores);
  } else {
    std::fill(scores, scores + keys, 0.f);
  }
  const int64_t k0 = p.k.at(b, h / p.group, 0);
  if (s.rows) return {keys, s.rows->scores(q, static_cast<const float*>(p.k.data) + k0, p.k.stride[2], scores, keys)};
  float top = kNegInf;
  for (int64_t j = 0; j < keys; ++j) {
    if (scores[j] == kNegInf) continue;  // hidden: its key is never read
    scores[j] += ops.dot(q, row_f32(p.k, k0 + j * p.k.stride[2], p.D, s.kv(p)), p.D);
    top = std::max(top, scores[j]);
  }
  return {keys, top};
}

void attend_row(const Problem& p, const VecOps& ops, int64_t row, Scratch& s) {
  const int64_t l = row % p.L, h = (row / p.L) % p.Hq, b = row / (p.L * p.Hq);
  const auto [keys, top] = score_row(p, ops, b, h, l, s);
  float* acc = s.acc(p);
  std::fill(acc, acc + p.Dv, 0.f);
  if (top != kNegInf) {  // else no visible key: zeros, as torch gives
    float* w = s.scores(p);
    const float inv_sum = 1.f / ops.exp_sum(w, keys, top);
    const int64_t v0 = p.v.at(b, h / p.group, 0);
    if (s.rows)
      s.rows->wsum(w, inv_sum, static_cast<const float*>(p.v.data) + v0, p.v.stride[2], keys, acc);
    else
      for (int64_t j = 0; j < keys; ++j)
        if (w[j] != 0.f) ops.axpy(acc, w[j] * inv_sum, row_f32(p.v, v0 + j * p.v.stride[2], p.Dv, s.kv(p)), p.Dv);
  }
  cpu_store_f32(acc, p.out_type, row * p.Dv, p.Dv, p.out);
}

// Multiply-adds per unit of cpu_parallel_for's cost: the rows go to both
// cores only from ~2M multiply-adds (kCpuMinParallel units) on. A decode
// step's attention (SmolLM2: 9 rows x 256 keys x 128) takes a few
// microseconds on one core; splitting it made SmolLM2 fp32 decode 25 % slower
// on the shared 2-core machine (helper wake-ups and waits on a descheduled
// helper, 30 times a token).
constexpr int64_t kMacsPerCostUnit = 128;

void run_attention(const Problem& p, int64_t rows) {
  const VecOps& ops = pick_ops();
  if (pick_row_loops(p.k, p.v, p.D, p.Dv)) cpu_kernel_note_call("sdpa_row_loops");  // tests prove they ran
  const int64_t row_cost = std::max<int64_t>(1, p.S * (p.D + p.Dv) / kMacsPerCostUnit);
  cpu_parallel_for(rows, row_cost, 1, [&](int64_t begin, int64_t end) {
    Scratch s(p);
    for (int64_t r = begin; r < end; ++r) attend_row(p, ops, r, s);
  });
}

// ---- Long queries (prefill, encoders): blocks of query rows on the BLAS ------
//
// One task is a block of up to block_rows(S) query rows of one head: scores =
// scale * Q_blk K^T with one serial sgemm (the block's scores, up to 128 x S
// floats, stay in the core's cache instead of a [B, H, L, S] array going
// through memory), then the mask, a max-shifted softmax in place, P V with a
// second sgemm and the 1 / sum per row on the way out. The tasks are split
// across the cores; each calls a single-threaded sgemm (mlxd_sgemm_serial).
// Half types are widened to float32 per head (S x D once per task, next to
// kBlockRows x S x D multiply-adds).

constexpr int64_t kBlockRows = 64;
// Taller blocks while the block's scores stay well inside a core's L2 (S up
// to 2048: 1 MiB): fewer, larger products (128 rows measured ~5 % faster at
// S = 1500 than 64).
constexpr int64_t kTallBlockRows = 128, kTallBlockMaxS = 2048;

int64_t block_rows(int64_t S) { return S <= kTallBlockMaxS ? kTallBlockRows : kBlockRows; }

// Rows [0, n) of a head's keys or values as row-major float32 with leading
// dimension ld: in place for dense float32 rows (ld == width), else packed
// (widened for half types) into `buf`. Rows of a head split out of a
// [B, S, H * D] projection (stride H * D) are packed too: read in place at a
// stride of a power of two kilobytes they measured 1.25x slower at L = S = 1500
// (8 heads of 64), and the copy (S x D once per head and thread) is small
// next to the block's two products.
struct HeadRows {
  const float* data = nullptr;
  int64_t ld = 0;
};

HeadRows head_rows(const View4& t, int64_t b, int64_t h, int64_t n, int64_t width, std::vector<float>& buf) {
  const int64_t at = t.at(b, h, 0);
  if (t.dtype == mx::float32 && t.stride[3] == 1 && t.stride[2] == width)
    return {static_cast<const float*>(t.data) + at, t.stride[2]};
  buf.resize(n * width);
  for (int64_t j = 0; j < n; ++j) load_f32(t, at + j * t.stride[2], width, buf.data() + j * width);
  return {buf.data(), width};
}

// Per-thread buffers of the blocked path; the widened keys / values of the
// last head a thread saw are kept for its next block of the same head (within
// one call: begin(id) forgets them when a part of another call comes). The buffers themselves live as long as the
// thread (thread_local in run_attention_blocked): allocated per part instead,
// the ~100-200 KiB of a block came back from the heap as fresh pages (glibc
// trims its top past 128 KiB), and each call paid the page faults again.
struct BlockScratch {
  std::vector<float> q, scores, out, inv_sum, bias, k, v;
  int64_t kv_b = -1, kv_h = -1;
  uint64_t call = 0;  // the call whose keys / values kr, vr hold
  HeadRows kr, vr;

  void begin() { kv_b = kv_h = -1; }
  // A part of call `id`: what the thread packed for an earlier part of the same call is kept.
  void begin(uint64_t id) {
    if (call != id) begin();
    call = id;
  }
  // A long-context call's buffers (several MiB) are not kept for the thread's lifetime.
  void trim() {
    constexpr size_t kKeepFloats = size_t{1} << 20;  // 4 MiB
    size_t held = 0;
    for (auto* b : {&q, &scores, &out, &inv_sum, &bias, &k, &v}) held += b->capacity();
    if (held <= kKeepFloats) return;
    for (auto* b : {&q, &scores, &out, &inv_sum, &bias, &k, &v}) std::vector<float>().swap(*b);
    begin();
  }
};

// Adds a mask row to the scores r[0, n): contiguous bool and float32 rows are
// read in place, others widened through `buf`.
void apply_mask_row(const View4& m, const VecOps& ops, int64_t at, int64_t n, float* r, std::vector<float>& buf) {
  if (m.stride[3] == 1 && m.dtype == mx::bool_) return ops.keep(r, static_cast<const bool*>(m.data) + at, n);
  if (m.stride[3] == 1 && m.dtype == mx::float32) return ops.add(r, static_cast<const float*>(m.data) + at, n);
  buf.resize(n);
  load_bias(m, at, n, buf.data());
  ops.add(r, buf.data(), n);
}

// The keys a block of `rows` query rows from l0 computes: causal rows see
// keys [0, l0 + rows) at most; masked rows up to their last visible key (at
// least one column, so the products are never empty: a row that sees nothing
// gives zeros in softmax_block).
int64_t block_keys(const Problem& p, int64_t b, int64_t h, int64_t l0, int64_t rows) {
  int64_t n = p.causal ? std::min(p.S, l0 + rows) : p.S;
  if (p.has_mask) {
    int64_t end = 1;
    for (int64_t i = 0; i < rows; ++i) end = visible_end(p.mask, p.mask.at(b, h, l0 + i), n, end);
    n = end;
  }
  return n;
}

// The scores sc [rows, n] in place: the mask, then exp(score - row max); the
// row's 1 / sum into s.inv_sum (applied to the output rows, fewer than the
// scores). Keys a row may not see, and rows that see none, end as 0.
void softmax_block(const Problem& p, const VecOps& ops, int64_t b, int64_t h, int64_t l0, int64_t rows, int64_t n,
                   float* sc, BlockScratch& s) {
  s.inv_sum.resize(rows);
  for (int64_t i = 0; i < rows; ++i) {
    float* r = sc + i * n;
    const int64_t keys = p.causal ? std::min(n, l0 + i + 1) : n;
    if (p.has_mask) apply_mask_row(p.mask, ops, p.mask.at(b, h, l0 + i), keys, r, s.bias);
    const float top = ops.max(r, keys);
    if (top == kNegInf) {  // no visible key: zeros, as torch gives
      std::fill(r, r + n, 0.f);
      s.inv_sum[i] = 0.f;
      continue;
    }
    s.inv_sum[i] = 1.f / ops.exp_sum(r, keys, top);
    std::fill(r + keys, r + n, 0.f);  // causal: keys after the row's own
  }
}

// The block's output rows o [rows, Dv] (float32) times their 1 / sum, stored
// in out_type unless o already is the output (direct).
void finish_block(const Problem& p, int64_t out_at, int64_t rows, float* o, bool direct, const BlockScratch& s) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = o + i * p.Dv;
    for (int64_t d = 0; d < p.Dv; ++d) row[d] *= s.inv_sum[i];
    if (!direct) cpu_store_f32(row, p.out_type, out_at + i * p.Dv, p.Dv, p.out);
  }
}

void attend_block(const Problem& p, const VecOps& ops, SerialSgemmFn sgemm, int64_t b, int64_t h, int64_t l0,
                  BlockScratch& s) {
  const int64_t rows = std::min(block_rows(p.S), p.L - l0), hk = h / p.group;
  const int64_t n = block_keys(p, b, h, l0, rows);
  if (s.kv_b != b || s.kv_h != hk) {
    s.kr = head_rows(p.k, b, hk, p.S, p.D, s.k);
    s.vr = head_rows(p.v, b, hk, p.S, p.Dv, s.v);
    s.kv_b = b, s.kv_h = hk;
  }
  // Dense float32 query rows are read in place; others (heads split out of a
  // projection, as K / V in head_rows; half types) packed and widened.
  const float* qa = nullptr;
  if (p.q.dtype == mx::float32 && p.q.stride[3] == 1 && p.q.stride[2] == p.D) {
    qa = static_cast<const float*>(p.q.data) + p.q.at(b, h, l0);
  } else {
    s.q.resize(rows * p.D);
    for (int64_t i = 0; i < rows; ++i) load_f32(p.q, p.q.at(b, h, l0 + i), p.D, s.q.data() + i * p.D);
    qa = s.q.data();
  }
  s.scores.resize(rows * n);
  float* sc = s.scores.data();
  sgemm(0, 1, static_cast<int>(rows), static_cast<int>(n), static_cast<int>(p.D), p.scale, qa,
        static_cast<int>(p.D), s.kr.data, static_cast<int>(s.kr.ld), 0.f, sc, static_cast<int>(n));
  softmax_block(p, ops, b, h, l0, rows, n, sc, s);
  // A float32 output's rows of this block are contiguous: P V goes straight
  // there and is scaled in place; half outputs go through s.out.
  const int64_t out_at = ((b * p.Hq + h) * p.L + l0) * p.Dv;
  const bool direct = p.out_type == mx::float32;
  float* o = direct ? static_cast<float*>(p.out) + out_at : (s.out.resize(rows * p.Dv), s.out.data());
  sgemm(0, 0, static_cast<int>(rows), static_cast<int>(p.Dv), static_cast<int>(n), 1.f, sc, static_cast<int>(n),
        s.vr.data, static_cast<int>(s.vr.ld), 0.f, o, static_cast<int>(p.Dv));
  finish_block(p, out_at, rows, o, direct, s);
}

#include "kernels/attention_lowp_cpu.inc"

// Numbers the blocked calls, so that a thread keeps the keys / values it
// packed for one part of a call for its next part of the same call.
std::atomic<uint64_t> g_blocked_calls{0};

// Each block is a part of its own, claimed by whichever thread is free (up to
// kMaxPartsPerThread per thread; blocks are 2-25M multiply-adds). With four
// parts per thread, as cpu_parallel_for cuts, the thread that finished first
// waited for up to a quarter of the other's share: L = S = 1500, 8 heads of
// 64 took 1.05-1.06x eager's time against 0.95-0.98x with a part per block
// (2026-11-27, in one process, AMD EPYC, 2 cores).
constexpr int64_t kMaxPartsPerThread = 64;

void run_attention_blocked(const Problem& p, int64_t batch, LowpGemmFn lowp) {
  const VecOps& ops = pick_ops();
  SerialSgemmFn sgemm = serial_sgemm();
  const int64_t rows = block_rows(p.S), blocks = (p.L + rows - 1) / rows;
  const int64_t tasks = batch * p.Hq * blocks;
  const int64_t cost = std::max<int64_t>(1, std::min(rows, p.L) * p.S * (p.D + p.Dv) / kMacsPerCostUnit);
  const uint64_t id = g_blocked_calls.fetch_add(1, std::memory_order_relaxed) + 1;
  const int64_t parts = tasks * cost >= kCpuMinParallel ? std::min(tasks, kMaxPartsPerThread * cpu_pool_threads()) : 1;
  cpu_parallel_parts(static_cast<int>(parts), [&](int i) {
    const int64_t begin = tasks * i / parts, end = tasks * (i + 1) / parts;
    if (begin >= end) return;
    thread_local BlockScratch s;
    s.begin(id);
    if (lowp != nullptr) {
      thread_local LowpScratch s16;
      const int one = 1, threads = lowp_blas().set_threads_local(&one);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t blk = t % blocks, h = (t / blocks) % p.Hq, b = t / (blocks * p.Hq);
        attend_block_lowp(p, ops, lowp, b, h, blk * rows, rows, s, s16);
      }
      lowp_blas().set_threads_local(&threads);
      if (s16.k.capacity() + s16.v.capacity() + s16.w.capacity() > (size_t{1} << 21)) {
        s16 = LowpScratch();
        s.begin();  // its packed keys / values went with it
      }
    } else {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t blk = t % blocks, h = (t / blocks) % p.Hq, b = t / (blocks * p.Hq);
        attend_block(p, ops, sgemm, b, h, blk * rows, s);
      }
    }
    s.trim();
  });
}

const ChainableKernel kSdpaCpuChainable{"SdpaCpu"};  // kernel_chain.h

class SdpaCpu : public mx::UnaryPrimitive {
 public:
  SdpaCpu(mx::Stream s, float scale, bool has_mask, bool causal, bool blocked, bool lowp)
      : mx::UnaryPrimitive(s), scale_(scale), has_mask_(has_mask), causal_(causal), blocked_(blocked), lowp_(lowp) {}

  // in: q, k, v, then the mask when present (any strides).
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& encoder = begin_cpu_task(stream(), in, out);
    const auto &q = in[0], &k = in[1], &v = in[2];
    Problem p{view_of(q), view_of(k), view_of(v), has_mask_ ? view_of(in[3]) : View4{},
              has_mask_, causal_, lowp_, scale_,
              q.shape(1), q.shape(1) / k.shape(1), q.shape(2), k.shape(2), q.shape(3), v.shape(3),
              out.data<void>(), out.dtype()};
    if (blocked_) {
      const LowpGemmFn lowp = lowp_gemm_for(p);
      cpu_kernel_note_call("sdpa_blocked");
      if (lowp != nullptr) cpu_kernel_note_call("sdpa_blocked_bf16");
      encoder.dispatch([p, lowp, batch = static_cast<int64_t>(q.shape(0))] { run_attention_blocked(p, batch, lowp); });
      return;
    }
    const int64_t rows = static_cast<int64_t>(q.shape(0)) * q.shape(1) * q.shape(2);
    cpu_kernel_note_call("sdpa");
    encoder.dispatch([p, rows] { run_attention(p, rows); });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("SdpaCpu runs on the CPU only");
  }
  const char* name() const override { return "SdpaCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const SdpaCpu&>(other);
    return scale_ == o.scale_ && has_mask_ == o.has_mask_ && causal_ == o.causal_ && blocked_ == o.blocked_ &&
           lowp_ == o.lowp_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {out_shape(in[0], in[2])};
  }

  static mx::Shape out_shape(const mx::array& q, const mx::array& v) {
    return {q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  }

 private:
  float scale_;
  bool has_mask_, causal_, blocked_, lowp_;
};

bool mask_ok(const mx::array& m, const mx::Shape& scores) {
  if (m.dtype() != mx::bool_ && !cpu_kernel_dtype_ok(m)) return false;
  if (m.ndim() > 4) return false;
  const int lead = 4 - static_cast<int>(m.ndim());
  for (int i = 0; i < static_cast<int>(m.ndim()); ++i)
    if (m.shape(i) != 1 && m.shape(i) != scores[i + lead]) return false;
  return true;
}

// Shapes, dtypes and mask both paths take.
bool operands_ok(const mx::array& q, const mx::array& k, const mx::array& v, const std::optional<mx::array>& mask) {
  if (!cpu_kernels_active() || q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) return false;
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), Hk = k.shape(1), S = k.shape(2);
  if (L <= 0 || S <= 0 || Hk <= 0 || Hq % Hk != 0) return false;
  if (k.shape(0) != B || v.shape(0) != B || v.shape(1) != Hk || v.shape(2) != S || k.shape(3) != q.shape(3))
    return false;
  for (const auto* a : {&q, &k, &v})
    if (!cpu_kernel_dtype_ok(*a)) return false;
  return !mask || mask_ok(*mask, {B, Hq, L, S});
}

}  // namespace

int fused_sdpa_cpu_max_queries() {
  const char* env = std::getenv("MLX_DELEGATE_SDPA_FUSED_MAX_L");
  return env && *env ? std::atoi(env) : kFusedSdpaCpuMaxQueries;
}

bool blocked_sdpa_cpu_enabled() {
  const char* env = std::getenv("MLX_DELEGATE_SDPA_BLOCKED");
  return !(env && std::string(env) == "0");
}

// MLX_DELEGATE_SDPA_BF16=0: bfloat16 attention widens to fp32 for sgemm
// instead of the 16-bit products (A/B runs, tests; read when a graph is built).
bool blocked_sdpa_lowp_enabled() {
  const char* env = std::getenv("MLX_DELEGATE_SDPA_BF16");
  return !(env && std::string(env) == "0");
}

bool fused_sdpa_cpu_applies(const mx::array& q, const mx::array& k, const mx::array& v,
                            const std::optional<mx::array>& mask) {
  return operands_ok(q, k, v, mask) && q.shape(2) <= fused_sdpa_cpu_max_queries();
}

bool blocked_sdpa_cpu_applies(const mx::array& q, const mx::array& k, const mx::array& v,
                              const std::optional<mx::array>& mask) {
  if (!blocked_sdpa_cpu_enabled() || serial_sgemm() == nullptr || !operands_ok(q, k, v, mask)) return false;
  // sgemm takes int dimensions and leading dimensions (a key row stride included).
  return fits_int(k.shape(2)) && fits_int(q.shape(3)) && fits_int(v.shape(3)) && fits_int(k.strides()[2]) &&
         fits_int(v.strides()[2]) && fits_int(block_rows(k.shape(2)) * static_cast<int64_t>(k.shape(2)));
}

namespace {

mx::array sdpa_primitive(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                         const std::optional<mx::array>& mask, bool causal, bool blocked) {
  std::vector<mx::array> inputs{q, k, v};
  if (mask) inputs.push_back(*mask);
  auto prim = std::make_shared<SdpaCpu>(mx::default_stream(mx::Device::cpu), scale, mask.has_value(),
                                        causal && !mask, blocked, blocked && blocked_sdpa_lowp_enabled());
  return mx::array(SdpaCpu::out_shape(q, v), q.dtype(), std::move(prim), std::move(inputs));
}

}  // namespace

mx::array fused_sdpa_cpu(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                         const std::optional<mx::array>& mask, bool causal) {
  return sdpa_primitive(q, k, v, scale, mask, causal, false);
}

mx::array blocked_sdpa_cpu(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                           const std::optional<mx::array>& mask, bool causal) {
  return sdpa_primitive(q, k, v, scale, mask, causal, true);
}

void fused_sdpa_cpu_set_row_loops(bool on) { g_row_loops.store(on, std::memory_order_relaxed); }

}  // namespace mlxd::rt
