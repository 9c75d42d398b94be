// Shared pieces of the CPU paged decode kernel (cpu_kernel.cpp): types,
// constants, the per-call job description and per-thread scratch.
//
// An int8 cache (C = int8_t) holds each (token, kv head) row quantized, with
// one fp32 scale per row in a tensor beside it ([KVH, NB, BS], the cache's
// row index): row = q * scale. The kernel applies the scales itself: a K
// scale multiplies the row's score, a V scale the row's probability.
#pragma once
#include <algorithm>
#include <atomic>
#include <exception>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#include "cpu_common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pagoda::parallel_for;
using BF16 = c10::BFloat16;
constexpr int64_t kTile = 16;         // positions per online-softmax step
constexpr int64_t kPrefetchRows = 16;  // how far ahead of the tile rows are prefetched
using pagoda::kNegBig;
constexpr int64_t kMinSplit = 256;    // fewest positions worth a split of their own
constexpr int64_t kMaxSplits = 16;

using pagoda::to_float;
inline float to_float(int8_t x) { return static_cast<float>(x); }

// Shapes and pointers shared by every work item of one call.
struct Job {
  int64_t num_heads, num_kv_heads, head_dim, group, block_size, num_blocks, max_blocks;
  const int64_t* block_tables;  // [S, max_blocks]
  const int64_t* context_lens;  // [S]
  float scale;
  int64_t window;
  float softcap;  // scores become softcap * tanh(score / softcap); 0: not capped
  int lanes;  // Lanes: dim order of the fp32 accumulators (and fp32 queries)
  const float* k_scales = nullptr;  // [KVH, NB * BS] scales of an int8 cache's rows (else nullptr)
  const float* v_scales = nullptr;
  // Whether decode may split a sequence's KV axis over threads when the batch is small (partial softmaxes
  // merged at the end). A split changes how a row rounds with the batch beside it; off (batch-invariant
  // serving): every row is one pass over its keys, the same at any batch and as a row of a prefill chunk.
  bool split_kv = true;
};

// One kv head's paged rows [NB * BS, D] and, for an int8 cache, their scales [NB * BS] (else nullptr).
template <typename C>
struct HeadRows {
  const C* k;
  const C* v;
  const float* k_scale;
  const float* v_scale;
};

template <typename C>
constexpr bool kQuantized = std::is_same_v<C, int8_t>;

// Online-softmax state of one item (or one split of it): [G] max, [G] sum, [G, D] acc.
struct State {
  float* row_max;
  float* row_sum;
  float* acc;
};

// Per-thread scratch, 64-byte aligned: widened K and V tiles [kTile, D] each,
// probabilities [G, kTile], the group's queries [G, D] (fp32).
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

// Dim orders of fp32 rows. kEvenOdd (widened bf16 rows): per 32 dims, the 16
// even ones then the 16 odd ones.
enum Lanes { kNatural, kEvenOdd };

// Position of dim d in the given order.
inline int64_t lane_of(int64_t d, int lanes) {
  const int64_t base = d & ~int64_t(31), r = d & 31;
  switch (lanes) {
    case kEvenOdd: return base + (r & 1) * 16 + r / 2;
    default: return d;
  }
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

// Walks positions [lo, hi) of one sequence in tiles of kTile, prefetching K and
// V rows (and an int8 cache's scales, a 64-byte line at a time) up to
// kPrefetchRows ahead. next() fills the tile's row offsets (elements into a
// head; rows past the count repeat the last one) and returns the count, 0 at
// the end. By default next() prefetches the rows up to kPrefetchRows past the
// tile at once; a kernel that calls prefetch_one() once per row it consumes
// (interleaved, so that the misses in flight do not fill the line buffers and
// stall the core) constructs it with `lead` 0, and next() then only catches up
// with the tile itself.
template <typename C>
struct TileWalker {
  TileWalker(const Job& job, HeadRows<C> head, const int64_t* table, int64_t lo, int64_t hi,
             int64_t lead = kPrefetchRows)
      : head(head), head_dim(job.head_dim), pos(lo), hi(hi), ahead_pos(lo), lead(lead),
        cursor{table, job.block_size, lo / job.block_size, lo % job.block_size}, start(cursor), ahead(cursor) {}

  int64_t next(int64_t* rows) {
    if (pos >= hi) return 0;
    const int64_t count = std::min(kTile, hi - pos);
    while (ahead_pos < std::min(hi, pos + count + lead)) prefetch_next();
    start = cursor;
    for (int64_t i = 0; i < kTile; ++i) {
      rows[i] = cursor.row() * head_dim;
      if (i + 1 < count) cursor.advance();
    }
    cursor.advance();
    pos += count;
    return count;
  }

  // Prefetches the next row not yet prefetched, if it lies within kPrefetchRows of the tiles handed out.
  PAGODA_INLINE void prefetch_one() {
    if (ahead_pos < std::min(hi, pos + kPrefetchRows)) prefetch_next();
  }

  // Whether the last tile's `count` rows are consecutive slots of one block (then its scales are contiguous).
  bool in_one_block(int64_t count) const { return start.offset + count <= start.block_size; }
  // The last tile's first slot (a row index into the head).
  int64_t first_slot() const { return start.row(); }

  HeadRows<C> head;
  int64_t head_dim, pos, hi, ahead_pos, lead;
  RowCursor cursor, start, ahead;

 private:
  PAGODA_INLINE void prefetch_next() {
    const int64_t row = ahead.row();
    prefetch_row(head.k + row * head_dim, head_dim);
    prefetch_row(head.v + row * head_dim, head_dim);
    if constexpr (kQuantized<C>) {
      if (row % 16 == 0 || ahead_pos == pos) {  // a new 64-byte line of scales (or the walk's first)
        prefetch_row(head.k_scale + row, 1);
        prefetch_row(head.v_scale + row, 1);
      }
    }
    ++ahead_pos;
    ahead.advance();
  }
};

}  // namespace
