/* The body of paged_decode.c's kernel for one pair of element types: included once per pair
 * with PD_Q (the query's and output's type), PD_QLOAD, PD_STORE (float32 -> PD_Q), PD_T (the
 * cache's type), PD_LOAD, PD_DOT, PD_KEYS8 and PD_KEYS8_OK (8 keys' scores at once and the
 * head dimensions it takes, where the build has one), PD_NAME, PD_ROWS, PD_F32 (1: float32
 * values, read in place) and PD_VALUE_ROW defined (and undefined again at the end). */
/* Returns 0, -1 when scratch memory cannot be had, -2 for shapes past the limits above. */
/* Rows b .. b + n - 1 (n >= 2) that are consecutive tokens of one request (the same blocks,
 * row i's context seq_lens[b] + i), for KV head h: each key and value is read once for all
 * their query heads, and the scores of 16 keys at a time are sums over the head dimension
 * vectorized across the keys. Scratch: qf and acc [n * rep][dim], scores [n * rep][stride]
 * (stride >= the last row's context + PD_KEYS). */
static void PD_ROWS(const PD_Q *q, const PD_T *k_cache, const PD_T *v_cache,
                    const int32_t *table, int first_len, int n, int h, int heads, int kv_heads,
                    int dim, int block_size, float scale, float *qf, float *acc,
                    float *scores, int stride, PD_Q *out) {
    const int rep = heads / kv_heads, m = n * rep; /* query j: row j / rep, head j % rep */
    const int last = first_len + n - 1;            /* the last row's context */
    const size_t row = (size_t)kv_heads * dim;     /* one token's keys, all heads */
    for (int j = 0; j < m; j++) {
        const PD_Q *qp = q + ((size_t)(j / rep) * heads + (size_t)h * rep + j % rep) * dim;
        for (int d = 0; d < dim; d++) qf[(size_t)j * dim + d] = PD_QLOAD(qp[d]) * scale;
    }
    float tile[MAX_DIM][PD_KEYS]; /* keys transposed: tile[d][key] */
    for (int t0 = 0; t0 < last; t0 += PD_KEYS) {
        const int w = last - t0 < PD_KEYS ? last - t0 : PD_KEYS;
        pd_prefetch_head(k_cache, table, t0 + PD_AHEAD, last, h, row, dim, block_size,
                         sizeof(PD_T));
        int kk = 0;
#ifdef PD_LOAD8_VECTOR
        if (w == PD_KEYS && dim % 8 == 0) /* eight keys at a time, transposed in registers */
            for (; kk < PD_KEYS; kk += 8) {
                const PD_T *kp[8];
                for (int i = 0; i < 8; i++)
                    kp[i] = k_cache + pd_row_at(table, t0 + kk + i, block_size, row, h, dim);
                for (int d = 0; d < dim; d += 8) {
                    __m256 r[8];
                    for (int i = 0; i < 8; i++) r[i] = PD_LOAD8(kp[i] + d);
                    pd_transpose8(r, tile + d, kk);
                }
            }
#endif
        for (; kk < PD_KEYS; kk++) {
            if (kk >= w) {
                for (int d = 0; d < dim; d++) tile[d][kk] = 0.f;
                continue;
            }
            const PD_T *kp = k_cache + pd_row_at(table, t0 + kk, block_size, row, h, dim);
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
    float total[PD_GROUP_MAX * MAX_REP];
    for (int j = 0; j < m; j++) {
        const int len = first_len + j / rep;
        total[j] = pd_softmax(scores + (size_t)j * stride, len);
        /* zeros up to the last row's context: every row then sums the same keys */
        for (int t = len; t < last; t++) scores[(size_t)j * stride + t] = 0.f;
    }
    memset(acc, 0, sizeof(float) * (size_t)m * dim);
    /* Values a weighted sum takes at once: the rows' sums stay in registers across them
     * (float32, read in place); converted bf16 ones need scratch, PD_KEYS at a time. */
#if PD_F32
#define PD_RUN PD_PV_KEYS
#else
#define PD_RUN PD_KEYS
#endif
    float vals[PD_F32 ? 1 : PD_KEYS][MAX_DIM]; /* 16-bit values converted */
    const float *vrows[PD_RUN];
    for (int t0 = 0; t0 < last; t0 += PD_RUN) {
        const int w = last - t0 < PD_RUN ? last - t0 : PD_RUN;
        for (int p = 0; p < w; p += PD_KEYS)
            pd_prefetch_head(v_cache, table, t0 + p + PD_AHEAD, last, h, row, dim, block_size,
                             sizeof(PD_T));
        for (int kk = 0; kk < w; kk++)
            vrows[kk] = PD_VALUE_ROW(v_cache + pd_row_at(table, t0 + kk, block_size, row, h, dim),
                                     dim, vals[PD_F32 ? 0 : kk]);
        pd_weighted_sum(scores + t0, stride, m, w, vrows, dim, acc);
    }
#undef PD_RUN
    for (int j = 0; j < m; j++) {
        PD_Q *op = out + ((size_t)(j / rep) * heads + (size_t)h * rep + j % rep) * dim;
        const float inv = 1.f / total[j];
        for (int d = 0; d < dim; d++) op[d] = PD_STORE(acc[(size_t)j * dim + d] * inv);
    }
}

/* One decode row's attention over the keys [t0, t1) of its context (t0 a multiple of
 * block_size), for the KV heads [h0, h1) and their query heads: the scores, softmax and values
 * of this stretch alone, for PD_MERGE: per query head j its largest score mx[j], the sum of
 * exponentials sm[j] and the unnormalized value sums acc [heads][dim] (those heads' entries
 * only; a head's are the same bits whichever heads go with it). The keys of a block are taken
 * eight tokens at a time, each head of them in turn (and the values sixteen tokens at a time),
 * so that those tokens' rows are read front to back together, as the hardware prefetchers
 * follow them. Read head by head instead (a head's rows a token's whole row apart: 4 KiB on
 * SmolLM2-1.7B, a page each), and with every next block asked for in one burst of software
 * prefetches (pd_block: small blocks only now), a 1.7B decode's attention read its cache at
 * 13 GB/s where the weights stream at 26.
 * Scratch: qf [heads][dim], scores [heads][stride] (stride >= t1 - t0). */
static void PD_SEG(const PD_Q *q, const PD_T *k_cache, const PD_T *v_cache,
                   const int32_t *table, int t0, int t1, int h0, int h1, int heads, int kv_heads,
                   int dim, int block_size, float scale, float *qf, float *scores, int stride,
                   float *mx, float *sm, float *acc) {
    const int rep = heads / kv_heads, len = t1 - t0, j0 = h0 * rep, j1 = h1 * rep;
    const size_t row = (size_t)kv_heads * dim; /* one token's keys, all heads */
    const size_t row_bytes = row * sizeof(PD_T), head_at = (size_t)h0 * dim * sizeof(PD_T),
                 head_bytes = (size_t)(h1 - h0) * dim * sizeof(PD_T);
    for (int j = j0; j < j1; j++)
        for (int d = 0; d < dim; d++) qf[(size_t)j * dim + d] = PD_QLOAD(q[(size_t)j * dim + d]) * scale;
    for (int b0 = t0; b0 < t1; b0 += block_size) {
        const int n = t1 - b0 < block_size ? t1 - b0 : block_size;
        const PD_T *kb = pd_block(k_cache, table, b0, t1, block_size, row_bytes, head_at,
                                  head_bytes);
        float *sb = scores + (b0 - t0);
#ifdef PD_KEYS8
        const int n8 = PD_KEYS8_OK(dim) ? n / 8 * 8 : 0;
        for (int i = 0; i < n8; i += 8)
            for (int h = h0; h < h1; h++)
                for (int j = h * rep; j < (h + 1) * rep; j++)
                    _mm256_storeu_ps(sb + (size_t)j * stride + i,
                                     PD_KEYS8(qf + (size_t)j * dim, q + (size_t)j * dim,
                                              kb + i * row + (size_t)h * dim, row, dim, scale));
#else
        const int n8 = 0;
#endif
        for (int i = n8; i < n; i++)
            for (int h = h0; h < h1; h++)
                for (int j = h * rep; j < (h + 1) * rep; j++)
                    sb[(size_t)j * stride + i] = PD_DOT(qf + (size_t)j * dim, q + (size_t)j * dim,
                                                        kb + i * row + (size_t)h * dim, dim, scale);
    }
    for (int j = j0; j < j1; j++) {
        float *sj = scores + (size_t)j * stride, top = sj[0];
#pragma omp simd reduction(max : top)
        for (int t = 1; t < len; t++) top = sj[t] > top ? sj[t] : top;
        mx[j] = top;
        sm[j] = exp_shifted(sj, len, top);
    }
    memset(acc + (size_t)j0 * dim, 0, sizeof(float) * (size_t)(j1 - j0) * dim);
    float vals[PD_KEYS][MAX_DIM]; /* 16-bit values converted (float32 ones are read in place) */
    const float *vrows[PD_KEYS];
    for (int b0 = t0; b0 < t1; b0 += block_size) {
        const int n = t1 - b0 < block_size ? t1 - b0 : block_size;
        const PD_T *vb = pd_block(v_cache, table, b0, t1, block_size, row_bytes, head_at,
                                  head_bytes);
        for (int i0 = 0; i0 < n; i0 += PD_KEYS)
            for (int h = h0; h < h1; h++) {
                const int w = n - i0 < PD_KEYS ? n - i0 : PD_KEYS;
                for (int i = 0; i < w; i++)
                    vrows[i] = PD_VALUE_ROW(vb + (size_t)(i0 + i) * row + (size_t)h * dim, dim, vals[i]);
                for (int r = 0; r < rep; r += 4)
                    pd_weighted_sum4(scores + (size_t)(h * rep + r) * stride + (b0 - t0) + i0, stride,
                                     rep - r < 4 ? rep - r : 4, w, vrows, dim,
                                     acc + (size_t)(h * rep + r) * dim);
            }
    }
}

/* The stretches [first, end) of one decode row (PD_SEG's mx, sm and acc, each stretch's
 * `part` floats apart: heads x (2 + dim)) joined into its output row: the softmax over the
 * whole context, each stretch's sums rescaled to the largest score. */
static void PD_MERGE(const float *parts, int first, int end, int heads, int dim, PD_Q *out) {
    const size_t part = (size_t)heads * (2 + dim);
    for (int j = 0; j < heads; j++) {
        float top = parts[(size_t)first * part + j];
        for (int s = first + 1; s < end; s++)
            top = parts[(size_t)s * part + j] > top ? parts[(size_t)s * part + j] : top;
        float total = 0.f, o[MAX_DIM];
        for (int d = 0; d < dim; d++) o[d] = 0.f;
        for (int s = first; s < end; s++) {
            const float *p = parts + (size_t)s * part;
            const float w = exp_nonpositive(p[j] - top);
            total += w * p[heads + j];
            const float *a = p + 2 * (size_t)heads + (size_t)j * dim;
#pragma omp simd
            for (int d = 0; d < dim; d++) o[d] += w * a[d];
        }
        const float inv = 1.f / total;
        for (int d = 0; d < dim; d++) out[(size_t)j * dim + d] = PD_STORE(o[d] * inv);
    }
}

int PD_NAME(const PD_Q *q, const PD_T *k_cache, const PD_T *v_cache,
                      const int32_t *tables, int table_stride, const int32_t *seq_lens,
                      PD_Q *out, int batch, int heads, int kv_heads, int dim, int block_size,
                      float scale, int threads) {
    const int rep = heads / kv_heads;
    if (rep > MAX_REP || dim > MAX_DIM) return -2;
    int max_len = 1;
    for (int b = 0; b < batch; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    /* Tasks: up to `group` (pd_group_rows) consecutive tokens of one request (a prompt
     * chunk), and decode rows (one token), whose contexts are cut into stretches of `seg`
     * keys (PD_SEG): with few rows and long contexts the threads share each row's keys
     * (SmolLM2-1.7B, one chat at 2000 tokens: a decode step 52 -> 39 ms on a 2-core Zen 5). */
    int *starts = malloc(sizeof(int) * ((size_t)batch + 1));
    int *grouped = malloc(sizeof(int) * ((size_t)batch + 1));
    int *singles = malloc(sizeof(int) * ((size_t)batch + 1));
    int *seg_first = malloc(sizeof(int) * ((size_t)batch + 1));
    if (starts == NULL || grouped == NULL || singles == NULL || seg_first == NULL) {
        free(starts), free(grouped), free(singles), free(seg_first);
        return -1;
    }
    const int stride = max_len + PD_KEYS; /* the grouped rows' scores: see PD_ROWS */
    const int group = pd_group_rows(batch, kv_heads, rep, stride, threads);
    int tasks = 0, widest = 1, n_grouped = 0, n_single = 0;
    for (int b = 0; b < batch;) {
        int n = 1;
        while (b + n < batch && n < group
               && pd_continues(tables, table_stride, seq_lens, block_size, b + n))
            n++;
        /* the run's last row is not left alone: as a single row it would take the stretches'
         * path, whose sums differ in their order (a row's bits would hang on the grouping) */
        if (n > 1 && b + n < batch
            && pd_continues(tables, table_stride, seq_lens, block_size, b + n)
            && !(b + n + 1 < batch
                 && pd_continues(tables, table_stride, seq_lens, block_size, b + n + 1)))
            n += n > 2 ? -1 : 1; /* leave two rows; a group of two takes the third */
        starts[tasks] = b;
        if (n > 1) {
            grouped[n_grouped++] = tasks;
            widest = n > widest ? n : widest;
        } else {
            singles[n_single++] = b;
        }
        tasks++;
        b += n;
    }
    starts[tasks] = batch;
    /* Stretches of PD_SEG_KEYS keys, or PD_SEG_BYTES of them (whole blocks): a row's own
     * length (and the model's shape) alone sets them, so that its result does not depend on
     * the rows beside it. */
    const int row_bytes = (int)sizeof(PD_T) * kv_heads * dim,
              seg_keys = PD_SEG_BYTES / row_bytes > PD_SEG_KEYS ? PD_SEG_BYTES / row_bytes
                                                                 : PD_SEG_KEYS;
    const int seg = (seg_keys + block_size - 1) / block_size * block_size;
    int n_seg = 0;
    for (int i = 0; i < n_single; i++) {
        seg_first[i] = n_seg;
        n_seg += (seq_lens[singles[i]] + seg - 1) / seg;
    }
    seg_first[n_single] = n_seg;
    const size_t part = (size_t)heads * (2 + dim);
    float *parts = n_seg ? malloc(sizeof(float) * part * n_seg) : NULL;
    int *seg_row = n_seg ? malloc(sizeof(int) * 2 * (size_t)n_seg) : NULL; /* (single, t0) */
    if (n_seg && (parts == NULL || seg_row == NULL)) {
        free(starts), free(grouped), free(singles), free(seg_first), free(parts), free(seg_row);
        return -1;
    }
    for (int i = 0; i < n_single; i++)
        for (int u = seg_first[i]; u < seg_first[i + 1]; u++) {
            seg_row[2 * u] = i;
            seg_row[2 * u + 1] = (u - seg_first[i]) * seg;
        }
    /* Few stretches (short contexts, few rows): each is cut by KV heads too, into units
     * enough for the threads to share evenly (alone, one chat's attention ran on one thread;
     * five stretches on two threads left one waiting for the other's third). */
    int hparts = n_seg ? (PD_UNITS_PER_THREAD * threads + n_seg - 1) / n_seg : 1;
    hparts = hparts < 1 ? 1 : hparts > kv_heads ? kv_heads : hparts;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = n_grouped ? malloc(sizeof(float) * (size_t)rep * widest * stride) : NULL;
        float *qf_rows = n_grouped ? malloc(sizeof(float) * 2 * (size_t)widest * rep * dim) : NULL;
        float *seg_scores = n_seg ? malloc(sizeof(float) * (size_t)heads * seg) : NULL;
        float *seg_qf = n_seg ? malloc(sizeof(float) * (size_t)heads * dim) : NULL;
        const int short_of_memory = (n_grouped && (scores == NULL || qf_rows == NULL))
                                    || (n_seg && (seg_scores == NULL || seg_qf == NULL));
        if (short_of_memory) {
#pragma omp atomic write
            failed = 1;
        }
        /* Where there are tasks enough, a task's KV heads run on one thread: a token's heads
         * lie side by side in the cache, so after the first head the others find their rows
         * in this core's caches (brought in with their neighbours'); with few tasks, each head
         * is a unit of its own, for the threads to share. */
        const int whole = n_grouped >= 2 * threads, units = whole ? n_grouped : n_grouped * kv_heads;
#pragma omp for schedule(dynamic) nowait
        for (int unit = 0; unit < units; unit++)
            for (int h = whole ? 0 : unit % kv_heads; h < (whole ? kv_heads : unit % kv_heads + 1);
                 h++) {
                if (short_of_memory) continue;
                const int task = grouped[whole ? unit : unit / kv_heads];
                const int b = starts[task], rows = starts[task + 1] - b;
                PD_ROWS(q + (size_t)b * heads * dim, k_cache, v_cache,
                        tables + (size_t)b * table_stride, seq_lens[b], rows, h, heads, kv_heads,
                        dim, block_size, scale, qf_rows, qf_rows + (size_t)widest * rep * dim,
                        scores, stride, out + (size_t)b * heads * dim);
            }
#pragma omp for schedule(dynamic)
        for (int unit = 0; unit < n_seg * hparts; unit++) {
            if (short_of_memory) continue;
            const int u = unit / hparts, g = unit % hparts;
            const int b = singles[seg_row[2 * u]], t0 = seg_row[2 * u + 1];
            const int t1 = t0 + seg < seq_lens[b] ? t0 + seg : seq_lens[b];
            float *p = parts + (size_t)u * part;
            PD_SEG(q + (size_t)b * heads * dim, k_cache, v_cache, tables + (size_t)b * table_stride,
                   t0, t1, kv_heads * g / hparts, kv_heads * (g + 1) / hparts, heads, kv_heads,
                   dim, block_size, scale, seg_qf, seg_scores, seg, p, p + heads,
                   p + 2 * (size_t)heads);
        }
        /* (the loop's barrier: every stretch is done) */
#pragma omp for schedule(static)
        for (int i = 0; i < n_single; i++)
            if (!failed)
                PD_MERGE(parts, seg_first[i], seg_first[i + 1], heads, dim,
                         out + (size_t)singles[i] * heads * dim);
        free(scores);
        free(qf_rows);
        free(seg_scores);
        free(seg_qf);
    }
    free(starts), free(grouped), free(singles), free(seg_first), free(parts), free(seg_row);
    return failed ? -1 : 0;
}

#undef PD_Q
#undef PD_QLOAD
#undef PD_T
#undef PD_LOAD
#undef PD_STORE
#undef PD_DOT
#undef PD_KEYS8
#undef PD_KEYS8_OK
#undef PD_NAME
#undef PD_ROWS
#undef PD_SEG
#undef PD_MERGE
#undef PD_F32
#undef PD_VALUE_ROW
#undef PD_LOAD8
