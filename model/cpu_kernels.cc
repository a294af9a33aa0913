// cadence's CPU kernels for the decode step, as XLA FFI custom calls (x86-64, AVX2 + FMA).
//
// Built and registered by model/cpu_kernels.py, which also holds the slow paths they are tested
// against. A decode step reads every weight and every live KV entry once; on XLA:CPU its
// matmuls of 2-16 rows pack the weights anew on every call and its paged attention pays a loop
// step per page, so the step ran at 3-6x the time of reading them. These kernels read each
// byte once, in the order it lies in memory:
//
//   cadence_cpu_layered_matmul   y[M, N] = x[M, K] @ W for W in the kernels' layouts, over the
//                            leading `live` rows of x (a prefill's rows that hold tokens; the
//                            rest, its bucket's padding, come out zero),
//                            (model/block_layout.py): float blocks [N / 16, K, 16] (float32,
//                            or a checkpoint's bfloat16 / float16 widened in registers), each
//                            block of 16 output columns one contiguous run, streamed once
//                            while 1-4 rows accumulate in registers; or GGUF's quantized
//                            blocks, re-laid so that a block's record per 32 or 256 k-rows
//                            holds its 16 columns' scales (and minimums) and codes: q8 / q4 /
//                            q5 (Q8_0, Q4_0 and Q4_1, Q5_0) and q4k / q5k / q6k (the K-quants
//                            Q4_K, Q5_K, Q6_K). Codes are widened to floats in registers and
//                            summed against x, and each group's sums are scaled once (plus
//                            min * the group's sum of x): the float32 kernel's numbers over the
//                            dequantized weights, summed in another order; with AVX-512 where
//                            the CPU has it (eight rows a pass), to the same bits; or, over
//                            int8 activations, as integer dot products (AVX-512 VNNI's where
//                            the CPU has it, to the same bits). W is one layer's matrix of a
//                            buffer that may hold every layer's, each in its own format (a []
//                            int32 `layer` operand picks it), so that a loop over layers is
//                            one program body (model/layer_loop.py).
//   cadence_cpu_layered_dequantize   the float32 W [K, N] of such a matrix (or of a run of its
//                            blocks), for prefill's GEMM.
//   cadence_cpu_blocked_matmul_int8   int8 blocks, widened in registers, with a float scale
//                            per output column: a quarter of float32's bytes (`live` rows too).
//   cadence_cpu_paged_decode     one query token per row over its pages of a paged KV pool,
//                            online softmax in float32, keys 0..position of the row (the
//                            last `window` of them where window > 0).
//   cadence_cpu_paged_write      new keys or values into their slots of a pool, in place:
//                            XLA:CPU has no 16-bit scatter, and widens the whole pool layer to
//                            float32 and back around one; within the layer loop, a layer of a
//                            pool stacked over layers, which XLA would copy out.
//   cadence_cpu_take_pages{,_bf16,_f16,_f8e4m3,_f8e5m2}   pages of a pool, widened to float32
//                            (prefill's key tiles): XLA:CPU widens the whole pool before a
//                            16-bit gather.
//   cadence_cpu_argmax           each row's likeliest token, as jnp.argmax: XLA:CPU does not
//                            vectorize its reduction over (value, index) pairs.
//   cadence_cpu_kth_largest      each row's k-th largest key, top-k's threshold for sampling.
//   cadence_cpu_mass_threshold   top-p's threshold: the key where a row's mass from the top
//                            reaches a target, by selection.
//   cadence_cpu_gumbel_candidates   the tokens that may win a row's draw: its Gumbel noise
//                            made and compared in one pass (`_of_bits`: the noise alone).
//
// The pool kernels take a pool of one layer or a layer of a stack of them (`pool_layer`).
//
// Work is split between the calling thread and the kernels' own workers (`Workers`: as many as
// XLA:CPU's intra-op pool has threads, less one), which spin between the calls of a step.
//
// One translation unit, in parts (model/csrc/, each included here alone): workers.h, the
// parallel loop; blocked.h, the matmul over float and int8 blocks; grouped.h, GGUF's formats
// as the kernels lay them out and the grouped tiles over float32 activations; int8_activations.h,
// the tiles over int8 activations; pool.h, the paged pool's kernels; sampling.h, sampling's.
// This file holds the handlers: the grouped matmul's dispatch, the dequantizer, the layered
// weights, and the FFI registrations.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#include "csrc/blocked.h"
#include "csrc/grouped.h"
#include "csrc/int8_activations.h"
#include "csrc/pool.h"
#include "csrc/sampling.h"
#include "csrc/workers.h"

namespace {

// y [M, blocks * 16] = x [M, K] @ W for W's grouped blocks at wp.
template <class F, bool kInt8>
void grouped_run(ffi::ThreadPool& pool, const float* xp, int64_t M, int64_t K, const uint8_t* wp,
                 float* yp, int64_t blocks) {
  const int64_t N = blocks * kBlock, groups = M * K / kGroup;
  // Work items of about 256 KiB of blocks, as the float32 kernel's, and at least one per
  // thread. Items of 256 KiB of float32 columns (39-64 KiB of blocks) made a decode step of
  // Qwen2.5-0.5B Q4_K_M 8% slower at one row and 5% at eight (int8 activations: 16% and 9%)
  // on a 2-core Intel Xeon: 4-6 times as many items, each a shorter stream
  // (bench/results/avx512-cpu/grain.txt).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t grain = std::max<int64_t>(
      1, std::min((256 << 10) / (K / F::kRows * F::kRecord), (blocks + threads - 1) / threads));
  // Each row's sums over the format's groups, for the minimums (formats without them need none).
  const int64_t sum_groups = M * K / F::kGroupRows;
  std::unique_ptr<float[]> sums(new float[F::kMin ? sum_groups : 1]);
  for (int64_t i = 0; F::kMin && i < sum_groups; ++i) {
    float total = 0.0f;
    for (int64_t k = 0; k < F::kGroupRows; ++k) total += xp[i * F::kGroupRows + k];
    sums[i] = total;
  }
  const float* xsum = sums.get();
  if constexpr (kInt8) {
    std::unique_ptr<int8_t[]> codes(new int8_t[M * K]);
    std::unique_ptr<float[]> scales(new float[groups]);
    std::unique_ptr<int32_t[]> code_sums(new int32_t[2 * groups]);
    quantize_rows(xp, groups, codes.get(), scales.get(), code_sums.get());
    const int8_t* xq = codes.get();
    const float* xs = scales.get();
    const int32_t* xqsum = code_sums.get();
    const bool wide = use_vnni();
    parallel_for(pool, blocks, grain, [=](int64_t first, int64_t last) {
      if (wide) {
        grouped_blocks_q8x<true, F>(xq, xqsum, xs, xsum, M, K, wp, yp, N, first, last);
      } else {
        grouped_blocks_q8x<false, F>(xq, xqsum, xs, xsum, M, K, wp, yp, N, first, last);
      }
    });
  } else {
    const bool wide = use_avx512();
    parallel_for(pool, blocks, grain, [=](int64_t first, int64_t last) {
      if (wide) {
        grouped_blocks<true, F>(xp, xsum, M, K, wp, yp, N, first, last);
      } else {
        grouped_blocks<false, F>(xp, xsum, M, K, wp, yp, N, first, last);
      }
    });
  }
}

// The float32 matrix W [K, N] a grouped array stands for, written out for prefill's GEMM (XLA's,
// compute-bound over many rows, where the record-at-a-time tile above is not). Each weight is
// code * scale (+ minimum) with the tile's own codes and multipliers: the products are exact
// (see the layouts above), so contracted into an FMA or not, every weight is the value GGUF's
// dequantizer gives.
template <class F>
void dequantize_blocks(const uint8_t* w, int64_t K, float* out, int64_t N, int64_t first, int64_t last) {
  const int64_t records = K / F::kRows;
  for (int64_t b = first; b < last; ++b) {
    const uint8_t* r = w + b * records * F::kRecord;
    for (int64_t rec = 0; rec < records; ++rec, r += F::kRecord) {
      for (int64_t g = 0; g < F::kRows / F::kGroupRows; ++g) {
        __m256 s0, s1, m0, m1;
        F::scale(r, g, s0, s1);
        if constexpr (F::kMin) F::minimum(r, g, m0, m1);
        for (int64_t k = 0; k < F::kGroupRows; k += F::kStep) {
          __m128i q[F::kStep];
          F::codes(r, g * F::kGroupRows + k, q);
          for (int s = 0; s < F::kStep; ++s) {
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q[s]));
            const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q[s], 8)));
            __m256 w0 = _mm256_mul_ps(q0, s0), w1 = _mm256_mul_ps(q1, s1);
            if constexpr (F::kMin) {
              w0 = _mm256_add_ps(w0, m0);
              w1 = _mm256_add_ps(w1, m1);
            }
            float* row = out + (rec * F::kRows + g * F::kGroupRows + k + s) * N + b * kBlock;
            _mm256_storeu_ps(row, w0);
            _mm256_storeu_ps(row + 8, w1);
          }
        }
      }
    }
  }
}

// out [K, blocks * 16] from the grouped blocks at wp.
template <class F>
void dequantize_run(ffi::ThreadPool& pool, const uint8_t* wp, int64_t K, int64_t blocks, float* op) {
  // Items of about 256 KiB written each.
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / (K * kBlock * 4));
  parallel_for(pool, blocks, grain, [=](int64_t first, int64_t last) {
    dequantize_blocks<F>(wp, K, op, blocks * kBlock, first, last);
  });
}

// ---------------------------------------------------------------------------------------------
// Every layer's matrix of one role in one buffer: the layer loop's weights.
//
// w holds a model's matrices of one role (a layer's q/k/v, its down projection...), each in
// the layout of its format, at byte offsets[l] for layer l, in formats[l]: formats may differ
// between layers (a Q4_K_M file keeps some layers' down projections in Q6_K). `layer` ([]
// int32) picks the one a call reads, so that a loop over layers runs one program body. Both
// handlers dispatch on the layer's format to the kernels above: the same numbers as a call
// over that layer's matrix alone.
enum Format : int32_t { kF32, kBF16, kF16, kQ8, kQ4, kQ5, kQ4K, kQ5K, kQ6K, kIQ4NL, kIQ4XS, kQ51, kQ3K, kQ2K };  // FORMAT_CODES

template <typename T>
struct Tag {
  using type = T;
};

template <class Fn>
ffi::Error with_format(int32_t format, Fn fn) {
  switch (format) {
    case kF32: return fn(Tag<float>{});
    case kBF16: return fn(Tag<BF16>{});
    case kF16: return fn(Tag<F16>{});
    case kQ8: return fn(Tag<Q8>{});
    case kQ4: return fn(Tag<Q4>{});
    case kQ5: return fn(Tag<Q5>{});
    case kQ4K: return fn(Tag<QK<false>>{});
    case kQ5K: return fn(Tag<QK<true>>{});
    case kQ6K: return fn(Tag<Q6K>{});
    case kIQ4NL: return fn(Tag<IQ4NL>{});
    case kIQ4XS: return fn(Tag<IQ4XS>{});
    case kQ51: return fn(Tag<Q51>{});
    case kQ3K: return fn(Tag<Q3K>{});
    case kQ2K: return fn(Tag<Q2K>{});
    default: return ffi::Error::InvalidArgument("cadence_cpu_layered: unknown weight format");
  }
}

template <typename T>
constexpr bool kFloat = std::is_same_v<T, float> || std::is_same_v<T, BF16> || std::is_same_v<T, F16>;

// Bytes of one block of 16 columns over K k-rows in format T (0 where K does not fit it).
template <typename T>
int64_t block_bytes(int64_t K) {
  if constexpr (kFloat<T>) {
    return K * kBlock * static_cast<int64_t>(sizeof(T));
  } else {
    return K % T::kRows ? 0 : K / T::kRows * T::kRecord;
  }
}

// The chosen layer's matrix: its first byte, and whether `blocks` blocks of K k-rows of its
// format lie within w (else nullptr).
const uint8_t* layer_matrix(ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                            ffi::Span<const int64_t> offsets, int64_t bytes) {
  const int32_t l = *layer.typed_data();
  if (layer.element_count() != 1 || l < 0 || l >= static_cast<int64_t>(offsets.size()) ||
      bytes <= 0 || offsets[l] < 0 || offsets[l] + bytes > static_cast<int64_t>(w.size_bytes())) {
    return nullptr;
  }
  return static_cast<const uint8_t*>(w.untyped_data()) + offsets[l];
}

// y [M, N] = x [M, K] @ the layer's W [K, N] (N = 16 * blocks; int8: over int8 activations,
// for the grouped formats).
ffi::Error LayeredMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> live,
                         ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                         ffi::Span<const int32_t> formats, ffi::Span<const int64_t> offsets,
                         bool int8) {
  const auto xd = x.dimensions(), yd = y->dimensions();
  const int32_t l = layer.element_count() == 1 ? *layer.typed_data() : -1;
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] || yd[1] % kBlock || live.element_count() != 1 ||
      formats.size() != offsets.size() || l < 0 || l >= static_cast<int64_t>(formats.size())) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_layered_matmul takes x [M, K], its live rows [], a layer in [0, layers) and "
        "gives [M, N] (N a multiple of 16)");
  }
  const int64_t K = xd[1], blocks = yd[1] / kBlock;
  return with_format(formats[l], [&](auto tag) {
    using T = typename decltype(tag)::type;
    const uint8_t* wp = layer_matrix(w, layer, offsets, blocks * block_bytes<T>(K));
    if (!wp) {
      return ffi::Error::InvalidArgument(
          "cadence_cpu_layered_matmul: the layer's matrix does not fit its format, K or w");
    }
    const int64_t M = live_rows(live, xd[0], y->typed_data(), yd[1]);  // the rest are zeros
    if (M == 0) return ffi::Error::Success();
    if constexpr (kFloat<T>) {
      matmul_run(pool, x.typed_data(), M, K, reinterpret_cast<const T*>(wp), nullptr,
                 y->typed_data(), blocks);
    } else if (int8) {
      grouped_run<T, true>(pool, x.typed_data(), M, K, wp, y->typed_data(), blocks);
    } else {
      grouped_run<T, false>(pool, x.typed_data(), M, K, wp, y->typed_data(), blocks);
    }
    return ffi::Error::Success();
  });
}

// Float blocks [blocks, K, 16] written out as the matrix [K, N].
template <typename T>
void relay_blocks(const T* w, int64_t K, float* out, int64_t N, int64_t first, int64_t last) {
  for (int64_t b = first; b < last; ++b) {
    for (int64_t k = 0; k < K; ++k) {
      __m256 w0, w1;
      load_row(w + (b * K + k) * kBlock, w0, w1);
      _mm256_storeu_ps(out + k * N + b * kBlock, w0);
      _mm256_storeu_ps(out + k * N + b * kBlock + 8, w1);
    }
  }
}

// The float32 W [K, N] of the layer's blocks [first, first + N / 16): a part of a fused
// matrix, or all of it.
ffi::Error LayeredDequantize(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::AnyBuffer w,
                             ffi::ResultBuffer<ffi::F32> out, ffi::Span<const int32_t> formats,
                             ffi::Span<const int64_t> offsets, int64_t first) {
  const auto od = out->dimensions();
  const int32_t l = *layer.typed_data();
  if (od.size() != 2 || od[1] % kBlock || first < 0 || formats.size() != offsets.size() ||
      l < 0 || l >= static_cast<int64_t>(formats.size())) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_layered_dequantize takes a layer in [0, layers) and gives [K, N] (N a "
        "multiple of 16)");
  }
  const int64_t K = od[0], blocks = od[1] / kBlock;
  return with_format(formats[l], [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int64_t bytes = block_bytes<T>(K);
    const uint8_t* wp = layer_matrix(w, layer, offsets, (first + blocks) * bytes);
    if (!wp) {
      return ffi::Error::InvalidArgument(
          "cadence_cpu_layered_dequantize: the blocks do not fit the layer's matrix");
    }
    wp += first * bytes;
    if constexpr (kFloat<T>) {
      float* op = out->typed_data();
      const int64_t grain = std::max<int64_t>(1, (256 << 10) / (K * kBlock * 4));
      parallel_for(pool, blocks, grain, [=](int64_t a, int64_t b) {
        relay_blocks(reinterpret_cast<const T*>(wp), K, op, blocks * kBlock, a, b);
      });
    } else {
      dequantize_run<T>(pool, wp, K, blocks, out->typed_data());
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(cadence_cpu_kth_largest, KthLargest,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(cadence_cpu_mass_threshold, MassThreshold,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(cadence_cpu_gumbel_candidates, GumbelCandidates,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("error"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cadence_cpu_gumbel_of_bits, GumbelOfBits,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("wide"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cadence_cpu_argmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

#define CADENCE_TAKE_PAGES(name, dt, type)                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (TakePages<dt, type>),           \
                                ffi::Ffi::Bind()                       \
                                    .Ctx<ffi::ThreadPool>()            \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Arg<ffi::AnyBuffer>()             \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Ret<ffi::Buffer<ffi::F32>>());

CADENCE_TAKE_PAGES(cadence_cpu_take_pages, ffi::F32, float)
CADENCE_TAKE_PAGES(cadence_cpu_take_pages_bf16, ffi::BF16, BF16)
CADENCE_TAKE_PAGES(cadence_cpu_take_pages_f16, ffi::F16, F16)
CADENCE_TAKE_PAGES(cadence_cpu_take_pages_f8e4m3, ffi::F8E4M3FN, F8E4M3)
CADENCE_TAKE_PAGES(cadence_cpu_take_pages_f8e5m2, ffi::F8E5M2, F8E5M2)

XLA_FFI_DEFINE_HANDLER_SYMBOL(cadence_cpu_paged_write, PagedWrite,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(cadence_cpu_blocked_matmul_int8, BlockedMatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Paged decode attention, one handler per pool dtype (model/cpu_kernels.py's ATTENTION).
#define CADENCE_PAGED_DECODE(name, dt, type)                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (PagedDecode<dt, type>),         \
                                ffi::Ffi::Bind()                       \
                                    .Ctx<ffi::ThreadPool>()            \
                                    .Arg<ffi::Buffer<ffi::F32>>()      \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Arg<ffi::AnyBuffer>()             \
                                    .Arg<ffi::AnyBuffer>()             \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Ret<ffi::Buffer<ffi::F32>>());

CADENCE_PAGED_DECODE(cadence_cpu_paged_decode, ffi::F32, float)
CADENCE_PAGED_DECODE(cadence_cpu_paged_decode_bf16, ffi::BF16, BF16)
CADENCE_PAGED_DECODE(cadence_cpu_paged_decode_f16, ffi::F16, F16)
CADENCE_PAGED_DECODE(cadence_cpu_paged_decode_f8e4m3, ffi::F8E4M3FN, F8E4M3)
CADENCE_PAGED_DECODE(cadence_cpu_paged_decode_f8e5m2, ffi::F8E5M2, F8E5M2)


XLA_FFI_DEFINE_HANDLER_SYMBOL(cadence_cpu_layered_matmul, LayeredMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int32_t>>("formats")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<bool>("int8"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(cadence_cpu_layered_dequantize, LayeredDequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int32_t>>("formats")
                                  .Attr<ffi::Span<const int64_t>>("offsets")
                                  .Attr<int64_t>("first"));
