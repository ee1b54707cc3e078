/* A few rows times a large fp32 matrix on a CPU with AVX-512: out = x @ w^T (+ bias).
 *
 * A decode step's LM head (8 rows x 1,024 x 250,880 at BLOOM-560m's width) must read the whole
 * 1 GB vocabulary matrix for 8 rows: 16 FLOP per 4 bytes read. On 2 cores that needs the
 * multiply-adds to run at about half the cores' peak while the matrix streams at the memory's
 * read bandwidth; oneDNN and MKL run it at 14-18 GB/s of a ~33 GB/s read bandwidth. This kernel
 * streams the matrix once, NT rows at a time, each row's 64-byte line used by all MT rows of x
 * in registers (MT x NT = 24 accumulators), and prefetches the rows PD ahead into L2 so the
 * memory keeps enough reads in flight while the cores multiply. Each thread takes a contiguous
 * run of the matrix's rows. Built and loaded by cpu_gemv.py (no torch headers: ctypes).
 *
 * x: M rows of K values, row stride ldx; w: N rows of K values, contiguous; bias: N values or
 * NULL; out: M rows of N values, row stride ldo. Each output is a K-term dot product summed in
 * 16 lanes and then across them: another order than MKL's or oneDNN's, equal to fp32 rounding.
 *
 * megatron_rlhf_gemv_bf16 is the same for bf16 x and w (a train.bf16 run's decode, the weight
 * its kept bf16 copy), with AVX-512-bf16's dot products: each instruction multiplies 32 pairs
 * of bf16 values and adds them, in pairs, into 16 fp32 sums. fp32 out, no bias. Compiled for
 * that instruction set alone (a target attribute); cpu_gemv.py calls it only where the CPU has it.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define NT 3  /* rows of w per tile */
#define MT 8  /* rows of x per tile (MT x NT accumulators of the 32 vector registers) */
#define PD 12 /* rows of w prefetched ahead */

static inline __attribute__((always_inline)) void tile(
    const int mt, const float *x, int64_t ldx, const float *w0, int64_t K, const float *ahead,
    float *out, int64_t ldo, int nt, const float *bias)
{
    __m512 acc[MT][NT];
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < NT; j++) acc[m][j] = _mm512_setzero_ps();
    /* a tile of fewer than NT rows (the run's last) reads row 0 again for the missing ones */
    const float *w1 = w0 + (nt > 1 ? K : 0), *w2 = w0 + (nt > 2 ? 2 * K : 0);
    const int64_t body = K & ~(int64_t)15;
    int64_t k = 0;
    for (; k < body; k += 16) {
        if (ahead) {
            _mm_prefetch((const char *)(ahead + k), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + K + k), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + 2 * K + k), _MM_HINT_T1);
        }
        const __m512 a0 = _mm512_loadu_ps(w0 + k), a1 = _mm512_loadu_ps(w1 + k),
                     a2 = _mm512_loadu_ps(w2 + k);
        for (int m = 0; m < mt; m++) {
            const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
            acc[m][0] = _mm512_fmadd_ps(a0, xv, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(a1, xv, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(a2, xv, acc[m][2]);
        }
    }
    if (k < K) { /* the last K % 16 values, masked (the rest read as 0) */
        const __mmask16 tail = (__mmask16)((1u << (K - k)) - 1u);
        const __m512 a0 = _mm512_maskz_loadu_ps(tail, w0 + k),
                     a1 = _mm512_maskz_loadu_ps(tail, w1 + k),
                     a2 = _mm512_maskz_loadu_ps(tail, w2 + k);
        for (int m = 0; m < mt; m++) {
            const __m512 xv = _mm512_maskz_loadu_ps(tail, x + m * ldx + k);
            acc[m][0] = _mm512_fmadd_ps(a0, xv, acc[m][0]);
            acc[m][1] = _mm512_fmadd_ps(a1, xv, acc[m][1]);
            acc[m][2] = _mm512_fmadd_ps(a2, xv, acc[m][2]);
        }
    }
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < nt; j++)
            out[m * ldo + j] = _mm512_reduce_add_ps(acc[m][j]) + (bias ? bias[j] : 0.0f);
}

/* Each thread takes a contiguous run of the matrix's rows, NT at a time; each tile of them meets
 * the rows of x MT at a time, each row count with its own fully unrolled tile (mt a constant:
 * the accumulators stay in registers). The first block of x rows prefetches the rows PD ahead;
 * the rest find the tile in cache. ROWS(mt) calls the tile function for one row count. */
#define FOR_EACH_TILE(ROWS)                                                                   \
    _Pragma("omp parallel num_threads(threads)")                                              \
    {                                                                                         \
        const int t = omp_get_thread_num(), nthreads = omp_get_num_threads();                 \
        const int64_t per = ((N + nthreads - 1) / nthreads + NT - 1) / NT * NT;               \
        const int64_t lo = t * per, hi = lo + per < N ? lo + per : N;                         \
        for (int64_t n = lo; n < hi; n += NT) {                                               \
            const int nt = hi - n < NT ? (int)(hi - n) : NT;                                  \
            const __typeof__(w) wn = w + n * K, ahead = n + PD + NT <= hi ? wn + PD * K : 0;  \
            for (int64_t m = 0; m < M; m += MT) {                                             \
                switch (M - m < MT ? (int)(M - m) : MT) {                                     \
                    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)           \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

#define ROWS_FP32(MTILE)                                                                  \
    case MTILE:                                                                           \
        tile(MTILE, x + m * ldx, ldx, wn, K, m ? 0 : ahead, out + m * ldo + n, ldo, nt,   \
             bias ? bias + n : 0);                                                        \
        break;

void megatron_rlhf_gemv(const float *x, int64_t ldx, int64_t M, const float *w, int64_t N,
                        int64_t K, const float *bias, float *out, int64_t ldo, int threads)
{
    FOR_EACH_TILE(ROWS_FP32)
}

#define BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

static inline __attribute__((always_inline)) BF16 void tile_bf16(
    const int mt, const uint16_t *x, int64_t ldx, const uint16_t *w0, int64_t K,
    const uint16_t *ahead, float *out, int64_t ldo, int nt)
{
    __m512 acc[MT][NT];
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < NT; j++) acc[m][j] = _mm512_setzero_ps();
    const uint16_t *w1 = w0 + (nt > 1 ? K : 0), *w2 = w0 + (nt > 2 ? 2 * K : 0);
    const int64_t body = K & ~(int64_t)31; /* 32 bf16 values: one 64-byte line */
    int64_t k = 0;
    for (; k < body; k += 32) {
        if (ahead) {
            _mm_prefetch((const char *)(ahead + k), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + K + k), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + 2 * K + k), _MM_HINT_T1);
        }
        const __m512bh a0 = (__m512bh)_mm512_loadu_si512(w0 + k),
                       a1 = (__m512bh)_mm512_loadu_si512(w1 + k),
                       a2 = (__m512bh)_mm512_loadu_si512(w2 + k);
        for (int m = 0; m < mt; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a0, xv);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a1, xv);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a2, xv);
        }
    }
    if (k < K) { /* the last K % 32 values, masked (the rest read as 0) */
        const __mmask32 tail = (__mmask32)((1ull << (K - k)) - 1ull);
        const __m512bh a0 = (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + k),
                       a1 = (__m512bh)_mm512_maskz_loadu_epi16(tail, w1 + k),
                       a2 = (__m512bh)_mm512_maskz_loadu_epi16(tail, w2 + k);
        for (int m = 0; m < mt; m++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * ldx + k);
            acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a0, xv);
            acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a1, xv);
            acc[m][2] = _mm512_dpbf16_ps(acc[m][2], a2, xv);
        }
    }
    for (int m = 0; m < mt; m++)
        for (int j = 0; j < nt; j++) out[m * ldo + j] = _mm512_reduce_add_ps(acc[m][j]);
}

#define ROWS_BF16(MTILE)                                                                   \
    case MTILE:                                                                            \
        tile_bf16(MTILE, x + m * ldx, ldx, wn, K, m ? 0 : ahead, out + m * ldo + n, ldo, nt); \
        break;

BF16 void megatron_rlhf_gemv_bf16(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *w,
                                  int64_t N, int64_t K, float *out, int64_t ldo, int threads)
{
    FOR_EACH_TILE(ROWS_BF16)
}
