// Shared pieces of the CPU paged decode kernel (cpu_kernel.cpp): types,
// constants, the per-call job description and per-thread scratch.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define PAGODA_INLINE inline __attribute__((always_inline))
#else
#define PAGODA_INLINE inline
#endif

namespace {

using BF16 = c10::BFloat16;
constexpr int64_t kTile = 16;         // positions per online-softmax step
constexpr int64_t kPrefetchRows = 16;  // how far ahead of the tile rows are prefetched
constexpr float kNegBig = -1e30f;     // "minus infinity" that stays finite under -ffast-math
constexpr int64_t kMinSplit = 256;    // fewest positions worth a split of their own
constexpr int64_t kMaxSplits = 16;

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Shapes and pointers shared by every work item of one call.
struct Job {
  int64_t num_heads, num_kv_heads, head_dim, group, block_size, num_blocks, max_blocks;
  const int64_t* block_tables;  // [S, max_blocks]
  const int64_t* context_lens;  // [S]
  float scale;
  int64_t window;
  bool permuted;   // fp32 rows in even/odd lane order (see widen_row)
  bool bf16_dot;   // scores by vdpbf16ps from a bf16 query
};

// Online-softmax state of one item (or one split of it): [G] max, [G] sum, [G, D] acc.
struct State {
  float* row_max;
  float* row_sum;
  float* acc;
};

// Per-thread scratch, 64-byte aligned: widened K and V tiles [kTile, D] each,
// probabilities [G, kTile], the group's queries [G, D] (fp32, or bf16 for bf16_dot).
struct Scratch {
  Scratch(int64_t group, int64_t head_dim)
      : head_dim(head_dim), buffer(2 * kTile * head_dim + group * kTile + group * head_dim + 16, 0.f) {
    auto address = reinterpret_cast<uintptr_t>(buffer.data());
    base = buffer.data() + ((64 - address % 64) % 64) / sizeof(float);
  }
  float* keys() { return base; }
  float* values() { return base + kTile * head_dim; }
  float* probs() { return base + 2 * kTile * head_dim; }
  float* query(int64_t group) { return probs() + group * kTile; }
  int64_t head_dim;
  std::vector<float> buffer;
  float* base;
};

// Position of dim d in the even/odd order: per 32 dims, the 16 even ones then the 16 odd ones.
inline int64_t lane_of(int64_t d, bool permuted) {
  return permuted ? (d & ~int64_t(31)) + (d & 1) * 16 + (d & 31) / 2 : d;
}

template <typename C>
inline void prefetch_row(const C* row, int64_t head_dim) {
#if defined(__GNUC__)
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < head_dim * int64_t(sizeof(C)); offset += 64) __builtin_prefetch(p + offset);
#endif
}

// Walks positions of one sequence's paged rows (a cursor into its block table).
struct RowCursor {
  const int64_t* table;
  int64_t block_size, block, offset;
  int64_t row() const { return table[block] * block_size + offset; }
  void advance() {
    if (++offset == block_size) { offset = 0; ++block; }
  }
};

}  // namespace
