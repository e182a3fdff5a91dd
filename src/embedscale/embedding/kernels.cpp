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

#include <atomic>
#include <cmath>
#include <cstdint>
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
      int32_t sl = slot[r];
      if (sl < 0) {
        sl = static_cast<int32_t>(nu);
        slot[r] = sl;
        uniq[nu++] = r;
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
    const float* gr = acc + u * D;
    float* wr = a.weight + r * D;
    if (a.adagrad) {
      const float sq = sum_of_squares<DIM>(gr, D);
      const float m = a.momentum[r] + sq / static_cast<float>(D);
      a.momentum[r] = m;
      const float mult = (1.0f / (std::sqrt(m) + a.eps)) * (-a.lr);  // std::sqrt: correctly rounded
      for (int64_t d = 0; d < D; ++d) wr[d] += gr[d] * mult;
    } else {
      for (int64_t d = 0; d < D; ++d) wr[d] += gr[d];
    }
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
  switch (a.D) {
    case 16: run<16, RowT, OffT>(a, rows, offsets); break;
    case 32: run<32, RowT, OffT>(a, rows, offsets); break;
    case 64: run<64, RowT, OffT>(a, rows, offsets); break;
    case 128: run<128, RowT, OffT>(a, rows, offsets); break;
    default: run<0, RowT, OffT>(a, rows, offsets);
  }
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
  switch (D) {
    case 16: forward_all<16, RowT, OffT>(weight, rows, offsets, scale, out, ldo, B, k, D); break;
    case 32: forward_all<32, RowT, OffT>(weight, rows, offsets, scale, out, ldo, B, k, D); break;
    case 64: forward_all<64, RowT, OffT>(weight, rows, offsets, scale, out, ldo, B, k, D); break;
    case 128: forward_all<128, RowT, OffT>(weight, rows, offsets, scale, out, ldo, B, k, D); break;
    default: forward_all<0, RowT, OffT>(weight, rows, offsets, scale, out, ldo, B, k, D);
  }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_pooled_update", &fused_pooled_update, "backward + SGD / row-wise Adagrad of a pooled lookup");
  m.def("fused_pooled_forward", &fused_pooled_forward, "sum-pooled lookup into a sample-major [B, k * D]");
}
