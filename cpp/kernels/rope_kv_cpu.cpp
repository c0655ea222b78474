// RoPE + KV-cache writes in one CPU task: the positions are read when the task
// runs (one compiled graph serves every step), the caches are taken over in
// place when MLX may donate them (else copied once, as a slice update would),
// then each row of q, k and v is read through its strides, rotated (q, k) in
// float32 and stored: q into its own output, k and v into their caches at the
// write position.
#include "kernels/rope_kv_cpu.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include "kernels/cpu_parallel.h"
#include "kernels/rope_cpu.h"

namespace mlxd::rt {
namespace mx = mlx::core;
namespace {

// A rank-4 operand read by rows: data, dtype, the first element's offset, element strides.
struct Rows4 {
  const void* data;
  mx::Dtype dtype;
  int64_t offset;
  int64_t stride[4];

  // a read as [B, H, L, D]: a [B, L, H, D] (seq_first) through its axes 1 and 2 swapped.
  static Rows4 of(const mx::array& a, bool seq_first) {
    const auto& st = a.strides();
    return {a.data<void>(), a.dtype(), 0, {st[0], st[seq_first ? 2 : 1], st[seq_first ? 1 : 2], st[3]}};
  }
  // The heads of D elements from `start` on x's last axis (x [B, L, N], a packed projection), read as
  // [B, H, L, D].
  static Rows4 packed(const mx::array& x, int64_t start, int64_t D) {
    const auto& st = x.strides();
    return {x.data<void>(), x.dtype(), start * st[2], {st[0], D * st[2], st[1], st[2]}};
  }
  // Row (i0, i1, i2) as float32 into dst (n elements).
  void load(int64_t i0, int64_t i1, int64_t i2, int64_t n, float* dst) const {
    const int64_t at = offset + i0 * stride[0] + i1 * stride[1] + i2 * stride[2];
    if (stride[3] == 1) return cpu_load_f32(data, dtype, at, n, dst);
    for (int64_t j = 0; j < n; ++j) cpu_load_f32(data, dtype, at + j * stride[3], 1, dst + j);
  }
};

// A cache input that was not donated: copied whole into its output first.
struct CacheCopy {
  const void* src = nullptr;  // null: donated, nothing to copy
  size_t itemsize = 0;
  mx::Shape shape;
  mx::Strides strides;
};

struct Call {
  Rows4 q, k, v;
  void *q_out, *k_out, *v_out;
  mx::Dtype q_type, k_type, v_type;  // of the outputs
  CacheCopy k_copy, v_copy;
  const void* rope_pos;
  mx::Dtype rope_pos_type;
  const void* write_pos;
  mx::Dtype write_pos_type;
  const void* freqs;  // inverse frequencies [dims / 2], or null: from base
  mx::Dtype freqs_type;
  int64_t freqs_stride;
  int64_t B, Hq, Hk, L, S, D, Dv;
  int dims;
  bool traditional;
  float base;
};

void run(const Call& c) {
  for (const CacheCopy* cc : {&c.k_copy, &c.v_copy}) {
    if (cc->src) cpu_copy_strided(cc->src, cc->itemsize, cc->shape, cc->strides, cc == &c.k_copy ? c.k_out : c.v_out);
  }
  const int64_t first = rope_read_position(c.rope_pos, c.rope_pos_type);
  // Clamped as DynamicSliceUpdateNode clamps (the host has checked an input position already).
  const int64_t at = std::clamp<int64_t>(rope_read_position(c.write_pos, c.write_pos_type), 0, c.S - c.L);
  std::vector<float> cos_t, sin_t;
  rope_angle_table(c.L, first, 1.f, rope_inverse_frequencies(c.dims, c.base, c.freqs, c.freqs_type, c.freqs_stride),
                   cos_t, sin_t);
  const int half = c.dims / 2;
  const int64_t q_rows = c.B * c.Hq * c.L, kv_rows = c.B * c.Hk * c.L;
  // Rows [0, q_rows) are q's, then k's, then v's.
  cpu_parallel_for(q_rows + 2 * kv_rows, std::max(c.D, c.Dv), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(std::max(c.D, c.Dv));
    for (int64_t r = begin; r < end; ++r) {
      const bool is_q = r < q_rows;
      const int64_t i = is_q ? r : (r - q_rows) % kv_rows;
      const int64_t H = is_q ? c.Hq : c.Hk;
      const int64_t l = i % c.L, h = (i / c.L) % H, b = i / (c.L * H);
      if (!is_q && r - q_rows >= kv_rows) {  // v: copied into its cache
        c.v.load(b, h, l, c.Dv, buf.data());
        cpu_store_f32(buf.data(), c.v_type, ((b * c.Hk + h) * c.S + at + l) * c.Dv, c.Dv, c.v_out);
        continue;
      }
      (is_q ? c.q : c.k).load(b, h, l, c.D, buf.data());
      rope_rotate_row(buf.data(), buf.data(), cos_t.data() + l * half, sin_t.data() + l * half, half, c.traditional);
      if (is_q) {
        cpu_store_f32(buf.data(), c.q_type, r * c.D, c.D, c.q_out);
      } else {
        cpu_store_f32(buf.data(), c.k_type, ((b * c.Hk + h) * c.S + at + l) * c.D, c.D, c.k_out);
      }
    }
  });
}

// q, k and v as heads of one packed projection x [B, L, N] (the primitive's first three inputs are
// x): each one's first element on x's last axis, and the [B, H, L, D] shape it is read as.
struct PackedQkv {
  int64_t start[3];
  mx::Shape shape[3];
  bool operator==(const PackedQkv& o) const {
    return std::equal(start, start + 3, o.start) && std::equal(shape, shape + 3, o.shape);
  }
};

std::atomic<bool> g_packed{true};

bool has_primitive_named(const mx::array& a, const char* name) {
  return a.has_primitive() && std::strcmp(a.primitive().name(), name) == 0;
}

// When q, k and v ([B, L, H, D], seq_first) are reshapes of last-axis slices of one [B, L, N]
// array (a fused q/k/v projection, split by the graph), that array and where each starts: the
// kernel reads the heads from it, so the slices and reshapes (six graph nodes a layer, each a
// task of MLX's scheduler in every decode step) drop out of the graph.
std::optional<std::pair<mx::array, PackedQkv>> packed_source(const mx::array& q, const mx::array& k,
                                                             const mx::array& v, bool seq_first) {
  if (!seq_first || !g_packed.load(std::memory_order_relaxed)) return std::nullopt;
  std::optional<mx::array> x;
  PackedQkv p;
  const mx::array* parts[3] = {&q, &k, &v};
  for (int i = 0; i < 3; ++i) {
    const auto& a = *parts[i];
    if (!has_primitive_named(a, "Reshape") || !has_primitive_named(a.inputs()[0], "Slice")) return std::nullopt;
    const auto& sl = a.inputs()[0];
    const auto& src = sl.inputs()[0];
    if (x ? src.id() != x->id() : src.ndim() != 3) return std::nullopt;
    // libmlx exports no type info for its primitives: matched by name above.
    const auto [lo, hi, st] = static_cast<const mx::Slice&>(sl.primitive()).state();
    const bool last_axis_only = st == mx::Shape{1, 1, 1} && lo[0] == 0 && lo[1] == 0 &&
                                hi[0] == src.shape(0) && hi[1] == src.shape(1);
    if (!last_axis_only || a.ndim() != 4 || a.shape(0) != src.shape(0) || a.shape(1) != src.shape(1) ||
        int64_t(a.shape(2)) * a.shape(3) != hi[2] - lo[2])
      return std::nullopt;
    x = src;
    p.start[i] = lo[2];
    p.shape[i] = heads_first_shape(a, true);
  }
  return std::make_pair(*x, p);
}

// Outputs 1 and 2 (the caches written) in place of inputs 3 and 4 (the caches read) in a chain.
const ChainableKernel kRopeKvWriteCpuChainable{"RopeKvWriteCpu", {{1, 3}, {2, 4}}};  // kernel_chain.h

class RopeKvWriteCpu : public mx::Primitive {
 public:
  RopeKvWriteCpu(mx::Stream s, RopeKvWriteArgs args, bool freqs_input, std::optional<PackedQkv> packed)
      : mx::Primitive(s), args_(args), freqs_input_(freqs_input), packed_(std::move(packed)) {}

  // in: q, k, v (or x, x, x: packed_), k_cache, v_cache, rope_pos, write_pos[, inv_freq (flat)];
  // out: q, k_cache, v_cache.
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    // Each output holds its own copy of the input list (MLX's make_arrays), so a cache is
    // referenced once per output and never looks donatable. The outputs are being
    // evaluated now (MLX detaches them right after), so the copies that `in` is not are
    // dropped first; a cache is then donatable exactly when a single-output slice update's
    // would be. As a chain member (run inside the chain's task) the chain has decided: a cache
    // output already holding the cache's buffer is updated in place, one with a buffer of its own
    // gets a copy first.
    const bool member = cpu_task_recording();
    if (!member)
      for (auto& o : out)
        if (&o.inputs() != &in) o.inputs().clear();
    if (!out[0].data_shared_ptr()) out[0].set_data(mx::allocator::malloc(out[0].nbytes()));
    CacheCopy copies[2];
    for (int j = 0; j < 2; ++j) {
      const auto& cache = in[3 + j];
      auto& dst = out[1 + j];
      const CacheCopy copy{cache.data<void>(), cache.itemsize(), cache.shape(), cache.strides()};
      if (dst.data_shared_ptr()) {
        if (dst.data<void>() != cache.data<void>()) copies[j] = copy;
      } else if (!member && cache.flags().row_contiguous && cache.is_donatable()) {
        dst.copy_shared_buffer(cache);  // nothing else reads the old cache: update it in place
      } else {
        dst.set_data(mx::allocator::malloc(dst.nbytes()));
        copies[j] = copy;
      }
    }
    const bool sf = args_.seq_first;
    mx::Shape shapes[3];  // q, k, v as [B, H, L, D]
    for (int i = 0; i < 3; ++i) shapes[i] = packed_ ? packed_->shape[i] : heads_first_shape(in[i], sf);
    auto rows = [&](int i) {
      return packed_ ? Rows4::packed(in[0], packed_->start[i], shapes[i][3]) : Rows4::of(in[i], sf);
    };
    Call c{rows(0), rows(1), rows(2), out[0].data<void>(), out[1].data<void>(), out[2].data<void>(),
           out[0].dtype(), out[1].dtype(), out[2].dtype(), std::move(copies[0]), std::move(copies[1]),
           in[5].data<void>(), in[5].dtype(), in[6].data<void>(), in[6].dtype(), nullptr, mx::float32, 0,
           shapes[0][0], shapes[0][1], shapes[1][1], shapes[0][2], in[3].shape(2), shapes[0][3], shapes[2][3],
           args_.dims, args_.traditional, args_.base};
    if (freqs_input_) {
      const auto& f = in[7];
      c.freqs = f.data<void>();
      c.freqs_type = f.dtype();
      c.freqs_stride = f.ndim() ? f.strides().back() : 0;
    }
    cpu_kernel_note_call(packed_ ? "rope_kv_write_packed" : "rope_kv_write");
    cpu_task_sink(stream()).dispatch([c = std::move(c)] { run(c); });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("RopeKvWriteCpu runs on the CPU only");
  }
  const char* name() const override { return "RopeKvWriteCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RopeKvWriteCpu&>(other);
    return args_.dims == o.args_.dims && args_.traditional == o.args_.traditional && args_.base == o.args_.base &&
           args_.seq_first == o.args_.seq_first && freqs_input_ == o.freqs_input_ && packed_ == o.packed_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {packed_ ? packed_->shape[0] : heads_first_shape(in[0], args_.seq_first), in[3].shape(), in[4].shape()};
  }

 private:
  RopeKvWriteArgs args_;
  bool freqs_input_;
  std::optional<PackedQkv> packed_;
};

}  // namespace

mx::Shape heads_first_shape(const mx::array& a, bool seq_first) {
  auto s = a.shape();
  if (seq_first && s.size() == 4) std::swap(s[1], s[2]);
  return s;
}

bool rope_kv_write_cpu_applies(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& k_cache,
                               const mx::array& v_cache, const mx::array* inv_freq, bool seq_first) {
  if (!cpu_kernels_active() || !cpu_kernel_dtype_ok(q)) return false;
  for (const auto* a : {&q, &k, &v, &k_cache, &v_cache})
    if (a->dtype() != q.dtype() || a->ndim() != 4 || a->size() == 0) return false;
  if (inv_freq && !cpu_kernel_dtype_ok(*inv_freq)) return false;
  const auto qs = heads_first_shape(q, seq_first), ks = heads_first_shape(k, seq_first),
             vs = heads_first_shape(v, seq_first);
  const auto &kc = k_cache.shape(), &vc = v_cache.shape();
  const int B = qs[0], Hk = ks[1], L = qs[2], S = kc[2];
  const bool shapes = ks[0] == B && vs[0] == B && kc[0] == B && vc[0] == B && vs[1] == Hk && kc[1] == Hk &&
                      vc[1] == Hk && ks[2] == L && vs[2] == L && vc[2] == S && L <= S && ks[3] == qs[3] &&
                      kc[3] == qs[3] && vc[3] == vs[3];
  return shapes && Hk > 0 && qs[1] % Hk == 0;
}

std::array<mx::array, 3> rope_kv_write_cpu(const mx::array& q, const mx::array& k, const mx::array& v,
                                           const mx::array& k_cache, const mx::array& v_cache,
                                           const mx::array& rope_pos, const mx::array& write_pos,
                                           const std::optional<mx::array>& inv_freq, const RopeKvWriteArgs& args) {
  if (args.dims <= 0 || args.dims % 2 || args.dims > q.shape(-1)) throw std::invalid_argument("rope: bad dims");
  if (inv_freq && static_cast<int>(inv_freq->size()) != args.dims / 2)
    throw std::invalid_argument("rope: inv_freq must have dims / 2 elements");
  for (const auto* p : {&rope_pos, &write_pos})
    if (p->size() != 1 || !mx::issubdtype(p->dtype(), mx::integer))
      throw std::invalid_argument("positions must be one-element integer arrays");
  std::vector<mx::array> inputs{q, k, v, k_cache, v_cache, rope_pos, write_pos};
  if (inv_freq) inputs.push_back(mx::flatten(*inv_freq));
  std::optional<PackedQkv> packed;
  if (auto src = packed_source(q, k, v, args.seq_first)) {
    inputs[0] = inputs[1] = inputs[2] = src->first;
    packed = std::move(src->second);
  }
  auto prim = std::make_shared<RopeKvWriteCpu>(mx::default_stream(mx::Device::cpu), args, inv_freq.has_value(),
                                               std::move(packed));
  auto outs = mx::array::make_arrays({heads_first_shape(q, args.seq_first), k_cache.shape(), v_cache.shape()},
                                     {q.dtype(), k_cache.dtype(), v_cache.dtype()}, std::move(prim), std::move(inputs));
  return {outs[0], outs[1], outs[2]};
}

void rope_kv_write_cpu_set_packed(bool on) { g_packed.store(on, std::memory_order_relaxed); }

}  // namespace mlxd::rt
