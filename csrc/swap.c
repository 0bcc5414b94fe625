/* swap.c - swapon(2) / swapoff(2) of a block device dsecd made (its zram).
 *
 * The swap header is written by dsecd/mem/zram.py; this only turns the area
 * on and off. swapoff can take long (it faults every swapped page back in):
 * callers run it in a worker thread.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sys/swap.h>

#include "dsec_native.h"

int dsec_swapon(const char *path, int priority)
{
    int flags = 0;

    if (priority >= 0)
        flags = SWAP_FLAG_PREFER | ((priority << SWAP_FLAG_PRIO_SHIFT) & SWAP_FLAG_PRIO_MASK);
    return swapon(path, flags) < 0 ? -errno : 0;
}

int dsec_swapoff(const char *path)
{
    return swapoff(path) < 0 ? -errno : 0;
}
