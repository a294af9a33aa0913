// cadence's CPU kernels: GGUF's quantized formats as the kernels lay them out, and the
// grouped matmul's tiles over float32 activations (AVX2, AVX-512).
// A part of cpu_kernels.cc's one translation unit (see there), included by it alone.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "blocked.h"
#include "isa.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Grouped (block-quantized) matmul.
//
// A block of 16 output columns is a run of records, one per F::kRows k-rows (32 for GGUF's
// 32-weight formats, 256 for its K-quants' super-blocks). Within a record, each group of
// F::kGroupRows k-rows has one scale per column (and for some formats one minimum). The
// record layouts, by format (model/block_layout.py packs them, `pack_grouped`):
//   q8  (Q8_0)  scale f16[16], q int8[32][16]                               w = q * scale
//   q4  (Q4_x)  scale f16[16], min f16[16], pairs u8[16][16]                 w = q * scale + min
//   q5  (Q5_0)  scale f16[16], high u8[4][16], pairs u8[16][16]              w = (q - 16) * scale
//   q4k (Q4_K)  d f16[16], dmin f16[16], sc u8[8][16], m u8[8][16], pairs u8[128][16]
//                                                          w = (d * sc) * q - (dmin * m)
//   q5k (Q5_K)  as q4k, with high u8[32][16] before the pairs               (5-bit q)
//   q6k (Q6_K)  d f16[16], sc int8[16][16], high u8[64][16], pairs u8[128][16]
//                                                          w = (d * sc) * (q - 32), 16-row groups
//   iq4nl (IQ4_NL) scale f16[16], pairs u8[16][16]          w = kIQ4[q] * scale
//   iq4xs (IQ4_XS) d f16[16], sc int8[8][16], pairs u8[128][16]   w = (d * sc) * kIQ4[q]
//   q51 (Q5_1)  scale f16[16], min f16[16], high u8[4][16], pairs u8[16][16]  w = q * scale + min
//   q3k (Q3_K)  d f16[16], sc int8[16][16], pairs u8[128][16]    w = (d * sc) * (q - 4), 16-row groups
//               (the file's 3-bit codes a nibble each here: lossless, 4 bits a weight)
//   q2k (Q2_K)  d f16[16], dmin f16[16], sc u8[16][16], m u8[16][16], pairs u8[128][16]
//                                           w = (d * sc) * q - (dmin * m), 16-row groups, q 0..3
// where a pairs byte (j, c) holds column c's low 4 bits of k-row 2j in its low nibble and of
// k-row 2j + 1 in its high nibble, and a high byte (i, c) holds the code's remaining bits of
// 8 / b consecutive k-rows from i * 8 / b, b bits each from its lowest (b = 1, or 2 for q6k).
// Every scale and minimum is a float32 product of integers and a float16 that is exact, as
// GGUF's dequantizer computes it, so the kernel's sums are of the file's own values.

constexpr int64_t kGroup = 32;            // k-rows per group of int8 activations
constexpr int64_t kPrefetchBytes = 4096;  // a single pass prefetches this far ahead

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(load16(p)); }

inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The 16 bytes at p as two k-rows of 4-bit codes: the low nibbles and the high ones.
inline void nibbles(const uint8_t* p, __m128i& even, __m128i& odd) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i bytes = load16(p);
  even = _mm_and_si128(bytes, low4);
  odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
}

// The 16 columns' float16 d at r times their int8 sub-block scales at sc (Q6_K's, IQ4_XS's).
inline void d_times_int8(const uint8_t* r, const uint8_t* sc, __m256& s0, __m256& s1) {
  s0 = _mm256_mul_ps(half8(r), i8x8(sc));
  s1 = _mm256_mul_ps(half8(r + 16), i8x8(sc + 8));
}

// The K-quants' with minimums (Q2_K, Q4_K, Q5_K): the 16 columns' float16 d at r times their
// unsigned sub-block scales at sc, and -(dmin * m), dmin after d, m their sub-block minimums.
inline void d_times_u8(const uint8_t* r, const uint8_t* sc, __m256& s0, __m256& s1) {
  s0 = _mm256_mul_ps(half8(r), u8x8(sc));
  s1 = _mm256_mul_ps(half8(r + 16), u8x8(sc + 8));
}

inline void less_dmin_times_u8(const uint8_t* r, const uint8_t* m, __m256& m0, __m256& m1) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  m0 = _mm256_xor_ps(_mm256_mul_ps(half8(r + 32), u8x8(m)), sign);
  m1 = _mm256_xor_ps(_mm256_mul_ps(half8(r + 48), u8x8(m + 8)), sign);
}

// IQ4_NL's and IQ4_XS's codes: 4-bit indices into llama.cpp's table of 16 int8 values
// (kvalues_iq4nl), spaced to follow a normal distribution's quantiles.
constexpr int8_t kIQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Two k-rows of table codes from the 16 bytes of index pairs at p.
inline void table_codes(const uint8_t* p, __m128i* q) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4));
  __m128i even, odd;
  nibbles(p, even, odd);
  q[0] = _mm_shuffle_epi8(table, even);
  q[1] = _mm_shuffle_epi8(table, odd);
}

// k-rows [k, k + 8 / kBits) of codes split into nibble pairs and a plane of kBits high bits a
// k-row, as int8: low | high << 4, less kOffset. Two k-rows at a time in one 256-bit register,
// the even one in the low lane: a byte of pairs in both lanes, shifted 0 and 4, and the plane's
// byte in both, the high lane shifted kBits further, so the lowest bits of each lane's bytes
// are its k-row's; then both shift right 2 kBits for the next two k-rows (shifts of 16 and 64
// bits: the bits that cross into a neighbouring byte land above the ones read, and are masked).
template <int kBits, int kOffset>
inline void split_codes(const uint8_t* pairs, const uint8_t* high, int64_t k, __m128i* q) {
  constexpr int kPerByte = 8 / kBits;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i mask = _mm256_set1_epi8(static_cast<char>(((1 << kBits) - 1) << 4));
  const __m256i halves = _mm256_set_epi64x(4, 4, 0, 0);
  __m256i h = _mm256_srlv_epi64(_mm256_broadcastsi128_si256(load16(high + k / kPerByte * kBlock)),
                                _mm256_set_epi64x(kBits, kBits, 0, 0));
  for (int j = 0; j < kPerByte; j += 2) {
    const __m256i bytes = _mm256_broadcastsi128_si256(load16(pairs + (k + j) / 2 * kBlock));
    __m256i codes = _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi64(bytes, halves), low4),
                                    _mm256_and_si256(_mm256_slli_epi16(h, 4), mask));
    h = _mm256_srli_epi16(h, 2 * kBits);
    if constexpr (kOffset != 0) codes = _mm256_sub_epi8(codes, _mm256_set1_epi8(kOffset));
    q[j] = _mm256_castsi256_si128(codes);
    q[j + 1] = _mm256_extracti128_si256(codes, 1);
  }
}

// The formats, as the tiles read them: a record's kRows k-rows, in groups of kGroupRows;
// codes(record, k, q) gives k-rows [k, k + kStep) of the record as 16 int8 codes each, and
// scale / minimum (where kMin) group g's 16 float32 multipliers / terms. For the VNNI tile
// (codes4): kBits a code, its low 4 (or 8) bits at kCodesAt, the rest in the plane at
// kHighAt, and kLift, what it adds to make the codes unsigned; kTable: the codes are kIQ4's
// values at 4-bit indices (kBits 8: signed bytes, as Q8_0's).
struct Q8 {
  static constexpr int64_t kRows = 32, kGroupRows = 32, kStep = 1, kRecord = 2 * kBlock + 32 * kBlock;
  static constexpr bool kMin = false;
  static constexpr bool kTable = false;
  static constexpr int kBits = 8, kLift = 128;
  static constexpr int64_t kCodesAt = 2 * kBlock, kHighAt = 0;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) { q[0] = load16(r + 2 * kBlock + k * kBlock); }
  static void scale(const uint8_t* r, int64_t, __m256& s0, __m256& s1) { s0 = half8(r); s1 = half8(r + 16); }
  static void minimum(const uint8_t*, int64_t, __m256&, __m256&) {}
};

struct Q4 {
  static constexpr int64_t kRows = 32, kGroupRows = 32, kStep = 2, kRecord = 4 * kBlock + 16 * kBlock;
  static constexpr bool kMin = true;
  static constexpr bool kTable = false;
  static constexpr int kBits = 4, kLift = 0;
  static constexpr int64_t kCodesAt = 4 * kBlock, kHighAt = 0;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) { nibbles(r + 4 * kBlock + k / 2 * kBlock, q[0], q[1]); }
  static void scale(const uint8_t* r, int64_t, __m256& s0, __m256& s1) { s0 = half8(r); s1 = half8(r + 16); }
  static void minimum(const uint8_t* r, int64_t, __m256& m0, __m256& m1) { m0 = half8(r + 32); m1 = half8(r + 48); }
};

// Q5_0 (kMinimum false: the codes -16..15, stored lifted by 16) and Q5_1 (true: the codes
// 0..31 and Q4_1's minimum, after the scale).
template <bool kMinimum>
struct Q5x {
  static constexpr int64_t kRows = 32, kGroupRows = 32, kStep = 8, kHigh = (kMinimum ? 4 : 2) * kBlock;
  static constexpr int64_t kPairs = kHigh + 4 * kBlock, kRecord = kPairs + 16 * kBlock;
  static constexpr bool kMin = kMinimum;
  static constexpr bool kTable = false;
  static constexpr int kBits = 5, kLift = kMinimum ? 0 : 16;
  static constexpr int64_t kCodesAt = kPairs, kHighAt = kHigh;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) { split_codes<1, kLift>(r + kPairs, r + kHigh, k, q); }
  static void scale(const uint8_t* r, int64_t, __m256& s0, __m256& s1) { s0 = half8(r); s1 = half8(r + 16); }
  static void minimum(const uint8_t* r, int64_t, __m256& m0, __m256& m1) {
    if constexpr (kMinimum) {
      m0 = half8(r + 32);
      m1 = half8(r + 48);
    }
  }
};
using Q5 = Q5x<false>;
using Q51 = Q5x<true>;

// Q4_K and Q5_K: 8 groups of 32 k-rows, 6-bit scales and minimums (a byte each here) of the
// super-block's d and dmin; Q2_K (kGroups 16): 16 groups of 16 k-rows, 4-bit scales and
// minimums, its 2-bit codes a nibble each.
template <bool kFive, int64_t kGroups = 8>
struct QK {
  static constexpr int64_t kRows = 256, kGroupRows = kRows / kGroups, kStep = kFive ? 8 : 2;
  static constexpr int64_t kSc = 4 * kBlock, kM = kSc + kGroups * kBlock, kHigh = kM + kGroups * kBlock;
  static constexpr int64_t kPairs = kHigh + (kFive ? 32 * kBlock : 0), kRecord = kPairs + 128 * kBlock;
  static constexpr bool kMin = true;
  static constexpr bool kTable = false;
  static constexpr int kBits = kFive ? 5 : 4, kLift = 0;
  static constexpr int64_t kCodesAt = kPairs, kHighAt = kHigh;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) {
    if constexpr (kFive) {
      split_codes<1, 0>(r + kPairs, r + kHigh, k, q);
    } else {
      nibbles(r + kPairs + k / 2 * kBlock, q[0], q[1]);
    }
  }
  static void scale(const uint8_t* r, int64_t g, __m256& s0, __m256& s1) { d_times_u8(r, r + kSc + g * kBlock, s0, s1); }
  static void minimum(const uint8_t* r, int64_t g, __m256& m0, __m256& m1) { less_dmin_times_u8(r, r + kM + g * kBlock, m0, m1); }
};

// Q6_K: 16 groups of 16 k-rows, int8 scales of the super-block's d.
struct Q6K {
  static constexpr int64_t kRows = 256, kGroupRows = 16, kStep = 4;
  static constexpr int64_t kSc = 2 * kBlock, kHigh = kSc + 16 * kBlock, kPairs = kHigh + 64 * kBlock;
  static constexpr int64_t kRecord = kPairs + 128 * kBlock;
  static constexpr bool kMin = false;
  static constexpr bool kTable = false;
  static constexpr int kBits = 6, kLift = 32;
  static constexpr int64_t kCodesAt = kPairs, kHighAt = kHigh;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) { split_codes<2, 32>(r + kPairs, r + kHigh, k, q); }
  static void scale(const uint8_t* r, int64_t g, __m256& s0, __m256& s1) { d_times_int8(r, r + kSc + g * kBlock, s0, s1); }
  static void minimum(const uint8_t*, int64_t, __m256&, __m256&) {}
};

// IQ4_NL: 32 k-rows to a float16 scale.
struct IQ4NL {
  static constexpr int64_t kRows = 32, kGroupRows = 32, kStep = 2, kRecord = 2 * kBlock + 16 * kBlock;
  static constexpr bool kMin = false;
  static constexpr bool kTable = true;
  static constexpr int kBits = 8, kLift = 128;
  static constexpr int64_t kCodesAt = 2 * kBlock, kHighAt = 0;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) { table_codes(r + kCodesAt + k / 2 * kBlock, q); }
  static void scale(const uint8_t* r, int64_t, __m256& s0, __m256& s1) { s0 = half8(r); s1 = half8(r + 16); }
  static void minimum(const uint8_t*, int64_t, __m256&, __m256&) {}
};

// IQ4_XS (kIQ, 8 groups of 32 k-rows: its codes kIQ4's values at 4-bit indices) and Q3_K
// (16 groups of 16 k-rows: its codes -4..3 lifted by 4 into a nibble): signed 6-bit scales (an
// int8 each here) of the super-block's d.
template <int64_t kGroups, bool kIQ>
struct QSigned {
  static constexpr int64_t kRows = 256, kGroupRows = kRows / kGroups, kStep = 2;
  static constexpr int64_t kSc = 2 * kBlock, kPairs = kSc + kGroups * kBlock, kRecord = kPairs + 128 * kBlock;
  static constexpr bool kMin = false;
  static constexpr bool kTable = kIQ;
  static constexpr int kBits = kIQ ? 8 : 4, kLift = kIQ ? 128 : 4;
  static constexpr int64_t kCodesAt = kPairs, kHighAt = 0;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) {
    if constexpr (kIQ) {
      table_codes(r + kPairs + k / 2 * kBlock, q);
    } else {
      nibbles(r + kPairs + k / 2 * kBlock, q[0], q[1]);
      q[0] = _mm_sub_epi8(q[0], _mm_set1_epi8(kLift));
      q[1] = _mm_sub_epi8(q[1], _mm_set1_epi8(kLift));
    }
  }
  static void scale(const uint8_t* r, int64_t g, __m256& s0, __m256& s1) { d_times_int8(r, r + kSc + g * kBlock, s0, s1); }
  static void minimum(const uint8_t*, int64_t, __m256&, __m256&) {}
};
using IQ4XS = QSigned<8, true>;
using Q3K = QSigned<16, false>;

using Q2K = QK<false, 16>;

static_assert(Q8::kRecord == 544 && Q4::kRecord == 320 && Q5::kRecord == 352);
static_assert(Q51::kRecord == 384 && Q3K::kRecord == 2336 && Q2K::kRecord == 2624);
static_assert(IQ4NL::kRecord == 288 && IQ4XS::kRecord == 2208);
static_assert(QK<false>::kRecord == 2368 && QK<true>::kRecord == 2880 && Q6K::kRecord == 3360);

// acc[m] += x[m][k] * w for the 16 weights w0, w1 of one k-row.
template <int MR>
inline void fma_row(__m256 (&acc)[MR][2], const float* x, int64_t K, __m256 w0, __m256 w1) {
  for (int m = 0; m < MR; ++m) {
    const __m256 xv = _mm256_broadcast_ss(x + m * K);
    acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
    acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
  }
}

// Prefetches group g's share of the record at byte `at` of the block's run (see matmul_tile:
// here counted in bytes of the run rather than k-rows).
template <class F>
inline void prefetch_group(uintptr_t ahead, uint64_t start, uint64_t share, int64_t at, int64_t g) {
  constexpr int64_t groups = F::kRows / F::kGroupRows;
  for (int64_t line = g * F::kRecord / groups; line < (g + 1) * F::kRecord / groups; line += 64) {
    const uint64_t row = ((start + at + line) * share) >> 32;
    _mm_prefetch(reinterpret_cast<const char*>(ahead + row), _MM_HINT_T0);
  }
}

// acc[m] += group g's minimums * row m's sum of x over the group (`xsum` at the group, rows
// `xgroups` apart): the minimum's share of a group, for the formats that have one.
template <int MR, class F>
inline void add_minimums(__m256 (&acc)[MR][2], const uint8_t* w, int64_t g, const float* xsum,
                         int64_t xgroups) {
  __m256 m0, m1;
  F::minimum(w, g, m0, m1);
  for (int m = 0; m < MR; ++m) {
    const __m256 xs = _mm256_broadcast_ss(xsum + m * xgroups);
    acc[m][0] = _mm256_fmadd_ps(xs, m0, acc[m][0]);
    acc[m][1] = _mm256_fmadd_ps(xs, m1, acc[m][1]);
  }
}

template <int MR>
inline void store_rows(const __m256 (&acc)[MR][2], float* y, int64_t N) {
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(y + m * N, acc[m][0]);
    _mm256_storeu_ps(y + m * N + 8, acc[m][1]);
  }
}

// Rows [0, MR) of x against one block of records. The scales are factored out of each group:
// its sums over the integer codes, sum_k x[k] q[k] (exact products), are scaled once, and a
// minimum adds min * sum_k x[k] (`xsum` [MR][K / 32], the group sums of x). One FMA per
// weight and row instead of a dequantizing FMA per weight on top: decode on one core is
// bound by these instructions, not by the bytes.
template <int MR, class F>
inline void grouped_tile(const float* x, const float* xsum, int64_t K, const uint8_t* w, float* y,
                         int64_t N, uintptr_t ahead, uint64_t start, uint64_t share) {
  const int64_t records = K / F::kRows, xgroups = K / F::kGroupRows;  // x's sums a row
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t r = 0; r < records; ++r, w += F::kRecord) {
    for (int64_t g = 0; g < F::kRows / F::kGroupRows; ++g) {
      prefetch_group<F>(ahead, start, share, r * F::kRecord, g);
      const int64_t k0 = r * F::kRows + g * F::kGroupRows;
      __m256 sums[MR][2];
      for (int m = 0; m < MR; ++m) sums[m][0] = sums[m][1] = _mm256_setzero_ps();
      for (int64_t k = 0; k < F::kGroupRows; k += F::kStep) {
        __m128i q[F::kStep];
        F::codes(w, g * F::kGroupRows + k, q);
        for (int s = 0; s < F::kStep; ++s) {
          const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q[s]));
          const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q[s], 8)));
          fma_row<MR>(sums, x + k0 + k + s, K, q0, q1);
        }
      }
      __m256 s0, s1;
      F::scale(w, g, s0, s1);
      for (int m = 0; m < MR; ++m) {
        acc[m][0] = _mm256_fmadd_ps(sums[m][0], s0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(sums[m][1], s1, acc[m][1]);
      }
      if constexpr (F::kMin) add_minimums<MR, F>(acc, w, g, xsum + k0 / F::kGroupRows, xgroups);
    }
  }
  store_rows<MR>(acc, y, N);
}

// The same tile with AVX-512, where the CPU has it (`grouped_run` picks at run time): a
// block's 16 columns are one 16-lane register, so each k-row is one widening, one conversion
// and one FMA per row where AVX2 needs two of each. Every lane computes what the AVX2 lane of
// its column computes, in the same order: the results are the same bits. The formats' codes,
// scales and minimums are the AVX2 ones (16 bytes, two 8-lane vectors), joined.

template <int MR>
CADENCE_AVX512 inline void fma_rows512(__m512 (&sums)[MR], int64_t K, const float* x, __m512 q) {
  for (int m = 0; m < MR; ++m) sums[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K]), q, sums[m]);
}

CADENCE_AVX512 inline __m512 join512(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                                             _mm256_castps_pd(hi), 1));
}

// add_minimums, 16 lanes at a time.
template <int MR, class F>
CADENCE_AVX512 inline void add_minimums512(__m512 (&acc)[MR], const uint8_t* w, int64_t g,
                                           const float* xsum, int64_t xgroups) {
  __m256 m0, m1;
  F::minimum(w, g, m0, m1);
  const __m512 mins = join512(m0, m1);
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * xgroups]), mins, acc[m]);
}

template <int MR, class F>
CADENCE_AVX512 inline void grouped_tile512(const float* x, const float* xsum, int64_t K,
                                           const uint8_t* w, float* y, int64_t N, uintptr_t ahead,
                                           uint64_t start, uint64_t share) {
  const int64_t records = K / F::kRows, xgroups = K / F::kGroupRows;  // x's sums a row
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t r = 0; r < records; ++r, w += F::kRecord) {
    for (int64_t g = 0; g < F::kRows / F::kGroupRows; ++g) {
      prefetch_group<F>(ahead, start, share, r * F::kRecord, g);
      const int64_t k0 = r * F::kRows + g * F::kGroupRows;
      __m512 sums[MR];
      for (int m = 0; m < MR; ++m) sums[m] = _mm512_setzero_ps();
      for (int64_t k = 0; k < F::kGroupRows; k += F::kStep) {
        __m128i q[F::kStep];
        F::codes(w, g * F::kGroupRows + k, q);
        for (int s = 0; s < F::kStep; ++s) {
          fma_rows512<MR>(sums, K, x + k0 + k + s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q[s])));
        }
      }
      __m256 s0, s1;
      F::scale(w, g, s0, s1);
      const __m512 s = join512(s0, s1);
      for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(sums[m], s, acc[m]);
      if constexpr (F::kMin) add_minimums512<MR, F>(acc, w, g, xsum + k0 / F::kGroupRows, xgroups);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * N, acc[m]);
}

// One tile of rows [0, MR): AVX-512's or AVX2's. The loop below is compiled for AVX2 alone, so
// the AVX-512 tile is called, not inlined: a call per block and eight rows (AVX-512's 32
// registers hold eight rows' sums and results, AVX2's 16 four rows').
template <bool kWide, int MR, class F>
inline void tile(const float* x, const float* xsum, int64_t K, const uint8_t* w, float* y,
                 int64_t N, uintptr_t ahead, uint64_t start, uint64_t share) {
  if constexpr (kWide) {
    grouped_tile512<MR, F>(x, xsum, K, w, y, N, ahead, start, share);
  } else {
    grouped_tile<MR, F>(x, xsum, K, w, y, N, ahead, start, share);
  }
}

// Calls fn(std::integral_constant<int, R>) for the R in [1, kMax] that equals rows.
template <int kMax, class Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (kMax > 0) {
    if (rows == kMax) {
      fn(std::integral_constant<int, kMax>{});
    } else {
      with_rows<kMax - 1>(rows, fn);
    }
  }
}

// Blocks [first, last) of a grouped matrix (`run` bytes each) for all M rows, as
// matmul_blocks: tile(std::integral_constant<int, MR>, m, wb, yb, ahead, start, share) for
// rows [m, m + MR) of block wb (output yb), tiles of kMax rows and the rest; `ahead`, `start`
// and `share` place the tile's prefetches (see matmul_tile).
template <int kMax, class Tile>
void grouped_runs(int64_t M, int64_t run, const uint8_t* w, float* y, int64_t first, int64_t last,
                  Tile tile) {
  const uint64_t passes = (M + kMax - 1) / kMax;
  const uint64_t share = ((uint64_t{1} << 32) + passes - 1) / passes;
  const int64_t lead = passes == 1 ? kPrefetchBytes : run;
  for (int64_t b = first; b < last; ++b) {
    const uint8_t* wb = w + b * run;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(wb) + lead;
    float* yb = y + b * kBlock;
    int64_t m = 0;
    for (; m + kMax <= M; m += kMax) {
      tile(std::integral_constant<int, kMax>{}, m, wb, yb, ahead, m / kMax * run, share);
    }
    const uint64_t start = m / kMax * run;
    with_rows<kMax - 1>(M - m, [&](auto mr) { tile(mr, m, wb, yb, ahead, start, share); });
  }
}

template <bool kWide, class F>
void grouped_blocks(const float* x, const float* xsum, int64_t M, int64_t K, const uint8_t* w,
                    float* y, int64_t N, int64_t first, int64_t last) {
  const int64_t groups = K / F::kGroupRows;  // x's sums a row (the minimums')
  grouped_runs<kWide ? 8 : 4>(M, K / F::kRows * F::kRecord, w, y, first, last,
               [=](auto mr, int64_t m, const uint8_t* wb, float* yb, uintptr_t ahead,
                   uint64_t start, uint64_t share) {
                 tile<kWide, decltype(mr)::value, F>(x + m * K, xsum + m * groups, K, wb,
                                                     yb + m * N, N, ahead, start, share);
               });
}

}  // namespace
