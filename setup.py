"""Build steps pyproject.toml cannot express: the cffi extension dsecd._native
(from csrc/, see dsecd/_native_build.py) and the static PID 1 of container
sandboxes, dsecd/libexec/dsec-init (from csrc/init.c).

Works for ``pip install .`` (dsec-init goes into the wheel), ``pip install -e .``
and ``python setup.py build_ext --inplace`` (dsec-init is built in the source
tree, where dsecd.native.init_binary_path() finds it).
"""

import os
import shlex
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

INIT_SOURCE = Path("csrc/init.c")
INIT_BINARY = Path("dsecd/libexec/dsec-init")


def compile_init(dest: Path) -> None:
    """Static, so that it runs in any sandbox rootfs (no libc needed there)."""
    if dest.exists() and dest.stat().st_mtime >= INIT_SOURCE.stat().st_mtime:
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    cc = shlex.split(os.environ.get("CC", "cc"))
    cmd = [*cc, "-static", "-O2", "-s", "-Wall", "-Wextra", "-o", str(dest), str(INIT_SOURCE)]
    print(" ".join(cmd))
    subprocess.run(cmd, check=True)


class BuildPyWithInit(build_py):
    def run(self):
        super().run()
        # An editable install runs from the source tree; a wheel from build_lib.
        root = Path(".") if getattr(self, "editable_mode", False) else Path(self.build_lib)
        compile_init(root / INIT_BINARY)

    def get_outputs(self, include_bytecode=True):
        # Declare the binary so that pip records (and uninstalls) it.
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(str(Path(self.build_lib) / INIT_BINARY))
        return outputs


class BuildExtWithInit(build_ext):
    def run(self):
        super().run()
        if self.inplace:
            compile_init(INIT_BINARY)


setup(
    cffi_modules=["dsecd/_native_build.py:ffibuilder"],
    cmdclass={"build_py": BuildPyWithInit, "build_ext": BuildExtWithInit},
)
