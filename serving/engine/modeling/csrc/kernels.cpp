// kvrelay's CPU kernels: the per-layer glue of a decode step fused into single passes, and
// decode attention straight from the paged KV cache.
// Layout of each cache: [blocks, kv_heads, block_size, head_dim].
//
// paged_decode_attention:
// One query token per sequence. For each (sequence, kv head) the `group` query heads that share
// the KV head are scored against the sequence's context, read block by block through its block
// table: no gathered copy of K/V is ever made, and each K/V row is read once for all its query
// heads. Scores and accumulation are fp32 whatever the cache dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <algorithm>
#include <type_traits>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// exp(x) for x <= 0 in a form the compiler vectorises (std::exp stays a scalar libm call):
// e^x = 2^n * e^g with n = round(x log2 e) built in the exponent bits and |g| <= ln2 / 2, where
// a degree-7 Taylor polynomial is accurate to ~1e-8 relative, below fp32 rounding.
inline float fast_exp(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.4426950408889634f);
  const float g = x - n * 0.6931471805599453f;
  const float p =
      1.f + g * (1.f + g * (0.5f + g * (1.f / 6 + g * (1.f / 24 + g * (1.f / 120 + g * (1.f / 720 + g * (1.f / 5040)))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
inline void from_float(T* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if defined(__AVX512BF16__)
// Lane r of the result = the sum of v[r]'s 16 lanes: a transpose-and-add tree (~45 ops for 16
// sums) instead of 16 separate horizontal reductions.
inline __m512 reduce16(const __m512* v) {
  __m512 y[8], z[4];
  for (int i = 0; i < 8; ++i)
    y[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(y[2 * i]), b = _mm512_castps_pd(y[2 * i + 1]);
    z[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x44), _mm512_shuffle_f32x4(z[0], z[1], 0xEE));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x44), _mm512_shuffle_f32x4(z[2], z[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

// Scores of one query head against a full 16-row bf16 K block: q . k for each row, with
// AVX512-BF16 dot products (bf16 x bf16 products are exact in fp32).
inline void score_block_bf16(const uint16_t* q, const uint16_t* k, int64_t head_dim, float scale, float* out) {
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t c = 0; c < head_dim; c += 32)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + c), (__m512bh)_mm512_loadu_si512(k + r * head_dim + c));
    acc[r] = a;
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)));
}
#endif

// Ask for `bytes` starting at `p` to be brought into cache ahead of use. Decode attention walks
// a sequence's blocks through its block table, scattered over the cache: the hardware
// prefetcher cannot guess the next block, so each block's successor is prefetched while the
// block itself is worked on.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

// Cache layout: [blocks, kv_heads, block_size, D], so one head's rows of a block are contiguous.
template <typename T, int D>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                   const int64_t* lens, T* out, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim_rt, int64_t block_size,
                   int64_t max_blocks, float scale, int64_t window) {
  const int64_t head_dim = D > 0 ? D : head_dim_rt;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t head_stride = block_size * head_dim;
  const int64_t block_stride = num_kv_heads * head_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    std::vector<float> rowf(block_size * head_dim);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / num_kv_heads, h = work % num_kv_heads;
      const int64_t len = lens[b];
      // A sliding window: the query (position len - 1) sees keys len - window .. len - 1 only.
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t* table = tables + b * max_blocks;
      for (int64_t j = 0; j < group; ++j)
        for (int64_t e = 0; e < head_dim; ++e)
          qf[j * head_dim + e] = to_float(q[(b * num_heads + h * group + j) * head_dim + e]) * scale;
      scores.assign(group * len, 0.f);
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      const int64_t first_blk = first / block_size;  // blocks before it are never read (may be freed)
      int64_t blk = first_blk;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (block_size == 16 && head_dim % 32 == 0) {
          const uint16_t* qb = reinterpret_cast<const uint16_t*>(q) + (b * num_heads + h * group) * head_dim;
          float tile[16];
          for (; blk < num_blocks; ++blk) {
            const uint16_t* kb = reinterpret_cast<const uint16_t*>(k_cache + table[blk] * block_stride + h * head_stride);
            if (blk + 1 < num_blocks)
              prefetch(k_cache + table[blk + 1] * block_stride + h * head_stride, head_stride * sizeof(T));
            const int64_t rows = std::min(block_size, len - blk * block_size);
            for (int64_t j = 0; j < group; ++j) {
              score_block_bf16(qb + j * head_dim, kb, head_dim, scale, tile);
              std::memcpy(scores.data() + j * len + blk * block_size, tile, rows * sizeof(float));
            }
          }
        }
      }
#endif
      for (; blk < num_blocks; ++blk) {
        const T* base = k_cache + table[blk] * block_stride + h * head_stride;
        if (blk + 1 < num_blocks)
          prefetch(k_cache + table[blk + 1] * block_stride + h * head_stride, head_stride * sizeof(T));
        const int64_t rows = std::min(block_size, len - blk * block_size);
        const int64_t n = rows * head_dim;
        for (int64_t i = 0; i < n; ++i) rowf[i] = to_float(base[i]);
        for (int64_t r = 0; r < rows; ++r) {
          const float* kf = rowf.data() + r * head_dim;
          for (int64_t j = 0; j < group; ++j) {
            const float* qj = qf.data() + j * head_dim;
            float s = 0.f;
            for (int64_t e = 0; e < head_dim; ++e) s += qj[e] * kf[e];
            scores[j * len + blk * block_size + r] = s;
          }
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t l = first; l < len; ++l) m = std::max(m, sj[l]);
        float sum = 0.f;
        for (int64_t l = first; l < len; ++l) { sj[l] = fast_exp(sj[l] - m); sum += sj[l]; }
        const float inv = 1.f / sum;
        for (int64_t l = first; l < len; ++l) sj[l] *= inv;
      }
      // One query head at a time, so its accumulator row stays in registers (D is a constant
      // for the common head sizes); the V rows it re-reads are in cache by the second head.
      for (int64_t j = 0; j < group; ++j) {
        float aj[D > 0 ? D : 1];
        float* accj = D > 0 ? aj : acc.data() + j * head_dim;
        for (int64_t e = 0; e < head_dim; ++e) accj[e] = 0.f;
        const float* pj = scores.data() + j * len;
        for (int64_t blk = first_blk; blk < num_blocks; ++blk) {
          const T* base = v_cache + table[blk] * block_stride + h * head_stride;
          if (j == 0 && blk + 1 < num_blocks)  // the later heads find these rows in cache
            prefetch(v_cache + table[blk + 1] * block_stride + h * head_stride, head_stride * sizeof(T));
          const int64_t rows = std::min(block_size, len - blk * block_size);
          for (int64_t r = blk == first_blk ? first - blk * block_size : 0; r < rows; ++r) {
            const float p = pj[blk * block_size + r];
            const T* vrow = base + r * head_dim;
            for (int64_t e = 0; e < head_dim; ++e) accj[e] += p * to_float(vrow[e]);
          }
        }
        if (D > 0)
          for (int64_t e = 0; e < head_dim; ++e) acc[j * head_dim + e] = accj[e];
      }
      for (int64_t j = 0; j < group; ++j)
        from_float(out + (b * num_heads + h * group + j) * head_dim, acc.data() + j * head_dim, head_dim);
    }
  });
}

}  // namespace

// q: [B, heads, d]; k_cache, v_cache: [blocks, kv_heads, block_size, d];
// block_tables: [B, max_blocks] int64; context_lens: [B] int64. Returns [B, heads, d].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [B, heads, d], cache [blocks, kvh, bs, d]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim mismatch");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "block_tables and context_lens must be int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(),
                                  "paged_decode_attention", [&] {
    const int64_t d = q.size(2);
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
             block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
             out.data_ptr<scalar_t>(), q.size(0), q.size(1), k_cache.size(1), d, k_cache.size(2),
             block_tables.size(1), static_cast<float>(scale), window);
    };
    if (d == 64) run(decode_kernel<scalar_t, 64>);
    else if (d == 128) run(decode_kernel<scalar_t, 128>);
    else run(decode_kernel<scalar_t, 0>);
  });
  return out;
}

namespace {

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// h += delta (rounded to T, like torch's add), then out = weight * T(h * rsqrt(mean(h^2) + eps)):
// the rounding steps of transformers' LlamaRMSNorm, so results match it in every dtype.
template <typename T>
void add_rms_norm_kernel(T* h, const T* delta, const T* weight, T* out, int64_t rows, int64_t dim,
                         float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> hf(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * dim;
      float sum = 0.f;
      for (int64_t i = 0; i < dim; ++i) {
        float v = to_float(hr[i]);
        if (delta != nullptr) {
          hr[i] = round_to<T>(v + to_float(delta[r * dim + i]));
          v = to_float(hr[i]);
        }
        hf[i] = v;
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / dim + eps);
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i)
        o[i] = round_to<T>(to_float(weight[i]) * to_float(round_to<T>(hf[i] * inv)));
    }
  });
}

// RoPE (rotate-half form) on the q and k heads of a fused qkv row, in place, then k and v are
// written to the paged caches at each token's slot.
template <typename T>
void rope_cache_write_kernel(T* qkv, const T* cos, const T* sin, T* k_cache, T* v_cache,
                             const int64_t* slots, int64_t tokens, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
  const int64_t half = head_dim / 2;
  const int64_t row = (num_heads + 2 * num_kv_heads) * head_dim;
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(head_dim);
    for (int64_t t = begin; t < end; ++t) {
      T* r = qkv + t * row;
      const T* c = cos + t * head_dim;
      const T* s = sin + t * head_dim;
      for (int64_t hd = 0; hd < num_heads + num_kv_heads; ++hd) {
        T* x = r + hd * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) xf[i] = to_float(x[i]);
        for (int64_t i = 0; i < half; ++i) {
          // each product rounded to T before the sum, as x * cos + rotate_half(x) * sin does
          x[i] = round_to<T>(to_float(round_to<T>(xf[i] * to_float(c[i]))) +
                             to_float(round_to<T>(-xf[i + half] * to_float(s[i]))));
          x[i + half] = round_to<T>(to_float(round_to<T>(xf[i + half] * to_float(c[i + half]))) +
                                    to_float(round_to<T>(xf[i] * to_float(s[i + half]))));
        }
      }
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t hd = 0; hd < num_kv_heads; ++hd) {
        const int64_t dst = ((block * num_kv_heads + hd) * block_size + offset) * head_dim;
        const T* k = r + (num_heads + hd) * head_dim;
        const T* v = r + (num_heads + num_kv_heads + hd) * head_dim;
        std::memcpy(k_cache + dst, k, head_dim * sizeof(T));
        std::memcpy(v_cache + dst, v, head_dim * sizeof(T));
      }
    }
  });
}

// out = silu(gate) * up for a fused [rows, 2 * dim] gate|up tensor, rounding like torch does.
template <typename T>
void silu_mul_kernel(const T* gate_up, T* out, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * dim;
      const T* u = g + dim;
      T* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float x = to_float(g[i]);
        const T act = round_to<T>(x / (1.f + std::exp(-x)));
        o[i] = round_to<T>(to_float(act) * to_float(u[i]));
      }
    }
  });
}

}  // namespace

// h: [T, dim] updated in place with delta (optional); returns the normalised rows.
torch::Tensor add_rms_norm(torch::Tensor h, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps) {
  TORCH_CHECK(h.is_contiguous() && h.dim() == 2, "h must be contiguous [T, dim]");
  auto out = torch::empty_like(h);
  torch::Tensor d = delta.has_value() ? delta->contiguous() : torch::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, h.scalar_type(),
                                  "add_rms_norm", [&] {
    add_rms_norm_kernel<scalar_t>(h.data_ptr<scalar_t>(), d.defined() ? d.data_ptr<scalar_t>() : nullptr,
                                  weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), h.size(0),
                                  h.size(1), static_cast<float>(eps));
  });
  return out;
}

// qkv: [T, (heads + 2 kv_heads) * d], roped in place; cos/sin: [T, d]; slots: [T] int64.
void rope_cache_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2), d = k_cache.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, qkv.scalar_type(),
                                  "rope_cache_write", [&] {
    rope_cache_write_kernel<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                                      sin.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                      v_cache.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(),
                                      qkv.size(0), num_heads, num_kv_heads, d, block_size);
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.dim() == 2, "gate_up must be contiguous [T, 2I]");
  const int64_t dim = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), dim}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, gate_up.scalar_type(),
                                  "silu_mul", [&] {
    silu_mul_kernel<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), dim);
  });
  return out;
}

namespace {

// y[m, n] = sum_k x[m, k] * w[n, k]: each weight row is read once for up to 8 rows m.
// Decoding a small batch is a matrix-vector product bound by how fast the weights stream from
// memory; with AVX512-BF16 one instruction does 32 bf16 multiply-adds into fp32 lanes.
//
// Any number of rows runs, 8 at a time over blocks of 64 weight rows (the block stays in L2
// while every 8-row tile of x passes over it). Each output y[m, n] is summed in one fixed order,
// k in steps of 32 into one fp32 vector, then one reduction tree, whatever M, the tile it falls
// in, or the thread that computes it: a row's result does not depend on the other rows of the
// batch (batch-invariant, what EngineConfig.deterministic relies on).
void small_m_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                         int64_t M, int64_t N, int64_t K) {
  constexpr int64_t kMaxM = 8, kBlockN = 64;
  at::parallel_for(0, (N + kBlockN - 1) / kBlockN, 1, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t nb = block_begin; nb < block_end; ++nb) {
      const int64_t n_end = std::min(N, (nb + 1) * kBlockN);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxM) {
        const int64_t mr = std::min(kMaxM, M - m0);
        const uint16_t* xt = x + m0 * K;
        for (int64_t n = nb * kBlockN; n < n_end; ++n) {
          const uint16_t* wr = w + n * K;
          float out[kMaxM];
#if defined(__AVX512BF16__)
          __m512 acc[kMaxM];
          for (int64_t m = 0; m < mr; ++m) acc[m] = _mm512_setzero_ps();
          int64_t k = 0;
          for (; k + 32 <= K; k += 32) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);
            for (int64_t m = 0; m < mr; ++m)
              acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(xt + m * K + k), wv);
          }
          if (k < K) {
            const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr + k);
            for (int64_t m = 0; m < mr; ++m)
              acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, xt + m * K + k), wv);
          }
          for (int64_t m = 0; m < mr; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
#else
          for (int64_t m = 0; m < mr; ++m) {
            float sum = 0.f;
            for (int64_t k = 0; k < K; ++k) {
              uint32_t a = static_cast<uint32_t>(xt[m * K + k]) << 16, b = static_cast<uint32_t>(wr[k]) << 16;
              float fa, fb;
              std::memcpy(&fa, &a, 4);
              std::memcpy(&fb, &b, 4);
              sum += fa * fb;
            }
            out[m] = sum;
          }
#endif
          for (int64_t m = 0; m < mr; ++m) {
            float v = out[m];
            if (bias != nullptr) {
              uint32_t bb = static_cast<uint32_t>(bias[n]) << 16;
              float fb;
              std::memcpy(&fb, &bb, 4);
              v = to_float(c10::BFloat16(v)) + fb;  // torch adds the bias to the rounded product
            }
            y[(m0 + m) * N + n] = c10::BFloat16(v).x;
          }
        }
      }
    }
  });
}

}  // namespace

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

inline vfloat load_v(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// dot products of kMR rows of x with kNR rows of w, into out[kMR * kNR]. The build forbids
// reassociation (-fno-associative-math, cpu_kernels.py): each sum is taken in the order written,
// whatever the tile's shape, so a row computed alone equals the same row beside others.
template <int kMR, int kNR>
inline void dot_tile(const float* x, const float* w, int64_t K, float* out) {
  vfloat acc[kMR][kNR] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vfloat wv[kNR];
    for (int j = 0; j < kNR; ++j) wv[j] = load_v(w + j * K + k);
    for (int i = 0; i < kMR; ++i) {
      const vfloat xv = load_v(x + i * K + k);
      for (int j = 0; j < kNR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < kMR; ++i)
    for (int j = 0; j < kNR; ++j) {
      float sum = 0.f;
      for (int lane = 0; lane < kLanes; ++lane) sum += acc[i][j][lane];
      for (int64_t kk = k; kk < K; ++kk) sum += x[i * K + kk] * w[j * K + kk];
      out[i * kNR + j] = sum;
    }
}

// The fp32 form of the same product, for any number of rows (the engine measures at start-up up
// to how many it beats torch's GEMM here: serving/engine/linear_choice.py). Weight rows are taken
// kNR at a time and stay in L1 while every kMR-row tile of x passes over them, so each weight
// byte comes from memory once and each load feeds several multiply-adds.
void small_m_linear_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                        int64_t K) {
  constexpr int kMR = 2, kNR = 4;
  at::parallel_for(0, (N + kNR - 1) / kNR, 16, [&](int64_t begin, int64_t end) {
    float out[kMR * kNR];
    for (int64_t nb = begin; nb < end; ++nb) {
      const int64_t n0 = nb * kNR, nr = std::min<int64_t>(kNR, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int64_t mr = std::min<int64_t>(kMR, M - m0);
        if (nr == kNR && mr == kMR) {
          dot_tile<kMR, kNR>(x + m0 * K, w + n0 * K, K, out);
        } else {
          for (int64_t i = 0; i < mr; ++i)
            for (int64_t j = 0; j < nr; ++j) dot_tile<1, 1>(x + (m0 + i) * K, w + (n0 + j) * K, K, out + i * kNR + j);
        }
        for (int64_t i = 0; i < mr; ++i)
          for (int64_t j = 0; j < nr; ++j)
            y[(m0 + i) * N + n0 + j] = out[i * kNR + j] + (bias != nullptr ? bias[n0 + j] : 0.f);
      }
    }
  });
}

}  // namespace

namespace {

// The batch-invariant linear for bf16 at any number of rows, in the layout of AVX512-BF16's
// dot product: weights packed once as [N/64][K/2][64 columns][2 k], so one 64-byte load holds
// 16 columns x 2 k, and an output row's 64 columns are 4 vectors of fp32 sums. For every k pair
// in order, x[m, k:k+2] is broadcast and multiplied into them:
//
//     acc[m][c] lane j += x[m, 2kk] * w[n, 2kk] + x[m, 2kk+1] * w[n, 2kk+1],  n = 64 nb + 16 c + j
//
// y[m, n] is that lane after the last pair: one order of sums per (m, n) whatever M, the 6-row
// tile m falls in, or the thread, and no horizontal reduction at all (what makes small_m_linear
// slower at many rows). Columns past N and the k past an odd K are packed as zeros.
constexpr int64_t kPackN = 64;
constexpr int64_t kTileM = 6;  // 6 rows x 4 vectors of sums + 4 of weights + x: 29 of the 32 registers

#if defined(__AVX512BF16__)
// Broadcast x[m, k] and x[m, k + 1] as one 32-bit lane (one load-and-broadcast; the last pair of an
// odd K gets a zero for the k past the row).
inline __m512bh x_pair(const uint16_t* xr, int64_t k, int64_t K) {
  uint32_t pair = xr[k];
  if (k + 1 < K) std::memcpy(&pair, xr + k, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
}

// fp32 -> bf16 rounded to nearest even, NaN -> 0x7FC0: c10::BFloat16(float)'s rounding, 16 lanes at
// once (not vcvtneps2bf16, which flushes denormals to zero).
inline __m256i ps_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  // NaN by its bits (-ffast-math may fold a floating-point v != v away)
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
}

inline __m512 bf16_to_ps(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int MR>
inline void packed_tile_bf16(const uint16_t* x, int64_t K, const uint16_t* wb, int64_t pairs, __m512* acc) {
  for (int i = 0; i < MR * 4; ++i) acc[i] = _mm512_setzero_ps();
  const int64_t full_pairs = K / 2;
  auto step = [&](int64_t kk, auto&& pair_of) {
    const uint16_t* wk = wb + kk * 2 * kPackN;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(wk + 64), w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = pair_of(x + m * K, 2 * kk);
      acc[m * 4 + 0] = _mm512_dpbf16_ps(acc[m * 4 + 0], xv, w0);
      acc[m * 4 + 1] = _mm512_dpbf16_ps(acc[m * 4 + 1], xv, w1);
      acc[m * 4 + 2] = _mm512_dpbf16_ps(acc[m * 4 + 2], xv, w2);
      acc[m * 4 + 3] = _mm512_dpbf16_ps(acc[m * 4 + 3], xv, w3);
    }
  };
  for (int64_t kk = 0; kk < full_pairs; ++kk)
    step(kk, [](const uint16_t* xr, int64_t k) {
      int32_t pair;
      std::memcpy(&pair, xr + k, sizeof(pair));
      return (__m512bh)_mm512_set1_epi32(pair);
    });
  if (full_pairs < pairs) step(full_pairs, [K](const uint16_t* xr, int64_t k) { return x_pair(xr, k, K); });
}
#endif

void packed_linear_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y, int64_t M,
                        int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
  const int64_t pairs = (K + 1) / 2;
  at::parallel_for(0, (N + kPackN - 1) / kPackN, 1, [&](int64_t block_begin, int64_t block_end) {
    __m512 acc[kTileM * 4];
    for (int64_t nb = block_begin; nb < block_end; ++nb) {
      const uint16_t* wb = wp + nb * pairs * 2 * kPackN;
      for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
        const int64_t mr = std::min<int64_t>(kTileM, M - m0);
        const uint16_t* xt = x + m0 * K;
        switch (mr) {
          case 6: packed_tile_bf16<6>(xt, K, wb, pairs, acc); break;
          case 5: packed_tile_bf16<5>(xt, K, wb, pairs, acc); break;
          case 4: packed_tile_bf16<4>(xt, K, wb, pairs, acc); break;
          case 3: packed_tile_bf16<3>(xt, K, wb, pairs, acc); break;
          case 2: packed_tile_bf16<2>(xt, K, wb, pairs, acc); break;
          default: packed_tile_bf16<1>(xt, K, wb, pairs, acc); break;
        }
        for (int c = 0; c < 4; ++c) {
          const int64_t n0 = nb * kPackN + c * 16;
          if (n0 >= N) break;
          const __mmask16 lanes = N - n0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (N - n0)) - 1);
          const __m512 b = bias != nullptr ? bf16_to_ps(_mm256_maskz_loadu_epi16(lanes, bias + n0)) : _mm512_setzero_ps();
          for (int64_t m = 0; m < mr; ++m) {
            __m512 v = acc[m * 4 + c];
            if (bias != nullptr) v = _mm512_add_ps(bf16_to_ps(ps_to_bf16(v)), b);
            _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0, lanes, ps_to_bf16(v));
          }
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "packed_linear: this CPU has no AVX512-BF16");
#endif
}

}  // namespace

bool has_packed_linear() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// w: [N, K] bf16 -> [ceil(N / 64), ceil(K / 2), 64, 2], zero-padded (the layout packed_linear reads).
torch::Tensor pack_linear_weight(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2, "w must be bf16 [N, K]");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + kPackN - 1) / kPackN, pairs = (K + 1) / 2;
  auto packed = torch::zeros({blocks, pairs, kPackN, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      dst[((n / kPackN * pairs + k / 2) * kPackN + n % kPackN) * 2 + k % 2] = src[n * K + k];
  return packed;
}

// x: [M, K] bf16, packed: pack_linear_weight(w) of w [N, K], bias: [N] or None. Returns [M, N].
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(1) == (x.size(1) + 1) / 2 &&
                  packed.size(0) == (N + kPackN - 1) / kPackN, "x [M, K], packed from a [N, K] weight");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), N}, x.options());
  torch::Tensor bias_t;
  if (bias.has_value()) {
    bias_t = bias->contiguous();
    TORCH_CHECK(bias_t.scalar_type() == at::kBFloat16 && bias_t.numel() == N, "bias must be bf16 [N]");
  }
  packed_linear_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                     reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                     bias_t.defined() ? reinterpret_cast<const uint16_t*>(bias_t.data_ptr<at::BFloat16>()) : nullptr,
                     reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), x.size(0), N, x.size(1));
  return y;
}

// x: [M, K], w: [N, K] of x's dtype (nn.Linear layout), bias: [N] or None.
// Returns [M, N].
torch::Tensor small_m_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w must have one dtype");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "bf16 or fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  x = x.contiguous();
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  torch::Tensor bias_t;
  if (bias.has_value()) {
    bias_t = bias->contiguous();
    TORCH_CHECK(bias_t.scalar_type() == x.scalar_type() && bias_t.numel() == w.size(0), "bias must be [N] of x's dtype");
  }
  if (x.scalar_type() == at::kFloat) {
    small_m_linear_f32(x.data_ptr<float>(), w.data_ptr<float>(), bias_t.defined() ? bias_t.data_ptr<float>() : nullptr,
                       y.data_ptr<float>(), x.size(0), w.size(0), x.size(1));
    return y;
  }
  const uint16_t* b = bias_t.defined() ? reinterpret_cast<const uint16_t*>(bias_t.data_ptr<at::BFloat16>()) : nullptr;
  small_m_linear_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                      reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), b,
                      reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), x.size(0), w.size(0),
                      x.size(1));
  return y;
}

namespace {

// ---- multi-LoRA: each token's own adapter, segmented (the Punica / S-LoRA "SGMV" idea) ---------
// y[row] += (x[row] A_s^T) B_s^T for each listed row, s its adapter's slot: A_s = a[lo_s:hi_s]
// ([r, in]) and B_s^T = bt[lo_s:hi_s] ([r, out]), the slot's rank range in the step's stacked
// adapters. A token costs its own adapter's rank only, where a stacked product costs every
// resident adapter's. Rows come sorted by slot, so one adapter's A and B stay in cache across its
// tokens. Sums are fp32 and a row's result depends on that row alone (batch-invariant); y is
// rounded once.

template <typename T>
inline void load_row_f32(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (; i + 16 <= n; i += 16) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

// yr[0:kLanes] += v, rounded once to T (bf16: round to nearest even, as c10::BFloat16(float))
inline void add_lanes(float* yr, const vfloat& v) {
  const vfloat sum = load_v(yr) + v;
  std::memcpy(yr, &sum, sizeof(sum));
}
inline void add_lanes(c10::BFloat16* yr, const vfloat& v) {
#if defined(__AVX512BF16__)
  static_assert(kLanes == 16);
  __m512 vv;
  std::memcpy(&vv, &v, sizeof(vv));
  const __m512 sum = _mm512_add_ps(bf16_to_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(yr))), vv);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr), ps_to_bf16(sum));
#else
  for (int lane = 0; lane < kLanes; ++lane) yr[lane] = c10::BFloat16(to_float(yr[lane]) + v[lane]);
#endif
}

inline vfloat load_lanes(const float* p) { return load_v(p); }
inline vfloat load_lanes(const c10::BFloat16* p) {
  vfloat v;
#if defined(__AVX512BF16__)
  const __m512 wide = bf16_to_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &wide, sizeof(v));
#else
  for (int lane = 0; lane < kLanes; ++lane) v[lane] = to_float(p[lane]);
#endif
  return v;
}

constexpr int kLoraTile = 8;

// Runs of up to kLoraTile listed rows of one slot (rows come sorted by slot), without the slots
// whose range is empty (their adapter leaves this linear alone).
struct LoraTile {
  int64_t first, count;
};
inline std::vector<LoraTile> lora_tiles(const int64_t* slots, const int64_t* ranges, int64_t n) {
  std::vector<LoraTile> tiles;
  for (int64_t i = 0; i < n;) {
    int64_t j = i;
    while (j < n && j - i < kLoraTile && slots[j] == slots[i]) ++j;
    if (ranges[2 * slots[i] + 1] > ranges[2 * slots[i]]) tiles.push_back({i, j - i});
    i = j;
  }
  return tiles;
}  // tokens of one adapter that share each load of its A and B

template <typename T>
void lora_segmented_impl(T* y, const T* x, const T* a, const T* bt, const int64_t* rows, const int64_t* slots,
                         const int64_t* ranges, int64_t n, int64_t in, int64_t out) {
  const std::vector<LoraTile> tiles = lora_tiles(slots, ranges, n);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs(kLoraTile * in), as, hs;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = tiles[t].first, count = tiles[t].count;
      const int64_t lo = ranges[2 * slots[first]], rank = ranges[2 * slots[first] + 1] - lo;
      // fp32 copies of the tile's x rows (zero past `count`) and its adapter's A
      std::fill(xs.begin(), xs.end(), 0.f);
      for (int64_t m = 0; m < count; ++m) load_row_f32(x + rows[first + m] * in, xs.data() + m * in, in);
      as.resize(rank * in);
      load_row_f32(a + lo * in, as.data(), rank * in);
      const T* b_rows = bt + lo * out;
      // shrink: h[j][m] = x_m . A_j
      hs.assign(rank * kLoraTile, 0.f);
      float h_tile[kLoraTile * 2];
      int64_t j = 0;
      for (; j + 2 <= rank; j += 2) {
        dot_tile<kLoraTile, 2>(xs.data(), as.data() + j * in, in, h_tile);
        for (int m = 0; m < kLoraTile; ++m) {
          hs[j * kLoraTile + m] = h_tile[m * 2];
          hs[(j + 1) * kLoraTile + m] = h_tile[m * 2 + 1];
        }
      }
      if (j < rank) {
        dot_tile<kLoraTile, 1>(xs.data(), as.data() + j * in, in, h_tile);
        for (int m = 0; m < kLoraTile; ++m) hs[j * kLoraTile + m] = h_tile[m];
      }
      // expand: y_m += sum_j h[j][m] B^T_j, 16 outputs at a time in registers for all the tile's rows
      int64_t k = 0;
      for (; k + kLanes <= out; k += kLanes) {
        vfloat acc[kLoraTile] = {};
        for (int64_t jj = 0; jj < rank; ++jj) {
          const vfloat b = load_lanes(b_rows + jj * out + k);
          const float* h = hs.data() + jj * kLoraTile;
          for (int m = 0; m < kLoraTile; ++m) acc[m] += h[m] * b;
        }
        for (int64_t m = 0; m < count; ++m) add_lanes(y + rows[first + m] * out + k, acc[m]);
      }
      for (; k < out; ++k)
        for (int64_t m = 0; m < count; ++m) {
          float sum = 0.f;
          for (int64_t jj = 0; jj < rank; ++jj) sum += hs[jj * kLoraTile + m] * to_float(b_rows[jj * out + k]);
          T* yr = y + rows[first + m] * out + k;
          *yr = static_cast<T>(to_float(*yr) + sum);
        }
    }
  });
}


#if defined(__AVX512BF16__)
// The bf16 form with AVX512-BF16's pair dot products (32 multiply-adds an instruction, no
// conversions): the shrink reads x and A as they are; the expand reads B^T packed by pairs of
// rank rows, [pairs, out, 2] per slot (LoRAManager lays it out), and h rounded to bf16 pairs.
void lora_segmented_packed_bf16(uint16_t* y, const uint16_t* x, const uint16_t* a, const uint16_t* bp,
                                const int64_t* rows, const int64_t* slots, const int64_t* ranges,
                                const int64_t* pair_starts, int64_t n, int64_t in, int64_t out) {
  const std::vector<LoraTile> tiles = lora_tiles(slots, ranges, n);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> hp;  // [pairs][kLoraTile]: each row's (h_2p, h_2p+1) as two bf16
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = tiles[t].first, count = tiles[t].count;
      const int64_t slot = slots[first], lo = ranges[2 * slot], rank = ranges[2 * slot + 1] - lo;
      const int64_t pairs = (rank + 1) / 2;
      const uint16_t* xr[kLoraTile];
      for (int m = 0; m < kLoraTile; ++m) xr[m] = x + rows[first + std::min<int64_t>(m, count - 1)] * in;
      // shrink: h[m][j] = x_m . A_j, fp32 sums of bf16 pairs; two rank rows at a time, their 16
      // sums reduced together
      hp.assign(pairs * kLoraTile, 0u);
      for (int64_t j = 0; j < rank; j += 2) {
        const bool two = j + 1 < rank;
        const uint16_t* a0 = a + (lo + j) * in;
        const uint16_t* a1 = two ? a0 + in : a0;
        __m512 acc[2 * kLoraTile];
        for (int i = 0; i < 2 * kLoraTile; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < in; k += 32) {
          const __mmask32 mask = in - k >= 32 ? (__mmask32)~0u : (__mmask32)((1ull << (in - k)) - 1);
          const __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, a0 + k);
          const __m512bh v1 = (__m512bh)_mm512_maskz_loadu_epi16(mask, a1 + k);
          for (int m = 0; m < kLoraTile; ++m) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[m] + k);
            acc[m] = _mm512_dpbf16_ps(acc[m], xv, v0);
            acc[kLoraTile + m] = _mm512_dpbf16_ps(acc[kLoraTile + m], xv, v1);
          }
        }
        alignas(64) float sums[2 * kLoraTile];
        _mm512_store_ps(sums, reduce16(acc));
        for (int m = 0; m < kLoraTile; ++m) {
          // (h_j, h_j+1) as one bf16 pair; an odd rank's last pair has a zero second half
          const uint32_t h0 = c10::BFloat16(sums[m]).x, h1 = two ? c10::BFloat16(sums[kLoraTile + m]).x : 0u;
          hp[(j / 2) * kLoraTile + m] = h0 | (h1 << 16);
        }
      }
      // expand: y_m += sum_p (h_2p, h_2p+1) . (B^T_2p, B^T_2p+1), 32 outputs at a time
      const uint16_t* b = bp + pair_starts[slot] * out * 2;
      for (int64_t k = 0; k < out; k += 32) {
        const int64_t lanes0 = std::min<int64_t>(16, out - k), lanes1 = std::max<int64_t>(0, std::min<int64_t>(16, out - k - 16));
        const __mmask16 mask0 = (__mmask16)((1u << lanes0) - 1), mask1 = (__mmask16)((1u << lanes1) - 1);
        __m512 acc[2 * kLoraTile];
        for (int i = 0; i < 2 * kLoraTile; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p) {
          const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi32(mask0, b + (p * out + k) * 2);
          const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi32(mask1, b + (p * out + k + 16) * 2);
          const uint32_t* h = hp.data() + p * kLoraTile;
          for (int m = 0; m < kLoraTile; ++m) {
            const __m512bh hv = (__m512bh)_mm512_set1_epi32(static_cast<int>(h[m]));
            acc[m] = _mm512_dpbf16_ps(acc[m], hv, w0);
            acc[kLoraTile + m] = _mm512_dpbf16_ps(acc[kLoraTile + m], hv, w1);
          }
        }
        for (int64_t m = 0; m < count; ++m) {
          uint16_t* yr = y + rows[first + m] * out + k;
          _mm256_mask_storeu_epi16(yr, mask0, ps_to_bf16(_mm512_add_ps(bf16_to_ps(_mm256_maskz_loadu_epi16(mask0, yr)), acc[m])));
          if (lanes1 > 0)
            _mm256_mask_storeu_epi16(yr + 16, mask1,
                                     ps_to_bf16(_mm512_add_ps(bf16_to_ps(_mm256_maskz_loadu_epi16(mask1, yr + 16)), acc[kLoraTile + m])));
        }
      }
    }
  });
}
#endif

}  // namespace

// y [T, out] (added to in place), x [T, in], a [R, in], bt [R, out], all of one dtype (bf16 or
// fp32); rows, slots [n] int64 (the rows that have an adapter, and its slot); ranges [S, 2] int64
// (each slot's rank range in a and bt; empty: the adapter leaves this linear alone).
// What both forms check of their rows: y [T, out], x [T, in], a [R, in]; rows, slots [n] int64
// within T and the slots; ranges [S, 2] int64 within a.
void check_lora_rows(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& rows,
                     const torch::Tensor& slots, const torch::Tensor& ranges) {
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && a.is_contiguous() && rows.is_contiguous() && slots.is_contiguous() &&
                  ranges.is_contiguous(), "contiguous tensors only");
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0) && a.size(1) == x.size(1), "y [T, out], x [T, in], a [R, in]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && ranges.scalar_type() == at::kLong &&
                  rows.numel() == slots.numel() && ranges.dim() == 2 && ranges.size(1) == 2, "rows, slots [n], ranges [S, 2] int64");
  const int64_t n = rows.numel(), num_slots = ranges.size(0), total = y.size(0);
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* g = ranges.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < total && s[i] >= 0 && s[i] < num_slots, "row or slot out of range");
  for (int64_t i = 0; i < num_slots; ++i)
    TORCH_CHECK(g[2 * i] >= 0 && g[2 * i] <= g[2 * i + 1] && g[2 * i + 1] <= a.size(0), "a slot's rank range is outside a");
}

void lora_segmented(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor bt, torch::Tensor rows,
                    torch::Tensor slots, torch::Tensor ranges) {
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  bt.scalar_type() == y.scalar_type(), "y, x, a and bt must have one dtype");
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kFloat, "bf16 or fp32 only");
  check_lora_rows(y, x, a, rows, slots, ranges);
  TORCH_CHECK(bt.is_contiguous() && bt.dim() == 2 && bt.size(1) == y.size(1) && a.size(0) == bt.size(0), "bt [R, out]");
  const int64_t n = rows.numel();
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* g = ranges.data_ptr<int64_t>();
  if (y.scalar_type() == at::kFloat) {
    lora_segmented_impl<float>(y.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), bt.data_ptr<float>(), r, s, g,
                               n, x.size(1), y.size(1));
  } else {
    lora_segmented_impl<c10::BFloat16>(y.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), a.data_ptr<at::BFloat16>(),
                                       bt.data_ptr<at::BFloat16>(), r, s, g, n, x.size(1), y.size(1));
  }
}

// The bf16 form on AVX512-BF16: as lora_segmented, with B^T packed by pairs of rank rows
// (bp: each slot's [ceil(r / 2), out, 2] from pair_starts[slot] pairs on, zero-padded).
void lora_segmented_packed(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor bp, torch::Tensor rows,
                           torch::Tensor slots, torch::Tensor ranges, torch::Tensor pair_starts) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16 && a.scalar_type() == at::kBFloat16 &&
                  bp.scalar_type() == at::kBFloat16, "bf16 only");
  check_lora_rows(y, x, a, rows, slots, ranges);
  TORCH_CHECK(bp.is_contiguous() && pair_starts.is_contiguous() && pair_starts.scalar_type() == at::kLong &&
                  pair_starts.numel() == ranges.size(0), "bp contiguous, pair_starts [S] int64");
  const int64_t n = rows.numel(), num_slots = ranges.size(0), out = y.size(1);
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* g = ranges.data_ptr<int64_t>();
  const int64_t* ps = pair_starts.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_slots; ++i)
    TORCH_CHECK(ps[i] >= 0 && (ps[i] + (g[2 * i + 1] - g[2 * i] + 1) / 2) * out * 2 <= bp.numel(), "a slot's pairs are outside bp");
  lora_segmented_packed_bf16(reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()),
                             reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                             reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>()),
                             reinterpret_cast<const uint16_t*>(bp.data_ptr<at::BFloat16>()), r, s, g, ps, n, x.size(1), out);
#else
  TORCH_CHECK(false, "lora_segmented_packed needs AVX512-BF16 (has_packed_linear)");
#endif
}

// Every kernel runs without the GIL (its tensors are converted before and its result after):
// in a served replica the event loop that streams tokens and answers Serve shares the process
// with the engine's step thread, and must not wait for a kernel.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("window") = 0, no_gil());
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm", no_gil());
  m.def("rope_cache_write", &rope_cache_write, "RoPE on q/k in place + K/V cache write", no_gil());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up", no_gil());
  m.def("has_packed_linear", &has_packed_linear, "whether packed_linear runs here (AVX512-BF16)");
  m.def("pack_linear_weight", &pack_linear_weight, "bf16 [N, K] -> the layout of packed_linear", no_gil());
  m.def("packed_linear", &packed_linear, "batch-invariant bf16 x @ w.T (+ bias) from a packed w", no_gil());
  m.def("small_m_linear", &small_m_linear, "x @ w.T (+ bias), rows summed independently of each other", no_gil());
  m.def("lora_segmented_packed", &lora_segmented_packed, "lora_segmented in bf16 pairs, B^T packed (AVX512-BF16)",
        no_gil());
  m.def("lora_segmented", &lora_segmented, "y[rows] += (x[rows] A_slot^T) B_slot^T, each row its own adapter", no_gil());
}
