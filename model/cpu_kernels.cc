// cadence's CPU kernels for the decode step, as XLA FFI custom calls (x86-64, AVX2 + FMA).
//
// Built and registered by model/cpu_kernels.py, which also holds the slow paths they are tested
// against. A decode step reads every weight and every live KV entry once; on XLA:CPU its
// matmuls of 2-16 rows pack the weights anew on every call and its paged attention pays a loop
// step per page, so the step ran at 3-6x the time of reading them. These kernels read each
// byte once, in the order it lies in memory:
//
//   cadence_cpu_layered_matmul   y[M, N] = x[M, K] @ W for W in the kernels' layouts
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
//                            per output column: a quarter of float32's bytes.
//   cadence_cpu_paged_decode     one query token per row over its pages of a paged KV pool,
//                            online softmax in float32, keys 0..position of the row.
//   cadence_cpu_paged_write      new keys or values into their slots of a pool, in place:
//                            XLA:CPU has no 16-bit scatter, and widens the whole pool layer to
//                            float32 and back around one; within the layer loop, a layer of a
//                            pool stacked over layers, which XLA would copy out.
//   cadence_cpu_take_pages{,_bf16,_f16}   pages of a pool, widened to float32 (prefill's key
//                            tiles): XLA:CPU widens the whole pool before a 16-bit gather.
//   cadence_cpu_argmax           each row's likeliest token, as jnp.argmax: XLA:CPU does not
//                            vectorize its reduction over (value, index) pairs.
//
// The pool kernels take a pool of one layer or a layer of a stack of them (`pool_layer`).
//
// Work is split between the calling thread and the kernels' own workers (`Workers`: as many as
// XLA:CPU's intra-op pool has threads, less one), which spin between the calls of a step.

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------
// Parallel loop over [0, items): the calling thread and cadence's own workers.
//
// A decode step calls the kernels ~150 times, 15-80 us each for a small model. Handing each
// call's work to the XLA:CPU thread pool wakes a sleeping thread every time, and the wake-up
// takes as long as the work: the calling thread did most of it alone. So the kernels keep
// their own workers (as many as the FFI pool has threads, less the caller): after a job each
// spins for a while (kSpin) waiting for the next one, which in a decode step comes within
// microseconds, then sleeps until one comes. A caller that finds the workers busy with
// another caller's job (two engines in one process) runs its own job alone.

constexpr auto kSpin = std::chrono::microseconds(200);

class Workers {
 public:
  static Workers& get(int threads) {
    static Workers* workers = new Workers(threads - 1);  // lives as long as the process
    return *workers;
  }

  // body(first, last) over chunks of `grain` items, on this thread and the workers.
  template <typename Body>
  void run(int64_t items, int64_t grain, const Body& body) {
    const int64_t chunks = (items + grain - 1) / grain;
    std::unique_lock<std::mutex> busy(submit_, std::try_to_lock);
    if (chunks <= 1 || threads_.empty() || !busy.owns_lock()) {
      body(0, items);
      return;
    }
    Job job;
    job.chunks = chunks;
    job.run_chunk = [&](int64_t c) { body(c * grain, std::min(items, (c + 1) * grain)); };
    job.id = ++last_id_;
    current_.store(&job);
    current_id_.store(job.id);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    work_on(job);
    while (job.done.load(std::memory_order_acquire) < chunks) _mm_pause();
    current_.store(nullptr);
    while (active_.load() > 0) _mm_pause();  // no worker still holds `job`
  }

 private:
  struct Job {
    uint64_t id = 0;
    int64_t chunks = 0;
    std::function<void(int64_t)> run_chunk;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };

  explicit Workers(int count) {
    for (int i = 0; i < count; ++i) threads_.emplace_back([this] { loop(); }).detach();
  }

  static void work_on(Job& job) {
    for (int64_t c; (c = job.next.fetch_add(1)) < job.chunks;) {
      job.run_chunk(c);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      auto since = std::chrono::steady_clock::now();
      for (int spins = 0; current_id_.load(std::memory_order_relaxed) == seen; ++spins) {
        _mm_pause();
        if ((spins & 63) != 63) continue;
        std::this_thread::yield();  // a thread waiting for this core (the host's) runs first
        if (std::chrono::steady_clock::now() - since > kSpin) {
          std::unique_lock<std::mutex> lock(sleep_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return current_id_.load() != seen; });
          sleepers_.fetch_sub(1);
          since = std::chrono::steady_clock::now();
        }
      }
      // Announce this thread before looking at the job: its submitter waits for active_ to
      // drop to 0 after unpublishing it, so a job seen here outlives its use.
      active_.fetch_add(1);
      Job* job = current_.load();
      if (job != nullptr) {
        seen = job->id;
        work_on(*job);
      } else {
        seen = current_id_.load();  // that job is over; wait for the next
      }
      active_.fetch_sub(1);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex submit_;  // one job at a time
  uint64_t last_id_ = 0;
  std::atomic<Job*> current_{nullptr};
  std::atomic<uint64_t> current_id_{0};
  std::atomic<int> active_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_;
  std::condition_variable wake_;
};

template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t items, int64_t grain, Body body) {
  Workers::get(static_cast<int>(pool.num_threads())).run(items, grain, body);
}

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

ffi::Error BlockedMatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                             ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kBlock || wd[1] != xd[1] ||
      static_cast<int64_t>(scale.element_count()) != wd[0] * kBlock) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_blocked_matmul_int8 takes x [M, K], w [N / 16, K, 16] and a scale per "
        "(padded) output column");
  }
  matmul_run(pool, x.typed_data(), xd[0], xd[1], w.typed_data(), scale.typed_data(),
             y->typed_data(), wd[0]);
  return ffi::Error::Success();
}

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
// where a pairs byte (j, c) holds column c's low 4 bits of k-row 2j in its low nibble and of
// k-row 2j + 1 in its high nibble, and a high byte (i, c) holds the code's remaining bits of
// 8 / b consecutive k-rows from i * 8 / b, b bits each from its lowest (b = 1, or 2 for q6k).
// Every scale and minimum is a float32 product of integers and a float16 that is exact, as
// GGUF's dequantizer computes it, so the kernel's sums are of the file's own values.

constexpr int64_t kGroup = 32;            // k-rows per group sum of x (the minimums')
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
// kHighAt, and kLift, what it adds to make the codes unsigned.
struct Q8 {
  static constexpr int64_t kRows = 32, kGroupRows = 32, kStep = 1, kRecord = 2 * kBlock + 32 * kBlock;
  static constexpr bool kMin = false;
  static constexpr int kBits = 8, kLift = 128;
  static constexpr int64_t kCodesAt = 2 * kBlock, kHighAt = 0;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) { q[0] = load16(r + 2 * kBlock + k * kBlock); }
  static void scale(const uint8_t* r, int64_t, __m256& s0, __m256& s1) { s0 = half8(r); s1 = half8(r + 16); }
  static void minimum(const uint8_t*, int64_t, __m256&, __m256&) {}
};

struct Q4 {
  static constexpr int64_t kRows = 32, kGroupRows = 32, kStep = 2, kRecord = 4 * kBlock + 16 * kBlock;
  static constexpr bool kMin = true;
  static constexpr int kBits = 4, kLift = 0;
  static constexpr int64_t kCodesAt = 4 * kBlock, kHighAt = 0;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) { nibbles(r + 4 * kBlock + k / 2 * kBlock, q[0], q[1]); }
  static void scale(const uint8_t* r, int64_t, __m256& s0, __m256& s1) { s0 = half8(r); s1 = half8(r + 16); }
  static void minimum(const uint8_t* r, int64_t, __m256& m0, __m256& m1) { m0 = half8(r + 32); m1 = half8(r + 48); }
};

struct Q5 {
  static constexpr int64_t kRows = 32, kGroupRows = 32, kStep = 8, kHigh = 2 * kBlock;
  static constexpr int64_t kPairs = kHigh + 4 * kBlock, kRecord = kPairs + 16 * kBlock;
  static constexpr bool kMin = false;
  static constexpr int kBits = 5, kLift = 16;
  static constexpr int64_t kCodesAt = kPairs, kHighAt = kHigh;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) { split_codes<1, 16>(r + kPairs, r + kHigh, k, q); }
  static void scale(const uint8_t* r, int64_t, __m256& s0, __m256& s1) { s0 = half8(r); s1 = half8(r + 16); }
  static void minimum(const uint8_t*, int64_t, __m256&, __m256&) {}
};

// Q4_K and Q5_K: 8 groups of 32 k-rows, 6-bit scales and minimums (a byte each here) of the
// super-block's d and dmin.
template <bool kFive>
struct QK {
  static constexpr int64_t kRows = 256, kGroupRows = 32, kStep = kFive ? 8 : 2;
  static constexpr int64_t kSc = 4 * kBlock, kM = kSc + 8 * kBlock, kHigh = kM + 8 * kBlock;
  static constexpr int64_t kPairs = kHigh + (kFive ? 32 * kBlock : 0), kRecord = kPairs + 128 * kBlock;
  static constexpr bool kMin = true;
  static constexpr int kBits = kFive ? 5 : 4, kLift = 0;
  static constexpr int64_t kCodesAt = kPairs, kHighAt = kHigh;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) {
    if constexpr (kFive) {
      split_codes<1, 0>(r + kPairs, r + kHigh, k, q);
    } else {
      nibbles(r + kPairs + k / 2 * kBlock, q[0], q[1]);
    }
  }
  static void scale(const uint8_t* r, int64_t g, __m256& s0, __m256& s1) {
    const uint8_t* sc = r + kSc + g * kBlock;
    s0 = _mm256_mul_ps(half8(r), u8x8(sc));
    s1 = _mm256_mul_ps(half8(r + 16), u8x8(sc + 8));
  }
  static void minimum(const uint8_t* r, int64_t g, __m256& m0, __m256& m1) {  // -(dmin * m)
    const uint8_t* m = r + kM + g * kBlock;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    m0 = _mm256_xor_ps(_mm256_mul_ps(half8(r + 32), u8x8(m)), sign);
    m1 = _mm256_xor_ps(_mm256_mul_ps(half8(r + 48), u8x8(m + 8)), sign);
  }
};

// Q6_K: 16 groups of 16 k-rows, int8 scales of the super-block's d.
struct Q6K {
  static constexpr int64_t kRows = 256, kGroupRows = 16, kStep = 4;
  static constexpr int64_t kSc = 2 * kBlock, kHigh = kSc + 16 * kBlock, kPairs = kHigh + 64 * kBlock;
  static constexpr int64_t kRecord = kPairs + 128 * kBlock;
  static constexpr bool kMin = false;
  static constexpr int kBits = 6, kLift = 32;
  static constexpr int64_t kCodesAt = kPairs, kHighAt = kHigh;
  static void codes(const uint8_t* r, int64_t k, __m128i* q) { split_codes<2, 32>(r + kPairs, r + kHigh, k, q); }
  static void scale(const uint8_t* r, int64_t g, __m256& s0, __m256& s1) {
    const uint8_t* sc = r + kSc + g * kBlock;
    s0 = _mm256_mul_ps(half8(r), i8x8(sc));
    s1 = _mm256_mul_ps(half8(r + 16), i8x8(sc + 8));
  }
  static void minimum(const uint8_t*, int64_t, __m256&, __m256&) {}
};

static_assert(Q8::kRecord == 544 && Q4::kRecord == 320 && Q5::kRecord == 352);
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
  const int64_t records = K / F::kRows, xgroups = K / kGroup;
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
      if constexpr (F::kMin) add_minimums<MR, F>(acc, w, g, xsum + k0 / kGroup, xgroups);
    }
  }
  store_rows<MR>(acc, y, N);
}

// The same tile with AVX-512, where the CPU has it (`grouped_run` picks at run time): a
// block's 16 columns are one 16-lane register, so each k-row is one widening, one conversion
// and one FMA per row where AVX2 needs two of each. Every lane computes what the AVX2 lane of
// its column computes, in the same order: the results are the same bits. The formats' codes,
// scales and minimums are the AVX2 ones (16 bytes, two 8-lane vectors), joined.
#define CADENCE_AVX512 __attribute__((target("avx512f")))

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
  const int64_t records = K / F::kRows, xgroups = K / kGroup;
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
      if constexpr (F::kMin) add_minimums512<MR, F>(acc, w, g, xsum + k0 / kGroup, xgroups);
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
  const int64_t groups = K / kGroup;
  grouped_runs<kWide ? 8 : 4>(M, K / F::kRows * F::kRecord, w, y, first, last,
               [=](auto mr, int64_t m, const uint8_t* wb, float* yb, uintptr_t ahead,
                   uint64_t start, uint64_t share) {
                 tile<kWide, decltype(mr)::value, F>(x + m * K, xsum + m * groups, K, wb,
                                                     yb + m * N, N, ahead, start, share);
               });
}

// AVX-512 where the CPU has it, unless CADENCE_CPU_AVX512=0 (the tests compare the two).
bool use_avx512() {
  static const bool use = [] {
    const char* env = std::getenv("CADENCE_CPU_AVX512");
    return __builtin_cpu_supports("avx512f") && !(env && std::string(env) == "0");
  }();
  return use;
}

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
  } else {
    split_codes<F::kBits - 4, 0>(r + F::kCodesAt, r + F::kHighAt, k, q);
  }
}

// Over int8 activations. Codes of at most 6 bits go in lifted (`dot4u`), and kLift * the
// group's sum of x's codes (`xqsum`, per 16 k-rows, rows K / 16 apart) comes off after;
// Q8_0's signed bytes take dot4.
template <int MR, class F>
inline void grouped_tile_q8x(const int8_t* xq, const int32_t* xqsum, const float* xd,
                             const float* xsum, int64_t K, const uint8_t* w, float* y, int64_t N,
                             uintptr_t ahead, uint64_t start, uint64_t share) {
  static_assert(F::kGroupRows % 16 == 0 && 8 % F::kStep == 0);
  constexpr bool kLifted = F::kBits < 8;
  const int64_t records = K / F::kRows, xgroups = K / kGroup, xspans = K / 16;
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
          int32_t total = 0;
          for (int64_t i = 0; i < F::kGroupRows / 16; ++i) total += xqsum[m * xspans + k0 / 16 + i];
          const __m256i lift = _mm256_set1_epi32(F::kLift * total);
          sums[m][0] = _mm256_sub_epi32(sums[m][0], lift);
          sums[m][1] = _mm256_sub_epi32(sums[m][1], lift);
        }
        const __m256 d = _mm256_set1_ps(xd[m * xgroups + k0 / kGroup]);
        acc[m][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums[m][0]), d), s0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums[m][1]), d), s1, acc[m][1]);
      }
      if constexpr (F::kMin) add_minimums<MR, F>(acc, w, g, xsum + k0 / kGroup, xgroups);
    }
  }
  store_rows<MR>(acc, y, N);
}

// The same tile with AVX-512 VNNI, where the CPU has it: a block's 16 columns of four k-rows
// are one 512-bit register, and one vpdpbusd per row adds its four products per column to the
// row's 32-bit sums (AVX2 spends five instructions on each half). vpdpbusd multiplies
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

CADENCE_VNNI inline __m512i load64(const std::array<uint8_t, 64>& a) { return _mm512_loadu_si512(a.data()); }

// k-rows [k, k + 4) of a record's codes in vpdpbusd's order, as unsigned bytes: byte 4c + j is
// column c's code of k-row k + j, plus F::kLift. kPhase is k modulo 8 (0 or 4), where the
// k-rows' high bits lie in their plane's bytes. Q8_0's whole-byte codes: one byte permutation
// (vpermb) of the four k-rows, and the sign bit flipped. The others: vpermb gathers the bytes
// holding a pair of columns' bits, two of each pairs row and, for 5- and 6-bit codes, one of
// the plane, into a 64-bit lane, and vpmultishiftqb takes each code's nibble from there into
// its byte (and its high bits, at bit 4).
template <class F, int kPhase>
CADENCE_VNNI inline __m512i codes4(const uint8_t* r, int64_t k) {
  if constexpr (F::kBits == 8) {
    static constexpr auto order = bytes64([](int i) { return 16 * (i % 4) + i / 4; });
    const __m512i codes = _mm512_loadu_si512(r + F::kCodesAt + k * kBlock);
    return _mm512_xor_si512(_mm512_permutexvar_epi8(load64(order), codes),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    constexpr int kHighBits = F::kBits - 4;
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
    if constexpr (kHighBits == 0) {
      return nibbles;
    } else {
      static constexpr auto high = bytes64([](int i) {
        const int c = i % 8 / 4, j = i % 4;
        return 8 * (4 + c) + kHighBits * (kPhase % (8 / kHighBits) + j) - 4;
      });
      const __m512i bits = _mm512_multishift_epi64_epi8(load64(high), lanes);
      // nibbles | (bits & the high bits' mask)
      return _mm512_ternarylogic_epi32(nibbles, bits,
                                       _mm512_set1_epi8(static_cast<char>(((1 << kHighBits) - 1) << 4)), 0xF8);
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
  const int64_t records = K / F::kRows, xgroups = K / kGroup, xspans = K / 16;
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
        int32_t total = 0;
        for (int64_t i = 0; i < F::kGroupRows / 16; ++i) total += xqsum[m * xspans + k0 / 16 + i];
        const __m512i exact = _mm512_sub_epi32(sums[m], _mm512_set1_epi32(F::kLift * total));
        const __m512 d = _mm512_set1_ps(xd[m * xgroups + k0 / kGroup]);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(exact), d), s, acc[m]);
      }
      if constexpr (F::kMin) add_minimums512<MR, F>(acc, w, g, xsum + k0 / kGroup, xgroups);
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
                                     xsum + m * groups, K, wb, yb + m * N, N, ahead, start, share);
        } else {
          grouped_tile_q8x<MR, F>(xq + m * K, xqsum + m * (K / 16), xd + m * groups,
                                  xsum + m * groups, K, wb, yb + m * N, N, ahead, start, share);
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
// a group of zeros, whose codes are 0).
void quantize_rows(const float* x, int64_t groups, int8_t* xq, float* xd) {
  for (int64_t i = 0; i < groups; ++i) {
    const float* g = x + i * kGroup;
    float amax = 0.0f;
    for (int64_t k = 0; k < kGroup; ++k) amax = std::max(amax, std::fabs(g[k]));
    const float d = amax / 127.0f, inverse = d > 0 ? 1.0f / d : 0.0f;
    xd[i] = d;
    for (int64_t k = 0; k < kGroup; ++k) {
      xq[i * kGroup + k] = static_cast<int8_t>(std::nearbyint(g[k] * inverse));
    }
  }
}

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
  // Each row's group sums, for the minimums (formats without them need none).
  std::unique_ptr<float[]> sums(new float[F::kMin ? groups : 1]);
  for (int64_t i = 0; F::kMin && i < groups; ++i) {
    float total = 0.0f;
    for (int64_t k = 0; k < kGroup; ++k) total += xp[i * kGroup + k];
    sums[i] = total;
  }
  const float* xsum = sums.get();
  if constexpr (kInt8) {
    std::unique_ptr<int8_t[]> codes(new int8_t[M * K]);
    std::unique_ptr<float[]> scales(new float[groups]);
    quantize_rows(xp, groups, codes.get(), scales.get());
    const int8_t* xq = codes.get();
    const float* xs = scales.get();
    // Each row's sums of its codes per 16 k-rows, for the lifted codes.
    const bool wide = use_vnni();
    std::unique_ptr<int32_t[]> code_sums(new int32_t[M * K / 16]);
    for (int64_t i = 0; i < M * K / 16; ++i) {
      int32_t total = 0;
      for (int64_t k = 0; k < 16; ++k) total += xq[i * 16 + k];
      code_sums[i] = total;
    }
    const int32_t* xqsum = code_sums.get();
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
enum Format : int32_t { kF32, kBF16, kF16, kQ8, kQ4, kQ5, kQ4K, kQ5K, kQ6K };  // FORMAT_CODES

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
ffi::Error LayeredMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer,
                         ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                         ffi::Span<const int32_t> formats, ffi::Span<const int64_t> offsets,
                         bool int8) {
  const auto xd = x.dimensions(), yd = y->dimensions();
  const int32_t l = *layer.typed_data();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] || yd[1] % kBlock ||
      formats.size() != offsets.size() || l < 0 || l >= static_cast<int64_t>(formats.size())) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_layered_matmul takes x [M, K], a layer in [0, layers) and gives [M, N] "
        "(N a multiple of 16)");
  }
  const int64_t M = xd[0], K = xd[1], blocks = yd[1] / kBlock;
  return with_format(formats[l], [&](auto tag) {
    using T = typename decltype(tag)::type;
    const uint8_t* wp = layer_matrix(w, layer, offsets, blocks * block_bytes<T>(K));
    if (!wp) {
      return ffi::Error::InvalidArgument(
          "cadence_cpu_layered_matmul: the layer's matrix does not fit its format, K or w");
    }
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

template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), load8(b));
  for (int64_t i = 8; i < d; i += 8) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
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
      a0 = _mm256_fmadd_ps(qv, load8(k0 + i), a0);
      a1 = _mm256_fmadd_ps(qv, load8(k0 + d + i), a1);
      a2 = _mm256_fmadd_ps(qv, load8(k0 + 2 * d + i), a2);
      a3 = _mm256_fmadd_ps(qv, load8(k0 + 3 * d + i), a3);
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
    for (int j = 0; j < NV; ++j) a[j] = _mm256_fmadd_ps(pt, load8(v + 8 * j), a[j]);
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
// time: scores, their running max and sum (online softmax), then the values they weigh.
template <typename T>
void attend_one(const float* q, const T* k_pool, const T* v_pool, const int32_t* table,
                int64_t width, int64_t num_pages, int64_t page_size, int64_t d, int64_t group,
                int32_t position, float* out) {
  if (position < 0) {
    std::fill(out, out + group * d, 0.0f);
    return;
  }
  const int64_t live = std::min<int64_t>(int64_t{position} + 1, width * page_size);
  alignas(32) float qs[kMaxGroup * kMaxHeadDim];
  alignas(32) float acc[kMaxGroup * kMaxHeadDim];
  alignas(32) float s[kMaxPage + 8];
  float peak[kMaxGroup], total[kMaxGroup];
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t i = 0; i < group * d; ++i) qs[i] = q[i] * scale;
  std::fill(acc, acc + group * d, 0.0f);
  std::fill(peak, peak + group, -1e30f);
  std::fill(total, total + group, 0.0f);
  for (int64_t start = 0, j = 0; start < live; start += page_size, ++j) {
    const int64_t page = std::clamp<int64_t>(table[j], 0, num_pages - 1);
    const T* kp = k_pool + page * page_size * d;
    const T* vp = v_pool + page * page_size * d;
    const int64_t n = std::min(page_size, live - start);
    const int64_t padded = (n + 7) & ~int64_t{7};
    for (int64_t g = 0; g < group; ++g) {
      page_scores(qs + g * d, kp, n, d, s);
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
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = acc[g * d + i] * inverse;
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

// T: the pool's element type (`BF16`, `F16`, float) for FFI's type DT.
template <ffi::DataType DT, typename T>
ffi::Error PagedDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> layer,
                       ffi::Buffer<DT> k_pages, ffi::Buffer<DT> v_pages,
                       ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> positions,
                       ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), td = page_table.dimensions();
  const PoolLayer pl = pool_layer(kd, layer);
  const int64_t at = pl.at;
  if (qd.size() != 3 || at < 0 || td.size() != 2 || td[0] != qd[0] ||
      positions.element_count() != qd[0] || v_pages.element_count() != k_pages.element_count() ||
      pl.d != qd[2]) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_paged_decode takes q [rows, heads, d], k/v pages [kv_heads, pages, page_size, "
        "d] (or a layer of them stacked), page_table [rows, width] and positions [rows]");
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
  const T* kp = reinterpret_cast<const T*>(k_pages.typed_data()) + at;
  const T* vp = reinterpret_cast<const T*>(v_pages.typed_data()) + at;
  const int32_t* tp = page_table.typed_data();
  const int32_t* pp = positions.typed_data();
  float* op = out->typed_data();
  const int64_t pool_stride = num_pages * page_size * d;  // one KV head's pages
  parallel_for(pool, rows * kv_heads, 1, [=](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t row = item / kv_heads, h = item % kv_heads;
      const int64_t offset = (row * heads + h * group) * d;
      attend_one(qp + offset, kp + h * pool_stride, vp + h * pool_stride, tp + row * width, width,
                 num_pages, page_size, d, group, pp[row], op + offset);
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Paged KV write, in place.
//
// A layer of pages [layers, kv_heads, num_pages, page_size, d] (the result, the same buffer
// when XLA aliases it, as a donated pool is), values [rows, t, kv_heads, d] already in the
// pool's dtype (16 or 32 bits), and each token's page and slot in it [rows, t]: a token whose
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
      (width != 2 && width != 4) || values.element_type() != pages.element_type() ||
      out->element_type() != pages.element_type() || out->element_count() != pages.element_count()) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_paged_write takes a layer of a 16- or 32-bit pool [layers, kv_heads, pages, "
        "page_size, d], values [rows, t, kv_heads, d] of its dtype, and page and slot [rows, t] "
        "int32");
  }
  if (out->untyped_data() != pages.untyped_data()) {  // not aliased: the result starts as the pool
    std::memcpy(out->untyped_data(), pages.untyped_data(), pages.size_bytes());
  }
  const int64_t tokens = vd[0] * vd[1];
  if (width == 2) {
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
// page_size, d], widened (exactly) to float32 where 16-bit: [kv_heads, n, page_size, d].
template <ffi::DataType DT, typename T>
ffi::Error TakePages(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> layer, ffi::Buffer<DT> pages,
                     ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::F32> out) {
  const auto pd = pages.dimensions();
  const int64_t n = ids.element_count();
  const PoolLayer pl = pool_layer(pd, layer);
  if (pl.at < 0 || pl.d % 8 || out->element_count() != pl.kv_heads * n * pl.page_size * pl.d) {
    return ffi::Error::InvalidArgument(
        "cadence_cpu_take_pages takes a layer of pages [layers, kv_heads, pages, page_size, d] "
        "(d a multiple of 8) and ids [n], and gives [kv_heads, n, page_size, d]");
  }
  const int64_t kv_heads = pl.kv_heads, num_pages = pl.num_pages, run = pl.page_size * pl.d;
  const T* src = reinterpret_cast<const T*>(pages.typed_data()) + pl.at;
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

}  // namespace

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
                                    .Arg<ffi::Buffer<dt>>()            \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Ret<ffi::Buffer<ffi::F32>>());

CADENCE_TAKE_PAGES(cadence_cpu_take_pages, ffi::F32, float)
CADENCE_TAKE_PAGES(cadence_cpu_take_pages_bf16, ffi::BF16, BF16)
CADENCE_TAKE_PAGES(cadence_cpu_take_pages_f16, ffi::F16, F16)

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
                                    .Arg<ffi::Buffer<dt>>()            \
                                    .Arg<ffi::Buffer<dt>>()            \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Arg<ffi::Buffer<ffi::S32>>()      \
                                    .Ret<ffi::Buffer<ffi::F32>>());

CADENCE_PAGED_DECODE(cadence_cpu_paged_decode, ffi::F32, float)
CADENCE_PAGED_DECODE(cadence_cpu_paged_decode_bf16, ffi::BF16, BF16)
CADENCE_PAGED_DECODE(cadence_cpu_paged_decode_f16, ffi::F16, F16)


XLA_FFI_DEFINE_HANDLER_SYMBOL(cadence_cpu_layered_matmul, LayeredMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
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
