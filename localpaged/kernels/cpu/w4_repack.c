/* AWQ and GPTQ checkpoints' 4-bit words into the package's internal layout and the 4-bit
 * kernel's, in parallel over rows of words: a 1.5B checkpoint's first load otherwise spends
 * tens of seconds in torch's element-wise shifts (localpaged/quant/layout.py keeps those as
 * the reference).
 *
 * The internal layout (layout.py's `Int4Weight.qweight`): uint32 words [K/8][N], nibble p of
 * word (r, n) the code of input row 8r + p of output column n (LSB first). */
#include <stdint.h>
#include <string.h>

/* AWQ GEMM `src` [K][N/8] (nibble p of word (k, j): column 8j + order[p], order 0 2 4 6 1 3 5
 * 7) -> internal `dst` [K/8][N]. */
void w4_awq_to_internal(const uint32_t *src, long k, long n, uint32_t *dst, int threads) {
    static const int nibble_of_column[8] = {0, 4, 1, 5, 2, 6, 3, 7};
    const long words = n / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < k / 8; r++) {
        uint32_t *out = dst + r * n;
        memset(out, 0, (size_t)n * sizeof(uint32_t));
        for (int p = 0; p < 8; p++) {
            const uint32_t *row = src + (r * 8 + p) * words;
            for (long j = 0; j < words; j++)
                for (int c = 0; c < 8; c++)
                    out[8 * j + c] |= ((row[j] >> (4 * nibble_of_column[c])) & 15u) << (4 * p);
        }
    }
}

/* Internal `src` [K/8][N] with its input rows reordered: code (i, col) of `dst` is code
 * (rows[i], col) of `src` (act-order GPTQ, rows sorted by group). */
void w4_gather_rows(const uint32_t *src, const int64_t *rows, long k, long n, uint32_t *dst,
                    int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < k / 8; r++) {
        uint32_t *out = dst + r * n;
        memset(out, 0, (size_t)n * sizeof(uint32_t));
        for (int p = 0; p < 8; p++) {
            const int64_t from = rows[r * 8 + p];
            const uint32_t *row = src + (from / 8) * n;
            const int shift = 4 * (int)(from % 8);
            for (long c = 0; c < n; c++) out[c] |= ((row[c] >> shift) & 15u) << (4 * p);
        }
    }
}

/* Internal `src` [K/8][N] -> the kernel's pairs layout `dst` [N/16][K/2][16] (quant_gemm.c):
 * byte (t, q, j) holds rows 2q and 2q + 1 of column 16t + j, which is byte q % 4 of word
 * (q / 4, 16t + j). */
void w4_internal_to_pairs(const uint32_t *src, long k, long n, uint8_t *dst, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long t = 0; t < n / 16; t++) {
        uint8_t *out = dst + t * (k / 2) * 16;
        for (long r = 0; r < k / 8; r++) {
            const uint32_t *w = src + r * n + t * 16;
            for (int b = 0; b < 4; b++)
                for (int j = 0; j < 16; j++) out[(4 * r + b) * 16 + j] = (uint8_t)(w[j] >> (8 * b));
        }
    }
}
