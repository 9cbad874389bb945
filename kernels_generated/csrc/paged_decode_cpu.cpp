// The CPU decode step's attention read (issue 29): one new query token a sequence attending to
// its keys in the paged cache, float32, what kernels_generated/paged_attention_cpu.py's
// `_decode_read` computes, without its masked keys. A task per (sequence, KV head) walks the
// sequence's keys once for its G query heads: each key's 16-float vectors loaded once, the G
// dot products in registers, then softmax and the weighted sum of the values into register
// accumulators. The reference is `_decode_read` (and paged_attention_ref): the same products,
// summed in another order, and e^x by a polynomial (below 2e-7 relative).
//
// q [T, Hq, D], kv_cache [2, num_blocks, block_size, Hkv, D], block_tables [T, W] int32 (the
// first ceil(seq_len / block_size) entries of a row used), seq_lens [T] int32 -> [T, Hq, D]; a
// row of no keys (seq_len 0, a padding row) reads zeros. Built for (D, G) pairs the Python side
// lists (`DECODE_SHAPES`); others run the Inductor-fused read.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

typedef float vf __attribute__((vector_size(64)));  // 16 floats (AVX2 builds: two halves)

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

typedef int32_t vi __attribute__((vector_size(64)));

#if defined(__clang__)
#define CE_SHUFFLE(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define CE_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define CE_SHUFFLE(v, ...) __builtin_shuffle(v, vi{__VA_ARGS__})
#define CE_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// The sum of a vector's lanes, its halves folded onto each other (four shuffles and adds; the
// sum of sixteen lanes one at a time was half of a row's attention time).
inline float hsum(vf v) {
  v += CE_SHUFFLE(v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += CE_SHUFFLE(v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += CE_SHUFFLE(v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += CE_SHUFFLE(v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// The lane sums of four vectors at once, in lanes 0, 4, 8 and 12 of the result: their halves
// folded pairwise, then quarters, then within each group of four (ten shuffles and seven
// adds where four hsums take sixteen and sixteen).
inline vf hsum4(vf a, vf b, vf c, vf d) {
  // [a0-7 + a8-15 | b0-7 + b8-15], the same of c and d.
  vf ab = CE_SHUFFLE2(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
          CE_SHUFFLE2(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  vf cd = CE_SHUFFLE2(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
          CE_SHUFFLE2(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // Four lanes a vector: [a | b | c | d].
  vf abcd = CE_SHUFFLE2(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            CE_SHUFFLE2(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  abcd += CE_SHUFFLE(abcd, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  abcd += CE_SHUFFLE(abcd, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return abcd;
}

// e^x for x <= 0 (a score less its row's max): x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
// series to r^6, times 2^n built in the exponent bits. Below -87, 0.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = std::floor(clamped * 1.44269504f + 0.5f);
  const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : p * scale;
}

// One (sequence, KV head): NV vectors of 16 a head, G query heads.
template <int NV, int G>
void decode_task(const float* qh, const float* kp, const float* vp, const int32_t* table,
                 int64_t L, int64_t bs, int64_t key_stride, int64_t head_offset, float sc,
                 float* scores, float* oh) {
  constexpr int64_t D = 16 * NV;
  vf q[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) q[g][j] = load(qh + g * D + 16 * j);
  float top[G];
  for (int g = 0; g < G; ++g) top[g] = -std::numeric_limits<float>::infinity();
  auto key = [&](int64_t l) { return kp + (table[l / bs] * bs + l % bs) * key_stride + head_offset; };
  int64_t l = 0;
  for (; l + 4 <= L; l += 4) {  // four keys a pass: their products' lane sums at once
    const float* k[4] = {key(l), key(l + 1), key(l + 2), key(l + 3)};
    for (int g = 0; g < G; ++g) {
      vf p[4];
      for (int i = 0; i < 4; ++i) {
        p[i] = q[g][0] * load(k[i]);
        for (int j = 1; j < NV; ++j) p[i] += q[g][j] * load(k[i] + 16 * j);
      }
      const vf s = hsum4(p[0], p[1], p[2], p[3]) * sc;
      for (int i = 0; i < 4; ++i) {
        scores[g * L + l + i] = s[4 * i];
        top[g] = std::max(top[g], s[4 * i]);
      }
    }
  }
  for (; l < L; ++l) {
    const float* k = key(l);
    vf kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = load(k + 16 * j);
    for (int g = 0; g < G; ++g) {
      vf p = q[g][0] * kv[0];
      for (int j = 1; j < NV; ++j) p += q[g][j] * kv[j];
      const float s = hsum(p) * sc;
      scores[g * L + l] = s;
      top[g] = std::max(top[g], s);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    const float m = top[g];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < L; ++l) {
      sg[l] = exp_nonpositive(sg[l] - m);
      sum += sg[l];
    }
    inv[g] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  vf acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = vf{};
  for (int64_t l = 0; l < L; ++l) {
    const float* v = vp + (table[l / bs] * bs + l % bs) * key_stride + head_offset;
    vf vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load(v + 16 * j);
    for (int g = 0; g < G; ++g) {
      const float w = scores[g * L + l];
      for (int j = 0; j < NV; ++j) acc[g][j] += w * vv[j];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) store(oh + g * D + 16 * j, acc[g][j] * inv[g]);
}

using Task = void (*)(const float*, const float*, const float*, const int32_t*, int64_t, int64_t,
                      int64_t, int64_t, float, float*, float*);

// The (D, G) pairs built: SmolLM2 (64, 3), Llama-3 / Qwen (128, 4), and a few more.
Task task_for(int64_t D, int64_t G) {
  if (D == 64 && G == 1) return &decode_task<4, 1>;
  if (D == 64 && G == 2) return &decode_task<4, 2>;
  if (D == 64 && G == 3) return &decode_task<4, 3>;
  if (D == 64 && G == 4) return &decode_task<4, 4>;
  if (D == 128 && G == 1) return &decode_task<8, 1>;
  if (D == 128 && G == 2) return &decode_task<8, 2>;
  if (D == 128 && G == 4) return &decode_task<8, 4>;
  return nullptr;
}

at::Tensor paged_decode_read(const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "paged_decode_read: q must be a contiguous float32 [T, Hq, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 &&
                  kv_cache.scalar_type() == at::kFloat && kv_cache.is_contiguous(),
              "paged_decode_read: kv_cache must be a contiguous float32 [2, blocks, block, Hkv, D]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && block_tables.size(0) == q.size(0),
              "paged_decode_read: block_tables must be a contiguous int32 [T, W]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt &&
                  seq_lens.size(0) == q.size(0),
              "paged_decode_read: seq_lens must be int32 [T]");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && Hq % Hkv == 0, "paged_decode_read: head sizes");
  const int64_t G = Hq / Hkv, W = block_tables.size(1);
  const Task task = task_for(D, G);
  TORCH_CHECK(task != nullptr, "paged_decode_read: not built for head size ", D, " and ", G,
              " query heads a KV head");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(lens[t] >= 0 && lens[t] <= W * bs, "paged_decode_read: seq_lens out of range");
    for (int64_t b = 0; b < (lens[t] + bs - 1) / bs; ++b) {
      const int32_t block = tables[t * W + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_read: block id out of range");
    }
  }
  at::Tensor out = at::empty({T, Hq, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + num_blocks * bs * Hkv * D;
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / Hkv, h = i % Hkv;
      const int64_t L = lens[t];
      scores.resize(static_cast<size_t>(G * std::max<int64_t>(L, 1)));
      task(qp + (t * Hq + h * G) * D, kp, vp, tables + t * W, L, bs, Hkv * D, h * D, sc,
           scores.data(), op + (t * Hq + h * G) * D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ce_cpu, m) {
  m.def(
      "paged_decode_read(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(ce_cpu, CPU, m) { m.impl("paged_decode_read", &paged_decode_read); }
