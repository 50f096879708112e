/* The body of paged_decode.c's kernel for one element type: included once per type with
 * PD_T, PD_LOAD, PD_STORE, PD_DOT and PD_NAME defined (and undefined again at the end). */
/* Returns 0, -1 when scratch memory cannot be had, -2 for shapes past the limits above. */
int PD_NAME(const PD_T *q, const PD_T *k_cache, const PD_T *v_cache,
                      const int32_t *tables, int table_stride, const int32_t *seq_lens,
                      PD_T *out, int batch, int heads, int kv_heads, int dim, int block_size,
                      float scale, int threads) {
    const int rep = heads / kv_heads;
    if (rep > MAX_REP || dim > MAX_DIM) return -2;
    int max_len = 1;
    for (int b = 0; b < batch; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)rep * max_len);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(dynamic)
        for (int b = 0; b < batch; b++)
            for (int h = 0; h < kv_heads; h++) {
                if (scores == NULL) continue;
                const int len = seq_lens[b];
                const int32_t *table = tables + (size_t)b * table_stride;
                const size_t row = (size_t)kv_heads * dim; /* one token's keys, all heads */
                float qf[MAX_REP][MAX_DIM], acc[MAX_REP][MAX_DIM];
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
                    for (int i = 0; i < n; i++)
                        for (int r = 0; r < rep; r++)
                            scores[(size_t)r * len + t0 + i] =
                                PD_DOT(qf[r], q0 + (size_t)r * dim, kb + (size_t)i * row, dim,
                                           scale);
                }
                float total[MAX_REP];
                for (int r = 0; r < rep; r++) {
                    float *sr = scores + (size_t)r * len, top = sr[0], sum = 0.f;
                    for (int t = 1; t < len; t++) top = sr[t] > top ? sr[t] : top;
#pragma omp simd reduction(+ : sum)
                    for (int t = 0; t < len; t++) {
                        sr[t] = exp_nonpositive(sr[t] - top);
                        sum += sr[t];
                    }
                    total[r] = sum;
                    memset(acc[r], 0, sizeof(float) * dim);
                }
                for (int t0 = 0; t0 < len; t0 += block_size) {
                    const PD_T *vb = v_cache + (size_t)table[t0 / block_size] * block_size * row
                                         + (size_t)h * dim;
                    const int n = len - t0 < block_size ? len - t0 : block_size;
                    for (int i = 0; i < n; i++) {
                        const PD_T *vp = vb + (size_t)i * row;
                        float vf[MAX_DIM];
#pragma omp simd
                        for (int d = 0; d < dim; d++) vf[d] = PD_LOAD(vp[d]);
                        for (int r = 0; r < rep; r++) {
                            const float p = scores[(size_t)r * len + t0 + i];
#pragma omp simd
                            for (int d = 0; d < dim; d++) acc[r][d] += p * vf[d];
                        }
                    }
                }
                for (int r = 0; r < rep; r++) {
                    PD_T *op = out + ((size_t)b * heads + (size_t)h * rep + r) * dim;
                    const float inv = 1.f / total[r];
                    for (int d = 0; d < dim; d++) op[d] = PD_STORE(acc[r][d] * inv);
                }
            }
        free(scores);
    }
    return failed ? -1 : 0;
}

#undef PD_T
#undef PD_LOAD
#undef PD_STORE
#undef PD_DOT
#undef PD_NAME
