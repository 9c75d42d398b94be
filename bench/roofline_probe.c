// Machine peaks for bench/roofline.py: one instruction's throughput, or memory bandwidth, on N threads.
//
//   roofline_probe bf16|vnni|amx|amx_int8|fma|avx2_int8 THREADS REPEATS
//                                                           GFLOP/s (int8: GOP/s) of each repeat, one a line
//   roofline_probe read|copy THREADS REPEATS MIB [huge]      GB/s of each repeat over a MIB buffer (copy: two
//                                                           halves); huge: on 2 MiB pages (madvise)
//
// The compute probes run independent accumulator chains of one instruction in a tight loop, enough of them
// to cover its latency, so the loop is bound by the instruction's throughput alone. A repeat runs for about
// 0.1 s on every thread at once; the first thread times it between barriers. bench/roofline.py compiles this
// with the system gcc (-O2 -mavx512f -mavx512bf16 -mavx512vnni -fopenmp, plus -mamx-tile -mamx-bf16
// -mamx-int8 -DWITH_AMX where the CPU has AMX; on a CPU with AVX2 alone -O2 -mavx2 -mfma -fopenmp, and the
// AVX2 probes only: fma, avx2_int8, 32-byte loads for the bandwidth) and runs only the probes whose
// instructions the CPU has.
//
// Why huge pages: on a VM each TLB miss walks two page tables; measured on a 2-core Zen 4 VM, one thread
// reads ~20 GB/s on 4 KiB pages and ~30 GB/s on 2 MiB ones. Torch's tensors are on 4 KiB pages.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#ifdef WITH_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

// Short repeats, many of them: on a shared machine the best one is the one that had the cores to itself.
#define REPEAT_S 0.1

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// 16 independent chains: Zen 4 and Sapphire Rapids need 5-6 in flight per pipe for these instructions.
#define CHAINS16(OP) \
  OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11) OP(12) OP(13) OP(14) OP(15)
// 8 for the AVX2 probes: AVX2 has 16 registers, and the inputs and temporaries need some (two FMA pipes of
// latency 4 need 8 in flight).
#define CHAINS8(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)

#if defined(__AVX512F__)
// vdpbf16ps zmm: 16 lanes x 2 bf16 products added into fp32 = 64 FLOPs an instruction.
static float bf16_loop(int64_t iters, float seed) {
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80 + (int)seed);  // two bf16 1.0s a lane
  __m512bh b = a;
#define DECL(i) __m512 acc##i = _mm512_set1_ps(seed + i);
#define STEP(i) acc##i = _mm512_dpbf16_ps(acc##i, a, b);
#define SUM(i) total = _mm512_add_ps(total, acc##i);
  CHAINS16(DECL)
  for (int64_t n = 0; n < iters; ++n) {
    CHAINS16(STEP)
  }
  __m512 total = _mm512_setzero_ps();
  CHAINS16(SUM)
  return _mm512_reduce_add_ps(total);
}
#undef DECL
#undef STEP
#undef SUM

// vpdpbusd zmm: 16 lanes x 4 u8*s8 products added into int32 = 128 integer ops an instruction.
static float vnni_loop(int64_t iters, float seed) {
  __m512i a = _mm512_set1_epi32(0x01010101 + (int)seed);
  __m512i b = a;
#define DECL(i) __m512i acc##i = _mm512_set1_epi32((int)seed + i);
#define STEP(i) acc##i = _mm512_dpbusd_epi32(acc##i, a, b);
#define SUM(i) total = _mm512_add_epi32(total, acc##i);
  CHAINS16(DECL)
  for (int64_t n = 0; n < iters; ++n) {
    CHAINS16(STEP)
  }
  __m512i total = _mm512_setzero_si512();
  CHAINS16(SUM)
  return (float)_mm512_reduce_add_epi32(total);
}
#undef DECL
#undef STEP
#undef SUM

#endif

// vfmadd231ps ymm: 8 lanes x (multiply + add) = 16 FLOPs an instruction: what our fp32 panel GEMM runs on a
// CPU with AVX2 alone (bf16 weights widened to fp32 panels there).
static float fma_loop(int64_t iters, float seed) {
  __m256 a = _mm256_set1_ps(1.0f + seed * 1e-7f), b = _mm256_set1_ps(0.999f);
#define DECL(i) __m256 acc##i = _mm256_set1_ps(seed + i);
#define STEP(i) acc##i = _mm256_fmadd_ps(a, b, acc##i);
#define SUM(i) total = _mm256_add_ps(total, acc##i);
  CHAINS8(DECL)
  for (int64_t n = 0; n < iters; ++n) {
    CHAINS8(STEP)
  }
  __m256 total = _mm256_setzero_ps();
  CHAINS8(SUM)
  float lanes[8];
  _mm256_storeu_ps(lanes, total);
  return lanes[0];
}
#undef DECL
#undef STEP
#undef SUM

// The AVX2 int8 kernel's product (csrc/cpu_quant_avx2.h): vpsignb, vpmaddubsw, vpmaddwd by ones, vpaddd =
// 8 lanes x 4 u8*s8 products added into int32 = 64 integer ops per four instructions. There is no one
// instruction for it without VNNI: the four together are the unit whose throughput bounds the kernel.
static float avx2_int8_loop(int64_t iters, float seed) {
  __m256i x = _mm256_set1_epi8((char)(3 + (int)seed)), x_abs = _mm256_abs_epi8(x), w = _mm256_set1_epi8(-5);
  const __m256i ones = _mm256_set1_epi16(1);
#define DECL(i) __m256i acc##i = _mm256_set1_epi32((int)seed + i);
#define STEP(i) \
  acc##i = _mm256_add_epi32(acc##i, _mm256_madd_epi16(_mm256_maddubs_epi16(x_abs, _mm256_sign_epi8(w, x)), ones));
#define SUM(i) total = _mm256_add_epi32(total, acc##i);
  CHAINS8(DECL)
  for (int64_t n = 0; n < iters; ++n) {
    __asm__ volatile("" : "+x"(w), "+x"(x));  // a new product each iteration, as the kernel's
    CHAINS8(STEP)
  }
  __m256i total = _mm256_setzero_si256();
  CHAINS8(SUM)
  return (float)_mm256_extract_epi32(total, 0);
}
#undef DECL
#undef STEP
#undef SUM

#ifdef WITH_AMX
// tdpbf16ps: a 16 x 16 fp32 tile += (16 x 32 bf16) x (32 x 16 bf16) = 16,384 FLOPs an instruction; tdpbusd:
// a 16 x 16 int32 tile += (16 x 64 u8) x (64 x 16 s8) = 32,768 ops. Tiles 0-3 accumulate, 4-5 are A and 6-7
// B: four independent products per iteration, as a 32 x 32 GEMM block runs them.
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} __attribute__((aligned(64)));

static void amx_setup(void) {
  static __thread uint16_t tile_data[16 * 32] __attribute__((aligned(64)));
  for (int i = 0; i < 16 * 32; ++i) tile_data[i] = 0x3f80;  // bf16 1.0 (int8: 0x80, 0x3f)
  struct TileConfig config = {.palette = 1};
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, tile_data, 64);
  _tile_loadd(5, tile_data, 64);
  _tile_loadd(6, tile_data, 64);
  _tile_loadd(7, tile_data, 64);
}

static float amx_finish(float seed) {
  static __thread float out[16 * 16] __attribute__((aligned(64)));
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0] + seed;
}

static float amx_loop(int64_t iters, float seed) {
  amx_setup();
  for (int64_t n = 0; n < iters; ++n) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  return amx_finish(seed);
}

static float amx_int8_loop(int64_t iters, float seed) {
  amx_setup();
  for (int64_t n = 0; n < iters; ++n) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  return amx_finish(seed);
}
#endif

typedef float (*Loop)(int64_t, float);

// The instruction's loop, operations per iteration of it, or NULL for an unknown (or not compiled) probe.
static Loop compute_probe(const char* name, double* ops_per_iter) {
  if (strcmp(name, "fma") == 0) {
    *ops_per_iter = 8.0 * 16;
    return fma_loop;
  }
  if (strcmp(name, "avx2_int8") == 0) {
    *ops_per_iter = 8.0 * 64;
    return avx2_int8_loop;
  }
#if defined(__AVX512F__)
  if (strcmp(name, "bf16") == 0) {
    *ops_per_iter = 16.0 * 64;
    return bf16_loop;
  }
  if (strcmp(name, "vnni") == 0) {
    *ops_per_iter = 16.0 * 128;
    return vnni_loop;
  }
#endif
#ifdef WITH_AMX
  if (strcmp(name, "amx") == 0) {
    *ops_per_iter = 4.0 * 16384;
    return amx_loop;
  }
  if (strcmp(name, "amx_int8") == 0) {
    *ops_per_iter = 4.0 * 32768;
    return amx_int8_loop;
  }
#endif
  return NULL;
}

// Iterations of `loop` that take about REPEAT_S on one thread.
static int64_t calibrate(Loop loop) {
  int64_t iters = 1 << 14;
  for (;;) {
    double start = now_s();
    volatile float sink = loop(iters, 1.0f);
    (void)sink;
    double elapsed = now_s() - start;
    if (elapsed > REPEAT_S / 8) return (int64_t)(iters * REPEAT_S / elapsed);
    iters *= 4;
  }
}

static int run_compute(Loop loop, double ops_per_iter, int threads, int repeats) {
  int64_t iters = calibrate(loop);
  double* seconds = calloc(repeats, sizeof(double));
  volatile float sink = 0;
#pragma omp parallel num_threads(threads)
  {
    double start = 0;
    for (int r = 0; r < repeats; ++r) {
#pragma omp barrier
      if (omp_get_thread_num() == 0) start = now_s();
      float value = loop(iters, (float)r);
#pragma omp barrier
      if (omp_get_thread_num() == 0) {
        seconds[r] = now_s() - start;
        sink += value;
      }
    }
  }
  for (int r = 0; r < repeats; ++r) printf("%.1f\n", ops_per_iter * iters * threads / seconds[r] / 1e9);
  free(seconds);
  return 0;
}

#if defined(__AVX512F__)
typedef __m512i Line;  // one 64-byte load or store
#define LINE_ZERO() _mm512_setzero_si512()
#define LINE_ADD(a, b) _mm512_add_epi64(a, b)
#define LINE_LOAD(p) _mm512_load_si512(p)
#define LINE_STORE(p, v) _mm512_store_si512(p, v)
#define LINE_SUM(v) _mm512_reduce_add_epi64(v)
#else
typedef __m256i Line;  // AVX2: 32-byte loads and stores
#define LINE_ZERO() _mm256_setzero_si256()
#define LINE_ADD(a, b) _mm256_add_epi64(a, b)
#define LINE_LOAD(p) _mm256_load_si256(p)
#define LINE_STORE(p, v) _mm256_store_si256(p, v)
#define LINE_SUM(v) (_mm256_extract_epi64(v, 0) + _mm256_extract_epi64(v, 1) + _mm256_extract_epi64(v, 2) + \
                     _mm256_extract_epi64(v, 3))
#endif

// Sums this thread's slice with 8 independent loads an iteration (no chain waits on memory).
static int64_t read_slice(const Line* p, int64_t n) {
  Line s0 = LINE_ZERO(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    s0 = LINE_ADD(s0, LINE_LOAD(p + i));
    s1 = LINE_ADD(s1, LINE_LOAD(p + i + 1));
    s2 = LINE_ADD(s2, LINE_LOAD(p + i + 2));
    s3 = LINE_ADD(s3, LINE_LOAD(p + i + 3));
    s4 = LINE_ADD(s4, LINE_LOAD(p + i + 4));
    s5 = LINE_ADD(s5, LINE_LOAD(p + i + 5));
    s6 = LINE_ADD(s6, LINE_LOAD(p + i + 6));
    s7 = LINE_ADD(s7, LINE_LOAD(p + i + 7));
  }
  Line s = LINE_ADD(LINE_ADD(LINE_ADD(s0, s1), LINE_ADD(s2, s3)), LINE_ADD(LINE_ADD(s4, s5), LINE_ADD(s6, s7)));
  return LINE_SUM(s);
}

static void copy_slice(Line* dst, const Line* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) LINE_STORE(dst + i, LINE_LOAD(src + i));
}

// Read: bytes read / s. Copy: (bytes read + bytes written) / s, as STREAM counts it. Each thread owns one
// contiguous slice; the buffer is written once and passed over once untimed first, so no repeat pays for
// the first touch of fresh pages.
static int run_memory(int copy, int threads, int repeats, int64_t mib, int huge) {
  int64_t lines = mib * (1 << 20) / sizeof(Line);
  Line* buf = aligned_alloc(1 << 21, lines * sizeof(Line));
  if (buf == NULL) {
    fprintf(stderr, "cannot allocate %lld MiB\n", (long long)mib);
    return 1;
  }
  if (huge && madvise(buf, lines * sizeof(Line), MADV_HUGEPAGE) != 0) {
    fprintf(stderr, "madvise(MADV_HUGEPAGE) failed\n");
    return 1;
  }
  int64_t half = lines / 2, n = copy ? half : lines;
  double* seconds = calloc(repeats, sizeof(double));
  volatile int64_t sink = 0;
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t lo = n * t / nt / 8 * 8, hi = t + 1 == nt ? n : n * (t + 1) / nt / 8 * 8;
    memset(buf + lo, t + 1, (hi - lo) * sizeof(Line));  // each thread first touches its own pages
    if (copy) memset(buf + half + lo, 0, (hi - lo) * sizeof(Line));
    double start = 0;
    for (int r = -1; r < repeats; ++r) {  // r = -1: the warm pass
#pragma omp barrier
      if (t == 0) start = now_s();
      int64_t value = 0;
      if (copy)
        copy_slice(buf + half + lo, buf + lo, hi - lo);
      else
        value = read_slice(buf + lo, hi - lo);
#pragma omp barrier
      if (t == 0 && r >= 0) seconds[r] = now_s() - start;
#pragma omp atomic
      sink += value;
    }
  }
  double bytes = (double)n * sizeof(Line) * (copy ? 2 : 1);
  for (int r = 0; r < repeats; ++r) printf("%.2f\n", bytes / seconds[r] / 1e9);
  free(seconds);
  free(buf);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s bf16|vnni|amx|amx_int8|fma|avx2_int8|read|copy THREADS REPEATS [MIB [huge]]\n", argv[0]);
    return 2;
  }
  int threads = atoi(argv[2]), repeats = atoi(argv[3]);
  if (threads < 1 || repeats < 1) {
    fprintf(stderr, "THREADS and REPEATS must be positive\n");
    return 2;
  }
  int copy = strcmp(argv[1], "copy") == 0;
  if (copy || strcmp(argv[1], "read") == 0) {
    if (argc < 5 || atoll(argv[4]) < 1) {
      fprintf(stderr, "%s needs a buffer size in MiB\n", argv[1]);
      return 2;
    }
    return run_memory(copy, threads, repeats, atoll(argv[4]), argc > 5 && strcmp(argv[5], "huge") == 0);
  }
#ifdef WITH_AMX
  // Linux keeps the AMX tile state off until the process asks for it (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  if (strncmp(argv[1], "amx", 3) == 0 && syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
    fprintf(stderr, "the kernel refused AMX tile state (arch_prctl)\n");
    return 1;
  }
#endif
  double ops_per_iter = 0;
  Loop loop = compute_probe(argv[1], &ops_per_iter);
  if (loop == NULL) {
    fprintf(stderr, "unknown probe %s (amx needs -DWITH_AMX)\n", argv[1]);
    return 2;
  }
  return run_compute(loop, ops_per_iter, threads, repeats);
}
