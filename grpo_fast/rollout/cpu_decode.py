"""The native engine's CPU decode step in C++ kernels (built once per machine with torch's extension loader;
the engine runs its PyTorch ops and oneDNN's linears where they cannot be built).

A 16-row decode step of SmolLM2-135M spends as much time in the ~30 small operators per layer around its four
GEMMs (norms, casts, RoPE, the KV write, two attention calls and their merge, SiLU, residual adds) as in the
GEMMs: each costs microseconds of dispatch for nanoseconds of arithmetic. Here a layer is four GEMMs and four
calls:
- `add_rms_norm(x, delta, weight, eps, dtype)`: x += delta in place (fp32 residual stream), returns
  RMSNorm(x) * weight in the next linear's dtype (fp32 arithmetic, the HF module's: x * rsqrt(mean(x^2) + eps)
  cast to the weight's dtype, times the weight);
- `rope_attend(qkv, cos, sin, ck, ckt, cv, pkt, pv, pvalid, t, heads, scaling, dtype)`: RoPE on the step's
  queries and keys (rotate-half, HF's), the row's key (into `ck` and its blocked copy `ckt`) and value
  written into its completion KV at slot t, then one fp32 softmax per query over its group's prompt keys
  (those `pvalid` marks; `pkt` blocked) and its own completion keys 0..t;
- `silu_mul(gate_up)`: SiLU(gate) * up of the fused gate / up projection, in its dtype;
- `linear(x, packed, bias, N)` (fp32 and bf16 weights on AVX-512, bf16 through vdpbf16ps where AVX512-BF16
  has it; fp32 and bf16 on AVX2 + FMA, bf16 widened to fp32 in registers; `linear_for`): the linears
  themselves, weights packed by `pack_linear` (repacked in place at each generate call) in blocks of 16
  output columns and streamed once per call, tiles of up to 8 rows x 48 columns (AVX2: 6 x 16)
  accumulating in fp32 registers, the rows split into tiles as even as can be. At decode shapes it beats
  oneDNN's packed linear (SmolLM2's 30 layers, 16 rows, weights streamed from memory, Zen 4: bf16 ~16 ->
  ~13 ms, fp32 ~26 -> ~20 ms; 8 rows 1.6x), whose small-M GEMMs run well below the machine's bandwidth; on
  a Zen 3 (AVX2) it reaches torch's large-GEMM peak there at 16 rows, where torch's own bf16 product runs at
  0.3 GFLOP/s.
The attention keeps the keys transposed as well, in blocks of 64 keys (d x 64 each, `blocked_keys`), so that
a query's scores accumulate 32 (AVX2) or 64 keys at a time in vector registers; one task per (row, KV head)
does RoPE on its query heads and key, writes the key and value, and runs those query heads together, each
key and value loaded once for up to three of them; the softmax exponentiates vector-wide.
`decode_layers` runs a step's whole layer stack in one call (native's step, where every linear is the
kernel's), with no return to the interpreter between the ~240 kernel calls. Vectors are GCC / Clang vector
extensions one machine register wide (AVX-512 or AVX2 as the machine has: the build is for this CPU,
`-march=native`, cached under a name holding its model and flags).
"""

import functools
import hashlib
import os
import shutil
import sys
import threading

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <immintrin.h>
#include <vector>

namespace {

constexpr int64_t KEYS = 64;      // keys per score block (4 AVX-512 / 8 AVX2 registers); buffers padded to it
constexpr float MASKED = -1e30f;  // a finite "minus infinity": the build assumes finite math

template <typename T> inline float f32(T v) { return static_cast<float>(v); }

template <typename X, typename D, typename O>
void add_rms_norm_impl(X* x, const D* delta, const float* w, O* out, int64_t R, int64_t H, float eps) {
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      X* xr = x + r * H;
      float ss = 0.f;
      if (delta != nullptr) {
        const D* dr = delta + r * H;
        for (int64_t j = 0; j < H; ++j) {
          const float v = f32(xr[j]) + f32(dr[j]);
          xr[j] = static_cast<X>(v);
        }
      }
      for (int64_t j = 0; j < H; ++j) ss += f32(xr[j]) * f32(xr[j]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      O* o = out + r * H;
      for (int64_t j = 0; j < H; ++j) o[j] = static_cast<O>(f32(static_cast<X>(f32(xr[j]) * inv)) * w[j]);
    }
  });
}

template <typename T>
void silu_mul_impl(const T* gu, T* out, int64_t R, int64_t I) {
  at::parallel_for(0, R, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * I;
      const T* u = g + I;
      T* o = out + r * I;
      for (int64_t j = 0; j < I; ++j) {
        const float a = f32(g[j]);
        o[j] = static_cast<T>(static_cast<float>(static_cast<T>(a / (1.f + std::exp(-a)))) * f32(u[j]));
      }
    }
  });
}

// one machine register of fp32 lanes (GCC / Clang vector extensions): 16 on AVX-512, 8 on AVX2. Never
// wider than the machine's registers: a 64-byte vector on AVX2 lives on the stack, every FMA through memory
#if defined(__AVX512F__)
constexpr int64_t VL = 16;
#else
constexpr int64_t VL = 8;
#endif
constexpr int NREG = KEYS / VL;  // registers holding one block of scores
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bf16 -> fp32: the 16 bits become the high half; one widening load and a shift (GCC's conversion of the
// vector extensions' types took six instructions on AVX-512; with these rope_attend alone ran ~0.86x the
// time at SmolLM2's shapes, position 128, bf16 KV, Zen 4; the whole decode step did not move measurably)
inline vf loadv(const at::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
  return (vf)_mm512_castsi512_ps(u);
#elif defined(__AVX2__)
  const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
  return (vf)_mm256_castsi256_ps(u);
#else
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

// s[h][p] = qs_h . key_p for `nq` queries, already scaled and padded with zero queries to a multiple of
// HEADS (`padded_heads`), against `count` keys stored in blocks of KEYS keys, each block transposed
// (`blocked_keys`: key p's element j at keys_t[p / KEYS][j][p % KEYS], readable up to `count` rounded up to
// KEYS; one block is one contiguous read, where rows of a whole transposed cache were 64 reads 1 KiB
// apart): HEADS heads at a time over up to SK keys in up to SREG registers each, every key loaded once for
// them all, over j (all of them: fixed counts keep the accumulators in registers). A stretch's registers
// are as many as its keys need (a block's last stretch: at 16 keys one of four), so a row's partly written
// last block is read only as far as its keys go (SmolLM2's 30 layers, 16 rows, a 38-token prompt, Zen 4:
// 0.62x the time at t = 0, 0.87x at 16, ~0.95x at 64-200, alike at 255)
constexpr int HEADS = 3, SREG = 4;
constexpr int64_t SK = SREG * VL;  // 32 keys (AVX2), 64 (AVX-512): KEYS is a multiple
template <int NS, typename KV>
inline void score_stretch(const float* qg, const KV* keys_t, int64_t p0, int64_t d, vf (&a)[HEADS][SREG]) {
  for (int64_t j = 0; j < d; ++j) {
    const KV* row = keys_t + ((p0 / KEYS) * d + j) * KEYS + p0 % KEYS;
#pragma GCC unroll 4
    for (int s = 0; s < NS; ++s) {
      const vf k = loadv(row + VL * s);
#pragma GCC unroll 3
      for (int h = 0; h < HEADS; ++h) a[h][s] += qg[h * d + j] * k;
    }
  }
}
template <typename KV>
void scores(const float* qs, int64_t nq, const KV* keys_t, int64_t count, int64_t d, float* out,
            int64_t out_stride) {
  for (int64_t h0 = 0; h0 < nq; h0 += HEADS) {
    const float* qg = qs + h0 * d;
    const int64_t hb = std::min<int64_t>(HEADS, nq - h0);
    for (int64_t p0 = 0; p0 < count; p0 += SK) {
      vf a[HEADS][SREG] = {};
      const int64_t n = std::min(SK, count - p0), regs = (n + VL - 1) / VL;
      static_assert(SREG == 4, "score_stretch's dispatch");
      if (regs == 4) score_stretch<4>(qg, keys_t, p0, d, a);
      else if (regs == 3) score_stretch<3>(qg, keys_t, p0, d, a);
      else if (regs == 2) score_stretch<2>(qg, keys_t, p0, d, a);
      else score_stretch<1>(qg, keys_t, p0, d, a);
      for (int64_t h = 0; h < hb; ++h) {
        float tmp[SK];
        std::memcpy(tmp, a[h], sizeof(tmp));
        std::memcpy(out + (h0 + h) * out_stride + p0, tmp, sizeof(float) * n);
      }
    }
  }
}

// the heads `scores` runs for nq queries: nq rounded up to a multiple of HEADS (zero queries past nq)
inline int64_t padded_heads(int64_t nq) { return (nq + HEADS - 1) / HEADS * HEADS; }

// RoPE (rotate-half, HF's) of one head's d values in fp32: out = x * cos + rotate_half(x) * sin
template <typename Q>
inline void rope(const Q* x, const float* c, const float* s, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float lo = f32(x[j]), hi = f32(x[j + half]);
    out[j] = lo * c[j] - hi * s[j];
    out[j + half] = hi * c[j + half] + lo * s[j + half];
  }
}

// acc[h][:] += sum_p w[h][p] * values[p][:] for `nq` weight rows (stride `w_stride`): heads HEADS at
// a time (past nq the last head's weights again, its sums dropped) over SK outputs in SREG registers
// each, every value loaded once for them all, over p; past d's last multiple of SK one head at a time, VL
// outputs, then a scalar tail
template <typename KV>
void accumulate(const float* w, int64_t w_stride, int64_t nq, const KV* values, int64_t count, int64_t d,
                float* acc) {
  const int64_t ds = d / SK * SK, dv = d / VL * VL;
  for (int64_t h0 = 0; h0 < nq; h0 += HEADS) {
    const int64_t hb = std::min<int64_t>(HEADS, nq - h0);
    const float* wh[HEADS];
    for (int64_t h = 0; h < HEADS; ++h) wh[h] = w + (h0 + std::min(h, hb - 1)) * w_stride;
    for (int64_t j0 = 0; j0 < ds; j0 += SK) {
      vf a[HEADS][SREG] = {};
      for (int64_t p = 0; p < count; ++p) {
        const KV* v = values + p * d + j0;
#pragma GCC unroll 4
        for (int s = 0; s < SREG; ++s) {
          const vf x = loadv(v + VL * s);
#pragma GCC unroll 3
          for (int h = 0; h < HEADS; ++h) a[h][s] += wh[h][p] * x;
        }
      }
      for (int64_t h = 0; h < hb; ++h) {
        float tmp[SK];
        std::memcpy(tmp, a[h], sizeof(tmp));
        float* acc_h = acc + (h0 + h) * d + j0;
        for (int64_t b = 0; b < SK; ++b) acc_h[b] += tmp[b];
      }
    }
    for (int64_t h = 0; h < hb; ++h) {
      float* acc_h = acc + (h0 + h) * d;
      for (int64_t j0 = ds; j0 < dv; j0 += VL) {
        vf a = {};
        for (int64_t p = 0; p < count; ++p) a += wh[h][p] * loadv(values + p * d + j0);
        float tmp[VL];
        std::memcpy(tmp, &a, sizeof(a));
        for (int64_t b = 0; b < VL; ++b) acc_h[j0 + b] += tmp[b];
      }
      for (int64_t p = 0; p < count && dv < d; ++p)
        for (int64_t j = dv; j < d; ++j) acc_h[j] += wh[h][p] * f32(values[p * d + j]);
    }
  }
}

template <typename Q, typename KV, typename O>
void rope_attend_impl(const Q* qkv, const float* cos, const float* sin, KV* ck, KV* ckt, KV* cv,
                      const KV* pkt, const KV* pv, const uint8_t* pvalid, const int64_t* t, O* out, int64_t R,
                      int64_t n, int64_t nh, int64_t kvh, int64_t d, int64_t cap, int64_t P, int64_t ldp,
                      float scaling) {
  const int64_t G = R / n, rep = nh / kvh, width = (nh + 2 * kvh) * d;
  // per (row, KV head), one task: RoPE on its rep query heads (scaled, into qs) and its key, the key (both
  // layouts) and value written into the row's completion KV at slot t, then those queries over the group's
  // prompt keys and the row's own keys 0..t
  at::parallel_for(0, R * kvh, 1, [&](int64_t i0, int64_t i1) {
    const int64_t stride = P + cap;
    std::vector<float> sc(rep * stride), acc(rep * d), qs(padded_heads(rep) * d, 0.f), key(d);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / kvh, kh = i % kvh, g = r / G, len = t[r] + 1, L = P + len;
      const Q* row = qkv + r * width;
      const float* c = cos + r * d;
      const float* sn = sin + r * d;
      for (int64_t h = 0; h < rep; ++h) {
        float* q = qs.data() + h * d;
        rope(row + (kh * rep + h) * d, c, sn, d, q);
        for (int64_t j = 0; j < d; ++j) q[j] *= scaling;
      }
      rope(row + (nh + kh) * d, c, sn, d, key.data());
      KV* dst = ck + ((r * kvh + kh) * cap + t[r]) * d;
      KV* dst_t = ckt + ((r * kvh + kh) * cap + t[r] / KEYS * KEYS) * d + t[r] % KEYS;
      KV* dst_v = cv + ((r * kvh + kh) * cap + t[r]) * d;
      const Q* v = row + (nh + kvh + kh) * d;
      for (int64_t j = 0; j < d; ++j) {
        dst[j] = static_cast<KV>(key[j]);
        dst_t[j * KEYS] = dst[j];
        dst_v[j] = static_cast<KV>(f32(v[j]));
      }
      const KV* pv_h = pv + (g * kvh + kh) * P * d;
      const KV* cv_h = cv + (r * kvh + kh) * cap * d;
      const uint8_t* valid = pvalid + g * P;
      scores(qs.data(), rep, pkt + (g * kvh + kh) * d * ldp, P, d, sc.data(), stride);
      scores(qs.data(), rep, ckt + (r * kvh + kh) * d * cap, len, d, sc.data() + P, stride);
      for (int64_t h = 0; h < rep; ++h) {
        float* s = sc.data() + h * stride;
        for (int64_t p = 0; p < P; ++p) s[p] = valid[p] ? s[p] : MASKED;
        float mx = MASKED;
        for (int64_t p = 0; p < L; ++p) mx = std::max(mx, s[p]);
        for (int64_t p = 0; p < L; ++p) s[p] = std::exp(s[p] - mx);
        float sum = 0.f;
        for (int64_t p = 0; p < L; ++p) sum += s[p];
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < L; ++p) s[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      accumulate(sc.data(), stride, rep, pv_h, P, d, acc.data());
      accumulate(sc.data() + P, stride, rep, cv_h, len, d, acc.data());
      for (int64_t h = 0; h < rep; ++h) {
        O* o = out + (r * nh + kh * rep + h) * d;
        for (int64_t j = 0; j < d; ++j) o[j] = static_cast<O>(acc[h * d + j]);
      }
    }
  });
}

#define FLOAT_OR_BF16(TYPE, NAME, ...)                                   \
  [&] {                                                                  \
    if ((TYPE) == at::kFloat) { using NAME = float; return __VA_ARGS__(); } \
    TORCH_CHECK((TYPE) == at::kBFloat16, #NAME " must be float32 or bfloat16"); \
    using NAME = at::BFloat16; return __VA_ARGS__();                     \
  }()

// ---- the decode's linear layers: y (M, N) = x (M, K) W^T + bias, fp32 accumulation. W packed in blocks of
// 16 output columns (fp32: (N/16, K, 16); bf16: (N/16, K/PER, 16, PER), PER = 2 where vdpbf16ps multiplies
// pairs, else 1), streamed once per call: a tile of TILE_ROWS rows x TILE_BLOCKS blocks keeps its
// accumulators in registers, each weight vector loaded once for the tile's rows, each row's input broadcast
// once for its vectors. AVX-512: a block is one 16-lane register, tiles of 8 rows x 3 blocks; AVX2 + FMA: a
// block is two 8-lane registers, tiles of 6 rows x 1 block (12 accumulators, 2 weights, 1 broadcast: the 16
// registers), bf16 weights widened to fp32 in registers (a 16-bit shift: exact) and multiplied in fp32.
template <typename W> struct Step;  // one k (fp32) or k pair (bf16 on AVX512-BF16) of a tile's products
#if defined(__AVX512F__)
#define GRPO_LINEAR 1
using Vec = __m512;
constexpr int LANES = 16, TILE_ROWS = 8, TILE_BLOCKS = 3;
// weights prefetched this many k steps ahead, and the next column group's into L2 (`ahead`): at 16 rows on a
// Zen 4 SmolLM2's linears (layers and head) in ~0.9x the time fp32, ~0.85x bf16 (the engine's decode step
// 0.97x / 0.87x), the next group's prefetch doing it (the current stream's alone: none); 64 rows alike
constexpr int64_t PREFETCH = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline __mmask16 mask16(int64_t left) {  // the first min(left, 16) lanes
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}
inline Vec vload_part(const float* p, int64_t left) {
  return _mm512_maskz_loadu_ps(mask16(left), p);
}
inline void vstore_part(float* y, Vec v, int64_t left) {
  _mm512_mask_storeu_ps(y, mask16(left), v);
}
template <> struct Step<float> {
  using X = float;
  static constexpr int64_t K_PER = 1;
  static inline Vec load_w(const float* w) { return _mm512_loadu_ps(w); }
  static inline Vec fma(Vec acc, const float* x, Vec w) {
    return _mm512_fmadd_ps(_mm512_set1_ps(*x), w, acc);
  }
};
#if defined(__AVX512BF16__)
constexpr int64_t BF16_PER = 2;
template <> struct Step<at::BFloat16> {
  using X = at::BFloat16;  // the inputs in pairs too
  static constexpr int64_t K_PER = 2;
  static inline __m512bh load_w(const at::BFloat16* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static inline Vec fma(Vec acc, const at::BFloat16* x, __m512bh w) {
    int32_t pair;
    std::memcpy(&pair, x, sizeof(pair));
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), w);
  }
};
inline void vstore_part(at::BFloat16* y, Vec v, int64_t left) {  // round to nearest even
  _mm256_mask_storeu_epi16(y, mask16(left), (__m256i)_mm512_cvtneps_pbh(v));
}
#else
#define GRPO_NO_LINEAR_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define GRPO_LINEAR 1
using Vec = __m256;
constexpr int LANES = 8, TILE_ROWS = 6, TILE_BLOCKS = 1;
// weights prefetched this many k steps ahead (1 KiB of fp32): the fp32 linears in 0.89-0.92x the time (Zen 3)
constexpr int64_t PREFETCH = 16;
constexpr int64_t BF16_PER = 1;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vload_part(const float* p, int64_t left) {
  if (left >= 8) return _mm256_loadu_ps(p);
  alignas(32) float tmp[8] = {0.f};
  for (int64_t i = 0; i < left; ++i) tmp[i] = p[i];
  return _mm256_load_ps(tmp);
}
inline void vstore_part(float* y, Vec v, int64_t left) {
  if (left >= 8) return _mm256_storeu_ps(y, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int64_t i = 0; i < left; ++i) y[i] = tmp[i];
}
inline void vstore_part(at::BFloat16* y, Vec v, int64_t left) {  // round to nearest even (finite values)
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
  if (left >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(y), h);
  alignas(16) uint16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h);
  std::memcpy(y, tmp, left * sizeof(uint16_t));
}
template <> struct Step<float> {
  using X = float;
  static constexpr int64_t K_PER = 1;
  static inline Vec load_w(const float* w) { return _mm256_loadu_ps(w); }
  static inline Vec fma(Vec acc, const float* x, Vec w) {
    return _mm256_fmadd_ps(_mm256_set1_ps(*x), w, acc);
  }
};
template <> struct Step<at::BFloat16> {
  using X = float;  // the inputs widened once per call: a bf16 broadcast costs four instructions here
  static constexpr int64_t K_PER = 1;
  static inline Vec load_w(const at::BFloat16* w) {  // 8 bf16 -> their fp32 values
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline Vec fma(Vec acc, const float* x, Vec w) {
    return _mm256_fmadd_ps(_mm256_set1_ps(*x), w, acc);
  }
};
#endif

#if defined(GRPO_LINEAR)
constexpr bool HAS_LINEAR_FP32 = true;
#if defined(GRPO_NO_LINEAR_BF16)
constexpr bool HAS_LINEAR_BF16 = false;
constexpr int64_t BF16_PER = 1;
#else
constexpr bool HAS_LINEAR_BF16 = true;
#endif
constexpr int VPB = 16 / LANES;  // vectors per block of 16 columns
template <typename W> using XOf = typename Step<W>::X;  // the inputs' type as the tiles read them

// `ahead`, `every`: this tile's share of the next column group's weights, one k step of them prefetched (into
// L2) every `every` k steps; the row tiles of a group take a share each, so that memory streams through all
// of them, not only the first (which reads the group from memory; the others find it in L2)
template <typename W, int MB, int NB>
void linear_tile(const XOf<W>* x, int64_t K, const W* w, const float* bias, W* y, int64_t N, int64_t n0,
                 const W* ahead, int64_t every) {
  using S = Step<W>;
  constexpr int NV = NB * VPB;
  const int64_t steps = K / S::K_PER, block = K * 16;  // elements of one packed block
  Vec acc[MB][NV];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j) acc[m][j] = vzero();
  const W* wb = w + (n0 / 16) * block;
  int64_t since = 0, line = 0;
  for (int64_t k = 0; k < steps; ++k) {
    if constexpr (PREFETCH > 0) {
#pragma GCC unroll 3
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wb + j * block + (k + PREFETCH) * 16 * S::K_PER),
                     _MM_HINT_T0);
      if (++since == every) {
        since = 0;
#pragma GCC unroll 3
        for (int j = 0; j < NB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + j * block + line * 16 * S::K_PER), _MM_HINT_T1);
        ++line;
      }
    }
    decltype(S::load_w(wb)) b[NV];
#pragma GCC unroll 3
    for (int j = 0; j < NV; ++j)
      b[j] = S::load_w(wb + (j / VPB) * block + (k * 16 + (j % VPB) * LANES) * S::K_PER);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m)
#pragma GCC unroll 3
      for (int j = 0; j < NV; ++j) acc[m][j] = S::fma(acc[m][j], x + m * K + k * S::K_PER, b[j]);
  }
#pragma GCC unroll 3
  for (int j = 0; j < NV; ++j) {
    const int64_t c = n0 + j * LANES, left = N - c;
    if (left <= 0) continue;  // a block's second half past N (AVX2)
    const Vec bv = bias != nullptr ? vload_part(bias + c, left) : vzero();
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) vstore_part(y + m * N + c, vadd(acc[m][j], bv), left);
  }
}

template <typename W, int NB, int MB>
void linear_tile_of(int64_t rows, const XOf<W>* x, int64_t K, const W* w, const float* bias, W* y, int64_t N,
                    int64_t n0, const W* ahead, int64_t every) {  // a tile of `rows` <= MB rows
  if constexpr (MB > 0) {
    if (rows == MB) linear_tile<W, MB, NB>(x, K, w, bias, y, N, n0, ahead, every);
    else linear_tile_of<W, NB, MB - 1>(rows, x, K, w, bias, y, N, n0, ahead, every);
  }
}

// the rows in as few tiles as TILE_ROWS allows, of sizes as even as can be (16 rows on AVX2: 6, 5, 5, not 6,
// 6, 4; 8 rows: 4, 4, not 6, 2, whose 4 accumulators would wait on the FMA's latency)
template <typename W, int NB>
void linear_rows(const XOf<W>* x, int64_t M, int64_t K, const W* w, const float* bias, W* y, int64_t N,
                 int64_t n0) {
  const int64_t passes = (M + TILE_ROWS - 1) / TILE_ROWS, steps = K / Step<W>::K_PER;
  const int64_t share = (steps + passes - 1) / passes;  // k steps of the next group each pass prefetches
  const W* next = w + (n0 / 16 + NB) * K * 16;  // the next column group's weights (past the end: harmless)
  for (int64_t p = 0, m = 0; p < passes; ++p) {
    const int64_t rows = M / passes + (p < M % passes);
    const W* ahead = next + p * share * 16 * Step<W>::K_PER;
    linear_tile_of<W, NB, TILE_ROWS>(rows, x + m * K, K, w, bias, y + m * N, N, n0, ahead, passes);
    m += rows;
  }
}

template <typename W, int NB>
void linear_blocks(int64_t nb, const XOf<W>* x, int64_t M, int64_t K, const W* w, const float* bias, W* y,
                   int64_t N, int64_t n0) {  // a column group of nb <= NB blocks
  if constexpr (NB > 0) {
    if (nb == NB) linear_rows<W, NB>(x, M, K, w, bias, y, N, n0);
    else linear_blocks<W, NB - 1>(nb, x, M, K, w, bias, y, N, n0);
  }
}

template <typename W>
void linear_impl(const XOf<W>* x, int64_t M, int64_t K, const W* w, const float* bias, W* y, int64_t N) {
  const int64_t blocks = (N + 15) / 16, groups = (blocks + TILE_BLOCKS - 1) / TILE_BLOCKS;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * TILE_BLOCKS, nb = std::min<int64_t>(TILE_BLOCKS, blocks - b0);
      linear_blocks<W, TILE_BLOCKS>(nb, x, M, K, w, bias, y, N, b0 * 16);
    }
  });
}
#else
constexpr bool HAS_LINEAR_FP32 = false, HAS_LINEAR_BF16 = false;
constexpr int64_t BF16_PER = 1;
#endif

// W (N, K) in S, given as its rows' addresses, -> the layout `linear` reads in D: (N/16, K/PER, 16, PER),
// rows past N zero
template <typename S, typename D, int PER>
void pack_linear_impl(const S* const* rows, D* out, int64_t N, int64_t K) {
  const int64_t blocks = (N + 15) / 16, steps = K / PER;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      D* o = out + b * 16 * K;
      // in tiles of 16 steps: each row's stretch read in order, the tile's outputs (16 x 16 x PER) in L1
      for (int64_t s0 = 0; s0 < steps; s0 += 16) {
        const int64_t s1 = std::min(steps, s0 + 16);
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t n = b * 16 + i;
          const S* w = n < N ? rows[n] : nullptr;
          for (int64_t s = s0; s < s1; ++s)
            for (int p = 0; p < PER; ++p)
              o[(s * 16 + i) * PER + p] = static_cast<D>(w ? f32(w[s * PER + p]) : 0.f);
        }
      }
    }
  });
}

}  // namespace

at::Tensor add_rms_norm(at::Tensor x, c10::optional<at::Tensor> delta, at::Tensor weight, double eps,
                        at::ScalarType out_dtype) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "x: a contiguous (rows, hidden) tensor");
  auto w = weight.scalar_type() == at::kFloat ? weight.contiguous() : weight.to(at::kFloat).contiguous();
  auto out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  at::Tensor d;
  if (delta.has_value()) d = delta->contiguous();
  const auto d_type = delta.has_value() ? d.scalar_type() : x.scalar_type();
  FLOAT_OR_BF16(x.scalar_type(), X, [&] {
    FLOAT_OR_BF16(d_type, D, [&] {
      FLOAT_OR_BF16(out_dtype, O, [&] {
        add_rms_norm_impl<X, D, O>(x.data_ptr<X>(), delta.has_value() ? d.data_ptr<D>() : nullptr,
                                   w.data_ptr<float>(), out.data_ptr<O>(), x.size(0), x.size(1),
                                   static_cast<float>(eps));
      });
    });
  });
  return out;
}

at::Tensor silu_mul(at::Tensor gate_up) {
  auto gu = gate_up.contiguous();
  const int64_t R = gu.size(0), I = gu.size(1) / 2;
  auto out = at::empty({R, I}, gu.options());
  FLOAT_OR_BF16(gu.scalar_type(), T, [&] { silu_mul_impl<T>(gu.data_ptr<T>(), out.data_ptr<T>(), R, I); });
  return out;
}

at::Tensor rope_attend(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor ck, at::Tensor ckt,
                       at::Tensor cv, at::Tensor pkt, at::Tensor pv, at::Tensor pvalid, at::Tensor t,
                       int64_t heads, double scaling, at::ScalarType out_dtype) {
  TORCH_CHECK(ck.is_contiguous() && ckt.is_contiguous() && cv.is_contiguous(),
              "the completion KV must be contiguous");
  TORCH_CHECK(pkt.scalar_type() == ck.scalar_type() && pv.scalar_type() == ck.scalar_type() &&
              ckt.scalar_type() == ck.scalar_type(), "one KV dtype");
  const int64_t R = qkv.size(0), n = pv.size(0), kvh = pv.size(1), P = pv.size(2), d = pv.size(3);
  const int64_t ldp = pkt.size(2) * KEYS, cap = ck.size(2);
  TORCH_CHECK(pkt.dim() == 5 && pkt.size(3) == d && pkt.size(4) == KEYS && ldp >= P && ckt.dim() == 5 &&
              ckt.size(2) * KEYS == cap && ckt.size(3) == d && ckt.size(4) == KEYS && d % 2 == 0,
              "pkt, ckt: the prompts' and completions' keys in blocks of 64 (.., slots / 64, d, 64: "
              "blocked_keys); d even");
  auto q = qkv.contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "cos, sin: float32");
  TORCH_CHECK(pvalid.scalar_type() == at::kByte && t.scalar_type() == at::kLong, "pvalid: uint8, t: int64");
  auto c = cos.contiguous(), s = sin.contiguous(), valid = pvalid.contiguous(), tt = t.contiguous();
  auto pktc = pkt.contiguous(), pvc = pv.contiguous();
  auto out = at::empty({R, heads * d}, qkv.options().dtype(out_dtype));
  FLOAT_OR_BF16(q.scalar_type(), Q, [&] {
    FLOAT_OR_BF16(ck.scalar_type(), KV, [&] {
      FLOAT_OR_BF16(out_dtype, O, [&] {
        rope_attend_impl<Q, KV, O>(q.data_ptr<Q>(), c.data_ptr<float>(), s.data_ptr<float>(),
                                   ck.data_ptr<KV>(), ckt.data_ptr<KV>(), cv.data_ptr<KV>(),
                                   pktc.data_ptr<KV>(), pvc.data_ptr<KV>(), valid.data_ptr<uint8_t>(),
                                   tt.data_ptr<int64_t>(), out.data_ptr<O>(), R, n,
                                   heads, kvh, d, cap, P, ldp, static_cast<float>(scaling));
      });
    });
  });
  return out;
}

// the (N_i, K) weights `ws` stacked by rows -> `linear`'s layout in dtype, into `out` where given (its
// storage rewritten in place: a captured graph or a kept copy reads it there), else a new tensor
at::Tensor pack_linear(std::vector<at::Tensor> ws, at::ScalarType dtype, c10::optional<at::Tensor> out) {
  TORCH_CHECK(!ws.empty() && ws[0].dim() == 2, "pack_linear: weights (N_i, K)");
  const int64_t K = ws[0].size(1), per = dtype == at::kBFloat16 ? BF16_PER : 1;
  TORCH_CHECK(K % per == 0, "pack_linear: bf16 needs an even K");
  auto src = ws[0].scalar_type();  // matrices of mixed dtypes are read as fp32 (torch.cat would promote)
  for (auto& w : ws)
    if (w.scalar_type() != src) src = at::kFloat;
  int64_t N = 0;
  for (auto& w : ws) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K, "pack_linear: weights (N_i, K) of one K");
    w = w.scalar_type() == src ? w.contiguous() : w.to(src).contiguous();
    N += w.size(0);
  }
  const std::vector<int64_t> shape = {(N + 15) / 16, K / per, 16, per};
  at::Tensor o = out.has_value() ? *out : at::empty(shape, ws[0].options().dtype(dtype));
  TORCH_CHECK(o.sizes() == at::IntArrayRef(shape) && o.scalar_type() == dtype && o.is_contiguous(),
              "pack_linear: out packed for ", N, " outputs and ", K, " inputs in ", dtype);
  FLOAT_OR_BF16(src, S, [&] {
    std::vector<const S*> rows;
    rows.reserve(N);
    for (auto& w : ws)
      for (int64_t n = 0; n < w.size(0); ++n) rows.push_back(w.data_ptr<S>() + n * K);
    if (dtype == at::kBFloat16)
      pack_linear_impl<S, at::BFloat16, BF16_PER>(rows.data(), o.data_ptr<at::BFloat16>(), N, K);
    else
      pack_linear_impl<S, float, 1>(rows.data(), o.data_ptr<float>(), N, K);
  });
  return o;
}

std::vector<std::string> linear_dtypes() {  // the weight dtypes `linear` runs on this build
  std::vector<std::string> out;
  if (HAS_LINEAR_FP32) out.push_back("float32");
  if (HAS_LINEAR_BF16) out.push_back("bfloat16");
  return out;
}

at::Tensor linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() >= 3 && x.scalar_type() == packed.scalar_type() &&
              packed.is_contiguous(), "linear: x (M, K) and packed weights of one dtype");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(0) == (N + 15) / 16 && packed.numel() == packed.size(0) * 16 * K,
              "linear: weights packed for ", N, " outputs and ", K, " inputs");
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(at::kFloat).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#if defined(GRPO_LINEAR)
  if (x.scalar_type() == at::kFloat) {
    linear_impl<float>(xc.data_ptr<float>(), M, K, packed.data_ptr<float>(), bp, y.data_ptr<float>(), N);
    return y;
  }
#if !defined(GRPO_NO_LINEAR_BF16)
  if (x.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(K % BF16_PER == 0, "linear: bf16 needs an even K here");
    using X = Step<at::BFloat16>::X;
    auto xs = xc.to(c10::CppTypeToScalarType<X>::value).contiguous();  // as the kernel reads them
    linear_impl<at::BFloat16>(xs.data_ptr<X>(), M, K, packed.data_ptr<at::BFloat16>(), bp,
                              y.data_ptr<at::BFloat16>(), N);
    return y;
  }
#endif
#endif
  TORCH_CHECK(false, "linear: not built for ", x.scalar_type(), " on this CPU");
  return y;
}

// The decode's draw where nothing is filtered (no top-k / top-p, T > 0): per row of fp32 logits (R, V), the
// token of softmax(logits / T) at the inverse CDF of u (R,), found over the sums of blocks of DRAW_BLOCK
// tokens, then the chosen block's tokens (double sums), never one of mass 0; and its log-prob,
// logits / T - max - log(sum). One pass for the max, one for the exponentials and the block sums.
// Under a repetition penalty (`seen` (R, V) bool, the tokens of each row's context): the softmax sampled is
// over the penalized logits (a seen token's divided by `penalty` where positive, multiplied where not), the
// log-prob stays the unpenalized one: its sum is the penalized one with the seen tokens' terms exchanged for
// their unpenalized ones (double), one more pass over the mask, no second pass of exponentials.
constexpr int64_t DRAW_BLOCK = 256;
std::vector<at::Tensor> draw(at::Tensor logits, at::Tensor u, double temperature,
                             c10::optional<at::Tensor> seen, double penalty) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "draw: logits (rows, vocab), float32");
  TORCH_CHECK(u.scalar_type() == at::kFloat && u.numel() == logits.size(0), "draw: u (rows,), float32");
  TORCH_CHECK(temperature > 0, "draw: temperature > 0");
  auto l = logits.contiguous(), uc = u.contiguous();
  const int64_t R = l.size(0), V = l.size(1), nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
  at::Tensor sc;
  if (seen.has_value() && seen->defined()) {
    TORCH_CHECK(seen->scalar_type() == at::kBool && seen->sizes() == l.sizes(),
                "draw: seen (rows, vocab), bool");
    TORCH_CHECK(penalty > 0, "draw: penalty > 0");
    sc = seen->contiguous();
  }
  const bool* sp = sc.defined() ? sc.data_ptr<bool>() : nullptr;
  const float pen = static_cast<float>(penalty);
  auto tok = at::empty({R}, l.options().dtype(at::kLong));
  auto logp = at::empty({R}, l.options());
  const float inv_t = static_cast<float>(1.0 / temperature);
  const float* lp = l.data_ptr<float>();
  const float* up = uc.data_ptr<float>();
  int64_t* tp = tok.data_ptr<int64_t>();
  float* op = logp.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> e(V), sums(nb);
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = lp + r * V;
      const bool* on = sp ? sp + r * V : nullptr;
      auto shaped = [&](int64_t i) { return on[i] ? (x[i] > 0.f ? x[i] / pen : x[i] * pen) : x[i]; };
      float mx = MASKED;
      if (on) {
        for (int64_t i = 0; i < V; ++i) mx = std::max(mx, shaped(i));
      } else {
        for (int64_t i = 0; i < V; ++i) mx = std::max(mx, x[i]);
      }
      mx *= inv_t;
      double total = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t end = std::min(V, (b + 1) * DRAW_BLOCK);
        float sb = 0.f;
        if (on) {
          for (int64_t i = b * DRAW_BLOCK; i < end; ++i) {
            e[i] = std::exp(shaped(i) * inv_t - mx);
            sb += e[i];
          }
        } else {
          for (int64_t i = b * DRAW_BLOCK; i < end; ++i) {
            e[i] = std::exp(x[i] * inv_t - mx);
            sb += e[i];
          }
        }
        sums[b] = sb;
        total += sb;
      }
      double raw_total = total;  // the unpenalized softmax's sum, on the same max
      if (on) {
        for (int64_t i = 0; i < V; ++i) {
          if (on[i]) raw_total += std::exp(static_cast<double>(x[i]) * inv_t - mx) - e[i];
        }
      }
      const double want = static_cast<double>(up[r]) * total;
      int64_t j = -1, last = 0;
      double below = 0.0;  // the mass of the blocks before j
      for (int64_t b = 0; b < nb; ++b) {
        if (sums[b] <= 0.f) continue;
        last = b;
        if (below + sums[b] > want) {
          j = b;
          break;
        }
        below += sums[b];
      }
      if (j < 0) {  // rounding put u * total past the last block with mass: its last token with mass
        j = last;
        below = total - sums[last];
      }
      const double rest = std::max(0.0, want - below);
      const int64_t end = std::min(V, (j + 1) * DRAW_BLOCK);
      int64_t k = -1;
      double acc = 0.0;
      for (int64_t i = j * DRAW_BLOCK; i < end; ++i) {
        if (e[i] <= 0.f) continue;
        k = i;
        acc += e[i];
        if (acc > rest) break;
      }
      tp[r] = k;
      op[r] = x[k] * inv_t - mx - static_cast<float>(std::log(raw_total));
    }
  });
  return {tok, logp};
}

// One decode step's decoder layers in one call, as native._decoder_kernels runs them from Python (per layer
// the input norm, the qkv linear, RoPE and attention, o, the post-attention norm, gate_up, SiLU x up, down),
// with no return to the interpreter between them. x (rows, hidden), the residual stream, is updated in place;
// returns the final norm's output. Per layer: norms[2i], norms[2i + 1] (fp32 weights) and the final one last
// with their eps; packed / bias / outs[4i + j] the qkv, o, gate_up and down linears (`linear`'s arguments);
// kv[5i + j] the completion keys, their blocked twins, values, the prompts' blocked keys and values.
at::Tensor decode_layers(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor pvalid, at::Tensor t,
                         std::vector<at::Tensor> norms, std::vector<double> eps,
                         std::vector<at::Tensor> packed, std::vector<c10::optional<at::Tensor>> bias,
                         std::vector<int64_t> outs, std::vector<at::Tensor> kv, int64_t heads, double scaling,
                         at::ScalarType dtype) {
  const int64_t L = (static_cast<int64_t>(norms.size()) - 1) / 2;
  TORCH_CHECK(L >= 1 && norms.size() == static_cast<size_t>(2 * L + 1) && eps.size() == norms.size() &&
              packed.size() == static_cast<size_t>(4 * L) && bias.size() == packed.size() &&
              outs.size() == packed.size() && kv.size() == static_cast<size_t>(5 * L),
              "decode_layers: per layer 2 norms (and the final one), 4 linears, 5 KV tensors");
  auto lin = [&](const at::Tensor& in, int64_t j) {
    const auto wt = packed[j].scalar_type();
    return linear(in.scalar_type() == wt ? in : in.to(wt), packed[j], bias[j], outs[j]);
  };
  c10::optional<at::Tensor> delta;
  for (int64_t i = 0; i < L; ++i) {
    auto h = add_rms_norm(x, delta, norms[2 * i], eps[2 * i], dtype);
    auto a = rope_attend(lin(h, 4 * i), cos, sin, kv[5 * i], kv[5 * i + 1], kv[5 * i + 2], kv[5 * i + 3],
                         kv[5 * i + 4], pvalid, t, heads, scaling, dtype);
    h = add_rms_norm(x, lin(a, 4 * i + 1), norms[2 * i + 1], eps[2 * i + 1], dtype);
    delta = lin(silu_mul(lin(h, 4 * i + 2)), 4 * i + 3);
  }
  return add_rms_norm(x, delta, norms[2 * L], eps[2 * L], x.scalar_type());
}

// Each kernel runs with the GIL released, as torch's own operators do: they touch no Python object, and
// holding it starved every other Python thread for the whole call (colocated asynchronous GRPO's trainer
// beside a decoding thread: 6 small products in 2 s instead of 4,645).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using released = py::call_guard<py::gil_scoped_release>;
  m.def("add_rms_norm", &add_rms_norm, released());
  m.def("rope_attend", &rope_attend, released());
  m.def("silu_mul", &silu_mul, released());
  m.def("linear", &linear, released());
  m.def("linear_dtypes", &linear_dtypes, released());
  m.def("pack_linear", &pack_linear, py::arg("ws"), py::arg("dtype"), py::arg("out") = py::none(),
        released());
  m.def("decode_layers", &decode_layers, released());
  m.def("draw", &draw, py::arg("logits"), py::arg("u"), py::arg("temperature"), py::arg("seen") = py::none(),
        py::arg("penalty") = 1.0, released());
}
"""


@functools.cache
def cpu_info() -> dict:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}


KEYS = 64  # keys per block of the kernels' key layout (the C++ KEYS)


def blocked_keys(k):
    """Keys (.., slots, d) in the layout rope_attend reads: blocks of KEYS keys, each transposed, (..,
    ceil(slots / KEYS), d, KEYS), zeros past the last key."""
    *lead, slots, d = k.shape
    k = torch.nn.functional.pad(k, (0, 0, 0, -slots % KEYS))
    return k.view(*lead, -1, KEYS, d).transpose(-1, -2).contiguous()


def blocked_zeros(k):
    """Zeros in the layout `blocked_keys` gives keys shaped like k (.., slots, d), made in place of k."""
    *lead, slots, d = k.shape
    return k.new_zeros(*lead, -(-slots // KEYS), d, KEYS)


def write_blocked_keys(kt, slots, k) -> None:
    """Keys k (L, .., d) into one row's blocked keys kt (.., slots / KEYS, d, KEYS) at `slots` (L,)."""
    kt[:, slots // KEYS, :, slots % KEYS] = k


# eager on a CPU the native engine's decode step runs these kernels where they build (False: its PyTorch ops
# and oneDNN's linears; a switch for tests and benchmarks, read at each generate call)
ENABLED = True
_lock = threading.Lock()
_state: dict = {}


def kernels():
    """The compiled module (add_rms_norm, rope_attend, silu_mul), or None where it cannot be built (no C++
    compiler or ninja; GRPO_FAST_CPU_KERNELS=0): the first call builds it (~30 s, once per machine: torch's
    extension cache) and says why not where it fails."""
    with _lock:
        if "module" not in _state:
            _state["module"], _state["reason"] = _build()
            if _state["reason"]:
                print(f"grpo-fast native rollout: CPU decode kernels off ({_state['reason']})", flush=True)
        return _state["module"]


def active():
    """The kernels where they build and are switched on (ENABLED), else None."""
    return kernels() if ENABLED else None


def linear_for(dtype):
    """`(pack, run)` for the decode's linear layers in `dtype` through the `linear` kernel where this CPU's
    build has it (AVX-512 or AVX2 + FMA: fp32 and bf16), else None: `pack([w, ...], dtype, out=None)` lays
    the (N_i, K) fp32 / bf16 weights, stacked by rows, out as the kernel reads them, in `dtype` (one pass:
    copy, cast rounding to nearest even; into `out`'s storage where given: a repack in place), `run(x,
    packed, bias, N)` is x W^T + bias in `dtype` (fp32 accumulation)."""
    kern = active()
    if kern is None or str(dtype).removeprefix("torch.") not in kern.linear_dtypes():
        return None
    return kern.pack_linear, kern.linear


def unavailable_reason() -> str | None:
    kernels()
    return _state["reason"]


def _build():
    if os.environ.get("GRPO_FAST_CPU_KERNELS", "1") == "0":
        return None, "GRPO_FAST_CPU_KERNELS=0"
    here = os.path.dirname(sys.executable)  # the environment's own ninja (a dependency), off PATH in a venv
    if shutil.which("ninja") is None and os.path.exists(os.path.join(here, "ninja")):
        os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    cpu = cpu_info()
    march = os.environ.get("GRPO_FAST_CPU_MARCH", "native")  # e.g. x86-64-v3: an AVX2 build on any machine
    key = f"{cpu.get('model name', '')}|{cpu.get('flags', '')}|{march}|{_SOURCE}"
    # a build per CPU, -march and source: checkouts of two versions on one machine do not rebuild each other's
    name = f"grpo_fast_cpu_decode_{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    try:
        from torch.utils.cpp_extension import _get_build_directory, load_inline

        if not os.path.exists(os.path.join(_get_build_directory(name, False), f"{name}.so")):
            print("grpo-fast native rollout: building the CPU decode kernels (once per machine)", flush=True)
        module = load_inline(
            name=name,
            cpp_sources=[_SOURCE],
            # fast math compiles the kernels only: linked without it, the process keeps its denormals
            extra_cflags=["-O3", f"-march={march}", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # noqa: BLE001 - an optimization: the engine runs its PyTorch ops instead
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return None, f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return module, None
