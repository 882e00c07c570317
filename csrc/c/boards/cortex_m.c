/* cortex_m.c: a bare-metal start for Cortex-M under QEMU (or a debugger) with semihosting: the
 * vector table, .data / .bss set-up, the FPU / MVE enabled when the build uses them, main(), and
 * the exit code handed back through semihosting. With boards/cortex_m.ld; not part of the runtime. */
#include <stdint.h>

#include "board.h"

extern uint32_t _sidata, _sdata, _edata, _sbss, _ebss, _estack;
int main(void);

static int semihost(int op, const void *arg)
{
    register int r0 __asm__("r0") = op;
    register const void *r1 __asm__("r1") = arg;
    __asm__ volatile("bkpt 0xab" : "+r"(r0) : "r"(r1) : "memory");
    return r0;
}

void qgru_board_puts(const char *s) { semihost(0x04, s); /* SYS_WRITE0 */ }

void qgru_board_exit(int code)
{
    const uint32_t block[2] = {0x20026u, (uint32_t)code}; /* ADP_Stopped_ApplicationExit, code */
    semihost(0x20, block);                                 /* SYS_EXIT_EXTENDED */
    for (;;) {
    }
}

/* SysTick: 24-bit down-counter of processor clocks (QEMU with -icount: virtual clocks) */
#define SYST_CSR (*(volatile uint32_t *)0xE000E010u)
#define SYST_RVR (*(volatile uint32_t *)0xE000E014u)
#define SYST_CVR (*(volatile uint32_t *)0xE000E018u)
void qgru_board_ticks_start(void)
{
    SYST_RVR = 0xFFFFFFu;
    SYST_CVR = 0;
    SYST_CSR = 5u; /* enable, processor clock, no interrupt */
}
uint32_t qgru_board_ticks(void) { return 0xFFFFFFu - SYST_CVR; }

static void fault(void) { qgru_board_puts("fault\n"), qgru_board_exit(3); }

void qgru_board_reset(void)
{
    uint32_t *src = &_sidata, *dst = &_sdata;
#if defined(__ARM_FP) || defined(__ARM_FEATURE_MVE)
    *(volatile uint32_t *)0xE000ED88u |= 0xFu << 20; /* CPACR: CP10, CP11 full access */
    __asm__ volatile("dsb\n\tisb" ::: "memory");
#endif
    while (dst < &_edata)
        *dst++ = *src++;
    for (dst = &_sbss; dst < &_ebss;)
        *dst++ = 0;
    qgru_board_exit(main());
}

__attribute__((section(".vectors"), used)) static void (*const vectors[16])(void) = {
    (void (*)(void))(uintptr_t)&_estack, qgru_board_reset, fault, fault, fault, fault, fault,
    0, 0, 0, 0, fault, fault, 0, fault, fault};
