// Integer GEMM on x86 CPUs with AVX-512 VNNI (issue 29): y = x @ dequant(w)^T for 4- and 8-bit
// weights with a scale and an offset per group of 32 input columns, the activation quantized to
// 16 bits per group of 32 as it comes in.
//
// With the activation x ~= dx * xq (dx = amax / 32512 per row and group, xq = round(x / dx)) and
// the weight w = s * u + m (u the unsigned code), a group's contribution to y[t, n] is
//     s * dx * sum(u * xq) + m * (dx * sum(xq)),
// the integer sum exact in int32. vpdpbusd multiplies unsigned bytes by signed bytes (4 a lane),
// so xq = 256 * hi + lo with hi = floor((xq + 128) / 256) in [-127, 127] and lo in [-128, 127]
// (32512 = 127 * 256 keeps hi a byte): sum(u * xq) = 256 * sum(u * hi) + sum(u * lo), two
// passes of byte products. Measured on SmolLM2 Q4_1 against the file in float32 (top-1 over
// 2,048 tokens): int8 activations (llama.cpp's Q8, one pass) agreed 96.8%, these 16 bits 99.95%.
// GGUF Q4_1 is (s, m) as stored; Q4_0 is m = -8 s; Q8_0's signed codes are stored as u = q + 128
// with m = -128 s. Both products with m are exact, so the reference (vnni_linear_ref in
// kernels_generated/vnni_linear_cpu.py: dequantize both, matmul in float32) differs only in
// the order floats are added.
//
// Layout (kernels_generated/vnni_linear_cpu.py packs it): output rows in blocks of 16, a block's
// groups one after another; per group, 4-bit: 4 vectors of 64 bytes, lane j's dword holding
// codes k..k+3 of row j in its low nibbles and k+4..k+7 in its high ones (k = 8p), 8-bit: 8
// vectors, lane j's dword codes k..k+3 (k = 4p). Scales [N / 16, G, 2, 16]: (s, m) of the 16 rows.
// Each output row's arithmetic is the same whatever the number of rows: batch invariant.
//
// Built twice (kernels_generated/vnni_linear_cpu.py picks the one the CPU runs): with AVX-512
// VNNI flags as `ce_cpu::vnni_linear`, and with CE_VNNI_AVX2 defined and AVX2 flags as
// `ce_cpu::vnni_linear_avx2` for CPUs without AVX-512 (Zen 2/3, Intel client chips). AVX2 has no
// byte dot product that cannot saturate, so there the codes are widened to 16 bits and
// `vpmaddwd` multiplies them by the 16-bit activation directly (one pass, exact in int32: a
// lane sums 16 products of at most 255 * 32512). The integer sums are the same numbers, and the
// floats that scale them are the same operations in the same order: the two builds agree bit
// for bit (tests/kernels/test_vnni_linear_cpu.py, where the CPU runs both).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstring>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRows = 16;  // output rows a vector (16 int32 lanes)

constexpr float kLevels = 32512.0f;  // 127 * 256

// The block a thread computes next, prefetched a group at a time while this one computes (null:
// none). Without it the loads waited on memory: SmolLM2's linears at 16 rows took 14.3 ms a
// step on the 2-core EPYC, 7.8 with it (8 rows 10.3 -> 5.6; the numbers bit-equal).
struct Ahead {
  const uint8_t* w;
  const float* sm;
};

template <int BITS>
inline void prefetch_group(const Ahead& ahead, int64_t g) {
  if (ahead.w == nullptr) return;
  const char* w = reinterpret_cast<const char*>(ahead.w + g * (BITS == 4 ? 256 : 512));
  for (int j = 0; j < (BITS == 4 ? 4 : 8); ++j) _mm_prefetch(w + 64 * j, _MM_HINT_T0);
  const char* sm = reinterpret_cast<const char*>(ahead.sm + g * 32);
  _mm_prefetch(sm, _MM_HINT_T0);
  _mm_prefetch(sm + 64, _MM_HINT_T0);
}

#if defined(CE_VNNI_AVX2)
constexpr int kRowTile = 4;  // activation rows a weight load serves (8 int32 sums)

// The quantized activation: xq int16 [T, K], dx = amax / 32512 and xs = dx * sum(xq), float32
// [T, G]: the same numbers as the AVX-512 build's (the same division, rounding and sum).
struct Activations {
  int16_t* xq;
  float* dx;
  float* xs;
};

void quantize_groups(const float* x, int64_t T, int64_t K, const Activations& act) {
  int16_t* xq = act.xq;
  float* dx = act.dx;
  float* xs = act.xs;
  const int64_t G = K / kGroup;
  at::parallel_for(0, T * G, 64, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / G, g = i % G;
      const float* p = x + t * K + g * kGroup;
      int16_t* q = xq + t * K + g * kGroup;
      __m256 a[4];
      for (int j = 0; j < 4; ++j) a[j] = _mm256_loadu_ps(p + 8 * j);
      __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
      const float d = _mm_cvtss_f32(h) / kLevels;
      if (d == 0.0f) {
        std::memset(q, 0, kGroup * sizeof(int16_t));
        dx[i] = 0.0f;
        xs[i] = 0.0f;
        continue;
      }
      const __m256 vd = _mm256_set1_ps(d);
      __m256i c[4];
      for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_div_ps(a[j], vd));
      // packs interleaves the 128-bit halves; the permute puts the 16 values back in order
      const __m256i q01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
      const __m256i q23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), q01);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), q23);
      __m256i sum = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
      dx[i] = d;
      xs[i] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
    }
  });
}

// One block of 16 output rows as two halves of 8 (a 64-byte vector's two 32-byte halves), TT
// activation rows from t0. A half's 32 bytes hold 4 codes of each of its 8 rows; widened to 16
// bits, each 32-bit lane is 2 codes of one row, times the same 2 activations (a broadcast of 4).
template <int BITS, int TT>
inline void block_rows(const uint8_t* w, const float* sm, const Activations& act, int64_t t0,
                       int64_t K, int64_t N, int64_t n0, float* y, const Ahead& ahead) {
  const int16_t* xq = act.xq;
  const float* dx = act.dx;
  const float* xs = act.xs;
  const int64_t G = K / kGroup;
  __m256 acc[TT][2];
  for (int i = 0; i < TT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi16(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    prefetch_group<BITS>(ahead, g);
    for (int h = 0; h < 2; ++h) {
      __m256i sum[TT][2];
      for (int i = 0; i < TT; ++i) sum[i][0] = sum[i][1] = _mm256_setzero_si256();
      for (int q = 0; q < 8; ++q) {  // codes k = 4q .. 4q + 3
        // rows 0-3 and 4-7 of the half, each 16 bytes widened to 16 bits as they load
        __m256i lo, hi;
        if constexpr (BITS == 4) {
          const uint8_t* p = w + g * 256 + 64 * (q >> 1) + 32 * h;
          lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
          hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
          if (q & 1) {
            lo = _mm256_srli_epi16(lo, 4);
            hi = _mm256_srli_epi16(hi, 4);
          }
          lo = _mm256_and_si256(lo, mask);
          hi = _mm256_and_si256(hi, mask);
        } else {
          const uint8_t* p = w + g * 512 + 64 * q + 32 * h;
          lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
          hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
        }
        for (int i = 0; i < TT; ++i) {
          const __m256i xb = _mm256_broadcastq_epi64(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(xq + (t0 + i) * K + g * kGroup + 4 * q)));
          sum[i][0] = _mm256_add_epi32(sum[i][0], _mm256_madd_epi16(lo, xb));
          sum[i][1] = _mm256_add_epi32(sum[i][1], _mm256_madd_epi16(hi, xb));
        }
      }
      const __m256 s = _mm256_loadu_ps(sm + g * 32 + 8 * h);
      const __m256 m = _mm256_loadu_ps(sm + g * 32 + 16 + 8 * h);
      for (int i = 0; i < TT; ++i) {
        const int64_t t = t0 + i;
        // lanes 2r, 2r + 1 of sum[i][0] are row r's (rows 4 + r of sum[i][1]): hadd gives rows
        // 0 1 4 5 2 3 6 7, the permute 0 .. 7
        const __m256i d = _mm256_permute4x64_epi64(_mm256_hadd_epi32(sum[i][0], sum[i][1]),
                                                   _MM_SHUFFLE(3, 1, 2, 0));
        const __m256 scale = _mm256_mul_ps(s, _mm256_set1_ps(dx[t * G + g]));
        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, acc[i][h]);
        acc[i][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[t * G + g]), acc[i][h]);
      }
    }
  }
  for (int i = 0; i < TT; ++i) {
    _mm256_storeu_ps(y + (t0 + i) * N + n0, acc[i][0]);
    _mm256_storeu_ps(y + (t0 + i) * N + n0 + 8, acc[i][1]);
  }
}

#else
constexpr int kRowTile = 8;  // activation rows a weight load serves

// The quantized activation: xq = 256 * hi + lo as hi, lo int8 [T, K] each, dx = amax / 32512
// and xs = dx * sum(xq), float32 [T, G].
struct Activations {
  int8_t* hi;
  int8_t* lo;
  float* dx;
  float* xs;
};

void quantize_groups(const float* x, int64_t T, int64_t K, const Activations& act) {
  int8_t* hi = act.hi;
  int8_t* lo = act.lo;
  float* dx = act.dx;
  float* xs = act.xs;
  const int64_t G = K / kGroup;
  at::parallel_for(0, T * G, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / G, g = i % G;
      const float* p = x + t * K + g * kGroup;
      int8_t* h = hi + t * K + g * kGroup;
      int8_t* l = lo + t * K + g * kGroup;
      __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      float d = amax / kLevels;
      if (d == 0.0f) {
        std::memset(h, 0, kGroup);
        std::memset(l, 0, kGroup);
        dx[i] = 0.0f;
        xs[i] = 0.0f;
        continue;
      }
      __m512 vd = _mm512_set1_ps(d);
      __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(a, vd));
      __m512i qb = _mm512_cvtps_epi32(_mm512_div_ps(b, vd));
      const __m512i half = _mm512_set1_epi32(128);
      __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(qa, half), 8);
      __m512i hb = _mm512_srai_epi32(_mm512_add_epi32(qb, half), 8);
      __m512i la = _mm512_sub_epi32(qa, _mm512_slli_epi32(ha, 8));
      __m512i lb = _mm512_sub_epi32(qb, _mm512_slli_epi32(hb, 8));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h), _mm512_cvtepi32_epi8(ha));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + 16), _mm512_cvtepi32_epi8(hb));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(l), _mm512_cvtepi32_epi8(la));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(l + 16), _mm512_cvtepi32_epi8(lb));
      int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      dx[i] = d;
      xs[i] = d * static_cast<float>(sum);
    }
  });
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One block of 16 output rows, TT activation rows from t0. Bits 4: w holds, per group, 4
// vectors of 64 bytes, lane j's dword = codes k..k+3 of row j in the low nibbles and k+4..k+7
// in the high ones (k = 8p); bits 8: 8 vectors, lane j's dword = codes k..k+3 (k = 4p).
template <int BITS, int TT>
inline void block_rows(const uint8_t* w, const float* sm, const Activations& act, int64_t t0,
                       int64_t K, int64_t N, int64_t n0, float* y, const Ahead& ahead) {
  const int8_t* hi = act.hi;
  const int8_t* lo = act.lo;
  const float* dx = act.dx;
  const float* xs = act.xs;
  const int64_t G = K / kGroup;
  __m512 acc[TT];
  for (int i = 0; i < TT; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    prefetch_group<BITS>(ahead, g);
    __m512i wv[8];
    if constexpr (BITS == 4) {
      const uint8_t* wg = w + g * 256;
      for (int p = 0; p < 4; ++p) {
        __m512i v = _mm512_loadu_si512(wg + 64 * p);
        wv[2 * p] = _mm512_and_si512(v, mask);
        wv[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
      }
    } else {
      const uint8_t* wg = w + g * 512;
      for (int p = 0; p < 8; ++p) wv[p] = _mm512_loadu_si512(wg + 64 * p);
    }
    const __m512 s = _mm512_loadu_ps(sm + g * 32);
    const __m512 m = _mm512_loadu_ps(sm + g * 32 + 16);
    for (int i = 0; i < TT; ++i) {
      const int64_t t = t0 + i;
      const int8_t* hp = hi + t * K + g * kGroup;
      const int8_t* lp = lo + t * K + g * kGroup;
      // The hi and lo passes in two chains (and each in two halves): vpdpbusd's latency is
      // several cycles, and one chain of 16 left its ports idle between dependent products.
      __m512i dh0 = _mm512_setzero_si512(), dh1 = _mm512_setzero_si512();
      __m512i dl0 = _mm512_setzero_si512(), dl1 = _mm512_setzero_si512();
      for (int p = 0; p < 8; p += 2) {
        dh0 = _mm512_dpbusd_epi32(dh0, wv[p], bcast4(hp + 4 * p));
        dh1 = _mm512_dpbusd_epi32(dh1, wv[p + 1], bcast4(hp + 4 * p + 4));
        dl0 = _mm512_dpbusd_epi32(dl0, wv[p], bcast4(lp + 4 * p));
        dl1 = _mm512_dpbusd_epi32(dl1, wv[p + 1], bcast4(lp + 4 * p + 4));
      }
      const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(dh0, dh1), 8),
                                         _mm512_add_epi32(dl0, dl1));
      const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(dx[t * G + g]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[i]);
      acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t * G + g]), acc[i]);
    }
  }
  for (int i = 0; i < TT; ++i) _mm512_storeu_ps(y + (t0 + i) * N + n0, acc[i]);
}

#endif

// kRowTile activation rows a call, then the rest in one call of its size.
template <int BITS, int TT>
inline void tail_rows(int64_t left, const uint8_t* w, const float* sm, const Activations& a,
                      int64_t t0, int64_t K, int64_t N, int64_t n0, float* y, const Ahead& ahead) {
  if constexpr (TT > 0) {
    if (left == TT)
      block_rows<BITS, TT>(w, sm, a, t0, K, N, n0, y, ahead);
    else
      tail_rows<BITS, TT - 1>(left, w, sm, a, t0, K, N, n0, y, ahead);
  }
}

template <int BITS>
void gemm(const Activations& a, int64_t T, int64_t K, const uint8_t* w, const float* sm,
          int64_t N, float* y) {
  const int64_t G = K / kGroup;
  const int64_t blocks = N / kRows;
  const int64_t wblock = G * (BITS == 4 ? 256 : 512);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = w + b * wblock;
      const float* sb = sm + b * G * 32;
      // The first pass over this block's codes fetches the next block's; later passes (more
      // rows) find this block in cache.
      const Ahead next = b + 1 < b1 ? Ahead{wb + wblock, sb + G * 32} : Ahead{nullptr, nullptr};
      const Ahead none{nullptr, nullptr};
      int64_t t = 0;
      for (; t + kRowTile <= T; t += kRowTile)
        block_rows<BITS, kRowTile>(wb, sb, a, t, K, N, b * kRows, y, t == 0 ? next : none);
      tail_rows<BITS, kRowTile - 1>(T - t, wb, sb, a, t, K, N, b * kRows, y, t == 0 ? next : none);
    }
  });
}

at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sm,
                       int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "vnni_linear: x must be a contiguous float32 [T, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "vnni_linear: bits 4 or 8");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "vnni_linear: K must divide into groups of 32");
  const int64_t G = K / kGroup;
  TORCH_CHECK(sm.dim() == 4 && sm.size(1) == G && sm.size(2) == 2 && sm.size(3) == kRows,
              "vnni_linear: scales must be [N / 16, K / 32, 2, 16]");
  const int64_t N = sm.size(0) * kRows;
  TORCH_CHECK(w.numel() == N * K * bits / 8 && w.scalar_type() == at::kByte, "vnni_linear: weight size");
  at::Tensor y = at::empty({T, N}, x.options());
  if (T == 0) return y;
  at::Tensor scales = at::empty({2, T, G}, x.options());
  float* dx = scales.data_ptr<float>();
  float* xs = dx + T * G;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = sm.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(CE_VNNI_AVX2)
  at::Tensor xq = at::empty({T, K}, x.options().dtype(at::kShort));
  const Activations a{xq.data_ptr<int16_t>(), dx, xs};
#else
  at::Tensor xq = at::empty({2, T, K}, x.options().dtype(at::kChar));
  const Activations a{xq.data_ptr<int8_t>(), xq.data_ptr<int8_t>() + T * K, dx, xs};
#endif
  quantize_groups(x.data_ptr<float>(), T, K, a);
  if (bits == 4)
    gemm<4>(a, T, K, wp, sp, N, yp);
  else
    gemm<8>(a, T, K, wp, sp, N, yp);
  return y;
}

}  // namespace

#if defined(CE_VNNI_AVX2)
#define CE_VNNI_OP "vnni_linear_avx2"
#else
#define CE_VNNI_OP "vnni_linear"
#endif

TORCH_LIBRARY_FRAGMENT(ce_cpu, m) {
  m.def(CE_VNNI_OP "(Tensor x, Tensor w, Tensor sm, int bits) -> Tensor");
}
TORCH_LIBRARY_IMPL(ce_cpu, CPU, m) { m.impl(CE_VNNI_OP, &vnni_linear); }
