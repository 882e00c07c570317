/* board.h: what a test or benchmark main needs from its board (boards/cortex_m.c under QEMU, or
 * boards/hosted.c on a system with stdio). */
#ifndef QGRU_BOARD_H_
#define QGRU_BOARD_H_
#include <stdint.h>
void qgru_board_puts(const char *s);
void qgru_board_exit(int code);
void qgru_board_ticks_start(void);
uint32_t qgru_board_ticks(void);
/* s: a decimal int appended to a line */
static inline void qgru_board_put_int(const char *label, long v)
{
    char buf[24], *p = buf + sizeof buf;
    unsigned long u = v < 0 ? 0ul - (unsigned long)v : (unsigned long)v;
    *--p = 0;
    *--p = '\n';
    do
        *--p = (char)('0' + u % 10);
    while (u /= 10);
    if (v < 0)
        *--p = '-';
    qgru_board_puts(label);
    qgru_board_puts(p);
}
#endif
