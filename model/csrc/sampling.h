// cadence's CPU kernels for sampling (model/sampling.py): argmax, top-k's and top-p's
// thresholds, and the draw's noise.
// A part of cpu_kernels.cc's one translation unit (see there), included by it alone.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#include "isa.h"
#include "workers.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Each row's likeliest token: the index of its first maximum, or of its first NaN where it has
// one (jnp.argmax's answer). XLA:CPU lowers argmax to a reduction over (value, index) pairs
// that it does not vectorize: 2-3 ms a decode step for 8 rows of a 151,936-token vocabulary.
// Here one pass finds the row's maximum (and whether it holds a NaN), vectorized, and a second
// the first index holding it.
int32_t argmax_row(const float* x, int64_t n) {
  __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(v, top);  // a NaN in v leaves top as it was
  }
  float best = -INFINITY;
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (float lane : lanes) best = std::max(best, lane);
  for (int64_t j = i; j < n; ++j) {
    any_nan |= std::isnan(x[j]);
    if (x[j] > best) best = x[j];
  }
  // The first index holding the maximum (the first NaN where there is one).
  const __m256 want = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hits = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                                : _mm256_cmp_ps(v, want, _CMP_EQ_OQ));
    if (hits) return static_cast<int32_t>(i + __builtin_ctz(hits));
  }
  for (; i < n; ++i) {
    if (any_nan ? std::isnan(x[i]) : x[i] == best) return static_cast<int32_t>(i);
  }
  return 0;  // not reached: some element holds the maximum
}

ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] < 1 || out->element_count() != xd[0]) {
    return ffi::Error::InvalidArgument("cadence_cpu_argmax takes x [rows, n >= 1] and gives [rows]");
  }
  const int64_t n = xd[1];
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  parallel_for(pool, xd[0], 1, [=](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) op[row] = argmax_row(xp + row * n, n);
  });
  return ffi::Error::Success();
}

// Sampling's thresholds over a row's order keys (model/sampling.py's `_order_keys`: float32
// logits as uint32 in the same order): the largest key t with sum(w[keys >= t]) >= target, over
// the positive weights. With every weight 1 and target k it is the k-th largest key (top-k's
// threshold); with the probabilities and top_p of their sum, top-p's. model/sampling.py's
// `_threshold` finds it in 32 halvings of the key range, each a masked sum over the row; here
// one pass sums the mass in bins of the keys' top 11 bits, a scan from the top finds the bin
// where the mass reaches the target, and a selection among that bin's items (quickselect by
// mass) finds the key. Sums in double, closer than the bisection's float32 ones where those
// round across the target. A NaN weight or target answers 0 (as the bisection does in
// `nucleus`, where a NaN probability makes the target NaN), a target <= 0 the largest key
// (every t qualifies), one beyond the row's mass 0 (none does).
constexpr int kBinBits = 11;

// The key where the mass of `items` (in one bin), taken from the top after `above`, reaches
// `target`, which their mass and `above` together reach.
uint32_t select_by_mass(std::vector<std::pair<uint32_t, float>>& items, double above, double target) {
  size_t lo = 0, hi = items.size();
  while (hi - lo > 32) {
    const uint32_t a = items[lo].first, b = items[lo + (hi - lo) / 2].first, c = items[hi - 1].first;
    const uint32_t pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));  // median of 3
    // [lo, gt) > pivot, [gt, i) == pivot, [lt, hi) < pivot.
    size_t gt = lo, i = lo, lt = hi;
    double greater = 0, equal = 0;
    while (i < lt) {
      const uint32_t key = items[i].first;
      if (key > pivot) {
        greater += items[i].second;
        std::swap(items[i++], items[gt++]);
      } else if (key < pivot) {
        std::swap(items[i], items[--lt]);
      } else {
        equal += items[i++].second;
      }
    }
    if (above + greater >= target) {
      hi = gt;
    } else if (above + greater + equal >= target) {
      return pivot;
    } else {
      above += greater + equal;
      lo = lt;
    }
  }
  std::sort(items.begin() + lo, items.begin() + hi,
            [](const auto& x, const auto& y) { return x.first > y.first; });
  for (size_t i = lo; i < hi;) {
    const uint32_t key = items[i].first;
    for (; i < hi && items[i].first == key; ++i) above += items[i].second;
    if (above >= target) return key;
  }
  // Reached only where the items' sums, added in another order than the bin's, fall a
  // rounding short of the target: every item of the bin stays.
  return std::min_element(items.begin(), items.end())->first;
}

// `w` nullptr: every weight 1.
uint32_t threshold_row(const uint32_t* keys, const float* w, int64_t n, double target,
                       std::vector<std::pair<uint32_t, float>>& items) {
  constexpr int kShift = 32 - kBinBits;
  double mass[2][1 << kBinBits] = {};  // two copies, so that neighbours in one bin do not wait
  bool nan = false;
  for (int64_t j = 0; j < n; ++j) {
    const float x = w ? w[j] : 1.0f;
    if (x > 0) {
      mass[j & 1][keys[j] >> kShift] += x;
    } else {
      nan |= std::isnan(x);
    }
  }
  if (nan || std::isnan(target)) return 0;
  if (target <= 0) return std::numeric_limits<uint32_t>::max();
  double above = 0;
  int bin = (1 << kBinBits) - 1;
  for (; bin >= 0; --bin) {
    const double here = mass[0][bin] + mass[1][bin];
    if (above + here >= target) break;
    above += here;
  }
  if (bin < 0) return 0;
  items.clear();
  for (int64_t j = 0; j < n; ++j) {
    const float x = w ? w[j] : 1.0f;
    if (static_cast<int>(keys[j] >> kShift) == bin && x > 0) items.emplace_back(keys[j], x);
  }
  return select_by_mass(items, above, target);
}

// `threshold_row` of each row of keys [rows, n]: weights `wp` [rows, n] (nullptr: every weight
// 1), the row's target `target(row)`.
template <class Target>
void thresholds(ffi::ThreadPool& pool, const uint32_t* kp, const float* wp, int64_t rows, int64_t n,
                Target target, uint32_t* op) {
  parallel_for(pool, rows, 1, [=](int64_t first, int64_t last) {
    std::vector<std::pair<uint32_t, float>> items;
    for (int64_t r = first; r < last; ++r) {
      op[r] = threshold_row(kp + r * n, wp ? wp + r * n : nullptr, n, target(r), items);
    }
  });
}

// Top-k's: each row's k-th largest key, k = ks[row] clipped into [1, n].
ffi::Error KthLargest(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::S32> ks,
                      ffi::ResultBuffer<ffi::U32> out) {
  const auto kd = keys.dimensions();
  if (kd.size() != 2 || kd[1] < 1 || ks.element_count() != kd[0] || out->element_count() != kd[0]) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_kth_largest takes keys [rows, n >= 1] and k [rows], and gives [rows]");
  }
  const int64_t n = kd[1];
  const int32_t* kk = ks.typed_data();
  thresholds(pool, keys.typed_data(), nullptr, kd[0], n,
             [=](int64_t r) { return static_cast<double>(std::clamp<int64_t>(kk[r], 1, n)); },
             out->typed_data());
  return ffi::Error::Success();
}

// Top-p's: each row's threshold for its weights (the kept tokens' probabilities) and target.
ffi::Error MassThreshold(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::F32> w,
                         ffi::Buffer<ffi::F32> target, ffi::ResultBuffer<ffi::U32> out) {
  const auto kd = keys.dimensions();
  if (kd.size() != 2 || kd[1] < 1 || w.element_count() != kd[0] * kd[1] ||
      target.element_count() != kd[0] || out->element_count() != kd[0]) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_mass_threshold takes keys and weights [rows, n >= 1] and targets [rows], and "
        "gives [rows]");
  }
  const float* tp = target.typed_data();
  thresholds(pool, keys.typed_data(), w.typed_data(), kd[0], kd[1],
             [=](int64_t r) { return static_cast<double>(tp[r]); }, out->typed_data());
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// The draw's noise. A sampled row draws jax.random.categorical's token: the argmax of its kept
// scaled logits plus Gumbel noise, the noise of element j being -log(-log(u)) for u the
// uniform float32 of threefry2x32's bits for the counter (0, j) under the row's key (JAX's
// partitionable threefry). XLA generates and stores that noise for the whole vocabulary, 8.6
// ms a step for 8 x 151,936 on 2 cores. Here it is made 8 lanes at once and compared as it is
// made, skipping tokens no filter kept; its logs are not XLA's to the bit, so the kernel gives
// the few tokens whose score is within the two logs' difference of the best (almost always
// one), and model/sampling.py's `_draw` scores those with XLA's own noise: the same token.

template <int R>
inline __m256i rotl32(__m256i x) {
  return _mm256_or_si256(_mm256_slli_epi32(x, R), _mm256_srli_epi32(x, 32 - R));
}

template <int A, int B, int C, int D>
inline void threefry_rounds(__m256i& x0, __m256i& x1) {
  x0 = _mm256_add_epi32(x0, x1), x1 = _mm256_xor_si256(x0, rotl32<A>(x1));
  x0 = _mm256_add_epi32(x0, x1), x1 = _mm256_xor_si256(x0, rotl32<B>(x1));
  x0 = _mm256_add_epi32(x0, x1), x1 = _mm256_xor_si256(x0, rotl32<C>(x1));
  x0 = _mm256_add_epi32(x0, x1), x1 = _mm256_xor_si256(x0, rotl32<D>(x1));
}

// JAX's 32 random bits for elements j of a one-dimensional draw under key (k0, k1): threefry2x32
// (20 rounds) of the counters (0, j), its two words xor-ed.
inline __m256i threefry_bits(uint32_t k0, uint32_t k1, __m256i j) {
  const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
  const auto add = [](__m256i x, uint32_t k) { return _mm256_add_epi32(x, _mm256_set1_epi32(static_cast<int>(k))); };
  __m256i x0 = _mm256_set1_epi32(static_cast<int>(k0)), x1 = add(j, k1);
  threefry_rounds<13, 15, 26, 6>(x0, x1), x0 = add(x0, k1), x1 = add(x1, k2 + 1);
  threefry_rounds<17, 29, 16, 24>(x0, x1), x0 = add(x0, k2), x1 = add(x1, k0 + 2);
  threefry_rounds<13, 15, 26, 6>(x0, x1), x0 = add(x0, k0), x1 = add(x1, k1 + 3);
  threefry_rounds<17, 29, 16, 24>(x0, x1), x0 = add(x0, k1), x1 = add(x1, k2 + 4);
  threefry_rounds<13, 15, 26, 6>(x0, x1), x0 = add(x0, k2), x1 = add(x1, k0 + 5);
  return _mm256_xor_si256(x0, x1);
}

// log for 8 positive normal floats (Cephes' logf): relative error about 1e-7. The polynomial's
// coefficients, highest power first, and log(2) in two parts:
constexpr float kLogPoly[9] = {7.0376836292e-2f,  -1.1514610310e-1f, 1.1676998740e-1f,
                               -1.2420140846e-1f, 1.4249322787e-1f,  -1.6668057665e-1f,
                               2.0000714765e-1f,  -2.4999993993e-1f, 3.3333331174e-1f};
constexpr float kLn2Low = -2.12194440e-4f, kLn2High = 0.693359375f;
inline __m256 log256(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256i xi = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(126)));
  __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(xi, _mm256_set1_epi32(0x007FFFFF)),
                                                 _mm256_set1_epi32(0x3F000000)));  // [0.5, 1)
  // m below sqrt(1/2): 2m - 1 and e - 1; else m - 1 (both exact).
  const __m256 low = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_sub_ps(e, _mm256_and_ps(low, one));
  m = _mm256_add_ps(_mm256_sub_ps(m, one), _mm256_and_ps(low, m));
  const __m256 z = _mm256_mul_ps(m, m);
  __m256 y = _mm256_set1_ps(kLogPoly[0]);
  for (int i = 1; i < 9; ++i) y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(kLogPoly[i]));
  y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(kLn2Low), y);
  y = _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), z, y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(kLn2High), _mm256_add_ps(m, y));
}

// Gumbel noise from 32 random bits, as jax.random.gumbel makes it: u = max(tiny, f + tiny) for
// f the float in [0, 1) of the bits' top 23, then -log(-log(u)).
inline __m256 gumbel256(__m256i bits) {
  const __m256 f = _mm256_sub_ps(
      _mm256_castsi256_ps(_mm256_or_si256(_mm256_srli_epi32(bits, 9), _mm256_set1_epi32(0x3F800000))),
      _mm256_set1_ps(1.0f));
  const __m256 tiny = _mm256_set1_ps(std::numeric_limits<float>::min());
  const __m256 u = _mm256_max_ps(tiny, _mm256_add_ps(f, tiny));
  const __m256 zero = _mm256_setzero_ps();
  return _mm256_sub_ps(zero, log256(_mm256_sub_ps(zero, log256(u))));
}

// The same for 16 lanes, where the CPU has AVX-512: each lane computes what an AVX2 lane does
// (one rotate for the three instructions of AVX2's).
template <int A, int B, int C, int D>
CADENCE_AVX512 inline void threefry_rounds512(__m512i& x0, __m512i& x1) {
  x0 = _mm512_add_epi32(x0, x1), x1 = _mm512_xor_si512(x0, _mm512_rol_epi32(x1, A));
  x0 = _mm512_add_epi32(x0, x1), x1 = _mm512_xor_si512(x0, _mm512_rol_epi32(x1, B));
  x0 = _mm512_add_epi32(x0, x1), x1 = _mm512_xor_si512(x0, _mm512_rol_epi32(x1, C));
  x0 = _mm512_add_epi32(x0, x1), x1 = _mm512_xor_si512(x0, _mm512_rol_epi32(x1, D));
}

CADENCE_AVX512 inline __m512i threefry_bits512(uint32_t k0, uint32_t k1, __m512i j) {
  const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
  const auto add = [](__m512i x, uint32_t k) CADENCE_AVX512 {
    return _mm512_add_epi32(x, _mm512_set1_epi32(static_cast<int>(k)));
  };
  __m512i x0 = _mm512_set1_epi32(static_cast<int>(k0)), x1 = add(j, k1);
  threefry_rounds512<13, 15, 26, 6>(x0, x1), x0 = add(x0, k1), x1 = add(x1, k2 + 1);
  threefry_rounds512<17, 29, 16, 24>(x0, x1), x0 = add(x0, k2), x1 = add(x1, k0 + 2);
  threefry_rounds512<13, 15, 26, 6>(x0, x1), x0 = add(x0, k0), x1 = add(x1, k1 + 3);
  threefry_rounds512<17, 29, 16, 24>(x0, x1), x0 = add(x0, k1), x1 = add(x1, k2 + 4);
  threefry_rounds512<13, 15, 26, 6>(x0, x1), x0 = add(x0, k2), x1 = add(x1, k0 + 5);
  return _mm512_xor_si512(x0, x1);
}

CADENCE_AVX512 inline __m512 log512(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i xi = _mm512_castps_si512(x);
  __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(xi, 23), _mm512_set1_epi32(126)));
  __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(xi, _mm512_set1_epi32(0x007FFFFF)),
                                                 _mm512_set1_epi32(0x3F000000)));
  const __mmask16 low = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm512_mask_sub_ps(e, low, e, one);
  m = _mm512_mask_add_ps(_mm512_sub_ps(m, one), low, _mm512_sub_ps(m, one), m);
  const __m512 z = _mm512_mul_ps(m, m);
  __m512 y = _mm512_set1_ps(kLogPoly[0]);
  for (int i = 1; i < 9; ++i) y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(kLogPoly[i]));
  y = _mm512_mul_ps(_mm512_mul_ps(y, m), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(kLn2Low), y);
  y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(kLn2High), _mm512_add_ps(m, y));
}

CADENCE_AVX512 inline __m512 gumbel512(__m512i bits) {
  const __m512 f = _mm512_sub_ps(
      _mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(bits, 9), _mm512_set1_epi32(0x3F800000))),
      _mm512_set1_ps(1.0f));
  const __m512 tiny = _mm512_set1_ps(std::numeric_limits<float>::min());
  const __m512 u = _mm512_max_ps(tiny, _mm512_add_ps(f, tiny));
  const __m512 zero = _mm512_setzero_ps();
  return _mm512_sub_ps(zero, log512(_mm512_sub_ps(zero, log512(u))));
}

// Scores of the 16 tokens j.. of a row: x[0..16) plus their noise under key (k0, k1).
void scores16(const float* x, int32_t j, uint32_t k0, uint32_t k1, float* out) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int h = 0; h < 16; h += 8) {
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(j + h), lanes);
    _mm256_storeu_ps(out + h, _mm256_add_ps(_mm256_loadu_ps(x + h), gumbel256(threefry_bits(k0, k1, index))));
  }
}

CADENCE_AVX512 void scores16_512(const float* x, int32_t j, uint32_t k0, uint32_t k1, float* out) {
  const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(j),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(x), gumbel512(threefry_bits512(k0, k1, index))));
}

CADENCE_AVX512 void gumbel_of_bits512(const uint32_t* bits, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    _mm512_storeu_ps(out + i, gumbel512(_mm512_loadu_si512(bits + i)));
  }
}

// The noise of `bits` (AVX-512's where `wide`), for its exhaustive test against XLA's
// (tests/test_sampling.py).
ffi::Error GumbelOfBits(ffi::Buffer<ffi::U32> bits, ffi::ResultBuffer<ffi::F32> out, bool wide) {
  const int64_t n = bits.element_count();
  if (out->element_count() != n || n % 16) {
    return ffi::Error::InvalidArgument("cadence_cpu_gumbel_of_bits takes bits [16 k] and gives [16 k]");
  }
  if (wide && !use_avx512()) return ffi::Error::InvalidArgument("this CPU runs no AVX-512 here");
  if (wide) {
    gumbel_of_bits512(bits.typed_data(), n, out->typed_data());
    return ffi::Error::Success();
  }
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits.typed_data() + i));
    _mm256_storeu_ps(out->typed_data() + i, gumbel256(b));
  }
  return ffi::Error::Success();
}

// One row's candidates: the indices j, ascending, whose score x[j] + noise[j] is within twice
// `error` (a bound on the difference between this noise and XLA's), plus the additions'
// rounding, of the row's best score (+inf: the other +inf scores); written up to `width` of
// them, and their count, or width + 1 where a row scores NaN or only -inf (XLA's draw then
// runs, with its answers for those).
// The noise lies within [-log(-log tiny), -log(-log(1 - 2^-23))] = [-4.47, 15.95]: a token whose
// value is more than that span below the row's largest scores below the largest's token
// whatever the noise, so it is never a candidate, and its noise is not made. At temperature 1
// a Qwen2.5 row has a median 7% of its vocabulary within the span of its top, at 0.7 0.1%.
constexpr float kGumbelSpan = 21.0f;  // > 15.95 + 4.47, the slack over the logs' error

// The least value a token may have and still be a candidate: the row's largest finite value
// less the span and the margins the candidates' floor allows; -inf (nothing skipped) where the
// row's largest is +inf or there is none.
inline float hopeless_below(const float* x, int64_t n, float error) {
  __m256 most = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) most = _mm256_max_ps(_mm256_loadu_ps(x + j), most);  // NaN: skipped
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, most);
  float top = -INFINITY;
  for (float v : lanes) top = std::max(top, v);
  for (; j < n; ++j) top = x[j] > top ? x[j] : top;
  if (!std::isfinite(top)) return -INFINITY;
  return top - (kGumbelSpan + 2 * error + (std::fabs(top) + kGumbelSpan) * 0x1p-20f);
}

template <void (*kScores)(const float*, int32_t, uint32_t, uint32_t, float*)>
int64_t gumbel_candidates_row(const float* x, int64_t n, uint32_t k0, uint32_t k1, float error,
                              int32_t* out, int64_t width, std::vector<std::pair<int32_t, float>>& near) {
  near.clear();
  // Blocks of tokens no filter kept or too far below the top (`hopeless_below`) are not scored;
  // a NaN compares false either way, so its block is, and the row goes to XLA's draw.
  const __m256 cutoff = _mm256_set1_ps(hopeless_below(x, n, error));
  const auto hopeful = [&](__m256 v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, cutoff, _CMP_NLT_UQ)); };
  float best = -INFINITY, floor = -INFINITY;  // the best score, and the least a candidate's
  // +inf ties with +inf alone (inf - margin would be NaN, and nothing compares >= NaN).
  const auto floor_of = [error](float top) {
    return std::isinf(top) ? top : top - (2 * error + std::fabs(top) * 0x1p-21f);
  };
  size_t pruned = 64;  // prune `near` when it doubles: linear however many stay
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  const auto kept = [&](__m256 v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, minus_inf, _CMP_NEQ_UQ)); };
  alignas(32) float tail[16], scores[16];
  for (int64_t j = 0; j < n; j += 16) {
    const float* v = x + j;
    if (j + 16 > n) {
      std::fill_n(tail, 16, -INFINITY);
      std::copy(x + j, x + n, tail);
      v = tail;
    }
    const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
    if (!((kept(v0) & hopeful(v0)) | (kept(v1) & hopeful(v1)))) continue;  // none can win
    kScores(v, static_cast<int32_t>(j), k0, k1, scores);
    const __m256 lo = _mm256_load_ps(scores), hi = _mm256_load_ps(scores + 8);
    if (_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(lo, lo, _CMP_UNORD_Q), _mm256_cmp_ps(hi, hi, _CMP_UNORD_Q)))) {
      return width + 1;  // NaN
    }
    const __m256 least = _mm256_set1_ps(floor);
    int hits = (_mm256_movemask_ps(_mm256_cmp_ps(lo, least, _CMP_GE_OQ)) & kept(lo)) |
               ((_mm256_movemask_ps(_mm256_cmp_ps(hi, least, _CMP_GE_OQ)) & kept(hi)) << 8);
    for (; hits; hits &= hits - 1) {
      const int lane = __builtin_ctz(hits);
      if (scores[lane] < floor) continue;
      if (scores[lane] > best) {
        best = scores[lane];
        floor = floor_of(best);
      }
      near.emplace_back(static_cast<int32_t>(j + lane), scores[lane]);
    }
    if (near.size() > pruned) {
      near.erase(std::remove_if(near.begin(), near.end(), [floor](const auto& c) { return c.second < floor; }),
                 near.end());
      if (best == INFINITY && static_cast<int64_t>(near.size()) > width) return width + 1;  // nothing beats +inf
      pruned = std::max<size_t>(64, 2 * near.size());
    }
  }
  if (best == -INFINITY) return width + 1;
  int64_t count = 0;
  for (const auto& [j, score] : near) {
    if (score >= floor) {
      if (count < width) out[count] = j;
      ++count;
    }
  }
  std::fill(out + std::min(count, width), out + width, 0);
  return count;
}

ffi::Error GumbelCandidates(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::F32> x,
                            ffi::ResultBuffer<ffi::S32> candidates, ffi::ResultBuffer<ffi::S32> counts,
                            float error) {
  const auto xd = x.dimensions();
  const auto cd = candidates->dimensions();
  if (xd.size() != 2 || keys.element_count() != 2 * xd[0] || cd.size() != 2 || cd[0] != xd[0] ||
      counts->element_count() != xd[0] || xd[1] >= (int64_t{1} << 31)) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_gumbel_candidates takes keys [rows, 2] and scores [rows, n], and gives "
        "candidates [rows, width] and counts [rows]");
  }
  const int64_t n = xd[1], width = cd[1];
  const uint32_t* kp = keys.typed_data();
  const float* xp = x.typed_data();
  int32_t* op = candidates->typed_data();
  int32_t* cp = counts->typed_data();
  const bool wide = use_avx512();
  parallel_for(pool, xd[0], 1, [=](int64_t first, int64_t last) {
    std::vector<std::pair<int32_t, float>> near;
    for (int64_t r = first; r < last; ++r) {
      const auto row = wide ? gumbel_candidates_row<scores16_512> : gumbel_candidates_row<scores16>;
      const int64_t count = row(xp + r * n, n, kp[2 * r], kp[2 * r + 1], error, op + r * width, width, near);
      cp[r] = static_cast<int32_t>(std::min(count, width + 1));
    }
  });
  return ffi::Error::Success();
}
}  // namespace
