/* Per-token log-prob statistics and their gradient over fp32 logits, on a CPU with AVX-512.
 *
 * The same four statistics per row as logprobs.py's PyTorch path (STATS: the max m of x/tau,
 * S = sum exp(x/tau - m), the centred mean sum (x/tau - m) exp(x/tau - m) / S, the target's
 * x/tau), and the same gradient, (p * (slope * log p + offset)) with scaled_lp added at the target.
 * At BLOOM's vocabulary a scoring or update micro-batch's logits are 128 x 250,880 fp32 values
 * (128 MB): the PyTorch path makes 4-6 passes over them, each through memory, and takes 26-36 ms
 * forward and 52-69 ms backward on the 2-core benchmark VM. Here each row is read from memory
 * once (its second pass finds the row's 1 MB in cache) and the gradient is written with streaming
 * stores (no read of the destination first).
 *
 * exp is a Cody-Waite range reduction and Cephes' degree-6 polynomial (about 1 ulp), with
 * arguments clamped below at -110 (exp is then exactly 0 in fp32, and (x - m) * exp stays 0
 * for a -inf logit instead of the nan that PyTorch's nansum skips). A nan logit stays nan.
 * Rows go to threads whole; each row is summed in 16 lanes and then across them: another order
 * than PyTorch's, equal to fp32 rounding. Built and loaded as cpu_gemv.c is (_cpu_build.py).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define EMPTY_MAX -1e30f /* max of a row without mass (logprobs.EMPTY_MAX) */
#define EXP_FLOOR -110.0f
#define MIN_LOG_PROB -1000.0f /* logprobs.MIN_LOG_PROB */

static inline __attribute__((always_inline)) __m512 exp_ps(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(EXP_FLOOR), x); /* this operand order keeps a nan */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 tail_mask(int64_t left) { return (__mmask16)((1u << left) - 1u); }

static inline __m512 load_scaled(const float *x, __mmask16 mask, float inv_temp)
{
    const __m512 v = _mm512_maskz_loadu_ps(mask, x);
    return inv_temp == 1.0f ? v : _mm512_mul_ps(v, _mm512_set1_ps(inv_temp));
}

/* The max of a row's x/tau, EMPTY_MAX for a row without mass (all -inf). */
static inline float row_max(const float *row, int64_t V, float inv_temp)
{
    __m512 top = _mm512_set1_ps(-__builtin_inff());
    for (int64_t j = 0; j < V; j += 16) {
        const __mmask16 mask = V - j < 16 ? tail_mask(V - j) : 0xFFFF;
        top = _mm512_mask_max_ps(top, mask, top, load_scaled(row + j, mask, inv_temp));
    }
    const float m = _mm512_reduce_max_ps(top);
    return m > EMPTY_MAX ? m : EMPTY_MAX;
}

/* stats: 4 rows of n values (max, sum_exp, centred mean, target logit), as logprobs.STATS. */
void megatron_rlhf_logprob_stats(const float *x, int64_t ldx, int64_t n, int64_t V,
                                 const int64_t *targets, float inv_temp, int with_entropy,
                                 float *stats, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *row = x + i * ldx;
        const float m = row_max(row, V, inv_temp);
        const __m512 mv = _mm512_set1_ps(m);
        __m512 sum = _mm512_setzero_ps(), centred = _mm512_setzero_ps();
        for (int64_t j = 0; j < V; j += 16) {
            const __mmask16 mask = V - j < 16 ? tail_mask(V - j) : 0xFFFF;
            const __m512 shifted =
                _mm512_max_ps(_mm512_set1_ps(EXP_FLOOR),
                              _mm512_sub_ps(load_scaled(row + j, mask, inv_temp), mv));
            const __m512 e = _mm512_maskz_mov_ps(mask, exp_ps(shifted));
            sum = _mm512_add_ps(sum, e);
            if (with_entropy) centred = _mm512_fmadd_ps(shifted, e, centred);
        }
        const float s = _mm512_reduce_add_ps(sum);
        const int64_t t = targets[i];
        stats[i] = m;
        stats[n + i] = s;
        stats[2 * n + i] = with_entropy && s > 0.0f ? _mm512_reduce_add_ps(centred) / s : 0.0f;
        stats[3 * n + i] = t >= 0 ? row[t] * inv_temp : 0.0f;
    }
}

/* grad = d(grad_lp * log p + grad_ent * H)/dx for each row (logprobs.rows_grad): with
 * log p = x/tau - lse, scaled = grad_lp/tau, and without an entropy gradient
 * p * (-scaled); with one, p * (slope * log p + offset), slope = -grad_ent/tau,
 * offset = slope * H - scaled, log p clamped below at MIN_LOG_PROB; plus scaled at the
 * target. grad_ent NULL: no entropy gradient. */
void megatron_rlhf_logprob_grad(const float *x, int64_t ldx, int64_t n, int64_t V,
                                const int64_t *targets, const float *lse, const float *entropy,
                                const float *grad_lp, const float *grad_ent, float inv_temp,
                                float *grad, int64_t ldg, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *row = x + i * ldx;
        float *out = grad + i * ldg;
        const float scaled = grad_lp[i] * inv_temp;
        const float slope = grad_ent ? -grad_ent[i] * inv_temp : 0.0f;
        const float offset = grad_ent ? slope * entropy[i] - scaled : -scaled;
        const __m512 lv = _mm512_set1_ps(lse[i]), sv = _mm512_set1_ps(slope),
                     ov = _mm512_set1_ps(offset), floor = _mm512_set1_ps(MIN_LOG_PROB);
        const int aligned = ((uintptr_t)out & 63) == 0;
        for (int64_t j = 0; j < V; j += 16) {
            const __mmask16 mask = V - j < 16 ? tail_mask(V - j) : 0xFFFF;
            __m512 log_p = _mm512_sub_ps(load_scaled(row + j, mask, inv_temp), lv);
            if (grad_ent) log_p = _mm512_max_ps(floor, log_p);
            const __m512 p = exp_ps(log_p);
            const __m512 g = grad_ent ? _mm512_mul_ps(p, _mm512_fmadd_ps(sv, log_p, ov))
                                      : _mm512_mul_ps(p, ov);
            if (mask != 0xFFFF)
                _mm512_mask_storeu_ps(out + j, mask, g);
            else if (aligned)
                _mm512_stream_ps(out + j, g);
            else
                _mm512_storeu_ps(out + j, g);
        }
        _mm_sfence(); /* the streamed stores are visible before the target's add below */
        const int64_t t = targets[i];
        if (t >= 0) out[t] += scaled;
    }
}

/* Draw one token per row from softmax(x/tau) by inverse CDF (generation/decode.py's _draw at
 * top_p = 1: the first token whose cumulative probability passes the row's uniform times the
 * total) and return its log-prob x/tau - m - log S. Three passes over a row: its max, its sum,
 * then the walk to the token, block by block, both sums in fp64 (PyTorch's fp32 cumulative sum
 * drifts at BLOOM's vocabulary). The walk's total is summed in another order than the total:
 * where rounding leaves the uniform's target unreached, the row's last token of nonzero
 * probability is drawn. */
void megatron_rlhf_sample(const float *x, int64_t ldx, int64_t n, int64_t V, float inv_temp,
                          const float *uniforms, int64_t *tokens, float *logprobs, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *row = x + i * ldx;
        const float m = row_max(row, V, inv_temp);
        const __m512 mv = _mm512_set1_ps(m);
        /* the total and the walk in fp64 (fp32 lanes over 1,024 values at a time): at BLOOM's
         * vocabulary an fp32 running sum drifts by ~1e-4 of the mass, tens of tokens */
        __m512d sum_lo = _mm512_setzero_pd(), sum_hi = _mm512_setzero_pd();
        for (int64_t start = 0; start < V; start += 1024) {
            __m512 sum = _mm512_setzero_ps();
            const int64_t stop = start + 1024 < V ? start + 1024 : V;
            for (int64_t j = start; j < stop; j += 16) {
                const __mmask16 mask = stop - j < 16 ? tail_mask(stop - j) : 0xFFFF;
                const __m512 shifted = _mm512_sub_ps(load_scaled(row + j, mask, inv_temp), mv);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, exp_ps(shifted)));
            }
            sum_lo = _mm512_add_pd(sum_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(sum)));
            sum_hi = _mm512_add_pd(sum_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1))));
        }
        const double total = _mm512_reduce_add_pd(_mm512_add_pd(sum_lo, sum_hi));
        const double target = uniforms[i] * total;
        double running = 0.0;
        int64_t token = -1, last_positive = V - 1;
        for (int64_t j = 0; j < V && token < 0; j += 16) {
            const __mmask16 mask = V - j < 16 ? tail_mask(V - j) : 0xFFFF;
            float e[16];
            const __m512 ev = _mm512_maskz_mov_ps(
                mask, exp_ps(_mm512_sub_ps(load_scaled(row + j, mask, inv_temp), mv)));
            const double block = _mm512_reduce_add_ps(ev);
            if (running + block <= target) {
                const unsigned positive = _mm512_cmp_ps_mask(ev, _mm512_setzero_ps(), _CMP_GT_OQ);
                if (positive) last_positive = j + 31 - __builtin_clz(positive);
                running += block;
                continue;
            }
            _mm512_storeu_ps(e, ev);
            for (int k = 0; k < 16 && j + k < V; k++) {
                running += e[k];
                if (e[k] > 0.0f) last_positive = j + k;
                if (running > target) {
                    token = j + k;
                    break;
                }
            }
        }
        if (token < 0) token = last_positive;
        tokens[i] = token;
        logprobs[i] = row[token] * inv_temp - m - (float)log(total);
    }
}
