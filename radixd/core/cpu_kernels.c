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

#define CASE(ONE, GG, DD) case GG * 1000 + DD: ONE(qb, k, v, row, n, ob, Hkv, h, scale, scratch, GG, DD); return;

/* NAME_head: one (request, KV head), qb / ob its G query heads, the kernel specialized for the
 * usual (G, D); NAME: every request and KV head in turn. */
#define DEFINE_DECODE(NAME, ONE, T)                                                              \
static void NAME##_head(const T *qb, const T *k, const T *v, const int64_t *row, int64_t n,      \
                        T *ob, int64_t Hkv, int64_t h, float scale, float *scratch, int64_t G,   \
                        int64_t D) {                                                             \
    switch (G * 1000 + D) {                                                                      \
        CASE(ONE, 1, 64) CASE(ONE, 2, 64) CASE(ONE, 3, 64) CASE(ONE, 4, 64)                      \
        CASE(ONE, 5, 64) CASE(ONE, 6, 64) CASE(ONE, 7, 64) CASE(ONE, 8, 64)                      \
        CASE(ONE, 1, 128) CASE(ONE, 2, 128) CASE(ONE, 4, 128) CASE(ONE, 8, 128)                  \
        default: ONE(qb, k, v, row, n, ob, Hkv, h, scale, scratch, G, D);                        \
    }                                                                                            \
}                                                                                                \
int NAME(const T *q, const T *k, const T *v, const int64_t *slots, const int64_t *lens,          \
         T *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t L, float scale,          \
         float *scratch) {                                                                       \
    const int64_t G = Hq / Hkv;                                                                  \
    if (G > MAX_G || D > MAX_D || G * Hkv != Hq) return -1;                                      \
    for (int64_t b = 0; b < B; b++)                                                              \
        for (int64_t h = 0; h < Hkv; h++)                                                        \
            NAME##_head(q + (b * Hq + h * G) * D, k, v, slots + b * L, lens[b],                  \
                        out + (b * Hq + h * G) * D, Hkv, h, scale, scratch, G, D);               \
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
 * p   [N / B, K, B / 2] bytes, B the block's rows (torch's build for AVX512 packs 64, for AVX2
 *     32): byte j of (block, k) holds rows block*B + j (low nibble) and block*B + B/2 + j (high
 *     nibble) at column k (which B, checked at run time by the caller);
 * sz  [K / group, N, 2] bf16: scale and zero, w = (q - 8) * scale + zero.
 * Each (block, k) is B / 2 bytes in and B values out, both contiguous.
 */
static inline __attribute__((always_inline)) void int4pack_block(const uint8_t *in, const uint16_t *sc,
                                                                 uint16_t *o, const int64_t half) {
    _Pragma("omp simd")
    for (int64_t j = 0; j < half; j++) {
        o[j] = f32_to_bf16((float)((in[j] & 15) - 8) * bf16_to_f32(sc[2 * j]) + bf16_to_f32(sc[2 * j + 1]));
        o[j + half] = f32_to_bf16((float)((in[j] >> 4) - 8) * bf16_to_f32(sc[2 * (j + half)])
                                  + bf16_to_f32(sc[2 * (j + half) + 1]));
    }
}

void int4pack_to_bf16_t(const uint8_t *p, const uint16_t *sz, uint16_t *out, int64_t N, int64_t K,
                        int64_t group, int64_t block) {
    for (int64_t nb = 0; nb < N / block; nb++) {
        for (int64_t k = 0; k < K; k++) {
            const uint8_t *in = p + (nb * K + k) * (block / 2);
            const uint16_t *sc = sz + ((k / group) * N + nb * block) * 2;
            uint16_t *o = out + k * N + nb * block;
            if (block == 64)  /* constant trip counts: the loops vectorize fully */
                int4pack_block(in, sc, o, 32);
            else
                int4pack_block(in, sc, o, 16);
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

/* ---- Integer dot products for few rows: int4 / int8 weights in blocks of 32, activations
 * quantized per block of 32 into int8 (llama.cpp's Q8 activations) or two int8 planes (see
 * PLANE2 below), AVX512-VNNI.
 *
 * Weights, repacked once at load (cpu_int.pack_cpu), per group c of 16 output columns and
 * block b of 32 input columns, one record after another (c major, then b):
 *   q4 (320 bytes): 4 x 64 bytes of nibbles, then d[16], m[16] as fp16: w = d * q + m.
 *       Chunk j, lane l (column 16c + l), byte i: low nibble w[.., 32b + 8j + i],
 *       high nibble w[.., 32b + 8j + 4 + i] (q 0..15).
 *   q8 (544 bytes): 8 x 64 bytes, chunk j lane l byte i = w[.., 32b + 4j + i] + 128 (uint8),
 *       then d[16] fp16: w = d * (u - 128).
 * The 4 bytes of one lane are what vpdpbusd multiplies by 4 activation bytes and sums into
 * that lane's int32: 16 columns at once, a column's sum never crosses lanes, and each
 * weight vector is loaded once for all rows. Per (row, block) the int32 sum becomes float
 * once: y += d_w * d_x * sum(q_w * q_x) + m_w * (d_x * sum(q_x))  (q4)
 *        y += d_w * d_x * (sum(u_w * q_x) - 128 * sum(q_x))      (q8).
 *
 * Activations: x [M, K] (float32 or bf16, row stride ldx) quantized per row and block of 32:
 * d_x = max|x| / 127, q_x = round(x / d_x) (to nearest even; with two planes the remainder as
 * well, each plane's dot products summed as 254 q + q2); with act = 1 the input is
 * [M, 2K] gate | up and the quantized row is SiLU(gate) * up (in float32).
 * Output y [M, N] float32 or bf16 (row stride ldy). */

#include <immintrin.h>
#include <stdlib.h>

#define FMA_TARGET __attribute__((target("avx2,fma,f16c")))  /* (the AVX2 kernels: avx2_supported) */

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))
#define Q4_REC 320
#define Q8_REC 544

typedef struct {
    int8_t *q;      /* [M][K] */
    int8_t *q2;     /* [M][K] the second plane (NULL: one) */
    float *d;       /* [M][B] activation scale */
    float *s;       /* [M][B] d * sum(q)  (q4's min term) */
    int32_t *neg;   /* [M][B] -128 * sum(q) (q8's offset) */
    int amx;        /* multiplied on AMX tiles (amx_takes); with two planes the rows lie in chunks of
                       AMX_MAX_ROWS, each chunk's first plane then its second (act_rows) */
} act_t;

#define AMX_MIN_ROWS 3  /* fewer rows: the VNNI kernel is faster (1 row: 0.7x the tiles' time, 2 rows 0.95x) */
#define AMX_MAX_ROWS 8  /* rows of a tile pass (both planes fill a tile's 16 rows) */
static int use_amx = 0;  /* set_amx */

/* Whether M rows are multiplied on AMX tiles. */
static inline int amx_takes(int64_t M) {
    return M >= AMX_MIN_ROWS && __atomic_load_n(&use_amx, __ATOMIC_RELAXED);
}

/* Decode attention's scores on AMX-BF16 tiles (where use_amx and the CPU has AMX-BF16): scores_amx. */
static int use_amx_bf16 = 0;
#define AMX_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")))
AMX_BF16_TARGET static void scores_amx(const uint16_t *const *qs, const uint16_t *k, const int64_t *const *rows,
                                       const int64_t *ns, int64_t R, int64_t Hkv, int64_t h0, int64_t h1, float scale,
                                       float *scratch, int64_t sstride, int64_t G, int64_t D);

/* Two planes: x / d = q + r (|r| <= 1/2) with q2 = round(254 r) as well, so that x is
 * d (q + q2 / 254) to 1/(2 * 254 * 127) of the block's largest value (about 15 bits): the
 * dot products are 254 sum(w q) + sum(w q2), exact in int32, and d, s, neg are stated for
 * the combined 254 q + q2 (d / 254). One plane: llama.cpp's Q8 activations. */
#define PLANE2 254

static inline float silu_f(float g) { return g / (1.f + expf(-g)); }

/* One row of K floats quantized into act rows r (q2 NULL: one plane). */
static void quantize_row(const float *xf, int64_t K, int8_t *q, int8_t *q2, float *d, float *s, int32_t *neg) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = xf + b * 32;
        float amax = 0.f;
        _Pragma("omp simd reduction(max:amax)")
        for (int i = 0; i < 32; i++) { const float a = fabsf(xb[i]); amax = a > amax ? a : amax; }
        const float db = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        if (q2) {
            _Pragma("omp simd reduction(+:sum)")
            for (int i = 0; i < 32; i++) {
                const float t = xb[i] * id;
                const float hi = nearbyintf(t), lo = nearbyintf((t - hi) * (float)PLANE2);
                q[b * 32 + i] = (int8_t)hi;
                q2[b * 32 + i] = (int8_t)lo;
                sum += PLANE2 * (int32_t)hi + (int32_t)lo;
            }
            d[b] = db / (float)PLANE2;
        } else {
            _Pragma("omp simd reduction(+:sum)")
            for (int i = 0; i < 32; i++) {
                const int32_t v = (int32_t)nearbyintf(xb[i] * id);
                q[b * 32 + i] = (int8_t)v;
                sum += v;
            }
            d[b] = db;
        }
        s[b] = d[b] * (float)sum;
        neg[b] = -128 * sum;
    }
}

/* SiLU(gate) * up of x [M, 2K] (gate | up, row stride ldx) into out [M, K], bf16, in float32
 * (one rounding; for prefill's GEMM path). */
void silu_mul_bf16(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t M, int64_t K) {
    for (int64_t r = 0; r < M; r++) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *o = out + r * K;
        _Pragma("omp simd")
        for (int64_t i = 0; i < K; i++) o[i] = f32_to_bf16(silu_f(bf16_to_f32(xr[i])) * bf16_to_f32(xr[K + i]));
    }
}

/* Row r's planes (q2 NULL: one plane). For AMX with two planes, chunk c of AMX_MAX_ROWS rows
 * (rc of them) starts at 2 c AMX_MAX_ROWS K, its second plane rc K after its first: a tile
 * reads both planes' rows with one stride. Up to AMX_MAX_ROWS rows this is the plain layout. */
static inline void act_rows(const act_t *a, int64_t M, int64_t K, int64_t r, int8_t **q1, int8_t **q2) {
    if (a->amx && a->q2) {
        const int64_t c0 = r - r % AMX_MAX_ROWS, rc = M - c0 < AMX_MAX_ROWS ? M - c0 : AMX_MAX_ROWS;
        *q1 = a->q + 2 * c0 * K + (r - c0) * K;
        *q2 = *q1 + rc * K;
        return;
    }
    *q1 = a->q + r * K;
    *q2 = a->q2 ? a->q2 + r * K : NULL;
}

/* Row r of x [M, K] (float32 or bf16, rows ldx apart; act 1: [M, 2K] gate | up, taken as
 * SiLU(gate) * up) in float32, into o [K]. */
static void row_in(const void *x, int x_bf16, int64_t ldx, int act, int64_t r, int64_t K, float *o) {
    if (x_bf16) {
        const uint16_t *xr = (const uint16_t *)x + r * ldx;
        if (act) {
            _Pragma("omp simd")
            for (int64_t i = 0; i < K; i++) o[i] = silu_f(bf16_to_f32(xr[i])) * bf16_to_f32(xr[K + i]);
        } else {
            _Pragma("omp simd")
            for (int64_t i = 0; i < K; i++) o[i] = bf16_to_f32(xr[i]);
        }
    } else {
        const float *xr = (const float *)x + r * ldx;
        if (act) {
            _Pragma("omp simd")
            for (int64_t i = 0; i < K; i++) o[i] = silu_f(xr[i]) * xr[K + i];
        } else {
            memcpy(o, xr, K * sizeof(float));
        }
    }
}

/* x rows to float (and SiLU(gate) * up), then quantized; tmp holds one row of K floats. */
static void quantize_act(const void *x, int x_bf16, int64_t ldx, int act, int64_t M, int64_t K, act_t *a,
                         float *tmp) {
    const int64_t B = K / 32;
    for (int64_t r = 0; r < M; r++) {
        row_in(x, x_bf16, ldx, act, r, K, tmp);
        int8_t *q1, *q2;
        act_rows(a, M, K, r, &q1, &q2);
        quantize_row(tmp, K, q1, q2, a->d + r * B, a->s + r * B, a->neg + r * B);
    }
}

static inline int32_t load_i32(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

VNNI_TARGET static inline void store_rows(const __m512 *acc, int R, void *y, int y_bf16, int64_t ldy, int64_t n0,
                                          int64_t N) {
    const __mmask16 mask = N - n0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1u);
    for (int r = 0; r < R; r++) {
        if (y_bf16) {
            /* round to nearest even, as f32_to_bf16 */
            __m512i u = _mm512_castps_si512(acc[r]);
            __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
            __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
            _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy + n0, mask, h);
        } else {
            _mm512_mask_storeu_ps((float *)y + r * ldy + n0, mask, acc[r]);
        }
    }
}

/* 16 columns (one record stream wc) times R rows of activations in P planes. */
VNNI_TARGET static inline __attribute__((always_inline)) void q4_cols(
        const uint8_t *wc, int64_t B, const act_t *a, int64_t K, int64_t r0, const int R, const int P,
        void *y, int y_bf16, int64_t ldy, int64_t n0, int64_t N) {
    __m512 acc[8];
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *rec = wc + b * Q4_REC;
        __m512i dot[8], dot2[8];
        for (int r = 0; r < R; r++) dot[r] = dot2[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i w = _mm512_loadu_si512(rec + 64 * j);
            const __m512i lo = _mm512_and_si512(w, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
            for (int r = 0; r < R; r++) {
                const int64_t off = (r0 + r) * K + b * 32 + 8 * j;
                dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(load_i32(a->q + off)));
                dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(load_i32(a->q + off + 4)));
                if (P == 2) {
                    dot2[r] = _mm512_dpbusd_epi32(dot2[r], lo, _mm512_set1_epi32(load_i32(a->q2 + off)));
                    dot2[r] = _mm512_dpbusd_epi32(dot2[r], hi, _mm512_set1_epi32(load_i32(a->q2 + off + 4)));
                }
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 256)));
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)));
        for (int r = 0; r < R; r++) {
            const int64_t i = (r0 + r) * B + b;
            if (P == 2) dot[r] = _mm512_add_epi32(_mm512_mullo_epi32(dot[r], _mm512_set1_epi32(PLANE2)), dot2[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(dw, _mm512_set1_ps(a->d[i])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[i]), acc[r]);
        }
    }
    store_rows(acc, R, (char *)y + r0 * ldy * (y_bf16 ? 2 : 4), y_bf16, ldy, n0, N);
}

VNNI_TARGET static inline __attribute__((always_inline)) void q8_cols(
        const uint8_t *wc, int64_t B, const act_t *a, int64_t K, int64_t r0, const int R, const int P,
        void *y, int y_bf16, int64_t ldy, int64_t n0, int64_t N) {
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        const uint8_t *rec = wc + b * Q8_REC;
        __m512i dot[8], dot2[8];
        for (int r = 0; r < R; r++) {
            dot[r] = P == 2 ? _mm512_setzero_si512() : _mm512_set1_epi32(a->neg[(r0 + r) * B + b]);
            dot2[r] = _mm512_setzero_si512();
        }
        for (int j = 0; j < 8; j++) {
            const __m512i w = _mm512_loadu_si512(rec + 64 * j);
            for (int r = 0; r < R; r++) {
                const int64_t off = (r0 + r) * K + b * 32 + 4 * j;
                dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(load_i32(a->q + off)));
                if (P == 2) dot2[r] = _mm512_dpbusd_epi32(dot2[r], w, _mm512_set1_epi32(load_i32(a->q2 + off)));
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 512)));
        for (int r = 0; r < R; r++) {
            if (P == 2)
                dot[r] = _mm512_add_epi32(_mm512_add_epi32(_mm512_mullo_epi32(dot[r], _mm512_set1_epi32(PLANE2)), dot2[r]),
                                          _mm512_set1_epi32(a->neg[(r0 + r) * B + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(dw, _mm512_set1_ps(a->d[(r0 + r) * B + b])),
                                     acc[r]);
        }
    }
    store_rows(acc, R, (char *)y + r0 * ldy * (y_bf16 ? 2 : 4), y_bf16, ldy, n0, N);
}

#define COLS_CASE(FN, R, P) case R: FN(wc, B, &a, K, r0, R, P, y, y_bf16, ldy, n0, N); break;
#define DEFINE_QMM(NAME, FN, REC)                                                                 \
VNNI_TARGET static void NAME##_range(const uint8_t *w, const act_t *ap, int64_t M, int64_t N, int64_t K, \
                                     void *y, int y_bf16, int64_t ldy, int64_t c0, int64_t c1) {  \
    const act_t a = *ap;                                                                          \
    const int64_t B = K / 32;                                                                     \
    for (int64_t c = c0; c < c1; c++) {                                                           \
        const uint8_t *wc = w + c * B * REC;                                                      \
        const int64_t n0 = c * 16;                                                                \
        if (a.q2) {  /* two planes: 4 rows at a time (registers) */                               \
            for (int64_t r0 = 0; r0 < M; r0 += 4) {                                               \
                switch (M - r0 < 4 ? M - r0 : 4) {                                               \
                    COLS_CASE(FN, 1, 2) COLS_CASE(FN, 2, 2) COLS_CASE(FN, 3, 2) COLS_CASE(FN, 4, 2) \
                }                                                                                 \
            }                                                                                     \
            continue;                                                                             \
        }                                                                                         \
        for (int64_t r0 = 0; r0 < M; r0 += 8) {                                                   \
            switch (M - r0 < 8 ? M - r0 : 8) {                                                   \
                COLS_CASE(FN, 1, 1) COLS_CASE(FN, 2, 1) COLS_CASE(FN, 3, 1) COLS_CASE(FN, 4, 1)   \
                COLS_CASE(FN, 5, 1) COLS_CASE(FN, 6, 1) COLS_CASE(FN, 7, 1) COLS_CASE(FN, 8, 1)   \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
}
DEFINE_QMM(q4mm, q4_cols, Q4_REC)
DEFINE_QMM(q8mm, q8_cols, Q8_REC)

/* 1 where this CPU (and its OS) runs the VNNI kernels. */
int vnni_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}

/* Activation planes (1 or 2): set_act_planes. */
static int act_planes = 2;

/* 1: int8 activations (llama.cpp's Q8); 2: two int8 planes (about 15 bits). Returns the setting. */
int set_act_planes(int planes) {
    if (planes == 1 || planes == 2) __atomic_store_n(&act_planes, planes, __ATOMIC_RELAXED);
    return __atomic_load_n(&act_planes, __ATOMIC_RELAXED);
}

/* The activation buffers of M rows of K: act_t's arrays and one float row, in mem. */
static size_t act_bytes(int64_t M, int64_t K) {
    return 2 * M * K + M * (K / 32) * (2 * sizeof(float) + sizeof(int32_t)) + K * sizeof(float);
}

static float *act_init(act_t *a, char *mem, int64_t M, int64_t K) {
    const int64_t B = K / 32;
    a->q = (int8_t *)mem;
    a->q2 = __atomic_load_n(&act_planes, __ATOMIC_RELAXED) == 2 ? a->q + M * K : NULL;
    a->d = (float *)(mem + 2 * M * K);
    a->s = a->d + M * B;
    a->neg = (int32_t *)(a->s + M * B);
    a->amx = amx_takes(M);
    return (float *)(a->neg + M * B);
}

/* A q4 / q8 weight dequantized to bf16 and transposed, out [K, N] (x @ out is x @ W.T), for
 * the GEMMs of many rows. A chunk's 16 lanes x 4 bytes are transposed to 4 x 16 bytes (one
 * byte shuffle within 128-bit lanes, one dword permute), so that each output row's 16 columns
 * are 16 consecutive bytes. */
VNNI_TARGET static inline void row16_bf16(__m128i bytes, __m512 d, __m512 m, uint16_t *o, __mmask16 mask) {
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), d, m);
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_mask_storeu_epi16(o, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

/* Columns n0 .. n1 - 1 (n0 a multiple of 16) of the weight, transposed: out [K, n1 - n0]
 * with row stride ldo (a panel for one GEMM: the dense weight need not exist whole). */
VNNI_TARGET static void qdequant_cols_bf16_t(int bits, const uint8_t *w, uint16_t *out, int64_t N, int64_t K, int64_t n0_,
                                      int64_t n1_, int64_t ldo) {
    const int64_t B = K / 32, rec_bytes = bits == 4 ? Q4_REC : Q8_REC;
    N = n1_ < N ? n1_ : N;
    /* within each 128-bit lane: 4 lanes x 4 bytes -> 4 bytes i x 4 lanes */
    const __m512i tr = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m512i gather = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t c = n0_ / 16; c < (N + 15) / 16; c++) {
        const int64_t n0 = c * 16;
        const __mmask16 mask = N - n0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n0)) - 1u);
        for (int64_t b = 0; b < B; b++) {
            const uint8_t *rec = w + (c * B + b) * rec_bytes;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + (bits == 4 ? 256 : 512))));
            const __m512 m = bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288)))
                                       : _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
            for (int j = 0; j < (bits == 4 ? 4 : 8); j++) {
                /* bytes [i][l]: 16 columns of row i of this chunk in each 128-bit quarter */
                const __m512i t = _mm512_permutexvar_epi32(gather, _mm512_shuffle_epi8(_mm512_loadu_si512(rec + 64 * j), tr));
                if (bits == 4) {
                    const __m512i lo = _mm512_and_si512(t, low), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
                    uint16_t *o = out + (b * 32 + 8 * j) * ldo + (n0 - n0_);
                    row16_bf16(_mm512_extracti32x4_epi32(lo, 0), d, m, o, mask);
                    row16_bf16(_mm512_extracti32x4_epi32(lo, 1), d, m, o + ldo, mask);
                    row16_bf16(_mm512_extracti32x4_epi32(lo, 2), d, m, o + 2 * ldo, mask);
                    row16_bf16(_mm512_extracti32x4_epi32(lo, 3), d, m, o + 3 * ldo, mask);
                    row16_bf16(_mm512_extracti32x4_epi32(hi, 0), d, m, o + 4 * ldo, mask);
                    row16_bf16(_mm512_extracti32x4_epi32(hi, 1), d, m, o + 5 * ldo, mask);
                    row16_bf16(_mm512_extracti32x4_epi32(hi, 2), d, m, o + 6 * ldo, mask);
                    row16_bf16(_mm512_extracti32x4_epi32(hi, 3), d, m, o + 7 * ldo, mask);
                } else {
                    uint16_t *o = out + (b * 32 + 4 * j) * ldo + (n0 - n0_);
                    row16_bf16(_mm512_extracti32x4_epi32(t, 0), d, m, o, mask);
                    row16_bf16(_mm512_extracti32x4_epi32(t, 1), d, m, o + ldo, mask);
                    row16_bf16(_mm512_extracti32x4_epi32(t, 2), d, m, o + 2 * ldo, mask);
                    row16_bf16(_mm512_extracti32x4_epi32(t, 3), d, m, o + 3 * ldo, mask);
                }
            }
        }
    }
}



/* ---- Decode attention with AVX512-BF16 dot products (bf16 pool; same contract as decode_bf16).
 * Scores: vdpbf16ps of the query head and the key (the products exact, summed in float32),
 * four keys at once reduced to four scores in one shuffle tree; the scale is applied to the
 * score. Softmax and the values' weighted sum in float32 as decode_bf16. */

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

int bf16dp_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
}

/* Four float32 vectors to their four sums, in lanes 0, 4, 8, 12 of the result. */
BF16_TARGET static inline __m512 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
    return _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
}

BF16_TARGET static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Requests attending together, every head ("members": requests whose rows share a radix-cached
 * prefix of slots): keys and values in tiles of TILE slots, each tile read once for all KV
 * heads (a slot's heads lie together in the pool) and, for the members, one after another, so
 * that a slot which several members' rows hold comes from memory once and from the L1 cache
 * for the others. Each member's arithmetic is that of attending alone, bit for bit: its
 * scores, softmax and sums over the keys in the same order. Member r: query heads qs[r]
 * [Hq, D], ns[r] slots rows[r], output outs[r] [Hq, D], scores in scratch + r * sstride. */
#define TILE 32
#define DP_MAX_HD 8192
#define GRP_MAX 4
BF16_TARGET static inline __attribute__((always_inline)) void grp_bf16dp(
        const uint16_t *const *qs, const uint16_t *k, const uint16_t *v, const int64_t *const *rows,
        const int64_t *ns, uint16_t *const *outs, int64_t R, int64_t Hkv, int64_t h0, int64_t h1, float scale,
        float *scratch, int64_t sstride, const int64_t G, const int64_t D) {
    const int64_t C = D / 32, slot = Hkv * D;
    const __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t nmax = 0;
    for (int64_t r = 0; r < R; r++) nmax = ns[r] > nmax ? ns[r] : nmax;
    const int tiles = R * G <= 16 && __atomic_load_n(&use_amx_bf16, __ATOMIC_RELAXED);
    if (tiles) scores_amx(qs, k, rows, ns, R, Hkv, h0, h1, scale, scratch, sstride, G, D);
    for (int64_t j0 = 0; j0 < nmax && !tiles; j0 += TILE) {
        for (int64_t h = h0; h < h1; h++) {
            for (int64_t r = 0; r < R; r++) {
                const int64_t n = ns[r];
                if (j0 >= n) continue;
                const int64_t j1 = j0 + TILE < n ? j0 + TILE : n, *row = rows[r];
                const uint16_t *q = qs[r];
                float *sc = scratch + r * sstride;
                __m512bh qv[MAX_G][MAX_D / 32];
                for (int64_t g = 0; g < G; g++)
                    for (int64_t c = 0; c < C; c++) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + (h * G + g) * D + c * 32);
                int64_t j = j0;
                for (; j + 4 <= j1; j += 4) {
                    const uint16_t *kr[4];
                    for (int t = 0; t < 4; t++) kr[t] = k + row[j + t] * slot + h * D;
                    for (int64_t g = 0; g < G; g++) {
                        __m512 acc[4];
                        for (int t = 0; t < 4; t++) {
                            acc[t] = _mm512_setzero_ps();
                            for (int64_t c = 0; c < C; c++)
                                acc[t] = _mm512_dpbf16_ps(acc[t], qv[g][c], (__m512bh)_mm512_loadu_si512(kr[t] + c * 32));
                        }
                        const __m512 s4 = _mm512_permutexvar_ps(pick, sum4(acc[0], acc[1], acc[2], acc[3]));
                        _mm_storeu_ps(sc + (h * G + g) * n + j, _mm512_castps512_ps128(_mm512_mul_ps(s4, vscale)));
                    }
                }
                for (; j < j1; j++) {
                    const uint16_t *kr = k + row[j] * slot + h * D;
                    for (int64_t g = 0; g < G; g++) {
                        __m512 acc = _mm512_setzero_ps();
                        for (int64_t c = 0; c < C; c++)
                            acc = _mm512_dpbf16_ps(acc, qv[g][c], (__m512bh)_mm512_loadu_si512(kr + c * 32));
                        sc[(h * G + g) * n + j] = _mm512_reduce_add_ps(acc) * scale;
                    }
                }
            }
        }
    }
    float sum[GRP_MAX][DP_MAX_HD / 32];
    for (int64_t r = 0; r < R; r++) {
        const int64_t n = ns[r];
        for (int64_t e = h0 * G; e < h1 * G; e++) {
            float *sc = scratch + r * sstride + e * n, t = -FLT_MAX, z = 0.f;
            _Pragma("omp simd reduction(max:t)")
            for (int64_t i = 0; i < n; i++) t = sc[i] > t ? sc[i] : t;
            _Pragma("omp simd reduction(+:z)")
            for (int64_t i = 0; i < n; i++) { sc[i] = expf(sc[i] - t); z += sc[i]; }
            sum[r][e] = z;
        }
    }
    float accm[GRP_MAX][DP_MAX_HD / 16][16] __attribute__((aligned(64)));  /* the heads' sums between tiles */
    for (int64_t r = 0; r < R; r++) memset(accm[r][h0 * G * D / 16], 0, (h1 - h0) * G * D * sizeof(float));
    float vt[TILE][MAX_D] __attribute__((aligned(64)));  /* the first member's values of a tile, in float32 */
    for (int64_t j0 = 0; j0 < nmax; j0 += TILE) {
        for (int64_t h = h0; h < h1; h++) {
            const int64_t t0 = j0 < ns[0] ? (j0 + TILE < ns[0] ? TILE : ns[0] - j0) : 0;  /* (vt's keys) */
            for (int64_t r = 0; r < R; r++) {
                const int64_t n = ns[r];
                if (j0 >= n) continue;
                const int64_t j1 = j0 + TILE < n ? j0 + TILE : n, *row = rows[r];
                const float *sc = scratch + r * sstride;
                /* the first member converts its values into vt, a member whose slots are the same reads them there */
                const int keep = R > 1 && r == 0, reuse = r > 0 && j1 - j0 <= t0
                                 && !memcmp(row + j0, rows[0] + j0, (j1 - j0) * sizeof(int64_t));
                __m512 acc[MAX_G][MAX_D / 16];
                for (int64_t g = 0; g < G; g++)
                    for (int64_t c = 0; c < D / 16; c++) acc[g][c] = _mm512_load_ps(accm[r][(h * G + g) * D / 16 + c]);
                for (int64_t i = j0; i < j1; i++) {
                    const uint16_t *vr = v + row[i] * slot + h * D;
                    __m512 vf[MAX_D / 16];
                    if (reuse) {
                        for (int64_t c = 0; c < D / 16; c++) vf[c] = _mm512_load_ps(&vt[i - j0][c * 16]);
                    } else {
                        for (int64_t c = 0; c < D / 16; c++) vf[c] = bf16x16_to_f32(vr + c * 16);
                        if (keep)
                            for (int64_t c = 0; c < D / 16; c++) _mm512_store_ps(&vt[i - j0][c * 16], vf[c]);
                    }
                    for (int64_t g = 0; g < G; g++) {
                        const __m512 p = _mm512_set1_ps(sc[(h * G + g) * n + i]);
                        for (int64_t c = 0; c < D / 16; c++) acc[g][c] = _mm512_fmadd_ps(p, vf[c], acc[g][c]);
                    }
                }
                for (int64_t g = 0; g < G; g++)
                    for (int64_t c = 0; c < D / 16; c++) _mm512_store_ps(accm[r][(h * G + g) * D / 16 + c], acc[g][c]);
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t e = h0 * G; e < h1 * G; e++) {
            const __m512 inv = _mm512_set1_ps(1.f / sum[r][e]);
            for (int64_t c = 0; c < D / 16; c++) {
                __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(accm[r][e * D / 16 + c]), inv));
                const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
                u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
                _mm256_storeu_si256((__m256i *)(outs[r] + e * D + c * 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
            }
        }
}

#define CASE_DP(GG, DD) case GG * 1000 + DD: grp_bf16dp(qs, k, v, rows, ns, outs, R, Hkv, h0, h1, scale, scratch, sstride, GG, DD); break;

/* R (at most GRP_MAX) members' KV heads h0 .. h1 - 1 (the query heads they serve); scratch
 * float [R * sstride], sstride >= Hq * (the members' longest row). */
BF16_TARGET static void attend_bf16dp(const uint16_t *const *qs, const uint16_t *k, const uint16_t *v,
                                      const int64_t *const *rows, const int64_t *ns, uint16_t *const *outs, int64_t R,
                                      int64_t h0, int64_t h1, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                                      float *scratch, int64_t sstride) {
    const int64_t G = Hq / Hkv;
    switch (G * 1000 + D) {
        CASE_DP(1, 64) CASE_DP(2, 64) CASE_DP(3, 64) CASE_DP(4, 64)
        CASE_DP(5, 64) CASE_DP(6, 64) CASE_DP(7, 64) CASE_DP(8, 64)
        CASE_DP(1, 128) CASE_DP(2, 128) CASE_DP(4, 128) CASE_DP(8, 128)
        default: grp_bf16dp(qs, k, v, rows, ns, outs, R, Hkv, h0, h1, scale, scratch, sstride, G, D);
    }
}

static int dp_takes(int64_t Hq, int64_t Hkv, int64_t D) {
    const int64_t G = Hq / Hkv;
    return G <= MAX_G && D <= MAX_D && D % 32 == 0 && G * Hkv == Hq && Hq * D <= DP_MAX_HD;
}

/* scratch: float [Hq * L] (the scores of one request). Hq * D at most DP_MAX_HD. */
BF16_TARGET int decode_bf16_dp(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *slots,
                               const int64_t *lens, uint16_t *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
                               int64_t L, float scale, float *scratch) {
    if (!dp_takes(Hq, Hkv, D)) return -1;
    for (int64_t b = 0; b < B; b++) {
        const uint16_t *qb = q + b * Hq * D;
        const int64_t *row = slots + b * L;
        uint16_t *ob = out + b * Hq * D;
        attend_bf16dp(&qb, k, v, &row, lens + b, &ob, 1, 0, Hkv, Hq, Hkv, D, scale, scratch, 0);
    }
    return 0;
}

/* ---- The same matmuls on AMX-INT8 tiles (Sapphire Rapids and later), for 3 rows and more.
 *
 * One tdpbsud per block of 32 inputs and group of 16 columns multiplies the activations
 * (signed) by the weights (unsigned): A [P * M, 32] bytes, both planes' rows (the second
 * plane's rows follow the first's in act_t, M rows apart: one tile with stride K);
 * B [8, 64], row kk the 16 columns' 4 bytes of inputs 4kk .. 4kk + 3 (a q4 record's chunk j
 * holds rows 2j, its low nibbles, and 2j + 1, its high ones: unpacked to bytes first; a q8
 * record's chunk j is row j, read in place); C [P * M, 16] int32, the block's exact sums,
 * which AVX-512 then scales into the float32 rows as the VNNI kernel does (the same int32
 * sums, the same float operations in the same order: bit for bit its result).
 *
 * Three column groups at a time share each A tile: tile 0 is A, tiles 1-3 the groups' B,
 * 4-6 their C. The tiles run in order, so each block's sums are stored while the next
 * block's are computed and scaled one block later, and a q4 block is unpacked one block
 * ahead (a tile load waits for the stores it reads to complete). The tile configuration is
 * per thread (in the thread's state); a thread loads it once per matmul (``job``), since
 * code between matmuls (oneDNN's GEMMs in torch) loads its own. The process asks the kernel
 * for AMX's state once (arch_prctl, amx_supported). */

#include <cpuid.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma,amx-tile,amx-int8")))
#define AMX_GROUPS 3
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
/* (gcc's tile load macro does not say it reads memory: this one does, so that the unpacked block is stored first) */
#define TILE_LOAD(t, p, s) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t :: "r"(p), "r"((int64_t)(s)) : "memory")
#define TILE_STORE(t, p, s) __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" :: "r"(p), "r"((int64_t)(s)) : "memory")
#define TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define TILE_DP(c, a, b) __asm__ volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

/* 1 where this CPU has AMX-INT8 (and the VNNI kernels) and the OS lets this process use its tiles. */
int amx_supported(void) {
    unsigned eax, ebx, ecx, edx;
    if (!vnni_supported() || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    if (!(edx & (1u << 24)) || !(edx & (1u << 25))) return 0;  /* AMX-TILE, AMX-INT8 */
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static _Atomic int64_t amx_units;  /* calls run on the tiles (thread_stats) */

/* The int matmuls on AMX tiles (1; the caller checked amx_supported) or VNNI only (0); -1 leaves it. Returns the setting. */
int set_amx(int on) {
    if (on >= 0) {
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        const int bf16 = on && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx & (1u << 22));  /* AMX-BF16 */
        __atomic_store_n(&use_amx, on ? 1 : 0, __ATOMIC_RELAXED);
        __atomic_store_n(&use_amx_bf16, bf16, __ATOMIC_RELAXED);
    }
    return __atomic_load_n(&use_amx, __ATOMIC_RELAXED);
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

static __thread struct { uint64_t job; int rows; } amx_loaded;

/* Tiles for TR rows of activations (P * M). */
AMX_TARGET static void amx_config(uint64_t job, int TR) {
    if (amx_loaded.job == job && amx_loaded.rows == TR) return;
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 1 + 2 * AMX_GROUPS; t++) {
        cfg.rows[t] = t >= 1 && t <= AMX_GROUPS ? 8 : (uint8_t)TR;
        cfg.colsb[t] = t == 0 ? 32 : 64;
    }
    _tile_loadconfig(&cfg);
    amx_loaded.job = job;
    amx_loaded.rows = TR;
}

#define TILE_DPBF16(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

/* Decode attention's scores (grp_bf16dp's first pass) on AMX-BF16 tiles: for each KV head and
 * block of 16 keys, C [16 keys, 16] += K [16 keys, 32 dims] x Q^T [32 dims, 16], Q^T's
 * columns the members' query heads (R * G <= 16; pairs of dims interleaved, as tdpbf16ps
 * reads them, the columns past R * G zero), 32 dims at a time: each score the same bf16
 * products summed in float32 whatever else the tile holds (a member's scores are those of
 * attending alone, bit for bit). A block whose 16 slots every member's row holds reads the
 * keys once for all of them; others, each member's own. The keys come straight from the pool
 * where the 16 slots follow each other (a prefix's usually do), else gathered first. Then
 * each column is scaled into the member's scores. Tiles: 0 keys, 1 queries, 2 scores; the
 * configuration is loaded in each call (code between, in this thread, may load its own). */
AMX_BF16_TARGET static void scores_amx(const uint16_t *const *qs, const uint16_t *k, const int64_t *const *rows,
                                       const int64_t *ns, int64_t R, int64_t Hkv, int64_t h0, int64_t h1, float scale,
                                       float *scratch, int64_t sstride, int64_t G, int64_t D) {
    _Alignas(64) uint32_t bq[MAX_D / 32][16][16];
    _Alignas(64) float tmp[16][16];
    _Alignas(64) uint16_t abuf[16 * MAX_D];
    const int64_t C = D / 32, slot = Hkv * D;
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 3; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    amx_loaded.job = 0;  /* (qmm's configuration is gone) */
    atomic_fetch_add_explicit(&amx_units, 1, memory_order_relaxed);
    int64_t nmax = 0;
    for (int64_t r = 0; r < R; r++) nmax = ns[r] > nmax ? ns[r] : nmax;
    const __m512i down = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t h = h0; h < h1; h++) {
        memset(bq, 0, C * sizeof bq[0]);
        for (int64_t r = 0; r < R; r++)
            for (int64_t g = 0; g < G; g++) {
                const uint32_t *qd = (const uint32_t *)(qs[r] + (h * G + g) * D);
                for (int64_t c = 0; c < C; c++)
                    for (int64_t i = 0; i < 16; i++) bq[c][i][r * G + g] = qd[c * 16 + i];
            }
        for (int64_t j = 0; j < nmax; j += 16) {
            int shared = 1;
            for (int64_t r = 0; r < R && shared; r++)
                shared = ns[r] >= j + 16 && (r == 0 || !memcmp(rows[r] + j, rows[0] + j, 16 * sizeof(int64_t)));
            for (int64_t r = 0; r < (shared ? 1 : R); r++) {
                const int64_t n = ns[r];
                if (j >= n) continue;
                const int64_t m = n - j < 16 ? n - j : 16, *row = rows[r] + j;
                int follow = m == 16;
                for (int64_t i = 1; i < m && follow; i++) follow = row[i] == row[0] + i;
                const uint16_t *src = abuf;
                int64_t stride = D * (int64_t)sizeof(uint16_t);
                if (follow) {
                    src = k + row[0] * slot + h * D;
                    stride = slot * (int64_t)sizeof(uint16_t);
                } else {
                    for (int64_t i = 0; i < 16; i++)  /* (past the row's end: its first key again, not read back) */
                        memcpy(abuf + i * D, k + row[i < m ? i : 0] * slot + h * D, D * sizeof(uint16_t));
                }
                TILE_ZERO(2);
                for (int64_t c = 0; c < C; c++) {
                    TILE_LOAD(0, src + c * 32, stride);
                    TILE_LOAD(1, bq[c], 64);
                    TILE_DPBF16(2, 0, 1);
                }
                TILE_STORE(2, tmp, 64);
                for (int64_t rr = shared ? 0 : r; rr < (shared ? R : r + 1); rr++) {
                    const int64_t nn = ns[rr], mm = nn - j < 16 ? nn - j : 16;
                    const __mmask16 mask = (__mmask16)((1u << mm) - 1u);
                    for (int64_t g = 0; g < G; g++) {
                        const __m512 col = _mm512_i32gather_ps(_mm512_add_epi32(down, _mm512_set1_epi32((int)(rr * G + g))),
                                                               &tmp[0][0], 4);
                        _mm512_mask_storeu_ps(scratch + rr * sstride + (h * G + g) * nn + j, mask, _mm512_mul_ps(col, vscale));
                    }
                }
            }
        }
    }
}

/* A q4 block's chunks to bytes, B's rows in order. */
AMX_TARGET static inline void unpack_q4(const uint8_t *rec, uint8_t *bt) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m512i w = _mm512_loadu_si512(rec + 64 * j);
        _mm512_store_si512(bt + 128 * j, _mm512_and_si512(w, low));
        _mm512_store_si512(bt + 128 * j + 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), low));
    }
}

/* group G's block b: B in tile TB, C in tile TC (literals: the tile is part of the instruction) */
#define AMX_GROUP(G, TB, TC)                                                                    \
    do {                                                                                        \
        TILE_LOAD(TB, bits == 4 ? (const uint8_t *)bt[e][G] : wc + G * gstride + b * rec_bytes, 64); \
        TILE_ZERO(TC);                                                                          \
        TILE_DP(TC, 0, TB);                                                                     \
    } while (0)

/* ng (1 .. 3) column groups from wc (records gstride bytes apart) times all M rows (R) in P planes. */
AMX_TARGET static inline __attribute__((always_inline)) void amx_cols(
        const int bits, const uint8_t *wc, int64_t gstride, const int ng, int64_t B, const act_t *a, int64_t K,
        const int R, const int P, void *y, int y_bf16, int64_t ldy, int64_t n0, int64_t N) {
    _Alignas(64) uint8_t bt[2][AMX_GROUPS][512];
    _Alignas(64) int32_t ct[2][AMX_GROUPS][2 * AMX_MAX_ROWS][16];
    __m512 acc[AMX_GROUPS][AMX_MAX_ROWS];
    const int64_t rec_bytes = bits == 4 ? Q4_REC : Q8_REC;
    for (int g = 0; g < ng; g++)
        for (int r = 0; r < R; r++) acc[g][r] = _mm512_setzero_ps();
    if (bits == 4)
        for (int g = 0; g < ng; g++) unpack_q4(wc + g * gstride, bt[0][g]);
    for (int64_t b = 0; b <= B; b++) {
        if (b < B) {
            const int e = (int)(b & 1);
            if (bits == 4 && b + 1 < B)
                for (int g = 0; g < ng; g++) unpack_q4(wc + g * gstride + (b + 1) * rec_bytes, bt[e ^ 1][g]);
            TILE_LOAD(0, a->q + b * 32, K);
            AMX_GROUP(0, 1, 4);
            if (ng > 1) AMX_GROUP(1, 2, 5);
            if (ng > 2) AMX_GROUP(2, 3, 6);
        }
        const int64_t bb = b - 1;
        const int e = (int)(bb & 1);
        for (int g = 0; g < ng && b > 0; g++) {
            const uint8_t *rec = wc + g * gstride + bb * rec_bytes;
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + (bits == 4 ? 256 : 512))));
            const __m512 mw = bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + 288))) : dw;
            for (int r = 0; r < R; r++) {
                const int64_t i = r * B + bb;
                __m512 dotf;
                if (bits == 4 && P == 2)  /* exact in float32: |sums| <= 32 * 15 * 127, 254 sum1 + sum2 < 2^24 */
                    dotf = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ct[e][g][r])), _mm512_set1_ps((float)PLANE2),
                                           _mm512_cvtepi32_ps(_mm512_load_si512(ct[e][g][R + r])));
                else {
                    __m512i dot = _mm512_load_si512(ct[e][g][r]);
                    if (P == 2) dot = _mm512_add_epi32(_mm512_mullo_epi32(dot, _mm512_set1_epi32(PLANE2)), _mm512_load_si512(ct[e][g][R + r]));
                    if (bits == 8) dot = _mm512_add_epi32(dot, _mm512_set1_epi32(a->neg[i]));
                    dotf = _mm512_cvtepi32_ps(dot);
                }
                acc[g][r] = _mm512_fmadd_ps(dotf, _mm512_mul_ps(dw, _mm512_set1_ps(a->d[i])), acc[g][r]);
                if (bits == 4) acc[g][r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[i]), acc[g][r]);
            }
        }
        if (b < B) {  /* (after the scaling above: its loads would wait behind these stores) */
            const int eb = (int)(b & 1);
            TILE_STORE(4, ct[eb][0], 64);
            if (ng > 1) TILE_STORE(5, ct[eb][1], 64);
            if (ng > 2) TILE_STORE(6, ct[eb][2], 64);
        }
    }
    for (int g = 0; g < ng; g++) store_rows(acc[g], R, y, y_bf16, ldy, n0 + 16 * g, N);
}

#define AMX_CASE(R) case R:                                                                     \
    if (bits == 4 && P == 2) amx_cols(4, wc, gstride, ng, B, cp, K, R, 2, yc, y_bf16, ldy, n0, N); \
    else if (bits == 4) amx_cols(4, wc, gstride, ng, B, cp, K, R, 1, yc, y_bf16, ldy, n0, N);      \
    else if (P == 2) amx_cols(8, wc, gstride, ng, B, cp, K, R, 2, yc, y_bf16, ldy, n0, N);         \
    else amx_cols(8, wc, gstride, ng, B, cp, K, R, 1, yc, y_bf16, ldy, n0, N);                     \
    break;

/* q4mm_range / q8mm_range on the tiles (activations laid out by act_rows, a->amx), the rows
 * in chunks of AMX_MAX_ROWS (each chunk reads the columns' weights again, from the cache). */
AMX_TARGET static void qmm_amx_range(int bits, const uint8_t *w, const act_t *ap, int64_t M, int64_t N, int64_t K,
                                     void *y, int y_bf16, int64_t ldy, int64_t c0, int64_t c1, uint64_t job) {
    const int64_t B = K / 32, rec_bytes = bits == 4 ? Q4_REC : Q8_REC, gstride = B * rec_bytes;
    const int P = ap->q2 ? 2 : 1;
    atomic_fetch_add_explicit(&amx_units, 1, memory_order_relaxed);
    for (int64_t r0 = 0; r0 < M; r0 += AMX_MAX_ROWS) {
        const int R = M - r0 < AMX_MAX_ROWS ? (int)(M - r0) : AMX_MAX_ROWS;
        act_t chunk = *ap;
        chunk.q = ap->q + P * r0 * K;
        chunk.q2 = P == 2 ? chunk.q + R * K : NULL;
        chunk.d = ap->d + r0 * B;
        chunk.s = ap->s + r0 * B;
        chunk.neg = ap->neg + r0 * B;
        const act_t *cp = &chunk;
        char *yc = (char *)y + r0 * ldy * (y_bf16 ? 2 : 4);
        amx_config(job, P * R);
        for (int64_t c = c0; c < c1; c += AMX_GROUPS) {
            const uint8_t *wc = w + c * gstride;
            const int64_t n0 = c * 16;
            const int ng = c1 - c < AMX_GROUPS ? (int)(c1 - c) : AMX_GROUPS;
            switch (R) { AMX_CASE(1) AMX_CASE(2) AMX_CASE(3) AMX_CASE(4) AMX_CASE(5) AMX_CASE(6) AMX_CASE(7) AMX_CASE(8) }
        }
    }
}


/* ---- A second thread for the int matmuls and decode attention.
 *
 * A helper thread (started on first use, where set_threads(2) allows it) shares the units of
 * a job with the calling thread: each unit is claimed by a compare-and-swap on its state word
 * (job number << 3 | owner), so that whichever thread is free takes the next one. The helper
 * writes its units into a shadow buffer; the caller copies the ones the helper finished. The
 * caller never waits long for a helper that the OS has preempted (another process, the event
 * loop, a client on the same cores: docs/benchmarks/cpu_spread.md): past a deadline it takes
 * the helper's unit over ("stolen": the caller computes it into the result; the helper's
 * copy, if it ever finishes, is dropped). Everything a late helper may still read stays
 * allocated (the arena below is only ever grown, the job's description is copied by value),
 * and it writes only into its shadow buffer. One caller at a time: a second concurrent
 * caller runs on its own thread, without the helper. */

#include <pthread.h>
#include <stdatomic.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_UNITS 128
#define CTX_BYTES 256
#define SPIN_NS 50000  /* the helper spins this long for the next job, then sleeps */
enum { U_MAIN = 1, U_HELPER = 2, U_DONE = 3, U_STOLEN = 4 };

typedef void (*unit_fn)(const void *ctx, int64_t unit, int helper);
typedef void (*copy_fn)(const void *ctx, int64_t unit);

typedef struct {
    unit_fn fn;
    int64_t n;
    uint64_t job;
    int steal;                               /* 0: no shadow, the caller waits (parallel_for) */
    _Alignas(64) char ctx[CTX_BYTES];
} job_t;

static struct {
    pthread_mutex_t lock;                    /* held by the caller of a parallel step */
    int want, started;                       /* threads wanted (1 or 2), helper running */
    _Atomic uint64_t seq;                    /* job description seqlock (odd while written) */
    job_t job;
    _Atomic uint32_t wake;                   /* futex word: bumped at each job */
    _Atomic int sleeping;
    _Atomic uint64_t state[MAX_UNITS];
    uint64_t next_job;
    char *arena, *shadow, *hscratch;         /* grown, never freed (a late helper may read them) */
    size_t arena_bytes, shadow_bytes, hscratch_bytes;
    _Atomic int64_t stolen, helper_units;    /* counters (stats) */
    _Atomic int delay_us;                    /* tests: the helper sleeps this long in each unit */
} P = {.lock = PTHREAD_MUTEX_INITIALIZER, .want = 1};

static inline uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + t.tv_nsec;
}

static inline void cpu_relax(void) { __builtin_ia32_pause(); }

static void run_claims(const job_t *j, int helper) {
    for (int64_t u = 0; u < j->n; u++) {
        uint64_t v = atomic_load_explicit(&P.state[u], memory_order_acquire);
        if ((v >> 3) >= j->job) continue;
        if (!atomic_compare_exchange_strong(&P.state[u], &v, (j->job << 3) | (helper ? U_HELPER : U_MAIN))) continue;
        if (helper && atomic_load_explicit(&P.delay_us, memory_order_relaxed)) usleep(atomic_load(&P.delay_us));
        j->fn(j->ctx, u, helper && j->steal);
        if (helper) {
            uint64_t mine = (j->job << 3) | U_HELPER;
            if (atomic_compare_exchange_strong(&P.state[u], &mine, (j->job << 3) | U_DONE))
                atomic_fetch_add_explicit(&P.helper_units, 1, memory_order_relaxed);
        }
    }
}

static void *helper_main(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    for (;;) {
        /* wait for a job newer than the last one seen: spin SPIN_NS, then sleep on the futex */
        job_t j;
        uint64_t spin_from = now_ns();
        for (;;) {
            const uint64_t s1 = atomic_load_explicit(&P.seq, memory_order_acquire);
            if (!(s1 & 1) && s1 / 2 > seen) {
                memcpy(&j, &P.job, sizeof j);
                atomic_thread_fence(memory_order_acquire);
                if (atomic_load_explicit(&P.seq, memory_order_relaxed) == s1) break;
                continue;
            }
            if (now_ns() - spin_from < SPIN_NS) { cpu_relax(); continue; }
            const uint32_t w = atomic_load(&P.wake);
            atomic_store(&P.sleeping, 1);
            if (atomic_load(&P.seq) / 2 <= seen) syscall(SYS_futex, &P.wake, FUTEX_WAIT_PRIVATE, w, NULL, NULL, 0);
            atomic_store(&P.sleeping, 0);
            spin_from = now_ns();
        }
        seen = j.job;
        run_claims(&j, 1);
    }
    return NULL;
}

/* Run units 0 .. n-1 of fn on this thread and, where it is running, the helper; copy the
 * helper's finished units with copy. copy NULL: the helper writes where the caller would
 * (fn's helper flag 0 for both) and the caller waits for the helper's units however long
 * they take (as an OpenMP barrier does; for prefill's long regions, whose outputs need no
 * shadow). Called with P.lock held. */
static void parallel_for(unit_fn fn, copy_fn copy, const void *ctx, size_t ctx_bytes, int64_t n) {
    if (!P.started || n < 2 || n > MAX_UNITS || ctx_bytes > CTX_BYTES) {
        for (int64_t u = 0; u < n; u++) fn(ctx, u, 0);
        return;
    }
    const uint64_t job = ++P.next_job;
    atomic_fetch_add_explicit(&P.seq, 1, memory_order_acq_rel);  /* odd: being written */
    P.job.fn = fn;
    P.job.n = n;
    P.job.job = job;
    P.job.steal = copy != NULL;
    memcpy(P.job.ctx, ctx, ctx_bytes);
    atomic_fetch_add_explicit(&P.seq, 1, memory_order_release);  /* even: seq / 2 == job */
    atomic_fetch_add(&P.wake, 1);
    if (atomic_load(&P.sleeping)) syscall(SYS_futex, &P.wake, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    const job_t *j = &P.job;
    const uint64_t t0 = now_ns();
    run_claims(j, 0);
    /* the helper's units still running: wait a while (a unit's time, at least 20 us), then take them over */
    int64_t mine = 0;
    for (int64_t u = 0; u < n; u++) mine += (atomic_load(&P.state[u]) & 7) == U_MAIN;
    const uint64_t per = mine ? (now_ns() - t0) / mine : 0, deadline = now_ns() + (per > 20000 ? per : 20000);
    for (int64_t u = 0; u < n; u++) {
        for (;;) {
            uint64_t v = atomic_load_explicit(&P.state[u], memory_order_acquire);
            if ((v & 7) == U_DONE) {
                if (copy) copy(ctx, u);
                break;
            }
            if ((v & 7) != U_HELPER) break;  /* (U_MAIN: done here) */
            if (copy && now_ns() > deadline && atomic_compare_exchange_strong(&P.state[u], &v, (job << 3) | U_STOLEN)) {
                fn(ctx, u, 0);
                atomic_fetch_add_explicit(&P.stolen, 1, memory_order_relaxed);
                break;
            }
            cpu_relax();
        }
    }
}

/* The helper on (threads 2) or off (1), from radixd's thread setting; returns the threads in use. */
int set_threads(int threads) {
    pthread_mutex_lock(&P.lock);
    P.want = threads > 1 ? 2 : 1;
    if (P.want == 2 && !P.started) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, helper_main, NULL) == 0) P.started = 1;
        pthread_attr_destroy(&attr);
    }
    /* (a started helper stays; with want 1 parallel_for no longer hands it work) */
    const int out = P.want == 2 && P.started ? 2 : 1;
    pthread_mutex_unlock(&P.lock);
    return out;
}

/* Tests: the helper sleeps delay_us in each unit it takes (as if preempted there). */
void set_helper_delay(int delay_us) { atomic_store(&P.delay_us, delay_us); }

/* Units run by the helper, units taken back from it, and units run on AMX tiles (int matmuls, attention scores), since the start. */
void thread_stats(int64_t *out) {
    out[0] = atomic_load(&P.helper_units);
    out[1] = atomic_load(&P.stolen);
    out[2] = atomic_load(&amx_units);
}

static char *grow(char **buf, size_t *have, size_t need) {
    if (need > *have || !*buf) {  /* (a first call asking for nothing gets a buffer too: NULL means no memory) */
        need = need > 64 ? need : 64;
        char *b = aligned_alloc(64, (need + 63) / 64 * 64);  /* the old one stays: a late helper may use it */
        if (!b) return NULL;
        *buf = b;
        *have = need;
    }
    return *buf;
}

/* The parallel step's buffers: the arena (inputs the units read), the shadow (the helper's
 * outputs) and the helper's scratch; NULL where memory ran out (the caller runs alone). */
static int pool_begin(size_t arena, size_t shadow, size_t hscratch) {
    if (pthread_mutex_trylock(&P.lock)) return 0;
    if (!(P.want == 2 && P.started) || !grow(&P.arena, &P.arena_bytes, arena) || !grow(&P.shadow, &P.shadow_bytes, shadow)
        || !grow(&P.hscratch, &P.hscratch_bytes, hscratch)) {
        pthread_mutex_unlock(&P.lock);
        return 0;
    }
    return 1;
}

static void pool_end(void) { pthread_mutex_unlock(&P.lock); }

/* qmm's units: column-group ranges, every row. */
typedef struct {
    const uint8_t *w;
    act_t a;
    void *y, *shadow;
    int64_t M, N, K, ldy, per, bits;
    uint64_t job;                                /* (amx: the tile configuration's key) */
    int y_bf16, amx;
} qmm_ctx;

/* Unit u's column groups [*c0, *c1). */
static inline void qmm_groups(const qmm_ctx *c, int64_t u, int64_t *c0, int64_t *c1) {
    const int64_t C = (c->N + 15) / 16;
    *c0 = u * c->per;
    *c1 = *c0 + c->per < C ? *c0 + c->per : C;
}

VNNI_TARGET static void qmm_unit(const void *p, int64_t u, int helper) {
    const qmm_ctx *c = p;
    int64_t c0, c1;
    qmm_groups(c, u, &c0, &c1);
    void *y = helper ? c->shadow : c->y;
    if (c->amx) qmm_amx_range((int)c->bits, c->w, &c->a, c->M, c->N, c->K, y, c->y_bf16, c->ldy, c0, c1, c->job);
    else if (c->bits == 4) q4mm_range(c->w, &c->a, c->M, c->N, c->K, y, c->y_bf16, c->ldy, c0, c1);
    else q8mm_range(c->w, &c->a, c->M, c->N, c->K, y, c->y_bf16, c->ldy, c0, c1);
}

/* Column groups [c0, c1) of every row of y [M, N] (elements of e bytes, rows ldy apart) from
 * the helper's shadow: a matmul unit's results. */
static void copy_groups(void *y, const void *shadow, int64_t M, int64_t N, int64_t ldy, int64_t e, int64_t c0,
                        int64_t c1) {
    const int64_t n0 = c0 * 16, n1 = c1 * 16 < N ? c1 * 16 : N;
    for (int64_t m = 0; m < M; m++)
        memcpy((char *)y + (m * ldy + n0) * e, (const char *)shadow + (m * ldy + n0) * e, (n1 - n0) * e);
}

static void qmm_copy(const void *p, int64_t u) {
    const qmm_ctx *c = p;
    int64_t c0, c1;
    qmm_groups(c, u, &c0, &c1);
    copy_groups(c->y, c->shadow, c->M, c->N, c->ldy, c->y_bf16 ? 2 : 4, c0, c1);
}

/* qmm_run's matmul (activations already quantized into a) on both threads where allowed. */
/* Column groups per unit of a matmul of C groups: units of 1-2 % of the work, at least 2
 * groups each (qmm_par, i8_par). */
static inline int64_t groups_per_unit(int64_t C) {
    const int64_t per = (C + 47) / 48;
    return per < 2 ? 2 : per;
}

VNNI_TARGET static void qmm_par(int bits, const act_t *a, const uint8_t *w, void *y, int y_bf16, int64_t ldy, int64_t M,
                                int64_t N, int64_t K, void *shadow) {
    const int64_t C = (N + 15) / 16, per = groups_per_unit(C);
    static _Atomic uint64_t jobs;
    const int amx = a->amx;
    qmm_ctx c = {w, *a, y, shadow, M, N, K, ldy, per, bits, amx ? atomic_fetch_add(&jobs, 1) + 1 : 0, y_bf16, amx};
    if (!shadow) {  /* alone: one unit */
        c.per = C;
        qmm_unit(&c, 0, 0);
        return;
    }
    parallel_for(qmm_unit, qmm_copy, &c, sizeof c, (C + per - 1) / per);
}

/* decode attention's units: (chunk of members, KV head range). The step's requests are put in
 * groups whose KV rows start at the same slot (a prefix the radix cache serves to all of
 * them), each group in chunks of at most GRP_MAX members: order[chunk[c] .. chunk[c + 1]) are
 * chunk c's requests. */
typedef struct {
    const uint16_t *q, *k, *v;
    const int64_t *slots, *lens, *order, *chunk;
    uint16_t *out, *shadow;
    float *scratch, *hscratch;
    int64_t Hq, Hkv, D, L, split, S, M;
    float scale;
} att_ctx;

/* Unit u's chunk *ci and KV heads [*h0, *h1) (empty where the split has more parts than heads). */
static inline void att_heads(const att_ctx *c, int64_t u, int64_t *ci, int64_t *h0, int64_t *h1) {
    const int64_t part = u % c->split, per = (c->Hkv + c->split - 1) / c->split;
    *ci = u / c->split;
    *h0 = part * per;
    *h1 = *h0 + per < c->Hkv ? *h0 + per : c->Hkv;
}

/* Chunk ci's members: their count (0: a late helper read another step's, out of range). */
static inline int64_t att_members(const att_ctx *c, int64_t ci, int64_t *bs) {
    const int64_t m0 = __atomic_load_n(&c->chunk[ci], __ATOMIC_RELAXED);
    const int64_t R = __atomic_load_n(&c->chunk[ci + 1], __ATOMIC_RELAXED) - m0;
    if (m0 < 0 || R < 1 || R > GRP_MAX || m0 + R > c->M) return 0;
    for (int64_t r = 0; r < R; r++) {
        bs[r] = __atomic_load_n(&c->order[m0 + r], __ATOMIC_RELAXED);
        if (bs[r] < 0 || bs[r] >= c->M) return 0;
    }
    return R;
}

BF16_TARGET static void att_unit(const void *p, int64_t u, int helper) {
    const att_ctx *c = p;
    int64_t ci, h0, h1, bs[GRP_MAX], ns[GRP_MAX];
    att_heads(c, u, &ci, &h0, &h1);
    if (h0 >= h1) return;
    const int64_t R = att_members(c, ci, bs);
    const uint16_t *qs[GRP_MAX];
    const int64_t *rows[GRP_MAX];
    uint16_t *outs[GRP_MAX];
    for (int64_t r = 0; r < R; r++) {
        const int64_t b = bs[r], n = __atomic_load_n(&c->lens[b], __ATOMIC_RELAXED);  /* (read once: see below) */
        const int64_t *row = c->slots + b * c->L;
        if (helper) {
            /* A helper still running a unit the caller took back reads the caller's buffers as
             * they are by then (another step's, reused for other data): it works on its own copy
             * of the slots, checked to lie inside the pool and its scratch, or it would read and
             * write out of bounds. (The caller's own were checked before the step.) */
            if (n < 1 || n > c->L) return;
            int64_t *mine = (int64_t *)(c->hscratch + GRP_MAX * c->Hq * c->L) + r * c->L;
            for (int64_t j = 0; j < n; j++) {
                const int64_t s = __atomic_load_n(&row[j], __ATOMIC_RELAXED);
                if ((uint64_t)s >= (uint64_t)c->S) return;
                mine[j] = s;
            }
            row = mine;
        }
        qs[r] = c->q + b * c->Hq * c->D;
        rows[r] = row;
        ns[r] = n;
        outs[r] = (helper ? c->shadow : c->out) + b * c->Hq * c->D;
    }
    if (R) attend_bf16dp(qs, c->k, c->v, rows, ns, outs, R, h0, h1, c->Hq, c->Hkv, c->D, c->scale,
                         helper ? c->hscratch : c->scratch, c->Hq * c->L);
}

static void att_copy(const void *p, int64_t u) {
    const att_ctx *c = p;
    const int64_t G = c->Hq / c->Hkv;
    int64_t ci, h0, h1, bs[GRP_MAX];
    att_heads(c, u, &ci, &h0, &h1);
    if (h0 >= h1) return;
    const int64_t R = att_members(c, ci, bs);
    for (int64_t r = 0; r < R; r++) {
        const int64_t off = bs[r] * c->Hq * c->D + h0 * G * c->D;
        memcpy(c->out + off, c->shadow + off, (h1 - h0) * G * c->D * sizeof(uint16_t));
    }
}

/* The step's chunks (att_ctx): requests grouped by their rows' first slot, in order of first
 * appearance; returns the number of chunks. */
static int64_t att_groups(const int64_t *slots, int64_t M, int64_t W, int64_t *order, int64_t *chunk, int64_t *used) {
    int64_t placed = 0, n = 0;
    memset(used, 0, M * sizeof(int64_t));
    for (int64_t t = 0; t < M; t++) {
        if (used[t]) continue;
        int64_t in_chunk = 0;
        for (int64_t t2 = t; t2 < M; t2++) {
            if (used[t2] || slots[t2 * W] != slots[t * W]) continue;
            if (in_chunk == 0) chunk[n++] = placed;
            used[t2] = 1;
            order[placed++] = t2;
            in_chunk = in_chunk + 1 == GRP_MAX ? 0 : in_chunk + 1;
        }
    }
    chunk[n] = placed;
    return n;
}

/* The dequantization for prefill's GEMMs: column ranges on both threads (no shadow: the
 * caller waits for the helper, as for a torch GEMM's OpenMP threads in the same step). */
typedef struct {
    const uint8_t *w;
    uint16_t *out;
    int64_t N, K, per, bits, ldo;
} deq_ctx;

VNNI_TARGET static void deq_unit(const void *p, int64_t u, int helper) {
    (void)helper;
    const deq_ctx *c = p;
    const int64_t n0 = u * c->per * 16, n1 = n0 + c->per * 16;
    qdequant_cols_bf16_t((int)c->bits, c->w, c->out + n0, c->N, c->K, n0, n1 < c->N ? n1 : c->N, c->ldo);
}

/* A q4 / q8 weight dequantized to bf16 and transposed, out [K, N] in rows of ldo >= N
 * elements (x @ out is x @ W.T), for the GEMMs of many rows. Each 16-column record writes
 * one 32-byte piece of K rows: rows ldo apart, where 2 ldo is a multiple of 4 KiB or near
 * one (N = 3072: 6 KiB), fall into a few cache sets and evict each other (the caller pads
 * ldo to an odd number of 32-byte pieces). */
VNNI_TARGET void qdequant_bf16_t(int bits, const uint8_t *w, uint16_t *out, int64_t N, int64_t K, int64_t ldo) {
    const int64_t C = (N + 15) / 16, per = (C + 15) / 16;
    deq_ctx c = {w, out, N, K, per, bits, ldo};
    if (pool_begin(0, 0, 0)) {
        parallel_for(deq_unit, NULL, &c, sizeof c, (C + per - 1) / per);
        pool_end();
    } else {
        c.per = C;
        deq_unit(&c, 0, 0);
    }
}

/* decode_bf16 / decode_f32 on both threads where the helper runs: one unit per (request, KV
 * head), KV head by KV head (the requests' units of a head one after another: a prefix they
 * share is read from memory by the first and from the caches by the next); the step's queries,
 * slots and lengths copied into the arena first (a late helper reads only those, its slots
 * checked to lie in the pool), the helper's results through the shadow. */
typedef struct {
    const void *q, *k, *v;
    const int64_t *slots, *lens;
    void *out, *shadow;
    float *scratch, *hscratch;
    int64_t Hq, Hkv, D, L, S, e;
    float scale;
    int fast;                                    /* float32: att_f32_avx2 (head_dim a multiple of 8) */
    int64_t B;                                   /* the requests */
    int kvt;                                     /* the pool's elements (KV_F32, KV_F16, KV_BF16; fast only) */
} dec_ctx;

/* Four floats' sums of four vectors: {sum a0, sum a1, sum a2, sum a3}. */
FMA_TARGET static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

FMA_TARGET static inline float hsum1(__m256 a) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

/* decode_f32_head's contract on an AVX2 CPU, D a multiple of 8 (at most MAX_D), for GH query
 * heads of the KV head at once (GH and DV = D / 8 known when compiled, so that every sum stays
 * in a register; the first version kept some on the stack, a store and a load per multiply-add,
 * and ran at a third of this speed):
 * - scores two keys at a time, each key's row loaded once for the GH heads (2 GH sums), the
 *   running maximum in vector lanes;
 * - the values' weighted sums in tiles of ATT_TK keys (their rows stay in the L1 cache), two
 *   vectors of the row at a time for the GH heads (2 GH sums), the sums kept in acc between
 *   tiles. Each output sums its keys in order, as decode_f32_head does. */
#define ATT_TK 32

/* The pool's element types the AVX2 decode attention reads (q and out are float32): */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

/* Eight elements of a pool row at p (elements of type kvt), as float32. */
FMA_TARGET static inline __attribute__((always_inline)) __m256 kv_load8(const void *p, const int kvt) {
    if (kvt == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (kvt == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}

/* n float32 values (n a multiple of 8) into a pool row of float16 or bfloat16 (kvt), rounded
 * to nearest even as torch's conversions round. */
FMA_TARGET static inline void kv_store(const float *x, uint16_t *out, int64_t n, const int kvt) {
    for (int64_t i = 0; i < n; i += 8) {
        if (kvt == KV_F16) {
            _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
        } else {
            for (int64_t l = 0; l < 8; l++) out[i + l] = f32_to_bf16(x[i + l]);
        }
    }
}

/* Element e of a pool buffer of element type kvt. */
static inline __attribute__((always_inline)) const void *kv_at(const void *buf, int64_t e, const int kvt) {
    return (const char *)buf + e * (kvt == KV_F32 ? 4 : 2);
}

FMA_TARGET static inline __attribute__((always_inline)) void att_f32_tile(
        const float *q, const void *k, const void *v, const int64_t *row, int64_t n, float *out, int64_t Hkv,
        int64_t h, float scale, float *sc, const int GH, const int64_t DV, const int kvt) {
    const int64_t D = 8 * DV;
    const __m128 vscale = _mm_set1_ps(scale);
    __m128 top01 = _mm_set1_ps(-FLT_MAX), top2 = _mm_set1_ps(-FLT_MAX);  /* lanes: (h0 h0 h1 h1), (h2 h2 . .) */
    int64_t j = 0;
    for (; j + 2 <= n; j += 2) {
        const void *ka = kv_at(k, (row[j] * Hkv + h) * D, kvt), *kb = kv_at(k, (row[j + 1] * Hkv + h) * D, kvt);
        __m256 a[3], b[3];
#pragma GCC unroll 3
        for (int i = 0; i < 3; i++) a[i] = b[i] = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int64_t d = 0; d < DV; d++) {
            const __m256 x = kv_load8(kv_at(ka, 8 * d, kvt), kvt), y = kv_load8(kv_at(kb, 8 * d, kvt), kvt);
#pragma GCC unroll 3
            for (int i = 0; i < GH; i++) {
                const __m256 u = _mm256_loadu_ps(q + i * D + 8 * d);
                a[i] = _mm256_fmadd_ps(u, x, a[i]);
                b[i] = _mm256_fmadd_ps(u, y, b[i]);
            }
        }
        const __m128 s01 = _mm_mul_ps(hsum4(a[0], b[0], GH > 1 ? a[1] : a[0], GH > 1 ? b[1] : b[0]), vscale);
        top01 = _mm_max_ps(top01, s01);
        _mm_storel_pi((__m64 *)(sc + j), s01);
        if (GH > 1) _mm_storeh_pi((__m64 *)(sc + n + j), s01);
        if (GH > 2) {
            const __m128 s2 = _mm_mul_ps(hsum4(a[2], b[2], a[2], b[2]), vscale);
            top2 = _mm_max_ps(top2, s2);
            _mm_storel_pi((__m64 *)(sc + 2 * n + j), s2);
        }
    }
    float top[3];
    {
        float t4[4], u4[4];
        _mm_storeu_ps(t4, top01);
        _mm_storeu_ps(u4, top2);
        top[0] = t4[0] > t4[1] ? t4[0] : t4[1];
        top[1] = t4[2] > t4[3] ? t4[2] : t4[3];
        top[2] = u4[0] > u4[1] ? u4[0] : u4[1];
    }
    for (; j < n; j++) {
        const void *kr = kv_at(k, (row[j] * Hkv + h) * D, kvt);
        for (int i = 0; i < GH; i++) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < DV; d++)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i * D + 8 * d), kv_load8(kv_at(kr, 8 * d, kvt), kvt), a);
            const float s1 = hsum1(a) * scale;
            sc[i * n + j] = s1;
            top[i] = s1 > top[i] ? s1 : top[i];
        }
    }
    float inv[3];
    for (int i = 0; i < GH; i++) {
        float z = 0.f, *si = sc + i * n;
        const float ti = top[i];
        _Pragma("omp simd reduction(+:z)")
        for (int64_t jj = 0; jj < n; jj++) { si[jj] = expf(si[jj] - ti); z += si[jj]; }
        inv[i] = 1.f / z;
    }
    float acc[3][MAX_D] __attribute__((aligned(32)));
    for (int i = 0; i < GH; i++) memset(acc[i], 0, D * sizeof(float));
    for (int64_t j0 = 0; j0 < n; j0 += ATT_TK) {
        const int64_t t = n - j0 < ATT_TK ? n - j0 : ATT_TK;
        const void *vr[ATT_TK];
        for (int64_t jj = 0; jj < t; jj++) vr[jj] = kv_at(v, (row[j0 + jj] * Hkv + h) * D, kvt);
#pragma GCC unroll 8
        for (int64_t d = 0; d < DV; d += 2) {
            const int two = d + 1 < DV;  /* (an odd last vector alone) */
            __m256 a[3], b[3];
#pragma GCC unroll 3
            for (int i = 0; i < GH; i++) {
                a[i] = _mm256_load_ps(acc[i] + 8 * d);
                b[i] = two ? _mm256_load_ps(acc[i] + 8 * d + 8) : _mm256_setzero_ps();
            }
            for (int64_t jj = 0; jj < t; jj++) {
                const __m256 x = kv_load8(kv_at(vr[jj], 8 * d, kvt), kvt);
                const __m256 y = two ? kv_load8(kv_at(vr[jj], 8 * d + 8, kvt), kvt) : x;
#pragma GCC unroll 3
                for (int i = 0; i < GH; i++) {
                    const __m256 p = _mm256_broadcast_ss(sc + i * n + j0 + jj);
                    a[i] = _mm256_fmadd_ps(p, x, a[i]);
                    if (two) b[i] = _mm256_fmadd_ps(p, y, b[i]);
                }
            }
#pragma GCC unroll 3
            for (int i = 0; i < GH; i++) {
                _mm256_store_ps(acc[i] + 8 * d, a[i]);
                if (two) _mm256_store_ps(acc[i] + 8 * d + 8, b[i]);
            }
        }
    }
    for (int i = 0; i < GH; i++) {
        const __m256 w = _mm256_set1_ps(inv[i]);
        for (int64_t d = 0; d < DV; d++) _mm256_storeu_ps(out + i * D + 8 * d, _mm256_mul_ps(_mm256_load_ps(acc[i] + 8 * d), w));
    }
}

#define ATT_CASE(GG, VV, T) case GG * 100 + VV: att_f32_tile(qg, k, v, row, n, o, Hkv, h, scale, sc, GG, VV, T); break;
#define ATT_SWITCH(T)                                                                                 \
    switch (gh * 100 + (DV == 4 || DV == 8 || DV == 16 ? DV : 0)) {                                 \
        ATT_CASE(1, 4, T) ATT_CASE(2, 4, T) ATT_CASE(3, 4, T)                                       \
        ATT_CASE(1, 8, T) ATT_CASE(2, 8, T) ATT_CASE(3, 8, T)                                       \
        ATT_CASE(1, 16, T) ATT_CASE(2, 16, T) ATT_CASE(3, 16, T)                                    \
        case 100: att_f32_tile(qg, k, v, row, n, o, Hkv, h, scale, sc, 1, DV, T); break;            \
        case 200: att_f32_tile(qg, k, v, row, n, o, Hkv, h, scale, sc, 2, DV, T); break;            \
        default: att_f32_tile(qg, k, v, row, n, o, Hkv, h, scale, sc, 3, DV, T); break;             \
    }

/* decode_f32_head's contract on an AVX2 CPU, D a multiple of 8, over a pool of float32,
 * float16 or bfloat16 (att_f32_avx2's kvt; a function of its own for each, so that each
 * compiles as the float32 one alone did): the G query heads in groups of three (two where G
 * is even and no multiple of three), each through att_f32_tile. */
#define DEFINE_ATT_AVX2(NAME, T)                                                                      \
FMA_TARGET static void NAME(const float *q, const void *k, const void *v, const int64_t *row, int64_t n, \
                            float *out, int64_t Hkv, int64_t h, float scale, float *scratch, int64_t G,  \
                            int64_t D) {                                                              \
    const int64_t DV = D / 8, step = G % 3 == 0 || G % 2 ? 3 : 2;                                     \
    for (int64_t g0 = 0; g0 < G; g0 += step) {                                                        \
        const int64_t gh = G - g0 < step ? G - g0 : step;                                             \
        const float *qg = q + g0 * D;                                                                 \
        float *o = out + g0 * D, *sc = scratch + g0 * n;                                              \
        ATT_SWITCH(T)                                                                                 \
    }                                                                                                 \
}
DEFINE_ATT_AVX2(att_avx2_f32, KV_F32)
DEFINE_ATT_AVX2(att_avx2_f16, KV_F16)
DEFINE_ATT_AVX2(att_avx2_bf16, KV_BF16)

static void att_f32_avx2(const float *q, const void *k, const void *v, const int64_t *row, int64_t n, float *out,
                         int64_t Hkv, int64_t h, float scale, float *scratch, int64_t G, int64_t D, int kvt) {
    if (kvt == KV_F16) att_avx2_f16(q, k, v, row, n, out, Hkv, h, scale, scratch, G, D);
    else if (kvt == KV_BF16) att_avx2_bf16(q, k, v, row, n, out, Hkv, h, scale, scratch, G, D);
    else att_avx2_f32(q, k, v, row, n, out, Hkv, h, scale, scratch, G, D);
}

static void dec_unit(const void *p, int64_t u, int helper) {
    const dec_ctx *c = p;
    const int64_t b = u % c->B, h = u / c->B, G = c->Hq / c->Hkv;  /* (KV head by KV head: see decode_mt) */
    const int64_t n = __atomic_load_n(&c->lens[b], __ATOMIC_RELAXED);
    const int64_t *row = c->slots + b * c->L;
    if (helper) {
        if (n < 1 || n > c->L) return;
        int64_t *mine = (int64_t *)(c->hscratch + G * c->L);
        for (int64_t j = 0; j < n; j++) {
            const int64_t s = __atomic_load_n(&row[j], __ATOMIC_RELAXED);
            if ((uint64_t)s >= (uint64_t)c->S) return;
            mine[j] = s;
        }
        row = mine;
    }
    const int64_t off = (b * c->Hq + h * G) * c->D;
    float *scratch = helper ? c->hscratch : c->scratch;
    if (c->e == 2)
        decode_bf16_head((const uint16_t *)c->q + off, c->k, c->v, row, n, (uint16_t *)(helper ? c->shadow : c->out) + off,
                         c->Hkv, h, c->scale, scratch, G, c->D);
    else if (c->fast)
        att_f32_avx2((const float *)c->q + off, c->k, c->v, row, n, (float *)(helper ? c->shadow : c->out) + off,
                     c->Hkv, h, c->scale, scratch, G, c->D, c->kvt);
    else
        decode_f32_head((const float *)c->q + off, c->k, c->v, row, n, (float *)(helper ? c->shadow : c->out) + off,
                        c->Hkv, h, c->scale, scratch, G, c->D);
}

static void dec_copy(const void *p, int64_t u) {
    const dec_ctx *c = p;
    const int64_t b = u % c->B, h = u / c->B, G = c->Hq / c->Hkv, off = ((b * c->Hq + h * G) * c->D) * c->e;
    memcpy((char *)c->out + off, (char *)c->shadow + off, G * c->D * c->e);
}

/* decode_bf16 (bf16 1) or decode_f32's contract, plus S (the pool's slots): on both threads
 * where the helper runs, else as they are. kvt: the pool's elements where they are not the
 * queries' (KV_F16, KV_BF16: float32 queries on an AVX2 CPU, fast, head_dim a multiple of 8;
 * else -1). */
int decode_mt(int bf16, const void *q, const void *k, const void *v, const int64_t *slots, const int64_t *lens,
              void *out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t L, float scale, float *scratch,
              int64_t S, int fast, int kvt) {
    const int64_t G = Hq / Hkv, e = bf16 ? 2 : 4;
    if (G > MAX_G || D > MAX_D || G * Hkv != Hq) return -1;
    fast = fast && !bf16 && D % 8 == 0;
    if (kvt != KV_F32 && (!fast || (kvt != KV_F16 && kvt != KV_BF16))) return -1;
    const size_t qbytes = (B * Hq * D * e + 63) / 64 * 64, sbytes = (B * L + B) * sizeof(int64_t);
    if (B * Hkv < 2 || B * Hkv > MAX_UNITS || !pool_begin(qbytes + sbytes, B * Hq * D * e, G * L * (sizeof(float) + sizeof(int64_t)))) {
        dec_ctx c = {q, k, v, slots, lens, out, NULL, scratch, NULL, Hq, Hkv, D, L, S, e, scale, fast, B, kvt};
        for (int64_t u = 0; u < B * Hkv; u++) dec_unit(&c, u, 0);
        return 0;
    }
    char *qc = P.arena;
    int64_t *sc = (int64_t *)(P.arena + qbytes);
    memcpy(qc, q, B * Hq * D * e);
    memcpy(sc, slots, B * L * sizeof(int64_t));
    memcpy(sc + B * L, lens, B * sizeof(int64_t));
    dec_ctx c = {qc, k, v, sc, sc + B * L, out, P.shadow, scratch, (float *)P.hscratch, Hq, Hkv, D, L, S, e, scale, fast, B,
                 kvt};
    parallel_for(dec_unit, dec_copy, &c, sizeof c, B * Hkv);
    pool_end();
    return 0;
}

int avx2_supported(void);

/* A step's new K or V rows into the pool: n rows of row float32 elements (ld apart) into
 * dst's slots loc (elements of type kvt: rounded to nearest even, as torch's to() rounds).
 * In the calling thread: torch's index_put here ran in its OpenMP threads beside radixd's
 * helper and took 46-470 us for 96 rows of the default model where 11 us was its own time.
 * Returns 0, -1 (a 16-bit pool without the AVX2 kernels, row not a multiple of 8), -4 (a slot
 * outside the pool). */
int kv_store_rows(const float *src, int64_t ld, const int64_t *loc, int64_t n, void *dst, int64_t row, int64_t S, int kvt) {
    if (kvt != KV_F32 && (!avx2_supported() || row % 8 || (kvt != KV_F16 && kvt != KV_BF16))) return -1;
    for (int64_t t = 0; t < n; t++)
        if ((uint64_t)loc[t] >= (uint64_t)S) return -4;
    for (int64_t t = 0; t < n; t++) {
        if (kvt == KV_F32) memcpy((float *)dst + loc[t] * row, src + t * ld, row * sizeof(float));
        else kv_store(src + t * ld, (uint16_t *)dst + loc[t] * row, row, kvt);
    }
    return 0;
}

/* ---- Prompt attention on an AVX2 CPU: every extend of a step (a prompt, or its chunk after
 * the request's cached prefix of p tokens) over the pool, read through its slots where they
 * lie (no gather), float32 queries over a pool of float32, float16 or bfloat16 (kvt).
 *
 * Query row i of an extend (position p + i) attends to its first p + i + 1 slots. A task is an
 * extend's KV head and a block of its rows: EXT_R query vectors (the block's rows times the
 * head's G query heads) held transposed, one per vector lane (qt[d][r]), so that a block of
 * EXT_KB keys' scores is an outer-product kernel (3 lane vectors x 4 keys, 12 sums in
 * registers), their running maximum, exponentials and sums are lane-wise (no horizontal
 * sums), and the values' weighted sums go into the output held transposed likewise
 * (ot[d][r], rescaled lane-wise where a lane's maximum rises). Exponentials are 2^x of
 * scores pre-scaled by log2(e) (a degree-6 polynomial, about 1 ulp). The keys above the
 * diagonal are left out block by block and masked inside the diagonal's blocks. */
#define EXT_R 24   /* query vectors of a task (three 8-lane vectors) */
#define EXT_KB 16  /* keys per block */

FMA_TARGET static inline __m256 exp2_neg(__m256 x) {  /* 2^x for x <= 0 (below -126: 2^-126) */
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5403530e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

typedef struct {
    const float *q;
    const void *k, *v;
    const int64_t *slots, *meta;                 /* meta: per extend its first row, rows, prefix, first slot */
    const int64_t *tasks, *bounds;               /* tasks: (extend, KV head, first row); unit u: tasks [bounds[u], bounds[u + 1]) */
    float *out;
    int64_t ldq, ldo, Hq, Hkv, D, QB;
    float c;                                     /* scale * log2(e) */
    int kvt;
} ext_ctx;

/* One block of keys' scores: st[jj][r] = qt[.][r] . key jj, for the t keys at kr, four keys
 * at a time: 12 sums and the 3 query vectors in registers. The empty asm keeps the query
 * vectors there: without it the compiler folded their loads into every multiply-add (12
 * loads for 12 of them) and the loads set the pace (57 against 139 GFLOP/s). */
FMA_TARGET static inline __attribute__((always_inline)) void ext_scores(const float *qt, const float *const *kr, int64_t t,
                                                                        int64_t D, float *st) {
    for (int64_t j = 0; j < t; j += 4) {
        const float *k0 = kr[j], *k1 = kr[j + 1 < t ? j + 1 : j], *k2 = kr[j + 2 < t ? j + 2 : j], *k3 = kr[j + 3 < t ? j + 3 : j];
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0, c0 = a0, c1 = a0, c2 = a0, d0 = a0,
               d1 = a0, d2 = a0;
        for (int64_t d = 0; d < D; d++) {
            __m256 x0 = _mm256_load_ps(qt + d * EXT_R), x1 = _mm256_load_ps(qt + d * EXT_R + 8),
                   x2 = _mm256_load_ps(qt + d * EXT_R + 16);
            __asm__("" : "+x"(x0), "+x"(x1), "+x"(x2));
            __m256 y = _mm256_broadcast_ss(k0 + d);
            a0 = _mm256_fmadd_ps(x0, y, a0); a1 = _mm256_fmadd_ps(x1, y, a1); a2 = _mm256_fmadd_ps(x2, y, a2);
            y = _mm256_broadcast_ss(k1 + d);
            b0 = _mm256_fmadd_ps(x0, y, b0); b1 = _mm256_fmadd_ps(x1, y, b1); b2 = _mm256_fmadd_ps(x2, y, b2);
            y = _mm256_broadcast_ss(k2 + d);
            c0 = _mm256_fmadd_ps(x0, y, c0); c1 = _mm256_fmadd_ps(x1, y, c1); c2 = _mm256_fmadd_ps(x2, y, c2);
            y = _mm256_broadcast_ss(k3 + d);
            d0 = _mm256_fmadd_ps(x0, y, d0); d1 = _mm256_fmadd_ps(x1, y, d1); d2 = _mm256_fmadd_ps(x2, y, d2);
        }
        float *s = st + j * EXT_R;  /* (rows past t: scratch the caller never reads) */
        _mm256_store_ps(s, a0); _mm256_store_ps(s + 8, a1); _mm256_store_ps(s + 16, a2);
        _mm256_store_ps(s + EXT_R, b0); _mm256_store_ps(s + EXT_R + 8, b1); _mm256_store_ps(s + EXT_R + 16, b2);
        _mm256_store_ps(s + 2 * EXT_R, c0); _mm256_store_ps(s + 2 * EXT_R + 8, c1); _mm256_store_ps(s + 2 * EXT_R + 16, c2);
        _mm256_store_ps(s + 3 * EXT_R, d0); _mm256_store_ps(s + 3 * EXT_R + 8, d1); _mm256_store_ps(s + 3 * EXT_R + 16, d2);
    }
}

/* ot[d][r] = ot[d][r] * alpha[r] + sum_jj pt[jj][r] * value jj [d], for the t values at vr
 * (four of the values' elements at a time, as the scores take four keys; D a multiple of 8). */
FMA_TARGET static inline __attribute__((always_inline)) void ext_values(const float *pt, const float *const *vr, int64_t t,
                                                                        int64_t D, const __m256 *alpha, float *ot) {
    for (int64_t d = 0; d < D; d += 4) {
        float *o = ot + d * EXT_R;
        __m256 a0 = _mm256_mul_ps(_mm256_load_ps(o), alpha[0]), a1 = _mm256_mul_ps(_mm256_load_ps(o + 8), alpha[1]),
               a2 = _mm256_mul_ps(_mm256_load_ps(o + 16), alpha[2]);
        __m256 b0 = _mm256_mul_ps(_mm256_load_ps(o + EXT_R), alpha[0]), b1 = _mm256_mul_ps(_mm256_load_ps(o + EXT_R + 8), alpha[1]),
               b2 = _mm256_mul_ps(_mm256_load_ps(o + EXT_R + 16), alpha[2]);
        __m256 c0 = _mm256_mul_ps(_mm256_load_ps(o + 2 * EXT_R), alpha[0]),
               c1 = _mm256_mul_ps(_mm256_load_ps(o + 2 * EXT_R + 8), alpha[1]),
               c2 = _mm256_mul_ps(_mm256_load_ps(o + 2 * EXT_R + 16), alpha[2]);
        __m256 d0 = _mm256_mul_ps(_mm256_load_ps(o + 3 * EXT_R), alpha[0]),
               d1 = _mm256_mul_ps(_mm256_load_ps(o + 3 * EXT_R + 8), alpha[1]),
               d2 = _mm256_mul_ps(_mm256_load_ps(o + 3 * EXT_R + 16), alpha[2]);
        for (int64_t j = 0; j < t; j++) {
            const float *p = pt + j * EXT_R, *w = vr[j] + d;
            __m256 x0 = _mm256_load_ps(p), x1 = _mm256_load_ps(p + 8), x2 = _mm256_load_ps(p + 16);
            __asm__("" : "+x"(x0), "+x"(x1), "+x"(x2));
            __m256 y = _mm256_broadcast_ss(w);
            a0 = _mm256_fmadd_ps(x0, y, a0); a1 = _mm256_fmadd_ps(x1, y, a1); a2 = _mm256_fmadd_ps(x2, y, a2);
            y = _mm256_broadcast_ss(w + 1);
            b0 = _mm256_fmadd_ps(x0, y, b0); b1 = _mm256_fmadd_ps(x1, y, b1); b2 = _mm256_fmadd_ps(x2, y, b2);
            y = _mm256_broadcast_ss(w + 2);
            c0 = _mm256_fmadd_ps(x0, y, c0); c1 = _mm256_fmadd_ps(x1, y, c1); c2 = _mm256_fmadd_ps(x2, y, c2);
            y = _mm256_broadcast_ss(w + 3);
            d0 = _mm256_fmadd_ps(x0, y, d0); d1 = _mm256_fmadd_ps(x1, y, d1); d2 = _mm256_fmadd_ps(x2, y, d2);
        }
        _mm256_store_ps(o, a0); _mm256_store_ps(o + 8, a1); _mm256_store_ps(o + 16, a2);
        _mm256_store_ps(o + EXT_R, b0); _mm256_store_ps(o + EXT_R + 8, b1); _mm256_store_ps(o + EXT_R + 16, b2);
        _mm256_store_ps(o + 2 * EXT_R, c0); _mm256_store_ps(o + 2 * EXT_R + 8, c1); _mm256_store_ps(o + 2 * EXT_R + 16, c2);
        _mm256_store_ps(o + 3 * EXT_R, d0); _mm256_store_ps(o + 3 * EXT_R + 8, d1); _mm256_store_ps(o + 3 * EXT_R + 16, d2);
    }
}

/* Pool row of slot s, KV head h, as float32: in place (a float32 pool) or converted into buf. */
FMA_TARGET static inline const float *ext_row(const void *buf, int64_t s, int64_t h, int64_t Hkv, int64_t D, int kvt, float *conv) {
    const int64_t e = (s * Hkv + h) * D;
    if (kvt == KV_F32) return (const float *)buf + e;
    for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(conv + d, kv_load8(kv_at(buf, e + d, kvt), kvt));
    return conv;
}

/* Task (extend x, KV head h, rows i0 .. i0 + QB - 1 of it). */
FMA_TARGET static void ext_task(const ext_ctx *c, int64_t x, int64_t h, int64_t i0) {
    const int64_t *mt = c->meta + 4 * x, *slots = c->slots + mt[3];
    const int64_t q0 = mt[0], e = mt[1], p = mt[2], G = c->Hq / c->Hkv, D = c->D, Hkv = c->Hkv;
    const int64_t m = e - i0 < c->QB ? e - i0 : c->QB, last = p + i0 + m, full = p + i0 + 1;
    float qt[MAX_D * EXT_R] __attribute__((aligned(32))), ot[MAX_D * EXT_R] __attribute__((aligned(32)));
    float st[EXT_KB * EXT_R] __attribute__((aligned(32))), conv[2 * EXT_KB * MAX_D] __attribute__((aligned(32)));
    memset(qt, 0, D * EXT_R * sizeof(float));
    memset(ot, 0, D * EXT_R * sizeof(float));
    float seen[EXT_R];                           /* lane r: the keys its row sees (padding lanes: all) */
    for (int64_t r = 0; r < EXT_R; r++) seen[r] = (float)(r < m * G ? p + i0 + r / G + 1 : last);
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < G; g++) {
            const float *qr = c->q + (q0 + i0 + i) * c->ldq + (h * G + g) * D;
            for (int64_t d = 0; d < D; d++) qt[d * EXT_R + i * G + g] = qr[d] * c->c;
        }
    __m256 top[3], sum[3], alpha[3], vis[3];
    for (int v = 0; v < 3; v++) {
        top[v] = _mm256_set1_ps(-FLT_MAX);
        sum[v] = _mm256_setzero_ps();
        vis[v] = _mm256_loadu_ps(seen + 8 * v);
    }
    const float *kr[EXT_KB], *vr[EXT_KB];
    for (int64_t j0 = 0; j0 < last; j0 += EXT_KB) {
        const int64_t t = last - j0 < EXT_KB ? last - j0 : EXT_KB;
        for (int64_t j = 0; j < t; j++) {
            kr[j] = ext_row(c->k, slots[j0 + j], h, Hkv, D, c->kvt, conv + j * D);
            vr[j] = ext_row(c->v, slots[j0 + j], h, Hkv, D, c->kvt, conv + (EXT_KB + j) * D);
        }
        ext_scores(qt, kr, t, D, st);
        const int masked = j0 + t > full;
        __m256 hi[3] = {top[0], top[1], top[2]};
        for (int64_t j = 0; j < t; j++) {
            const __m256 at = _mm256_set1_ps((float)(j0 + j));
            for (int v = 0; v < 3; v++) {
                __m256 s = _mm256_load_ps(st + j * EXT_R + 8 * v);
                if (masked) {
                    s = _mm256_blendv_ps(s, _mm256_set1_ps(-FLT_MAX), _mm256_cmp_ps(at, vis[v], _CMP_GE_OQ));
                    _mm256_store_ps(st + j * EXT_R + 8 * v, s);
                }
                hi[v] = _mm256_max_ps(hi[v], s);
            }
        }
        for (int v = 0; v < 3; v++) {
            alpha[v] = exp2_neg(_mm256_sub_ps(top[v], hi[v]));
            top[v] = hi[v];
            sum[v] = _mm256_mul_ps(sum[v], alpha[v]);
        }
        for (int64_t j = 0; j < t; j++) {
            const __m256 at = _mm256_set1_ps((float)(j0 + j));
            for (int v = 0; v < 3; v++) {
                __m256 w = exp2_neg(_mm256_sub_ps(_mm256_load_ps(st + j * EXT_R + 8 * v), top[v]));
                if (masked) w = _mm256_andnot_ps(_mm256_cmp_ps(at, vis[v], _CMP_GE_OQ), w);
                _mm256_store_ps(st + j * EXT_R + 8 * v, w);
                sum[v] = _mm256_add_ps(sum[v], w);
            }
        }
        ext_values(st, vr, t, D, alpha, ot);
    }
    float inv[EXT_R];
    for (int v = 0; v < 3; v++) _mm256_storeu_ps(inv + 8 * v, _mm256_div_ps(_mm256_set1_ps(1.f), sum[v]));
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t r = i * G + g;
            float *o = c->out + (q0 + i0 + i) * c->ldo + (h * G + g) * D;
            for (int64_t d = 0; d < D; d++) o[d] = ot[d * EXT_R + r] * inv[r];
        }
}

static void ext_unit(const void *p, int64_t u, int helper) {
    (void)helper;
    const ext_ctx *c = p;
    for (int64_t t = c->bounds[u]; t < c->bounds[u + 1]; t++) ext_task(c, c->tasks[3 * t], c->tasks[3 * t + 1], c->tasks[3 * t + 2]);
}

/* out[row, head, :] for the E extends of meta (int64 [E, 4]: first row, rows e >= 1, cached
 * prefix p >= 0, offset in slots of its p + e slots): softmax(q k^T * scale) v over its slots'
 * keys up to its own position, q and out float32 rows of Hq x D (ldq, ldo floats apart), T
 * rows in all; k / v the pool's buffers [S, Hkv, D] of element type kvt. On both threads
 * where the helper runs (no shadow: the caller waits for the helper's units, as for prefill's
 * GEMMs). The caller checked avx2_supported(). Returns 0, -1 (shapes), -2 (no memory), -4 (a
 * slot outside the pool, an extend outside the rows or the slots). */
FMA_TARGET int extend_mt(const float *q, int64_t ldq, const void *k, const void *v, int kvt, int64_t S,
                         const int64_t *slots, int64_t nslots, const int64_t *meta, int64_t E, int64_t T, float *out,
                         int64_t ldo, int64_t Hq, int64_t Hkv, int64_t D, float scale) {
    if (Hkv < 1 || Hq % Hkv || Hq / Hkv > MAX_G || D % 8 || D > MAX_D || D < 8 || (kvt != KV_F32 && kvt != KV_F16 && kvt != KV_BF16))
        return -1;
    const int64_t G = Hq / Hkv, QB = EXT_R / G > 0 ? EXT_R / G : 1;
    int64_t ntasks = 0;
    double total = 0;
    for (int64_t x = 0; x < E; x++) {
        const int64_t *mt = meta + 4 * x;
        if (mt[1] < 1 || mt[2] < 0 || mt[0] < 0 || mt[0] + mt[1] > T || mt[3] < 0 || mt[3] + mt[2] + mt[1] > nslots) return -4;
        ntasks += Hkv * ((mt[1] + QB - 1) / QB);
    }
    for (int64_t j = 0; j < nslots; j++)
        if ((uint64_t)slots[j] >= (uint64_t)S) return -4;
    int64_t *tasks = malloc((3 * ntasks + MAX_UNITS + 1) * sizeof(int64_t)), *bounds = tasks + 3 * ntasks;
    double *cost = malloc((ntasks + 1) * sizeof(double));
    if (!tasks || !cost) { free(tasks); free(cost); return -2; }
    /* KV head by KV head, then extend by extend: requests sharing a prefix one after another */
    int64_t n = 0;
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t x = 0; x < E; x++) {
            const int64_t *mt = meta + 4 * x;
            for (int64_t i0 = 0; i0 < mt[1]; i0 += QB) {
                tasks[3 * n] = x; tasks[3 * n + 1] = h; tasks[3 * n + 2] = i0;
                cost[n] = (double)(mt[2] + i0 + (mt[1] - i0 < QB ? mt[1] - i0 : QB)) + 64;
                total += cost[n++];
            }
        }
    /* units of about equal work, consecutive tasks each */
    int64_t units = 0;
    bounds[0] = 0;
    const double per = total / (ntasks < MAX_UNITS ? ntasks : MAX_UNITS);
    double acc = 0;
    for (int64_t t = 0; t < ntasks; t++) {
        acc += cost[t];
        if (acc >= per * (units + 1) - 1e-9 || t == ntasks - 1) bounds[++units] = t + 1;
        if (units == MAX_UNITS) { bounds[units] = ntasks; break; }
    }
    free(cost);
    ext_ctx c = {q, k, v, slots, meta, tasks, bounds, out, ldq, ldo, Hq, Hkv, D, QB, scale * 1.4426950408889634f, kvt};
    if (pool_begin(0, 0, 0)) {
        parallel_for(ext_unit, NULL, &c, sizeof c, units);
        pool_end();
    } else {
        for (int64_t u = 0; u < units; u++) ext_unit(&c, u, 0);
    }
    free(tasks);
    return 0;
}

/* ---- A decode step's decoder layers in one call (Llama's block: pre-norms, fused q/k/v and
 * gate/up projections, neox rotary, SiLU), every kernel as the layer-by-layer path calls it
 * (the same functions, the same bf16 roundings between them: bit for bit its result). */

typedef struct {
    const uint8_t *qkv, *o, *gate_up, *down;     /* q4 / q8 records */
    int64_t qkv_bits, o_bits, gate_up_bits, down_bits;
    const uint16_t *norm_in, *norm_post;         /* bf16 [hidden] */
    uint16_t *k_buf, *v_buf;                     /* the pool's buffers of this layer [slots, Hkv, D] */
    float eps_in, eps_post;
} dlayer_t;

typedef struct {
    int64_t hidden, inter, hq, hkv, dim, layers, max_pos;
    float scale;
    const float *cos, *sin;                      /* [max_pos, dim / 2] */
    int64_t kvt;                                 /* decode_layers_f32: the pool's elements (KV_F32, KV_F16, KV_BF16) */
} dmodel_t;

typedef struct {
    int64_t rows;                                /* tokens, one per request */
    const int64_t *pos, *loc;                    /* [rows]: positions, new slots */
    const int64_t *slots, *lens;                 /* [rows, width], [rows]: the requests' KV slots */
    int64_t width, pool_slots;                   /* (pool_slots: the buffers' first dimension) */
} dstep_t;

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* A decode step's positions, new slots, lengths and slots checked against the rotary table and
 * the pool: 0, -3 (a position past the table) or -4 (a slot outside the pool, a length outside
 * the table row). */
static int step_bad(const dmodel_t *m, const dstep_t *st) {
    const int64_t W = st->width;
    for (int64_t t = 0; t < st->rows; t++) {
        if (st->pos[t] < 0 || st->pos[t] >= m->max_pos) return -3;
        if (st->lens[t] < 1 || st->lens[t] > W || st->loc[t] < 0 || st->loc[t] >= st->pool_slots) return -4;
        for (int64_t j = 0; j < st->lens[t]; j++)
            if (st->slots[t * W + j] < 0 || st->slots[t * W + j] >= st->pool_slots) return -4;
    }
    return 0;
}

/* y [M, N] = x [M, K] @ W.T for a q4 (bits 4) or q8 (bits 8) weight; K a multiple of 32; x
 * float32 or bf16 (x_bf16), y likewise; act 1: x is [M, 2K] gate | up, multiplied as
 * SiLU(gate) * up. Any M: each column group's weights are read once from memory for all rows
 * (kept in L1 across the row chunks of 8). On both threads where the helper runs. Returns 0,
 * or -1 (shape out of range), -2 (no memory). The caller checked vnni_supported(). */
VNNI_TARGET int qmm_vnni(int bits, const void *x, int x_bf16, int64_t ldx, int act, const uint8_t *w, void *y,
                         int y_bf16, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if (M < 1 || K % 32 || (bits != 4 && bits != 8)) return -1;
    const size_t abytes = act_bytes(M, K), ybytes = M * ldy * (y_bf16 ? 2 : 4);
    const int par = pool_begin(abytes, ybytes, 0);
    char *mem = par ? P.arena : malloc(abytes);
    if (!mem) return -2;
    act_t a;
    float *tmp = act_init(&a, mem, M, K);
    quantize_act(x, x_bf16, ldx, act, M, K, &a, tmp);
    qmm_par(bits, &a, w, y, y_bf16, ldy, M, N, K, par ? P.shadow : NULL);
    if (par) pool_end();
    else free(mem);
    return 0;
}

/* ---- The same records on a CPU with AVX2, FMA and F16C but no AVX512-VNNI: float32
 * activations (not quantized), each weight dequantized once per call into a float panel,
 * multiplied in a 6-row x 16-column FMA kernel (12 accumulators in registers).
 *
 * A column group's panel holds its 16 columns' weights w = d * q + m (q4) or d * (u - 128)
 * (q8), input-major: pan[i * 16 + l] = W[16c + l, i]. Up to FMA_FEW rows (a decode step) take
 * no panel: the weights are dequantized in registers (fma_few); for more rows (a prefill) the
 * group's whole panel (K * 64 bytes, in L2) is made once and each chunk of 6 rows reads it. Each weight is read from memory once per call; the sums are float32 fused
 * multiply-adds, in input order within a row. On an AVX2 CPU (a 2-core AMD EPYC) this served
 * a decode step of 8 requests' int matmuls (the default model) in place of torch's int4
 * kernel on bf16 activations (see cpu_int). */

#define FMA_ROWS 6   /* rows per pass of the kernel (2 x 6 accumulators) */

/* 1 where this CPU runs the AVX2 kernels. */
int avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* Block b's 32 x 16 weights of one column group (its record) into pan [32][16] floats. */
FMA_TARGET static inline void fma_panel(int bits, const uint8_t *rec, float *pan) {
    if (bits == 4) {
        const __m256i low = _mm256_set1_epi32(0x0F);
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 256 + 16 * h)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h)));
            for (int j = 0; j < 4; j++) {
                /* lane l: column 8h + l; byte t: input 8j + t (low nibble), 8j + 4 + t (high) */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h));
                for (int t = 0; t < 4; t++) {
                    const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(v, 8 * t), low);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(v, 8 * t + 4), low);
                    _mm256_store_ps(pan + (8 * j + t) * 16 + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), d, m));
                    _mm256_store_ps(pan + (8 * j + 4 + t) * 16 + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), d, m));
                }
            }
        }
    } else {
        const __m256i low = _mm256_set1_epi32(0xFF);
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 512 + 16 * h)));
            const __m256 m = _mm256_mul_ps(d, _mm256_set1_ps(-128.f));
            for (int j = 0; j < 8; j++) {
                /* lane l: column 8h + l; byte t: input 4j + t, stored + 128 */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h));
                for (int t = 0; t < 4; t++) {
                    const __m256i u = _mm256_and_si256(_mm256_srli_epi32(v, 8 * t), low);
                    _mm256_store_ps(pan + (4 * j + t) * 16 + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(u), d, m));
                }
            }
        }
    }
}

/* acc[2r], acc[2r + 1] += x[r][0 .. n) @ pan[0 .. n) (16 columns), R rows ldx apart (the
 * accumulators in named registers through the loop: an array of them was kept on the stack). */
#define FMA_ROW(r) if (R > r) {                                                                   \
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + i);                                    \
        a##r##0 = _mm256_fmadd_ps(xb, w0, a##r##0);                                                \
        a##r##1 = _mm256_fmadd_ps(xb, w1, a##r##1);                                                \
    }
FMA_TARGET static inline __attribute__((always_inline)) void fma_tile(const float *pan, const float *x, int64_t ldx,
                                                                      int64_t n, const int R, __m256 *acc) {
    __m256 a00 = acc[0], a01 = acc[1], a10 = acc[2 % (2 * R)], a11 = acc[3 % (2 * R)], a20 = acc[4 % (2 * R)],
           a21 = acc[5 % (2 * R)], a30 = acc[6 % (2 * R)], a31 = acc[7 % (2 * R)], a40 = acc[8 % (2 * R)],
           a41 = acc[9 % (2 * R)], a50 = acc[10 % (2 * R)], a51 = acc[11 % (2 * R)];
    for (int64_t i = 0; i < n; i++) {
        const __m256 w0 = _mm256_load_ps(pan + 16 * i), w1 = _mm256_load_ps(pan + 16 * i + 8);
        FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)
    }
    acc[0] = a00; acc[1] = a01;
    if (R > 1) { acc[2] = a10; acc[3] = a11; }
    if (R > 2) { acc[4] = a20; acc[5] = a21; }
    if (R > 3) { acc[6] = a30; acc[7] = a31; }
    if (R > 4) { acc[8] = a40; acc[9] = a41; }
    if (R > 5) { acc[10] = a50; acc[11] = a51; }
}

/* Few rows (a decode step): R <= FMA_FEW rows times one half (8 columns) of a column group,
 * every block, the weights' integers converted in registers (no panel): per input one vector
 * of them, R fused multiply-adds, summed over the block's 32 inputs and only then scaled:
 * sum_i x_i (d q_i + m) = d sum_i x_i q_i + m sum_i x_i, with xs[r * B + b] row r's sum over
 * block b (q4; q8 stores u = q + 128 and has no m: its bytes are read back as q). Each
 * dequantized weight cost a fused multiply-add (d q + m) the products did not need, and its
 * latency on the way to them. t[r] is row r's result over the 8 columns 8h .. 8h + 7. */
#define FMA_FEW 8
#define FEW_ROW(r) if (R > r) a##r = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + r * K + i), w, a##r);
#define FEW_INPUT(WV, I) { const __m256 w = WV; const int64_t i = (I); FEW_ROW(0) FEW_ROW(1) FEW_ROW(2) FEW_ROW(3) \
                           FEW_ROW(4) FEW_ROW(5) FEW_ROW(6) FEW_ROW(7) }
#define FEW_SCALE(r) if (R > r) { t[r] = _mm256_fmadd_ps(d, a##r, t[r]); a##r = _mm256_setzero_ps(); }
#define FEW_MIN(r) if (R > r) t[r] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + r * B + b), t[r]);
FMA_TARGET static inline __attribute__((always_inline)) void fma_few(int bits, const uint8_t *wc, int64_t B, const float *x,
                                                                     const float *xs, int64_t K, int h, const int R,
                                                                     __m256 *t) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int r = 0; r < R; r++) t[r] = a0;
    if (bits == 4) {
        for (int64_t b = 0; b < B; b++) {
            const uint8_t *rec = wc + b * Q4_REC;
            const float *xr = x + 32 * b;
            for (int j = 0; j < 4; j++) {
                /* byte u of a lane: input 8j + u in its low nibble, 8j + 4 + u in its high one,
                 * each moved to the top of the lane and shifted back down (no mask to hold) */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h));
#define Q4_NIBBLE(s) _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_slli_epi32(v, s), 28))
                FEW_INPUT(Q4_NIBBLE(28), 8 * j) FEW_INPUT(Q4_NIBBLE(24), 8 * j + 4)
                FEW_INPUT(Q4_NIBBLE(20), 8 * j + 1) FEW_INPUT(Q4_NIBBLE(16), 8 * j + 5)
                FEW_INPUT(Q4_NIBBLE(12), 8 * j + 2) FEW_INPUT(Q4_NIBBLE(8), 8 * j + 6)
                FEW_INPUT(Q4_NIBBLE(4), 8 * j + 3) FEW_INPUT(Q4_NIBBLE(0), 8 * j + 7)
#undef Q4_NIBBLE
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 256 + 16 * h)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h)));
            FEW_SCALE(0) FEW_SCALE(1) FEW_SCALE(2) FEW_SCALE(3) FEW_SCALE(4) FEW_SCALE(5) FEW_SCALE(6) FEW_SCALE(7)
            FEW_MIN(0) FEW_MIN(1) FEW_MIN(2) FEW_MIN(3) FEW_MIN(4) FEW_MIN(5) FEW_MIN(6) FEW_MIN(7)
        }
    } else {
        const __m256i top = _mm256_set1_epi32((int)0x80808080u);
        for (int64_t b = 0; b < B; b++) {
            const uint8_t *rec = wc + b * Q8_REC;
            const float *xr = x + 32 * b;
            for (int j = 0; j < 8; j++) {
                /* bytes u = q + 128: with the top bit flipped, q as a signed byte, moved to the top and shifted back */
                const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h)), top);
                FEW_INPUT(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24)), 4 * j)
                FEW_INPUT(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24)), 4 * j + 1)
                FEW_INPUT(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24)), 4 * j + 2)
                FEW_INPUT(_mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24)), 4 * j + 3)
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 512 + 16 * h)));
            FEW_SCALE(0) FEW_SCALE(1) FEW_SCALE(2) FEW_SCALE(3) FEW_SCALE(4) FEW_SCALE(5) FEW_SCALE(6) FEW_SCALE(7)
        }
    }
}

/* Rows r0 .. r0 + R - 1's 16 (or the last N - n0) outputs from the accumulators. */
FMA_TARGET static inline __attribute__((always_inline)) void fma_store(const __m256 *acc, int R, void *y, int y_bf16, int64_t ldy, int64_t n0, int64_t N) {
    const int64_t cols = N - n0 < 16 ? N - n0 : 16;
    for (int r = 0; r < R; r++) {
        float v[16];
        _mm256_storeu_ps(v, acc[2 * r]);
        _mm256_storeu_ps(v + 8, acc[2 * r + 1]);
        if (y_bf16) {
            uint16_t *o = (uint16_t *)y + r * ldy + n0;
            for (int64_t l = 0; l < cols; l++) o[l] = f32_to_bf16(v[l]);
        } else {
            memcpy((float *)y + r * ldy + n0, v, cols * sizeof(float));
        }
    }
}

#define FMA_CASE(R) case R: {                                                                       \
    __m256 acc[2 * R];                                                                             \
    for (int i = 0; i < 2 * R; i++) acc[i] = _mm256_setzero_ps();                                  \
    fma_tile(pan, xr, K, K, R, acc);                                                               \
    fma_store(acc, R, (char *)y + r0 * ldy * (y_bf16 ? 2 : 4), y_bf16, ldy, n0, N);               \
    break; }

/* y [M, N] (columns of groups c0 .. c1 - 1) = x [M, K] (float32, rows K apart) @ W.T: with
 * few (a matmul of at most FMA_FEW rows: M of them) through fma_few, xs the rows' sums over
 * each block of 32 inputs (fma_block_sums; q4 only); else (M rows of a row block of a larger
 * matmul, any number of them) through the panel, pan a float scratch of K * 16
 * (fma_panel_floats), 32-byte aligned. */
FMA_TARGET static void fma_range(int bits, const uint8_t *w, const float *x, const float *xs, int few, int64_t M,
                                 int64_t N, int64_t K, void *y, int y_bf16, int64_t ldy, int64_t c0, int64_t c1,
                                 float *pan) {
    const int64_t B = K / 32, rec_bytes = bits == 4 ? Q4_REC : Q8_REC;
    for (int64_t c = c0; c < c1; c++) {
        const uint8_t *wc = w + c * B * rec_bytes;
        const int64_t n0 = c * 16;
        if (few) {
            __m256 acc[2 * FMA_FEW];
            __m256 half[FMA_FEW];
            for (int h = 0; h < 2; h++) {
                switch (M) {
                    case 1: fma_few(bits, wc, B, x, xs, K, h, 1, half); break;
                    case 2: fma_few(bits, wc, B, x, xs, K, h, 2, half); break;
                    case 3: fma_few(bits, wc, B, x, xs, K, h, 3, half); break;
                    case 4: fma_few(bits, wc, B, x, xs, K, h, 4, half); break;
                    case 5: fma_few(bits, wc, B, x, xs, K, h, 5, half); break;
                    case 6: fma_few(bits, wc, B, x, xs, K, h, 6, half); break;
                    case 7: fma_few(bits, wc, B, x, xs, K, h, 7, half); break;
                    default: fma_few(bits, wc, B, x, xs, K, h, 8, half); break;
                }
                for (int64_t r = 0; r < M; r++) acc[2 * r + h] = half[r];
            }
            fma_store(acc, (int)M, y, y_bf16, ldy, n0, N);
            continue;
        }
        for (int64_t b = 0; b < B; b++) fma_panel(bits, wc + b * rec_bytes, pan + b * 32 * 16);
        for (int64_t r0 = 0; r0 < M; r0 += FMA_ROWS) {
            const float *xr = x + r0 * K;
            switch (M - r0 < FMA_ROWS ? M - r0 : FMA_ROWS) {
                FMA_CASE(1) FMA_CASE(2) FMA_CASE(3) FMA_CASE(4) FMA_CASE(5) FMA_CASE(6)
            }
        }
    }
}

/* The scratch floats a matmul of M rows by K inputs needs: the panel (fma_range), or up to
 * FMA_FEW rows the rows' block sums (fma_block_sums). */
static inline int64_t fma_panel_floats(int64_t M, int64_t K) { return M > FMA_FEW ? K * 16 : M * (K / 32) + 16; }

/* A thread's panel scratch (grown, never freed: a late helper's unit may still use its own). */
static float *fma_scratch(int64_t floats) {
    static __thread float *buf;
    static __thread int64_t have;
    if (floats > have) {
        float *b = aligned_alloc(64, (size_t)(floats * sizeof(float) + 63) / 64 * 64);
        if (!b) return NULL;
        buf = b;
        have = floats;
    }
    return buf;
}

/* Up to FMA_FEW rows of x [M, K]: each row's sums over its blocks of 32 inputs (fma_few's m
 * term), once per matmul, in the calling thread's scratch (grown before the call by its
 * fma_scratch(fma_panel_floats(M, K)); never freed: a late helper may still read it). */
static const float *fma_block_sums(const float *x, int64_t M, int64_t K) {
    float *xs = fma_scratch(fma_panel_floats(M, K));
    const int64_t B = K / 32;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < B; b++) {
            float z = 0.f;
            for (int i = 0; i < 32; i++) z += x[r * K + 32 * b + i];
            xs[r * B + b] = z;
        }
    return xs;
}

/* The units of a matmul (fma_par): row blocks of mc rows times column ranges of per groups.
 * A block's activations (mc x K floats) stay in the L2 cache while each column group of its
 * unit passes over them; with the whole of x read once per column group (the first version),
 * a prompt's GEMM read hundreds of MB of activations per call from L3 or memory and ran at
 * 100-120 GFLOP/s on the 2-core EPYC where 256 rows ran at 170. A panel is dequantized once
 * per block (about 3 / mc of the multiply-adds' work). */
#define FMA_L2 (384 * 1024)       /* bytes of a block's activations and its panel */
#define FMA_MIN_MC 24
#define FMA_UNITS 48              /* units of 1-2 % of the work where the row blocks are fewer */
typedef struct {
    const uint8_t *w;
    const float *x, *xs;                         /* xs: up to FMA_FEW rows, their block sums */
    void *y, *shadow;
    float *hpan;                                 /* the helper's panel scratch */
    int64_t M, N, K, ldy, per, bits, mc, parts;  /* parts: column ranges per row block */
    int y_bf16;
} fma_ctx;

/* Unit u's rows [*r0, *r0 + *m) and column groups [*c0, *c1). */
static inline void fma_unit_span(const fma_ctx *c, int64_t u, int64_t *r0, int64_t *m, int64_t *c0, int64_t *c1) {
    const int64_t C = (c->N + 15) / 16, part = u % c->parts;
    *r0 = u / c->parts * c->mc;
    *m = c->M - *r0 < c->mc ? c->M - *r0 : c->mc;
    *c0 = part * c->per;
    *c1 = *c0 + c->per < C ? *c0 + c->per : C;
}

FMA_TARGET static void fma_unit(const void *p, int64_t u, int helper) {
    const fma_ctx *c = p;
    int64_t r0, m, c0, c1;
    fma_unit_span(c, u, &r0, &m, &c0, &c1);
    /* (the caller's panel was allocated before the step, the helper's is the pool's scratch) */
    float *pan = helper ? c->hpan : fma_scratch(fma_panel_floats(c->M, c->K));
    if (c0 >= c1 || m < 1) return;
    char *y = (char *)(helper ? c->shadow : c->y) + r0 * c->ldy * (c->y_bf16 ? 2 : 4);
    fma_range((int)c->bits, c->w, c->x + r0 * c->K, c->xs, c->M <= FMA_FEW, m, c->N, c->K, y, c->y_bf16, c->ldy, c0,
              c1, pan);
}

static void fma_copy(const void *p, int64_t u) {
    const fma_ctx *c = p;
    int64_t r0, m, c0, c1;
    fma_unit_span(c, u, &r0, &m, &c0, &c1);
    const int64_t e = c->y_bf16 ? 2 : 4, off = r0 * c->ldy * e;
    if (m > 0) copy_groups((char *)c->y + off, (const char *)c->shadow + off, m, c->N, c->ldy, e, c0, c1);
}

/* x [M, K] (float32 or bf16, rows ldx apart; act 1: [M, 2K] gate | up, taken as SiLU(gate) *
 * up) as float32 rows K apart, into xf. */
static void fma_rows_in(const void *x, int x_bf16, int64_t ldx, int act, int64_t M, int64_t K, float *xf) {
    for (int64_t r = 0; r < M; r++) row_in(x, x_bf16, ldx, act, r, K, xf + r * K);
}

/* y = xf @ W.T (xf float32 rows K apart, in memory a late helper may still read): the units
 * (fma_ctx) shared with the helper (results through shadow, its panel hpan) where shadow is
 * given, else all on this thread. Up to FMA_FEW rows: one row block; else blocks of mc rows
 * (FMA_L2), and where they are fewer than FMA_UNITS, each split in column ranges so that
 * there are about FMA_UNITS units (each range at least 2 column groups). */
FMA_TARGET static void fma_par(int bits, const uint8_t *w, const float *xf, void *y, int y_bf16, int64_t ldy, int64_t M,
                               int64_t N, int64_t K, void *shadow, float *hpan) {
    const int64_t C = (N + 15) / 16;
    int64_t mc = M, blocks = 1;
    const float *xs = NULL;
    if (M > FMA_FEW) {  /* blocks of at most the rows that fit, all of about the same size */
        const int64_t most = max64((FMA_L2 - 16 * K * (int64_t)sizeof(float)) / (K * (int64_t)sizeof(float)), FMA_MIN_MC);
        blocks = (M + most - 1) / most;
        blocks = blocks > MAX_UNITS ? MAX_UNITS : blocks;
        mc = ((M + blocks - 1) / blocks + FMA_ROWS - 1) / FMA_ROWS * FMA_ROWS;
        blocks = (M + mc - 1) / mc;
    } else if (bits == 4) {
        xs = fma_block_sums(xf, M, K);
    }
    int64_t parts = blocks >= FMA_UNITS ? 1 : (FMA_UNITS + blocks - 1) / blocks;
    parts = parts > C / 2 ? (C / 2 > 0 ? C / 2 : 1) : parts;
    if (blocks * parts > MAX_UNITS) parts = MAX_UNITS / blocks;
    const int64_t per = (C + parts - 1) / parts;
    parts = (C + per - 1) / per;
    fma_ctx c = {w, xf, xs, y, shadow, hpan, M, N, K, ldy, per, bits, mc, parts, y_bf16};
    if (shadow) {
        parallel_for(fma_unit, fma_copy, &c, sizeof c, blocks * parts);
    } else {
        for (int64_t u = 0; u < blocks * parts; u++) fma_unit(&c, u, 0);
    }
}

/* ---- One int8 activation plane on an AVX2 CPU (RADIXD_CPU_ACT_BITS=8: llama.cpp's Q8
 * activations): the records times the activations quantized per row and block of 32, as the
 * VNNI kernels take them with one plane, the dot products on vpmaddubsw / vpmaddwd instead of
 * vpdpbusd. A q4 weight's nibbles (0..15) times int8 activations: eight byte-pair sums of a
 * block stay within int16 (8 x 2 x 15 x 127 < 32767) before vpmaddwd adds them into int32; a
 * q8 weight (bytes q + 128) as llama.cpp takes it: |q| times the activation with q's sign
 * (vpsignb), each pair sum within int16 (2 x 128 x 127). The int32 sums are the VNNI
 * kernel's (q8's sum of (q + 128) x plus its -128 sum(x) term is sum(q x)) and are scaled by
 * the same float operations in the same order, 8 columns a vector (not compared with it on
 * a CPU that has both: the tests hold it to the q8 reference and exact integer products).
 * Each weight's bytes are split into nibbles once for all rows of a pass (8), where the float
 * kernel converts every weight to float32: 2-3x fewer operations per product. */

/* 16 columns (record stream wc) times R <= 8 rows: y rows r0 .. r0 + R - 1. */
FMA_TARGET static inline __attribute__((always_inline)) void i8_cols(
        int bits, const uint8_t *wc, int64_t B, const act_t *a, int64_t K, int64_t r0, const int R,
        void *y, int y_bf16, int64_t ldy, int64_t n0, int64_t N) {
    __m256 acc[2 * FMA_FEW];
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), top = _mm256_set1_epi8((char)0x80);
    for (int i = 0; i < 2 * R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        for (int h = 0; h < 2; h++) {
            __m256i dot[FMA_FEW];
            if (bits == 4) {
                const uint8_t *rec = wc + b * Q4_REC;
                __m256i s16[FMA_FEW];
                for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
                for (int j = 0; j < 4; j++) {
                    /* lane l: column 8h + l; its bytes' low nibbles inputs 8j .. 8j + 3, high ones 8j + 4 .. 8j + 7 */
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h));
                    const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                    for (int r = 0; r < R; r++) {
                        const int8_t *xq = a->q + (r0 + r) * K + b * 32 + 8 * j;
                        const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xq)));
                        const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xq + 4)));
                        s16[r] = _mm256_add_epi16(s16[r], _mm256_add_epi16(pl, ph));
                    }
                }
                for (int r = 0; r < R; r++) dot[r] = _mm256_madd_epi16(s16[r], ones);
                const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 256 + 16 * h)));
                const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 288 + 16 * h)));
                for (int r = 0; r < R; r++) {
                    const int64_t i = (r0 + r) * B + b;
                    __m256 *t = &acc[2 * r + h];
                    *t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(dw, _mm256_set1_ps(a->d[i])), *t);
                    *t = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->s[i]), *t);
                }
            } else {
                const uint8_t *rec = wc + b * Q8_REC;
                for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {
                    /* lane l: column 8h + l, its bytes inputs 4j .. 4j + 3, each q + 128 */
                    const __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h)), top);
                    const __m256i aq = _mm256_abs_epi8(q);
                    for (int r = 0; r < R; r++) {
                        const __m256i x = _mm256_set1_epi32(load_i32(a->q + (r0 + r) * K + b * 32 + 4 * j));
                        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(x, q)), ones));
                    }
                }
                const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 512 + 16 * h)));
                for (int r = 0; r < R; r++) {
                    __m256 *t = &acc[2 * r + h];
                    *t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_mul_ps(dw, _mm256_set1_ps(a->d[(r0 + r) * B + b])), *t);
                }
            }
        }
    }
    fma_store(acc, R, (char *)y + r0 * ldy * (y_bf16 ? 2 : 4), y_bf16, ldy, n0, N);
}

#define I8_CASE(R) case R: i8_cols(bits, wc, B, a, K, r0, R, y, y_bf16, ldy, n0, N); break;
/* Column groups c0 .. c1 - 1 of y [M, N], every row, 8 rows a pass. */
FMA_TARGET static void i8_range(int bits, const uint8_t *w, const act_t *a, int64_t M, int64_t N, int64_t K, void *y,
                                int y_bf16, int64_t ldy, int64_t c0, int64_t c1) {
    const int64_t B = K / 32, rec = bits == 4 ? Q4_REC : Q8_REC;
    for (int64_t c = c0; c < c1; c++) {
        const uint8_t *wc = w + c * B * rec;
        const int64_t n0 = c * 16;
        for (int64_t r0 = 0; r0 < M; r0 += FMA_FEW) {
            switch (M - r0 < FMA_FEW ? M - r0 : FMA_FEW) {
                I8_CASE(1) I8_CASE(2) I8_CASE(3) I8_CASE(4) I8_CASE(5) I8_CASE(6) I8_CASE(7) I8_CASE(8)
            }
        }
    }
}

FMA_TARGET static void i8_unit(const void *p, int64_t u, int helper) {
    const qmm_ctx *c = p;
    int64_t c0, c1;
    qmm_groups(c, u, &c0, &c1);
    i8_range((int)c->bits, c->w, &c->a, c->M, c->N, c->K, helper ? c->shadow : c->y, c->y_bf16, c->ldy, c0, c1);
}

/* y = a @ W.T, a quantized with one plane (in memory a late helper may still read): column
 * ranges shared with the helper (results through shadow) where shadow is given. */
FMA_TARGET static void i8_par(int bits, const act_t *a, const uint8_t *w, void *y, int y_bf16, int64_t ldy, int64_t M,
                              int64_t N, int64_t K, void *shadow) {
    const int64_t C = (N + 15) / 16, per = groups_per_unit(C);
    qmm_ctx c = {w, *a, y, shadow, M, N, K, ldy, per, bits, 0, y_bf16, 0};
    if (!shadow) {
        c.per = C;
        i8_unit(&c, 0, 0);
        return;
    }
    parallel_for(i8_unit, qmm_copy, &c, sizeof c, (C + per - 1) / per);
}

/* x [M, K] (act 1: [M, 2K] gate | up, as SiLU(gate) * up) quantized with one plane into the
 * activation buffers at mem (act_bytes(M, K)), then times W: for qmm_fma and the fused step. */
FMA_TARGET static void i8_mm(int bits, const void *x, int x_bf16, int64_t ldx, int act, const uint8_t *w, void *y,
                             int y_bf16, int64_t ldy, int64_t M, int64_t N, int64_t K, char *mem, void *shadow) {
    act_t a;  /* (one plane, no tiles: act_planes is 1 and AMX is off wherever this runs) */
    float *tmp = act_init(&a, mem, M, K);
    quantize_act(x, x_bf16, ldx, act, M, K, &a, tmp);
    i8_par(bits, &a, w, y, y_bf16, ldy, M, N, K, shadow);
}

/* qmm_vnni's contract on an AVX2 CPU (the caller checked avx2_supported()): x's rows are
 * converted to float32 (act 1: SiLU(gate) * up) into the parallel step's arena, then the
 * column groups are shared between the threads. Returns 0, -1 (shapes), -2 (no memory). */
FMA_TARGET int qmm_fma(int bits, const void *x, int x_bf16, int64_t ldx, int act, const uint8_t *w, void *y,
                       int y_bf16, int64_t ldy, int64_t M, int64_t N, int64_t K) {
    if (M < 1 || K % 32 || (bits != 4 && bits != 8)) return -1;
    if (__atomic_load_n(&act_planes, __ATOMIC_RELAXED) == 1) {  /* RADIXD_CPU_ACT_BITS=8 */
        const size_t abytes = act_bytes(M, K), ybytes = M * ldy * (y_bf16 ? 2 : 4);
        const int par = pool_begin(abytes, ybytes, 0);
        char *mem = par ? P.arena : malloc(abytes);
        if (!mem) return -2;
        i8_mm(bits, x, x_bf16, ldx, act, w, y, y_bf16, ldy, M, N, K, mem, par ? P.shadow : NULL);
        if (par) pool_end();
        else free(mem);
        return 0;
    }
    const int64_t panel = fma_panel_floats(M, K);
    if (!fma_scratch(panel)) return -2;
    const size_t xbytes = M * K * sizeof(float), ybytes = M * ldy * (y_bf16 ? 2 : 4);
    const int par = pool_begin(xbytes, ybytes, panel * sizeof(float));
    float *xf = par ? (float *)P.arena : malloc(xbytes);
    if (!xf) return -2;
    fma_rows_in(x, x_bf16, ldx, act, M, K, xf);
    fma_par(bits, w, xf, y, y_bf16, ldy, M, N, K, par ? P.shadow : NULL, (float *)P.hscratch);
    if (par) pool_end();
    else free(xf);
    return 0;
}

/* x [rows, hidden] bf16: the embeddings in, the residual stream after (written in place);
 * out [rows, hidden]: the last layer's MLP output (the model adds it to x in its final norm).
 * Returns 0, -1 (shapes), -2 (no memory), -3 (a position past the rotary table), -4 (a slot
 * outside the pool or a length outside the table). */
VNNI_TARGET int decode_layers_bf16(const dmodel_t *m, const dlayer_t *ls, const dstep_t *st, uint16_t *x, uint16_t *out) {
    const int64_t M = st->rows, H = m->hidden, I = m->inter, D = m->dim, Hq = m->hq, Hkv = m->hkv, W = st->width;
    const int64_t Nqkv = (Hq + 2 * Hkv) * D, slot = Hkv * D;
    if (M < 1 || H % 32 || I % 32 || (Hq * D) % 32 || D % 2 || !dp_takes(Hq, Hkv, D)) return -1;
    const int bad = step_bad(m, st);
    if (bad) return bad;
    const int64_t kmax = max64(max64(H, I), Hq * D), nmax = max64(max64(Nqkv, 2 * I), max64(H, Hq * D));
    const size_t bf = sizeof(uint16_t);
    const size_t bytes = (M * H + M * Nqkv + 2 * M * Hq * D + M * H + M * 2 * I) * bf + GRP_MAX * Hq * W * sizeof(float)
                         + M * (W + 4) * sizeof(int64_t) + 8 + act_bytes(M, kmax) + 256;
    const int par = pool_begin(bytes, M * nmax * bf, GRP_MAX * (Hq * W * sizeof(float) + W * sizeof(int64_t)));
    char *mem = par ? P.arena : malloc(bytes);
    if (!mem) return -2;
    uint16_t *h = (uint16_t *)mem, *qkv = h + M * H, *q = qkv + M * Nqkv, *att = q + M * Hq * D, *o = att + M * Hq * D,
             *gu = o + M * H;
    float *scores = (float *)(gu + M * 2 * I);
    int64_t *slots = (int64_t *)(scores + GRP_MAX * Hq * W), *lens = slots + M * W;  /* (copies: a late helper reads them) */
    int64_t *order = lens + M, *chunk = order + M, *used = chunk + M + 1;
    char *actmem = (char *)(used + M);
    memcpy(slots, st->slots, M * W * sizeof(int64_t));
    memcpy(lens, st->lens, M * sizeof(int64_t));
    void *shadow = par ? P.shadow : NULL;
    /* attention units: a chunk of requests sharing a prefix each, or its KV heads one by one
     * where chunks are few */
    const int64_t chunks = att_groups(slots, M, W, order, chunk, used);
    const int64_t split = chunks >= 4 || Hkv == 1 ? 1 : Hkv;
    att_ctx ac = {q, NULL, NULL, slots, lens, order, chunk, att, (uint16_t *)shadow, scores,
                  (float *)(par ? P.hscratch : NULL), Hq, Hkv, D, W, split, st->pool_slots, M, m->scale};
    act_t a;
    float *tmp;
    for (int64_t l = 0; l < m->layers; l++) {
        const dlayer_t *L = &ls[l];
        if (l == 0) add_rmsnorm_bf16(x, H, NULL, 0, L->norm_in, h, H, M, H, L->eps_in);
        else add_rmsnorm_bf16(out, H, x, H, L->norm_in, h, H, M, H, L->eps_in);
        tmp = act_init(&a, actmem, M, H);
        quantize_act(h, 1, H, 0, M, H, &a, tmp);
        qmm_par((int)L->qkv_bits, &a, L->qkv, qkv, 1, Nqkv, M, Nqkv, H, shadow);
        rotary_bf16(qkv, Nqkv, M, Hq, D, m->cos, m->sin, st->pos, q);
        for (int64_t t = 0; t < M; t++) {  /* k rotated into its slot, v copied */
            rotary_bf16(qkv + t * Nqkv + Hq * D, Nqkv, 1, Hkv, D, m->cos, m->sin, st->pos + t, L->k_buf + st->loc[t] * slot);
            memcpy(L->v_buf + st->loc[t] * slot, qkv + t * Nqkv + (Hq + Hkv) * D, slot * bf);
        }
        ac.k = L->k_buf;
        ac.v = L->v_buf;
        if (shadow) parallel_for(att_unit, att_copy, &ac, sizeof ac, chunks * split);
        else for (int64_t u = 0; u < chunks * split; u++) att_unit(&ac, u, 0);
        tmp = act_init(&a, actmem, M, Hq * D);
        quantize_act(att, 1, Hq * D, 0, M, Hq * D, &a, tmp);
        qmm_par((int)L->o_bits, &a, L->o, o, 1, H, M, H, Hq * D, shadow);
        add_rmsnorm_bf16(o, H, x, H, L->norm_post, h, H, M, H, L->eps_post);
        tmp = act_init(&a, actmem, M, H);
        quantize_act(h, 1, H, 0, M, H, &a, tmp);
        qmm_par((int)L->gate_up_bits, &a, L->gate_up, gu, 1, 2 * I, M, 2 * I, H, shadow);
        tmp = act_init(&a, actmem, M, I);
        quantize_act(gu, 1, 2 * I, 1, M, I, &a, tmp);
        qmm_par((int)L->down_bits, &a, L->down, out, 1, H, M, H, I, shadow);
    }
    if (par) pool_end();
    else free(mem);
    return 0;
}

/* decode_layers_bf16's step on an AVX2 CPU, in float32: the embeddings, the residual stream,
 * the layers' norm weights (dlayer_t's norm_in / norm_post) and the pool's buffers are float32
 * (the structures' bf16 pointers read as float), the projections q4 / q8 records multiplied by
 * the FMA kernel, decode attention per (request, KV head) as decode_mt runs it: the same
 * functions in the same order as the layer loop, its result bit for bit. The caller checked
 * avx2_supported(). Returns as decode_layers_bf16. */
FMA_TARGET int decode_layers_f32(const dmodel_t *m, const dlayer_t *ls, const dstep_t *st, float *x, float *out) {
    const int64_t M = st->rows, H = m->hidden, I = m->inter, D = m->dim, Hq = m->hq, Hkv = m->hkv, W = st->width;
    const int64_t Nqkv = (Hq + 2 * Hkv) * D, slot = Hkv * D, G = Hq / Hkv;
    if (M < 1 || H % 32 || I % 32 || (Hq * D) % 32 || D % 2 || G * Hkv != Hq || G > MAX_G || D > MAX_D) return -1;
    const int bad = step_bad(m, st);
    if (bad) return bad;
    const int64_t kmax = max64(max64(H, I), Hq * D), nmax = max64(max64(Nqkv, 2 * I), max64(H, Hq * D));
    const int64_t panel = fma_panel_floats(M, kmax);
    const size_t fl = sizeof(float);
    const int kvt = (int)m->kvt;
    if (kvt != KV_F32 && (D % 8 || (kvt != KV_F16 && kvt != KV_BF16))) return -1;
    const int i8 = __atomic_load_n(&act_planes, __ATOMIC_RELAXED) == 1;  /* RADIXD_CPU_ACT_BITS=8: i8_mm */
    const size_t bytes = (M * H + M * Nqkv + 2 * M * Hq * D + M * H + M * 2 * I + M * I + G * W + 2 * slot) * fl
                         + M * (W + 1) * sizeof(int64_t) + 256 + (i8 ? act_bytes(M, kmax) + 64 : 0);
    const size_t hbytes = max64(panel * fl, G * W * fl + W * sizeof(int64_t) + 64);
    if (!fma_scratch(panel)) return -2;
    const int par = pool_begin(bytes, M * nmax * fl, hbytes);
    char *mem = par ? P.arena : malloc(bytes);
    if (!mem) return -2;
    float *h = (float *)mem, *qkv = h + M * H, *q = qkv + M * Nqkv, *att = q + M * Hq * D, *o = att + M * Hq * D,
          *gu = o + M * H, *act = gu + M * 2 * I, *scores = act + M * I, *kv_row = scores + G * W;
    int64_t *slots = (int64_t *)(((uintptr_t)(kv_row + 2 * slot) + 63) / 64 * 64), *lens = slots + M * W;
    memcpy(slots, st->slots, M * W * sizeof(int64_t));  /* (copies: a late helper reads them) */
    memcpy(lens, st->lens, M * sizeof(int64_t));
    char *actmem = (char *)(((uintptr_t)(lens + M) + 63) / 64 * 64);
    void *shadow = par ? P.shadow : NULL;
    float *hscratch = par ? (float *)P.hscratch : NULL;
    dec_ctx ac = {q, NULL, NULL, slots, lens, att, shadow, scores, hscratch, Hq, Hkv, D, W, st->pool_slots, 4, m->scale,
                  D % 8 == 0, M, kvt};
    for (int64_t l = 0; l < m->layers; l++) {
        const dlayer_t *L = &ls[l];
        void *k_buf = L->k_buf, *v_buf = L->v_buf;
        if (l == 0) add_rmsnorm_f32(x, H, NULL, 0, (const float *)L->norm_in, h, H, M, H, L->eps_in);
        else add_rmsnorm_f32(out, H, x, H, (const float *)L->norm_in, h, H, M, H, L->eps_in);
        if (i8) i8_mm((int)L->qkv_bits, h, 0, H, 0, L->qkv, qkv, 0, Nqkv, M, Nqkv, H, actmem, shadow);
        else fma_par((int)L->qkv_bits, L->qkv, h, qkv, 0, Nqkv, M, Nqkv, H, shadow, hscratch);
        rotary_f32(qkv, Nqkv, M, Hq, D, m->cos, m->sin, st->pos, q);
        for (int64_t t = 0; t < M; t++) {  /* k rotated into its slot, v copied (in the pool's elements) */
            const float *vt = qkv + t * Nqkv + (Hq + Hkv) * D;
            if (kvt == KV_F32) {
                rotary_f32(qkv + t * Nqkv + Hq * D, Nqkv, 1, Hkv, D, m->cos, m->sin, st->pos + t,
                           (float *)k_buf + st->loc[t] * slot);
                memcpy((float *)v_buf + st->loc[t] * slot, vt, slot * fl);
            } else {
                rotary_f32(qkv + t * Nqkv + Hq * D, Nqkv, 1, Hkv, D, m->cos, m->sin, st->pos + t, kv_row);
                kv_store(kv_row, (uint16_t *)k_buf + st->loc[t] * slot, slot, kvt);
                kv_store(vt, (uint16_t *)v_buf + st->loc[t] * slot, slot, kvt);
            }
        }
        ac.k = k_buf;
        ac.v = v_buf;
        if (shadow && M * Hkv >= 2 && M * Hkv <= MAX_UNITS) parallel_for(dec_unit, dec_copy, &ac, sizeof ac, M * Hkv);
        else for (int64_t u = 0; u < M * Hkv; u++) dec_unit(&ac, u, 0);
        if (i8) i8_mm((int)L->o_bits, att, 0, Hq * D, 0, L->o, o, 0, H, M, H, Hq * D, actmem, shadow);
        else fma_par((int)L->o_bits, L->o, att, o, 0, H, M, H, Hq * D, shadow, hscratch);
        add_rmsnorm_f32(o, H, x, H, (const float *)L->norm_post, h, H, M, H, L->eps_post);
        if (i8) {
            i8_mm((int)L->gate_up_bits, h, 0, H, 0, L->gate_up, gu, 0, 2 * I, M, 2 * I, H, actmem, shadow);
            i8_mm((int)L->down_bits, gu, 0, 2 * I, 1, L->down, out, 0, H, M, H, I, actmem, shadow);
            continue;
        }
        fma_par((int)L->gate_up_bits, L->gate_up, h, gu, 0, 2 * I, M, 2 * I, H, shadow, hscratch);
        fma_rows_in(gu, 0, 2 * I, 1, M, I, act);
        fma_par((int)L->down_bits, L->down, act, out, 0, H, M, H, I, shadow, hscratch);
    }
    if (par) pool_end();
    else free(mem);
    return 0;
}
