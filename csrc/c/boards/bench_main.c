/* bench_main.c: QGRU_BENCH_STEPS streaming steps (one qgru_rt_run call each, the state carried)
 * of an exported model; prints the SysTick count (boards/cortex_m.c) and a checksum of the state.
 * scripts/bench_mcu.py builds it with two step counts and counts the instructions between them. */
#include "board.h"
#include "qgru_rt_kernel.h"
#include QGRU_MODEL_HEADER

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define MODEL CAT(QGRU_MODEL, _model)

static uint32_t work[512];
static int16_t state[4096], x[1024];
#ifdef QGRU_BENCH_FLOAT /* float input (qgru_rt_run_float): x's integers times this value */
static float xf[256]; /* (the M0 board has 16 KB of RAM) */
#endif

int main(void)
{
    const qgru_rt_model *m = &MODEL;
    int32_t t, i, rc = 0;
    long sum = 0;
    uint32_t ticks;
    for (i = 0; i < m->input_size; i++)
        x[i] = (int16_t)((i * 37) % 200 - 100);
#ifdef QGRU_BENCH_FLOAT
    if (m->input_size > 256)
        return 2;
    for (i = 0; i < m->input_size; i++)
        xf[i] = (float)x[i] * (float)(QGRU_BENCH_FLOAT);
#endif
    qgru_board_ticks_start();
    for (t = 0; t < QGRU_BENCH_STEPS && !rc; t++)
#ifdef QGRU_BENCH_FLOAT
        rc = qgru_rt_run_float(m, xf, 1, state, 0, work, sizeof work);
#else
        rc = qgru_rt_run(m, x, 1, state, 0, work, sizeof work);
#endif
    ticks = qgru_board_ticks();
    for (i = 0; i < m->hidden_size; i++)
        sum += state[i];
    qgru_board_put_int("rc ", rc);
    qgru_board_put_int("ticks ", (long)ticks);
    qgru_board_put_int("checksum ", sum);
    qgru_board_put_int("work ", (long)qgru_rt_work_bytes(m, 1));
    return rc != 0;
}
