/* Every CPU kernel in one library, so that one compilation serves them all (see each file). */
#define _GNU_SOURCE /* syscall(), for the AMX permission, under -std=c11: before any header */
#include "int8_dot.c"
#include "quant_gemm.c"
#include "paged_decode.c"
#include "decode_layer.c"
#include "gguf_pack.c"
#include "w4_repack.c"
