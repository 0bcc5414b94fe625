/* policy_loop.c - the per-syscall cost of a task policy, for bench/policy.py.
 *
 *   policy_loop open N PATH [PLAN]    N x open(PATH, O_RDONLY) + close
 *   policy_loop getppid N             N x getppid (a syscall that does nothing)
 *   policy_loop apply N PLAN          N children each build and apply PLAN: the
 *                                     median ns of that step (what an exec's child pays)
 *
 * With PLAN (a file holding a compiled policy, dsecd/policy.py), the process
 * first restricts itself with it exactly as an exec's child does
 * (csrc/policy_steps.h): every open then walks Landlock's rules. Prints the
 * mean ns per iteration. Built by the bench with -I csrc.
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>

#include "exec_steps.h"
#include "policy_steps.h"

static double now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static int restrict_with(const char *plan_path)
{
    static unsigned char plan[DSEC_POLICY_MAX_BYTES];
    struct dsec_err e = {0};
    FILE *f = fopen(plan_path, "rb");
    size_t n;

    if (!f) {
        perror(plan_path);
        return -1;
    }
    n = fread(plan, 1, sizeof(plan), f);
    fclose(f);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 || policy_apply(plan, n, &e) < 0) {
        fprintf(stderr, "policy_loop: apply %s: step %d, %s at %s\n", plan_path, e.step, strerror(e.err), e.path);
        return -1;
    }
    return 0;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return (x > y) - (x < y);
}

/* N children, each timing its own policy_apply; the median. */
static int apply_children(long n, const char *plan_path)
{
    static unsigned char plan[DSEC_POLICY_MAX_BYTES];
    static double ns[10000];
    FILE *f = fopen(plan_path, "rb");
    size_t len;
    int fds[2];

    if (!f || n < 1 || n > 10000 || pipe(fds) < 0) {
        perror(plan_path);
        return 1;
    }
    len = fread(plan, 1, sizeof(plan), f);
    fclose(f);
    for (long i = 0; i < n; i++) {
        pid_t pid = fork();

        if (pid == 0) {
            struct dsec_err e = {0};
            double t0, dt;

            prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
            t0 = now_ns();
            if (policy_apply(plan, len, &e) < 0)
                _exit(1);
            dt = now_ns() - t0;
            _exit(write(fds[1], &dt, sizeof(dt)) == sizeof(dt) ? 0 : 1);
        }
        int status;

        if (pid < 0 || waitpid(pid, &status, 0) < 0 || status != 0 || read(fds[0], &ns[i], sizeof(ns[i])) != sizeof(ns[i])) {
            fprintf(stderr, "policy_loop: a child failed to apply %s\n", plan_path);
            return 1;
        }
    }
    qsort(ns, (size_t)n, sizeof(ns[0]), cmp);
    printf("%.1f\n", ns[n / 2]);
    return 0;
}

int main(int argc, char **argv)
{
    long n = argc > 2 ? atol(argv[2]) : 0;
    double t0;

    if (argc >= 4 && strcmp(argv[1], "open") == 0) {
        if (argc > 4 && restrict_with(argv[4]) < 0)
            return 1;
        t0 = now_ns();
        for (long i = 0; i < n; i++) {
            int fd = open(argv[3], O_RDONLY | O_CLOEXEC);

            if (fd < 0) {
                perror(argv[3]);
                return 1;
            }
            close(fd);
        }
    } else if (argc == 4 && strcmp(argv[1], "apply") == 0) {
        return apply_children(n, argv[3]);
    } else if (argc == 3 && strcmp(argv[1], "getppid") == 0) {
        t0 = now_ns();
        for (long i = 0; i < n; i++)
            syscall(SYS_getppid);
    } else {
        fprintf(stderr, "usage: policy_loop open N PATH [PLAN] | getppid N | apply N PLAN\n");
        return 2;
    }
    printf("%.1f\n", (now_ns() - t0) / (double)n);
    return 0;
}
