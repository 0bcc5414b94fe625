"""A microVM's file service as the node wires it, for the unit tests."""

from __future__ import annotations

from dsecd.engine.microvms import MicroVMService
from dsecd.engine.vmfiles import VmFiles


def vm_files(agent=None, workers=None, balloon=None, max_output: int = 1 << 20) -> tuple[VmFiles, MicroVMService]:
    """A VmFiles given what dsecd/node.py gives it of a MicroVMService with
    no backend: its agent lookup (or `agent(sb)`, a stand-in channel), its
    count of the requests a pause waits for and its record of file watches;
    and that MicroVMService."""
    vms = MicroVMService(None, "no microVM backend in unit tests", workers, None, {}, max_output, 0)
    vms.balloon = balloon
    files = VmFiles(agent or vms.agent, vms.request_running, vms.watch_started, workers, max_output, balloon)
    return files, vms
