/* The body of paged_decode.c's kernel for one element type: included once per type with
 * PD_T, PD_LOAD, PD_STORE, PD_DOT, PD_NAME, PD_ROWS, PD_F32 (1: the float32 build) and
 * PD_VALUE_ROW defined (and undefined again at the end). */
/* Returns 0, -1 when scratch memory cannot be had, -2 for shapes past the limits above. */
/* Rows b .. b + n - 1 (n >= 2) that are consecutive tokens of one request (the same blocks,
 * row i's context seq_lens[b] + i), for KV head h: each key and value is read once for all
 * their query heads, and the scores of 16 keys at a time are sums over the head dimension
 * vectorized across the keys. Scratch: qf and acc [n * rep][dim], scores [n * rep][stride]
 * (stride >= the last row's context + PD_KEYS). */
static void PD_ROWS(const PD_T *q, const PD_T *k_cache, const PD_T *v_cache,
                    const int32_t *table, int first_len, int n, int h, int heads, int kv_heads,
                    int dim, int block_size, float scale, float *qf, float *acc,
                    float *scores, int stride, PD_T *out) {
    const int rep = heads / kv_heads, m = n * rep; /* query j: row j / rep, head j % rep */
    const int last = first_len + n - 1;            /* the last row's context */
    const size_t row = (size_t)kv_heads * dim;     /* one token's keys, all heads */
    for (int j = 0; j < m; j++) {
        const PD_T *qp = q + ((size_t)(j / rep) * heads + (size_t)h * rep + j % rep) * dim;
        for (int d = 0; d < dim; d++) qf[(size_t)j * dim + d] = PD_LOAD(qp[d]) * scale;
    }
    float tile[MAX_DIM][PD_KEYS]; /* keys transposed: tile[d][key] */
    for (int t0 = 0; t0 < last; t0 += PD_KEYS) {
        const int w = last - t0 < PD_KEYS ? last - t0 : PD_KEYS;
        for (int kk = 0; kk < PD_KEYS; kk++) {
            if (kk >= w) {
                for (int d = 0; d < dim; d++) tile[d][kk] = 0.f;
                continue;
            }
            const int t = t0 + kk;
            const PD_T *kp = k_cache + (size_t)table[t / block_size] * block_size * row
                             + (size_t)(t % block_size) * row + (size_t)h * dim;
            for (int d = 0; d < dim; d++) tile[d][kk] = PD_LOAD(kp[d]);
        }
        for (int j = 0; j < m; j += PD_QROWS) {
            const int nq = m - j < PD_QROWS ? m - j : PD_QROWS;
            if (t0 >= first_len + (j + nq - 1) / rep) continue; /* past these rows' contexts */
            /* all PD_KEYS scores stored: past a row's context they are zeroed below (the
             * rows have PD_KEYS spare entries) */
            pd_scores16(qf + (size_t)j * dim, nq, (const float(*)[PD_KEYS])tile, dim,
                        scores + (size_t)j * stride + t0, stride);
        }
    }
    float total[PD_GROUP * MAX_REP];
    for (int j = 0; j < m; j++) {
        const int len = first_len + j / rep;
        total[j] = pd_softmax(scores + (size_t)j * stride, len);
        /* zeros up to the last row's context: every row then sums the same keys */
        for (int t = len; t < last; t++) scores[(size_t)j * stride + t] = 0.f;
    }
    memset(acc, 0, sizeof(float) * (size_t)m * dim);
    float vals[PD_KEYS][MAX_DIM]; /* bf16 values converted (float32 ones are read in place) */
    const float *vrows[PD_KEYS];
    for (int t0 = 0; t0 < last; t0 += PD_KEYS) {
        const int w = last - t0 < PD_KEYS ? last - t0 : PD_KEYS;
        for (int kk = 0; kk < w; kk++) {
            const int t = t0 + kk;
            const PD_T *vp = v_cache + (size_t)table[t / block_size] * block_size * row
                             + (size_t)(t % block_size) * row + (size_t)h * dim;
            vrows[kk] = PD_VALUE_ROW(vp, dim, vals[kk]);
        }
        for (int j = 0; j < m; j += 4)
            pd_weighted_sum4(scores + (size_t)j * stride + t0, stride, m - j < 4 ? m - j : 4, w,
                             vrows, dim, acc + (size_t)j * dim);
    }
    for (int j = 0; j < m; j++) {
        PD_T *op = out + ((size_t)(j / rep) * heads + (size_t)h * rep + j % rep) * dim;
        const float inv = 1.f / total[j];
        for (int d = 0; d < dim; d++) op[d] = PD_STORE(acc[(size_t)j * dim + d] * inv);
    }
}

int PD_NAME(const PD_T *q, const PD_T *k_cache, const PD_T *v_cache,
                      const int32_t *tables, int table_stride, const int32_t *seq_lens,
                      PD_T *out, int batch, int heads, int kv_heads, int dim, int block_size,
                      float scale, int threads) {
    const int rep = heads / kv_heads;
    if (rep > MAX_REP || dim > MAX_DIM) return -2;
    int max_len = 1;
    for (int b = 0; b < batch; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* Tasks: a row, or up to PD_GROUP consecutive tokens of one request (a prompt chunk). */
    int *starts = malloc(sizeof(int) * ((size_t)batch + 1));
    if (starts == NULL) return -1;
    int tasks = 0, widest = 1;
    for (int b = 0; b < batch;) {
        int n = 1;
        while (b + n < batch && n < PD_GROUP
               && pd_continues(tables, table_stride, seq_lens, block_size, b + n))
            n++;
        starts[tasks++] = b;
        widest = n > widest ? n : widest;
        b += n;
    }
    starts[tasks] = batch;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const int stride = max_len + PD_KEYS; /* the grouped rows' scores: see PD_ROWS */
        float *scores = malloc(sizeof(float) * (size_t)rep * widest * stride);
        float *qf_rows = widest > 1 ? malloc(sizeof(float) * 2 * (size_t)widest * rep * dim) : NULL;
        if (scores == NULL || (widest > 1 && qf_rows == NULL)) {
#pragma omp atomic write
            failed = 1;
        }
        /* Where there are tasks enough, a task's KV heads run on one thread: a token's heads
         * lie side by side in the cache, so after the first head the others find their rows
         * in this core's caches (brought in with their neighbours'); with few tasks, each head
         * is a unit of its own, for the threads to share. */
        const int whole = tasks >= 2 * threads, units = whole ? tasks : tasks * kv_heads;
#pragma omp for schedule(dynamic)
        for (int unit = 0; unit < units; unit++)
            for (int h = whole ? 0 : unit % kv_heads; h < (whole ? kv_heads : unit % kv_heads + 1);
                 h++) {
                const int task = whole ? unit : unit / kv_heads;
                if (scores == NULL || (widest > 1 && qf_rows == NULL)) continue;
                const int b = starts[task], rows = starts[task + 1] - b;
                const int32_t *table = tables + (size_t)b * table_stride;
                if (rows > 1) {
                    PD_ROWS(q + (size_t)b * heads * dim, k_cache, v_cache, table, seq_lens[b],
                            rows, h, heads, kv_heads, dim, block_size, scale, qf_rows,
                            qf_rows + (size_t)widest * rep * dim, scores, stride,
                            out + (size_t)b * heads * dim);
                    continue;
                }
                const int len = seq_lens[b];
                const size_t row = (size_t)kv_heads * dim; /* one token's keys, all heads */
                float qf[MAX_REP][MAX_DIM], acc[MAX_REP * MAX_DIM]; /* acc [rep][dim] */
                for (int r = 0; r < rep; r++) {
                    const PD_T *qp = q + ((size_t)b * heads + (size_t)h * rep + r) * dim;
                    for (int d = 0; d < dim; d++) qf[r][d] = PD_LOAD(qp[d]) * scale;
                }
                const PD_T *q0 = q + ((size_t)b * heads + (size_t)h * rep) * dim;
                /* keys block by block: no division per key */
                for (int t0 = 0; t0 < len; t0 += block_size) {
                    const PD_T *kb = k_cache + (size_t)table[t0 / block_size] * block_size * row
                                         + (size_t)h * dim;
                    const int n = len - t0 < block_size ? len - t0 : block_size;
                    /* this block's values (read after the softmax) and the next block's keys,
                     * asked for now so that they arrive while these keys are scored */
                    pd_prefetch_rows(v_cache + (size_t)table[t0 / block_size] * block_size * row
                                         + (size_t)h * dim,
                                     row * sizeof(PD_T), n, dim * sizeof(PD_T));
                    if (t0 + block_size < len)
                        pd_prefetch_rows(k_cache + (size_t)table[t0 / block_size + 1] * block_size
                                             * row + (size_t)h * dim,
                                         row * sizeof(PD_T), block_size, dim * sizeof(PD_T));
                    int i = 0;
#if PD_F32 && defined(PD_DOT8)
                    if (dim % 8 == 0) /* eight keys at a time */
                        for (; i + 8 <= n; i += 8)
                            for (int r = 0; r < rep; r++)
                                _mm256_storeu_ps(scores + (size_t)r * len + t0 + i,
                                                 pd_dot8(qf[r], (const float *)kb + i * row,
                                                         row, dim));
#endif
#if !PD_F32 && defined(PD_AVX512BF16)
                    if (dim % 32 == 0) /* eight keys at a time, bf16 products */
                        for (; i + 8 <= n; i += 8)
                            for (int r = 0; r < rep; r++)
                                _mm256_storeu_ps(scores + (size_t)r * len + t0 + i,
                                                 _mm256_mul_ps(pd_dot8_bf16(
                                                     (const uint16_t *)q0 + (size_t)r * dim,
                                                     (const uint16_t *)kb + i * row, row, dim),
                                                     _mm256_set1_ps(scale)));
#endif
                    for (; i < n; i++)
                        for (int r = 0; r < rep; r++)
                            scores[(size_t)r * len + t0 + i] =
                                PD_DOT(qf[r], q0 + (size_t)r * dim, kb + (size_t)i * row, dim,
                                           scale);
                }
                float total[MAX_REP];
                for (int r = 0; r < rep; r++) total[r] = pd_softmax(scores + (size_t)r * len, len);
                memset(acc, 0, sizeof(float) * rep * dim);
                float vals[PD_KEYS][MAX_DIM]; /* as in PD_ROWS */
                const float *vrows[PD_KEYS];
                /* values a run of up to PD_KEYS keys at a time, within one block */
                for (int t0 = 0, w = 0; t0 < len; t0 += w) {
                    const int in_block = block_size - t0 % block_size;
                    w = len - t0 < PD_KEYS ? len - t0 : PD_KEYS;
                    w = w < in_block ? w : in_block;
                    const PD_T *vb = v_cache + (size_t)table[t0 / block_size] * block_size * row
                                         + (size_t)(t0 % block_size) * row + (size_t)h * dim;
                    for (int i = 0; i < w; i++)
                        vrows[i] = PD_VALUE_ROW(vb + (size_t)i * row, dim, vals[i]);
                    for (int r = 0; r < rep; r += 4)
                        pd_weighted_sum4(scores + (size_t)r * len + t0, len,
                                         rep - r < 4 ? rep - r : 4, w, vrows, dim,
                                         acc + (size_t)r * dim);
                }
                for (int r = 0; r < rep; r++) {
                    PD_T *op = out + ((size_t)b * heads + (size_t)h * rep + r) * dim;
                    const float inv = 1.f / total[r];
                    for (int d = 0; d < dim; d++) op[d] = PD_STORE(acc[(size_t)r * dim + d] * inv);
                }
            }
        free(scores);
        free(qf_rows);
    }
    free(starts);
    return failed ? -1 : 0;
}

#undef PD_T
#undef PD_LOAD
#undef PD_STORE
#undef PD_DOT
#undef PD_NAME
#undef PD_ROWS
#undef PD_F32
#undef PD_VALUE_ROW
