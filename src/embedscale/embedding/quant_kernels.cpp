// Fused CPU pooled lookup straight from row-wise quantized rows (embedscale serving).
//
// One call pools every feature of a batch over its table's stored rows, in parallel over (feature, sample bags):
// a row of an INT8 / INT4 table is FBGEMM's fused row (FloatToFusedNBitRowwiseQuantizedSBHalf): dim * bits / 8
// bytes of unsigned values (INT4: two a byte, the even column in the low nibble), then an fp16 scale and an fp16
// bias; an FP16 (FP32) table is dim halves (floats) a row. A value x = scale * q + bias is never written out: each looked-up
// row adds (w * scale) * q to the bag's accumulator in registers (one fused multiply-add a value; AVX2 widens 8
// values at a time) and w * bias to the bag's bias sum, added to every column at the end (w the per-id weight,
// 1 without; FBGEMM's kernel does the same), and the bag's sum (or mean: divided by its length; empty bags give zeros) lands in the sample-major output
// [B, sum of feature dims] at the feature's columns. Ids outside the table are reported, never read.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int64_t MAX_DIM = 1024;
constexpr int64_t PREFETCH = 48;  // ids ahead whose rows are prefetched (random rows miss the caches)

struct Feature {
  const uint8_t* rows;   // the table's stored bytes, row-major
  int64_t row_bytes;     // bytes a row
  int64_t num_rows;
  int64_t dim;
  int64_t bits;          // 4, 8, 16 (fp16 rows) or 32 (fp32 rows)
  const int64_t* ids;
  const int64_t* offsets;  // [B + 1]
  int64_t num_bags;        // B
  const float* weights;    // per id, or nullptr
  bool mean;
  int64_t col;             // first output column
};

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// acc += a * q over a row's values (the row's w * bias is summed apart, once a bag: see pool_bag).
template <int DIM>
inline void add_int8(float* __restrict acc, const uint8_t* __restrict q, float a, int64_t D) {
  const int64_t n = DIM > 0 ? DIM : D;
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 va = _mm256_set1_ps(a);
  for (; d + 8 <= n; d += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + d));
    const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(va, x, _mm256_loadu_ps(acc + d)));
  }
#endif
  for (; d < n; ++d) acc[d] = std::fma(a, static_cast<float>(q[d]), acc[d]);
}

template <int DIM>
inline void add_int4(float* __restrict acc, const uint8_t* __restrict q, float a, int64_t D) {
  const int64_t n = DIM > 0 ? DIM : D;
  int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 va = _mm256_set1_ps(a);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (; d + 8 <= n; d += 8) {  // 4 bytes: 8 values, the even column in the low nibble
    int32_t four;
    std::memcpy(&four, q + d / 2, sizeof(four));
    const __m128i b = _mm_cvtsi32_si128(four);
    const __m128i even = _mm_and_si128(b, low), odd = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(even, odd)));
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(va, x, _mm256_loadu_ps(acc + d)));
  }
#endif
  for (; d < n; d += 2) {
    acc[d] = std::fma(a, static_cast<float>(q[d / 2] & 0xF), acc[d]);
    acc[d + 1] = std::fma(a, static_cast<float>(q[d / 2] >> 4), acc[d + 1]);
  }
}

template <int DIM>
inline void add_fp32(float* __restrict acc, const uint8_t* __restrict q, float w, int64_t D) {
  const int64_t n = DIM > 0 ? DIM : D;
  const float* x = reinterpret_cast<const float*>(q);
  for (int64_t d = 0; d < n; ++d) acc[d] += w * x[d];
}

template <int DIM>
inline void add_fp16(float* __restrict acc, const uint8_t* __restrict q, float w, int64_t D) {
  const int64_t n = DIM > 0 ? DIM : D;
  const c10::Half* h = reinterpret_cast<const c10::Half*>(q);
  for (int64_t d = 0; d < n; ++d) acc[d] += w * static_cast<float>(h[d]);
}

// Bags [b0, b1) of one feature of BITS-bit rows into the output (row stride cols). Returns false on an id outside
// the table. BITS and DIM are template arguments: the per-value loop has no branch and a fixed trip count.
template <int BITS, int DIM>
bool pool_bags(const Feature& f, int64_t b0, int64_t b1, float* __restrict out, int64_t cols) {
  const int64_t D = DIM > 0 ? DIM : f.dim;
  const int64_t data_bytes = D * BITS / 8, end = f.offsets[f.num_bags];
  float acc[DIM > 0 ? DIM : MAX_DIM];
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
    const int64_t lo = f.offsets[b], hi = f.offsets[b + 1];
    float bias_sum = 0.f;  // sum of w * bias over the bag's rows, added to every column at the end
    for (int64_t i = lo; i < hi; ++i) {
      if (i + PREFETCH < end) {
        const int64_t ahead = f.ids[i + PREFETCH];
        if (ahead >= 0 && ahead < f.num_rows) __builtin_prefetch(f.rows + ahead * f.row_bytes, 0, 0);
      }
      const int64_t r = f.ids[i];
      if (r < 0 || r >= f.num_rows) return false;
      const uint8_t* row = f.rows + r * f.row_bytes;
      const float w = f.weights ? f.weights[i] : 1.f;
      if constexpr (BITS == 32) {
        add_fp32<DIM>(acc, row, w, D);
      } else if constexpr (BITS == 16) {
        add_fp16<DIM>(acc, row, w, D);
      } else {
        const float scale = half_at(row + data_bytes), bias = half_at(row + data_bytes + 2);
        bias_sum = std::fma(w, bias, bias_sum);
        if constexpr (BITS == 8) add_int8<DIM>(acc, row, w * scale, D);
        else add_int4<DIM>(acc, row, w * scale, D);
      }
    }
    const float inv = (f.mean && hi > lo) ? 1.f / static_cast<float>(hi - lo) : 1.f;
    float* o = out + b * cols + f.col;
    for (int64_t d = 0; d < D; ++d) o[d] = f.mean ? (acc[d] + bias_sum) * inv : acc[d] + bias_sum;
  }
  return true;
}

template <int BITS>
bool pool_dim(const Feature& f, int64_t b0, int64_t b1, float* out, int64_t cols) {
  switch (f.dim) {
    case 8: return pool_bags<BITS, 8>(f, b0, b1, out, cols);
    case 16: return pool_bags<BITS, 16>(f, b0, b1, out, cols);
    case 32: return pool_bags<BITS, 32>(f, b0, b1, out, cols);
    case 64: return pool_bags<BITS, 64>(f, b0, b1, out, cols);
    case 128: return pool_bags<BITS, 128>(f, b0, b1, out, cols);
    default: return pool_bags<BITS, 0>(f, b0, b1, out, cols);
  }
}

bool pool_range(const Feature& f, int64_t b0, int64_t b1, float* out, int64_t cols) {
  switch (f.bits) {
    case 4: return pool_dim<4>(f, b0, b1, out, cols);
    case 8: return pool_dim<8>(f, b0, b1, out, cols);
    case 16: return pool_dim<16>(f, b0, b1, out, cols);
    default: return pool_dim<32>(f, b0, b1, out, cols);
  }
}

Feature feature_of(const torch::Tensor& table, int64_t bits, int64_t dim, const torch::Tensor& ids,
                   const torch::Tensor& offsets, const torch::Tensor& weights, bool mean, int64_t col, int64_t B) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.device().is_cpu(), "table: contiguous 2-d on CPU");
  TORCH_CHECK(bits == 4 || bits == 8 || bits == 16 || bits == 32, "bits must be 4, 8, 16 or 32, got ", bits);
  TORCH_CHECK(dim > 0 && dim <= MAX_DIM && (bits != 4 || dim % 2 == 0), "dim ", dim, " not supported at ", bits, " bits");
  const int64_t row_bytes = table.size(1) * table.element_size();
  const int64_t want = bits >= 16 ? dim * bits / 8 : dim * bits / 8 + 4;
  TORCH_CHECK(row_bytes == want, "a row holds ", row_bytes, " bytes, ", want, " expected at dim ", dim, ", ", bits,
              " bits");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.is_contiguous(), "ids: contiguous int64");
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && offsets.is_contiguous() && offsets.numel() == B + 1,
              "offsets: contiguous int64 [B + 1]");
  const bool weighted = weights.defined() && weights.numel() > 0;
  if (weighted) TORCH_CHECK(weights.scalar_type() == torch::kFloat32 && weights.numel() == ids.numel(),
                            "weights: float32, one per id");
  return Feature{reinterpret_cast<const uint8_t*>(table.data_ptr()), row_bytes, table.size(0), dim, bits,
                 ids.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), B,
                 weighted ? weights.data_ptr<float>() : nullptr, mean, col};
}

}  // namespace

// tables[t]; per feature f: its table feature_table[f], ids[f], offsets[f] ([B + 1]), weights[f] (empty: none),
// mean[f]. Returns float32 [B, sum of the features' dims], the features' columns in the order given.
torch::Tensor quantized_pooled_forward(const std::vector<torch::Tensor>& tables, const std::vector<int64_t>& bits,
                                       const std::vector<int64_t>& dims, const std::vector<int64_t>& feature_table,
                                       const std::vector<torch::Tensor>& ids,
                                       const std::vector<torch::Tensor>& offsets,
                                       const std::vector<torch::Tensor>& weights, const std::vector<bool>& mean,
                                       int64_t B) {
  const int64_t F = static_cast<int64_t>(feature_table.size());
  TORCH_CHECK(ids.size() == static_cast<size_t>(F) && offsets.size() == static_cast<size_t>(F) &&
              weights.size() == static_cast<size_t>(F) && mean.size() == static_cast<size_t>(F),
              "one ids, offsets, weights and mean entry per feature");
  TORCH_CHECK(bits.size() == tables.size() && dims.size() == tables.size(), "one bits and dim entry per table");
  std::vector<Feature> fs;
  int64_t cols = 0;
  for (int64_t f = 0; f < F; ++f) {
    const int64_t t = feature_table[f];
    TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(tables.size()), "feature ", f, ": no table ", t);
    fs.push_back(feature_of(tables[t], bits[t], dims[t], ids[f], offsets[f], weights[f], mean[f], cols, B));
    cols += dims[t];
  }
  auto out = torch::empty({B, cols}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  std::atomic<int64_t> bad{-1};
  {
    pybind11::gil_scoped_release release;
    at::parallel_for(0, F * B, 256, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end;) {  // runs of one feature's bags
        const int64_t f = k / B, b0 = k % B, b1 = std::min(B, b0 + (end - k));
        if (!pool_range(fs[f], b0, b1, o, cols)) {
          int64_t none = -1;
          bad.compare_exchange_strong(none, f);
        }
        k += b1 - b0;
      }
    });
  }
  TORCH_CHECK(bad.load() < 0, "feature ", bad.load(), ": a row id outside its table");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_pooled_forward", &quantized_pooled_forward,
        "pooled lookup of every feature straight from INT8 / INT4 / FP16 / FP32 rows into a sample-major [B, sum dims]");
}
