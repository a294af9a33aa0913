// cadence's CPU kernels: the matmul over float and int8 blocks [N / 16, K, 16].
// A part of cpu_kernels.cc's one translation unit (see there), included by it alone.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#include "workers.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Blocked matmul.

constexpr int64_t kBlock = 16;  // output columns per block: two 8-lane vectors
// A single pass over a block prefetches its own stream this many k-rows ahead (8 KiB of
// float32, 2 KiB of int8): 10% more bandwidth at 1-16 rows on a 2-core AMD EPYC (1 KiB to
// 16 KiB and the T0/NTA hints all measured alike).
constexpr int64_t kPrefetchRows = 128;

// 16-bit float elements (weights a checkpoint stored so, KV pages): widened to float32 as
// they are loaded, exactly.
struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

// 8 elements as an 8-lane float vector.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BF16* p) {  // bfloat16 is a float32's high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8-bit float KV pages (--kv_cache_dtype=float8_*), widened exactly through float16. The pool
// is written saturated (`model.paged_kv.as_pool`), so it holds no infinity; a NaN, which only
// a NaN activation writes, widens to e5m2's NaN but to e4m3's +-480.
struct F8E4M3 { uint8_t bits; };
struct F8E5M2 { uint8_t bits; };
inline __m128i load8_high_bytes(const uint8_t* p) {  // 8 bytes, each the high byte of a 16-bit lane
  return _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const F8E5M2* p) {  // float8_e5m2 is a float16's high byte
  return _mm256_cvtph_ps(load8_high_bytes(&p->bits));
}
// float8_e4m3fn's sign, exponent and mantissa set in a float16's (the exponent shifted down one
// bit, its top bit cleared): its value times 2^-8, the exponents' biases being 7 and 15,
// subnormals included. The attention kernel folds the 2^8 into its query and output.
inline __m256 load8_e4m3_over_256(const F8E4M3* p) {
  const __m128i h = _mm_and_si128(_mm_srai_epi16(load8_high_bytes(&p->bits), 1), _mm_set1_epi16(-0x4001));
  return _mm256_cvtph_ps(h);
}
inline __m256 load8(const F8E4M3* p) {
  return _mm256_mul_ps(load8_e4m3_over_256(p), _mm256_set1_ps(256.0f));
}

// The 16 weights of k-row k of a block, as two 8-lane float vectors: float32 as stored, 16-bit
// floats and int8 widened (int8's per-column scale is applied to the sums, once).
template <typename T>
inline void load_row(const T* w, __m256& w0, __m256& w1) {
  w0 = load8(w);
  w1 = load8(w + 8);
}

inline void load_row(const int8_t* w, __m256& w0, __m256& w1) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));
}

// Rows [0, MR) of x against one block: w points at the block's [K, 16] run; `scale` (16
// floats, or null) multiplies the sums. At k-row k the tile prefetches k-row
// (start + k) * share / 2^32 of the run at address `ahead` (see matmul_blocks). The address is
// an integer: past the last block it is never read, and prefetching it does not fault.
template <int MR, typename W>
inline void matmul_tile(const float* x, int64_t K, const W* w, const float* scale, float* y,
                        int64_t N, uintptr_t ahead, uint64_t start, uint64_t share) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k, w += kBlock) {
    const uint64_t row = ((start + k) * share) >> 32;
    _mm_prefetch(reinterpret_cast<const char*>(ahead + row * kBlock * sizeof(W)), _MM_HINT_T0);
    __m256 w0, w1;
    load_row(w, w0, w1);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
      acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
    }
  }
  if (scale) {
    const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
    for (int m = 0; m < MR; ++m) {
      acc[m][0] = _mm256_mul_ps(acc[m][0], s0);
      acc[m][1] = _mm256_mul_ps(acc[m][1], s1);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(y + m * N, acc[m][0]);
    _mm256_storeu_ps(y + m * N + 8, acc[m][1]);
  }
}

// Blocks [first, last) for all M rows, four rows per pass over a block. One pass (M <= 4)
// prefetches its own stream kPrefetchRows ahead. With several passes, the later ones read the
// block from cache and memory would idle, so pass p prefetches k-rows [p, p + 1) * K / passes of
// the next block instead, and the next block streams in during all of them: 8 rows read 1.15x
// faster than with the first pass alone prefetching, 16 rows 1.4x (2-core AMD EPYC).
template <typename W>
void matmul_blocks(const float* x, int64_t M, int64_t K, const W* w, const float* scale, float* y,
                   int64_t N, int64_t first, int64_t last) {
  const uint64_t passes = (M + 3) / 4;
  const uint64_t share = ((uint64_t{1} << 32) + passes - 1) / passes;  // 2^32 / passes, rounded up
  const int64_t lead = passes == 1 ? kPrefetchRows : K;                // k-rows to the prefetched run
  for (int64_t b = first; b < last; ++b) {
    const W* wb = w + b * K * kBlock;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(wb) + lead * kBlock * sizeof(W);
    const float* sb = scale ? scale + b * kBlock : nullptr;
    float* yb = y + b * kBlock;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      matmul_tile<4>(x + m * K, K, wb, sb, yb + m * N, N, ahead, m / 4 * K, share);
    }
    const uint64_t start = m / 4 * K;
    switch (M - m) {
      case 3: matmul_tile<3>(x + m * K, K, wb, sb, yb + m * N, N, ahead, start, share); break;
      case 2: matmul_tile<2>(x + m * K, K, wb, sb, yb + m * N, N, ahead, start, share); break;
      case 1: matmul_tile<1>(x + m * K, K, wb, sb, yb + m * N, N, ahead, start, share); break;
      default: break;
    }
  }
}

// y [M, blocks * 16] = x [M, K] @ W for float or int8 blocks (with `scale`), split over the
// thread pool.
template <typename W>
void matmul_run(ffi::ThreadPool& pool, const float* xp, int64_t M, int64_t K, const W* wp,
                const float* scale, float* yp, int64_t blocks) {
  // About 256 KiB of float32 weights per work item: long enough runs for the hardware
  // prefetcher (64 KiB items made the whole decode step 1.2x slower), short enough to balance
  // the threads.
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / (K * kBlock * 4));
  parallel_for(pool, blocks, grain, [=](int64_t first, int64_t last) {
    matmul_blocks(xp, M, K, wp, scale, yp, blocks * kBlock, first, last);
  });
}

// The rows of x [M, .] a matmul computes: the leading `live` ([] int32, one value, which the
// caller checks; prefill's rows that hold tokens, the rest being its bucket's padding), at
// most M. y's other rows [M, N] are written as zeros.
int64_t live_rows(ffi::Buffer<ffi::S32> live, int64_t M, float* y, int64_t N) {
  const int64_t rows = std::clamp<int64_t>(*live.typed_data(), 0, M);
  std::fill(y + rows * N, y + M * N, 0.0f);
  return rows;
}

ffi::Error BlockedMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> live,
                             ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                             ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kBlock || wd[1] != xd[1] || yd.size() != 2 ||
      yd[0] != xd[0] || yd[1] != wd[0] * kBlock ||
      static_cast<int64_t>(scale.element_count()) != wd[0] * kBlock || live.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_blocked_matmul_int8 takes x [M, K], its live rows [], w [N / 16, K, 16] and "
        "a scale per (padded) output column");
  }
  const int64_t rows = live_rows(live, xd[0], y->typed_data(), wd[0] * kBlock);
  if (rows > 0) {
    matmul_run(pool, x.typed_data(), rows, xd[1], w.typed_data(), scale.typed_data(),
               y->typed_data(), wd[0]);
  }
  return ffi::Error::Success();
}

}  // namespace
