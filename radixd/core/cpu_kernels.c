/* Decode attention over the KV pool on the CPU: one query token per request, its keys and
 * values read where they lie (the slots its table row names), no copy, no padding.
 *
 * q, out  [B, Hq, D]         the requests' queries and the result, in the pool's dtype
 * k, v    [S, Hkv, D]        one layer's pool buffers (contiguous)
 * slots   [B, L] int64       request b's slots at positions 0 .. lens[b]-1 (row stride L)
 * lens    [B] int64
 * scratch float [G * L]      the scores of one (request, KV head)
 *
 * Query head h reads KV head h / G (G = Hq / Hkv). The loops run KV head by KV head, request
 * by request: a prefix several requests share is read from the cache after the first. Two
 * passes over a request's slots: scores (q.k, the G query heads of a KV head at once), then
 * softmax and the weighted sum of values, accumulated in float32. Compiled with
 * -O3 -ffast-math -fopenmp-simd (vectorized loops and expf): every score is finite, and the
 * maximum starts at -FLT_MAX, never at an infinity. One thread: the caller picks the parallelism.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 16
#define MAX_D 256

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One (request, KV head): G query heads over n keys. Inlined with constant G and D where
 * the dispatcher knows them, so the loops unroll and the accumulators stay in registers. */
#define DEFINE_ONE(NAME, T, LOAD, STORE)                                                         \
static inline __attribute__((always_inline)) void NAME(                                          \
        const T *q, const T *k, const T *v, const int64_t *row, int64_t n, T *out,               \
        int64_t Hkv, int64_t h, float scale, float *scratch, const int64_t G, const int64_t D) { \
    float qf[MAX_G][MAX_D], acc[MAX_G][MAX_D], top[MAX_G], sum[MAX_G];                           \
    for (int64_t g = 0; g < G; g++) {                                                            \
        _Pragma("omp simd")                                                                      \
        for (int64_t d = 0; d < D; d++) { qf[g][d] = LOAD(q[g * D + d]) * scale; acc[g][d] = 0.f; } \
        top[g] = -FLT_MAX;                                                                       \
    }                                                                                            \
    for (int64_t j = 0; j < n; j++) {                                                            \
        const T *kr = k + (row[j] * Hkv + h) * D;                                                \
        float kf[MAX_D];                                                                         \
        _Pragma("omp simd")                                                                      \
        for (int64_t d = 0; d < D; d++) kf[d] = LOAD(kr[d]);                                     \
        for (int64_t g = 0; g < G; g++) {                                                        \
            float s = 0.f;                                                                       \
            _Pragma("omp simd reduction(+:s)")                                                   \
            for (int64_t d = 0; d < D; d++) s += qf[g][d] * kf[d];                               \
            scratch[g * n + j] = s;                                                              \
            top[g] = s > top[g] ? s : top[g];                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int64_t g = 0; g < G; g++) {                                                            \
        float *sc = scratch + g * n, t = top[g], z = 0.f;                                        \
        _Pragma("omp simd reduction(+:z)")                                                       \
        for (int64_t j = 0; j < n; j++) { sc[j] = expf(sc[j] - t); z += sc[j]; }                 \
        sum[g] = z;                                                                              \
    }                                                                                            \
    for (int64_t j = 0; j < n; j++) {                                                            \
        const T *vr = v + (row[j] * Hkv + h) * D;                                                \
        float vf[MAX_D];                                                                         \
        _Pragma("omp simd")                                                                      \
        for (int64_t d = 0; d < D; d++) vf[d] = LOAD(vr[d]);                                     \
        for (int64_t g = 0; g < G; g++) {                                                        \
            const float p = scratch[g * n + j];                                                  \
            _Pragma("omp simd")                                                                  \
            for (int64_t d = 0; d < D; d++) acc[g][d] += p * vf[d];                              \
        }                                                                                        \
    }                                                                                            \
    for (int64_t g = 0; g < G; g++) {                                                            \
        const float inv = 1.f / sum[g];                                                          \
        for (int64_t d = 0; d < D; d++) out[g * D + d] = STORE(acc[g][d] * inv);                 \
    }                                                                                            \
}

#define CASE(ONE, GG, DD) case GG * 1000 + DD: ONE(qb, k, v, row, n, ob, Hkv, h, scale, scratch, GG, DD); break;

#define DEFINE_DECODE(NAME, ONE, T)                                                              \
int NAME(const T *q, const T *k, const T *v, const int64_t *slots, const int64_t *lens,          \
         T *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t L, float scale,          \
         float *scratch) {                                                                       \
    const int64_t G = Hq / Hkv;                                                                  \
    if (G > MAX_G || D > MAX_D || G * Hkv != Hq) return -1;                                      \
    for (int64_t b = 0; b < B; b++) {                                                            \
        for (int64_t h = 0; h < Hkv; h++) {                                                      \
            const int64_t n = lens[b], *row = slots + b * L;                                     \
            const T *qb = q + (b * Hq + h * G) * D;                                              \
            T *ob = out + (b * Hq + h * G) * D;                                                  \
            switch (G * 1000 + D) {                                                              \
                CASE(ONE, 1, 64) CASE(ONE, 2, 64) CASE(ONE, 3, 64) CASE(ONE, 4, 64)              \
                CASE(ONE, 5, 64) CASE(ONE, 6, 64) CASE(ONE, 7, 64) CASE(ONE, 8, 64)              \
                CASE(ONE, 1, 128) CASE(ONE, 2, 128) CASE(ONE, 4, 128) CASE(ONE, 8, 128)          \
                default: ONE(qb, k, v, row, n, ob, Hkv, h, scale, scratch, G, D);                \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    return 0;                                                                                    \
}

#define IDENT(x) (x)
DEFINE_ONE(one_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ONE(one_f32, float, IDENT, IDENT)
DEFINE_DECODE(decode_bf16, one_bf16, uint16_t)
DEFINE_DECODE(decode_f32, one_f32, float)

/* An int4 weight in torch's CPU packing (aten._convert_weight_to_int4pack_for_cpu) dequantized
 * to bf16 and transposed, out [K, N] (W.T: x @ out is x @ W.T), for the matmuls of many rows,
 * where a bf16 GEMM beats the int4 kernel.
 *
 * p   [N / 64, K, 32] bytes: byte j of (block, k) holds rows block*64 + j (low nibble) and
 *     block*64 + 32 + j (high nibble) at column k (checked at run time by the caller);
 * sz  [K / group, N, 2] bf16: scale and zero, w = (q - 8) * scale + zero.
 * Each (block, k) is 32 bytes in and 64 values out, both contiguous.
 */
void int4pack_to_bf16_t(const uint8_t *p, const uint16_t *sz, uint16_t *out, int64_t N, int64_t K,
                        int64_t group) {
    for (int64_t nb = 0; nb < N / 64; nb++) {
        for (int64_t k = 0; k < K; k++) {
            const uint8_t *in = p + (nb * K + k) * 32;
            const uint16_t *sc = sz + ((k / group) * N + nb * 64) * 2;
            uint16_t *o = out + k * N + nb * 64;
            _Pragma("omp simd")
            for (int64_t j = 0; j < 32; j++) {
                o[j] = f32_to_bf16((float)((in[j] & 15) - 8) * bf16_to_f32(sc[2 * j]) + bf16_to_f32(sc[2 * j + 1]));
                o[j + 32] = f32_to_bf16((float)((in[j] >> 4) - 8) * bf16_to_f32(sc[2 * (j + 32)])
                                        + bf16_to_f32(sc[2 * (j + 32) + 1]));
            }
        }
    }
}

/* x @ W.T for a grouped int8 weight, few rows: y [M, N] = x [M, K] (float32) times W [N, K],
 * W[n, g * group + i] = q[g, n, i] * s[g, n] (q int8 [K / group, N, group], s bf16 [K / group, N]).
 * Up to 8 rows at a time share each weight load; the sums over a group stay lane-wise in
 * registers across groups and are added up once per (row, output). */
static inline __attribute__((always_inline)) void int8g_rows(
        const float *x, const int8_t *q, const uint16_t *s, float *y, int64_t N, int64_t K,
        const int64_t group, const int64_t rows) {
    for (int64_t n = 0; n < N; n++) {
        float acc[8][MAX_D];
        for (int64_t m = 0; m < rows; m++)
            _Pragma("omp simd")
            for (int64_t i = 0; i < group; i++) acc[m][i] = 0.f;
        for (int64_t g = 0; g < K / group; g++) {
            const int8_t *qr = q + (g * N + n) * group;
            const float sc = bf16_to_f32(s[g * N + n]);
            float w[MAX_D];
            _Pragma("omp simd")
            for (int64_t i = 0; i < group; i++) w[i] = (float)qr[i] * sc;
            for (int64_t m = 0; m < rows; m++) {
                const float *xr = x + m * K + g * group;
                _Pragma("omp simd")
                for (int64_t i = 0; i < group; i++) acc[m][i] += xr[i] * w[i];
            }
        }
        for (int64_t m = 0; m < rows; m++) {
            float t = 0.f;
            _Pragma("omp simd reduction(+:t)")
            for (int64_t i = 0; i < group; i++) t += acc[m][i];
            y[m * N + n] = t;
        }
    }
}

#define ROWS_CASE(R) case R:                                                              \
    if (group == 32) int8g_rows(xm, q, s, ym, N, K, 32, R);                                    \
    else int8g_rows(xm, q, s, ym, N, K, group, R);                                             \
    break;

int int8g_mm(const float *x, const int8_t *q, const uint16_t *s, float *y, int64_t M, int64_t N,
             int64_t K, int64_t group) {
    if (group > MAX_D || K % group) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const float *xm = x + m0 * K;
        float *ym = y + m0 * N;
        switch (M - m0 < 8 ? M - m0 : 8) {
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
            ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
        }
    }
    return 0;
}

/* RMSNorm of x + residual, the sum written into the residual (in its dtype) first, as torch's
 * path of triton_ops.add_rmsnorm rounds it: y = round(round(s * rsqrt(mean(s^2) + eps)) * w).
 * res NULL: RMSNorm(x). Rows of N, strides in elements. */
#define DEFINE_NORM(NAME, T, LOAD, STORE)                                                        \
void NAME(const T *x, int64_t sx, T *res, int64_t sr, const T *w, T *out, int64_t so,            \
          int64_t R, int64_t N, float eps) {                                                     \
    for (int64_t r = 0; r < R; r++) {                                                            \
        const T *xr = x + r * sx;                                                                \
        T *o = out + r * so;                                                                     \
        float acc = 0.f;                                                                         \
        if (res) {                                                                               \
            T *rr = res + r * sr;                                                                \
            _Pragma("omp simd reduction(+:acc)")                                                 \
            for (int64_t i = 0; i < N; i++) {                                                    \
                const T s = STORE(LOAD(rr[i]) + LOAD(xr[i]));                                    \
                rr[i] = s;                                                                       \
                acc += LOAD(s) * LOAD(s);                                                        \
            }                                                                                    \
            xr = rr;                                                                             \
        } else {                                                                                 \
            _Pragma("omp simd reduction(+:acc)")                                                 \
            for (int64_t i = 0; i < N; i++) acc += LOAD(xr[i]) * LOAD(xr[i]);                    \
        }                                                                                        \
        const float rs = 1.f / sqrtf(acc / (float)N + eps);                                      \
        _Pragma("omp simd")                                                                      \
        for (int64_t i = 0; i < N; i++) o[i] = STORE(LOAD(STORE(LOAD(xr[i]) * rs)) * LOAD(w[i])); \
    }                                                                                            \
}

/* Neox rotary (rotate halves) of x [Tn, H, D] (token stride sx elements, heads contiguous)
 * at positions pos, into out [Tn, H, D]: out = x * cos + rotate_half(x) * sin in float32,
 * with cos / sin [positions, D / 2] float32 tables. */
#define DEFINE_ROTARY(NAME, T, LOAD, STORE)                                                      \
void NAME(const T *x, int64_t sx, int64_t Tn, int64_t H, int64_t D, const float *cos,            \
          const float *sin, const int64_t *pos, T *out) {                                        \
    const int64_t half = D / 2;                                                                  \
    for (int64_t t = 0; t < Tn; t++) {                                                           \
        const float *c = cos + pos[t] * half, *s = sin + pos[t] * half;                          \
        for (int64_t h = 0; h < H; h++) {                                                        \
            const T *xr = x + t * sx + h * D;                                                    \
            T *o = out + (t * H + h) * D;                                                        \
            _Pragma("omp simd")                                                                  \
            for (int64_t i = 0; i < half; i++) {                                                 \
                const float a = LOAD(xr[i]), b = LOAD(xr[i + half]);                             \
                o[i] = STORE(a * c[i] - b * s[i]);                                               \
                o[i + half] = STORE(b * c[i] + a * s[i]);                                        \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
}

DEFINE_NORM(add_rmsnorm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_NORM(add_rmsnorm_f32, float, IDENT, IDENT)
DEFINE_ROTARY(rotary_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_ROTARY(rotary_f32, float, IDENT, IDENT)
