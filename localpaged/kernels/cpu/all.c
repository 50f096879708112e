/* Every CPU kernel in one library, so that one compilation serves them all (see each file). */
#include "quant_gemm.c"
#include "paged_decode.c"
#include "decode_layer.c"
