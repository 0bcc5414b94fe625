"""Build steps pyproject.toml cannot express: the cffi extension dsecd._native
(from csrc/, see dsecd/_native_build.py), the static PID 1 of container
sandboxes, dsecd/libexec/dsec-init (from csrc/init.c), the static PID 1 of
microVM guests, dsecd/libexec/dsec-guest-agent (from csrc/guest/agent.c), and
the lazy pager,
dsecd/libexec/dsec-pager (from csrc/pager/, linked with libfuse3 and libcrypto).

Works for ``pip install .`` (both binaries go into the wheel), ``pip install -e .``
and ``python setup.py build_ext --inplace`` (they are built in the source tree,
where dsecd.native.init_binary_path() and dsecd.fs.pager.pager_binary_path()
find them).
"""

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

INIT_SOURCE = Path("csrc/init.c")
INIT_HEADERS = [Path("csrc/exec_steps.h"), Path("csrc/dsec_native.h"), Path("csrc/missing_defs.h"),
                Path("csrc/policy_steps.h")]
INIT_BINARY = Path("dsecd/libexec/dsec-init")
PAGER_SOURCES = sorted(Path("csrc/pager").glob("*.[ch]"))
PAGER_BINARY = Path("dsecd/libexec/dsec-pager")
AGENT_SOURCE = Path("csrc/guest/agent.c")
AGENT_HEADERS = [Path("csrc/missing_defs.h")]
AGENT_BINARY = Path("dsecd/libexec/dsec-guest-agent")


def compile_init(dest: Path) -> None:
    """Static, so that it runs in any sandbox rootfs (no libc needed there).

    Against musl where musl-gcc is installed (scripts/setup.sh installs it):
    a static glibc binary starts with dozens of CPUID instructions (its CPU
    feature and cache probes), each a trap to the hypervisor on a VM (~11 us
    on the development VM), 0.4 ms per start against musl's 0.05 ms, and one
    dsec-init starts per sandbox. musl-gcc sees only musl's headers, so the
    kernel's (linux/, asm/, asm-generic/) are offered to it through a
    directory of links to the system's copies."""
    newest = max(p.stat().st_mtime for p in (INIT_SOURCE, *INIT_HEADERS))
    if dest.exists() and dest.stat().st_mtime >= newest:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    musl = shutil.which("musl-gcc") if "CC" not in os.environ else None
    with tempfile.TemporaryDirectory() as tmp:
        if musl:
            cc = [musl, "-isystem", kernel_headers(Path(tmp))]
        else:
            cc = shlex.split(os.environ.get("CC", "cc"))
        cmd = [*cc, "-static", "-O2", "-s", "-Wall", "-Wextra", "-o", str(dest), str(INIT_SOURCE)]
        print(" ".join(cmd))
        subprocess.run(cmd, check=True)


def kernel_headers(tmp: Path) -> str:
    """A directory with linux/, asm/ and asm-generic/ linked to the system's
    kernel headers (asm/ is under the multiarch dir on Debian)."""
    multiarch = subprocess.run(["cc", "-print-multiarch"], capture_output=True, text=True).stdout.strip()
    for name, where in (("linux", "/usr/include/linux"), ("asm-generic", "/usr/include/asm-generic"),
                        ("asm", f"/usr/include/{multiarch}/asm" if multiarch else "/usr/include/asm")):
        (tmp / name).symlink_to(where)
    return str(tmp)


def compile_agent(dest: Path) -> None:
    """Static: it is /init of the microVM guests' initramfs, which has no libc."""
    newest = max(p.stat().st_mtime for p in (AGENT_SOURCE, *AGENT_HEADERS))
    if dest.exists() and dest.stat().st_mtime >= newest:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    cc = shlex.split(os.environ.get("CC", "cc"))
    cmd = [*cc, "-static", "-O2", "-s", "-Wall", "-Wextra", "-o", str(dest), str(AGENT_SOURCE)]
    print(" ".join(cmd))
    subprocess.run(cmd, check=True)


def compile_pager(dest: Path) -> None:
    """Dynamic: it runs on the host, next to the daemon, against its libfuse3."""
    newest = max(p.stat().st_mtime for p in PAGER_SOURCES)
    if dest.exists() and dest.stat().st_mtime >= newest:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    cc = shlex.split(os.environ.get("CC", "cc"))
    fuse = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3", "libcrypto"], check=True,
                          capture_output=True, text=True).stdout.split()
    sources = [str(p) for p in PAGER_SOURCES if p.suffix == ".c"]
    cmd = [*cc, "-O2", "-Wall", "-Wextra", "-o", str(dest), *sources, *fuse]
    print(" ".join(cmd))
    subprocess.run(cmd, check=True)


def compile_binaries(root: Path) -> None:
    compile_init(root / INIT_BINARY)
    compile_agent(root / AGENT_BINARY)
    compile_pager(root / PAGER_BINARY)


class BuildPyWithInit(build_py):
    def run(self):
        super().run()
        # An editable install runs from the source tree; a wheel from build_lib.
        root = Path(".") if getattr(self, "editable_mode", False) else Path(self.build_lib)
        compile_binaries(root)

    def get_outputs(self, include_bytecode=True):
        # Declare the binary so that pip records (and uninstalls) it.
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(str(Path(self.build_lib) / INIT_BINARY))
            outputs.append(str(Path(self.build_lib) / PAGER_BINARY))
            outputs.append(str(Path(self.build_lib) / AGENT_BINARY))
        return outputs


class BuildExtWithInit(build_ext):
    def run(self):
        super().run()
        if self.inplace:
            compile_binaries(Path("."))


setup(
    cffi_modules=["dsecd/_native_build.py:ffibuilder"],
    cmdclass={"build_py": BuildPyWithInit, "build_ext": BuildExtWithInit},
)
