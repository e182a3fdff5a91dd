// Fused CPU backward + sparse optimizer of LocalEmbeddingBags' pooled lookup (embedscale, issue 15).
//
// One call does, for every feature (= one table) of a dim group, in parallel over features:
//   1. walk the feature's bags in batch order; every value i of bag b adds
//      w_i * grad_out[b, feature columns] to the accumulator of its row (w_i = per-value scale, times -lr
//      for SGD), the accumulator slot of a row found through a dense row -> slot map (no sort);
//   2. apply the optimizer once per distinct row (FBGEMM EXACT_SGD / EXACT_ROWWISE_ADAGRAD semantics:
//      duplicates summed first), then reset the row's slot.
// Each row's contributions are summed in batch order, with a fused multiply-add per element: the order
// and rounding of the PyTorch path (a stable sort by row, then embedding_bag's weighted segment sum).
// Features must read disjoint row ranges (one table each), so threads never write the same row.
// The formulas are those of embedscale.embedding.optim (its module docstring).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t MAX_DIM = 1024;
constexpr int64_t PREFETCH = 16;      // values ahead whose slot is prefetched
constexpr int64_t PREFETCH_ROWS = 4;  // rows ahead whose weights are prefetched in the update

struct Args {
  float* weight;        // [R, D]
  float* momentum;      // [R] or nullptr (SGD)
  bool* touched;        // [R] or nullptr
  int32_t* slot;        // [R], every entry -1 between calls
  const float* grad;    // grad_out[b, col0 + f * D + d] = grad[b * ldg + f * D + d]
  int64_t ldg;
  const float* scale;   // [n] per-value factor or nullptr
  const int64_t* row_lo;  // [k] first row of feature f's table
  const int64_t* row_hi;  // [k] one past its last row
  int64_t B, k, D;
  bool adagrad;
  float lr, eps;
};

struct Scratch {
  std::vector<float> acc;
  std::vector<int64_t> uniq;
};

template <int DIM>
inline void axpy(float* __restrict dst, const float* __restrict g, float w, int64_t D) {
  const int64_t n = DIM > 0 ? DIM : D;
  for (int64_t d = 0; d < n; ++d) dst[d] = std::fma(w, g[d], dst[d]);
}

template <int DIM>
inline void assign(float* __restrict dst, const float* __restrict g, float w, int64_t D) {
  const int64_t n = DIM > 0 ? DIM : D;
  for (int64_t d = 0; d < n; ++d) dst[d] = w * g[d];
}

// sum of g[d]^2 in the fixed order of optim.row_mean_squares (the PyTorch path): the squares folded in
// halves (j += j + h, h = width / 2; an odd width's last element added to element 0) down to one.
template <int DIM>
inline float sum_of_squares(const float* g, int64_t D) {
  constexpr int64_t CAP = DIM > 0 ? DIM : MAX_DIM;
  float buf[CAP];
  const int64_t n = DIM > 0 ? DIM : D;
  for (int64_t d = 0; d < n; ++d) buf[d] = g[d] * g[d];
  int64_t w = n;
  while (w > 1) {
    const int64_t h = w / 2;
    for (int64_t j = 0; j < h; ++j) buf[j] = buf[j] + buf[j + h];
    if (w % 2) buf[0] = buf[0] + buf[2 * h];
    w = h;
  }
  return buf[0];
}

// Calls go(std::integral_constant<int, DIM>()) with DIM = D for the dims compiled for (16, 32, 64, 128: the
// inner loops unrolled), DIM = 0 (any D, a run-time loop bound) otherwise.
template <typename Go>
inline auto with_dim(int64_t D, Go&& go) {
  switch (D) {
    case 16: return go(std::integral_constant<int, 16>());
    case 32: return go(std::integral_constant<int, 32>());
    case 64: return go(std::integral_constant<int, 64>());
    case 128: return go(std::integral_constant<int, 128>());
    default: return go(std::integral_constant<int, 0>());
  }
}

// The accumulator slot of row r through the dense row -> slot map: an unseen row (slot -1) takes the next slot
// (first-seen order, recorded in uniq). Returns the slot; fresh tells whether it was just taken.
inline int32_t claim_slot(int32_t* slot, int64_t r, int64_t& nu, int64_t* uniq, bool& fresh) {
  int32_t s = slot[r];
  fresh = s < 0;
  if (fresh) {
    s = static_cast<int32_t>(nu);
    slot[r] = s;
    uniq[nu++] = r;
  }
  return s;
}

// The optimizer step of one row from its summed gradient gr (optim.rowwise_adagrad_update_ /
// optim.sgd_update_): row-wise Adagrad (momentum given) scales gr by -lr / (sqrt(m) + eps) after adding its
// mean square to m; SGD adds gr * sgd_mult (-lr, or 1 when gr already carries -lr).
template <int DIM>
inline void update_row(float* __restrict wr, float* momentum_r, const float* __restrict gr, int64_t D,
                       float lr, float eps, float sgd_mult) {
  if (momentum_r) {
    const float sq = sum_of_squares<DIM>(gr, D);
    const float m = *momentum_r + sq / static_cast<float>(D);
    *momentum_r = m;
    const float mult = (1.0f / (std::sqrt(m) + eps)) * (-lr);  // std::sqrt: correctly rounded
    for (int64_t d = 0; d < D; ++d) wr[d] += gr[d] * mult;
  } else if (sgd_mult == 1.0f) {
    for (int64_t d = 0; d < D; ++d) wr[d] += gr[d];
  } else {
    for (int64_t d = 0; d < D; ++d) wr[d] += gr[d] * sgd_mult;
  }
}

// One feature: values [begin(b), end(b)) of each bag b; one_hot: value b * k + f.
// Returns the number of values whose row lies outside the feature's table (skipped: they would race with
// another feature's update; only possible with the module's id validation turned off).
template <int DIM, typename RowT, typename OffT>
int64_t feature_step(const Args& a, const RowT* rows, const OffT* offsets, int64_t f, float factor,
                     Scratch& s) {
  const int64_t D = DIM > 0 ? DIM : a.D;
  int64_t nvals;
  if (offsets) {
    nvals = static_cast<int64_t>(offsets[(f + 1) * a.B] - offsets[f * a.B]);
  } else {
    nvals = a.B;
  }
  if (nvals == 0) return 0;
  const int64_t lo = a.row_lo[f], hi = a.row_hi[f];
  const int64_t vend = offsets ? static_cast<int64_t>(offsets[(f + 1) * a.B]) : 0;
  int64_t bad = 0;
  // grown, never shrunk: no allocation per step once the largest feature was seen (at every dim)
  if (static_cast<int64_t>(s.uniq.size()) < nvals) s.uniq.resize(nvals);
  if (static_cast<int64_t>(s.acc.size()) < nvals * D) s.acc.resize(nvals * D);
  float* acc = s.acc.data();
  int64_t* uniq = s.uniq.data();
  int32_t* slot = a.slot;
  int64_t nu = 0;
  const float* gcol = a.grad + f * D;
  for (int64_t b = 0; b < a.B; ++b) {
    int64_t begin, end;
    if (offsets) {
      begin = offsets[f * a.B + b];
      end = offsets[f * a.B + b + 1];
    } else {
      begin = b * a.k + f;
      end = begin + 1;
    }
    const float* g = gcol + b * a.ldg;
    if (!offsets && b + PREFETCH < a.B) __builtin_prefetch(slot + rows[(b + PREFETCH) * a.k + f]);
    for (int64_t i = begin; i < end; ++i) {
      // the slot of a value PREFETCH ahead: a cold table's slots are cache misses (prefetch never faults)
      if (offsets && i + PREFETCH < vend) __builtin_prefetch(slot + rows[i + PREFETCH]);
      const int64_t r = static_cast<int64_t>(rows[i]);
      if (r < lo || r >= hi) {
        ++bad;
        continue;
      }
      const float w = a.scale ? a.scale[i] * factor : factor;
      bool fresh;
      const int32_t sl = claim_slot(slot, r, nu, uniq, fresh);
      if (fresh) {
        assign<DIM>(acc + sl * D, g, w, D);
      } else {
        axpy<DIM>(acc + sl * D, g, w, D);
      }
    }
  }
  for (int64_t u = 0; u < nu; ++u) {
    const int64_t r = uniq[u];
    if (u + PREFETCH_ROWS < nu) {
      __builtin_prefetch(a.weight + uniq[u + PREFETCH_ROWS] * D, 1);
      if (a.momentum) __builtin_prefetch(a.momentum + uniq[u + PREFETCH_ROWS], 1);
    }
    slot[r] = -1;
    // SGD: the sums already carry -lr (factor)
    update_row<DIM>(a.weight + r * D, a.adagrad ? a.momentum + r : nullptr, acc + u * D, D, a.lr, a.eps, 1.0f);
    if (a.touched) a.touched[r] = true;
  }
  return bad;
}

template <int DIM, typename RowT, typename OffT>
void run(const Args& a, const RowT* rows, const OffT* offsets) {
  const float factor = a.adagrad ? 1.0f : -a.lr;
  std::atomic<int64_t> bad{0};
  at::parallel_for(0, a.k, 1, [&](int64_t lo, int64_t hi) {
    thread_local Scratch s;
    for (int64_t f = lo; f < hi; ++f) bad += feature_step<DIM, RowT, OffT>(a, rows, offsets, f, factor, s);
  });
  TORCH_CHECK(bad.load() == 0, "fused_pooled_update: ", bad.load(),
              " looked-up rows lie outside their feature's table (ids not validated?); they were not updated");
}

template <typename RowT, typename OffT>
void dispatch_dim(const Args& a, const RowT* rows, const OffT* offsets) {
  with_dim(a.D, [&](auto dim) { run<decltype(dim)::value, RowT, OffT>(a, rows, offsets); });
}

template <typename RowT>
void dispatch_offsets(const Args& a, const RowT* rows, const c10::optional<at::Tensor>& offsets) {
  if (!offsets.has_value()) {
    dispatch_dim<RowT, int32_t>(a, rows, nullptr);
  } else if (offsets->scalar_type() == at::kInt) {
    dispatch_dim<RowT, int32_t>(a, rows, offsets->data_ptr<int32_t>());
  } else {
    dispatch_dim<RowT, int64_t>(a, rows, offsets->data_ptr<int64_t>());
  }
}

// Forward of one feature: out[b, f * D + d] = sum over the bag's values of w_i * weight[row_i, d], summed in
// value order with a fused multiply-add from 0 (w_i = scale or 1): embedding_bag's sum, written straight into
// the sample-major output (no [k, B, D] -> [B, k * D] transpose).
template <int DIM, typename RowT, typename OffT>
void feature_forward(const float* weight, const RowT* rows, const OffT* offsets, const float* scale, float* out,
                     int64_t ldo, int64_t B, int64_t k, int64_t D_, int64_t f) {
  const int64_t D = DIM > 0 ? DIM : D_;
  float acc[DIM > 0 ? DIM : MAX_DIM];
  const int64_t vend = offsets ? static_cast<int64_t>(offsets[(f + 1) * B]) : 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t begin, end;
    if (offsets) {
      begin = offsets[f * B + b];
      end = offsets[f * B + b + 1];
    } else {
      begin = b * k + f;
      end = begin + 1;
      if (b + PREFETCH < B) __builtin_prefetch(weight + static_cast<int64_t>(rows[(b + PREFETCH) * k + f]) * D);
    }
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
    for (int64_t i = begin; i < end; ++i) {
      if (offsets && i + PREFETCH < vend) __builtin_prefetch(weight + static_cast<int64_t>(rows[i + PREFETCH]) * D);
      const float* x = weight + static_cast<int64_t>(rows[i]) * D;
      const float w = scale ? scale[i] : 1.0f;
      for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(w, x[d], acc[d]);
    }
    float* o = out + b * ldo + f * D;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d];
  }
}

template <int DIM, typename RowT, typename OffT>
void forward_all(const float* weight, const RowT* rows, const OffT* offsets, const float* scale, float* out,
                 int64_t ldo, int64_t B, int64_t k, int64_t D) {
  at::parallel_for(0, k, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t f = lo; f < hi; ++f)
      feature_forward<DIM, RowT, OffT>(weight, rows, offsets, scale, out, ldo, B, k, D, f);
  });
}

template <typename RowT, typename OffT>
void forward_dim(const float* weight, const RowT* rows, const OffT* offsets, const float* scale, float* out,
                 int64_t ldo, int64_t B, int64_t k, int64_t D) {
  with_dim(D, [&](auto dim) {
    forward_all<decltype(dim)::value, RowT, OffT>(weight, rows, offsets, scale, out, ldo, B, k, D);
  });
}

template <typename RowT>
void forward_offsets(const float* weight, const RowT* rows, const c10::optional<at::Tensor>& offsets,
                     const float* scale, float* out, int64_t ldo, int64_t B, int64_t k, int64_t D) {
  if (!offsets.has_value()) {
    forward_dim<RowT, int32_t>(weight, rows, nullptr, scale, out, ldo, B, k, D);
  } else if (offsets->scalar_type() == at::kInt) {
    forward_dim<RowT, int32_t>(weight, rows, offsets->data_ptr<int32_t>(), scale, out, ldo, B, k, D);
  } else {
    forward_dim<RowT, int64_t>(weight, rows, offsets->data_ptr<int64_t>(), scale, out, ldo, B, k, D);
  }
}


// ---- the sharded step (embedding/sharded.py, retrieve design) -----------------------------------------------

// Gradient sums of one pooled lookup over [storage (n rows) | fetch area (R rows)]: value i (feature-major,
// bag j = f * B + b, as a KJT holds them) adds w_i * grad[b, f * D ...] to its row. Storage rows get a slot
// (row -> slot map, first-seen order), fetch-area rows their own row of `fetched` (row pos - n). Every sum
// starts at zero and adds the values in value order (fma with a per-value weight, a plain add without): the
// order and rounding of a stable sort by row and embedding_bag's segment sum (optim.aggregate_row_gradients).
template <int DIM>
int64_t row_sums(const int64_t* pos, int64_t nv, const int64_t* offsets, const float* scale, const float* grad,
                 int64_t ldg, int64_t B, int64_t k, int64_t D_, int64_t n, int64_t R, int32_t* slot, int64_t* urows, float* ugrads,
                 float* fetched) {
  const int64_t D = DIM > 0 ? DIM : D_;
  for (int64_t x = 0; x < R * D; ++x) fetched[x] = 0.f;
  int64_t nu = 0, bad = 0;
  const int64_t nbags = k * B;
  for (int64_t j = 0; j < nbags; ++j) {
    const int64_t f = j / B, b = j - f * B;
    const float* g = grad + b * ldg + f * D;
    const int64_t begin = offsets ? offsets[j] : j, end = offsets ? offsets[j + 1] : j + 1;
    for (int64_t i = begin; i < end; ++i) {
      if (i + PREFETCH < nv) {
        const int64_t q = pos[i + PREFETCH];
        if (q >= 0 && q < n) __builtin_prefetch(slot + q);
      }
      const int64_t r = pos[i];
      float* acc;
      if (r >= n) {
        if (r >= n + R) { ++bad; continue; }
        acc = fetched + (r - n) * D;
      } else if (r >= 0) {
        bool fresh;
        acc = ugrads + claim_slot(slot, r, nu, urows, fresh) * D;
        if (fresh) for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
      } else {
        ++bad;
        continue;
      }
      if (scale) {
        const float w = scale[i];
        for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(w, g[d], acc[d]);
      } else {
        for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + g[d];
      }
    }
  }
  for (int64_t u = 0; u < nu; ++u) slot[urows[u]] = -1;
  TORCH_CHECK(bad == 0, "sharded_row_grad_sums: ", bad, " values read rows outside [0, ", n + R, ")");
  return nu;
}

struct RowList {
  const int64_t* rows;
  const float* grads;
  const int64_t* map;  // rows[i] indexes map (map[x] < 0: skip), or nullptr
  int64_t count, map_size, limit;  // storage rows >= limit are skipped
};

// Sum gradients per storage row over lists (in list order, each list in its order; every sum starts at zero:
// index_add_ / embedding_bag's order), then apply SGD or row-wise Adagrad once per distinct row, as
// optim.sgd_update_ / optim.rowwise_adagrad_update_ compute it. Returns the rows updated.
template <int DIM>
int64_t apply_lists(float* weight, float* momentum, bool* touched, int32_t* slot, int64_t n, int64_t D_,
                    const std::vector<RowList>& lists, bool adagrad, float lr, float eps) {
  const int64_t D = DIM > 0 ? DIM : D_;
  int64_t total = 0;
  for (const auto& l : lists) total += l.count;
  thread_local std::vector<float> acc;
  thread_local std::vector<int64_t> uniq;
  if (static_cast<int64_t>(uniq.size()) < total) uniq.resize(total);
  if (static_cast<int64_t>(acc.size()) < total * D) acc.resize(total * D);
  for (const auto& l : lists) {  // checked before the slot map is touched (it must stay all -1 on an error)
    for (int64_t i = 0; i < l.count; ++i) {
      int64_t r = l.rows[i];
      if (l.map) {
        TORCH_CHECK(r >= 0 && r < l.map_size, "sharded_apply_row_grads: index ", r, " outside its map");
        r = l.map[r];
        if (r < 0) continue;
      }
      TORCH_CHECK(r >= 0 && r < n, "sharded_apply_row_grads: row ", r, " outside the storage of ",
                  n, " rows");
    }
  }
  int64_t nu = 0;
  for (const auto& l : lists) {
    for (int64_t i = 0; i < l.count; ++i) {
      if (i + PREFETCH < l.count && !l.map) {
        const int64_t q = l.rows[i + PREFETCH];
        if (q >= 0 && q < n) __builtin_prefetch(slot + q);
      }
      int64_t r = l.rows[i];
      if (l.map) {
        r = l.map[r];
        if (r < 0) continue;
      }
      if (r >= l.limit) continue;
      bool fresh;
      float* a = acc.data() + claim_slot(slot, r, nu, uniq.data(), fresh) * D;
      if (fresh) for (int64_t d = 0; d < D; ++d) a[d] = 0.f;
      const float* g = l.grads + i * D;
      for (int64_t d = 0; d < D; ++d) a[d] = a[d] + g[d];
    }
  }
  const float* accp = acc.data();
  const int64_t* up = uniq.data();
  at::parallel_for(0, nu, 1024, [&](int64_t lo, int64_t hi) {
    for (int64_t u = lo; u < hi; ++u) {
      const int64_t r = up[u];
      if (u + PREFETCH_ROWS < hi) {
        __builtin_prefetch(weight + up[u + PREFETCH_ROWS] * D, 1);
        if (momentum) __builtin_prefetch(momentum + up[u + PREFETCH_ROWS], 1);
      }
      slot[r] = -1;
      update_row<DIM>(weight + r * D, adagrad ? momentum + r : nullptr, accp + u * D, D, lr, eps, -lr);
      if (touched) touched[r] = true;
    }
  });
  return nu;
}

}  // namespace

// Pooled forward: returns [B, k * D] (feature f at columns f * D ...), B = number of samples. Same inputs
// as fused_pooled_update. check_rows: raise on a row outside the storage (as embedding_bag does); the caller
// may skip it when it validated the ids.
at::Tensor fused_pooled_forward(at::Tensor weight, at::Tensor rows, c10::optional<at::Tensor> offsets,
                                c10::optional<at::Tensor> scale, int64_t B, int64_t k, bool check_rows) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.dim() == 2,
              "fused_pooled_forward: weight must be a contiguous float32 CPU matrix");
  TORCH_CHECK(rows.is_contiguous() && (rows.scalar_type() == at::kInt || rows.scalar_type() == at::kLong),
              "fused_pooled_forward: rows must be contiguous int32/int64");
  const int64_t D = weight.size(1);
  TORCH_CHECK(D >= 1 && D <= MAX_DIM, "fused_pooled_forward: dim must be in [1, ", MAX_DIM, "]");
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->is_contiguous() && offsets->numel() == k * B + 1, "offsets: [k * B + 1]");
  } else {
    TORCH_CHECK(rows.numel() == k * B, "one-hot rows: [B * k]");
  }
  const float* sc = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == rows.numel(),
                "scale: float32 [n]");
    sc = scale->data_ptr<float>();
  }
  at::Tensor out = at::empty({B, k * D}, weight.options());
  if (check_rows && rows.numel() > 0) {
    // embedding_bag raises on a row outside the storage; so does this (one pass, before any read)
    const auto mm = at::aminmax(rows);
    TORCH_CHECK(std::get<0>(mm).item<int64_t>() >= 0 && std::get<1>(mm).item<int64_t>() < weight.size(0),
                "fused_pooled_forward: a row lies outside the storage of ", weight.size(0), " rows");
  }
  if (rows.scalar_type() == at::kInt) {
    forward_offsets<int32_t>(weight.data_ptr<float>(), rows.data_ptr<int32_t>(), offsets, sc,
                             out.data_ptr<float>(), k * D, B, k, D);
  } else {
    forward_offsets<int64_t>(weight.data_ptr<float>(), rows.data_ptr<int64_t>(), offsets, sc,
                             out.data_ptr<float>(), k * D, B, k, D);
  }
  return out;
}

// weight [R, D] float32 contiguous (updated in place); momentum [R] float32 or None (SGD);
// slot [R] int32, all -1 (left all -1); rows [n] int32/int64 flat rows of the group;
// offsets [k * B + 1] int32/int64 (key-major bags f * B + b) or None (one-hot: value b * k + f);
// scale [n] float32 or None; grad [B, >= k * D] float32 with unit column stride (the group's columns,
// feature f at columns f * D ...); touched [R] bool or None; row_lo, row_hi [k] int64: the rows of feature
// f's table (the k features' ranges must not overlap).
void fused_pooled_update(at::Tensor weight, c10::optional<at::Tensor> momentum, at::Tensor slot,
                         at::Tensor rows, c10::optional<at::Tensor> offsets, c10::optional<at::Tensor> scale,
                         at::Tensor grad, c10::optional<at::Tensor> touched, at::Tensor row_lo,
                         at::Tensor row_hi, double lr, double eps) {
  const int64_t k = row_lo.numel();
  TORCH_CHECK(row_lo.scalar_type() == at::kLong && row_hi.scalar_type() == at::kLong && row_lo.is_contiguous() &&
                  row_hi.is_contiguous() && row_hi.numel() == k,
              "fused_pooled_update: row_lo, row_hi: int64 [k]");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.dim() == 2,
              "fused_pooled_update: weight must be a contiguous float32 CPU matrix");
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.dim() == 2 && grad.stride(1) == 1,
              "fused_pooled_update: grad must be float32 [B, cols] with unit column stride");
  TORCH_CHECK(slot.scalar_type() == at::kInt && slot.is_contiguous() && slot.numel() >= weight.size(0),
              "fused_pooled_update: slot must be int32 [num_rows]");
  TORCH_CHECK(rows.is_contiguous() && (rows.scalar_type() == at::kInt || rows.scalar_type() == at::kLong),
              "fused_pooled_update: rows must be contiguous int32/int64");
  Args a;
  a.weight = weight.data_ptr<float>();
  a.momentum = nullptr;
  if (momentum.has_value()) {
    TORCH_CHECK(momentum->scalar_type() == at::kFloat && momentum->is_contiguous(), "momentum: float32");
    a.momentum = momentum->data_ptr<float>();
  }
  a.touched = touched.has_value() ? touched->data_ptr<bool>() : nullptr;
  a.slot = slot.data_ptr<int32_t>();
  a.grad = grad.data_ptr<float>();
  a.ldg = grad.stride(0);
  a.B = grad.size(0);
  a.k = k;
  a.D = weight.size(1);
  TORCH_CHECK(grad.size(1) >= k * a.D, "fused_pooled_update: grad has too few columns");
  TORCH_CHECK(a.D >= 1 && a.D <= MAX_DIM, "fused_pooled_update: dim must be in [1, ", MAX_DIM, "]");
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->is_contiguous() && offsets->numel() == k * a.B + 1, "offsets: [k * B + 1]");
  } else {
    TORCH_CHECK(rows.numel() == k * a.B, "one-hot rows: [B * k]");
  }
  a.scale = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == rows.numel(),
                "scale: float32 [n]");
    a.scale = scale->data_ptr<float>();
  }
  a.row_lo = row_lo.data_ptr<int64_t>();
  a.row_hi = row_hi.data_ptr<int64_t>();
  for (int64_t f = 0; f < k; ++f) {
    TORCH_CHECK(a.row_lo[f] >= 0 && a.row_lo[f] <= a.row_hi[f] && a.row_hi[f] <= weight.size(0),
                "fused_pooled_update: feature ", f, " rows [", a.row_lo[f], ", ", a.row_hi[f], ") outside the storage");
  }
  a.adagrad = a.momentum != nullptr;
  a.lr = static_cast<float>(lr);
  a.eps = static_cast<float>(eps);
  if (rows.scalar_type() == at::kInt) {
    dispatch_offsets<int32_t>(a, rows.data_ptr<int32_t>(), offsets);
  } else {
    dispatch_offsets<int64_t>(a, rows.data_ptr<int64_t>(), offsets);
  }
}

// Sharded step, index conversion (OPER 5.1), part 1: global row ids of a batch's feature-major values,
// gids[i] = base[f] + values[i] for the per_feature[f] values of feature f; with validate, the first value
// outside [0, rows[f]) is returned (gids left partly written), else -1.
int64_t sharded_feature_gids(at::Tensor values, at::Tensor per_feature, at::Tensor base, at::Tensor rows,
                             bool validate, at::Tensor gids) {
  TORCH_CHECK(values.scalar_type() == at::kLong && values.is_contiguous() && gids.scalar_type() == at::kLong &&
                  gids.is_contiguous() && gids.numel() >= values.numel(),
              "sharded_feature_gids: values, gids: int64");
  TORCH_CHECK(per_feature.scalar_type() == at::kLong && base.scalar_type() == at::kLong &&
                  rows.scalar_type() == at::kLong && per_feature.is_contiguous() && base.is_contiguous() &&
                  rows.is_contiguous() && base.numel() == per_feature.numel() && rows.numel() == per_feature.numel(),
              "sharded_feature_gids: per_feature, base, rows: int64 [F]");
  const int64_t F = per_feature.numel(), n = values.numel();
  const int64_t* v = values.data_ptr<int64_t>();
  const int64_t* pf = per_feature.data_ptr<int64_t>();
  const int64_t* bs = base.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  int64_t* g = gids.data_ptr<int64_t>();
  int64_t i = 0;
  for (int64_t f = 0; f < F; ++f) {
    const int64_t end = i + pf[f], b = bs[f], r = rw[f];
    TORCH_CHECK(end <= n, "sharded_feature_gids: per_feature sums past the values");
    if (validate) {
      for (; i < end; ++i) {
        const int64_t x = v[i];
        if (x < 0 || x >= r) return i;
        g[i] = b + x;
      }
    } else {
      for (; i < end; ++i) g[i] = b + v[i];
    }
  }
  TORCH_CHECK(i == n, "sharded_feature_gids: per_feature sums to ", i, ", not to the ", n, " values");
  return -1;
}

// Part 2: each gid's packed code (row_code: int32 or int64, as the address map keeps it), its key (the code
// without the replica bit), whether it is read from another rank than me, and the positions of those values.
// Returns their number.
int64_t sharded_remote_split(at::Tensor gids, at::Tensor row_code, int64_t shift, int64_t key_mask, int64_t me,
                             at::Tensor code, at::Tensor key, at::Tensor remote, at::Tensor ridx) {
  const int64_t n = gids.numel();
  TORCH_CHECK(gids.scalar_type() == at::kLong && gids.is_contiguous(), "sharded_remote_split: gids: int64");
  TORCH_CHECK(code.scalar_type() == at::kLong && key.scalar_type() == at::kLong && ridx.scalar_type() == at::kLong &&
                  remote.scalar_type() == at::kBool && code.is_contiguous() && key.is_contiguous() &&
                  ridx.is_contiguous() && remote.is_contiguous() && code.numel() >= n && key.numel() >= n &&
                  ridx.numel() >= n && remote.numel() >= n,
              "sharded_remote_split: outputs: int64 code, key, ridx and bool remote of [n]");
  TORCH_CHECK(row_code.is_contiguous() && (row_code.scalar_type() == at::kInt || row_code.scalar_type() == at::kLong),
              "sharded_remote_split: row_code: int32 / int64");
  const int64_t G = row_code.numel();
  const int64_t* g = gids.data_ptr<int64_t>();
  int64_t* c = code.data_ptr<int64_t>();
  int64_t* k = key.data_ptr<int64_t>();
  bool* rm = remote.data_ptr<bool>();
  int64_t* ri = ridx.data_ptr<int64_t>();
  int64_t nr = 0;
  auto go = [&](const auto* rc) {
    for (int64_t i = 0; i < n; ++i) {
      if (i + PREFETCH < n) {
        const int64_t q = g[i + PREFETCH];
        if (q >= 0 && q < G) __builtin_prefetch(rc + q);
      }
      const int64_t x = g[i];
      TORCH_CHECK(x >= 0 && x < G, "sharded_remote_split: gid ", x, " outside the map's ", G, " rows");
      const int64_t cc = static_cast<int64_t>(rc[x]);
      const int64_t kk = cc & key_mask;
      c[i] = cc;
      k[i] = kk;
      const bool r = (kk >> shift) != me;
      rm[i] = r;
      if (r) ri[nr++] = i;
    }
  };
  if (row_code.scalar_type() == at::kInt) {
    go(row_code.data_ptr<int32_t>());
  } else {
    go(row_code.data_ptr<int64_t>());
  }
  return nr;
}

// Part 3: the unique remote keys, ascending, and each remote value's index among them: the result of
// torch.unique(key[ridx], sorted=True, return_inverse=True), from a hash table (first-seen ids) and a sort of
// the unique keys only (a batch's remote values repeat: the skew of the data).
std::tuple<at::Tensor, at::Tensor> sharded_remote_unique(at::Tensor key, at::Tensor ridx) {
  TORCH_CHECK(key.scalar_type() == at::kLong && key.is_contiguous() && ridx.scalar_type() == at::kLong &&
                  ridx.is_contiguous(),
              "sharded_remote_unique: key, ridx: int64");
  const int64_t n = ridx.numel(), nk = key.numel();
  const int64_t* k = key.data_ptr<int64_t>();
  const int64_t* ri = ridx.data_ptr<int64_t>();
  int bits = 4;
  while ((int64_t{1} << bits) < 2 * n) ++bits;
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  thread_local std::vector<int64_t> tkeys;
  thread_local std::vector<int32_t> tids, inv;
  thread_local std::vector<std::pair<int64_t, int32_t>> uniq;
  tkeys.resize(mask + 1);
  tids.assign(mask + 1, -1);
  inv.resize(n);
  uniq.clear();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = ri[i];
    TORCH_CHECK(j >= 0 && j < nk, "sharded_remote_unique: index ", j, " outside the ", nk, " keys");
    const int64_t x = k[j];
    uint64_t h = (static_cast<uint64_t>(x) * 0x9E3779B97F4A7C15ull) >> (64 - bits);
    while (tids[h] >= 0 && tkeys[h] != x) h = (h + 1) & mask;
    if (tids[h] < 0) {
      tids[h] = static_cast<int32_t>(uniq.size());
      tkeys[h] = x;
      uniq.emplace_back(x, tids[h]);
    }
    inv[i] = tids[h];
  }
  std::sort(uniq.begin(), uniq.end());
  const int64_t U = static_cast<int64_t>(uniq.size());
  at::Tensor runiq = at::empty({U}, key.options());
  at::Tensor rinv = at::empty({n}, key.options());
  int64_t* ru = runiq.data_ptr<int64_t>();
  thread_local std::vector<int64_t> rank;
  rank.resize(U);
  for (int64_t u = 0; u < U; ++u) {
    ru[u] = uniq[u].first;
    rank[uniq[u].second] = u;
  }
  int64_t* rv = rinv.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) rv[i] = rank[inv[i]];
  return {runiq, rinv};
}

// Part 4: the replica slots a batch's local values read, in ascending storage row (held replicas are the
// storage rows from num_owned on; region_slot maps them to slots).
at::Tensor sharded_local_replicas(at::Tensor key, at::Tensor remote, int64_t num_owned, int64_t off_mask,
                                  at::Tensor region_slot) {
  TORCH_CHECK(key.scalar_type() == at::kLong && key.is_contiguous() && remote.scalar_type() == at::kBool &&
                  remote.is_contiguous() && remote.numel() == key.numel(),
              "sharded_local_replicas: key int64, remote bool, [n]");
  TORCH_CHECK(region_slot.scalar_type() == at::kLong && region_slot.is_contiguous(),
              "sharded_local_replicas: region_slot: int64");
  const int64_t n = key.numel(), held = region_slot.numel();
  const int64_t* k = key.data_ptr<int64_t>();
  const bool* rm = remote.data_ptr<bool>();
  thread_local std::vector<uint8_t> flag;
  flag.assign(held, 0);
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (rm[i]) continue;
    const int64_t off = k[i] & off_mask;
    if (off < num_owned) continue;
    TORCH_CHECK(off - num_owned < held, "sharded_local_replicas: storage row ", off, " past the held replicas");
    count += !flag[off - num_owned];
    flag[off - num_owned] = 1;
  }
  at::Tensor out = at::empty({count}, region_slot.options());
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t* rs = region_slot.data_ptr<int64_t>();
  for (int64_t j = 0, c = 0; j < held; ++j)
    if (flag[j]) o[c++] = rs[j];
  return out;
}

// Sharded step, backward: per-row gradient sums of a pooled lookup over [storage | fetch area] (see row_sums).
// pos [nv] int64 table rows of the values (feature-major bags f * B + b); offsets [k * B + 1] int64 or None
// (one value per bag); scale [nv] float32 or None; grad [B, >= k * D] float32, unit column stride; n storage
// rows; slot [>= n] int32, all -1 (left all -1); urows [>= nv] int64 and ugrads [>= nv, D] float32 receive
// the storage rows read (first-seen order) and their sums; fetched [R, D] float32 receives the fetch-area
// rows' sums. Returns the number of storage rows.
int64_t sharded_row_grad_sums(at::Tensor pos, c10::optional<at::Tensor> offsets, c10::optional<at::Tensor> scale,
                              at::Tensor grad, int64_t B, int64_t k, int64_t n, at::Tensor slot, at::Tensor urows,
                              at::Tensor ugrads, at::Tensor fetched) {
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous(), "sharded_row_grad_sums: pos: int64");
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.dim() == 2 && grad.stride(1) == 1 && grad.size(0) == B,
              "sharded_row_grad_sums: grad must be float32 [B, cols] with unit column stride");
  TORCH_CHECK(fetched.scalar_type() == at::kFloat && fetched.is_contiguous() && fetched.dim() == 2,
              "sharded_row_grad_sums: fetched: float32 [R, D]");
  const int64_t D = fetched.size(1), R = fetched.size(0), nv = pos.numel();
  TORCH_CHECK(D >= 1 && D <= MAX_DIM && grad.size(1) >= k * D, "sharded_row_grad_sums: dims");
  TORCH_CHECK(slot.scalar_type() == at::kInt && slot.is_contiguous() && slot.numel() >= n, "slot: int32 [n]");
  TORCH_CHECK(urows.scalar_type() == at::kLong && urows.is_contiguous() && urows.numel() >= nv, "urows: int64 [nv]");
  TORCH_CHECK(ugrads.scalar_type() == at::kFloat && ugrads.is_contiguous() && ugrads.numel() >= nv * D,
              "ugrads: float32 [nv, D]");
  const int64_t* off = nullptr;
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->scalar_type() == at::kLong && offsets->is_contiguous() && offsets->numel() == k * B + 1,
                "offsets: int64 [k * B + 1]");
    off = offsets->data_ptr<int64_t>();
    TORCH_CHECK(off[k * B] == nv, "offsets end at ", off[k * B], ", not at the ", nv, " values");
  } else {
    TORCH_CHECK(nv == k * B, "one value per bag: pos [k * B]");
  }
  const float* sc = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == nv,
                "scale: float32 [nv]");
    sc = scale->data_ptr<float>();
  }
  auto go = [&](auto tag) {
    constexpr int DIM = decltype(tag)::value;
    return row_sums<DIM>(pos.data_ptr<int64_t>(), nv, off, sc, grad.data_ptr<float>(), grad.stride(0), B, k, D, n, R,
                         slot.data_ptr<int32_t>(), urows.data_ptr<int64_t>(), ugrads.data_ptr<float>(),
                         fetched.data_ptr<float>());
  };
  return with_dim(D, go);
}

// Sharded step, update: lists i of (rows[i] [c] int64, grads[i] [c, D] float32, maps[i]: an int64 map the rows
// index (entries < 0 skipped) or an empty tensor for none, limits[i]: storage rows >= it skipped), summed per
// storage row in list order, then SGD / row-wise Adagrad (momentum given) once per row; touched [n] bool or
// None. slot [>= n] int32, all -1 (left all -1). Returns the rows updated.
int64_t sharded_apply_row_grads(at::Tensor weight, c10::optional<at::Tensor> momentum,
                                c10::optional<at::Tensor> touched, at::Tensor slot, std::vector<at::Tensor> rows,
                                std::vector<at::Tensor> grads, std::vector<at::Tensor> maps,
                                std::vector<int64_t> limits, double lr, double eps) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.dim() == 2,
              "sharded_apply_row_grads: weight must be a contiguous float32 CPU matrix");
  const int64_t n = weight.size(0), D = weight.size(1);
  TORCH_CHECK(D >= 1 && D <= MAX_DIM, "sharded_apply_row_grads: dim must be in [1, ", MAX_DIM, "]");
  TORCH_CHECK(slot.scalar_type() == at::kInt && slot.is_contiguous() && slot.numel() >= n, "slot: int32 [n]");
  TORCH_CHECK(rows.size() == grads.size() && rows.size() == maps.size() && rows.size() == limits.size(),
              "sharded_apply_row_grads: one grads, map and limit per rows list");
  float* mom = nullptr;
  if (momentum.has_value()) {
    TORCH_CHECK(momentum->scalar_type() == at::kFloat && momentum->is_contiguous() && momentum->numel() >= n,
                "momentum: float32 [n]");
    mom = momentum->data_ptr<float>();
  }
  bool* tch = nullptr;
  if (touched.has_value()) {
    TORCH_CHECK(touched->scalar_type() == at::kBool && touched->is_contiguous() && touched->numel() >= n,
                "touched: bool [n]");
    tch = touched->data_ptr<bool>();
  }
  std::vector<RowList> lists;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    const auto& g = grads[i];
    TORCH_CHECK(r.scalar_type() == at::kLong && r.is_contiguous() && r.dim() == 1, "rows: int64 [c]");
    TORCH_CHECK(g.scalar_type() == at::kFloat && g.is_contiguous() && g.numel() == r.numel() * D,
                "grads: float32 [c, D] per rows list");
    TORCH_CHECK(limits[i] >= 0 && limits[i] <= n, "sharded_apply_row_grads: limit ", limits[i], " outside [0, ", n, "]");
    RowList l{r.data_ptr<int64_t>(), g.data_ptr<float>(), nullptr, r.numel(), 0, limits[i]};
    if (maps[i].numel()) {
      TORCH_CHECK(maps[i].scalar_type() == at::kLong && maps[i].is_contiguous(), "maps: int64");
      l.map = maps[i].data_ptr<int64_t>();
      l.map_size = maps[i].numel();
    }
    lists.push_back(l);
  }
  const bool adagrad = mom != nullptr;
  const float flr = static_cast<float>(lr), feps = static_cast<float>(eps);
  float* w = weight.data_ptr<float>();
  int32_t* sl = slot.data_ptr<int32_t>();
  return with_dim(D, [&](auto dim) {
    return apply_lists<decltype(dim)::value>(w, mom, tch, sl, n, D, lists, adagrad, flr, feps);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_pooled_update", &fused_pooled_update, "backward + SGD / row-wise Adagrad of a pooled lookup",
        py::call_guard<py::gil_scoped_release>());
  m.def("fused_pooled_forward", &fused_pooled_forward, "sum-pooled lookup into a sample-major [B, k * D]",
        py::call_guard<py::gil_scoped_release>());
  m.def("sharded_feature_gids", &sharded_feature_gids, "global row ids of feature-major values, checked",
        py::call_guard<py::gil_scoped_release>());
  m.def("sharded_remote_split", &sharded_remote_split, "codes, keys and remote values of a batch's gids",
        py::call_guard<py::gil_scoped_release>());
  m.def("sharded_remote_unique", &sharded_remote_unique, "sorted unique remote keys and the inverse",
        py::call_guard<py::gil_scoped_release>());
  m.def("sharded_local_replicas", &sharded_local_replicas, "replica slots read by local values, ascending",
        py::call_guard<py::gil_scoped_release>());
  m.def("sharded_row_grad_sums", &sharded_row_grad_sums, "per-row gradient sums over [storage | fetch area]",
        py::call_guard<py::gil_scoped_release>());
  m.def("sharded_apply_row_grads", &sharded_apply_row_grads, "per-row sums of gradient lists + optimizer update",
        py::call_guard<py::gil_scoped_release>());
}
