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
 *
 * The _bf16 entry points take bf16 logits (a train.bf16 run's LM head) and compute in fp32, as
 * the PyTorch path does on its fp32 copies: half the bytes read and no copies. Their gradient is
 * rounded once to bf16, to nearest even, as the PyTorch path's copy into the bf16 gradient does.
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

/* 16 values of a row (fp32, or bf16 widened: its 16 bits are an fp32's upper half) from index
 * j, the lanes outside mask 0 */
static inline __attribute__((always_inline)) __m512 load(const void *row, int64_t j,
                                                         __mmask16 mask, int bf16)
{
    if (!bf16) return _mm512_maskz_loadu_ps(mask, (const float *)row + j);
    const uint16_t *x = (const uint16_t *)row + j;
    __m256i half;
    if (mask == 0xFFFF) {
        half = _mm256_loadu_si256((const __m256i *)x);
    } else { /* the row's last values: no read past its end */
        uint16_t tail[16] = {0};
        for (int k = 0; k < 16 && (mask >> k & 1); k++) tail[k] = x[k];
        half = _mm256_loadu_si256((const __m256i *)tail);
    }
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

static inline __attribute__((always_inline)) __m512 load_scaled(const void *row, int64_t j,
                                                                __mmask16 mask, float inv_temp,
                                                                int bf16)
{
    const __m512 v = load(row, j, mask, bf16);
    return inv_temp == 1.0f ? v : _mm512_mul_ps(v, _mm512_set1_ps(inv_temp));
}

static inline float value(const void *row, int64_t t, int bf16)
{
    if (!bf16) return ((const float *)row)[t];
    const uint32_t bits = (uint32_t)((const uint16_t *)row)[t] << 16;
    float v;
    __builtin_memcpy(&v, &bits, sizeof v);
    return v;
}

/* fp32 to bf16, rounded to nearest even (a nan stays a quiet nan), 16 lanes to 16 halves */
static inline __m256i to_bf16(__m512 v)
{
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan,
                                    _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* lo, hi += v's 16 lanes widened to fp64 */
static inline void add_widened(__m512d *lo, __m512d *hi, __m512 v)
{
    *lo = _mm512_add_pd(*lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    *hi = _mm512_add_pd(*hi, _mm512_cvtps_pd(_mm256_castpd_ps(
                                 _mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

#define BLOCK 1024 /* values a lane sums in fp32 (64 each) before the fp64 sums take them */

/* The max of a row's x/tau, EMPTY_MAX for a row without mass (all -inf). */
static inline __attribute__((always_inline)) float row_max(const void *row, int64_t V,
                                                           float inv_temp, int bf16)
{
    __m512 top = _mm512_set1_ps(-__builtin_inff());
    for (int64_t j = 0; j < V; j += 16) {
        const __mmask16 mask = V - j < 16 ? tail_mask(V - j) : 0xFFFF;
        top = _mm512_mask_max_ps(top, mask, top, load_scaled(row, j, mask, inv_temp, bf16));
    }
    const float m = _mm512_reduce_max_ps(top);
    return m > EMPTY_MAX ? m : EMPTY_MAX;
}

/* stats: 4 rows of n values (max, sum_exp, centred mean, target logit), as logprobs.STATS. */
static inline __attribute__((always_inline)) void stats_rows(
    const void *x, int64_t ldx, int64_t n, int64_t V, const int64_t *targets, float inv_temp,
    int with_entropy, float *stats, int threads, int bf16)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const void *row = bf16 ? (const void *)((const uint16_t *)x + i * ldx)
                               : (const void *)((const float *)x + i * ldx);
        const float m = row_max(row, V, inv_temp, bf16);
        const __m512 mv = _mm512_set1_ps(m);
        /* both sums in fp64 across blocks: a 16-lane fp32 sum over BLOOM's vocabulary (15,680
         * terms a lane) drifts by ~1e-5 of the total, 20x the PyTorch path's error */
        __m512d sum_lo = _mm512_setzero_pd(), sum_hi = sum_lo, cen_lo = sum_lo, cen_hi = sum_lo;
        for (int64_t start = 0; start < V; start += BLOCK) {
            const int64_t stop = start + BLOCK < V ? start + BLOCK : V;
            __m512 sum = _mm512_setzero_ps(), centred = _mm512_setzero_ps();
            for (int64_t j = start; j < stop; j += 16) {
                const __mmask16 mask = stop - j < 16 ? tail_mask(stop - j) : 0xFFFF;
                const __m512 shifted =
                    _mm512_max_ps(_mm512_set1_ps(EXP_FLOOR),
                                  _mm512_sub_ps(load_scaled(row, j, mask, inv_temp, bf16), mv));
                const __m512 e = _mm512_maskz_mov_ps(mask, exp_ps(shifted));
                sum = _mm512_add_ps(sum, e);
                if (with_entropy) centred = _mm512_fmadd_ps(shifted, e, centred);
            }
            add_widened(&sum_lo, &sum_hi, sum);
            if (with_entropy) add_widened(&cen_lo, &cen_hi, centred);
        }
        const double s = _mm512_reduce_add_pd(_mm512_add_pd(sum_lo, sum_hi));
        const double c = _mm512_reduce_add_pd(_mm512_add_pd(cen_lo, cen_hi));
        const int64_t t = targets[i];
        stats[i] = m;
        stats[n + i] = (float)s;
        stats[2 * n + i] = with_entropy && s > 0.0 ? (float)(c / s) : 0.0f;
        stats[3 * n + i] = t >= 0 ? value(row, t, bf16) * inv_temp : 0.0f;
    }
}

void megatron_rlhf_logprob_stats(const float *x, int64_t ldx, int64_t n, int64_t V,
                                 const int64_t *targets, float inv_temp, int with_entropy,
                                 float *stats, int threads)
{
    stats_rows(x, ldx, n, V, targets, inv_temp, with_entropy, stats, threads, 0);
}

void megatron_rlhf_logprob_stats_bf16(const uint16_t *x, int64_t ldx, int64_t n, int64_t V,
                                      const int64_t *targets, float inv_temp, int with_entropy,
                                      float *stats, int threads)
{
    stats_rows(x, ldx, n, V, targets, inv_temp, with_entropy, stats, threads, 1);
}

/* grad = d(grad_lp * log p + grad_ent * H)/dx for each row (logprobs.rows_grad): with
 * log p = x/tau - lse, scaled = grad_lp/tau, and without an entropy gradient
 * p * (-scaled); with one, p * (slope * log p + offset), slope = -grad_ent/tau,
 * offset = slope * H - scaled, log p clamped below at MIN_LOG_PROB; plus scaled at the
 * target (added in fp32 before the one rounding of a bf16 gradient). grad_ent NULL: no entropy
 * gradient. */
static inline __attribute__((always_inline)) void grad_rows(
    const void *x, int64_t ldx, int64_t n, int64_t V, const int64_t *targets, const float *lse,
    const float *entropy, const float *grad_lp, const float *grad_ent, float inv_temp,
    void *grad, int64_t ldg, int threads, int bf16)
{
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const void *row = bf16 ? (const void *)((const uint16_t *)x + i * ldx)
                               : (const void *)((const float *)x + i * ldx);
        float *out = bf16 ? 0 : (float *)grad + i * ldg;
        uint16_t *out16 = bf16 ? (uint16_t *)grad + i * ldg : 0;
        const int64_t t = targets[i];
        const float scaled = grad_lp[i] * inv_temp;
        const float slope = grad_ent ? -grad_ent[i] * inv_temp : 0.0f;
        const float offset = grad_ent ? slope * entropy[i] - scaled : -scaled;
        const __m512 lv = _mm512_set1_ps(lse[i]), sv = _mm512_set1_ps(slope),
                     ov = _mm512_set1_ps(offset), floor = _mm512_set1_ps(MIN_LOG_PROB);
        const int aligned = bf16 ? ((uintptr_t)out16 & 31) == 0 : ((uintptr_t)out & 63) == 0;
        for (int64_t j = 0; j < V; j += 16) {
            const __mmask16 mask = V - j < 16 ? tail_mask(V - j) : 0xFFFF;
            __m512 log_p = _mm512_sub_ps(load_scaled(row, j, mask, inv_temp, bf16), lv);
            if (grad_ent) log_p = _mm512_max_ps(floor, log_p);
            const __m512 p = exp_ps(log_p);
            __m512 g = grad_ent ? _mm512_mul_ps(p, _mm512_fmadd_ps(sv, log_p, ov))
                                : _mm512_mul_ps(p, ov);
            if ((uint64_t)(t - j) < 16) /* the target's lane */
                g = _mm512_mask_add_ps(g, (__mmask16)(1u << (t - j)), g,
                                       _mm512_set1_ps(scaled));
            if (bf16) {
                const __m256i h = to_bf16(g);
                if (mask != 0xFFFF) {
                    uint16_t tail[16];
                    _mm256_storeu_si256((__m256i *)tail, h);
                    for (int k = 0; k < 16 && (mask >> k & 1); k++) out16[j + k] = tail[k];
                } else if (aligned) {
                    _mm256_stream_si256((__m256i *)(out16 + j), h);
                } else {
                    _mm256_storeu_si256((__m256i *)(out16 + j), h);
                }
            } else if (mask != 0xFFFF) {
                _mm512_mask_storeu_ps(out + j, mask, g);
            } else if (aligned) {
                _mm512_stream_ps(out + j, g);
            } else {
                _mm512_storeu_ps(out + j, g);
            }
        }
        _mm_sfence(); /* the streamed stores are visible to whoever reads the gradient next */
    }
}

void megatron_rlhf_logprob_grad(const float *x, int64_t ldx, int64_t n, int64_t V,
                                const int64_t *targets, const float *lse, const float *entropy,
                                const float *grad_lp, const float *grad_ent, float inv_temp,
                                float *grad, int64_t ldg, int threads)
{
    grad_rows(x, ldx, n, V, targets, lse, entropy, grad_lp, grad_ent, inv_temp, grad, ldg,
              threads, 0);
}

void megatron_rlhf_logprob_grad_bf16(const uint16_t *x, int64_t ldx, int64_t n, int64_t V,
                                     const int64_t *targets, const float *lse,
                                     const float *entropy, const float *grad_lp,
                                     const float *grad_ent, float inv_temp, uint16_t *grad,
                                     int64_t ldg, int threads)
{
    grad_rows(x, ldx, n, V, targets, lse, entropy, grad_lp, grad_ent, inv_temp, grad, ldg,
              threads, 1);
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
        const float m = row_max(row, V, inv_temp, 0);
        const __m512 mv = _mm512_set1_ps(m);
        /* the total and the walk in fp64 (fp32 lanes over 1,024 values at a time): at BLOOM's
         * vocabulary an fp32 running sum drifts by ~1e-4 of the mass, tens of tokens */
        __m512d sum_lo = _mm512_setzero_pd(), sum_hi = _mm512_setzero_pd();
        for (int64_t start = 0; start < V; start += BLOCK) {
            __m512 sum = _mm512_setzero_ps();
            const int64_t stop = start + BLOCK < V ? start + BLOCK : V;
            for (int64_t j = start; j < stop; j += 16) {
                const __mmask16 mask = stop - j < 16 ? tail_mask(stop - j) : 0xFFFF;
                const __m512 shifted = _mm512_sub_ps(load_scaled(row, j, mask, inv_temp, 0), mv);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, exp_ps(shifted)));
            }
            add_widened(&sum_lo, &sum_hi, sum);
        }
        const double total = _mm512_reduce_add_pd(_mm512_add_pd(sum_lo, sum_hi));
        const double target = uniforms[i] * total;
        double running = 0.0;
        int64_t token = -1, last_positive = V - 1;
        for (int64_t j = 0; j < V && token < 0; j += 16) {
            const __mmask16 mask = V - j < 16 ? tail_mask(V - j) : 0xFFFF;
            float e[16];
            const __m512 ev = _mm512_maskz_mov_ps(
                mask, exp_ps(_mm512_sub_ps(load_scaled(row, j, mask, inv_temp, 0), mv)));
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
