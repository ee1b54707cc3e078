/* The sum of squares of n fp32 values, in fp64, on a CPU with AVX-512: a gradient norm's
 * reduction over a whole parameter (BLOOM's 250,880 x 1,024 vocabulary gradient is 257M values).
 *
 * torch's CPU norm of an fp32 tensor accumulates in fp32 across each thread's whole run: 257M
 * values of one magnitude come out ~3.6 % low against float64, a PPO step's real gradients at
 * BLOOM-560m's shapes 5e-5 to 8e-5 low (cpu_norm.py). Here each block of BLOCK values is
 * summed in 64 fp32 lanes (4 vectors: at most BLOCK / 64 terms each) and the block's sum added
 * in fp64: the error stays at fp32 rounding whatever n is. One read of the values (a
 * memory-bound sweep, at the read bandwidth). Non-finite values propagate (a nan or inf
 * gradient gives a non-finite sum, which the caller's check turns into a skipped step). Built
 * and loaded by cpu_norm.py.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define BLOCK 4096 /* values per fp32 partial sum (64 lanes x 64 terms) */

static double block_sum(const float *x, int64_t n) /* n <= BLOCK */
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16),
                     v2 = _mm512_loadu_ps(x + i + 32), v3 = _mm512_loadu_ps(x + i + 48);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
        a2 = _mm512_fmadd_ps(v2, v2, a2);
        a3 = _mm512_fmadd_ps(v3, v3, a3);
    }
    for (; i < n; i += 16) { /* the last n % 64 values, 16 at a time, the rest masked to 0 */
        const int64_t left = n - i;
        const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        a0 = _mm512_fmadd_ps(v, v, a0);
    }
    const __m512 s = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
    /* the 16 lanes widened to fp64 before their sum */
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(s)),
                  hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
                      _mm512_castps_pd(s), 1)));
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

double megatron_rlhf_sum_squares(const float *x, int64_t n, int threads)
{
    double total = 0.0;
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t start = b * BLOCK;
        total += block_sum(x + start, n - start < BLOCK ? n - start : BLOCK);
    }
    return total;
}
