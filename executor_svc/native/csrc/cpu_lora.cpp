// The LoRA deltas of one fused linear layer for every adapter segment of a
// step, in one call (lora_add_).
//
// A step's rows are grouped by adapter (executor_svc/lora/batch.py): segment
// s is rows [start, end) of x [T, K] and out [T, N] under one adapter, whose
// delta on this layer is A [R, K] (its modules' A matrices stacked) and
// B [cols, R] (their B matrices as a block matrix over columns [c0, c1) of
// out, scales folded in), both packed by the panel GEMMs (cpu_gemm.cpp:
// pack_bf16 or pack_f32). Each segment adds
//     out[start:end, c0:c1] += (x[start:end] A^T) B^T.
// The two-GEMM path runs two GEMM calls, a slice and an add per segment and
// layer, each forking the intra-op threads (960 calls a decode step for 8
// adapters on 30 layers). Here the work is split once, over (segment, up to
// 24 rows) items of about equal cost: an item shrinks its rows to t [rows, R]
// (fp32 sums rounded to the dtype, as the first GEMM's output is) in a buffer
// of its own and expands t into its columns, adding in fp32 and rounding
// once. Inside an item the panels are the outer loop and blocks of at most 6
// rows the inner one, so each panel group comes from memory once per item
// (the adapters' weights are what a decode step's deltas mostly wait for)
// and from L1 for the item's other row blocks; bf16 B panels are read only
// as deep as A has ranks (pack_bf16 pads K to 32: a rank-16 B is half
// padding). A row's result depends on no other row (batch-invariant).
//
// bf16 on AVX512-BF16 dot products over the bf16 panels (bf16_dot.h); fp32
// on AVX-512 FMAs over the fp32 panels (64 outputs: 6 rows x 4 vectors of
// accumulators). Builds without them run scalar loops over the same panels:
// correct, slow, and not called by the executor there (it packs bf16
// weights for oneDNN and fp32 ones not at all when these kernels are
// missing, and then runs the two-GEMM path).
#include "bf16_dot.h"
#include "cpu_common.h"

namespace {

using BF16 = c10::BFloat16;

constexpr int64_t kBf16Cols = 16, kBf16Depth = 32;  // pack_bf16: 16-output panels of k-pairs, K padded to 32
constexpr int64_t kF32Cols = 64;                    // pack_f32: 64-output panels, K as is
constexpr int64_t kItemRows = 24;                   // rows of a work item at most
constexpr int64_t kBlockRows = 6;                   // rows of one dot block (6 x 4 panels of accumulators)

// One segment's rows, columns and packed pair.
struct Segment {
  int64_t start, end, col0, col1;
  const void* a;     // A's panels
  const void* b;     // B's panels
  int64_t a_panels;  // panels of A (ceil(R / panel width))
  int64_t depth;     // t's width: B's K (bf16: R padded to 32, of which the dot products read A's panels' ranks)
};

struct Item {
  int64_t segment, row0, rows;
};

// Splits `rows` into equal parts of at most `most` rows (8 rows at most 6: 4 + 4, not 6 + 2); returns the part's
// rows (the last may have fewer).
inline int64_t even_part(int64_t rows, int64_t most) {
  const int64_t parts = (rows + most - 1) / most;
  return (rows + parts - 1) / parts;
}

// Items of at most kItemRows rows, each segment's rows split evenly.
std::vector<Item> split_rows(const std::vector<Segment>& segments) {
  std::vector<Item> items;
  for (int64_t s = 0; s < int64_t(segments.size()); ++s) {
    const int64_t rows = segments[s].end - segments[s].start;
    if (rows <= 0 || segments[s].col1 <= segments[s].col0) continue;
    const int64_t per = even_part(rows, kItemRows);
    for (int64_t r = 0; r < rows; r += per) items.push_back({s, segments[s].start + r, std::min(per, rows - r)});
  }
  return items;
}

#if defined(PAGODA_BF16_DOT)
// 16 bf16 values (mask: the first n) widened to fp32.
PAGODA_INLINE __m512 load_bf16x16(__mmask16 mask, const BF16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// Panel groups (of kDotPanels panels) read ahead into L2.
constexpr int64_t kAheadGroups = 2;

// Before panel group `p`, prefetches into L2 the first `pairs` k-pairs (64-byte lines) of each panel of the group
// kAheadGroups ahead (before the first group, of every group up to it): an adapter's matrices come from memory
// a few KB each, too little for the hardware prefetcher to ramp up.
PAGODA_INLINE void prefetch_ahead(const BF16* panels, int64_t panel_elems, int64_t pairs, int64_t num_panels,
                                  int64_t p) {
  const int64_t from = p == 0 ? pagoda::kDotPanels : p + kAheadGroups * pagoda::kDotPanels;
  const int64_t to = std::min(num_panels, p + (kAheadGroups + 1) * pagoda::kDotPanels);
  for (int64_t q = from; q < to; ++q)
    for (int64_t kk = 0; kk < pairs; ++kk)
      _mm_prefetch(reinterpret_cast<const char*>(panels + q * panel_elems + kk * 2 * kBf16Cols), _MM_HINT_T1);
}

// One item in bf16: x rows ldx apart with K padded to kp (pairs readable), t [rows, depth] scratch.
void bf16_item(const BF16* x, int64_t ldx, int64_t kp, const Segment& s, int64_t row0, int64_t rows, BF16* t,
               BF16* out, int64_t ldo) {
  __m512 acc[pagoda::kDotRows * pagoda::kDotPanels];
  const auto* a = static_cast<const BF16*>(s.a);
  const auto* b = static_cast<const BF16*>(s.b);
  const int64_t block = even_part(rows, kBlockRows);
  for (int64_t p = 0; p < s.a_panels; p += pagoda::kDotPanels) {  // t = x A^T, rounded to bf16
    const int64_t count = std::min<int64_t>(pagoda::kDotPanels, s.a_panels - p);
    prefetch_ahead(a, kp * kBf16Cols, kp / 2, s.a_panels, p);
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
      const int64_t n = std::min(block, rows - r0);
      pagoda::bf16_dot(x + (row0 + r0) * ldx, ldx, n, a + p * kp * kBf16Cols, kp * kBf16Cols, kp / 2, count, acc);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t j = 0; j < count; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + (r0 + r) * s.depth + (p + j) * kBf16Cols),
                              (__m256i)_mm512_cvtneps_pbh(acc[r * count + j]));
    }
  }
  // out += t B^T over the ranks A has: B's K past them is padding (zeros), its lines are never read.
  const int64_t b_panels = (s.col1 - s.col0 + kBf16Cols - 1) / kBf16Cols, panel = s.depth * kBf16Cols;
  const int64_t pairs = s.a_panels * kBf16Cols / 2;
  for (int64_t p = 0; p < b_panels; p += pagoda::kDotPanels) {
    const int64_t count = std::min<int64_t>(pagoda::kDotPanels, b_panels - p);
    prefetch_ahead(b, panel, pairs, b_panels, p);
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
      const int64_t n = std::min(block, rows - r0);
      pagoda::bf16_dot(t + r0 * s.depth, s.depth, n, b + p * panel, panel, pairs, count, acc);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t col = s.col0 + (p + j) * kBf16Cols, cols = std::min(kBf16Cols, s.col1 - col);
        const __mmask16 mask = cols == 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
        for (int64_t r = 0; r < n; ++r) {
          BF16* o = out + (row0 + r0 + r) * ldo + col;
          const __m512 sum = _mm512_add_ps(load_bf16x16(mask, o), acc[r * count + j]);
          _mm256_mask_storeu_epi16(o, mask, (__m256i)_mm512_cvtneps_pbh(sum));
        }
      }
    }
  }
}
#else
// Element (n, k) of a matrix [N, K] packed by pack_bf16 (K padded to kp).
inline float bf16_panel_at(const BF16* panels, int64_t kp, int64_t n, int64_t k) {
  const int64_t panel = n / kBf16Cols, lane = n % kBf16Cols;
  return pagoda::to_float(panels[panel * kp * kBf16Cols + (k / 2) * 2 * kBf16Cols + lane * 2 + k % 2]);
}

// One item in bf16 by scalar loops over the panels (x: K columns, ldx apart; kp: A's padded K).
void bf16_item(const BF16* x, int64_t ldx, int64_t kp, const Segment& s, int64_t row0, int64_t rows, BF16* t,
               BF16* out, int64_t ldo, int64_t k_size) {
  const auto* a = static_cast<const BF16*>(s.a);
  const auto* b = static_cast<const BF16*>(s.b);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < s.depth; ++j) {
      float sum = 0.f;
      if (j < s.a_panels * kBf16Cols)
        for (int64_t k = 0; k < k_size; ++k)
          sum += pagoda::to_float(x[(row0 + r) * ldx + k]) * bf16_panel_at(a, kp, j, k);
      t[r * s.depth + j] = BF16(sum);
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = s.col0; c < s.col1; ++c) {
      float sum = 0.f;
      for (int64_t j = 0; j < s.depth; ++j)
        sum += pagoda::to_float(t[r * s.depth + j]) * bf16_panel_at(b, s.depth, c - s.col0, j);
      BF16& o = out[(row0 + r) * ldo + c];
      o = BF16(pagoda::to_float(o) + sum);
    }
}
#endif

#if defined(__AVX512F__)
// acc[r * 4 + j] = sum over k < k_size of x[r, k] * panel[k, 16 j : 16 j + 16] for r < ROWS.
template <int ROWS>
PAGODA_INLINE void f32_block(const float* x, int64_t ldx, const float* panel, int64_t k_size, __m512* acc) {
  __m512 sum[ROWS][4];
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const float* w = panel + k * kF32Cols;
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32),
                 w3 = _mm512_loadu_ps(w + 48);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
      const __m512 v = _mm512_set1_ps(x[r * ldx + k]);
      sum[r][0] = _mm512_fmadd_ps(v, w0, sum[r][0]);
      sum[r][1] = _mm512_fmadd_ps(v, w1, sum[r][1]);
      sum[r][2] = _mm512_fmadd_ps(v, w2, sum[r][2]);
      sum[r][3] = _mm512_fmadd_ps(v, w3, sum[r][3]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) acc[r * 4 + j] = sum[r][j];
}

void f32_rows(const float* x, int64_t ldx, int64_t rows, const float* panel, int64_t k_size, __m512* acc) {
  switch (rows) {
    case 6: f32_block<6>(x, ldx, panel, k_size, acc); break;
    case 5: f32_block<5>(x, ldx, panel, k_size, acc); break;
    case 4: f32_block<4>(x, ldx, panel, k_size, acc); break;
    case 3: f32_block<3>(x, ldx, panel, k_size, acc); break;
    case 2: f32_block<2>(x, ldx, panel, k_size, acc); break;
    default: f32_block<1>(x, ldx, panel, k_size, acc); break;
  }
}

PAGODA_INLINE __mmask16 first(int64_t n) {
  return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// One item in fp32: x [rows, k_size] ldx apart, t [rows, depth] scratch.
void f32_item(const float* x, int64_t ldx, int64_t k_size, const Segment& s, int64_t row0, int64_t rows, float* t,
              float* out, int64_t ldo) {
  __m512 acc[kBlockRows * 4];
  const auto* a = static_cast<const float*>(s.a);
  const auto* b = static_cast<const float*>(s.b);
  const int64_t block = even_part(rows, kBlockRows);
  for (int64_t p = 0; p < s.a_panels; ++p) {  // t = x A^T
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
      const int64_t n = std::min(block, rows - r0);
      f32_rows(x + (row0 + r0) * ldx, ldx, n, a + p * k_size * kF32Cols, k_size, acc);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t j = 0; j < 4; ++j)
          _mm512_mask_storeu_ps(t + (r0 + r) * s.depth + p * kF32Cols + 16 * j,
                                first(s.depth - p * kF32Cols - 16 * j), acc[r * 4 + j]);
    }
  }
  const int64_t b_panels = (s.col1 - s.col0 + kF32Cols - 1) / kF32Cols;
  for (int64_t p = 0; p < b_panels; ++p) {  // out += t B^T
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
      const int64_t n = std::min(block, rows - r0);
      f32_rows(t + r0 * s.depth, s.depth, n, b + p * s.depth * kF32Cols, s.depth, acc);
      for (int64_t j = 0; j < 4; ++j) {
        const int64_t col = s.col0 + p * kF32Cols + 16 * j;
        const __mmask16 mask = first(s.col1 - col);
        if (!mask) break;
        for (int64_t r = 0; r < n; ++r) {
          float* o = out + (row0 + r0 + r) * ldo + col;
          _mm512_mask_storeu_ps(o, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), acc[r * 4 + j]));
        }
      }
    }
  }
}
#else
// One item in fp32 by scalar loops over the panels.
void f32_item(const float* x, int64_t ldx, int64_t k_size, const Segment& s, int64_t row0, int64_t rows, float* t,
              float* out, int64_t ldo) {
  const auto* a = static_cast<const float*>(s.a);
  const auto* b = static_cast<const float*>(s.b);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < s.depth; ++j) {
      float sum = 0.f;
      for (int64_t k = 0; k < k_size; ++k)
        sum += x[(row0 + r) * ldx + k] * a[(j / kF32Cols) * k_size * kF32Cols + k * kF32Cols + j % kF32Cols];
      t[r * s.depth + j] = sum;
    }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = s.col0; c < s.col1; ++c) {
      const int64_t n = c - s.col0;
      float sum = 0.f;
      for (int64_t j = 0; j < s.depth; ++j)
        sum += t[r * s.depth + j] * b[(n / kF32Cols) * s.depth * kF32Cols + j * kF32Cols + n % kF32Cols];
      out[(row0 + r) * ldo + c] += sum;
    }
}
#endif

// The segments of `bounds` (first row, end row, first column, end column per segment) with their packed pairs,
// checked against x [T, K], out [T, N] and the panel layout of x's dtype.
std::vector<Segment> check_segments(const at::Tensor& out, const at::Tensor& x, at::TensorList a, at::TensorList b,
                                    at::IntArrayRef bounds) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t t = x.size(0), k = x.size(1), n = out.size(1), width = bf16 ? kBf16Cols : kF32Cols;
  const int64_t kp = (k + kBf16Depth - 1) / kBf16Depth * kBf16Depth;
  TORCH_CHECK(int64_t(a.size()) == int64_t(b.size()) && int64_t(bounds.size()) == 4 * int64_t(a.size()),
              "lora_add_: one A, one B and four bounds per segment");
  std::vector<Segment> segments;
  for (size_t s = 0; s < a.size(); ++s) {
    const int64_t start = bounds[4 * s], end = bounds[4 * s + 1], col0 = bounds[4 * s + 2], col1 = bounds[4 * s + 3];
    TORCH_CHECK(0 <= start && start <= end && end <= t, "lora_add_: segment ", s, " rows [", start, ", ", end,
                ") outside ", t, " rows");
    TORCH_CHECK(0 <= col0 && col0 <= col1 && col1 <= n, "lora_add_: segment ", s, " columns [", col0, ", ", col1,
                ") outside ", n, " columns");
    const at::Tensor &pa = a[s], &pb = b[s];
    TORCH_CHECK(pa.scalar_type() == x.scalar_type() && pb.scalar_type() == x.scalar_type() && pa.is_contiguous() &&
                    pb.is_contiguous(),
                "lora_add_: segment ", s, "'s panels must be contiguous and of x's dtype");
    const int64_t b_panels = (col1 - col0 + width - 1) / width;
    int64_t depth;
    if (bf16) {
      TORCH_CHECK(pa.dim() == 4 && pa.size(1) * 2 == kp && pa.size(2) == kBf16Cols && pa.size(3) == 2,
                  "lora_add_: segment ", s, "'s A must come from pack_bf16 of [R, ", k, "]");
      TORCH_CHECK(pb.dim() == 4 && pb.size(0) == b_panels && pb.size(2) == kBf16Cols && pb.size(3) == 2,
                  "lora_add_: segment ", s, "'s B must come from pack_bf16 of [", col1 - col0, ", R]");
      depth = pb.size(1) * 2;
      TORCH_CHECK(pa.size(0) * kBf16Cols <= depth, "lora_add_: segment ", s, "'s A has more ranks than its B");
    } else {
      TORCH_CHECK(pa.dim() == 3 && pa.size(1) == k && pa.size(2) == kF32Cols, "lora_add_: segment ", s,
                  "'s A must come from pack_f32 of [R, ", k, "]");
      TORCH_CHECK(pb.dim() == 3 && pb.size(0) == b_panels && pb.size(2) == kF32Cols, "lora_add_: segment ", s,
                  "'s B must come from pack_f32 of [", col1 - col0, ", R]");
      depth = pb.size(1);
      TORCH_CHECK(depth > (pa.size(0) - 1) * kF32Cols && depth <= pa.size(0) * kF32Cols, "lora_add_: segment ", s,
                  "'s A and B differ in rank");
    }
    segments.push_back({start, end, col0, col1, pa.data_ptr(), pb.data_ptr(), pa.size(0), depth});
  }
  return segments;
}

}  // namespace

// out [T, N] (bf16 or fp32, rows may be strided) += for each segment (4 bounds: rows [start, end), columns
// [c0, c1)): (x[start:end] A^T) B^T into out[start:end, c0:c1], A and B packed by pack_bf16 / pack_f32 in
// x's dtype (A [R, K], B [c1 - c0, R]). Rows of no segment are left as they are.
void lora_add_(at::Tensor out, const at::Tensor& x, at::TensorList a, at::TensorList b, at::IntArrayRef bounds) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.device().is_cpu() &&
                  out.device().is_cpu(),
              "lora_add_: x [T, K] and out [T, N] must be 2-D CPU tensors of the same rows");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "lora_add_: x and out must both be bfloat16 or both float32");
  TORCH_CHECK(out.stride(1) == 1, "lora_add_: out's rows must be contiguous");
  const std::vector<Segment> segments = check_segments(out, x, a, b, bounds);
  const std::vector<Item> items = split_rows(segments);
  if (items.empty()) return;
  const int64_t k = x.size(1), ldo = out.stride(0);
  int64_t depth = 1;
  for (const Segment& s : segments) depth = std::max(depth, s.depth);
  auto cost = [&](int64_t i) {
    const Segment& s = segments[items[i].segment];
    return items[i].rows * (k + s.col1 - s.col0) * s.depth + 1;
  };
  if (x.scalar_type() == at::kBFloat16) {
    // The dot blocks read k-pairs up to K padded to 32: x is copied when it is not laid out so.
    const int64_t kp = (k + kBf16Depth - 1) / kBf16Depth * kBf16Depth;
    at::Tensor xk = x;
#if defined(PAGODA_BF16_DOT)
    if (x.stride(1) != 1 || kp != k) {
      xk = at::zeros({x.size(0), kp}, x.options());
      xk.slice(1, 0, k).copy_(x);
    }
#else
    if (x.stride(1) != 1) xk = x.contiguous();
#endif
    const BF16* xd = xk.data_ptr<BF16>();
    BF16* od = out.data_ptr<BF16>();
    const int64_t ldx = xk.stride(0);
    pagoda::parallel_for_balanced(int64_t(items.size()), cost, [&](int64_t begin, int64_t end) {
      std::vector<BF16> t(kItemRows * depth);
      for (int64_t i = begin; i < end; ++i) {
        const Item& item = items[i];
#if defined(PAGODA_BF16_DOT)
        bf16_item(xd, ldx, kp, segments[item.segment], item.row0, item.rows, t.data(), od, ldo);
#else
        bf16_item(xd, ldx, kp, segments[item.segment], item.row0, item.rows, t.data(), od, ldo, k);
#endif
      }
    });
    return;
  }
  const at::Tensor xk = x.stride(1) == 1 ? x : x.contiguous();
  const float* xd = xk.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t ldx = xk.stride(0);
  pagoda::parallel_for_balanced(int64_t(items.size()), cost, [&](int64_t begin, int64_t end) {
    std::vector<float> t(kItemRows * depth);
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      f32_item(xd, ldx, k, segments[item.segment], item.row0, item.rows, t.data(), od, ldo);
    }
  });
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("lora_add_", &lora_add_); }
