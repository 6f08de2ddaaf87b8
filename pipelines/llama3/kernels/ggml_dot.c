/* The `ggml` mode's products: llama.cpp's CPU numerics for matrices of Q4_0, Q4_1, Q4_K and
 * Q8_0 weights, on the GGUF blocks as the file stores them. Called through ctypes
 * (pipelines/llama3/ggml_mode.py); built into every kernel library (kernels/BUILD.bazel).
 *
 * As ggml does, each activation row is first quantized to the weight type's `vec_dot_type`:
 *
 *   weights   activations   per block of the activation row
 *   Q4_0      Q8_0 (32)     d = amax / 127 (stored float16), q = round_even(x * (127 / amax))
 *   Q8_0      Q8_0 (32)     the same
 *   Q4_1      Q8_1 (32)     Q8_0's d and q, and s = float16(d * sum q) (d before rounding)
 *   Q4_K      Q8_K (256)    max = the first value of largest magnitude, iscale = -127 / max,
 *                           q = min(127, round_even(iscale * x)), d = 1 / iscale (float32),
 *                           bsums = the sums of q over each 16 values
 *
 * (ggml's x86 quantize_row_q8_0 / q8_1 and quantize_row_q8_K_ref; ggml_activations.py holds
 * the same rules in torch.) Then every (weight block, activation block) pair gives an exact
 * integer dot product, and the float accumulation follows ggml's AVX2 vec_dot kernels: eight
 * float lanes, lane k holding the blocks' integer sums over values 4k .. 4k+3 (of each
 * 32-value sub-block), scaled by the block's d_w * d_a and accumulated with one FMA per block;
 * at the end the lanes are summed as hsum_float_8 sums them ((l0 + l4) + (l2 + l6)) + ((l1 +
 * l5) + (l3 + l7)), then the min terms (Q4_1: sum of m * s, one FMA per block; Q4_K: four
 * lanes of dmin * (mins . bsums), summed (m0 + m2) + (m1 + m3)).
 *
 * Every build computes the same bits: the AVX2 build with maddubs/madd, the AVX-512 VNNI
 * build with dpbusd for the same integer sums, the portable build with scalar loops and
 * fmaf for the same roundings. So a result depends neither on the CPU nor on the thread
 * count (each output is one row's dot product, whoever computes it). The quantizers and
 * products of every build are compared with Debian's libggml 0.27.0 itself (its
 * libggml-cpu-haswell.so), bit for bit: pipelines/llama3/tests/test_ggml_known_answer.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GGML_SIMD 1
#else
#define GGML_SIMD 0
#endif
#if GGML_SIMD && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GGML_VNNI 1
#else
#define GGML_VNNI 0
#endif

/* The *_PAIRS codes: Q4_0 and Q4_1 rows repacked at load (ggml_mode.GgmlMatrix) two blocks
 * at a time, below; the same bytes, values and arithmetic as the GGUF blocks. */
enum { W_Q4_0 = 0, W_Q4_1 = 1, W_Q4_K = 2, W_Q8_0 = 3, W_Q4_0_PAIRS = 4, W_Q4_1_PAIRS = 5 };

/* Activation blocks, in this file's own layout (ggml's values, float32 scales). */
typedef struct {
  float d; /* float16's value */
  int8_t q[32];
} act8_0;
typedef struct {
  float d, s; /* float16's values */
  int8_t q[32];
} act8_1;
typedef struct {
  float d;
  int8_t q[256];
  int16_t bsums[16];
} act8_k;

/* Weight blocks as GGUF stores them. */
typedef struct {
  uint16_t d;
  uint8_t qs[16];
} blk_q4_0;
typedef struct {
  uint16_t d, m;
  uint8_t qs[16];
} blk_q4_1;
typedef struct {
  uint16_t d;
  int8_t qs[32];
} blk_q8_0;
typedef struct {
  uint16_t d, dmin;
  uint8_t scales[12];
  uint8_t qs[128];
} blk_q4_k;

/* Blocks 2i and 2i + 1 of a Q4_0 or Q4_1 row, repacked: their float16 scales (and minimums)
 * side by side, then 32 bytes whose low nibbles are block 2i's 32 values in order and whose
 * high nibbles are block 2i + 1's, so one load and two masks unpack both blocks (a GGUF
 * block keeps values 0-15 and 16-31 in one block's low and high nibbles). A row of an odd
 * number of blocks ends in its last block as GGUF stores it. Same size as the two blocks. */
typedef struct {
  uint16_t d[2];
  uint8_t qs[32];
} pair_q4_0;
typedef struct {
  uint16_t d[2], m[2];
  uint8_t qs[32];
} pair_q4_1;
_Static_assert(sizeof(pair_q4_0) == 2 * sizeof(blk_q4_0), "pairs keep the blocks' bytes");
_Static_assert(sizeof(pair_q4_1) == 2 * sizeof(blk_q4_1), "pairs keep the blocks' bytes");

/* The GGUF type whose activations and arithmetic a (possibly repacked) weight code has. */
static inline int gguf_type(int wtype) {
  return wtype == W_Q4_0_PAIRS ? W_Q4_0 : wtype == W_Q4_1_PAIRS ? W_Q4_1 : wtype;
}

/* The instruction set this build's products use: 2 VNNI, 1 AVX2, 0 plain C. */
int ggml_dot_isa(void) { return GGML_VNNI ? 2 : GGML_SIMD; }

static inline float h2f(uint16_t h) {
#if GGML_SIMD
  return _cvtsh_ss(h);
#else
  return half_bits_to_float(h);
#endif
}

/* float32 -> float16, round to nearest even (F16C's and torch's conversion). */
static uint16_t f2h(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  const uint32_t a = x & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return sign | 0x7C00 | (a > 0x7F800000u ? 0x200 : 0);
  if (a >= 0x477FF000u) return sign | 0x7C00; /* rounds past 65504 */
  if (a >= 0x38800000u) {                     /* a float16 normal */
    uint32_t h = (a >> 13) - (112u << 10);
    const uint32_t rest = a & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return sign | (uint16_t)h;
  }
  if (a < 0x33000000u) return sign; /* at most 2^-25: rounds to zero */
  const uint32_t e = a >> 23, m = (a & 0x7FFFFF) | 0x800000;
  const uint32_t shift = 126 - e; /* a float16 subnormal: units of 2^-24 */
  uint32_t h = m >> shift;
  const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1))) h++;
  return sign | (uint16_t)h;
}

/* round half to even, as _mm256_round_ps(_MM_ROUND_NEAREST) and ggml's nearest_int: adding
 * 1.5 * 2^23 leaves no fraction bits (exact for |v| < 2^22; here |v| <= 127.5). No libm call:
 * a call out of AVX-512 code into SSE code cost 5 us a block. */
static inline float round_even(float v) {
  const volatile float shift = 12582912.0f; /* volatile: never folded away */
  return (v + shift) - shift;
}
static inline float max_abs(float m, float v) {
  const float a = v < 0.0f ? -v : v;
  return a > m ? a : m;
}

/* --- activation quantizers ------------------------------------------------------------- */

static void quantize_row_8_0(const float *x, int64_t K, act8_0 *y) {
  for (int64_t b = 0; b < K / 32; b++, x += 32) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = max_abs(amax, x[j]);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    y[b].d = h2f(f2h(d));
    for (int j = 0; j < 32; j++) y[b].q[j] = (int8_t)round_even(x[j] * id);
  }
}

static void quantize_row_8_1(const float *x, int64_t K, act8_1 *y) {
  for (int64_t b = 0; b < K / 32; b++, x += 32) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = max_abs(amax, x[j]);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
      y[b].q[j] = (int8_t)round_even(x[j] * id);
      sum += y[b].q[j];
    }
    y[b].d = h2f(f2h(d));
    y[b].s = h2f(f2h(d * (float)sum));
  }
}

static void quantize_row_8_k(const float *x, int64_t K, act8_k *y) {
  for (int64_t b = 0; b < K / 256; b++, x += 256) {
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < 256; j++) {
      const float ax = fabsf(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    if (amax == 0.0f) {
      memset(&y[b], 0, sizeof(y[b]));
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; j++) {
      const float v = round_even(iscale * x[j]);
      y[b].q[j] = (int8_t)(v < 127.0f ? v : 127.0f);
    }
    for (int j = 0; j < 16; j++) {
      int sum = 0;
      for (int i = 0; i < 16; i++) sum += y[b].q[16 * j + i];
      y[b].bsums[j] = (int16_t)sum;
    }
    y[b].d = 1.0f / iscale;
  }
}

/* Bytes of one quantized activation row of K values for weight type `wtype`. */
int64_t ggml_act_row_bytes(int wtype, int64_t K) {
  switch (gguf_type(wtype)) {
  case W_Q4_0:
  case W_Q8_0:
    return (K / 32) * (int64_t)sizeof(act8_0);
  case W_Q4_1:
    return (K / 32) * (int64_t)sizeof(act8_1);
  case W_Q4_K:
    return (K / 256) * (int64_t)sizeof(act8_k);
  }
  return -1;
}

/* The activation rows x [M, K] quantized for `wtype` into out (M * ggml_act_row_bytes). */
void ggml_quantize_rows(int wtype, const float *x, int64_t M, int64_t K, uint8_t *out) {
  const int64_t row = ggml_act_row_bytes(wtype, K);
  wtype = gguf_type(wtype);
  for (int64_t m = 0; m < M; m++) {
    uint8_t *dst = out + m * row;
    if (wtype == W_Q4_1)
      quantize_row_8_1(x + m * K, K, (act8_1 *)dst);
    else if (wtype == W_Q4_K)
      quantize_row_8_k(x + m * K, K, (act8_k *)dst);
    else
      quantize_row_8_0(x + m * K, K, (act8_0 *)dst);
  }
}

/* --- the eight lanes -------------------------------------------------------------------- */

/* The sum of eight float lanes in ggml's order (hsum_float_8: the halves added, then pairs):
 * every eight-lane reduction here, vector or scalar, ends in these additions. */
static inline float sum8(const float lane[8]) {
  const float r0 = lane[4] + lane[0], r1 = lane[5] + lane[1];
  const float r2 = lane[6] + lane[2], r3 = lane[7] + lane[3];
  return (r0 + r2) + (r1 + r3);
}

#if GGML_SIMD
typedef __m256 lanes;
static inline lanes lanes_zero(void) { return _mm256_setzero_ps(); }
static inline lanes lanes_fma(float d, __m256i sums, lanes acc) {
  return _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sums), acc);
}
static inline float lanes_sum(lanes v) { /* ggml's hsum_float_8 */
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
/* sum over each 4 bytes of u (unsigned) * s (signed), as 8 int32 lanes */
static inline __m256i dot_us8(__m256i u, __m256i s) {
#if GGML_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
/* the same for two signed operands (ggml's mul_sum_i8_pairs: |a| times b with a's sign) */
static inline __m256i dot_ss8(__m256i a, __m256i b) {
  return dot_us8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}
static inline __m256i nibbles_32(const uint8_t *qs) { /* values 0..15 then 16..31 */
  const __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}
#else
typedef struct {
  float v[8];
} lanes;
static inline lanes lanes_zero(void) {
  lanes z;
  for (int k = 0; k < 8; k++) z.v[k] = 0.0f;
  return z;
}
static inline lanes lanes_fma(float d, const int32_t sums[8], lanes acc) {
  for (int k = 0; k < 8; k++) acc.v[k] = fmaf(d, (float)sums[k], acc.v[k]);
  return acc;
}
static inline float lanes_sum(lanes a) { return sum8(a.v); }
static inline void nibbles(const uint8_t *qs, int32_t out[32]) {
  for (int j = 0; j < 16; j++) {
    out[j] = qs[j] & 0x0F;
    out[j + 16] = qs[j] >> 4;
  }
}
#endif

/* --- rows of weights . one quantized activation row ------------------------------------
 * Each block_* adds one (weight block, activation block) pair to a row's lanes; the dot_*
 * drivers run ROWS weight rows side by side over the same activation row, so the FMA chains
 * of several rows overlap (one row's chain is what ggml's kernel does; interleaving rows
 * changes no rounding of any row). */

#define ROWS 4
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 32
#endif

static inline void block_q4_0(lanes *acc, const blk_q4_0 *w, const act8_0 *a) {
  const float d = h2f(w->d) * a->d;
#if GGML_SIMD
  const __m256i qw = _mm256_sub_epi8(nibbles_32(w->qs), _mm256_set1_epi8(8));
  *acc = lanes_fma(d, dot_ss8(qw, _mm256_loadu_si256((const __m256i *)a->q)), *acc);
#else
  int32_t q[32], sums[8];
  nibbles(w->qs, q);
  for (int k = 0; k < 8; k++) {
    sums[k] = 0;
    for (int e = 4 * k; e < 4 * k + 4; e++) sums[k] += (q[e] - 8) * a->q[e];
  }
  *acc = lanes_fma(d, sums, *acc);
#endif
}

static inline void block_q4_1(lanes *acc, float *mins, const blk_q4_1 *w, const act8_1 *a) {
  const float d = h2f(w->d) * a->d;
  *mins = fmaf(h2f(w->m), a->s, *mins);
#if GGML_SIMD
  *acc = lanes_fma(d, dot_us8(nibbles_32(w->qs), _mm256_loadu_si256((const __m256i *)a->q)),
                   *acc);
#else
  int32_t q[32], sums[8];
  nibbles(w->qs, q);
  for (int k = 0; k < 8; k++) {
    sums[k] = 0;
    for (int e = 4 * k; e < 4 * k + 4; e++) sums[k] += q[e] * a->q[e];
  }
  *acc = lanes_fma(d, sums, *acc);
#endif
}

static inline void block_q8_0(lanes *acc, const blk_q8_0 *w, const act8_0 *a) {
  const float d = h2f(w->d) * a->d;
#if GGML_SIMD
  const __m256i qw = _mm256_loadu_si256((const __m256i *)w->qs);
  *acc = lanes_fma(d, dot_ss8(qw, _mm256_loadu_si256((const __m256i *)a->q)), *acc);
#else
  int32_t sums[8];
  for (int k = 0; k < 8; k++) {
    sums[k] = 0;
    for (int e = 4 * k; e < 4 * k + 4; e++) sums[k] += w->qs[e] * a->q[e];
  }
  *acc = lanes_fma(d, sums, *acc);
#endif
}

/* Two blocks of a pair, each added to the row's lanes exactly as block_q4_0 / block_q4_1 add
 * it (the same products, scales and FMAs, block 2i first), the nibbles unpacked once. */
static inline void pair_scales(const uint16_t *h, int n, float *f) {
#if GGML_SIMD
  uint64_t bits = 0;
  memcpy(&bits, h, (size_t)n * 2);
  _mm_storeu_ps(f, _mm_cvtph_ps(_mm_cvtsi64_si128((long long)bits)));
#else
  for (int k = 0; k < n; k++) f[k] = half_bits_to_float(h[k]);
#endif
}

#if GGML_SIMD
static inline void pair_nibbles(const uint8_t *qs, __m256i *lo, __m256i *hi) {
  const __m256i bytes = _mm256_loadu_si256((const __m256i *)qs);
  *lo = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F));
  *hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
}
#else
/* block `half` of the pair's 32 values times an activation block's, as 8 lanes of sums */
static inline void pair_sums(const uint8_t *qs, int half, int offset, const int8_t *q,
                             int32_t sums[8]) {
  for (int k = 0; k < 8; k++) {
    sums[k] = 0;
    for (int e = 4 * k; e < 4 * k + 4; e++)
      sums[k] += ((half ? qs[e] >> 4 : qs[e] & 0x0F) - offset) * q[e];
  }
}
#endif

static inline void pair_q4_0_step(lanes *acc, const pair_q4_0 *w, const act8_0 *a) {
  float f[4];
  pair_scales(w->d, 2, f);
#if GGML_SIMD
  __m256i lo, hi;
  pair_nibbles(w->qs, &lo, &hi);
  const __m256i eight = _mm256_set1_epi8(8);
  *acc = lanes_fma(f[0] * a[0].d,
                   dot_ss8(_mm256_sub_epi8(lo, eight), _mm256_loadu_si256((const __m256i *)a[0].q)),
                   *acc);
  *acc = lanes_fma(f[1] * a[1].d,
                   dot_ss8(_mm256_sub_epi8(hi, eight), _mm256_loadu_si256((const __m256i *)a[1].q)),
                   *acc);
#else
  for (int half = 0; half < 2; half++) {
    int32_t sums[8];
    pair_sums(w->qs, half, 8, a[half].q, sums);
    *acc = lanes_fma(f[half] * a[half].d, sums, *acc);
  }
#endif
}

static inline void pair_q4_1_step(lanes *acc, float *mins, const pair_q4_1 *w,
                                  const act8_1 *a) {
  float f[4]; /* d0 d1 m0 m1 */
  pair_scales(w->d, 4, f);
#if GGML_SIMD
  __m256i lo, hi;
  pair_nibbles(w->qs, &lo, &hi);
  *mins = fmaf(f[2], a[0].s, *mins);
  *acc = lanes_fma(f[0] * a[0].d, dot_us8(lo, _mm256_loadu_si256((const __m256i *)a[0].q)), *acc);
  *mins = fmaf(f[3], a[1].s, *mins);
  *acc = lanes_fma(f[1] * a[1].d, dot_us8(hi, _mm256_loadu_si256((const __m256i *)a[1].q)), *acc);
#else
  for (int half = 0; half < 2; half++) {
    int32_t sums[8];
    *mins = fmaf(f[2 + half], a[half].s, *mins);
    pair_sums(w->qs, half, 0, a[half].q, sums);
    *acc = lanes_fma(f[half] * a[half].d, sums, *acc);
  }
#endif
}

/* Q4_K's eight 6-bit scales and mins (ggml's get_scale_min_k4). */
static inline void scales_mins_k4(const uint8_t *q, int32_t sc[8], int32_t mn[8]) {
  for (int j = 0; j < 8; j++) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}

static inline void block_q4_k(lanes *acc, float accm[4], const blk_q4_k *w, const act8_k *a) {
  const float d = a->d * h2f(w->d);
  const float dmin = -a->d * h2f(w->dmin);
  int32_t sc[8], mn[8];
  scales_mins_k4(w->scales, sc, mn);
  /* the min term: four lanes, lane i = mn[2i] * (sum of q over sub-block 2i) + the next */
  for (int i = 0; i < 4; i++) {
    const int32_t s0 = a->bsums[4 * i] + a->bsums[4 * i + 1];
    const int32_t s1 = a->bsums[4 * i + 2] + a->bsums[4 * i + 3];
    accm[i] = fmaf(dmin, (float)(mn[2 * i] * s0 + mn[2 * i + 1] * s1), accm[i]);
  }
#if GGML_SIMD
  __m256i sumi = _mm256_setzero_si256();
  for (int j = 0; j < 4; j++) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)(w->qs + 32 * j));
    const __m256i lo = _mm256_and_si256(bits, _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), _mm256_set1_epi8(0x0F));
    const __m256i al = _mm256_loadu_si256((const __m256i *)(a->q + 64 * j));
    const __m256i ah = _mm256_loadu_si256((const __m256i *)(a->q + 64 * j + 32));
    const __m256i pl = _mm256_mullo_epi32(dot_us8(lo, al), _mm256_set1_epi32(sc[2 * j]));
    const __m256i ph = _mm256_mullo_epi32(dot_us8(hi, ah), _mm256_set1_epi32(sc[2 * j + 1]));
    sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
  }
  *acc = lanes_fma(d, sumi, *acc);
#else
  int32_t sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int j = 0; j < 4; j++) {
    const uint8_t *qs = w->qs + 32 * j;
    const int8_t *al = a->q + 64 * j, *ah = al + 32;
    for (int k = 0; k < 8; k++) {
      int32_t l = 0, h = 0;
      for (int e = 4 * k; e < 4 * k + 4; e++) {
        l += (qs[e] & 0x0F) * al[e];
        h += (qs[e] >> 4) * ah[e];
      }
      sums[k] += sc[2 * j] * l + sc[2 * j + 1] * h;
    }
  }
  *acc = lanes_fma(d, sums, *acc);
#endif
}

static inline int64_t weight_row_bytes(int wtype, int64_t K) {
  switch (gguf_type(wtype)) {
  case W_Q4_0:
    return (K / 32) * (int64_t)sizeof(blk_q4_0);
  case W_Q4_1:
    return (K / 32) * (int64_t)sizeof(blk_q4_1);
  case W_Q8_0:
    return (K / 32) * (int64_t)sizeof(blk_q8_0);
  case W_Q4_K:
    return (K / 256) * (int64_t)sizeof(blk_q4_k);
  }
  return -1;
}

/* y[r] = row r of w (rows of `wrow` bytes) . a, for r < R (at most ROWS). */
static void dot_rows(int wtype, const uint8_t *w, int64_t wrow, int R, const uint8_t *a,
                     int64_t K, float *y) {
  lanes acc[ROWS];
  float mins[ROWS], accm[ROWS][4];
  for (int r = 0; r < ROWS; r++) {
    acc[r] = lanes_zero();
    mins[r] = accm[r][0] = accm[r][1] = accm[r][2] = accm[r][3] = 0.0f;
  }
#define EACH_ROW(STEP)                                                                         \
  if (R == ROWS) {                                                                             \
    for (int r = 0; r < ROWS; r++) STEP;                                                       \
  } else {                                                                                     \
    for (int r = 0; r < R; r++) STEP;                                                          \
  }
#if GGML_SIMD
  /* the bytes of the rows PREFETCH_ROWS ahead, fetched now: a decode step streams every
   * matrix from memory once, and the hardware prefetcher starts late on each small matrix */
  for (int64_t off = 0; off < ROWS * wrow; off += 64)
    _mm_prefetch((const char *)(w + PREFETCH_ROWS * wrow + off), _MM_HINT_T0);
#endif
  switch (wtype) {
  case W_Q4_0:
    for (int64_t b = 0; b < K / 32; b++)
      EACH_ROW(block_q4_0(&acc[r], (const blk_q4_0 *)(w + r * wrow) + b, (const act8_0 *)a + b));
    for (int r = 0; r < R; r++) y[r] = lanes_sum(acc[r]);
    break;
  case W_Q8_0:
    for (int64_t b = 0; b < K / 32; b++)
      EACH_ROW(block_q8_0(&acc[r], (const blk_q8_0 *)(w + r * wrow) + b, (const act8_0 *)a + b));
    for (int r = 0; r < R; r++) y[r] = lanes_sum(acc[r]);
    break;
  case W_Q4_1:
    for (int64_t b = 0; b < K / 32; b++)
      EACH_ROW(block_q4_1(&acc[r], &mins[r], (const blk_q4_1 *)(w + r * wrow) + b,
                          (const act8_1 *)a + b));
    for (int r = 0; r < R; r++) y[r] = lanes_sum(acc[r]) + mins[r];
    break;
  case W_Q4_0_PAIRS: {
    const int64_t pairs = K / 64;
    for (int64_t b = 0; b < pairs; b++)
      EACH_ROW(pair_q4_0_step(&acc[r], (const pair_q4_0 *)(w + r * wrow) + b,
                              (const act8_0 *)a + 2 * b));
    if ((K / 32) % 2) {
      EACH_ROW(block_q4_0(&acc[r], (const blk_q4_0 *)((const pair_q4_0 *)(w + r * wrow) + pairs),
                          (const act8_0 *)a + 2 * pairs));
    }
    for (int r = 0; r < R; r++) y[r] = lanes_sum(acc[r]);
    break;
  }
  case W_Q4_1_PAIRS: {
    const int64_t pairs = K / 64;
    for (int64_t b = 0; b < pairs; b++)
      EACH_ROW(pair_q4_1_step(&acc[r], &mins[r], (const pair_q4_1 *)(w + r * wrow) + b,
                              (const act8_1 *)a + 2 * b));
    if ((K / 32) % 2) {
      EACH_ROW(block_q4_1(&acc[r], &mins[r],
                          (const blk_q4_1 *)((const pair_q4_1 *)(w + r * wrow) + pairs),
                          (const act8_1 *)a + 2 * pairs));
    }
    for (int r = 0; r < R; r++) y[r] = lanes_sum(acc[r]) + mins[r];
    break;
  }
  default:
    for (int64_t b = 0; b < K / 256; b++)
      EACH_ROW(block_q4_k(&acc[r], accm[r], (const blk_q4_k *)(w + r * wrow) + b,
                          (const act8_k *)a + b));
    for (int r = 0; r < R; r++)
      y[r] = lanes_sum(acc[r]) + ((accm[r][0] + accm[r][2]) + (accm[r][1] + accm[r][3]));
  }
#undef EACH_ROW
}

#define N_TILE 16 /* weight rows kept in cache while every activation row passes */
#define COLS 4    /* activation rows sharing one unpacking of a weight block (prefill) */

#if GGML_SIMD
/* y[c * ystride] = one weight row . activation row c, for c < C (at most COLS): each weight
 * block unpacked once for the C rows. Per output the same operations in the same order as
 * dot_rows (the block_* steps), so the same bits. */
static void dot_cols(int wtype, const uint8_t *w, const uint8_t *a, int64_t arow, int C,
                     int64_t K, float *y, int64_t ystride) {
  lanes acc[COLS];
  float mins[COLS], accm[COLS][4];
  for (int c = 0; c < COLS; c++) {
    acc[c] = lanes_zero();
    mins[c] = accm[c][0] = accm[c][1] = accm[c][2] = accm[c][3] = 0.0f;
  }
  switch (wtype) {
  case W_Q4_0:
    for (int64_t b = 0; b < K / 32; b++) {
      const blk_q4_0 *wb = (const blk_q4_0 *)w + b;
      const float dw = h2f(wb->d);
      const __m256i qw = _mm256_sub_epi8(nibbles_32(wb->qs), _mm256_set1_epi8(8));
      for (int c = 0; c < C; c++) {
        const act8_0 *ab = (const act8_0 *)(a + c * arow) + b;
        acc[c] = lanes_fma(dw * ab->d, dot_ss8(qw, _mm256_loadu_si256((const __m256i *)ab->q)),
                           acc[c]);
      }
    }
    for (int c = 0; c < C; c++) y[c * ystride] = lanes_sum(acc[c]);
    return;
  case W_Q8_0:
    for (int64_t b = 0; b < K / 32; b++) {
      const blk_q8_0 *wb = (const blk_q8_0 *)w + b;
      const float dw = h2f(wb->d);
      const __m256i qw = _mm256_loadu_si256((const __m256i *)wb->qs);
      for (int c = 0; c < C; c++) {
        const act8_0 *ab = (const act8_0 *)(a + c * arow) + b;
        acc[c] = lanes_fma(dw * ab->d, dot_ss8(qw, _mm256_loadu_si256((const __m256i *)ab->q)),
                           acc[c]);
      }
    }
    for (int c = 0; c < C; c++) y[c * ystride] = lanes_sum(acc[c]);
    return;
  case W_Q4_0_PAIRS:
  case W_Q4_1_PAIRS:
    /* per column the blocks in order, each as the GGUF cases below compute it */
    for (int64_t b = 0; b < K / 64; b++) {
      __m256i v[2];
      float f[4];
      if (wtype == W_Q4_0_PAIRS) {
        const pair_q4_0 *wp = (const pair_q4_0 *)w + b;
        pair_scales(wp->d, 2, f);
        pair_nibbles(wp->qs, &v[0], &v[1]);
        for (int half = 0; half < 2; half++) {
          const __m256i qw = _mm256_sub_epi8(v[half], _mm256_set1_epi8(8));
          for (int c = 0; c < C; c++) {
            const act8_0 *ab = (const act8_0 *)(a + c * arow) + 2 * b + half;
            acc[c] = lanes_fma(f[half] * ab->d,
                               dot_ss8(qw, _mm256_loadu_si256((const __m256i *)ab->q)), acc[c]);
          }
        }
      } else {
        const pair_q4_1 *wp = (const pair_q4_1 *)w + b;
        pair_scales(wp->d, 4, f);
        pair_nibbles(wp->qs, &v[0], &v[1]);
        for (int half = 0; half < 2; half++)
          for (int c = 0; c < C; c++) {
            const act8_1 *ab = (const act8_1 *)(a + c * arow) + 2 * b + half;
            mins[c] = fmaf(f[2 + half], ab->s, mins[c]);
            acc[c] = lanes_fma(f[half] * ab->d,
                               dot_us8(v[half], _mm256_loadu_si256((const __m256i *)ab->q)),
                               acc[c]);
          }
      }
    }
    if ((K / 32) % 2) { /* the row's last block, as GGUF stores it */
      const int64_t last = K / 32 - 1;
      for (int c = 0; c < C; c++) {
        if (wtype == W_Q4_0_PAIRS)
          block_q4_0(&acc[c], (const blk_q4_0 *)((const pair_q4_0 *)w + last / 2),
                     (const act8_0 *)(a + c * arow) + last);
        else
          block_q4_1(&acc[c], &mins[c], (const blk_q4_1 *)((const pair_q4_1 *)w + last / 2),
                     (const act8_1 *)(a + c * arow) + last);
      }
    }
    for (int c = 0; c < C; c++)
      y[c * ystride] = wtype == W_Q4_1_PAIRS ? lanes_sum(acc[c]) + mins[c] : lanes_sum(acc[c]);
    return;
  case W_Q4_1:
    for (int64_t b = 0; b < K / 32; b++) {
      const blk_q4_1 *wb = (const blk_q4_1 *)w + b;
      const float dw = h2f(wb->d), mw = h2f(wb->m);
      const __m256i qw = nibbles_32(wb->qs);
      for (int c = 0; c < C; c++) {
        const act8_1 *ab = (const act8_1 *)(a + c * arow) + b;
        mins[c] = fmaf(mw, ab->s, mins[c]);
        acc[c] = lanes_fma(dw * ab->d, dot_us8(qw, _mm256_loadu_si256((const __m256i *)ab->q)),
                           acc[c]);
      }
    }
    for (int c = 0; c < C; c++) y[c * ystride] = lanes_sum(acc[c]) + mins[c];
    return;
  default:
    for (int64_t b = 0; b < K / 256; b++) {
      const blk_q4_k *wb = (const blk_q4_k *)w + b;
      const float dw = h2f(wb->d), dminw = h2f(wb->dmin);
      int32_t sc[8], mn[8];
      scales_mins_k4(wb->scales, sc, mn);
      __m256i lo[4], hi[4];
      for (int j = 0; j < 4; j++) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(wb->qs + 32 * j));
        lo[j] = _mm256_and_si256(bits, _mm256_set1_epi8(0x0F));
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), _mm256_set1_epi8(0x0F));
      }
      for (int c = 0; c < C; c++) {
        const act8_k *ab = (const act8_k *)(a + c * arow) + b;
        const float d = ab->d * dw, dmin = -ab->d * dminw;
        for (int i = 0; i < 4; i++) {
          const int32_t s0 = ab->bsums[4 * i] + ab->bsums[4 * i + 1];
          const int32_t s1 = ab->bsums[4 * i + 2] + ab->bsums[4 * i + 3];
          accm[c][i] = fmaf(dmin, (float)(mn[2 * i] * s0 + mn[2 * i + 1] * s1), accm[c][i]);
        }
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
          const __m256i al = _mm256_loadu_si256((const __m256i *)(ab->q + 64 * j));
          const __m256i ah = _mm256_loadu_si256((const __m256i *)(ab->q + 64 * j + 32));
          const __m256i pl = _mm256_mullo_epi32(dot_us8(lo[j], al), _mm256_set1_epi32(sc[2 * j]));
          const __m256i ph =
              _mm256_mullo_epi32(dot_us8(hi[j], ah), _mm256_set1_epi32(sc[2 * j + 1]));
          sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
        }
        acc[c] = lanes_fma(d, sumi, acc[c]);
      }
    }
    for (int c = 0; c < C; c++)
      y[c * ystride] = lanes_sum(acc[c]) + ((accm[c][0] + accm[c][2]) + (accm[c][1] + accm[c][3]));
  }
}
#endif

/* y[M, N] = x[M, K] . W^T with W [N, K] in GGUF blocks of `wtype`, each output computed as
 * ggml computes it (above). act: scratch of M * ggml_act_row_bytes(wtype, K) bytes, filled
 * here. Rows of W are split among `threads`; the result does not depend on the split. */
void ggml_gemm(int wtype, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
               float *y, uint8_t *act, int threads) {
  const int64_t arow = ggml_act_row_bytes(wtype, K), wrow = weight_row_bytes(wtype, K);
  if (M * K >= 4096 && threads > 1) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t m = 0; m < M; m++) ggml_quantize_rows(wtype, x + m * K, 1, K, act + m * arow);
  } else {
    ggml_quantize_rows(wtype, x, M, K, act);
  }
  const int64_t tiles = (N + N_TILE - 1) / N_TILE;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tiles; t++) {
    const int64_t n0 = t * N_TILE, n1 = n0 + N_TILE < N ? n0 + N_TILE : N;
    float out[ROWS];
    int64_t m = 0;
#if GGML_SIMD
    for (; M > 1 && m + 1 < M; m += COLS) { /* prefill: weight blocks unpacked once per COLS */
      const int C = (int)(M - m < COLS ? M - m : COLS);
      for (int64_t n = n0; n < n1; n++)
        dot_cols(wtype, w + n * wrow, act + m * arow, arow, C, K, y + m * N + n, N);
    }
#endif
    for (; m < M; m++)
      for (int64_t n = n0; n < n1; n += ROWS) {
        const int R = (int)(n1 - n < ROWS ? n1 - n : ROWS);
        dot_rows(wtype, w + n * wrow, wrow, R, act + m * arow, K, out);
        for (int r = 0; r < R; r++) y[m * N + n + r] = out[r];
      }
  }
}

/* --- the float operations in front of the quantizers ------------------------------------
 * Written as scalar C with explicit fmaf, so every build rounds alike: a rounding that
 * differed here could move an activation across a quantization step. */

/* RMSNorm as ggml's rms_norm and mul compute it: the squares (float) summed in double, in
 * order; mean = (float)(sum / dim); y = (x * (1 / sqrtf(mean + eps))) * w. */
void ggml_rms_norm(const float *x, const float *w, int64_t rows, int64_t dim, float eps,
                   float *y) {
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * dim;
    float *yr = y + r * dim;
    double sum = 0.0;
    for (int64_t i = 0; i < dim; i++) sum += (double)(xr[i] * xr[i]);
    const float mean = (float)(sum / (double)dim);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < dim; i++) yr[i] = (xr[i] * scale) * w[i];
  }
}

static inline float from_bits(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}

/* exp(x) by the algorithm of ggml's AVX2 ggml_v_expf (Arm's optimized-routines expf: n =
 * round(x / ln 2) by the 1.5 * 2^23 shift, a degree-5 polynomial in the remainder, scaled by
 * 2^n through the exponent bits; |n| > 126 takes the two-step scaling, |n| > 192 saturates),
 * one lane at a time with the same FMAs. */
static inline __attribute__((always_inline)) float ggml_expf(float x) {
  const float shift = 0x1.8p23f;
  const float z = fmaf(x, 0x1.715476p+0f, shift);
  const float n = z - shift;
  const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
  uint32_t zbits;
  memcpy(&zbits, &z, 4);
  const uint32_t e = zbits << 23;
  const float k = from_bits(e + 0x3F800000u);
  const float u = b * b;
  const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                            fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                       u, 0x1.ffffecp-1f * b);
  if (!(fabsf(n) > 126.0f)) return fmaf(j, k, k);
  const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
  const float s1 = from_bits(g + 0x7F000000u), s2 = from_bits(e - g);
  if (fabsf(n) > 192.0f) return s1 * s1;
  return fmaf(s2, j, s2) * s1;
}

#if GGML_SIMD
/* ggml_expf of eight lanes: each lane the scalar function's operations (the same FMAs, the
 * same bit arithmetic, its two rare branches as blends), so the same bits lane by lane
 * (checked for all 2^32 inputs when written, NaNs as NaNs; test_ggml_mode's SwiGLU test holds
 * the builds to each other on a million drawn bit patterns). */
static inline __m256 ggml_expf8(__m256 x) {
  const __m256 shift = _mm256_set1_ps(0x1.8p23f);
  const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), shift);
  const __m256 n = _mm256_sub_ps(z, shift);
  const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
  const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32(0x3F800000)));
  const __m256 u = _mm256_mul_ps(b, b);
  const __m256 j = _mm256_fmadd_ps(
      _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b,
                                      _mm256_set1_ps(0x1.573e2ep-5f)),
                      u,
                      _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b,
                                      _mm256_set1_ps(0x1.fffdb6p-2f))),
      u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
  const __m256 normal = _mm256_fmadd_ps(j, k, k);
  const __m256 an = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), n); /* fabsf(n) */
  const __m256 big = _mm256_cmp_ps(an, _mm256_set1_ps(126.0f), _CMP_GT_OQ);
  if (_mm256_testz_ps(big, big)) return normal;
  const __m256i g = _mm256_and_si256(
      _mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
      _mm256_set1_epi32((int)0x82000000u));
  const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7F000000)));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
  const __m256 scaled = _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1);
  const __m256 huge = _mm256_cmp_ps(an, _mm256_set1_ps(192.0f), _CMP_GT_OQ);
  const __m256 far = _mm256_blendv_ps(scaled, _mm256_mul_ps(s1, s1), huge);
  return _mm256_blendv_ps(normal, far, big);
}
#endif

/* x[i] = exp(x[i] - max) for i < n (ggml's soft_max: the exponentials of a row's shifted
 * scores), eight at a time where the build has the lanes. */
static void ggml_exp_shifted(float *x, int64_t n, float max) {
  int64_t i = 0;
#if GGML_SIMD
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, ggml_expf8(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(max))));
#endif
  for (; i < n; i++) x[i] = ggml_expf(x[i] - max);
}

/* sums[r] = the n values of row r of x (rows `stride` apart) added in double in order, for
 * r < rows: one addition at a time per row, the rows' chains interleaved (an addition's
 * latency, not its throughput, bounds one row alone). Not ggml's order: its AVX2
 * ggml_vec_soft_max_f32 first adds each 8 exponentials in float (hsum_float_8's order; its
 * AVX-512 builds each 16, _mm512_reduce_add_ps) and adds that float to the double sum, and
 * takes the last n mod 8 exponentials from libm's expf (docs/goldens.md, "Where llama.cpp
 * still differs"). Kept: the ggml goldens were made with this order. */
static void sums_in_double(const float *x, int64_t stride, int64_t rows, int64_t n,
                           double *sums) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    const float *x0 = x + r * stride, *x1 = x0 + stride, *x2 = x1 + stride, *x3 = x2 + stride;
    for (int64_t i = 0; i < n; i++) {
      s0 += (double)x0[i];
      s1 += (double)x1[i];
      s2 += (double)x2[i];
      s3 += (double)x3[i];
    }
    sums[r] = s0, sums[r + 1] = s1, sums[r + 2] = s2, sums[r + 3] = s3;
  }
  if (rows - r == 3) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0;
    const float *x0 = x + r * stride, *x1 = x0 + stride, *x2 = x1 + stride;
    for (int64_t i = 0; i < n; i++) {
      s0 += (double)x0[i];
      s1 += (double)x1[i];
      s2 += (double)x2[i];
    }
    sums[r] = s0, sums[r + 1] = s1, sums[r + 2] = s2;
    return;
  }
  for (; r + 2 <= rows; r += 2) {
    double s0 = 0.0, s1 = 0.0;
    const float *x0 = x + r * stride, *x1 = x0 + stride;
    for (int64_t i = 0; i < n; i++) {
      s0 += (double)x0[i];
      s1 += (double)x1[i];
    }
    sums[r] = s0, sums[r + 1] = s1;
  }
  for (; r < rows; r++) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)x[r * stride + i];
    sums[r] = s;
  }
}

/* SwiGLU as ggml's swiglu computes it: out = (g / (1 + exp(-g))) * up, SiLU by ggml_expf. */
void ggml_swiglu(const float *gate, const float *up, int64_t n, float *out) {
  int64_t i = 0;
#if GGML_SIMD
  for (; i + 8 <= n; i += 8) { /* the same operations lane by lane */
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = ggml_expf8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; i++) {
    const float g = gate[i];
    out[i] = (g / (1.0f + ggml_expf(0.0f - g))) * up[i];
  }
}

/* The same for rows of a fused gate/up product: gu [rows, 2 * hidden] (gate then up). */
void ggml_swiglu_rows(const float *gu, int64_t rows, int64_t hidden, float *out) {
  for (int64_t r = 0; r < rows; r++)
    ggml_swiglu(gu + r * 2 * hidden, gu + r * 2 * hidden + hidden, hidden, out + r * hidden);
}

/* --- attention ----------------------------------------------------------------------------
 * Grouped-query attention after ggml's (llama.cpp without flash attention, float32 caches):
 * scores q . k_j over eight lanes (one FMA per value, lanes summed as above), times `scale`;
 * softmax: the maximum, exp(s - max) by ggml_expf, their sum in double, each probability
 * times (float)(1 / sum), as ggml's soft_max, except the sum's order and the last n mod 8
 * exponentials (sums_in_double says how; the factor differed in 677 of 2,000 rows measured);
 * out = sum_j p_j v_j, one FMA per j in order.
 * The same bits on every build and thread count, for prefill and decode alike: torch's SDPA,
 * whose order depends on the CPU's kernel level, would let an 8-bit quantization downstream
 * flip on one machine and not another. */

#define ATTN_VECTORS 16 /* head dims up to 128 keep the output row in registers */
#define KEY_TILE 64       /* keys whose K (then V) rows stay in L1 while a group's heads read them */
#define ATTN_SCORES 65536 /* scores of a group's heads kept per thread (256 KiB of stack) */
#define ATTN_GROUP_MAX 64 /* query heads per KV head handled together, at most */

static float dot_lanes(const float *a, const float *b, int64_t n) {
  float lane[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; k++) lane[k] = fmaf(a[i + k], b[i + k], lane[k]);
  for (int k = 0; i < n; i++, k++) lane[k] = fmaf(a[i], b[i], lane[k]);
  return sum8(lane);
}

#if GGML_SIMD
/* dot_lanes of `a` against four rows of b (`stride` floats apart) at once, n a multiple of 8:
 * each row's lanes and their sum exactly as dot_lanes computes them (lane k the FMAs of values
 * k, k + 8, ... in order; one vector FMA is eight lanes' fmaf), in four independent chains, so
 * a key's score waits on the FMA latency once for four keys instead of once per key. */
static inline __m128 dot_lanes4(const float *a, const float *b, int64_t stride, int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(a + i);
    for (int r = 0; r < 4; r++)
      acc[r] = _mm256_fmadd_ps(x, _mm256_loadu_ps(b + r * stride + i), acc[r]);
  }
  /* sum8 of the four rows side by side: the halves added (lane k + lane k + 4), the 4 x 4
   * transposed, then (r0 + r2) + (r1 + r3) lane by lane */
  __m128 h[4];
  for (int r = 0; r < 4; r++)
    h[r] = _mm_add_ps(_mm256_extractf128_ps(acc[r], 1), _mm256_castps256_ps128(acc[r]));
  _MM_TRANSPOSE4_PS(h[0], h[1], h[2], h[3]);
  return _mm_add_ps(_mm_add_ps(h[0], h[2]), _mm_add_ps(h[1], h[3]));
}

#if defined(__AVX512F__)
/* weigh_values for `heads` heads of one KV group at once (scores rows `stride` apart, output
 * rows of 16 nz floats side by side): each V row loaded once for them, their outputs' heads x
 * nz vectors of sixteen lanes held over the keys, which keeps enough FMAs in flight; per value
 * the same FMA in the same order as one head alone. */
static inline __attribute__((always_inline)) void weigh_values_heads(
    const float *p, int64_t stride, const float *inv, const float *V, int64_t j0, int64_t j1,
    float *o, const int nz, const int heads) {
  __m512 acc[3][8];
  for (int g = 0; g < heads; g++)
    for (int v = 0; v < nz; v++) acc[g][v] = _mm512_loadu_ps(o + g * 16 * nz + 16 * v);
  for (int64_t j = j0; j < j1; j++) {
    __m512 vj[8];
    for (int v = 0; v < nz; v++) vj[v] = _mm512_loadu_ps(V + j * 16 * nz + 16 * v);
    for (int g = 0; g < heads; g++) {
      const __m512 pj = _mm512_set1_ps(p[g * stride + j] * inv[g]);
      for (int v = 0; v < nz; v++) acc[g][v] = _mm512_fmadd_ps(pj, vj[v], acc[g][v]);
    }
  }
  for (int g = 0; g < heads; g++)
    for (int v = 0; v < nz; v++) _mm512_storeu_ps(o + g * 16 * nz + 16 * v, acc[g][v]);
}
#endif

/* o[:8 nv] += sum over keys j0 <= j < j1 of (p[j] * inv) V[j] (rows of 8 nv floats), o's
 * vectors held in registers over the keys: one FMA per value, in order. */
static inline __attribute__((always_inline)) void weigh_values(const float *p, float inv,
                                                                const float *V, int64_t j0,
                                                                int64_t j1, float *o,
                                                                const int64_t nv) {
#if defined(__AVX512F__)
  if (nv % 2 == 0) { /* sixteen lanes a vector: the same FMA per value */
    __m512 acc[ATTN_VECTORS / 2];
    for (int64_t v = 0; v < nv / 2; v++) acc[v] = _mm512_loadu_ps(o + 16 * v);
    for (int64_t j = j0; j < j1; j++) {
      const __m512 pj = _mm512_set1_ps(p[j] * inv);
      const float *vj = V + j * 8 * nv;
      for (int64_t v = 0; v < nv / 2; v++)
        acc[v] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vj + 16 * v), acc[v]);
    }
    for (int64_t v = 0; v < nv / 2; v++) _mm512_storeu_ps(o + 16 * v, acc[v]);
    return;
  }
#endif
  __m256 acc[ATTN_VECTORS];
  for (int64_t v = 0; v < nv; v++) acc[v] = _mm256_loadu_ps(o + 8 * v);
  for (int64_t j = j0; j < j1; j++) {
    const __m256 pj = _mm256_set1_ps(p[j] * inv);
    const float *vj = V + j * 8 * nv;
    for (int64_t v = 0; v < nv; v++)
      acc[v] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * v), acc[v]);
  }
  for (int64_t v = 0; v < nv; v++) _mm256_storeu_ps(o + 8 * v, acc[v]);
}
#endif

/* qkv [seq, n_heads + 2 n_kv, hd]: the fused q/k/v product of positions start .. start +
 * seq - 1, unrotated; cos, sin [seq, hd] their rope rows. The q and k heads are rotated in
 * place as ggml's rope rotates a pair (x0, x1) (the icelake build disassembles to
 * vfmsub231ss / vfmadd132ss): x0' = fma(x0, cos, -(x1 sin)), x1' = fma(x0, sin, x1 cos), the
 * pair being (x_i, x_{i+hd/2}) in this engine's row order; k and v are written to the caches
 * [n_kv, max_seq, hd] (batch row 0), then every query attends over positions 0 .. its own;
 * out [seq, n_heads * hd]. */
void ggml_attention(float *qkv, int64_t seq, const float *cos, const float *sin,
                    float *cache_k, float *cache_v, int64_t n_heads, int64_t n_kv, int64_t hd,
                    int64_t max_seq, int64_t start, float scale, float *out, int threads) {
  const int64_t width = (n_heads + 2 * n_kv) * hd, half = hd / 2;
  for (int64_t i = 0; i < seq; i++) {
    float *row = qkv + i * width;
    const float *c = cos + i * hd, *sn = sin + i * hd;
    for (int64_t h = 0; h < n_heads + n_kv; h++) {
      float *x = row + h * hd;
      for (int64_t d = 0; d < half; d++) {
        const float a = x[d], b = x[d + half];
        x[d] = fmaf(a, c[d], -(b * sn[d]));
        x[d + half] = fmaf(a, sn[d + half], b * c[d + half]);
      }
    }
    for (int64_t j = 0; j < n_kv; j++) {
      const int64_t slot = (j * max_seq + start + i) * hd;
      memcpy(cache_k + slot, row + (n_heads + j) * hd, (size_t)hd * 4);
      memcpy(cache_v + slot, row + (n_heads + n_kv + j) * hd, (size_t)hd * 4);
    }
  }
  const int64_t group = n_heads / n_kv, units = seq * n_kv, ctx = start + seq;
  /* The heads of a KV group (which read the same keys and values) go through each tile of
   * KEY_TILE keys together, so a tile's K and V rows are fetched from L2 once for the group,
   * not once per head; at most ATTN_SCORES scores per thread on the stack (one head at a time
   * beyond, as before). Each score, sum and output element is computed by the same operations
   * in the same order as one head alone: only the loops are interleaved. */
  int64_t together = group < ATTN_GROUP_MAX ? group : ATTN_GROUP_MAX;
  while (together > 1 && together * ctx > ATTN_SCORES) together--;
#pragma omp parallel num_threads(threads)
  {
    float *scores = (float *)__builtin_alloca(sizeof(float) * (size_t)(together * ctx));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < units; t++) {
      const int64_t i = t / n_kv, kv = t % n_kv, n = start + i + 1;
      const float *K = cache_k + kv * max_seq * hd, *V = cache_v + kv * max_seq * hd;
      for (int64_t h0 = kv * group; h0 < (kv + 1) * group; h0 += together) {
        const int64_t heads = (kv + 1) * group - h0 < together ? (kv + 1) * group - h0 : together;
        float max[ATTN_GROUP_MAX], inv[ATTN_GROUP_MAX];
        for (int64_t g = 0; g < heads; g++) max[g] = -INFINITY;
        for (int64_t j0 = 0; j0 < n; j0 += KEY_TILE) {
          const int64_t j1 = j0 + KEY_TILE < n ? j0 + KEY_TILE : n;
          for (int64_t g = 0; g < heads; g++) {
            const float *qh = qkv + i * width + (h0 + g) * hd;
            float *p = scores + g * ctx;
            int64_t j = j0;
#if GGML_SIMD
            if (hd % 8 == 0)
              for (; j + 4 <= j1; j += 4) {
                _mm_storeu_ps(p + j, _mm_mul_ps(dot_lanes4(qh, K + j * hd, hd, hd),
                                                _mm_set1_ps(scale)));
                for (int r = 0; r < 4; r++) max[g] = p[j + r] > max[g] ? p[j + r] : max[g];
              }
#endif
            for (; j < j1; j++) {
              p[j] = dot_lanes(qh, K + j * hd, hd) * scale;
              max[g] = p[j] > max[g] ? p[j] : max[g];
            }
          }
        }
        double sums[ATTN_GROUP_MAX];
        for (int64_t g = 0; g < heads; g++) ggml_exp_shifted(scores + g * ctx, n, max[g]);
        sums_in_double(scores, ctx, heads, n, sums);
        for (int64_t g = 0; g < heads; g++) {
          inv[g] = (float)(1.0 / sums[g]);
          float *o = out + i * n_heads * hd + (h0 + g) * hd;
          for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
        }
#if GGML_SIMD
        if (hd % 8 == 0 && hd <= 8 * ATTN_VECTORS) {
          /* a head's output vectors in registers over a tile's keys (kept in `out` between
           * tiles): the same FMA per value, in order */
          const int64_t nv = hd / 8;
          for (int64_t j0 = 0; j0 < n; j0 += KEY_TILE) {
            const int64_t j1 = j0 + KEY_TILE < n ? j0 + KEY_TILE : n;
            int64_t g = 0;
#if defined(__AVX512F__)
            /* head_dim 64: three heads at a time; 128: two */
            float *row = out + i * n_heads * hd + h0 * hd;
            if (hd == 64)
              for (; g < heads; g += 3) {
                const int k = heads - g < 3 ? (int)(heads - g) : 3;
                const float *p = scores + g * ctx;
                if (k == 3)
                  weigh_values_heads(p, ctx, inv + g, V, j0, j1, row + g * hd, 4, 3);
                else if (k == 2)
                  weigh_values_heads(p, ctx, inv + g, V, j0, j1, row + g * hd, 4, 2);
                else
                  weigh_values_heads(p, ctx, inv + g, V, j0, j1, row + g * hd, 4, 1);
              }
            else if (hd == 128)
              for (; g < heads; g += 2) {
                const float *p = scores + g * ctx;
                if (heads - g >= 2)
                  weigh_values_heads(p, ctx, inv + g, V, j0, j1, row + g * hd, 8, 2);
                else
                  weigh_values_heads(p, ctx, inv + g, V, j0, j1, row + g * hd, 8, 1);
              }
#endif
            for (; g < heads; g++) {
              const float *p = scores + g * ctx;
              float *o = out + i * n_heads * hd + (h0 + g) * hd;
              if (nv == 8) /* head_dim 64 (SmolLM2) and 128 (Llama 3): loops the compiler unrolls */
                weigh_values(p, inv[g], V, j0, j1, o, 8);
              else if (nv == 16)
                weigh_values(p, inv[g], V, j0, j1, o, 16);
              else
                weigh_values(p, inv[g], V, j0, j1, o, nv);
            }
          }
          continue;
        }
#endif
        for (int64_t g = 0; g < heads; g++) {
          const float *p = scores + g * ctx;
          float *o = out + i * n_heads * hd + (h0 + g) * hd;
          for (int64_t j = 0; j < n; j++) {
            const float pj = p[j] * inv[g];
            const float *vj = V + j * hd;
            for (int64_t d = 0; d < hd; d++) o[d] = fmaf(pj, vj[d], o[d]);
          }
        }
      }
    }
  }
}

/* --- the rope tables, the same bits from every compiler and libm ---------------------------
 * cos, sin and pow without libm's cosf, sinf and powf (whose last bit is each libm's own):
 * double-precision range reduction and Taylor polynomials in +, -, * and / only (-std=c11:
 * nothing is contracted into an FMA), rounded once to float. Each double result is within a
 * few double ulps of the exact value, so its float rounding is the correctly rounded float
 * unless the exact value lies within about 1e-15 (relative) of a tie between two floats; the
 * tables' test (test_ggml_mode.py) holds every entry of the checkpoints' tables to the
 * correctly rounded one. glibc's cosf and sinf, which llama.cpp calls, round about 1% of the
 * entries the other way, by 1 ulp: measured against llama-server in test_llama_cpp. */

/* pi / 2 in three parts of 26, 26 and 53 bits (k * ROPE_PIO2_1 and k * ROPE_PIO2_2 exact for
 * k < 2^27), and ln 2 in two (n * ROPE_LN2_HI exact for n < 2^21). */
static const double ROPE_PIO2_1 = 0x1.921fb5p+0, ROPE_PIO2_2 = 0x1.110b46p-26,
                    ROPE_PIO2_3 = 0x1.1a62633145c07p-54, ROPE_TWO_OVER_PI = 0x1.45f306dc9c883p-1;
static const double ROPE_LN2_HI = 0x1.62e42feep-1, ROPE_LN2_LO = 0x1.a39ef35793c76p-33;

/* Taylor coefficients after the first term: sin's of r^3 .. r^17 and cos's of r^2 .. r^18
 * (constants folded by the compiler: one IEEE division each). */
static const double ROPE_SIN[8] = {-1.0 / 6.0,       1.0 / 120.0,          -1.0 / 5040.0,
                                   1.0 / 362880.0,   -1.0 / 39916800.0,    1.0 / 6227020800.0,
                                   -1.0 / 1307674368000.0, 1.0 / 355687428096000.0};
static const double ROPE_COS[9] = {-1.0 / 2.0,           1.0 / 24.0,           -1.0 / 720.0,
                                   1.0 / 40320.0,        -1.0 / 3628800.0,     1.0 / 479001600.0,
                                   -1.0 / 87178291200.0, 1.0 / 20922789888000.0,
                                   -1.0 / 6402373705728000.0};

/* c[0] + x (c[1] + x (... + x c[n - 1])), innermost first. */
static double rope_horner(const double *c, int n, double x) {
  double p = c[n - 1];
  for (int j = n - 2; j >= 0; j--) p = c[j] + x * p;
  return p;
}

/* The largest angle the reduction is exact for (k < 2^26): 2^26 rad, far beyond any position. */
#define ROPE_MAX_ANGLE 67108864.0

/* sin and cos of x (|x| < ROPE_MAX_ANGLE): x = k pi/2 + r, |r| <= pi/4 (x - k * PIO2_1 is exact,
 * Sterbenz), then Taylor series to r^17 and r^18 (the next terms are below 1e-19). */
static void rope_sin_cos(double x, double *sin_out, double *cos_out) {
  const int negative = x < 0;
  const double ax = negative ? -x : x;
  const int64_t k = (int64_t)(ax * ROPE_TWO_OVER_PI + 0.5);
  const double kd = (double)k;
  const double r = ((ax - kd * ROPE_PIO2_1) - kd * ROPE_PIO2_2) - kd * ROPE_PIO2_3;
  const double r2 = r * r;
  const double s = r + r * r2 * rope_horner(ROPE_SIN, 8, r2);
  const double c = 1.0 + r2 * rope_horner(ROPE_COS, 9, r2);
  double sx, cx;
  switch (k & 3) {
    case 0: sx = s, cx = c; break;
    case 1: sx = c, cx = -s; break;
    case 2: sx = -s, cx = -c; break;
    default: sx = -c, cx = s; break;
  }
  *sin_out = negative ? -sx : sx;
  *cos_out = cx;
}

/* base^e for base > 0 (a normal float) and |e * ln base| < 700: exp(e * log(base)). log: base =
 * m 2^n with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172,
 * to s^25; exp: y = n ln 2 + r, |r| <= ln 2 / 2, Taylor to r^17, times 2^n (exact). */
static double rope_pow(double base, double e) {
  int n = 0;
  double m = base;
  while (m >= 1.4142135623730951) m *= 0.5, n++; /* powers of two: exact */
  while (m < 0.7071067811865476) m *= 2.0, n--;
  const double s = (m - 1.0) / (m + 1.0), s2 = s * s;
  double series = 1.0 / 25.0;
  for (int j = 23; j >= 1; j -= 2) series = 1.0 / (double)j + s2 * series;
  const double log_base = (double)n * ROPE_LN2_HI + ((double)n * ROPE_LN2_LO + 2.0 * s * series);
  const double y = e * log_base;
  const double ny = (double)(int64_t)(y / (ROPE_LN2_HI + ROPE_LN2_LO) + (y < 0 ? -0.5 : 0.5));
  const double r = (y - ny * ROPE_LN2_HI) - ny * ROPE_LN2_LO;
  double poly = 1.0;
  for (int j = 17; j >= 1; j--) poly = 1.0 + r * poly / (double)j;
  int64_t shift = (int64_t)ny;
  double scale = 1.0;
  for (; shift > 0; shift--) scale *= 2.0;
  for (; shift < 0; shift++) scale *= 0.5;
  return poly * scale;
}

float ggml_rope_pow(float base, float e) { return (float)rope_pow((double)base, (double)e); }

void ggml_rope_sin_cos(const float *angles, int64_t n, float *sin_out, float *cos_out) {
  for (int64_t i = 0; i < n; i++) {
    double s, c;
    rope_sin_cos((double)angles[i], &s, &c);
    sin_out[i] = (float)s;
    cos_out[i] = (float)c;
  }
}

/* The rope tables as ggml's rope computes its angles: theta_scale = base^(-2 / hd), the angle
 * of pair i at position p is p * theta_scale^i multiplied up in float32 (divided by
 * freq_factors[i], the rope_freqs tensor, when given), then cos and sin of the float angle,
 * correctly rounded (above). Written in this engine's "rotate half" layout: cos, sin
 * [positions, hd], entries i and i + hd/2 alike. Returns -1 (nothing written) when an angle
 * would be negative, not finite or beyond ROPE_MAX_ANGLE, else 0. */
int ggml_rope_tables(int64_t positions, int64_t hd, float base, const float *freq_factors,
                     float *cos_out, float *sin_out) {
  const int64_t half = hd / 2;
  const float theta_scale = ggml_rope_pow(base, -2.0f / (float)hd);
  /* float products and quotients by positive numbers are monotonic: the last position holds
   * every pair's largest angle */
  float last = (float)(positions - 1);
  for (int64_t i = 0; positions > 0 && i < half; i++) {
    const float angle = freq_factors ? last / freq_factors[i] : last;
    if (!(angle >= 0.0f && angle < ROPE_MAX_ANGLE)) return -1;
    last *= theta_scale;
  }
  for (int64_t p = 0; p < positions; p++) {
    float theta = (float)p;
    for (int64_t i = 0; i < half; i++) {
      const float angle = freq_factors ? theta / freq_factors[i] : theta;
      double s, c;
      rope_sin_cos((double)angle, &s, &c);
      cos_out[p * hd + i] = cos_out[p * hd + i + half] = (float)c;
      sin_out[p * hd + i] = sin_out[p * hd + i + half] = (float)s;
      theta *= theta_scale;
    }
  }
  return 0;
}

/* --- one decode step through every layer ---------------------------------------------------
 * What the mode's modules compute for one new position of one sequence (GgmlRMSNorm,
 * GgmlAttention, GgmlFeedForward, the residual adds), the same functions in the same order,
 * so the same bits, in one call instead of about ten Python-level calls per layer. */

typedef struct {
  const float *attn_norm, *ffn_norm;  /* [dim] */
  const uint8_t *wqkv, *wo, *w13, *w2; /* GGUF blocks, rows in the engine's order */
  int32_t tqkv, to, t13, t2;           /* their weight codes */
  float *cache_k, *cache_v;            /* [n_kv, max_seq, hd] */
} ggml_layer;

int64_t ggml_layer_bytes(void) { return (int64_t)sizeof(ggml_layer); }

/* Where each row's attention reads and writes: one sequence's contiguous caches (the table's,
 * position `pos`; one thread), or the paged caches k, v ([layers, slots, n_kv, hd],
 * layer_floats = slots * n_kv * hd apart), row r over slots[starts[r] .. starts[r + 1]), its
 * own position the last. */
typedef struct {
  int64_t pos, max_seq;
  const int64_t *slots, *starts, *write;
  const uint8_t *fresh;
  float *k, *v;
  int64_t layer_floats, attention_work;
} ggml_context;

static int decode_rows(const ggml_layer *layers, int64_t n_layers, float *h, int64_t rows,
                       int64_t dim, int64_t n_heads, int64_t n_kv, int64_t hd, int64_t ffn,
                       const ggml_context *c, const float *cos, const float *sin, float eps,
                       float scale, int threads) {
  const int64_t width = (n_heads + 2 * n_kv) * hd, attn = n_heads * hd, kv_row = n_kv * hd;
  int64_t widest = dim > attn ? dim : attn, context = 0;
  widest = widest > ffn ? widest : ffn;
  for (int64_t r = 0; c->slots && r < rows; r++)
    if (c->starts[r + 1] - c->starts[r] > context) context = c->starts[r + 1] - c->starts[r];
  const int64_t floats = rows * (dim + width + attn + 3 * ffn + dim) + 2 * context * kv_row;
  float *x = (float *)malloc(sizeof(float) * (size_t)floats);
  uint8_t *act = (uint8_t *)malloc((size_t)(rows * (2 * widest + 1024)));
  if (!x || !act) {
    free(x);
    free(act);
    return -1;
  }
  float *qkv = x + rows * dim, *att = qkv + rows * width, *gu = att + rows * attn;
  float *s = gu + rows * 2 * ffn, *y = s + rows * ffn, *keys = y + rows * dim;
  float *values = keys + context * kv_row;
  for (int64_t l = 0; l < n_layers; l++) {
    const ggml_layer *L = &layers[l];
    ggml_rms_norm(h, L->attn_norm, rows, dim, eps, x);
    ggml_gemm(L->tqkv, x, rows, dim, L->wqkv, width, qkv, act, threads);
    for (int64_t r = 0; r < rows; r++) {
      if (!c->slots) {
        const int workers = (c->pos + 1) * n_heads * hd >= c->attention_work ? threads : 1;
        ggml_attention(qkv, 1, cos, sin, L->cache_k, L->cache_v, n_heads, n_kv, hd, c->max_seq,
                       c->pos, scale, att, workers);
        continue;
      }
      /* the context's keys and values, [slots, n_kv, hd] -> [n_kv, n, hd] */
      const int64_t n = c->starts[r + 1] - c->starts[r], past = n - 1;
      const int64_t *ctx = c->slots + c->starts[r];
      float *lk = c->k + l * c->layer_floats, *lv = c->v + l * c->layer_floats;
      for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < n_kv; g++) {
          memcpy(keys + (g * n + t) * hd, lk + ctx[t] * kv_row + g * hd, (size_t)hd * 4);
          memcpy(values + (g * n + t) * hd, lv + ctx[t] * kv_row + g * hd, (size_t)hd * 4);
        }
      const int workers = n * n_heads * hd >= c->attention_work ? threads : 1;
      ggml_attention(qkv + r * width, 1, cos + r * hd, sin + r * hd, keys, values, n_heads, n_kv,
                     hd, n, past, scale, att + r * attn, workers);
      if (!c->fresh[r]) continue;
      for (int64_t g = 0; g < n_kv; g++) {
        memcpy(lk + c->write[r] * kv_row + g * hd, keys + (g * n + past) * hd, (size_t)hd * 4);
        memcpy(lv + c->write[r] * kv_row + g * hd, values + (g * n + past) * hd, (size_t)hd * 4);
      }
    }
    ggml_gemm(L->to, att, rows, attn, L->wo, dim, y, act, threads);
    for (int64_t i = 0; i < rows * dim; i++) h[i] = h[i] + y[i];
    ggml_rms_norm(h, L->ffn_norm, rows, dim, eps, x);
    ggml_gemm(L->t13, x, rows, dim, L->w13, 2 * ffn, gu, act, threads);
    ggml_swiglu_rows(gu, rows, ffn, s);
    ggml_gemm(L->t2, s, rows, ffn, L->w2, dim, y, act, threads);
    for (int64_t i = 0; i < rows * dim; i++) h[i] = h[i] + y[i];
  }
  free(x);
  free(act);
  return 0;
}

/* One sequence's decode step: h [dim] in place, the residual stream after every layer; cos,
 * sin: the rows of `pos`. threads: per product. Returns -1 (h untouched) when its scratch
 * cannot be allocated, else 0. */
int ggml_decode_layers(const ggml_layer *layers, int64_t n_layers, float *h, int64_t dim,
                       int64_t n_heads, int64_t n_kv, int64_t hd, int64_t ffn, int64_t max_seq,
                       int64_t pos, const float *cos, const float *sin, float eps, float scale,
                       int threads, int64_t attention_work) {
  const ggml_context c = {pos, max_seq, NULL, NULL, NULL, NULL, NULL, NULL, 0, attention_work};
  return decode_rows(layers, n_layers, h, 1, dim, n_heads, n_kv, hd, ffn, &c, cos, sin, eps,
                     scale, threads);
}

/* A serving step of decode rows only (one new position each), as GgmlAttention.forward_paged
 * and the mode's modules compute it, the same functions in the same order, so the same bits:
 * h [rows, dim] in place. Row r's context is slots[starts[r] .. starts[r + 1]) of the paged
 * caches: its keys and values gathered into a contiguous cache, the row through
 * ggml_attention there (which rotates it and writes its keys and values at the last
 * position), those copied to slot write[r] where fresh[r]. Threads: every product; the
 * attention from `attention_work` score x value multiply-adds. Returns -1 (h untouched) when
 * its scratch cannot be allocated, else 0. */
int ggml_decode_paged(const ggml_layer *layers, int64_t n_layers, float *h, int64_t rows,
                      int64_t dim, int64_t n_heads, int64_t n_kv, int64_t hd, int64_t ffn,
                      const int64_t *slots, const int64_t *starts, const int64_t *write,
                      const uint8_t *fresh, float *k, float *v, int64_t layer_floats,
                      const float *cos, const float *sin, float eps, float scale, int threads,
                      int64_t attention_work) {
  const ggml_context c = {0, 0, slots, starts, write, fresh, k, v, layer_floats, attention_work};
  return decode_rows(layers, n_layers, h, rows, dim, n_heads, n_kv, hd, ffn, &c, cos, sin, eps,
                     scale, threads);
}
