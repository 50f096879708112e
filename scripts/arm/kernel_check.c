/* Calls the CPU kernel library's entry points from a script of commands, for builds that
 * Python cannot load here (aarch64 under qemu-user): scripts/check_arm.py writes the script and
 * the input tensors, runs this driver, and compares what it saves with the x86 build's results.
 *
 * One command per line, words separated by spaces:
 *   load NAME PATH             a buffer holding the file's bytes
 *   zero NAME BYTES            a buffer of zero bytes
 *   ptr NAME OFFSET TARGET     store TARGET's address (`-`: NULL) at byte OFFSET of NAME (the
 *                              pointer fields of a struct written by Python)
 *   call FN ARG...             call entry point FN; each ARG is `p:NAME` or `p:-` (pointer),
 *                              `i:N` (int), `l:N` (long) or `f:X` (float, hex as C writes it);
 *                              prints `FN -> RESULT`
 *   save NAME PATH             write the buffer to the file
 * Exits 1 at the first malformed line or failed file operation, after a message on stderr.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The library's entry points (the sources in localpaged/kernels/cpu, SIGNATURES in native.py). */
int w4_gemm_isa(void);
int i8_dot_isa(void);
int w4_gemm_bf16(const uint16_t *, const uint8_t *, const uint16_t *, uint16_t *, int, int, int,
                 int, int);
int w8_gemm_bf16(const uint16_t *, const int8_t *, const float *, uint16_t *, int, int, int, int);
int w4_gemm_f32(const float *, const uint8_t *, const uint16_t *, float *, int, int, int, int, int);
int w8_gemm_f32(const float *, const int8_t *, const float *, float *, int, int, int, int);
int w4_gemm_f32_exact(const float *, const uint8_t *, const uint16_t *, float *, int, int, int,
                      int, int);
int w4_i8_gemm_f32(const float *, const uint8_t *, const uint16_t *, float *, int, int, int, int,
                   int, int);
int q8_gemm_f32(const float *, const int8_t *, const void *, int, const float *, float *, int,
                int, int, int, int, int);
int w6_gemm_f32(const float *, const uint8_t *, const uint8_t *, const uint16_t *, int, float *,
                int, int, int, int, int, int);
int w6_gemm_bf16(const uint16_t *, const uint8_t *, const uint8_t *, const uint16_t *, int,
                 uint16_t *, int, int, int, int, int);
int w6_vector(void);
int paged_decode_bf16(const uint16_t *, const uint16_t *, const uint16_t *, const int32_t *, int,
                      const int32_t *, uint16_t *, int, int, int, int, int, float, int);
int paged_decode_f32(const float *, const float *, const float *, const int32_t *, int,
                     const int32_t *, float *, int, int, int, int, int, float, int);
int paged_decode_f32h(const float *, const uint16_t *, const uint16_t *, const int32_t *, int,
                      const int32_t *, float *, int, int, int, int, int, float, int);
/* The structs are opaque here: Python lays them out (ctypes, the same LP64 layout on both). */
int decode_layer_bf16(const void *, const void *, uint16_t *, uint16_t *, int);
int decode_layer_f32(const void *, const void *, float *, float *, int);
void rms_norm_rows_bf16(const uint16_t *, const uint16_t *, uint16_t *, const uint16_t *,
                        uint16_t *, int, int, float, int);
void rms_norm_rows_f32(const float *, const float *, float *, const float *, float *, int, int,
                       float, int);
void silu_and_mul_rows_bf16(const uint16_t *, uint16_t *, int, int, int);
void silu_and_mul_rows_f32(const float *, float *, int, int, int);
void rotary_rows_bf16(uint16_t *, long, int, uint16_t *, long, int, int, const float *, int, int);
void rotary_rows_f32(float *, long, int, float *, long, int, int, const float *, int, int);

#define MAX_BUFS 4096
#define MAX_ARGS 16

struct buf {
    char name[64];
    unsigned char *data;
    size_t size;
};

static struct buf bufs[MAX_BUFS];
static int nbufs;

static void fail(const char *what, const char *detail) {
    fprintf(stderr, "kernel_check: %s: %s\n", what, detail);
    exit(1);
}

static struct buf *find(const char *name) {
    for (int i = 0; i < nbufs; i++)
        if (strcmp(bufs[i].name, name) == 0) return &bufs[i];
    fail("no buffer named", name);
    return NULL;
}

static struct buf *add(const char *name, size_t size) {
    if (nbufs == MAX_BUFS || strlen(name) >= sizeof bufs[0].name) fail("cannot add buffer", name);
    struct buf *b = &bufs[nbufs++];
    strcpy(b->name, name);
    /* 64 spare bytes: the kernels may read a vector past a row's end, as in torch's tensors */
    b->data = aligned_alloc(64, (size + 64 + 63) / 64 * 64);
    if (b->data == NULL) fail("out of memory for", name);
    memset(b->data, 0, size + 64);
    b->size = size;
    return b;
}

union arg {
    void *p;
    long i;
    float f;
};

#define P(n) (a[n].p)
#define I(n) ((int)a[n].i)
#define L(n) (a[n].i)
#define F(n) (a[n].f)

/* Returns the entry point's result (0 for the void ones). */
static long dispatch(const char *fn, const union arg *a) {
    if (!strcmp(fn, "w4_gemm_isa")) return w4_gemm_isa();
    if (!strcmp(fn, "i8_dot_isa")) return i8_dot_isa();
    if (!strcmp(fn, "w6_vector")) return w6_vector();
    if (!strcmp(fn, "w6_gemm_f32"))
        return w6_gemm_f32(P(0), P(1), P(2), P(3), I(4), P(5), I(6), I(7), I(8), I(9), I(10),
                           I(11));
    if (!strcmp(fn, "w6_gemm_bf16"))
        return w6_gemm_bf16(P(0), P(1), P(2), P(3), I(4), P(5), I(6), I(7), I(8), I(9), I(10));
    if (!strcmp(fn, "w4_gemm_bf16"))
        return w4_gemm_bf16(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7), I(8));
    if (!strcmp(fn, "w8_gemm_bf16"))
        return w8_gemm_bf16(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7));
    if (!strcmp(fn, "w4_gemm_f32"))
        return w4_gemm_f32(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7), I(8));
    if (!strcmp(fn, "w8_gemm_f32"))
        return w8_gemm_f32(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7));
    if (!strcmp(fn, "w4_gemm_f32_exact"))
        return w4_gemm_f32_exact(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7), I(8));
    if (!strcmp(fn, "w4_i8_gemm_f32"))
        return w4_i8_gemm_f32(P(0), P(1), P(2), P(3), I(4), I(5), I(6), I(7), I(8), I(9));
    if (!strcmp(fn, "q8_gemm_f32"))
        return q8_gemm_f32(P(0), P(1), P(2), I(3), P(4), P(5), I(6), I(7), I(8), I(9), I(10),
                           I(11));
    if (!strcmp(fn, "paged_decode_bf16"))
        return paged_decode_bf16(P(0), P(1), P(2), P(3), I(4), P(5), P(6), I(7), I(8), I(9),
                                 I(10), I(11), F(12), I(13));
    if (!strcmp(fn, "paged_decode_f32"))
        return paged_decode_f32(P(0), P(1), P(2), P(3), I(4), P(5), P(6), I(7), I(8), I(9),
                                I(10), I(11), F(12), I(13));
    if (!strcmp(fn, "paged_decode_f32h"))
        return paged_decode_f32h(P(0), P(1), P(2), P(3), I(4), P(5), P(6), I(7), I(8), I(9),
                                 I(10), I(11), F(12), I(13));
    if (!strcmp(fn, "decode_layer_bf16")) return decode_layer_bf16(P(0), P(1), P(2), P(3), I(4));
    if (!strcmp(fn, "decode_layer_f32")) return decode_layer_f32(P(0), P(1), P(2), P(3), I(4));
    if (!strcmp(fn, "rms_norm_rows_bf16"))
        rms_norm_rows_bf16(P(0), P(1), P(2), P(3), P(4), I(5), I(6), F(7), I(8));
    else if (!strcmp(fn, "rms_norm_rows_f32"))
        rms_norm_rows_f32(P(0), P(1), P(2), P(3), P(4), I(5), I(6), F(7), I(8));
    else if (!strcmp(fn, "silu_and_mul_rows_bf16"))
        silu_and_mul_rows_bf16(P(0), P(1), I(2), I(3), I(4));
    else if (!strcmp(fn, "silu_and_mul_rows_f32"))
        silu_and_mul_rows_f32(P(0), P(1), I(2), I(3), I(4));
    else if (!strcmp(fn, "rotary_rows_bf16"))
        rotary_rows_bf16(P(0), L(1), I(2), P(3), L(4), I(5), I(6), P(7), I(8), I(9));
    else if (!strcmp(fn, "rotary_rows_f32"))
        rotary_rows_f32(P(0), L(1), I(2), P(3), L(4), I(5), I(6), P(7), I(8), I(9));
    else
        fail("unknown entry point", fn);
    return 0;
}

static void *pointer(const char *name) {
    return strcmp(name, "-") == 0 ? NULL : find(name)->data;
}

int main(int argc, char **argv) {
    FILE *script = argc > 1 ? fopen(argv[1], "r") : stdin;
    if (script == NULL) fail("cannot open", argv[1]);
    char line[4096];
    while (fgets(line, sizeof line, script) != NULL) {
        char *word[2 + MAX_ARGS];
        int words = 0;
        for (char *w = strtok(line, " \t\r\n"); w != NULL && words < 2 + MAX_ARGS;
             w = strtok(NULL, " \t\r\n"))
            word[words++] = w;
        if (words == 0) continue;
        const char *cmd = word[0];
        if (!strcmp(cmd, "load") && words == 3) {
            FILE *f = fopen(word[2], "rb");
            if (f == NULL) fail("cannot open", word[2]);
            fseek(f, 0, SEEK_END);
            const long size = ftell(f);
            fseek(f, 0, SEEK_SET);
            struct buf *b = add(word[1], (size_t)size);
            if (fread(b->data, 1, (size_t)size, f) != (size_t)size) fail("cannot read", word[2]);
            fclose(f);
        } else if (!strcmp(cmd, "zero") && words == 3) {
            add(word[1], (size_t)strtoull(word[2], NULL, 10));
        } else if (!strcmp(cmd, "ptr") && words == 4) {
            struct buf *b = find(word[1]);
            const size_t at = (size_t)strtoull(word[2], NULL, 10);
            void *p = pointer(word[3]);
            if (at + sizeof p > b->size) fail("pointer past the end of", word[1]);
            memcpy(b->data + at, &p, sizeof p);
        } else if (!strcmp(cmd, "call") && words >= 2) {
            union arg a[MAX_ARGS];
            memset(a, 0, sizeof a);
            for (int i = 2; i < words; i++) {
                const char *v = word[i] + 2;
                if (strlen(word[i]) < 2 || word[i][1] != ':') fail("bad argument", word[i]);
                switch (word[i][0]) {
                case 'p': a[i - 2].p = pointer(v); break;
                case 'i':
                case 'l': a[i - 2].i = strtol(v, NULL, 10); break;
                case 'f': a[i - 2].f = strtof(v, NULL); break;
                default: fail("bad argument", word[i]);
                }
            }
            printf("%s -> %ld\n", word[1], dispatch(word[1], a));
            fflush(stdout);
        } else if (!strcmp(cmd, "save") && words == 3) {
            struct buf *b = find(word[1]);
            FILE *f = fopen(word[2], "wb");
            if (f == NULL || fwrite(b->data, 1, b->size, f) != b->size) fail("cannot write", word[2]);
            fclose(f);
        } else {
            fail("bad command", cmd);
        }
    }
    return 0;
}
