/* hosted.c: board.h on a hosted C library (Linux, qemu-user): stdio and exit. */
#include <stdio.h>
#include <stdlib.h>

#include "board.h"

void qgru_board_puts(const char *s) { fputs(s, stdout); }
void qgru_board_exit(int code) { fflush(stdout), exit(code); }
void qgru_board_ticks_start(void) {}
uint32_t qgru_board_ticks(void) { return 0; }
