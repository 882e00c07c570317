/* selftest_main.c: runs an exported model's golden self-test on a board (board.h) and prints
 * "mismatches N" (0: bit-exact). Build with -DQGRU_MODEL_HEADER='"gru.h"' -DQGRU_MODEL=gru and
 * the model .c compiled with -D<PREFIX>_GOLDEN. */
#include "board.h"
#include "qgru_rt_kernel.h"
#include QGRU_MODEL_HEADER

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

static uint32_t work[1536]; /* 6 KB, checked against qgru_rt_work_bytes */

int main(void)
{
    int bad;
    qgru_board_puts("kernel ");
    qgru_board_puts(qgru_rt_kernel_name);
    qgru_board_puts("\n");
    bad = CAT(QGRU_MODEL, _selftest)(work, sizeof work);
    qgru_board_put_int("mismatches ", bad);
    return bad != 0;
}
