// cadence's CPU kernels: the grouped matmul's tiles over int8 activations (AVX2, AVX-512
// VNNI).
// A part of cpu_kernels.cc's one translation unit (see there), included by it alone.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "grouped.h"

namespace {

// ---------------------------------------------------------------------------------------------
// The grouped matmul over int8 activations (opt-in: llama.cpp's numerics for its quantized
// weights). Each row of x is quantized per 32 k-rows to int8 with a float32 scale (amax / 127,
// rounded to nearest), and each group's sum of codes times x is an integer dot product: four
// k-rows of a column's codes against the row's four int8 values in one multiply-add of bytes
// (maddubs) and one of 16-bit pairs (madd), where the float32 kernel widens every code to a
// float and spends an FMA on it. The group's integer sum is then scaled as the float kernel
// scales its float sum; minimums still weigh the float32 group sums of x.

// 16 columns' codes of four k-rows (q[0..3], a byte per column each) as two registers of
// 8 columns: byte 4c + j of a register is its column c's code of k-row j.
inline void interleave4(const __m128i* q, __m256i& lo, __m256i& hi) {
  const __m128i a = _mm_unpacklo_epi8(q[0], q[1]), b = _mm_unpacklo_epi8(q[2], q[3]);
  const __m128i c = _mm_unpackhi_epi8(q[0], q[1]), d = _mm_unpackhi_epi8(q[2], q[3]);
  lo = _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
  hi = _mm256_set_m128i(_mm_unpackhi_epi16(c, d), _mm_unpacklo_epi16(c, d));
}

// Per 32-bit lane, sum over its 4 bytes of w * x (signed bytes both; |x| <= 127, so no pair
// of products saturates the 16-bit step).
inline __m256i dot4(__m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// The same sum over codes of at most 6 bits lifted to unsigned bytes (`lifted_codes`): the
// unsigned codes are maddubs' unsigned operand as they are (a pair of products stays within
// 63 * 127 * 2, no saturation), without dot4's abs and sign.
inline __m256i dot4u(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// k-rows [k, k + kStep) of a format's codes as unsigned bytes, F::kLift above `codes`'.
template <class F>
inline void lifted_codes(const uint8_t* r, int64_t k, __m128i* q) {
  if constexpr (F::kLift == 0) {
    F::codes(r, k, q);
  } else if constexpr (F::kBits == 4) {  // nibbles as stored (Q3_K's)
    nibbles(r + F::kCodesAt + k / 2 * kBlock, q[0], q[1]);
  } else {
    split_codes<F::kBits - 4, 0>(r + F::kCodesAt, r + F::kHighAt, k, q);
  }
}

// kLift * row m's sum of x's codes over the group at k-row k0 (`xqsum`: per 16 k-rows, rows
// K / 16 apart): what lifted codes add to the group's integer sums.
template <class F>
inline int32_t lifted_part(const int32_t* xqsum, int64_t m, int64_t K, int64_t k0) {
  int32_t total = 0;
  for (int64_t i = 0; i < F::kGroupRows / 16; ++i) total += xqsum[m * (K / 16) + k0 / 16 + i];
  return F::kLift * total;
}

// Over int8 activations. Codes of at most 6 bits go in lifted (`dot4u`) and `lifted_part`
// comes off after; Q8_0's signed bytes take dot4.
template <int MR, class F>
inline void grouped_tile_q8x(const int8_t* xq, const int32_t* xqsum, const float* xd,
                             const float* xsum, int64_t K, const uint8_t* w, float* y, int64_t N,
                             uintptr_t ahead, uint64_t start, uint64_t share) {
  static_assert(F::kGroupRows % 16 == 0 && 8 % F::kStep == 0);
  constexpr bool kLifted = F::kBits < 8;
  const int64_t records = K / F::kRows, xgroups = K / kGroup;
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t r = 0; r < records; ++r, w += F::kRecord) {
    for (int64_t g = 0; g < F::kRows / F::kGroupRows; ++g) {
      prefetch_group<F>(ahead, start, share, r * F::kRecord, g);
      const int64_t k0 = r * F::kRows + g * F::kGroupRows;
      __m256i sums[MR][2];
      for (int m = 0; m < MR; ++m) sums[m][0] = sums[m][1] = _mm256_setzero_si256();
      for (int64_t k = 0; k < F::kGroupRows; k += 8) {
        __m128i q[8];
        for (int j = 0; j < 8; j += F::kStep) {
          if constexpr (kLifted) {
            lifted_codes<F>(w, g * F::kGroupRows + k + j, q + j);
          } else {
            F::codes(w, g * F::kGroupRows + k + j, q + j);
          }
        }
        for (int half = 0; half < 8; half += 4) {
          __m256i lo, hi;
          interleave4(q + half, lo, hi);
          for (int m = 0; m < MR; ++m) {
            int32_t four;
            std::memcpy(&four, xq + m * K + k0 + k + half, 4);
            const __m256i xv = _mm256_set1_epi32(four);
            if constexpr (kLifted) {
              sums[m][0] = _mm256_add_epi32(sums[m][0], dot4u(lo, xv));
              sums[m][1] = _mm256_add_epi32(sums[m][1], dot4u(hi, xv));
            } else {
              sums[m][0] = _mm256_add_epi32(sums[m][0], dot4(lo, xv));
              sums[m][1] = _mm256_add_epi32(sums[m][1], dot4(hi, xv));
            }
          }
        }
      }
      __m256 s0, s1;
      F::scale(w, g, s0, s1);
      for (int m = 0; m < MR; ++m) {
        if constexpr (kLifted && F::kLift != 0) {
          const __m256i lift = _mm256_set1_epi32(lifted_part<F>(xqsum, m, K, k0));
          sums[m][0] = _mm256_sub_epi32(sums[m][0], lift);
          sums[m][1] = _mm256_sub_epi32(sums[m][1], lift);
        }
        const __m256 d = _mm256_set1_ps(xd[m * xgroups + k0 / kGroup]);
        acc[m][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums[m][0]), d), s0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums[m][1]), d), s1, acc[m][1]);
      }
      if constexpr (F::kMin) add_minimums<MR, F>(acc, w, g, xsum + k0 / F::kGroupRows, K / F::kGroupRows);
    }
  }
  store_rows<MR>(acc, y, N);
}

// The same tile with AVX-512 VNNI, where the CPU has it: a block's 16 columns of four k-rows
// are one 512-bit register, and one vpdpbusd per row adds its four products per column to the
// row's 32-bit sums (AVX2 spends three to five on each half). vpdpbusd multiplies
// unsigned bytes by signed ones: the codes go in as unsigned bytes, kLift above the AVX2
// tile's (`codes4`), and kLift * the group's sum of x's codes (`xqsum`, per 16 k-rows, rows
// K / 16 apart) comes off: the same integer sums, scaled as the AVX2 tile scales them, so the
// same bits. With 32 registers, eight rows' sums and results fit: a block's codes are
// unpacked once for eight rows where AVX2 unpacks them once per four.
#define CADENCE_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx512vbmi")))

// A 64-byte constant built at compile time: byte i is f(i).
template <class Fn>
constexpr std::array<uint8_t, 64> bytes64(Fn f) {
  std::array<uint8_t, 64> out{};
  for (int i = 0; i < 64; ++i) out[i] = static_cast<uint8_t>(f(i));
  return out;
}

CADENCE_VNNI inline __m512i load64(const std::array<uint8_t, 64>& a) {
  return _mm512_loadu_si512(a.data());
}

// k-rows [k, k + 4) of a record's codes in vpdpbusd's order, as unsigned bytes: byte 4c + j is
// column c's code of k-row k + j, plus F::kLift. kPhase is k modulo 8 (0 or 4), where the
// k-rows' high bits lie in their plane's bytes. Q8_0's whole-byte codes: one byte permutation
// (vpermb) of the four k-rows, and the sign bit flipped. The others: vpermb gathers the bytes
// holding a pair of columns' bits, two of each pairs row and, for 5- and 6-bit codes, one of
// the plane, into a 64-bit lane, and vpmultishiftqb takes each code's nibble from there into
// its byte (and its high bits, at bit 4).
template <class F, int kPhase>
CADENCE_VNNI inline __m512i codes4(const uint8_t* r, int64_t k) {
  if constexpr (F::kBits == 8 && !F::kTable) {
    static constexpr auto order = bytes64([](int i) { return 16 * (i % 4) + i / 4; });
    const __m512i codes = _mm512_loadu_si512(r + F::kCodesAt + k * kBlock);
    return _mm512_xor_si512(_mm512_permutexvar_epi8(load64(order), codes),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    constexpr int kHighBits = F::kTable ? 0 : F::kBits - 4;
    // The table: the pairs rows of k-rows k, k + 1 and k + 2, k + 3 (bytes 0-15, 16-31), and
    // the plane's row of their high bits (32-47). Lane q (columns 2q, 2q + 1) gathers its
    // columns' bytes of each: byte 2 row + column.
    __m512i table = _mm512_zextsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + F::kCodesAt + k / 2 * kBlock)));
    if constexpr (kHighBits > 0) {
      table = _mm512_inserti32x4(table, load16(r + F::kHighAt + k / (8 / kHighBits) * kBlock), 2);
    }
    static constexpr auto gather = bytes64([](int i) {
      const int q = i / 8, b = i % 8;
      return b < 6 ? 16 * (b / 2) + 2 * q + b % 2 : 0;
    });
    const __m512i lanes = _mm512_permutexvar_epi8(load64(gather), table);
    // Byte 4c + j of a lane (column c of its two, k-row k + j): the nibble at bit
    // 8 (2 (j / 2) + c) + 4 (j % 2), the high bits at bit 8 (4 + c) + b (phase + j) of the lane,
    // b of them, taken from 4 bits lower so that they land at bit 4.
    static constexpr auto low = bytes64([](int i) {
      const int c = i % 8 / 4, j = i % 4;
      return 8 * (2 * (j / 2) + c) + 4 * (j % 2);
    });
    const __m512i nibbles = _mm512_and_si512(_mm512_multishift_epi64_epi8(load64(low), lanes),
                                             _mm512_set1_epi8(0x0F));
    if constexpr (F::kTable) {  // the indices' values, lifted: one byte permutation (vpermb)
      static constexpr auto lifted = bytes64([](int i) { return kIQ4[i % 16] + F::kLift; });
      return _mm512_permutexvar_epi8(nibbles, load64(lifted));
    } else if constexpr (kHighBits == 0) {
      return nibbles;
    } else {
      static constexpr auto high = bytes64([](int i) {
        const int c = i % 8 / 4, j = i % 4;
        return 8 * (4 + c) + kHighBits * (kPhase % (8 / kHighBits) + j) - 4;
      });
      const __m512i bits = _mm512_multishift_epi64_epi8(load64(high), lanes);
      // nibbles | (bits & the high bits' mask)
      const __m512i mask = _mm512_set1_epi8(static_cast<char>(((1 << kHighBits) - 1) << 4));
      return _mm512_ternarylogic_epi32(nibbles, bits, mask, 0xF8);
    }
  }
}

// sums[m] += per column, the four codes times row m's four int8 values at x (rows K apart).
template <int MR>
CADENCE_VNNI inline void dot_rows(__m512i (&sums)[MR], const int8_t* x, int64_t K, __m512i codes) {
  for (int m = 0; m < MR; ++m) {
    int32_t four;
    std::memcpy(&four, x + m * K, 4);
    sums[m] = _mm512_dpbusd_epi32(sums[m], codes, _mm512_set1_epi32(four));
  }
}

template <int MR, class F>
CADENCE_VNNI inline void grouped_tile_q8x512(const int8_t* xq, const int32_t* xqsum,
                                             const float* xd, const float* xsum, int64_t K,
                                             const uint8_t* w, float* y, int64_t N,
                                             uintptr_t ahead, uint64_t start, uint64_t share) {
  static_assert(F::kGroupRows % 16 == 0);
  const int64_t records = K / F::kRows, xgroups = K / kGroup;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t r = 0; r < records; ++r, w += F::kRecord) {
    for (int64_t g = 0; g < F::kRows / F::kGroupRows; ++g) {
      prefetch_group<F>(ahead, start, share, r * F::kRecord, g);
      const int64_t k0 = r * F::kRows + g * F::kGroupRows;
      __m512i sums[MR];
      for (int m = 0; m < MR; ++m) sums[m] = _mm512_setzero_si512();
      for (int64_t k = 0; k < F::kGroupRows; k += 8) {
        dot_rows<MR>(sums, xq + k0 + k, K, codes4<F, 0>(w, g * F::kGroupRows + k));
        dot_rows<MR>(sums, xq + k0 + k + 4, K, codes4<F, 4>(w, g * F::kGroupRows + k + 4));
      }
      __m256 s0, s1;
      F::scale(w, g, s0, s1);
      const __m512 s = join512(s0, s1);
      for (int m = 0; m < MR; ++m) {
        const __m512i lift = _mm512_set1_epi32(lifted_part<F>(xqsum, m, K, k0));
        const __m512i exact = _mm512_sub_epi32(sums[m], lift);
        const __m512 d = _mm512_set1_ps(xd[m * xgroups + k0 / kGroup]);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), d), s, acc[m]);
      }
      if constexpr (F::kMin) add_minimums512<MR, F>(acc, w, g, xsum + k0 / F::kGroupRows, K / F::kGroupRows);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y + m * N, acc[m]);
}

// Blocks [first, last) for all M rows over int8 activations, as grouped_blocks.
template <bool kWide, class F>
void grouped_blocks_q8x(const int8_t* xq, const int32_t* xqsum, const float* xd,
                        const float* xsum, int64_t M, int64_t K, const uint8_t* w, float* y,
                        int64_t N, int64_t first, int64_t last) {
  const int64_t groups = K / kGroup;
  grouped_runs<kWide ? 8 : 4>(
      M, K / F::kRows * F::kRecord, w, y, first, last,
      [=](auto mr, int64_t m, const uint8_t* wb, float* yb, uintptr_t ahead, uint64_t start,
          uint64_t share) {
        constexpr int MR = decltype(mr)::value;
        if constexpr (kWide) {
          grouped_tile_q8x512<MR, F>(xq + m * K, xqsum + m * (K / 16), xd + m * groups,
                                     xsum + m * (K / F::kGroupRows), K, wb, yb + m * N, N, ahead, start, share);
        } else {
          grouped_tile_q8x<MR, F>(xq + m * K, xqsum + m * (K / 16), xd + m * groups,
                                  xsum + m * (K / F::kGroupRows), K, wb, yb + m * N, N, ahead, start, share);
        }
      });
}

// AVX-512 VNNI and VBMI where the CPU has them, unless CADENCE_CPU_AVX512=0.
bool use_vnni() {
  static const bool use = use_avx512() && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  return use;
}

// x's rows quantized per 32 k-rows: codes round(x / d) in [-127, 127], d = amax / 127 (0 for
// a group of zeros, whose codes are 0), and the codes' sums per 16 k-rows (`xqsum`, what the
// tiles take off lifted codes' sums).
void quantize_rows(const float* x, int64_t groups, int8_t* xq, float* xd, int32_t* xqsum) {
  static_assert(kGroup == 32, "two sums of 16 k-rows a group");
  for (int64_t i = 0; i < groups; ++i) {
    const float* g = x + i * kGroup;
    float amax = 0.0f;
    for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(g[k]));
    const float d = amax / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
    xd[i] = d;
    int32_t halves[2] = {0, 0};
    for (int64_t k = 0; k < kGroup; ++k) {
      const int8_t code = static_cast<int8_t>(std::nearbyint(g[k] * inverse));
      xq[i * kGroup + k] = code;
      halves[k / 16] += code;
    }
    xqsum[2 * i] = halves[0];
    xqsum[2 * i + 1] = halves[1];
  }
}

}  // namespace
