/* cpu_load.c - the work of bench/cpu.py, run inside sandboxes (static: the
 * busybox image has no libc).
 *
 *   cpu_load calib US                 iterations of the work loop that take US alone (median of 21)
 *   cpu_load step ITERS SLEEP_US N    N steps of ITERS iterations then SLEEP_US of sleep;
 *                                     prints each step's latency in ns (CLOCK_MONOTONIC)
 *   cpu_load burn DUTY PERIOD_US SECONDS NPROC
 *                                     NPROC processes, each busy DUTY of the time for SECONDS,
 *                                     in bursts of 0.5..1.5 x DUTY x PERIOD_US separated by sleeps
 *                                     of 0.5..1.5 x (1-DUTY) x PERIOD_US (random, so the burners never
 *                                     lock into phase with the LS step); prints total iterations
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A dependent multiply-add chain: pure ALU, no memory traffic, not foldable. */
static uint64_t work(uint64_t iters, uint64_t x)
{
    for (uint64_t i = 0; i < iters; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        __asm__ volatile("" : "+r"(x));
    }
    return x;
}

static void sleep_until(uint64_t t)
{
    struct timespec ts = {.tv_sec = (time_t)(t / 1000000000ull), .tv_nsec = (long)(t % 1000000000ull)};

    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) != 0)
        ;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return (x > y) - (x < y);
}

static int calib(uint64_t us)
{
    uint64_t iters = 100000, t, x = 1, runs[21];

    for (;;) { /* grow until one run takes ~us */
        t = now_ns();
        x = work(iters, x);
        t = now_ns() - t;
        if (t >= us * 1000)
            break;
        iters *= 2;
    }
    for (int i = 0; i < 21; i++) {
        t = now_ns();
        x = work(iters, x);
        runs[i] = now_ns() - t;
    }
    qsort(runs, 21, sizeof(runs[0]), cmp_u64);
    /* The fastest run: on a shared host, the least disturbed one. */
    printf("%llu\n", (unsigned long long)(iters * us * 1000 / runs[0]) + (x & 0));
    return 0;
}

static int step(uint64_t iters, uint64_t sleep_us, int n)
{
    uint64_t *lat = calloc((size_t)n, sizeof(*lat)), x = 1;

    if (!lat)
        return 1;
    for (int i = 0; i < n; i++) {
        uint64_t t = now_ns();

        x = work(iters, x);
        lat[i] = now_ns() - t;
        sleep_until(now_ns() + sleep_us * 1000);
    }
    for (int i = 0; i < n; i++)
        printf("%llu\n", (unsigned long long)lat[i]);
    return (int)(x & 0);
}

/* 0.5..1.5 x mean, uniformly. */
static uint64_t jitter(uint64_t mean, unsigned *seed)
{
    return mean / 2 + (uint64_t)((double)rand_r(seed) / RAND_MAX * (double)mean);
}

static uint64_t burn_one(double duty, uint64_t period_ns, uint64_t end, unsigned seed)
{
    uint64_t done = 0, x = seed, busy = (uint64_t)(duty * period_ns), idle = period_ns - busy;

    if (duty < 1.0)
        sleep_until(now_ns() + (uint64_t)(rand_r(&seed) % period_ns)); /* random start */
    for (uint64_t t = now_ns(); t < end; t = now_ns()) {
        uint64_t busy_end = duty >= 1.0 ? end : t + jitter(busy, &seed);

        while (now_ns() < busy_end) {
            x = work(10000, x);
            done += 10000;
        }
        if (duty < 1.0)
            sleep_until(busy_end + jitter(idle, &seed));
    }
    return done + (x & 0);
}

static int burn(double duty, uint64_t period_us, double seconds, int nproc)
{
    int fds[2];
    uint64_t end = now_ns() + (uint64_t)(seconds * 1e9), total = 0, got;

    if (pipe(fds) < 0)
        return 1;
    for (int i = 0; i < nproc; i++) {
        if (fork() == 0) {
            got = burn_one(duty, period_us * 1000, end, (unsigned)(getpid() * 2654435761u));
            if (write(fds[1], &got, sizeof(got)) != sizeof(got))
                _exit(1);
            _exit(0);
        }
    }
    close(fds[1]);
    while (read(fds[0], &got, sizeof(got)) == sizeof(got))
        total += got;
    while (wait(NULL) > 0)
        ;
    printf("%llu\n", (unsigned long long)total);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "calib"))
        return calib(strtoull(argv[2], NULL, 10));
    if (argc == 5 && !strcmp(argv[1], "step"))
        return step(strtoull(argv[2], NULL, 10), strtoull(argv[3], NULL, 10), atoi(argv[4]));
    if (argc == 6 && !strcmp(argv[1], "burn"))
        return burn(atof(argv[2]), strtoull(argv[3], NULL, 10), atof(argv[4]), atoi(argv[5]));
    fprintf(stderr, "usage: cpu_load calib US | step ITERS SLEEP_US N | burn DUTY PERIOD_US SECONDS NPROC\n");
    return 2;
}
