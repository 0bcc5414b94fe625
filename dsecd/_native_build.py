"""cffi API-mode builder of dsecd._native, from the real csrc/ files.

The declarations come verbatim from the CFFI-BEGIN/CFFI-END block of
csrc/dsec_native.h, so the header is the one place they are written. Kernel
constants are declared as ``#define X ...``: the C compiler fills in their
values from the system headers (or csrc/missing_defs.h) at build time.

Run by setup.py through ``cffi_modules``; ``python dsecd/_native_build.py``
builds the module in place for a quick try.
"""

import os
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
SOURCES = ["spawn.c", "fileops.c", "probe.c", "madvise.c", "swap.c", "sched.c", "seccomp.c", "mount.c",
           "userns.c", "netns.c", "upperfs.c", "cgroupfs.c"]
HEADERS = ["dsec_native.h", "missing_defs.h"]

# Values filled in by the compiler, never copied by hand.
CONSTANTS = """
#define RESOLVE_NO_XDEV ...
#define RESOLVE_NO_MAGICLINKS ...
#define RESOLVE_NO_SYMLINKS ...
#define RESOLVE_BENEATH ...
#define RESOLVE_IN_ROOT ...
#define RESOLVE_CACHED ...
#define PR_SCHED_CORE ...
#define PR_SCHED_CORE_GET ...
#define MADV_WILLNEED ...
#define MNT_DETACH ...
#define MADV_COLD ...
#define MADV_PAGEOUT ...
#define PROC_SUPER_MAGIC ...
#define SYSFS_MAGIC ...
#define DEBUGFS_MAGIC ...
#define TRACEFS_MAGIC ...
#define SECURITYFS_MAGIC ...
#define CGROUP_SUPER_MAGIC ...
#define CGROUP2_SUPER_MAGIC ...
#define BPF_FS_MAGIC ...
#define DEVPTS_SUPER_MAGIC ...
#define NSFS_MAGIC ...
#define EFIVARFS_MAGIC ...
#define PSTOREFS_MAGIC ...
#define BINFMTFS_MAGIC ...
#define SELINUX_MAGIC ...
#define SMACK_MAGIC ...
"""

PRELUDE = """
#include <sys/prctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <linux/magic.h>
#include "dsec_native.h"
#include "missing_defs.h"
"""


def header_cdef(path: Path) -> str:
    """The declarations between the CFFI-BEGIN and CFFI-END markers."""
    text = path.read_text()
    begin = text.index("/* CFFI-BEGIN */") + len("/* CFFI-BEGIN */")
    return text[begin : text.index("/* CFFI-END */")]


def _rel(path: Path) -> str:
    # setuptools refuses absolute source paths; they are relative to setup.py.
    return os.path.relpath(path, Path.cwd())


ffibuilder = FFI()
ffibuilder.cdef(header_cdef(CSRC / "dsec_native.h") + CONSTANTS)
ffibuilder.set_source(
    "dsecd._native",
    PRELUDE,
    sources=[_rel(CSRC / name) for name in SOURCES],
    include_dirs=[_rel(CSRC)],
    libraries=["seccomp"],  # csrc/seccomp.c builds its filter with libseccomp (in the daemon only)
    depends=[_rel(CSRC / name) for name in HEADERS],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    os.chdir(ROOT)
    ffibuilder.compile(verbose=True)
