/* probe.c - kernel feature probes, run once at daemon start.
 *
 * Each probe exercises the real mechanism (loads the BPF program, creates the
 * VM) rather than reading a version number: distribution kernels backport,
 * and container runtimes filter syscalls with seccomp. A probe returns 0 (or a
 * positive version) when the feature works and -errno when it does not; it
 * never leaves anything behind.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/kvm.h>
#include <sys/mman.h>
#include <linux/seccomp.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dsec_native.h"
#include "missing_defs.h"

static int neg_errno(long rc)
{
    return rc < 0 ? -errno : 0;
}

/* EINVAL: kernel without CONFIG_SCHED_CORE; ENODEV: no SMT siblings. */
int dsec_probe_sched_core(void)
{
    uint64_t cookie = 0;

    return neg_errno(prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, PR_SCHED_CORE_SCOPE_THREAD,
                           (unsigned long)&cookie));
}

int dsec_probe_landlock_abi(void)
{
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);

    return abi < 0 ? -errno : (int)abi;
}

/* Filter mode plus the two actions the fncall backend relies on. */
int dsec_probe_seccomp(void)
{
    static const uint32_t actions[] = {SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO};

    for (size_t i = 0; i < sizeof(actions) / sizeof(actions[0]); i++) {
        uint32_t action = actions[i];
        if (syscall(SYS_seccomp, SECCOMP_GET_ACTION_AVAIL, 0, &action) < 0)
            return -errno;
    }
    return 0;
}

/* "r0 = 1; exit": a cgroup_skb program that lets every packet through. */
static int bpf_load_pass_all(void)
{
    struct bpf_insn insns[] = {
        {.code = BPF_ALU64 | BPF_MOV | BPF_K, .dst_reg = BPF_REG_0, .imm = 1},
        {.code = BPF_JMP | BPF_EXIT},
    };
    union bpf_attr attr;
    long fd;

    memset(&attr, 0, sizeof(attr));
    attr.prog_type = BPF_PROG_TYPE_CGROUP_SKB;
    attr.expected_attach_type = BPF_CGROUP_INET_EGRESS;
    attr.insns = (uint64_t)(uintptr_t)insns;
    attr.insn_cnt = sizeof(insns) / sizeof(insns[0]);
    attr.license = (uint64_t)(uintptr_t)"GPL";
    fd = syscall(SYS_bpf, BPF_PROG_LOAD, &attr, sizeof(attr));
    return fd < 0 ? -errno : (int)fd;
}

/* BPF_F_ALLOW_MULTI, so the probe never replaces a program someone else
 * attached to that cgroup; the detach names our program. */
static int bpf_attach_detach(int cg_fd, int prog_fd)
{
    union bpf_attr attr;

    memset(&attr, 0, sizeof(attr));
    attr.target_fd = cg_fd;
    attr.attach_bpf_fd = prog_fd;
    attr.attach_type = BPF_CGROUP_INET_EGRESS;
    attr.attach_flags = BPF_F_ALLOW_MULTI;
    if (syscall(SYS_bpf, BPF_PROG_ATTACH, &attr, sizeof(attr)) < 0)
        return -errno;
    attr.attach_flags = 0;
    return neg_errno(syscall(SYS_bpf, BPF_PROG_DETACH, &attr, sizeof(attr)));
}

/* cgroup_dir must be a cgroup v2 directory (EBADF from attach otherwise). */
int dsec_probe_bpf_cgroup(const char *cgroup_dir)
{
    int cg_fd = open(cgroup_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int prog_fd, rc;

    if (cg_fd < 0)
        return -errno;
    prog_fd = bpf_load_pass_all();
    rc = prog_fd < 0 ? prog_fd : bpf_attach_detach(cg_fd, prog_fd);
    if (prog_fd >= 0)
        close(prog_fd);
    close(cg_fd);
    return rc;
}

static int kvm_ioctl(int fd, unsigned long req, unsigned long arg)
{
    int rc = ioctl(fd, req, arg);

    return rc < 0 ? -errno : rc;
}

/* Run one instruction (HLT) in real mode at guest address 0x1000: some hosts
 * create VMs and vCPUs but cannot enter a guest. Returns 0 when the guest
 * exits with KVM_EXIT_HLT, -errno, or the unexpected exit reason. */
static int kvm_run_hlt(int kvm, int vm, int vcpu)
{
    struct kvm_userspace_memory_region region = {.slot = 0, .guest_phys_addr = 0x1000,
                                                 .memory_size = 0x1000};
    struct kvm_sregs sregs;
    struct kvm_regs regs = {.rip = 0x1000, .rflags = 2};
    struct kvm_run *run = MAP_FAILED;
    unsigned char *mem;
    int size, rc;

    mem = mmap(NULL, 0x1000, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        return -errno;
    mem[0] = 0xf4; /* hlt */
    region.userspace_addr = (unsigned long)mem;
    size = kvm_ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
    rc = size < 0 ? size : kvm_ioctl(vm, KVM_SET_USER_MEMORY_REGION, (unsigned long)&region);
    if (rc >= 0) {
        run = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, vcpu, 0);
        rc = run == MAP_FAILED ? -errno : kvm_ioctl(vcpu, KVM_GET_SREGS, (unsigned long)&sregs);
    }
    if (rc >= 0) {
        sregs.cs.base = 0;
        sregs.cs.selector = 0;
        rc = kvm_ioctl(vcpu, KVM_SET_SREGS, (unsigned long)&sregs);
    }
    if (rc >= 0)
        rc = kvm_ioctl(vcpu, KVM_SET_REGS, (unsigned long)&regs);
    if (rc >= 0)
        rc = kvm_ioctl(vcpu, KVM_RUN, 0);
    if (rc >= 0)
        rc = run->exit_reason == KVM_EXIT_HLT ? 0 : (int)run->exit_reason;
    if (run != MAP_FAILED)
        munmap(run, size);
    munmap(mem, 0x1000);
    return rc;
}

/* Opening /dev/kvm is not enough: nested or restricted hosts fail at
 * KVM_CREATE_VM or KVM_CREATE_VCPU, or cannot enter a guest, so the probe
 * creates one of each and runs a one-instruction guest. */
void dsec_probe_kvm(struct dsec_kvm_probe *out)
{
    int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
    int vm = -1, vcpu = -1;

    out->open_err = kvm < 0 ? -errno : 0;
    out->api = out->create_vm = out->create_vcpu = out->run = out->open_err;
    if (kvm < 0)
        return;
    out->api = kvm_ioctl(kvm, KVM_GET_API_VERSION, 0);
    vm = kvm_ioctl(kvm, KVM_CREATE_VM, 0);
    out->create_vm = vm < 0 ? vm : 0;
    vcpu = vm < 0 ? vm : kvm_ioctl(vm, KVM_CREATE_VCPU, 0);
    out->create_vcpu = vcpu < 0 ? vcpu : 0;
    out->run = vcpu < 0 ? vcpu : kvm_run_hlt(kvm, vm, vcpu);
    if (vcpu >= 0)
        close(vcpu);
    if (vm >= 0)
        close(vm);
    close(kvm);
}

int dsec_probe_openat2(void)
{
    int fd = dsec_file_openat2(AT_FDCWD, "/", O_PATH | O_CLOEXEC, 0,
                               RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS);

    if (fd < 0)
        return fd;
    close(fd);
    return 0;
}

/* op on a pidfd of our own process; pidfd_open's error if there is none. */
static int with_own_pidfd(int (*op)(int pidfd))
{
    int fd = dsec_pidfd_open(getpid(), 0);
    int rc;

    if (fd < 0)
        return fd;
    rc = op(fd);
    close(fd);
    return rc;
}

static int signal_zero(int pidfd)
{
    return dsec_pidfd_send_signal(pidfd, 0);
}

/* The kernel takes the pidfd's pid as a process-group id, so ESRCH (we lead
 * no group) also means the flag is known; EINVAL means it is not. */
static int group_signal_zero(int pidfd)
{
    int rc = dsec_pidfd_kill_group(pidfd, 0);

    return rc == -ESRCH ? 0 : rc;
}

/* pidfd_open (5.3) and pidfd_send_signal (5.1); signal 0 only checks. */
int dsec_probe_pidfd(void)
{
    return with_own_pidfd(signal_zero);
}

/* pidfd_send_signal(PIDFD_SIGNAL_PROCESS_GROUP) (6.9): signal 0 to the
 * process group whose id is our pid only checks. */
int dsec_probe_pidfd_group_signal(void)
{
    return with_own_pidfd(group_signal_zero);
}

/* clone3 with a zero size fails with EINVAL when the syscall exists, before
 * anything is created; ENOSYS (absent) or EPERM (filtered) are reported. */
int dsec_probe_clone3(void)
{
    long rc = syscall(SYS_clone3, NULL, 0);

    if (rc < 0 && errno == EINVAL)
        return 0;
    return rc < 0 ? -errno : 0;
}
