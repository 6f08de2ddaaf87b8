/* float16 bits -> float32, exactly (every float16 is a float32): shared by packed_gemm.c's
 * packers and ggml_dot.c's plain-C block reads. */
#ifndef LLAMA_GOLDENS_HALF_H
#define LLAMA_GOLDENS_HALF_H

#include <stdint.h>
#include <string.h>

static inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000u | (mantissa << 13); /* infinity, NaN */
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else { /* subnormal: value = mantissa * 2^-24, exact in float32 */
    float value = (float)mantissa * 5.9604644775390625e-8f;
    memcpy(&bits, &value, 4);
    bits |= sign;
  }
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

#endif
