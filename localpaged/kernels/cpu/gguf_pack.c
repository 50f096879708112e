/* GGUF Q4_0 / Q4_1 / Q4_K matrices straight from the file's blocks into the 4-bit kernel's layout
 * (quant_gemm.c: `packed` pairs [N/16][K/2][16] or int8_dot.c's quads [N/16][K/4][32], and
 * `sb` float16 [N/16][K/32][2][16]), in parallel over tiles: what a model load spends most of
 * its time on otherwise. The same bytes as localpaged/quant/ggml_int4.py's numpy route
 * (`int4_pairs` then `cpu_w4_layout`), float32 operations in its order:
 *   Q4_0 (18 bytes: f16 d, 16 bytes of codes): W = d * (q - 8): s = d, b = -8 * d;
 *   IQ4_NL (as Q4_0; W = d * kvalues[q]): the codes as they are, s = d, b = -128 * d (the
 *   form of int8_dot.c's I8_NL, which looks the codes up);
 *   IQ4_XS: per group of 32 as IQ4_NL with d * (ls - 32) for d (see gp_iq4xs);
 *   Q4_1 (20 bytes: f16 d, f16 m, codes):      W = d * q + m:   s = d, b = -(-m / d) * d,
 *   or, for a block whose d is 0, codes 0 and s = b = m;
 *   Q4_K: per group of 32, as Q4_1 with d * sc for d and -(dmin * m) for m (see gp_q4k).
 * Code v of a block: byte v & 15 of its 16, the low nibble for v < 16, else the high one.
 * `rows[i]` is the file's row of output row i (llama.cpp's q/k permutation undone). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define GP_TILE 16
#define GP_BLOCK 32

/* A group's `W = scale * q + offset` as the kernel's scale s and offset b (the value at code 0,
 * rounded through the zero point -offset / scale as the numpy route does), or for a group
 * whose scale is 0 codes 0 and s = b = offset. */
static void gp_affine(float scale, float offset, uint8_t q[GP_BLOCK], float *s, float *o) {
    if (scale == 0.f) {
        memset(q, 0, GP_BLOCK);
        *s = *o = offset;
        return;
    }
    const float zero = -offset / scale;
    *s = scale;
    *o = -zero * scale;
}

/* The 6-bit scale and min of group `sub` (0..7) of a Q4_K / Q5_K super-block from its 12
 * bytes `sc`: groups 0..3 take the low 6 bits of bytes 0..3 (scales) and 4..7 (mins), groups
 * 4..7 a nibble of bytes 8..11 and the top 2 bits of bytes 0..3 / 4..7. */
static void gp_k_scale_min(const uint8_t *sc, int sub, int *scale, int *min) {
    *scale = sub < 4 ? sc[sub] & 63 : (sc[sub + 4] & 0xF) | (sc[sub - 4] >> 6) << 4;
    *min = sub < 4 ? sc[sub + 4] & 63 : (sc[sub + 4] >> 4) | (sc[sub] >> 6) << 4;
}

/* Codes 0..15 of 16 columns (`q`, `stride` values a column) written as `chunks` chunks of the
 * quads layout at `dst`: byte 4jj + i of chunk c holds value 4c + i of column jj in its low
 * nibble and of column jj + 8 in its high one (the low nibbles of codes up to 63, for the
 * 6-bit layout). */
static void gp_quads(const uint8_t *q, int stride, int chunks, uint8_t *dst) {
    for (int c = 0; c < chunks; c++)
        for (int jj = 0; jj < 8; jj++)
            for (int i = 0; i < 4; i++) {
                const int v = 4 * c + i;
                dst[c * 2 * GP_TILE + 4 * jj + i] =
                    (uint8_t)((q[jj * stride + v] & 15) | (q[(jj + 8) * stride + v] & 15) << 4);
            }
}

/* Group `sub` (0..7) of a Q4_K super-block `b` (144 bytes: f16 d, f16 dmin, 12 bytes of
 * 6-bit scales and mins, 128 bytes of codes: 32-byte run c holds group 2c in its low nibbles,
 * 2c + 1 in its high ones): codes, and scale d * sc and offset -(dmin * m) through gp_affine
 * (ggml_int4.py's `_flat_blocks` for a scale of 0). */
static void gp_q4k(const uint8_t *b, int sub, uint8_t q[GP_BLOCK], float *s, float *o) {
    uint16_t h;
    memcpy(&h, b, 2);
    const float d = f16_to_f32(h);
    memcpy(&h, b + 2, 2);
    const float dmin = f16_to_f32(h);
    const uint8_t *qs = b + 16 + 32 * (sub / 2);
    int scale, min;
    gp_k_scale_min(b + 4, sub, &scale, &min);
    const float scl = d * (float)scale, off = -(dmin * (float)min);
    for (int v = 0; v < GP_BLOCK; v++) q[v] = sub % 2 ? qs[v] >> 4 : qs[v] & 15;
    gp_affine(scl, off, q, s, o);
}

/* The 32 codes of 16 bytes laid out as Q4_0's: value v < 16 in byte v's low nibble, v + 16 in
 * its high one (Q4_0, Q4_1, IQ4_NL, and each group of IQ4_XS). */
static void gp_nibbles(const uint8_t *qs, uint8_t q[GP_BLOCK]) {
    for (int v = 0; v < 16; v++) {
        q[v] = qs[v] & 15;
        q[v + 16] = qs[v] >> 4;
    }
}

/* Group `sub` (0..7) of an IQ4_XS super-block `b` (136 bytes: f16 d, u16 scales_h, 4 bytes
 * scales_l, 128 bytes of codes, 16 a group laid out as IQ4_NL's): codes, scale d * (ls - 32)
 * (ls: a nibble of scales_l and two bits of scales_h) and offset -128 times it. */
static void gp_iq4xs(const uint8_t *b, int sub, uint8_t q[GP_BLOCK], float *s, float *o) {
    uint16_t h, high;
    memcpy(&h, b, 2);
    memcpy(&high, b + 2, 2);
    const int ls = ((b[4 + sub / 2] >> 4 * (sub % 2)) & 15) | ((high >> 2 * sub) & 3) << 4;
    gp_nibbles(b + 8 + 16 * sub, q);
    *s = f16_to_f32(h) * (float)(ls - 32);
    *o = -128.f * *s;
}

/* One block's 32 codes (0..15), scale and offset. */
static void gp_block(const uint8_t *b, int type, uint8_t q[GP_BLOCK], float *s, float *o) {
    const int symmetric = type == 2 || type == 20;
    uint16_t h;
    memcpy(&h, b, 2);
    const float d = f16_to_f32(h);
    gp_nibbles(b + (symmetric ? 2 : 4), q);
    if (symmetric) {
        *s = d;
        *o = (type == 2 ? -8.f : -128.f) * d;
        return;
    }
    memcpy(&h, b + 2, 2);
    gp_affine(d, f16_to_f32(h), q, s, o);
}

/* Returns 0, or -1 for a type other than Q4_0 (2) / Q4_1 (3) / Q4_K (12) / IQ4_NL (20) /
 * IQ4_XS (23) or shapes off the layout. */
int gguf_q4_pack(const uint8_t *blocks, int type, const int32_t *rows, int n, int k,
                 uint8_t *packed, uint16_t *sb, int quads, int threads) {
    const int super = type == 12 || type == 23;
    if ((type != 2 && type != 3 && !super && type != 20) || n % GP_TILE ||
        k % (super ? 256 : GP_BLOCK))
        return -1;
    const int groups = k / GP_BLOCK, bytes = type == 2 || type == 20 ? 18 : 20;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < n / GP_TILE; t++) {
        uint8_t *pt = packed + (size_t)t * (k / 2) * GP_TILE;
        uint16_t *st = sb + (size_t)t * groups * 2 * GP_TILE;
        for (int g = 0; g < groups; g++) {
            uint8_t q[GP_TILE][GP_BLOCK];
            for (int j = 0; j < GP_TILE; j++) {
                const int r = rows[t * GP_TILE + j];
                float s, o;
                if (type == 12)
                    gp_q4k(blocks + ((size_t)r * (k / 256) + g / 8) * 144, g % 8, q[j], &s, &o);
                else if (type == 23)
                    gp_iq4xs(blocks + ((size_t)r * (k / 256) + g / 8) * 136, g % 8, q[j], &s, &o);
                else
                    gp_block(blocks + ((size_t)r * groups + g) * bytes, type, q[j], &s, &o);
                st[(size_t)g * 2 * GP_TILE + j] = f32_to_f16(s);
                st[(size_t)g * 2 * GP_TILE + GP_TILE + j] = f32_to_f16(o);
            }
            if (quads) {
                gp_quads(q[0], GP_BLOCK, GP_BLOCK / 4,
                         pt + (size_t)g * (GP_BLOCK / 4) * 2 * GP_TILE);
            } else { /* pair p: byte j = q[2p] of column j | q[2p+1] << 4 */
                uint8_t *pp = pt + (size_t)g * (GP_BLOCK / 2) * GP_TILE;
                for (int p = 0; p < GP_BLOCK / 2; p++)
                    for (int j = 0; j < GP_TILE; j++)
                        pp[p * GP_TILE + j] = (uint8_t)(q[j][2 * p] | q[j][2 * p + 1] << 4);
            }
        }
    }
    return 0;
}

/* The codes (0..63, the file's own) of one block of Q5_0 (type 6: f16 d, 32 high bits, 16
 * bytes of low nibbles; 32 values), Q5_1 (7: f16 d, f16 m, then as Q5_0), Q5_K (13: f16 d,
 * f16 dmin, 12 bytes of 6-bit scales and mins, 32 bytes of high bits, 128 of nibbles; 256
 * values) or Q6_K (14: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d;
 * 256 values), value v as ggml_int8.py reads it. */
static void gp_high_codes(const uint8_t *b, int type, uint8_t *q) {
    if (type == 6 || type == 7) {
        const uint8_t *hb = b + (type == 6 ? 2 : 4), *qs = hb + 4;
        uint32_t hi;
        memcpy(&hi, hb, 4);
        for (int v = 0; v < 32; v++)
            q[v] = (uint8_t)((v < 16 ? qs[v] & 15 : qs[v - 16] >> 4) | ((hi >> v) & 1) << 4);
    } else if (type == 13) {
        const uint8_t *qh = b + 16, *qs = b + 48;
        for (int sub = 0; sub < 8; sub++)
            for (int l = 0; l < 32; l++) {
                const uint8_t nb = qs[32 * (sub / 2) + l];
                q[32 * sub + l] = (uint8_t)((sub % 2 ? nb >> 4 : nb & 15) | ((qh[l] >> sub) & 1) << 4);
            }
    } else {
        for (int n = 0; n < 2; n++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t lb = b[64 * n + 32 * (j % 2) + l];
                    const int lo = j < 2 ? lb & 15 : lb >> 4;
                    q[128 * n + 32 * j + l] = (uint8_t)(lo | ((b[128 + 32 * n + l] >> (2 * j)) & 3) << 4);
                }
    }
}

/* Q6_K's scale of sub-block i (of 16 values): d * sc. */
static float gp_q6k_scale(const uint8_t *b, int i) {
    uint16_t h;
    memcpy(&h, b + 208, 2);
    return f16_to_f32(h) * (float)(int8_t)b[192 + i];
}

/* GGUF Q8_0 (type 8: f16 d, 32 int8), Q5_0 (type 6: code - 16, scale d) and Q6_K (type 14:
 * code - 32, a scale d * sc per 16 values) matrices straight into the 8-bit kernel's tiles
 * (int8_dot.c: codes [N/16][K/2][2][16], scales float32 [N/16][K/bs][16], or float16 for Q8_0
 * when `half`: its own d, exact), the numbers of
 * localpaged/quant/ggml_int8.py (its `_q8_0`, `_q5_0`, `_q6_k`). */
static void gp_q8_block(const uint8_t *b, int type, int8_t *q, float *s) {
    if (type == 8) {
        uint16_t h;
        memcpy(&h, b, 2);
        s[0] = f16_to_f32(h);
        memcpy(q, b + 2, 32);
        return;
    }
    uint8_t u[256];
    gp_high_codes(b, type, u);
    const int values = type == 6 ? 32 : 256, zero = type == 6 ? 16 : 32;
    for (int v = 0; v < values; v++) q[v] = (int8_t)(u[v] - zero);
    if (type == 6) {
        uint16_t h;
        memcpy(&h, b, 2);
        s[0] = f16_to_f32(h);
    } else {
        for (int i = 0; i < 16; i++) s[i] = gp_q6k_scale(b, i);
    }
}

int gguf_q8_pack(const uint8_t *blocks, int type, const int32_t *rows, int n, int k,
                 int8_t *codes, void *scales, int half, int threads) {
    const int values = type == 14 ? 256 : 32, bs = type == 14 ? 16 : 32;
    const int bytes = type == 8 ? 34 : type == 6 ? 22 : type == 14 ? 210 : 0;
    if (bytes == 0 || n % GP_TILE || k % values || (half && type != 8)) return -1;
    const int per_row = k / values, scales_per = values / bs;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < n / GP_TILE; t++) {
        int8_t *ct = codes + (size_t)t * k * GP_TILE;
        const size_t first = (size_t)t * (k / bs) * GP_TILE;
        for (int j = 0; j < GP_TILE; j++) {
            const uint8_t *row = blocks + (size_t)rows[t * GP_TILE + j] * per_row * bytes;
            for (int blk = 0; blk < per_row; blk++) {
                int8_t q[256];
                float s[16];
                gp_q8_block(row + (size_t)blk * bytes, type, q, s);
                for (int i = 0; i < scales_per; i++) {
                    const size_t at = first + ((size_t)blk * scales_per + i) * GP_TILE + j;
                    if (half) /* Q8_0's d: a float16 in the file, exact */
                        ((uint16_t *)scales)[at] = f32_to_f16(s[i]);
                    else
                        ((float *)scales)[at] = s[i];
                }
                for (int v = 0; v < values; v++) {
                    const int kk = blk * values + v;
                    ct[(size_t)(kk / 2) * 2 * GP_TILE + (kk % 2) * GP_TILE + j] = q[v];
                }
            }
        }
    }
    return 0;
}

/* The top two bits of codes `q` ([16][stride], 0..63) of `chunks` chunks (even) from chunk
 * `first` of a tile into its 6-bit `high` plane (int8_dot.c's layout). */
static void gp_w6_high(const uint8_t *q, int stride, size_t first, int chunks, uint8_t *ht) {
    for (int c = 0; c < chunks; c += 2) /* pair of chunks */
        for (int jj = 0; jj < 8; jj++)
            for (int i = 0; i < 4; i++) {
                uint8_t top = 0;
                for (int half = 0; half < 2; half++) {
                    const int v = 4 * (c + half) + i;
                    top |= (uint8_t)(((q[jj * stride + v] >> 4) | (q[(jj + 8) * stride + v] >> 4) << 2)
                                     << 4 * half);
                }
                ht[(first + c) / 2 * 2 * GP_TILE + 4 * jj + i] = top;
            }
}

/* GGUF Q5_0 (type 6), Q5_1 (7), Q5_K (13) and Q6_K (14) matrices straight into int8_dot.c's
 * 6-bit layout: codes 0..63 (gp_high_codes), the low nibbles in the quads layout `packed`
 * [N/16][K/4][32], the top two bits in `high` [N/16][K/8][32], and per group a float16 scale
 * and offset in `sb` [N/16][K/gs][2][16] (`scales_only`: the scales alone, [N/16][K/gs][16],
 * for the symmetric Q5_0 and Q6_K, whose offsets are -16 * s and -32 * s), gs = 16 for Q6_K
 * (its sub-blocks) and 32 for the others:
 *   Q5_0: s = d, b = -16 * d;                Q5_1: s = d, b = m;
 *   Q5_K: per group of 32, s = d * sc, b = -(dmin * m);
 *   Q6_K: per group of 16, s = d * sc, b = -32 * s (s rounded to float16 first, so that
 *         W = s * (q - 32) holds for the kept s).
 * Returns the groups of the block (1, 8 or 16). */
static int gp_w6_codes(const uint8_t *b, int type, uint8_t *q, float *s, float *o) {
    gp_high_codes(b, type, q);
    if (type == 14) {
        for (int i = 0; i < 16; i++) {
            s[i] = f16_to_f32(f32_to_f16(gp_q6k_scale(b, i)));
            o[i] = -32.f * s[i];
        }
        return 16;
    }
    uint16_t h, h2;
    memcpy(&h, b, 2);
    memcpy(&h2, b + 2, 2); /* Q5_1's m, Q5_K's dmin */
    const float d = f16_to_f32(h);
    if (type == 6 || type == 7) {
        s[0] = d;
        o[0] = type == 6 ? -16.f * d : f16_to_f32(h2);
        return 1;
    }
    for (int sub = 0; sub < 8; sub++) { /* Q5_K */
        int scale, min;
        gp_k_scale_min(b + 4, sub, &scale, &min);
        s[sub] = d * (float)scale;
        o[sub] = -(f16_to_f32(h2) * (float)min);
    }
    return 8;
}

/* Returns 0, or -1 for another type or shapes off the layout. */
int gguf_w6_pack(const uint8_t *blocks, int type, const int32_t *rows, int n, int k,
                 uint8_t *packed, uint8_t *high, uint16_t *sb, int scales_only, int threads) {
    const int values = type == 13 || type == 14 ? 256 : 32;
    const int bytes = type == 6 ? 22 : type == 7 ? 24 : type == 13 ? 176 : type == 14 ? 210 : 0;
    if (bytes == 0 || n % GP_TILE || k % values) return -1;
    const int gs = type == 14 ? 16 : 32, groups = k / gs, per_row = k / values;
    const int entries = scales_only ? 1 : 2; /* per group and column */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < n / GP_TILE; t++) {
        uint8_t *pt = packed + (size_t)t * (k / 2) * GP_TILE;
        uint8_t *ht = high + (size_t)t * (k / 4) * GP_TILE;
        uint16_t *st = sb + (size_t)t * groups * entries * GP_TILE;
        for (int blk = 0; blk < per_row; blk++) {
            uint8_t q[GP_TILE][256];
            for (int j = 0; j < GP_TILE; j++) {
                const uint8_t *row = blocks + (size_t)rows[t * GP_TILE + j] * per_row * bytes;
                float s[16], o[16];
                const int count = gp_w6_codes(row + (size_t)blk * bytes, type, q[j], s, o);
                for (int i = 0; i < count; i++) {
                    uint16_t *at = st + ((size_t)blk * count + i) * entries * GP_TILE + j;
                    at[0] = f32_to_f16(s[i]);
                    if (!scales_only) at[GP_TILE] = f32_to_f16(o[i]);
                }
            }
            const size_t first = (size_t)blk * (values / 4); /* this block's first chunk */
            gp_quads(q[0], 256, values / 4, pt + first * 2 * GP_TILE);
            gp_w6_high(q[0], 256, first, values / 4, ht);
        }
    }
    return 0;
}

/* GGUF Q4_K (type 12) straight into the quads layout with super-block scales (int8_dot.c's
 * I8_KQ form: per 256 values and column d and dmin as in the file, per group of 32 its 6-bit
 * scale and min): 4.625 bits a weight where float16 scales and offsets per group take 5, and
 * d * sc exact. `kq` [N/16][K/256][320 bytes]. Q5_K (type 13: the same scales, its fifth bits
 * apart) the same way, the codes' top bits into the 6-bit layout's `high` [N/16][K/8][32]
 * (NULL for Q4_K). Returns 0, or -1 for another type or shapes off the layout. */
int gguf_q4k_pack_kq(const uint8_t *blocks, int type, const int32_t *rows, int n, int k,
                     uint8_t *packed, uint8_t *high, uint8_t *kq, int threads) {
    if ((type != 12 && type != 13) || (type == 13) != (high != NULL) || n % GP_TILE || k % 256)
        return -1;
    const int supers = k / 256, bytes = type == 12 ? 144 : 176;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < n / GP_TILE; t++) {
        uint8_t *pt = packed + (size_t)t * (k / 2) * GP_TILE;
        for (int sup = 0; sup < supers; sup++) {
            uint8_t *rec = kq + ((size_t)t * supers + sup) * 320;
            uint8_t q[GP_TILE][256];
            for (int j = 0; j < GP_TILE; j++) {
                const uint8_t *b = blocks + ((size_t)rows[t * GP_TILE + j] * supers + sup) * bytes;
                memcpy(rec + 2 * j, b, 2);      /* d */
                memcpy(rec + 32 + 2 * j, b + 2, 2); /* dmin */
                for (int g = 0; g < 8; g++) {
                    int scale, min;
                    gp_k_scale_min(b + 4, g, &scale, &min);
                    rec[64 + g * GP_TILE + j] = (uint8_t)scale;
                    rec[192 + g * GP_TILE + j] = (uint8_t)min;
                }
                if (type == 13) {
                    gp_high_codes(b, 13, q[j]);
                    continue;
                }
                for (int g = 0; g < 8; g++) {
                    const uint8_t *qs = b + 16 + 32 * (g / 2);
                    for (int v = 0; v < GP_BLOCK; v++)
                        q[j][g * GP_BLOCK + v] = g % 2 ? qs[v] >> 4 : qs[v] & 15;
                }
            }
            gp_quads(q[0], 256, 64, pt + (size_t)sup * 64 * 2 * GP_TILE); /* 64 chunks */
            if (high != NULL)
                gp_w6_high(q[0], 256, (size_t)sup * 64, 64, high + (size_t)t * (k / 4) * GP_TILE);
        }
    }
    return 0;
}

/* A bf16 matrix w [n][k] (an lm_head) in int8 per output row, as Int8Linear's torch formula
 * computes it: scale = max(max |w|, 1e-12) / 127, code = w / scale rounded half to even (the
 * same float32 operations, so the same bytes); into `codes` [n][k] and `scales` [n], and where
 * `tiles` is not NULL (n % 16 == 0, k even) also the 8-bit kernel's tiles [n/16][k/2][2][16].
 * One pass over the weight, in parallel: torch's route (a float32 copy, its quotient, the
 * rounding) took 0.6 s of a Qwen2.5-1.5B load. */
void rows_to_int8(const uint16_t *w, int n, int k, int8_t *codes, float *scales,
                  int8_t *tiles, int threads) {
    const int groups = tiles != NULL ? n / GP_TILE : n, per = tiles != NULL ? GP_TILE : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < groups; g++)
        for (int i = 0; i < per; i++) {
            const size_t r = (size_t)g * per + i;
            const uint16_t *wr = w + r * k;
            float top = 0.f;
#pragma omp simd reduction(max : top)
            for (int j = 0; j < k; j++) {
                const float v = fabsf(bf16_to_f32(wr[j]));
                top = v > top ? v : top;
            }
            const float s = (top > 1e-12f ? top : 1e-12f) / 127.f;
            scales[r] = s;
            int8_t *cr = codes + r * k;
#pragma omp simd
            for (int j = 0; j < k; j++) cr[j] = (int8_t)rintf(bf16_to_f32(wr[j]) / s);
        }
    if (tiles == NULL) return;
    /* tile g: code j of its row i at [j / 2][j % 2][i], written in order (the 16 rows read
     * side by side stay in the cache) */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < groups; g++) {
        const int8_t *rows = codes + (size_t)g * GP_TILE * k;
        int8_t *tp = tiles + (size_t)g * GP_TILE * k;
        for (int j = 0; j < k; j++)
            for (int i = 0; i < GP_TILE; i++) tp[(size_t)j * GP_TILE + i] = rows[(size_t)i * k + j];
    }
}
