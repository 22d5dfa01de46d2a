// attention-flash.c - causal attention of a block of prefill tokens over one KV head's list,
// streaming the list once per block (flash attention: an online softmax, no weights row).
//
// Token by token, a prefill chunk reads each head's whole list once per token: at 8K tokens
// that is several gigabytes of keys and values per layer, and the cores wait on memory. Here
// the tokens of a block and their query heads (the GQA group), up to FLASH_ROWS query rows,
// share every block of FLASH_KEYS entries. A key block is converted once into a transposed
// float tile, so a query's FLASH_KEYS scores are plain multiply-adds over the head's
// dimensions (no horizontal sums); a value block once into a float tile. Each query row
// keeps a running max m, a running sum l of exp(score - m) and its unnormalised output o,
// rescaled by exp(m_old - m_new) when the max grows; out = o / l at the end.
#include "cpu/attention.h"

#include <math.h>
#include <string.h>

int flash_tokens_per_block(int n_rep) { return n_rep >= FLASH_ROWS ? 1 : FLASH_ROWS / n_rep; }

// Kt (d x FLASH_KEYS), Vb (FLASH_KEYS x d), two score rows, then m, l and o of every row.
static int block_rows(int n_rep) { return flash_tokens_per_block(n_rep) * n_rep; }

size_t flash_work_floats(int d, int n_rep) {
    return (size_t)2 * d * FLASH_KEYS + 2 * FLASH_KEYS + (size_t)block_rows(n_rep) * (size_t)(d + 2);
}

// Entries [j0, j0 + nb) of the list as floats: keys transposed into Kt (columns past nb are
// zero), values row by row into Vb.
static void load_block_scalar(const struct kv_list *l, int j0, int nb, int d, float *Kt, float *Vb) {
    float tmp[PYKV_MAX_HEAD_DIM];
    for (int j = 0; j < FLASH_KEYS; j++) {
        if (j >= nb) {
            for (int c = 0; c < d; c++) Kt[(size_t)c * FLASH_KEYS + j] = 0.0f;
            continue;
        }
        const float *k = kv_key_f32(l, j0 + j, d, tmp);
        for (int c = 0; c < d; c++) Kt[(size_t)c * FLASH_KEYS + j] = k[c];
        memcpy(Vb + (size_t)j * d, kv_value_f32(l, j0 + j, d, tmp), (size_t)d * sizeof(float));
    }
}

// One query row against a loaded block: nv (<= nb) entries visible.
static void row_scalar(const float *q, const float *Kt, const float *Vb, int nv, int d, float scale,
                       float *m, float *lsum, float *o, float *s) {
    float mb = -INFINITY;
    for (int j = 0; j < nv; j++) {
        float acc = 0.0f;
        for (int c = 0; c < d; c++) acc += q[c] * Kt[(size_t)c * FLASH_KEYS + j];
        s[j] = acc * scale;
        if (s[j] > mb) mb = s[j];
    }
    if (mb > *m) {
        const float corr = expf(*m - mb);   // 0 on the first block (m = -inf)
        *lsum *= corr;
        for (int c = 0; c < d; c++) o[c] *= corr;
        *m = mb;
    }
    float sum = 0.0f;
    for (int j = 0; j < nv; j++) {
        const float p = expf(s[j] - *m);
        const float *v = Vb + (size_t)j * d;
        sum += p;
        for (int c = 0; c < d; c++) o[c] += p * v[c];
    }
    *lsum += sum;
}

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/simd-avx2.h"

static int use_avx2(int d) {
    return d % 32 == 0 && cpu_has_avx2();
}

static inline AVX2_TGT void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// A full block's keys, transposed: eight rows by eight dimensions at a time through an 8x8
// transpose; and its values as they are (fmt: enum kv_format, a constant in each instance
// below).
static inline __attribute__((always_inline)) AVX2_TGT void load_keys_fmt(const struct kv_list *l, int j0, int d,
                                                                         float *Kt, const int fmt) {
    for (int jb = 0; jb < FLASH_KEYS; jb += 8) {
        const void *rows[8];
        for (int t = 0; t < 8; t++) rows[t] = kv_key_row(l, j0 + jb + t, d);
        for (int c = 0; c < d; c += 8) {
            __m256 r[8];
            for (int t = 0; t < 8; t++) r[t] = load8_kv(rows[t], c, fmt);
            transpose8(r);
            for (int t = 0; t < 8; t++) _mm256_storeu_ps(Kt + (size_t)(c + t) * FLASH_KEYS + jb, r[t]);
        }
    }
}

static inline __attribute__((always_inline)) AVX2_TGT void load_values_fmt(const struct kv_list *l, int j0, int d,
                                                                           float *Vb, const int fmt) {
    for (int j = 0; j < FLASH_KEYS; j++) {
        const void *v = kv_value_row(l, j0 + j, d);
        for (int c = 0; c < d; c += 8) _mm256_storeu_ps(Vb + (size_t)j * d + c, load8_kv(v, c, fmt));
    }
}

static AVX2_TGT void load_block_avx2(const struct kv_list *l, int j0, int d, float *Kt, float *Vb) {
    if (l->fmt_k == KV_F16) load_keys_fmt(l, j0, d, Kt, KV_F16);
    else if (l->fmt_k == KV_Q8_0) load_keys_fmt(l, j0, d, Kt, KV_Q8_0);
    else load_keys_fmt(l, j0, d, Kt, KV_F32);
    if (l->fmt_v == KV_F16) load_values_fmt(l, j0, d, Vb, KV_F16);
    else if (l->fmt_v == KV_Q8_0) load_values_fmt(l, j0, d, Vb, KV_Q8_0);
    else load_values_fmt(l, j0, d, Vb, KV_F32);
}

// Scores of nr (1 or 2) query rows against the block, scaled, lanes j >= nv[r] set to -inf:
// row r's FLASH_KEYS scores go to s + r * FLASH_KEYS. Each key column is loaded once for
// both rows.
static inline __attribute__((always_inline)) AVX2_TGT
void block_scores_avx2(const float *const *q, const int nr, const float *Kt, int d, float scale, const int *nv, float *s) {
    __m256 a[2][4];
    for (int r = 0; r < nr; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
    for (int c = 0; c < d; c++) {
        const float *kt = Kt + (size_t)c * FLASH_KEYS;
        __m256 k0 = _mm256_loadu_ps(kt), k1 = _mm256_loadu_ps(kt + 8);
        __m256 k2 = _mm256_loadu_ps(kt + 16), k3 = _mm256_loadu_ps(kt + 24);
        // in registers: the compiler would fold each load into both rows' multiply-adds
        __asm__("" : "+x"(k0), "+x"(k1), "+x"(k2), "+x"(k3));
        for (int r = 0; r < nr; r++) {
            const __m256 qc = _mm256_broadcast_ss(q[r] + c);
            a[r][0] = _mm256_fmadd_ps(qc, k0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(qc, k1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(qc, k2, a[r][2]);
            a[r][3] = _mm256_fmadd_ps(qc, k3, a[r][3]);
        }
    }
    const __m256 vs = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < nr; r++)
        for (int b = 0; b < 4; b++) {
            const __m256i idx = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * b));
            const __m256 visible = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nv[r]), idx));
            _mm256_storeu_ps(s + r * FLASH_KEYS + 8 * b, _mm256_blendv_ps(ninf, _mm256_mul_ps(a[r][b], vs), visible));
        }
}

// The online-softmax step of one row: its block scores s (masked lanes -inf) become
// weights in place and the running max and sum move on; returns the factor its running
// output must be rescaled by.
static inline AVX2_TGT float row_softmax_avx2(float *s, float *m, float *lsum) {
    __m256 v0 = _mm256_loadu_ps(s), v1 = _mm256_loadu_ps(s + 8), v2 = _mm256_loadu_ps(s + 16), v3 = _mm256_loadu_ps(s + 24);
    const __m256 mx = _mm256_max_ps(_mm256_max_ps(v0, v1), _mm256_max_ps(v2, v3));
    const float mb = hmax_ps(mx);
    float corr = 1.0f;
    if (mb > *m) {
        corr = expf(*m - mb);   // 0 on the first block (m = -inf)
        *m = mb;
    }
    const __m256 vm = _mm256_set1_ps(*m);
    v0 = exp_ps(_mm256_sub_ps(v0, vm)); v1 = exp_ps(_mm256_sub_ps(v1, vm));
    v2 = exp_ps(_mm256_sub_ps(v2, vm)); v3 = exp_ps(_mm256_sub_ps(v3, vm));
    _mm256_storeu_ps(s, v0); _mm256_storeu_ps(s + 8, v1); _mm256_storeu_ps(s + 16, v2); _mm256_storeu_ps(s + 24, v3);
    *lsum = *lsum * corr + hsum_ps(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    return corr;
}

// o_r = o_r * corr_r + weights_r x Vb for nr (1 or 2) rows that see the block's first nv
// entries. Two rows share every value load and keep eight independent multiply-add chains,
// enough to hide the FMA latency.
static inline __attribute__((always_inline)) AVX2_TGT
void rows_values_avx2(const int nr, const float *s, const float *corr, int nv, const float *Vb, int d, float *o) {
    for (int c = 0; c < d; c += 32) {
        __m256 a[2][4];
        for (int r = 0; r < nr; r++) {
            const __m256 vc = _mm256_set1_ps(corr[r]);
            for (int b = 0; b < 4; b++) a[r][b] = _mm256_mul_ps(_mm256_loadu_ps(o + (size_t)r * d + c + 8 * b), vc);
        }
        for (int j = 0; j < nv; j++) {
            const float *v = Vb + (size_t)j * d + c;
            __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
            __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
            __asm__("" : "+x"(v0), "+x"(v1), "+x"(v2), "+x"(v3));   // loaded once for both rows
            for (int r = 0; r < nr; r++) {
                const __m256 p = _mm256_broadcast_ss(s + r * FLASH_KEYS + j);
                a[r][0] = _mm256_fmadd_ps(p, v0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(p, v1, a[r][1]);
                a[r][2] = _mm256_fmadd_ps(p, v2, a[r][2]);
                a[r][3] = _mm256_fmadd_ps(p, v3, a[r][3]);
            }
        }
        for (int r = 0; r < nr; r++)
            for (int b = 0; b < 4; b++) _mm256_storeu_ps(o + (size_t)r * d + c + 8 * b, a[r][b]);
    }
}

// Rows r0 .. rows-1 of the block (row r = token r / n_rep, head r % n_rep), two at a time.
static AVX2_TGT void rows_avx2(const float *q, size_t q_stride, int n_rep, int r0, int rows, int n_vis0, int j0,
                               const float *Kt, const float *Vb, int d, float scale, float *m, float *lsum, float *o, float *s) {
    for (int r = r0; r < rows; r += 2) {
        const int nr = r + 1 < rows ? 2 : 1;
        const float *qr[2];
        int nv[2];
        for (int i = 0; i < nr; i++) {
            const int tok = (r + i) / n_rep, head = (r + i) % n_rep;
            qr[i] = q + (size_t)tok * q_stride + (size_t)head * d;
            nv[i] = n_vis0 + tok - j0;
            if (nv[i] > FLASH_KEYS) nv[i] = FLASH_KEYS;
        }
        float corr[2];
        if (nr == 2) block_scores_avx2(qr, 2, Kt, d, scale, nv, s);
        else block_scores_avx2(qr, 1, Kt, d, scale, nv, s);
        for (int i = 0; i < nr; i++) corr[i] = row_softmax_avx2(s + i * FLASH_KEYS, m + r + i, lsum + r + i);
        // rows that see different entries (the chunk's diagonal) go one at a time: a masked
        // entry's value is never read, so one that is not finite cannot reach the other row
        if (nr == 2 && nv[0] == nv[1]) rows_values_avx2(2, s, corr, nv[0], Vb, d, o + (size_t)r * d);
        else
            for (int i = 0; i < nr; i++) rows_values_avx2(1, s + i * FLASH_KEYS, corr + i, nv[i], Vb, d, o + (size_t)(r + i) * d);
    }
}
#else
static int use_avx2(int d) { (void)d; return 0; }
#endif

static void attention_flash_impl(const float *q, size_t q_stride, int n_tok, int n_rep, int n_vis0,
                                 const struct kv_list *l, int d, float *out, size_t out_stride, float *work, int simd) {
    const int rows = n_tok * n_rep;
    float *Kt = work, *Vb = Kt + (size_t)d * FLASH_KEYS, *s = Vb + (size_t)d * FLASH_KEYS;
    float *m = s + 2 * FLASH_KEYS, *lsum = m + rows, *o = lsum + rows;
    for (int r = 0; r < rows; r++) { m[r] = -INFINITY; lsum[r] = 0.0f; }
    memset(o, 0, (size_t)rows * d * sizeof(float));
    const float scale = 1.0f / sqrtf((float)d);
    const int n_end = n_vis0 + n_tok - 1;   // entries the last token sees

    for (int j0 = 0; j0 < n_end; j0 += FLASH_KEYS) {
        const int nb = n_end - j0 < FLASH_KEYS ? n_end - j0 : FLASH_KEYS;
        // tokens that see nothing of this block come first: skip their rows
        const int first_tok = j0 >= n_vis0 ? j0 - n_vis0 + 1 : 0;
#if defined(__x86_64__) || defined(__i386__)
        if (simd) {
            if (nb == FLASH_KEYS) load_block_avx2(l, j0, d, Kt, Vb);
            else load_block_scalar(l, j0, nb, d, Kt, Vb);
            rows_avx2(q, q_stride, n_rep, first_tok * n_rep, rows, n_vis0, j0, Kt, Vb, d, scale, m, lsum, o, s);
            continue;
        }
#endif
        load_block_scalar(l, j0, nb, d, Kt, Vb);
        for (int r = first_tok * n_rep; r < rows; r++) {
            const int tok = r / n_rep, head = r % n_rep;
            int nv = n_vis0 + tok - j0;
            if (nv > nb) nv = nb;
            row_scalar(q + (size_t)tok * q_stride + (size_t)head * d, Kt, Vb, nv, d, scale, m + r, lsum + r,
                       o + (size_t)r * d, s);
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / lsum[r];
        float *dst = out + (size_t)(r / n_rep) * out_stride + (size_t)(r % n_rep) * d;
        for (int c = 0; c < d; c++) dst[c] = o[(size_t)r * d + c] * inv;
    }
}

void attention_flash(const float *q, size_t q_stride, int n_tok, int n_rep, int n_vis0, const struct kv_list *l,
                     int d, float *out, size_t out_stride, float *work) {
    attention_flash_impl(q, q_stride, n_tok, n_rep, n_vis0, l, d, out, out_stride, work, use_avx2(d));
}

void attention_flash_scalar(const float *q, size_t q_stride, int n_tok, int n_rep, int n_vis0, const struct kv_list *l,
                            int d, float *out, size_t out_stride, float *work) {
    attention_flash_impl(q, q_stride, n_tok, n_rep, n_vis0, l, d, out, out_stride, work, 0);
}

double attention_merge_scales(int n_part, const float *m, const float *lsum, float *f) {
    float mx = -INFINITY;
    for (int p = 0; p < n_part; p++) if (m[p] > mx) mx = m[p];
    double total = 0.0;
    for (int p = 0; p < n_part; p++) {
        f[p] = expf(m[p] - mx);
        total += (double)f[p] * lsum[p];
    }
    return total;
}

void attention_merge(int n_part, const float *m, const float *lsum, const float *o, int d, float *out) {
    float f[ATTENTION_MAX_PARTS];
    const double total = attention_merge_scales(n_part, m, lsum, f);
    memset(out, 0, (size_t)d * sizeof(float));
    for (int p = 0; p < n_part; p++)
        for (int c = 0; c < d; c++) out[c] += f[p] * o[(size_t)p * d + c];
    const float inv = (float)(1.0 / total);
    for (int c = 0; c < d; c++) out[c] *= inv;
}
