// cadence's CPU kernels: the paged KV pool's: decode attention, writes, pages taken for
// prefill.
// A part of cpu_kernels.cc's one translation unit (see there), included by it alone.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#include "blocked.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Paged decode attention.

// exp for 8 floats (Cephes' single-precision polynomial, as in the common AVX ports): relative
// error about 2e-7 over the range, exp(x) = 0 below -87.3 (the softmax's masked scores).
inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447505531f);
  const __m256 below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  // x = n * ln2 + r, |r| <= ln2 / 2
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(below, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// How the attention kernel widens a pool's elements: as `load8`, except float8_e4m3fn's, left
// 2^-8 of their values (`kAttendScale`, exact), which the query and the output make up for: one
// product fewer per 8 elements of every key and value read.
template <typename T>
inline __m256 attend_load8(const T* p) { return load8(p); }
template <>
inline __m256 attend_load8(const F8E4M3* p) { return load8_e4m3_over_256(p); }
template <typename T>
constexpr float kAttendScale = 1.0f;
template <>
constexpr float kAttendScale<F8E4M3> = 256.0f;

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), attend_load8(b));
  for (int64_t i = 8; i < d; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), attend_load8(b + i), acc);
  }
  return hsum(acc);
}

// Scores of keys [0, n) of a page, s[t] = q . k[t]: four keys at a time, each in its own
// accumulator, reduced together.
template <typename T>
inline void page_scores(const float* q, const T* k, int64_t n, int64_t d, float* s) {
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const T* k0 = k + t * d;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(qv, attend_load8(k0 + i), a0);
      a1 = _mm256_fmadd_ps(qv, attend_load8(k0 + d + i), a1);
      a2 = _mm256_fmadd_ps(qv, attend_load8(k0 + 2 * d + i), a2);
      a3 = _mm256_fmadd_ps(qv, attend_load8(k0 + 3 * d + i), a3);
    }
    // [a0 a1 a2 a3] summed within each 128-bit half, then the halves added.
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(s + t, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  for (; t < n; ++t) s[t] = dot(q, k + t * d, d);
}

// acc[0, 8 * NV) += sum_t p[t] * v[t][0, 8 * NV), the accumulator held in registers.
template <int NV, typename T>
inline void accumulate_part(float* acc, const float* p, const T* v, int64_t n, int64_t d) {
  __m256 a[NV];
  for (int j = 0; j < NV; ++j) a[j] = _mm256_loadu_ps(acc + 8 * j);
  for (int64_t t = 0; t < n; ++t, v += d) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    for (int j = 0; j < NV; ++j) a[j] = _mm256_fmadd_ps(pt, attend_load8(v + 8 * j), a[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + 8 * j, a[j]);
}

// acc[0, d) += sum_t p[t] * v[t]: in parts of 64 lanes (8 registers), the last one shorter.
template <typename T>
inline void accumulate(float* acc, const float* p, const T* v, int64_t n, int64_t d) {
  for (int64_t part = 0; part < d; part += 64) {
    switch (std::min<int64_t>(64, d - part) / 8) {
      case 8: accumulate_part<8>(acc + part, p, v + part, n, d); break;
      case 7: accumulate_part<7>(acc + part, p, v + part, n, d); break;
      case 6: accumulate_part<6>(acc + part, p, v + part, n, d); break;
      case 5: accumulate_part<5>(acc + part, p, v + part, n, d); break;
      case 4: accumulate_part<4>(acc + part, p, v + part, n, d); break;
      case 3: accumulate_part<3>(acc + part, p, v + part, n, d); break;
      case 2: accumulate_part<2>(acc + part, p, v + part, n, d); break;
      default: accumulate_part<1>(acc + part, p, v + part, n, d); break;
    }
  }
}

constexpr int64_t kMaxGroup = 16;     // query heads per KV head
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxPage = 1024;    // tokens per page

// One (row, KV head): the group's queries [group, d] against keys 0..position, a page at a
// time: scores, their running max and sum (online softmax), then the values they weigh. With a
// sliding window (window > 0), only keys after position - window: the pages before the one
// holding the first are never read, and that page's earlier keys are masked.
template <typename T>
void attend_one(const float* q, const T* k_pool, const T* v_pool, const int32_t* table,
                int64_t width, int64_t num_pages, int64_t page_size, int64_t d, int64_t group,
                int32_t position, int32_t window, float* out) {
  if (position < 0) {
    std::fill(out, out + group * d, 0.0f);
    return;
  }
  const int64_t live = std::min<int64_t>(int64_t{position} + 1, width * page_size);
  const int64_t first = window > 0 ? std::max<int64_t>(int64_t{position} - window + 1, 0) : 0;
  alignas(32) float qs[kMaxGroup * kMaxHeadDim];
  alignas(32) float acc[kMaxGroup * kMaxHeadDim];
  alignas(32) float s[kMaxPage + 8];
  float peak[kMaxGroup], total[kMaxGroup];
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t i = 0; i < group * d; ++i) qs[i] = q[i] * scale * kAttendScale<T>;
  std::fill(acc, acc + group * d, 0.0f);
  std::fill(peak, peak + group, -1e30f);
  std::fill(total, total + group, 0.0f);
  for (int64_t j = first / page_size, start = j * page_size; start < live; start += page_size, ++j) {
    const int64_t page = std::clamp<int64_t>(table[j], 0, num_pages - 1);
    const T* kp = k_pool + page * page_size * d;
    const T* vp = v_pool + page * page_size * d;
    const int64_t n = std::min(page_size, live - start);
    const int64_t padded = (n + 7) & ~int64_t{7};
    const int64_t hidden = std::max<int64_t>(first - start, 0);  // keys before the window
    for (int64_t g = 0; g < group; ++g) {
      page_scores(qs + g * d, kp, n, d, s);
      for (int64_t t = 0; t < hidden; ++t) s[t] = -1e30f;  // exp gives 0 (a later key is seen)
      float top = peak[g];
      for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
      for (int64_t t = n; t < padded; ++t) s[t] = -1e30f;  // exp gives 0
      const float correction = std::exp(peak[g] - top);
      peak[g] = top;
      __m256 sum = _mm256_setzero_ps();
      const __m256 top8 = _mm256_set1_ps(top);
      for (int64_t t = 0; t < padded; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), top8));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, e);
      }
      total[g] = total[g] * correction + hsum(sum);
      float* a = acc + g * d;
      if (correction != 1.0f) {
        for (int64_t i = 0; i < d; ++i) a[i] *= correction;
      }
      accumulate(a, s, vp, n, d);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inverse = total[g] > 0 ? 1.0f / total[g] : 0.0f;
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = acc[g * d + i] * inverse * kAttendScale<T>;
  }
}

// The pools' kernels read and write one layer of a pool stacked over layers, [layers,
// kv_heads, num_pages, page_size, d], chosen by `layer` (a [] int32 operand, so that a loop
// over layers is one program body), or a single layer's pool [kv_heads, num_pages, page_size,
// d] (`layer` 0): its shape, and the layer's offset into the stack in elements (-1 where the
// pool's rank or `layer` is wrong).
struct PoolLayer {
  int64_t kv_heads = 0, num_pages = 0, page_size = 0, d = 0, at = -1;
};

PoolLayer pool_layer(const ffi::AnyBuffer::Dimensions pd, ffi::Buffer<ffi::S32> layer) {
  const int64_t rank = pd.size(), layers = rank == 5 ? pd[0] : 1;
  const int32_t l = *layer.typed_data();
  if ((rank != 4 && rank != 5) || layer.element_count() != 1 || l < 0 || l >= layers) return {};
  const int64_t* dims = pd.begin() + (rank - 4);
  return {dims[0], dims[1], dims[2], dims[3], l * dims[0] * dims[1] * dims[2] * dims[3]};
}

// T: the pool's element type (float, `BF16`, `F16`, `F8E4M3`, `F8E5M2`) for FFI's type DT (the
// pages are untyped buffers, checked to be of it: FFI has no native type for 8-bit floats).
template <ffi::DataType DT, typename T>
ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> layer,
                       ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                       ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> positions,
                       ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = page_table.dimensions();
  const PoolLayer pl = pool_layer(kd, layer);
  const int64_t at = pl.at;
  if (qd.size() != 3 || at < 0 || td.size() != 2 || td[0] != qd[0] ||
      positions.element_count() != qd[0] || v_pages.element_count() != k_pages.element_count() ||
      k_pages.element_type() != DT || v_pages.element_type() != DT || pl.d != qd[2] ||
      window.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_paged_decode takes q [rows, heads, d], k/v pages [kv_heads, pages, page_size, "
        "d] (or a layer of them stacked), page_table [rows, width], positions [rows] and a "
        "window []");
  }
  const int64_t rows = qd[0], heads = qd[1], d = qd[2];
  const int64_t kv_heads = pl.kv_heads, num_pages = pl.num_pages, page_size = pl.page_size;
  const int64_t width = td[1];
  if (heads % kv_heads || heads / kv_heads > kMaxGroup || d % 8 || d > kMaxHeadDim ||
      page_size > kMaxPage) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_paged_decode: heads must be a multiple of kv_heads (at most 16 per KV head), "
        "head_dim a multiple of 8 up to 256, pages at most 1024 tokens");
  }
  const int64_t group = heads / kv_heads;
  const float* qp = q.typed_data();
  const T* kp = static_cast<const T*>(k_pages.untyped_data()) + at;
  const T* vp = static_cast<const T*>(v_pages.untyped_data()) + at;
  const int32_t* tp = page_table.typed_data();
  const int32_t* pp = positions.typed_data();
  const int32_t w = *window.typed_data();
  float* op = out->typed_data();
  const int64_t pool_stride = num_pages * page_size * d;  // one KV head's pages
  parallel_for(pool, rows * kv_heads, 1, [=](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t row = item / kv_heads, h = item % kv_heads;
      const int64_t offset = (row * heads + h * group) * d;
      attend_one(qp + offset, kp + h * pool_stride, vp + h * pool_stride, tp + row * width, width,
                 num_pages, page_size, d, group, pp[row], w, op + offset);
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Paged KV write, in place.
//
// A layer of pages [layers, kv_heads, num_pages, page_size, d] (the result, the same buffer
// when XLA aliases it, as a donated pool is), values [rows, t, kv_heads, d] already in the
// pool's dtype (8, 16 or 32 bits), and each token's page and slot in it [rows, t]: a token whose
// page is outside [0, num_pages) is dropped (the scatter's mode="drop", which
// `model.paged_kv.write` routes padding to). Tokens are written in order, so of two with one
// slot the later stands.
template <typename E>
void write_tokens(ffi::ThreadPool& pool, const E* src, E* dst, const int32_t* pp,
                  const int32_t* sp, int64_t tokens, int64_t kv_heads, int64_t num_pages,
                  int64_t page_size, int64_t d) {
  parallel_for(pool, kv_heads, 1, [=](int64_t first, int64_t last) {
    for (int64_t h = first; h < last; ++h) {
      for (int64_t i = 0; i < tokens; ++i) {
        if (pp[i] < 0 || pp[i] >= num_pages || sp[i] < 0 || sp[i] >= page_size) continue;
        std::copy_n(src + (i * kv_heads + h) * d, d,
                    dst + ((h * num_pages + pp[i]) * page_size + sp[i]) * d);
      }
    }
  });
}

ffi::Error PagedWrite(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer pages,
                      ffi::AnyBuffer values, ffi::Buffer<ffi::S32> page, ffi::Buffer<ffi::S32> slot,
                      ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pages.dimensions(), vd = values.dimensions();
  const PoolLayer pl = pool_layer(pd, layer);
  const int64_t width = ffi::ByteWidth(pages.element_type());
  if (pl.at < 0 || vd.size() != 4 || vd[2] != pl.kv_heads || vd[3] != pl.d ||
      page.element_count() != vd[0] * vd[1] || slot.element_count() != vd[0] * vd[1] ||
      (width != 1 && width != 2 && width != 4) || values.element_type() != pages.element_type() ||
      out->element_type() != pages.element_type() || out->element_count() != pages.element_count()) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_paged_write takes a layer of an 8-, 16- or 32-bit pool [layers, kv_heads, pages, "
        "page_size, d], values [rows, t, kv_heads, d] of its dtype, and page and slot [rows, t] "
        "int32");
  }
  if (out->untyped_data() != pages.untyped_data()) {  // not aliased: the result starts as the pool
    std::memcpy(out->untyped_data(), pages.untyped_data(), pages.size_bytes());
  }
  const int64_t tokens = vd[0] * vd[1];
  if (width == 1) {
    write_tokens(pool, static_cast<const uint8_t*>(values.untyped_data()),
                 static_cast<uint8_t*>(out->untyped_data()) + pl.at, page.typed_data(),
                 slot.typed_data(), tokens, pl.kv_heads, pl.num_pages, pl.page_size, pl.d);
  } else if (width == 2) {
    write_tokens(pool, static_cast<const uint16_t*>(values.untyped_data()),
                 static_cast<uint16_t*>(out->untyped_data()) + pl.at, page.typed_data(),
                 slot.typed_data(), tokens, pl.kv_heads, pl.num_pages, pl.page_size, pl.d);
  } else {
    write_tokens(pool, static_cast<const uint32_t*>(values.untyped_data()),
                 static_cast<uint32_t*>(out->untyped_data()) + pl.at, page.typed_data(),
                 slot.typed_data(), tokens, pl.kv_heads, pl.num_pages, pl.page_size, pl.d);
  }
  return ffi::Error::Success();
}

// Pages `ids` (clipped into the pool) of a layer of a pool [layers, kv_heads, num_pages,
// page_size, d], widened (exactly) to float32 where 8- or 16-bit: [kv_heads, n, page_size, d].
template <ffi::DataType DT, typename T>
ffi::Error TakePages(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer pages,
                     ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> out) {
  const auto pd = pages.dimensions();
  const int64_t n = ids.element_count();
  const PoolLayer pl = pool_layer(pd, layer);
  if (pl.at < 0 || pl.d % 8 || pages.element_type() != DT ||
      out->element_count() != pl.kv_heads * n * pl.page_size * pl.d) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_take_pages takes a layer of pages [layers, kv_heads, pages, page_size, d] "
        "(d a multiple of 8) and ids [n], and gives [kv_heads, n, page_size, d]");
  }
  const int64_t kv_heads = pl.kv_heads, num_pages = pl.num_pages, run = pl.page_size * pl.d;
  const T* src = static_cast<const T*>(pages.untyped_data()) + pl.at;
  const int32_t* ip = ids.typed_data();
  float* dst = out->typed_data();
  parallel_for(pool, kv_heads * n, 1, [=](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t h = item / n, page = std::clamp<int64_t>(ip[item % n], 0, num_pages - 1);
      const T* from = src + (h * num_pages + page) * run;
      float* to = dst + item * run;
      for (int64_t i = 0; i < run; i += 8) _mm256_storeu_ps(to + i, load8(from + i));
    }
  });
  return ffi::Error::Success();
}

}  // namespace
