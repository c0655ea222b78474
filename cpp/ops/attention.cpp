// Attention and LLM building blocks, mapped to MLX's fused kernels.
#include <limits>

#include <mlx/fast.h>

#include "../ops_common.h"
#include "kernels/attention_cpu.h"
#include "kernels/cpu_parallel.h"
#include "kernels/rope_cpu.h"
#include "kernels/rope_kv_cpu.h"
#include "kernels/rows_cpu.h"

namespace mlxd::rt {

namespace {

// torch's is_causal mask: query i sees keys 0..i (top-left aligned). MLX's
// "causal" mode is aligned bottom-right, so it is only used when L == S.
mx::array top_left_causal(int L, int S) {
  auto rows = mx::reshape(mx::arange(L, mx::int32), {L, 1});
  auto cols = mx::reshape(mx::arange(S, mx::int32), {1, S});
  return mx::less_equal(cols, rows);
}

// [..., L, 1]: whether each query row sees at least one key. torch returns
// zeros for rows with none, MLX a mean of v (bool) or NaN (float).
mx::array rows_with_keys(const mx::array& mask) {
  auto visible = mask.dtype() == mx::bool_
                     ? mask
                     : mx::not_equal(mask, mx::array(-std::numeric_limits<float>::infinity(), mask.dtype()));
  return mx::any(visible, -1, /*keepdims=*/true);
}

// MLX has no CPU attention kernel: its fast SDPA composes matmuls around its
// own single-threaded softmax. On the CPU, float32 attention is composed here
// around the vectorised two-core softmax (kernels/rows_cpu.h). Half types keep
// MLX's path, which does not round the scores to the half type.
bool composed_cpu_sdpa(const mx::array& q) { return q.dtype() == mx::float32 && cpu_kernels_active(); }

// softmax(q k^T * scale + mask) v with GQA: the query heads that share a key
// head are stacked along L, so each key head is one matmul. `mask` broadcasts
// to [B, Hq, L, S] (bool: keep where true; float: added).
mx::array sdpa_cpu(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                   const std::optional<mx::array>& mask) {
  const int B = q.shape(0), Hq = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int Hk = k.shape(1), S = k.shape(2);
  auto grouped = mx::reshape(mx::multiply(q, mx::array(scale, q.dtype())), {B, Hk, (Hq / Hk) * L, D});
  auto scores = mx::reshape(mx::matmul(grouped, mx::swapaxes(k, -1, -2)), {B, Hq, L, S});
  if (mask) {
    scores = mask->dtype() == mx::bool_
                 ? mx::where(*mask, scores, mx::array(-std::numeric_limits<float>::infinity(), scores.dtype()))
                 : mx::add(scores, *mask);
  }
  auto probs = rows_cpu(scores, RowKernel::softmax);
  auto out = mx::matmul(mx::reshape(probs, {B, Hk, (Hq / Hk) * L, S}), v);
  return mx::reshape(out, {B, Hq, L, v.shape(3)});
}

}  // namespace

void exec_SdpaNode(const mlxd::SdpaNode& n, ExecContext& ctx) {
  const auto& q = ctx.in(n.q());
  const auto& k = ctx.in(n.k());
  const auto& v = ctx.in(n.v());
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) throw NodeError("q, k and v must be rank 4");
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0)
    throw NodeError("query heads (" + std::to_string(q.shape(1)) + ") are not a multiple of key heads (" +
                    std::to_string(k.shape(1)) + ")");
  const int L = q.shape(2), S = k.shape(2);
  std::optional<mx::array> mask;
  if (const auto* m = ctx.maybe_in(n.mask())) {
    mask = m->dtype() == mx::bool_ || m->dtype() == q.dtype() ? *m : mx::astype(*m, q.dtype());
  }
  if (fused_sdpa_cpu_applies(q, k, v, mask)) {  // few query rows (decode): one fused kernel
    ctx.set(n.out(), fused_sdpa_cpu(q, k, v, n.scale(), mask, n.causal()));
    return;
  }
  if (blocked_sdpa_cpu_applies(q, k, v, mask)) {  // more rows: blocks of rows on the BLAS, one node
    ctx.set(n.out(), blocked_sdpa_cpu(q, k, v, n.scale(), mask, n.causal()));
    return;
  }
  if (!mask && n.causal() && L != S) mask = top_left_causal(L, S);
  mx::array out = mx::array(0.f);
  if (composed_cpu_sdpa(q) && L > 0 && S > 0) {
    if (n.causal() && !mask) mask = top_left_causal(L, S);
    out = sdpa_cpu(q, k, v, n.scale(), mask);
  } else {
    std::string mode = n.causal() && !mask ? "causal" : "";
    out = mx::fast::scaled_dot_product_attention(q, k, v, n.scale(), mode, mask);
  }
  if (mask && L > 0) out = mx::where(rows_with_keys(*mask), out, mx::zeros({}, out.dtype()));
  ctx.set(n.out(), out);
}

namespace {

// The CPU kernel (kernels/rope_cpu.h) for a RopeNode: one graph node instead
// of MLX's composed fallback; the frequencies go in as given (no reciprocal).
mx::array rope_cpu_node(const mlxd::RopeNode& n, const mx::array& x, const mx::array* inv_freq, ExecContext& ctx) {
  std::optional<mx::array> freqs;
  if (inv_freq) freqs = *inv_freq;
  if (const auto* at = ctx.maybe_in(n.offset_tensor())) {
    if (at->size() != 1 || !mx::issubdtype(at->dtype(), mx::integer))
      throw NodeError("rope offset must be a one-element integer tensor");
    return rope_cpu(x, n.dims(), n.traditional(), n.base(), n.scale(), *at, freqs);
  }
  return rope_cpu(x, n.dims(), n.traditional(), n.base(), n.scale(), static_cast<int>(ctx.resolve(n.offset())), freqs);
}

}  // namespace

namespace {

// MLX's RoPE (mx::fast::rope, composed on the CPU): first position `at` (a
// one-element integer array, no host read) or `offset`.
mx::array rope_mlx(mx::array x, int dims, bool traditional, float base_value, float scale, const mx::array* inv_freq,
                   const mx::array* at, int offset) {
  std::optional<float> base = base_value;
  std::optional<mx::array> periods;  // MLX takes 1 / inv_freq
  if (inv_freq) {
    periods = mx::reciprocal(mx::astype(*inv_freq, mx::float32));
    base = std::nullopt;
  }
  bool lifted = x.ndim() == 2;  // MLX wants at least [B, L, D]
  if (lifted) x = mx::expand_dims(x, 0);
  mx::array out = x;
  if (at) {
    // The position stays an array (no host read), so the graph is the same at
    // every position. A scalar offset applies to any batch size.
    auto first = mx::reshape(mx::astype(*at, mx::int32), {});
    out = mx::fast::rope(x, dims, traditional, base, scale, first, periods);
  } else {
    out = mx::fast::rope(x, dims, traditional, base, scale, offset, periods);
  }
  return lifted ? mx::squeeze(out, 0) : out;
}

void check_position(const mx::array& at, const char* what) {
  if (at.size() != 1 || !mx::issubdtype(at.dtype(), mx::integer))
    throw NodeError(std::string(what) + " must be a one-element integer tensor");
}

}  // namespace

void exec_RopeNode(const mlxd::RopeNode& n, ExecContext& ctx) {
  auto x = ctx.in(n.x());
  if (x.ndim() < 2) throw NodeError("rope needs [..., L, D]");
  if (n.dims() <= 0 || n.dims() > x.shape(-1) || n.dims() % 2) throw NodeError("bad rope dims");
  const auto* inv_freq = ctx.maybe_in(n.inv_freq());
  if (rope_cpu_applies(x, inv_freq)) {
    ctx.set(n.out(), rope_cpu_node(n, x, inv_freq, ctx));
    return;
  }
  const auto* at = ctx.maybe_in(n.offset_tensor());
  if (at) check_position(*at, "rope offset");
  ctx.set(n.out(), rope_mlx(x, n.dims(), n.traditional(), n.base(), n.scale(), inv_freq, at,
                            at ? 0 : static_cast<int>(ctx.resolve(n.offset()))));
}

void exec_RopeKvWriteNode(const mlxd::RopeKvWriteNode& n, ExecContext& ctx) {
  const auto& q_in = ctx.in(n.q());
  const auto& k_in = ctx.in(n.k());
  const auto& v_in = ctx.in(n.v());
  const auto& k_cache = ctx.in(n.k_cache());
  const auto& v_cache = ctx.in(n.v_cache());
  const auto& rope_pos = ctx.in(n.rope_pos());
  const auto& write_pos = ctx.in(n.write_pos());
  const auto* inv_freq = ctx.maybe_in(n.inv_freq());
  const bool sf = n.seq_first();
  for (const auto* a : {&q_in, &k_in, &v_in, &k_cache, &v_cache})
    if (a->ndim() != 4) throw NodeError("q, k, v and the caches must be rank 4");
  // Shapes as [B, H, L, D] (seq_first inputs are [B, L, H, D]).
  const auto qs = heads_first_shape(q_in, sf), ks = heads_first_shape(k_in, sf), vs = heads_first_shape(v_in, sf);
  if (n.dims() <= 0 || n.dims() > qs[3] || n.dims() % 2 || ks[3] != qs[3])
    throw NodeError("bad rope dims, or q and k differ in head size");
  for (int c = 0; c < 2; ++c) {
    const auto& cache = c ? v_cache : k_cache;
    const auto& update = c ? vs : ks;
    for (int d = 0; d < 4; ++d)
      if (d != 2 ? update[d] != cache.shape(d) : update[d] > cache.shape(d))
        throw NodeError("k / v do not fit their cache outside the sequence axis, or are longer than it");
  }
  if (ks[2] != vs[2] || k_cache.shape(2) != v_cache.shape(2))
    throw NodeError("k and v (and their caches) must have the same length");
  check_position(rope_pos, "rope position");
  check_position(write_pos, "cache write position");
  const int last = k_cache.shape(2) - ks[2];
  ctx.guard_index(n.write_pos(), 0, last, "slice update start");
  if (rope_kv_write_cpu_applies(q_in, k_in, v_in, k_cache, v_cache, inv_freq, sf)) {
    std::optional<mx::array> freqs;
    if (inv_freq) freqs = *inv_freq;
    auto outs = rope_kv_write_cpu(q_in, k_in, v_in, k_cache, v_cache, rope_pos, write_pos, freqs,
                                  {n.dims(), n.traditional(), n.base(), sf});
    ctx.set(n.out_q(), outs[0]);
    ctx.set(n.out_k_cache(), outs[1]);
    ctx.set(n.out_v_cache(), outs[2]);
    return;
  }
  // MLX ops (GPUs, kernels off): what the transposes, RopeNode and DynamicSliceUpdateNode run.
  auto heads_first = [sf](const mx::array& x) { return sf ? mx::transpose(x, {0, 2, 1, 3}) : x; };
  auto rope = [&](const mx::array& x) {
    return rope_mlx(heads_first(x), n.dims(), n.traditional(), n.base(), 1.f, inv_freq, &rope_pos, 0);
  };
  // Still clamped: a position computed inside the graph cannot be checked on the host.
  auto at = mx::clip(mx::reshape(mx::astype(write_pos, mx::int32), {1}), mx::array(0, mx::int32),
                     mx::array(last, mx::int32));
  ctx.set(n.out_q(), rope(q_in));
  ctx.set(n.out_k_cache(), mx::slice_update(k_cache, mx::astype(rope(k_in), k_cache.dtype()), at, {2}));
  ctx.set(n.out_v_cache(), mx::slice_update(v_cache, mx::astype(heads_first(v_in), v_cache.dtype()), at, {2}));
}

}  // namespace mlxd::rt
