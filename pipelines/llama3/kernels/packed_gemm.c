/* Matrix products with weights that stay 4-bit or 8-bit: y[M, N] = x[M, K] . W^T, float32.
 *
 * Built by Bazel once per instruction set (kernels/BUILD.bazel), loaded by
 * pipelines/llama3/kernel_library.py and called through ctypes (packed.py): AVX-512, AVX2 +
 * FMA, or plain C. Weights are groupwise, 32 values per group along K:
 *
 *   int4: W[n, k] = fma(scale[n, g], q[n, k], offset[n, g])   q in 0..15, g = k / 32
 *         q4[n, g, j] holds q[n, 32g + j] in its low nibble and q[n, 32g + j + 16] in its
 *         high nibble (llama.cpp's Q4_0/Q4_1 byte order); so_[n, g] = {scale, offset}.
 *         Q4_0 (offset = -8 d), Q4_1 (scale d, offset m) and Q4_K (per sub-block d*sc and
 *         -dmin*m) all map onto it exactly.
 *   int8: W[n, k] = scale[n, g] * q[n, k]               q in -128..127 (Q8_0)
 *
 * The activations stay float32, so the products differ from the dense float32 path only in
 * summation order: each group's dot product sum_j x_j q_j is scaled once, and the offset
 * term is offset * sum_j x_j. `*_dequantize` writes W exactly as the dense path computes it
 * (fma above; for every GGUF scale the product is exact, so it is also d * q + m rounded
 * once), which is how the tests prove the packing loses nothing.
 *
 * The vector builds take the outputs in blocks of 16 (AVX-512) or 8 (AVX2): each output's
 * dot products as alone, then the block's horizontal sums and offset terms together, in each
 * output's own order and roundings (vec_sums, offset_terms): the same bits as one output at
 * a time, at up to half the cost where K is small (SmolLM2's 576: the per-output scalar tail
 * cost about as much as the dot products). test_packed.py holds every output of a block to
 * its bits alone.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PACKED_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PACKED_SIMD 256
#else
#define PACKED_SIMD 0
#endif

#define GROUP 32
#define M_TILE 4 /* activation rows sharing one unpacking of a weight group */

/* The vector width the library was built with: 512 (AVX-512), 256 (AVX2 + FMA) or 0. */
int packed_gemm_simd(void) { return PACKED_SIMD; }

#if PACKED_SIMD == 512
/* A group's 32 values as two vectors of 16 floats, in k order. */
static inline void unpack_q4_512(const uint8_t *q, __m512 *lo, __m512 *hi) {
  const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
  const __m128i mask = _mm_set1_epi8(0x0F);
  *lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
  *hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
}

static inline void unpack_q8_512(const int8_t *q, __m512 *lo, __m512 *hi) {
  *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
  *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
}

static inline __m512 group_dot_512(const float *x, __m512 lo, __m512 hi) {
  return _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), hi, _mm512_mul_ps(_mm512_loadu_ps(x), lo));
}
#endif

#if PACKED_SIMD == 256
static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* 16 packed bytes -> the group's 32 values as four vectors of 8 floats, in k order. Each
 * half of the bytes is widened to 32-bit lanes straight from memory; a lane's low nibble is
 * value j, its high nibble value j + 16 (fewer shuffles than splitting the nibbles first). */
static inline void unpack_q4(const uint8_t *q, __m256 w[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
  const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
  w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v0, mask));
  w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(v1, mask));
  w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
  w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
}

static inline void unpack_q8(const int8_t *q, __m256 w[4]) {
  for (int i = 0; i < 4; i++) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
}

static inline __m256 group_dot(const float *x, const __m256 w[4]) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(x), w[0]);
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w[1], acc);
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w[2], acc);
  return _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w[3], acc);
}
#endif

/* sum_j x[m, 32g + j] for every row m and group g: the offset term's factor. */
static void group_sums(const float *x, int64_t M, int64_t K, float *sums) {
  const int64_t G = K / GROUP;
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < G; g++) {
      float s = 0.0f;
      for (int j = 0; j < GROUP; j++) s += x[m * K + g * GROUP + j];
      sums[m * G + g] = s;
    }
}

/* sum_g offset[g] * sums[g] over a row's groups, in four independent partial sums. */
static inline float offset_term(const float *so_, const float *sums, int64_t G) {
  float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t g = 0;
  for (; g + 4 <= G; g += 4)
    for (int j = 0; j < 4; j++) part[j] += so_[2 * (g + j) + 1] * sums[g + j];
  for (; g < G; g++) part[0] += so_[2 * g + 1] * sums[g];
  return (part[0] + part[1]) + (part[2] + part[3]);
}

#if PACKED_SIMD == 512
typedef __m512 vec_t;
#define N_BLOCK 16 /* outputs whose horizontal sums and offset terms are computed together */
static inline vec_t vec_zero(void) { return _mm512_setzero_ps(); }
static inline vec_t vec_add(vec_t a, vec_t b) { return _mm512_add_ps(a, b); }
static inline vec_t vec_mul(vec_t a, vec_t b) { return _mm512_mul_ps(a, b); }
static inline vec_t vec_set1(float v) { return _mm512_set1_ps(v); }
static inline vec_t vec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vec_store(float *p, vec_t v) { _mm512_storeu_ps(p, v); }
static inline float vec_sum(vec_t v) { return _mm512_reduce_add_ps(v); }

/* out[j] = vec_sum(v[j]) for 16 vectors, each lane summed in _mm512_reduce_add_ps's order
 * (lane i + lane i + 8, then + 4, then [0] + [2] and [1] + [3], then the two): the same bits,
 * the pairs of every level added in one instruction for 16 outputs (a transposing tree). */
static inline vec_t vec_sums(const vec_t v[N_BLOCK]) {
  vec_t w[8], x[4], y[2];
  for (int k = 0; k < 8; k++) /* [v[2k] lo256 + hi256 | v[2k+1] lo256 + hi256] */
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; k++) /* quarter q: v[4k + q]'s four sums of lanes i and i + 4 */
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; k++) /* quarter q: [0] + [2], [1] + [3] of v[8k + q], v[8k + 4 + q] */
    y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  /* lane 4q + p: the sum of v[4p + q]; put it in lane 4p + q */
  const vec_t r = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}
#elif PACKED_SIMD == 256
typedef __m256 vec_t;
#define N_BLOCK 8
static inline vec_t vec_zero(void) { return _mm256_setzero_ps(); }
static inline vec_t vec_add(vec_t a, vec_t b) { return _mm256_add_ps(a, b); }
static inline vec_t vec_mul(vec_t a, vec_t b) { return _mm256_mul_ps(a, b); }
static inline vec_t vec_set1(float v) { return _mm256_set1_ps(v); }
static inline vec_t vec_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vec_store(float *p, vec_t v) { _mm256_storeu_ps(p, v); }
static inline float vec_sum(vec_t v) { return hsum256(v); }

/* out[j] = hsum256(v[j]) for 8 vectors, in hsum256's order (lane i + lane i + 4, then
 * [0] + [2] and [1] + [3], then the two), pairs of every level added together. */
static inline vec_t vec_sums(const vec_t v[N_BLOCK]) {
  vec_t w[4], y[2];
  for (int k = 0; k < 4; k++) /* [v[2k] lo128 + hi128 | v[2k+1] lo128 + hi128] */
    w[k] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x31));
  for (int k = 0; k < 2; k++) /* half h: [0] + [2], [1] + [3] of v[4k + h], v[4k + 2 + h] */
    y[k] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  /* lane 4h + p: the sum of v[2p + h]; put it in lane 2p + h */
  const vec_t r = _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

#if PACKED_SIMD
/* One weight group's scaled dot products added to the rows' accumulators: the group (its 16
 * int4 bytes, `int4`, or 32 int8 values) unpacked once, then for each row i of x (rows K
 * apart) acc[i] = fma(scale, sum_j x_ij q_j, acc[i]). */
static inline __attribute__((always_inline)) void group_steps(const float *x, int64_t K,
                                                              const void *q, int int4,
                                                              float scale, int mt, vec_t *acc) {
#if PACKED_SIMD == 512
  __m512 lo, hi;
  if (int4)
    unpack_q4_512((const uint8_t *)q, &lo, &hi);
  else
    unpack_q8_512((const int8_t *)q, &lo, &hi);
  const __m512 s = _mm512_set1_ps(scale);
  for (int i = 0; i < mt; i++) acc[i] = _mm512_fmadd_ps(s, group_dot_512(x + i * K, lo, hi), acc[i]);
#else
  __m256 w[4];
  if (int4)
    unpack_q4((const uint8_t *)q, w);
  else
    unpack_q8((const int8_t *)q, w);
  const __m256 s = _mm256_set1_ps(scale);
  for (int i = 0; i < mt; i++) acc[i] = _mm256_fmadd_ps(s, group_dot(x + i * K, w), acc[i]);
#endif
}

/* The vector partial sums of `mt` rows of x (rows K apart) with one output's weight row,
 * before the horizontal sum: each group's dot product scaled into one of two accumulators per
 * row (even and odd groups, halving the dependency chain), which are then added; each group
 * unpacked once for the rows. Called with mt a constant (tile_vectors), so that every
 * accumulator stays in a register: indexed by row and group parity at run time they were
 * kept in memory, a store and a load on every group's dependency chain (SmolLM2's one-row
 * gate/up product on the AVX2 build, 2 threads: 0.106-0.158 -> 0.090-0.103 ms, its Q8_0 head
 * 1.55 -> 1.26-1.42 ms; Intel Xeon). q: the row's int4 bytes or int8 values; scales: the
 * groups' scales (int4: {scale, offset} pairs). */
static inline __attribute__((always_inline)) void rows_vectors(const float *x, int64_t K,
                                                               const void *q, int int4,
                                                               const float *scales, int mt,
                                                               vec_t out[M_TILE]) {
  const int64_t G = K / GROUP, bytes = int4 ? GROUP / 2 : GROUP, stride = int4 ? 2 : 1;
  const uint8_t *qb = (const uint8_t *)q;
  vec_t even[M_TILE], odd[M_TILE];
  for (int i = 0; i < mt; i++) even[i] = odd[i] = vec_zero();
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    group_steps(x + g * GROUP, K, qb + g * bytes, int4, scales[g * stride], mt, even);
    group_steps(x + (g + 1) * GROUP, K, qb + (g + 1) * bytes, int4, scales[(g + 1) * stride], mt,
                odd);
  }
  if (g < G) group_steps(x + g * GROUP, K, qb + g * bytes, int4, scales[g * stride], mt, even);
  for (int i = 0; i < mt; i++) out[i] = vec_add(even[i], odd[i]);
}

/* rows_vectors of rows m0 .. m0 + mt, with mt a constant in each call. */
_Static_assert(M_TILE == 4, "tile_vectors has a case for each row count up to M_TILE");
static inline void tile_vectors(const float *x, int64_t K, const void *q, int int4,
                                const float *scales, int64_t m0, int mt, vec_t out[M_TILE]) {
  x += m0 * K;
  switch (mt) {
  case 1:
    rows_vectors(x, K, q, int4, scales, 1, out);
    break;
  case 2:
    rows_vectors(x, K, q, int4, scales, 2, out);
    break;
  case 3:
    rows_vectors(x, K, q, int4, scales, 3, out);
    break;
  default:
    rows_vectors(x, K, q, int4, scales, M_TILE, out);
  }
}

static inline void q4_vectors(const float *x, int64_t K, const uint8_t *qrow, const float *sorow,
                              int64_t m0, int mt, vec_t out[M_TILE]) {
  tile_vectors(x, K, qrow, 1, sorow, m0, mt, out);
}

static inline void q8_vectors(const float *x, int64_t K, const int8_t *qrow, const float *srow,
                              int64_t m0, int mt, vec_t out[M_TILE]) {
  tile_vectors(x, K, qrow, 0, srow, m0, mt, out);
}

/* offset_term of one row for N_BLOCK outputs at once, lane j in output j's order and
 * roundings (each product rounded, then added): offt holds the outputs' offsets [g][j]. */
static inline vec_t offset_terms(const float *offt, const float *sums, int64_t G) {
  vec_t part[4] = {vec_zero(), vec_zero(), vec_zero(), vec_zero()};
  int64_t g = 0;
  for (; g + 4 <= G; g += 4)
    for (int j = 0; j < 4; j++)
      part[j] = vec_add(part[j], vec_mul(vec_load(offt + (g + j) * N_BLOCK), vec_set1(sums[g + j])));
  for (; g < G; g++)
    part[0] = vec_add(part[0], vec_mul(vec_load(offt + g * N_BLOCK), vec_set1(sums[g])));
  return vec_add(vec_add(part[0], part[1]), vec_add(part[2], part[3]));
}
#endif

/* y[m, n] for every row m of one output n: the kernels' arithmetic, one output at a time
 * (the portable build's only path; the vector builds' for outputs past the last whole block). */
static void q4_rows(const float *x, const float *sums, int64_t M, int64_t K, const uint8_t *q4,
                    const float *so_, int64_t n, float *y, int64_t N) {
  const int64_t G = K / GROUP;
  const uint8_t *qrow = q4 + n * G * (GROUP / 2);
  const float *sorow = so_ + n * G * 2;
  for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
    const int mt = (int)(M - m0 < M_TILE ? M - m0 : M_TILE);
#if PACKED_SIMD
    vec_t v[M_TILE];
    q4_vectors(x, K, qrow, sorow, m0, mt, v);
    for (int i = 0; i < mt; i++)
      y[(m0 + i) * N + n] = vec_sum(v[i]) + offset_term(sorow, sums + (m0 + i) * G, G);
#else
    for (int i = 0; i < mt; i++) {
      const float *xm = x + (m0 + i) * K;
      float total = 0.0f;
      for (int64_t g = 0; g < G; g++) {
        const uint8_t *q = qrow + g * (GROUP / 2);
        float dot = 0.0f;
        for (int j = 0; j < GROUP / 2; j++)
          dot += xm[g * GROUP + j] * (float)(q[j] & 0x0F) +
                 xm[g * GROUP + j + 16] * (float)(q[j] >> 4);
        total += sorow[2 * g] * dot + sorow[2 * g + 1] * sums[(m0 + i) * G + g];
      }
      y[(m0 + i) * N + n] = total;
    }
#endif
  }
}

static void q8_rows(const float *x, int64_t M, int64_t K, const int8_t *q8, const float *scale,
                    int64_t n, float *y, int64_t N) {
  const int64_t G = K / GROUP;
  const int8_t *qrow = q8 + n * K;
  const float *srow = scale + n * G;
  for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
    const int mt = (int)(M - m0 < M_TILE ? M - m0 : M_TILE);
#if PACKED_SIMD
    vec_t v[M_TILE];
    q8_vectors(x, K, qrow, srow, m0, mt, v);
    for (int i = 0; i < mt; i++) y[(m0 + i) * N + n] = vec_sum(v[i]);
#else
    for (int i = 0; i < mt; i++) {
      const float *xm = x + (m0 + i) * K;
      float total = 0.0f;
      for (int64_t g = 0; g < G; g++) {
        float dot = 0.0f;
        for (int j = 0; j < GROUP; j++) dot += xm[g * GROUP + j] * (float)qrow[g * GROUP + j];
        total += srow[g] * dot;
      }
      y[(m0 + i) * N + n] = total;
    }
#endif
  }
}

#if PACKED_SIMD
#ifndef PREFETCH_OUTPUTS
#define PREFETCH_OUTPUTS 32
#endif
/* The `bytes` bytes at p, fetched into the cache now: a decode step (M of a few rows) streams
 * every matrix from memory once, and the hardware prefetcher starts late on each small
 * matrix (ggml_dot.c's dot_rows does the same). Changes no result. */
static inline void prefetch(const void *p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)p + off, _MM_HINT_T0);
}

/* Outputs n0 .. n0 + N_BLOCK of every row: q4_rows' numbers, bit for bit, with each row's
 * horizontal sums and offset terms computed for the block's outputs together (at SmolLM2's
 * K of 576 those per-output scalar tails cost as much as the dot products). */
static void q4_block(const float *x, const float *sums, int64_t M, int64_t K, const uint8_t *q4,
                     const float *so_, int64_t n0, float *y, int64_t N) {
  const int64_t G = K / GROUP;
  if (M <= M_TILE && n0 + PREFETCH_OUTPUTS + N_BLOCK <= N) { /* the outputs PREFETCH_OUTPUTS on */
    prefetch(q4 + (n0 + PREFETCH_OUTPUTS) * G * (GROUP / 2), N_BLOCK * G * (GROUP / 2));
    prefetch(so_ + (n0 + PREFETCH_OUTPUTS) * G * 2, N_BLOCK * G * 2 * (int64_t)sizeof(float));
  }
  float offt[G * N_BLOCK];
  for (int j = 0; j < N_BLOCK; j++)
    for (int64_t g = 0; g < G; g++) offt[g * N_BLOCK + j] = so_[((n0 + j) * G + g) * 2 + 1];
  for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
    const int mt = (int)(M - m0 < M_TILE ? M - m0 : M_TILE);
    vec_t v[M_TILE][N_BLOCK];
    for (int j = 0; j < N_BLOCK; j++) {
      vec_t out[M_TILE];
      const int64_t n = n0 + j;
      q4_vectors(x, K, q4 + n * G * (GROUP / 2), so_ + n * G * 2, m0, mt, out);
      for (int i = 0; i < mt; i++) v[i][j] = out[i];
    }
    for (int i = 0; i < mt; i++)
      vec_store(y + (m0 + i) * N + n0,
                vec_add(vec_sums(v[i]), offset_terms(offt, sums + (m0 + i) * G, G)));
  }
}

static void q8_block(const float *x, int64_t M, int64_t K, const int8_t *q8, const float *scale,
                     int64_t n0, float *y, int64_t N) {
  const int64_t G = K / GROUP;
  if (M <= M_TILE && n0 + PREFETCH_OUTPUTS + N_BLOCK <= N) {
    prefetch(q8 + (n0 + PREFETCH_OUTPUTS) * K, N_BLOCK * K);
    prefetch(scale + (n0 + PREFETCH_OUTPUTS) * G, N_BLOCK * G * (int64_t)sizeof(float));
  }
  for (int64_t m0 = 0; m0 < M; m0 += M_TILE) {
    const int mt = (int)(M - m0 < M_TILE ? M - m0 : M_TILE);
    vec_t v[M_TILE][N_BLOCK];
    for (int j = 0; j < N_BLOCK; j++) {
      vec_t out[M_TILE];
      const int64_t n = n0 + j;
      q8_vectors(x, K, q8 + n * K, scale + n * G, m0, mt, out);
      for (int i = 0; i < mt; i++) v[i][j] = out[i];
    }
    for (int i = 0; i < mt; i++) vec_store(y + (m0 + i) * N + n0, vec_sums(v[i]));
  }
}
#endif

/* y[M, N] = x[M, K] . W^T for int4 weights; sums: scratch of M * K / 32 floats. */
void q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *q4, const float *so_, int64_t N,
             float *y, float *sums, int threads) {
  group_sums(x, M, K, sums);
#if PACKED_SIMD
  const int64_t blocks = N / N_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; b++) q4_block(x, sums, M, K, q4, so_, b * N_BLOCK, y, N);
  for (int64_t n = blocks * N_BLOCK; n < N; n++) q4_rows(x, sums, M, K, q4, so_, n, y, N);
#else
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++) q4_rows(x, sums, M, K, q4, so_, n, y, N);
#endif
}

void q8_gemm(const float *x, int64_t M, int64_t K, const int8_t *q8, const float *scale,
             int64_t N, float *y, int threads) {
#if PACKED_SIMD
  const int64_t blocks = N / N_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; b++) q8_block(x, M, K, q8, scale, b * N_BLOCK, y, N);
  for (int64_t n = blocks * N_BLOCK; n < N; n++) q8_rows(x, M, K, q8, scale, n, y, N);
#else
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; n++) q8_rows(x, M, K, q8, scale, n, y, N);
#endif
}

/* --- packing GGUF blocks ------------------------------------------------------------------
 * Each packer writes `rows` rows of a [rows, K] matrix into q/so_ (or q/scale), taking dest
 * row r from source row src_rows[r] (or r when src_rows is NULL: wq/wk reorder their rows).
 * row_bytes is the source row's size in bytes. Every value is converted exactly.
 */
static float half_to_float(const uint8_t *p) {
  return half_bits_to_float((uint16_t)(p[0] | (p[1] << 8)));
}

static const uint8_t *source_row(const uint8_t *blocks, int64_t row_bytes, const int64_t *src_rows,
                                 int64_t r) {
  return blocks + (src_rows ? src_rows[r] : r) * row_bytes;
}

/* Q4_0: f16 d, 16 bytes of nibbles; w = d * (q - 8) = fma(d, q, -8 d) exactly. */
void pack_q4_0(const uint8_t *blocks, int64_t row_bytes, const int64_t *src_rows, int64_t rows,
               int64_t K, uint8_t *q, float *so_) {
  const int64_t G = K / GROUP;
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *row = source_row(blocks, row_bytes, src_rows, r);
    for (int64_t g = 0; g < G; g++) {
      const uint8_t *block = row + g * 18;
      const float d = half_to_float(block);
      so_[(r * G + g) * 2] = d;
      so_[(r * G + g) * 2 + 1] = -8.0f * d;
      memcpy(q + (r * G + g) * 16, block + 2, 16);
    }
  }
}

/* Q4_1: f16 d, f16 m, 16 bytes of nibbles; w = d * q + m. */
void pack_q4_1(const uint8_t *blocks, int64_t row_bytes, const int64_t *src_rows, int64_t rows,
               int64_t K, uint8_t *q, float *so_) {
  const int64_t G = K / GROUP;
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *row = source_row(blocks, row_bytes, src_rows, r);
    for (int64_t g = 0; g < G; g++) {
      const uint8_t *block = row + g * 20;
      so_[(r * G + g) * 2] = half_to_float(block);
      so_[(r * G + g) * 2 + 1] = half_to_float(block + 2);
      memcpy(q + (r * G + g) * 16, block + 4, 16);
    }
  }
}

/* Q4_K: 256 values per super-block: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins,
 * 128 bytes of nibbles (32-byte chunk c: sub-block 2c low nibbles, 2c + 1 high). Sub-block s:
 * w = (d * sc_s) * q - dmin * m_s, both products exact in float32. */
void pack_q4_k(const uint8_t *blocks, int64_t row_bytes, const int64_t *src_rows, int64_t rows,
               int64_t K, uint8_t *q, float *so_) {
  const int64_t G = K / GROUP;
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *row = source_row(blocks, row_bytes, src_rows, r);
    for (int64_t b = 0; b < K / 256; b++) {
      const uint8_t *block = row + b * 144, *scales = block + 4, *qs = block + 16;
      const float d = half_to_float(block), dmin = half_to_float(block + 2);
      for (int s = 0; s < 8; s++) {
        int sc, m;
        if (s < 4) {
          sc = scales[s] & 0x3F;
          m = scales[s + 4] & 0x3F;
        } else {
          sc = (scales[s + 4] & 0x0F) | ((scales[s - 4] >> 6) << 4);
          m = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
        }
        const int64_t group = r * G + b * 8 + s;
        so_[group * 2] = d * (float)sc;
        so_[group * 2 + 1] = -(dmin * (float)m);
        const uint8_t *chunk = qs + (s / 2) * 32;
        const int shift = (s % 2) * 4;
        for (int j = 0; j < 16; j++)
          q[group * 16 + j] =
              (uint8_t)(((chunk[j] >> shift) & 0x0F) | (((chunk[j + 16] >> shift) & 0x0F) << 4));
      }
    }
  }
}

/* Q8_0: f16 d, 32 int8; w = d * q. */
void pack_q8_0(const uint8_t *blocks, int64_t row_bytes, const int64_t *src_rows, int64_t rows,
               int64_t K, int8_t *q, float *scale) {
  const int64_t G = K / GROUP;
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t *row = source_row(blocks, row_bytes, src_rows, r);
    for (int64_t g = 0; g < G; g++) {
      const uint8_t *block = row + g * 34;
      scale[r * G + g] = half_to_float(block);
      memcpy(q + (r * G + g) * GROUP, block + 2, GROUP);
    }
  }
}

/* W[N, K] as the dense path has it (float32), for checks. */
void q4_dequantize(const uint8_t *q4, const float *so_, int64_t N, int64_t K, float *w) {
  const int64_t G = K / GROUP;
  for (int64_t n = 0; n < N; n++)
    for (int64_t g = 0; g < G; g++) {
      const uint8_t *q = q4 + (n * G + g) * (GROUP / 2);
      const float scale = so_[(n * G + g) * 2], offset = so_[(n * G + g) * 2 + 1];
      float *out = w + n * K + g * GROUP;
      for (int j = 0; j < GROUP / 2; j++) {
        out[j] = __builtin_fmaf(scale, (float)(q[j] & 0x0F), offset);
        out[j + 16] = __builtin_fmaf(scale, (float)(q[j] >> 4), offset);
      }
    }
}

void q8_dequantize(const int8_t *q8, const float *scale, int64_t N, int64_t K, float *w) {
  const int64_t G = K / GROUP;
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++) w[n * K + k] = scale[n * G + k / GROUP] * (float)q8[n * K + k];
}

/* Dot product of two float32 vectors over 8 lanes (vectorized without reassociating). */
static inline float dot8(const float *a, const float *b, int64_t n) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] += a[i + j] * b[i + j];
    float sum = 0.0f;
    for (; i < n; i++) sum += a[i] * b[i];
    for (int j = 0; j < 8; j++) sum += lanes[j];
    return sum;
}

/* RMSNorm of each row, as torch's float32 rms_norm computes it: y = (x * r) * w with
 * r = 1 / sqrt(mean(x^2) + eps), the sum of squares in float32 over 8 lanes. Quantized mode's
 * norms run here: torch's CPU rms_norm is a chain of eight small operators (14 us a call,
 * 61 calls per SmolLM2 token); this is one call. Summation order aside, the same arithmetic. */
void rms_norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps, float *y) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        const float scale = 1.0f / __builtin_sqrtf(dot8(xr, xr, dim) / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) yr[i] = (xr[i] * scale) * w[i];
    }
}

/* One decode step of grouped-query attention for one sequence, after the fused QKV product.
 *
 * qkv: [n_heads + 2 n_kv_heads, head_dim], the q, k and v heads of the new position `pos`;
 * the q and k heads are rotated in place (RoPE, "rotate half" layout with the cos/sin rows
 * of `pos`, the same roundings as model.apply_rotary_emb: each product rounded, then the sum;
 * -std=c11 keeps the compiler from fusing them). k and v are written to the caches
 * ([n_kv_heads, max_seq, head_dim] each, batch row 0), then every q head attends over
 * positions 0..pos of its KV head (n_heads / n_kv_heads q heads per KV head):
 * out[h] = softmax(q_h . K^T * scale) V, float32. scores: scratch of pos + 1 floats.
 * Replaces ten torch operators per layer (rotation, cache writes, SDPA, reshapes). */
/* The rotation of the q and k heads of qkv, in place (Attention.project's, bit for bit). */
static void rotate_heads(float *qkv, const float *cos, const float *sin, int64_t heads,
                         int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x = qkv + h * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            const float low_cos = a * cos[i], low_sin = -b * sin[i];
            const float high_cos = b * cos[i + half], high_sin = a * sin[i + half];
            x[i] = low_cos + low_sin;
            x[i + half] = high_cos + high_sin;
        }
    }
}

/* Grouped-query attention of one query position over T keys and values: key t of KV head g
 * is at cache + ((slots ? slots[t] : t) * t_stride + g * g_stride) * head_dim, for the
 * contiguous cache (t_stride 1, g_stride max_seq) and the paged one (slots, t_stride
 * n_kv_heads, g_stride 1) alike, in one summation order. Each query head h: its scores
 * q_h . k_t * scale in t order, their peak, exp(score - peak) summed in t order, then out_h =
 * sum over t, in order, of (exp_t / total) * v_t. A KV head's query heads (`group` of them)
 * are computed side by side, so each key and value row is read once for all of them rather
 * than once per head; per head the operations and their order are the ones above, so the
 * same bits (test_packed's decode attention checks). `scores`: scratch of T floats, used
 * when the group does not fit GROUP_HEADS. */
#define GROUP_HEADS 16
#if PACKED_SIMD
/* r[j] lane c = r[c] lane j. */
static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* out[c] = dot8(q, k[c], n) * scale for 8 keys (n % 8 == 0): each key's 8 lanes as dot8
 * accumulates them (a product, then a sum, per lane), then its lanes added in dot8's order
 * from 0.0f, the 8 keys side by side after a transpose instead of one chain of 8 dependent
 * scalar additions per key: the same operations per key, so the same bits. */
static inline void dot8_keys8(const float *q, const float *const k[8], int64_t n, float scale,
                              float *out) {
    __m256 acc[8];
    for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        for (int c = 0; c < 8; c++)
            acc[c] = _mm256_add_ps(acc[c], _mm256_mul_ps(qv, _mm256_loadu_ps(k[c] + i)));
    }
    transpose8(acc);
    __m256 sum = _mm256_add_ps(_mm256_setzero_ps(), acc[0]);
    for (int j = 1; j < 8; j++) sum = _mm256_add_ps(sum, acc[j]);
    _mm256_storeu_ps(out, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}
#endif

/* The cached row (key or value) of position t for the KV group at g_offset: slots map a
 * position to its row in a paged cache (NULL: the contiguous cache's row t). */
static inline const float *cached_row(const float *cache, const int64_t *slots, int64_t t,
                                      int64_t t_stride, int64_t g_offset, int64_t head_dim) {
    return cache + ((slots ? slots[t] : t) * t_stride + g_offset) * head_dim;
}

/* Query heads first .. first + count - 1 (one KV group's, or one of them) over T cached
 * positions; scores holds count rows of T. */
static void attend_heads(const float *qkv, const float *cache_k, const float *cache_v,
                         const int64_t *slots, int64_t t_stride, int64_t g_offset, int64_t first,
                         int64_t count, int64_t head_dim, int64_t T, float scale, float *scores,
                         float *out) {
    float peak[GROUP_HEADS], total[GROUP_HEADS];
    const float *q = qkv + first * head_dim; /* head first + j's query: q + j * head_dim */
    out += first * head_dim;
    int64_t t = 0;
#if PACKED_SIMD
    for (; head_dim % 8 == 0 && t + 8 <= T; t += 8) {
        const float *k[8];
        for (int c = 0; c < 8; c++)
            k[c] = cached_row(cache_k, slots, t + c, t_stride, g_offset, head_dim);
        for (int64_t j = 0; j < count; j++)
            dot8_keys8(q + j * head_dim, k, head_dim, scale, scores + j * T + t);
    }
#endif
    for (; t < T; t++) {
        const float *k = cached_row(cache_k, slots, t, t_stride, g_offset, head_dim);
        for (int64_t j = 0; j < count; j++)
            scores[j * T + t] = dot8(q + j * head_dim, k, head_dim) * scale;
    }
    for (int64_t j = 0; j < count; j++) {
        float sum = 0.0f, *sj = scores + j * T;
        peak[j] = -__builtin_inff();
        for (int64_t u = 0; u < T; u++)
            if (sj[u] > peak[j]) peak[j] = sj[u];
        for (int64_t t = 0; t < T; t++) {
            sj[t] = __builtin_expf(sj[t] - peak[j]);
            sum += sj[t];
        }
        total[j] = sum;
        float *o = out + j * head_dim;
        for (int64_t i = 0; i < head_dim; i++) o[i] = 0.0f;
    }
#if PACKED_SIMD
    /* each head's output 64 values at a time in registers across every t: o[i] + p * v[i]
     * (a product, then a sum) in t order, as the loop below, without a store and a load of
     * o[i] per t */
    if (head_dim % 64 == 0) {
        for (int64_t j = 0; j < count; j++)
            for (int64_t c0 = 0; c0 < head_dim; c0 += 64) {
                float *o = out + j * head_dim + c0;
                __m256 acc[8];
                for (int u = 0; u < 8; u++) acc[u] = _mm256_loadu_ps(o + 8 * u);
                for (int64_t t = 0; t < T; t++) {
                    const float *vt =
                        cached_row(cache_v, slots, t, t_stride, g_offset, head_dim) + c0;
                    const __m256 p = _mm256_set1_ps(scores[j * T + t] / total[j]);
                    for (int u = 0; u < 8; u++) {
                        const __m256 v = _mm256_loadu_ps(vt + 8 * u);
                        acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(p, v));
                    }
                }
                for (int u = 0; u < 8; u++) _mm256_storeu_ps(o + 8 * u, acc[u]);
            }
        return;
    }
#endif
    for (int64_t t = 0; t < T; t++) {
        const float *vt = cached_row(cache_v, slots, t, t_stride, g_offset, head_dim);
        for (int64_t j = 0; j < count; j++) {
            const float p = scores[j * T + t] / total[j];
            float *o = out + j * head_dim;
            for (int64_t i = 0; i < head_dim; i++) o[i] += p * vt[i];
        }
    }
}

/* Attention of `rows` rows (queries qkv + r * width, outputs out + r * attn), one task per
 * (row, KV group) split among `threads` once the rows' positions x query values reach
 * `parallel_work` (else one thread): a group's heads in one attend_heads call (one at a time
 * past GROUP_HEADS), so no bit depends on the split. Row r attends T positions of the
 * contiguous cache (slots NULL; one row), or the starts[r + 1] - starts[r] positions of the
 * paged cache at slots + starts[r]. Returns -1 when a thread's scratch cannot be allocated. */
static int attend_rows(const float *qkv, int64_t width, const float *cache_k,
                       const float *cache_v, const int64_t *slots, const int64_t *starts,
                       int64_t t_stride, int64_t g_stride, int64_t rows, int64_t n_heads,
                       int64_t n_kv_heads, int64_t head_dim, int64_t T, float scale, float *out,
                       int64_t attn, int threads, int64_t parallel_work) {
    const int64_t group = n_heads / n_kv_heads, heads = group <= GROUP_HEADS ? group : 1;
    int64_t most = T, work = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t Tr = slots ? starts[r + 1] - starts[r] : T;
        most = Tr > most ? Tr : most;
        work += Tr * n_heads * head_dim;
    }
    int failed = 0;
#pragma omp parallel num_threads(work >= parallel_work ? threads : 1)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(heads * most));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * n_kv_heads; task++) {
            const int64_t r = task / n_kv_heads, kv = task % n_kv_heads;
            if (!scores) continue;
            const int64_t *rs = slots ? slots + starts[r] : NULL;
            const int64_t Tr = slots ? starts[r + 1] - starts[r] : T;
            for (int64_t first = kv * group; first < (kv + 1) * group; first += heads)
                attend_heads(qkv + r * width, cache_k, cache_v, rs, t_stride, kv * g_stride,
                             first, heads, head_dim, Tr, scale, scores, out + r * attn);
        }
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* One row's attention over T positions (attend_rows with one row, on the calling thread); if
 * its scratch cannot be allocated, one head at a time in the caller's `scores` (T floats): the
 * same bits. */
static void attend(const float *qkv, const float *cache_k, const float *cache_v,
                   const int64_t *slots, int64_t t_stride, int64_t g_stride, int64_t n_heads,
                   int64_t n_kv_heads, int64_t head_dim, int64_t T, float scale, float *scores,
                   float *out) {
    const int64_t starts[2] = {0, T};
    if (attend_rows(qkv, 0, cache_k, cache_v, slots, starts, t_stride, g_stride, 1, n_heads,
                    n_kv_heads, head_dim, T, scale, out, 0, 1, INT64_MAX) == 0)
        return;
    const int64_t group = n_heads / n_kv_heads;
    for (int64_t head = 0; head < n_heads; head++)
        attend_heads(qkv, cache_k, cache_v, slots, t_stride, head / group * g_stride, head, 1,
                     head_dim, T, scale, scores, out);
}

/* Rope on a row's query and key heads, its keys and values stored at position pos of the
 * contiguous cache [n_kv_heads, max_seq, head_dim]: decode_attention before it attends. */
static void store_position(float *qkv, const float *cos, const float *sin, float *cache_k,
                           float *cache_v, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                           int64_t max_seq, int64_t pos) {
    rotate_heads(qkv, cos, sin, n_heads + n_kv_heads, head_dim);
    const float *k = qkv + n_heads * head_dim, *v = k + n_kv_heads * head_dim;
    for (int64_t j = 0; j < n_kv_heads; j++) {
        memcpy(cache_k + (j * max_seq + pos) * head_dim, k + j * head_dim, head_dim * 4);
        memcpy(cache_v + (j * max_seq + pos) * head_dim, v + j * head_dim, head_dim * 4);
    }
}

/* The same for the paged cache [slots, n_kv_heads, head_dim], the position at `slot`. */
static void store_slot(float *qkv, const float *cos, const float *sin, float *cache_k,
                       float *cache_v, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                       int64_t slot) {
    rotate_heads(qkv, cos, sin, n_heads + n_kv_heads, head_dim);
    const float *k = qkv + n_heads * head_dim, *v = k + n_kv_heads * head_dim;
    const int64_t at = slot * n_kv_heads * head_dim;
    memcpy(cache_k + at, k, n_kv_heads * head_dim * 4);
    memcpy(cache_v + at, v, n_kv_heads * head_dim * 4);
}

void decode_attention(float *qkv, const float *cos, const float *sin, float *cache_k,
                      float *cache_v, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                      int64_t max_seq, int64_t pos, float scale, float *scores, float *out) {
    store_position(qkv, cos, sin, cache_k, cache_v, n_heads, n_kv_heads, head_dim, max_seq, pos);
    attend(qkv, cache_k, cache_v, NULL, 1, max_seq, n_heads, n_kv_heads, head_dim, pos + 1,
           scale, scores, out);
}

/* store_slot where `fresh`; else the rotation alone, the slot's keys and values kept (a
 * position kept from before, as a preempted sequence's, is not written again: PagedBatch). */
static void store_if_fresh(float *qkv, const float *cos, const float *sin, float *cache_k,
                           float *cache_v, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                           int64_t slot, int fresh) {
    if (fresh)
        store_slot(qkv, cos, sin, cache_k, cache_v, n_heads, n_kv_heads, head_dim, slot);
    else
        rotate_heads(qkv, cos, sin, n_heads + n_kv_heads, head_dim);
}

/* decode_attention over a paged cache (pipelines/llama3/serving.py's block pool): the cache is
 * [slots, n_kv_heads, head_dim], slots[t] is where position t lives (t = 0..pos; the new
 * position's keys and values are written at slots[pos] where `fresh`). Bit-identical to
 * decode_attention on the same keys. */
void decode_attention_paged(float *qkv, const float *cos, const float *sin, float *cache_k,
                            float *cache_v, int64_t n_heads, int64_t n_kv_heads,
                            int64_t head_dim, const int64_t *slots, int64_t pos, float scale,
                            float *scores, float *out, int fresh) {
    store_if_fresh(qkv, cos, sin, cache_k, cache_v, n_heads, n_kv_heads, head_dim, slots[pos],
                   fresh);
    attend(qkv, cache_k, cache_v, slots, n_kv_heads, 1, n_heads, n_kv_heads, head_dim,
           pos + 1, scale, scores, out);
}

/* SwiGLU of rows of a fused gate/up product, gu [rows, 2 * hidden] (gate then up): out =
 * (g / (1 + exp(-g))) * up, torch's SiLU formula times up with each step rounded as written,
 * exp from the C library. The quantized mode's feed-forward calls it for every row (packed.py
 * PackedFeedForward), so its decode step below computes what the modules compute. */
void swiglu_rows(const float *gu, int64_t rows, int64_t hidden, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gu + r * 2 * hidden, *up = gate + hidden;
        float *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i++) {
            const float g = gate[i];
            o[i] = (g / (1.0f + expf(-g))) * up[i];
        }
    }
}

/* --- one decode step through every layer ---------------------------------------------------
 * What the quantized mode's modules compute for decode rows (one new position each), the same
 * functions in the same order, so the same bits, in one call instead of about a dozen
 * Python-level calls per layer: KernelRMSNorm, PackedAttention's fused product and its
 * one-position attention (decode_attention over one sequence's contiguous cache, or
 * decode_attention_paged per row over the serving engine's paged caches), PackedLinear,
 * PackedFeedForward's swiglu_rows, the residual adds. */

enum { P_QKV, P_O, P_13, P_2, P_COUNT }; /* a layer's products */

typedef struct {
    const float *attn_norm, *ffn_norm;  /* [dim] */
    const void *q[P_COUNT];             /* packed values: int4 nibbles or int8 */
    const float *scales[P_COUNT];       /* int4: {scale, offset} per group; int8: scale */
    int64_t parallel_rows[P_COUNT];     /* from this many rows the product takes `threads` */
    int32_t int4[P_COUNT];              /* 1: int4, 0: int8 */
    float *cache_k, *cache_v;           /* [n_kv, max_seq, hd], batch row 0 (contiguous) */
} packed_layer;

int64_t packed_layer_bytes(void) { return (int64_t)sizeof(packed_layer); }

/* Where each row's attention reads and writes: one sequence's contiguous caches (the table's,
 * position `pos`), or the paged caches, row r over slots[starts[r] .. starts[r + 1]) with
 * its own position's slot replaced by write[r] (where its new keys and values go), layer l's
 * at k + l * layer_floats; a step's attention from attention_work score x value
 * multiply-adds on runs on the threads (attend_rows). */
typedef struct {
    int64_t pos, max_seq;
    const int64_t *slots, *starts, *write;
    const uint8_t *fresh; /* paged: row r's keys and values written where fresh[r] */
    float *k, *v;
    int64_t layer_floats, attention_work;
} decode_context;

static void layer_product(const packed_layer *L, int p, const float *x, int64_t rows, int64_t K,
                          int64_t N, float *y, float *sums, int threads) {
    const int t = rows >= L->parallel_rows[p] ? threads : 1;
    if (L->int4[p])
        q4_gemm(x, rows, K, (const uint8_t *)L->q[p], L->scales[p], N, y, sums, t);
    else
        q8_gemm(x, rows, K, (const int8_t *)L->q[p], L->scales[p], N, y, t);
}

static int decode_rows(const packed_layer *layers, int64_t n_layers, float *h, int64_t rows,
                       int64_t dim, int64_t n_heads, int64_t n_kv, int64_t hd, int64_t ffn,
                       const decode_context *c, const float *cos, const float *sin, float eps,
                       float scale, int threads) {
    const int64_t width = (n_heads + 2 * n_kv) * hd, attn = n_heads * hd;
    int64_t widest = dim > attn ? dim : attn;
    widest = widest > ffn ? widest : ffn;
    const int64_t floats = rows * (dim + width + attn + 3 * ffn + dim + widest / GROUP);
    float *x = (float *)malloc(sizeof(float) * (size_t)floats);
    /* the rows' block tables as their attention reads them: row r's positions at
     * row_slots + starts[r], its new one (last) at the slot it is written to */
    const int64_t tables = c->slots ? c->starts[rows] : 0;
    int64_t *row_slots = c->slots ? (int64_t *)malloc(sizeof(int64_t) * (size_t)tables) : NULL;
    if (!x || (c->slots && !row_slots)) {
        free(x);
        free(row_slots);
        return -1;
    }
    if (c->slots) {
        memcpy(row_slots, c->slots, sizeof(int64_t) * (size_t)tables);
        for (int64_t r = 0; r < rows; r++) row_slots[c->starts[r + 1] - 1] = c->write[r];
    }
    float *qkv = x + rows * dim, *att = qkv + rows * width, *gu = att + rows * attn;
    float *s = gu + rows * 2 * ffn, *y = s + rows * ffn, *sums = y + rows * dim;
    for (int64_t l = 0; l < n_layers; l++) {
        const packed_layer *L = &layers[l];
        rms_norm(h, L->attn_norm, rows, dim, eps, x);
        layer_product(L, P_QKV, x, rows, dim, width, qkv, sums, threads);
        int failed;
        if (c->slots) { /* each row's position stored, then every row's attention */
            float *k = c->k + l * c->layer_floats, *v = c->v + l * c->layer_floats;
            for (int64_t r = 0; r < rows; r++)
                store_if_fresh(qkv + r * width, cos + r * hd, sin + r * hd, k, v, n_heads, n_kv,
                               hd, c->write[r], c->fresh[r]);
            failed = attend_rows(qkv, width, k, v, row_slots, c->starts, n_kv, 1, rows, n_heads,
                                 n_kv, hd, 0, scale, att, attn, threads, c->attention_work);
        } else {
            store_position(qkv, cos, sin, L->cache_k, L->cache_v, n_heads, n_kv, hd, c->max_seq,
                           c->pos);
            failed = attend_rows(qkv, width, L->cache_k, L->cache_v, NULL, NULL, 1, c->max_seq,
                                 1, n_heads, n_kv, hd, c->pos + 1, scale, att, attn, threads,
                                 c->attention_work);
        }
        if (failed) {
            free(x);
            free(row_slots);
            return -1;
        }
        layer_product(L, P_O, att, rows, attn, dim, y, sums, threads);
        for (int64_t i = 0; i < rows * dim; i++) h[i] = h[i] + y[i];
        rms_norm(h, L->ffn_norm, rows, dim, eps, x);
        layer_product(L, P_13, x, rows, dim, 2 * ffn, gu, sums, threads);
        swiglu_rows(gu, rows, ffn, s);
        layer_product(L, P_2, s, rows, ffn, dim, y, sums, threads);
        for (int64_t i = 0; i < rows * dim; i++) h[i] = h[i] + y[i];
    }
    free(x);
    free(row_slots);
    return 0;
}

/* One sequence's decode step: h [dim] in place, the residual stream after every layer; cos,
 * sin: the rows of `pos`; its attention on `threads` from attention_work score x value
 * multiply-adds. Returns -1 (h untouched) when its scratch cannot be allocated. */
int packed_decode_layers(const packed_layer *layers, int64_t n_layers, float *h, int64_t dim,
                         int64_t n_heads, int64_t n_kv, int64_t hd, int64_t ffn,
                         int64_t max_seq, int64_t pos, const float *cos, const float *sin,
                         float eps, float scale, int threads, int64_t attention_work) {
    const decode_context c = {pos, max_seq, NULL, NULL, NULL, NULL, NULL, NULL, 0, attention_work};
    return decode_rows(layers, n_layers, h, 1, dim, n_heads, n_kv, hd, ffn, &c, cos, sin, eps,
                       scale, threads);
}

/* A serving step of decode rows only: h [rows, dim] in place; row r (cos, sin: its rows)
 * attends over slots[starts[r] .. starts[r + 1]) of the paged caches k, v ([layers, slots,
 * n_kv, hd]: layer_floats = slots * n_kv * hd apart), its own position's slot replaced by
 * write[r], as PackedAttention.forward_paged's decode_paged. The arguments are
 * ggml_decode_paged's: a row's keys and values are written where fresh[r], as the modules
 * write them. Returns -1 (h untouched) when its scratch cannot be allocated. */
int packed_decode_paged(const packed_layer *layers, int64_t n_layers, float *h, int64_t rows,
                        int64_t dim, int64_t n_heads, int64_t n_kv, int64_t hd, int64_t ffn,
                        const int64_t *slots, const int64_t *starts, const int64_t *write,
                        const uint8_t *fresh, float *k, float *v, int64_t layer_floats,
                        const float *cos, const float *sin, float eps, float scale, int threads,
                        int64_t attention_work) {
    const decode_context c = {0, 0, slots, starts, write, fresh, k, v, layer_floats,
                              attention_work};
    return decode_rows(layers, n_layers, h, rows, dim, n_heads, n_kv, hd, ffn, &c, cos, sin, eps,
                       scale, threads);
}
