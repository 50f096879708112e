/* AMX's shared parts: the process's permission to use the tiles and the tile configuration's
 * layout (Intel SDM, LDTILECFG). Included where the build has AMX (-mamx-tile). */
#ifndef LOCALPAGED_AMX_H
#define LOCALPAGED_AMX_H
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out AMX state only on request, once per process. */
static int amx_allowed(void) {
    static int state = -1; /* -1 unknown; racing threads compute the same answer */
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return state;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
#endif
