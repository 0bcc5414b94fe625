"""What only microVM sandboxes do: template snapshots.

(The requests both backends answer alike are in test_backend_conformance.py.)
Under TCG a guest takes a core while it boots, so these tests keep one or
two VMs at a time and assert no timings. They skip where `dsec info` says
the microvm backend is unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import Daemon, skip_unless_microvm
from image_kit import docker_save, layer_of, rootfs_layer

import dsecd
from dsecd import native
from dsecd.errors import LimitExceeded, NotFound


@pytest.fixture(scope="module")
def vm_client(daemon):
    c = daemon.client()
    info = skip_unless_microvm(c)
    if not info.get("templates"):
        c.close()
        pytest.skip("microvm.templates is off in this daemon's config")
    yield c
    c.close()


def _vm(c, image="busybox", **kw):
    args = {"backend": "microvm", "memory": "256M", "net": "none", "disk": "64M", **kw}
    return c.create(image, **args)


IDENTITY = "hostname; cat /proc/sys/kernel/random/boot_id; head -c 16 /dev/urandom | od -An -tx1"


def test_restores_of_one_template_are_each_their_own(vm_client, daemon):
    a = _vm(vm_client)            # the first of this shape: builds the template, then restores it
    b = _vm(vm_client)
    try:
        key = a.inspect()["vm"]["template"]
        assert key and b.inspect()["vm"]["template"] == key
        assert a.inspect()["vm"]["ram"] == "private"
        ida, idb = (s.exec(["sh", "-c", IDENTITY]).stdout.decode().split("\n", 2) for s in (a, b))
        assert ida[0] == f"sb-{a.id}" and idb[0] == f"sb-{b.id}"
        assert ida[1] != idb[1], "a boot id made before the snapshot would be shared by every copy"
        assert ida[2] != idb[2], "the CRNG was not reseeded after the restore"
        # Memory and files written by one copy are its own.
        a.exec(["sh", "-c", "echo mine > /dev/shm/x; echo mine > /etc/x"])
        assert b.exec(["sh", "-c", "cat /dev/shm/x /etc/x"]).exit_code != 0
        # The agent learned which sandbox it serves (its console says so).
        serial = a.inspect()["vm"]["serial_log"]
        assert f"serving sandbox {a.id}" in open(serial, errors="replace").read()
        tdir = daemon.state / "vm-templates" / key
        meta = json.loads((tdir / "meta.json").read_text())
        assert meta["layers"] == a.inspect()["layers"]
        assert {p.name for p in tdir.iterdir()} == {"ram", "state", "meta.json"}
    finally:
        a.destroy(force=True)
        b.destroy(force=True)


def test_a_restored_vm_cannot_change_its_template(vm_client):
    """Its QEMU maps the template's RAM copy-on-write from a sealed memfd: no
    write, truncation or hole punch (QEMU 7.2's way of discarding guest RAM
    even in a private mapping) reaches the pages other VMs read."""
    sb = _vm(vm_client)
    try:
        pid = sb.inspect()["vm"]["qemu_pid"]
        fd_dir = f"/proc/{pid}/fd"
        memfds = [n for n in os.listdir(fd_dir) if "memfd:dsec-vm-template" in os.readlink(f"{fd_dir}/{n}")]
        assert memfds, "the restored QEMU holds no template memfd"
        # Root on the host, through the very fd QEMU holds: still refused.
        fd = os.open(f"{fd_dir}/{memfds[0]}", os.O_RDWR)
        try:
            with pytest.raises(OSError) as err:
                os.pwrite(fd, b"x", 0)
            assert err.value.errno == errno.EPERM
            with pytest.raises(OSError):
                os.truncate(fd, 0)
        finally:
            os.close(fd)
        assert sb.exec(["echo", "still fine"]).stdout == b"still fine\n"
    finally:
        sb.destroy(force=True)


def test_image_gc_drops_the_templates_of_removed_layers(vm_client, daemon):
    # An image of its own layer (a container's changes over busybox), so that
    # removing it leaves a layer nothing names.
    box = vm_client.create("busybox", memory="64M")
    box.exec(["sh", "-c", "echo gc > /gc-marker"])
    box.snapshot("bb-gc")
    box.destroy()
    sb = vm_client.create("bb-gc", backend="microvm", memory="256M", net="none", disk="32M")
    try:
        key = sb.inspect()["vm"]["template"]
        assert sb.exec(["cat", "/gc-marker"]).stdout == b"gc\n"
    finally:
        sb.destroy()
    assert (daemon.state / "vm-templates" / key).is_dir()
    assert key not in vm_client.request("image_gc")["vm_templates_removed"]      # still named: kept
    vm_client.request("image_rm", name="bb-gc")
    assert key in vm_client.request("image_gc")["vm_templates_removed"]
    assert not (daemon.state / "vm-templates" / key).exists()


def test_a_layer_the_image_repeats_is_attached_once(vm_client, busybox_rootfs, tmp_path):
    # Older images repeat an empty layer; each distinct layer is one pmem
    # device (a VM has few), its files as at its topmost place.
    empty, extra = layer_of({}), layer_of({"etc/x": b"x\n"})
    docker_save(tmp_path / "repeat.tar", [rootfs_layer(busybox_rootfs), empty, extra, empty], {})
    vm_client.build_image(str(tmp_path / "repeat.tar"), "bb-repeat")
    try:
        sb = _vm(vm_client, "bb-repeat")
        try:
            assert len(sb.inspect()["layers"]) == 4
            assert sb.exec(["cat", "/etc/x"]).stdout == b"x\n"
            qemu = sb.inspect()["vm"]["qemu_pid"]
            with open(f"/proc/{qemu}/cmdline", "rb") as f:
                assert f.read().count(b"virtio-pmem-pci,") == 3
        finally:
            sb.destroy()
    finally:
        vm_client.request("image_rm", name="bb-repeat")


def test_an_image_of_too_many_layers_is_refused_and_the_most_boot(vm_client, busybox_rootfs, tmp_path):
    """Layer i is a virtio-pmem device at PCI slot 0x10 + i, and q35 has
    its LPC bridge at 0x1f: an image of 16 distinct layers was let through
    and its QEMU failed at once ("slot 31 function 0 not available"), the
    create an `io` error (one of 17 was one too, after admission). It is
    refused as a bad request before anything is made, and an image of the
    most a VM takes, 15, boots with every layer's files."""
    layers = [rootfs_layer(busybox_rootfs)] + [layer_of({f"etc/l{i}": f"{i}\n".encode()}) for i in range(1, 15)]
    docker_save(tmp_path / "most.tar", layers, {})
    docker_save(tmp_path / "over.tar", layers + [layer_of({"etc/l15": b"15\n"})], {})
    vm_client.build_image(str(tmp_path / "most.tar"), "bb-most")
    vm_client.build_image(str(tmp_path / "over.tar"), "bb-over")
    try:
        before = {s["id"] for s in vm_client.list()}
        with pytest.raises(dsecd.DsecError) as err:
            _vm(vm_client, "bb-over")
        assert err.value.code == "bad_request" and "at most 15 layers" in err.value.message, err.value
        assert {s["id"] for s in vm_client.list()} == before
        sb = _vm(vm_client, "bb-most")
        try:
            assert sb.exec(["cat", "/etc/l1", "/etc/l14"]).stdout == b"1\n14\n"
        finally:
            sb.destroy()
    finally:
        vm_client.request("image_rm", name="bb-most")
        vm_client.request("image_rm", name="bb-over")


# A walk of what a snapshot holds: per path its type, mode and owner, and but
# for a directory (whose size and link count are its file system's) its link
# count, size, content hash or link target and the first path of the walk
# that is the same inode (hard links as groups).
TREE = r"""
for p in $(find /work /usr /etc /bin/busybox | sort); do
  if [ -d "$p" ] && [ ! -L "$p" ]; then echo "$p $(stat -c '%a %u:%g' "$p") D"; continue; fi
  if [ -L "$p" ]; then t="L $(readlink "$p")"; elif [ -p "$p" ]; then t=P;
  else t="F $(md5sum < "$p" | cut -c1-32)"; fi
  echo "$p $(stat -c '%a %u:%g %h %s %d:%i' "$p") $t"
done | awk '$4 != "D" { if (!($6 in first)) first[$6] = $1; $6 = first[$6] } { print }'
[ -e /bin/true ] || echo /bin/true gone
"""


def test_snapshot_of_a_vm_is_an_image_both_backends_run(vm_client):
    """pack_diff of a VM: its writable layer (a tmpfs in the guest) comes as
    a tar from the agent and becomes a layer with the tree as the guest had
    it, as a container's would: the overlay's deletions (whiteouts) and
    replaced directories (opaque), symlinks, FIFOs, empty directories,
    modes (setuid, sticky), owners, contents, and hard links (of files,
    FIFOs, symlinks) as one inode with its link count."""
    sb = _vm(vm_client)
    try:
        r = sb.exec(["sh", "-c", "set -e; mkdir -p /work/d && echo hi > /work/d/f && ln -s d/f /work/link && "
                     "cp /bin/busybox /work/suid && chmod 4755 /work/suid && rm /bin/true && "
                     "rm -rf /usr && mkdir -p /usr/only && touch /usr/only/new && mkfifo /work/fifo && "
                     "ln /work/d/f /work/d/g && ln /work/d/f /work/h && ln /bin/busybox /work/bb && "
                     "ln /work/fifo /work/fifo2 && ln /work/link /work/link2 && mkdir -m 1777 /work/empty && "
                     "chown 1000:2000 /work/d && chown 33:44 /work/d/f && chmod 640 /work/d/f"])
        assert r.exit_code == 0, r.stderr
        tree = sb.exec(["sh", "-c", TREE]).stdout.decode()
        out = sb.snapshot("vm-snap")
        assert len(out["layers"]) == 2
    finally:
        sb.destroy()
    assert "/work/h 640 33:44 3 3 /work/d/f F" in tree and "/work/link2 777 0:0 2 3 /work/link L d/f" in tree
    # overlayfs shows a copied-up file under the inode number of its lower
    # file, its new link too: it finds that file by the link's origin handle,
    # whose uuid names the layer (each layer has its own, erofs.stamp_uuid).
    assert "/work/bb 755 0:0 2 1982256 /bin/busybox F" in tree
    want = tree
    box = vm_client.create("vm-snap", memory="64M")
    try:
        assert box.exec(["sh", "-c", TREE]).stdout.decode() == want
    finally:
        box.destroy()
    vm = vm_client.create("vm-snap", backend="microvm", memory="256M", net="none", disk="64M")
    try:
        assert vm.exec(["sh", "-c", TREE]).stdout.decode() == want
    finally:
        vm.destroy()
    vm_client.request("image_rm", name="vm-snap")


# A file capability (cap_net_raw+ep), as setcap writes it.
FILE_CAP = bytes.fromhex("0100000200200000000000000000000000000000")


def test_a_vm_snapshot_keeps_the_xattrs_of_the_files_it_changed(vm_client, daemon, busybox_rootfs, tmp_path):
    """A file of the image that a VM changes is copied up in the guest with
    its xattrs, and its snapshot's layer has them as a container's has:
    security.capability and trusted.* (but overlayfs's own, which would
    mean something to every overlay the layer is a lower layer of)."""
    root = tmp_path / "root"
    shutil.copytree(busybox_rootfs, root, symlinks=True)
    (root / "x").mkdir()
    for name, key, value in (("t", "trusted.t", b"tt"), ("c", "security.capability", FILE_CAP)):
        (root / "x" / name).write_bytes(b"data\n")
        os.setxattr(root / "x" / name, key, value)
    vm_client.import_image(str(root), "vm-xattrs")
    sb = _vm(vm_client, "vm-xattrs")
    try:
        assert sb.exec(["chmod", "600", "/x/t", "/x/c"]).exit_code == 0       # both copied up
        layer = sb.snapshot("vm-xattrs-snap")["layers"][-1]["digest"]
    finally:
        sb.destroy()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    native.mount_erofs(str(daemon.state / "store" / "blobs" / "sha256" / layer.split(":", 1)[1]), str(mnt))
    try:
        assert os.getxattr(mnt / "x" / "t", "trusted.t") == b"tt"
        assert os.getxattr(mnt / "x" / "c", "security.capability") == FILE_CAP
        assert not [k for f in ("t", "c") for k in os.listxattr(mnt / "x" / f) if k.startswith("trusted.overlay.")]
    finally:
        native.umount(str(mnt))
        for name in ("vm-xattrs-snap", "vm-xattrs"):
            vm_client.request("image_rm", name=name)


def test_a_vm_snapshot_keeps_xattrs_past_a_page(busybox_rootfs, tmp_path):
    """The agent read a file's xattrs into 4 KiB buffers: a value, or a list
    of names, past that was left out of the snapshot's layer without a
    word. Values up to the kernel's 64 KiB go now, the image's user.* ones
    of a copied-up file too. The image and the daemon's state (where the
    layer is unpacked) are on the host's /dev/shm, a tmpfs: ext4 keeps no
    more than a block of xattrs per file (a container's upper there could
    not hold them either)."""
    shm = Path(tempfile.mkdtemp(prefix="dsecd-test-xattrs-", dir="/dev/shm"))
    d = None
    try:
        shutil.copytree(busybox_rootfs, shm / "r", symlinks=True)
        big = shm / "r" / "big"
        big.write_bytes(b"data\n")
        try:
            os.setxattr(big, "user.big", b"u" * 20000)
            os.setxattr(big, "trusted.big", b"t" * 30000)
            for i in range(200):                                # names past 4 KiB
                os.setxattr(big, f"trusted.name-{i:03}-{'n' * 20}", b"%d" % i)
        except OSError as err:
            pytest.skip(f"/dev/shm holds no such xattrs on this host: {err}")
        (shm / "daemon").mkdir()
        d = Daemon(shm / "daemon")
        d.start()
        c = d.client()
        try:
            skip_unless_microvm(c, close=False)
            c.import_image(str(shm / "r"), "big-xattrs")
            sb = _vm(c, "big-xattrs")
            try:
                assert sb.exec(["chmod", "600", "/big"]).exit_code == 0       # copied up
                layer = sb.snapshot("big-xattrs-snap")["layers"][-1]["digest"]
            finally:
                sb.destroy()
        finally:
            c.close()
        # mounted from the disk: file-backed EROFS refuses a file on tmpfs
        blob = tmp_path / "layer"
        shutil.copyfile(d.state / "store" / "blobs" / "sha256" / layer.split(":", 1)[1], blob)
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        native.mount_erofs(str(blob), str(mnt))
        try:
            assert os.getxattr(mnt / "big", "user.big") == b"u" * 20000
            assert os.getxattr(mnt / "big", "trusted.big") == b"t" * 30000
            assert len([k for k in os.listxattr(mnt / "big") if k.startswith("trusted.name-")]) == 200
        finally:
            native.umount(str(mnt))
    finally:
        if d is not None:
            d.cleanup()
        shutil.rmtree(shm, ignore_errors=True)


def test_a_second_snapshot_of_a_vm_has_its_changes(vm_client):
    """Each snapshot reads the guest's writable layer from its start: the
    agent's walk opens the layer's directory anew, not a dup of one the
    previous walk left at its end (which made the second image empty)."""
    sb = _vm(vm_client)
    try:
        sb.exec(["sh", "-c", "echo one > /work/one"])
        sb.snapshot("vm-snap-1")
        sb.exec(["sh", "-c", "echo two > /work/two"])
        sb.snapshot("vm-snap-2")
        box = vm_client.create("vm-snap-2", memory="64M")
        try:
            assert box.exec(["cat", "/work/one", "/work/two"]).stdout == b"one\ntwo\n"
        finally:
            box.destroy()
    finally:
        sb.destroy()
        for name in ("vm-snap-1", "vm-snap-2"):
            vm_client.request("image_rm", name=name)


def test_a_vm_snapshot_keeps_a_renamed_image_directory_whole(vm_client):
    """A rename of an image directory and a chmod of an image file in a VM:
    the guest's overlay makes no redirect and no metacopy (the agent mounts
    it redirect_dir=follow,metacopy=off, whatever the guest kernel's
    defaults), so the snapshot's layer holds the moved files and the file's
    data whole, which its tar keeps (it drops overlay's bookkeeping)."""
    sb = _vm(vm_client)
    try:
        r = sb.exec(["sh", "-c", "set -e; mv /etc /etc2 && chmod 4755 /bin/busybox && ls /etc2 | wc -l"])
        assert r.exit_code == 0, r.stderr
        listed = r.stdout
        sb.snapshot("vm-snap-moved")
    finally:
        sb.destroy()
    box = vm_client.create("vm-snap-moved", memory="64M")
    try:
        r = box.exec(["/bin/busybox", "sh", "-c", "ls /etc2 | wc -l; [ -e /etc ] || echo gone; "
                      "/bin/busybox stat -c %a /bin/busybox"])
        assert r.stdout == listed + b"gone\n4755\n", (r.stdout, r.stderr)
    finally:
        box.destroy()
        vm_client.request("image_rm", name="vm-snap-moved")


def test_a_vms_processes_do_not_see_its_snapshot(vm_client):
    """The guest's processes hold still while the agent reads the writable
    layer the way a container's do (the freezer): a process its user had
    stopped stays stopped, and a running one is sent no SIGSTOP and SIGCONT
    (which it, its parent and a shell's job control would see)."""
    sb = _vm(vm_client)
    try:
        sb.exec(["sh", "-c", "sleep 600 >/dev/null 2>&1 & echo $! > /stopped; kill -STOP $!"])
        looper = sb.spawn(["sh", "-c", "trap 'echo CONT >> /seen' CONT; n=0; "
                           "while :; do n=$((n+1)); echo $n > /count; sleep 0.05; done"])
        sb.exec(["sh", "-c", "until [ -s /count ]; do sleep 0.05; done"])
        sb.snapshot("vm-snap-still")
        # Two turns of the loop after the snapshot: a trap would have run by then.
        r = sb.exec(["sh", "-c", "a=$(cat /count); until [ $(cat /count) -ge $((a+2)) ]; do sleep 0.05; done; "
                     "grep State /proc/$(cat /stopped)/status; cat /seen 2>/dev/null; echo end"])
        assert r.stdout == b"State:\tT (stopped)\nend\n", r.stdout
        looper.kill()
    finally:
        sb.destroy()
        vm_client.request("image_rm", name="vm-snap-still")


def test_a_snapshot_never_freezes_the_guest_agent(vm_client, daemon):
    """Root in the guest may mount cgroup2 and move PID 1, the agent, into
    the cgroup a snapshot freezes: the agent moves itself out first, so it
    still walks the layer and thaws the guest (a frozen agent would hold
    the snapshot, and the guest, for ever)."""
    sb = _vm(vm_client)
    try:
        r = sb.exec(["sh", "-c", "mkdir /cg && mount -t cgroup2 none /cg && echo 1 > /cg/sandbox/cgroup.procs && "
                     "grep -qx 1 /cg/sandbox/cgroup.procs && echo moved"])
        assert r.stdout == b"moved\n", r.stderr
        # The CLI, under a bound far past the seconds a snapshot takes: a
        # frozen agent would never answer.
        out = daemon.cli("snapshot", sb.id, "--name", "vm-snap-agent", timeout=300)
        assert out.returncode == 0, out.stderr
        assert sb.exec(["echo", "thawed"]).stdout == b"thawed\n"
    finally:
        sb.destroy()
        with contextlib.suppress(NotFound):
            vm_client.request("image_rm", name="vm-snap-agent")


def test_stdin_is_held_back_while_the_process_does_not_read(vm_client, daemon):
    """One chunk of stdin at a time is in the agent (it answers TAKEN once
    the process's pipe has it): a process that does not read holds its
    sender's exec_input, and the guest never buffers what the host sends."""
    sb = _vm(vm_client)
    piece, count = 1 << 16, 64

    async def go():
        async with dsecd.Client(daemon.socket) as c:
            asb = await c.get(sb.id)
            sent: list[int] = []

            async def pieces():
                for i in range(count):
                    sent.append(i)
                    yield b"x" * piece

            # It reads nothing until /tmp/go exists, then counts what it gets.
            stream = asb.exec_stream(["sh", "-c", "until [ -e /tmp/go ]; do sleep 0.1; done; wc -c"],
                                     stdin=pieces())

            async def collect() -> bytes:
                return b"".join([data async for _, data in stream])

            task = asyncio.create_task(collect())
            for _ in range(300):
                if len(sent) >= 2:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(2)          # room for a sender that is not held to run ahead
            held = len(sent)
            await asb.write_file("/tmp/go", b"")
            out = await task
            return held, out, stream.result

    try:
        held, out, result = asyncio.run(go())
        # The pipe (64 KiB) took one chunk, the agent holds the next; the third waits in the client.
        assert held <= 3, f"{held} chunks went to a process that read none"
        assert result.exit_code == 0 and out.strip() == str(piece * count).encode()
    finally:
        sb.destroy(force=True)


def test_what_a_vm_cannot_enforce_is_refused_before_its_boot(vm_client):
    """A task policy was accepted at create, after a whole boot, and then
    refused every exec; --pids was accepted, shown by inspect and not
    enforced (the guest ran any number of processes). Both are refused
    before anything is made; a VM's inspect says its pids are not limited."""
    before = {s["id"] for s in vm_client.list()}
    for kw, what in (({"policy": "agent"}, "policies"), ({"pids": 64}, "--pids")):
        with pytest.raises(dsecd.DsecError) as err:
            _vm(vm_client, **kw)
        assert err.value.code == "unsupported" and what in err.value.message, err.value
    assert {s["id"] for s in vm_client.list()} == before
    sb = _vm(vm_client)
    try:
        assert sb.inspect()["limits"]["pids"] is None
    finally:
        sb.destroy(force=True)


def test_the_writable_layer_has_the_inodes_its_record_says(daemon_factory, busybox_rootfs):
    """sandbox.disk_inodes went into a VM's record (inspect's limits) but
    never to its guest, whose writable layer kept the kernel's default
    (27827 inodes for a 256M guest): a cap the record claimed and nothing
    enforced. The guest's tmpfs is mounted with it (nr_inodes); filling it
    gives ENOSPC inside, as a container's does."""
    d = daemon_factory("[sandbox]\ndisk_inodes = 2000\n[microvm]\ntemplates = false\nwatchdog_interval_s = 0\n")
    c = d.client()
    try:
        skip_unless_microvm(c, close=False)
        c.import_image(busybox_rootfs, "busybox")
        sb = _vm(c)
        try:
            assert sb.inspect()["limits"]["disk_inodes"] == 2000
            total = sb.exec(["sh", "-c", "df -i / | tail -n 1"]).stdout.split()[1]
            assert total == b"2000", total
            r = sb.exec(["sh", "-c", "mkdir /many && i=0; while [ $i -lt 3000 ]; do printf '' > /many/f$i || break; "
                         "i=$((i+1)); done; echo $i"], timeout=300)
            assert 1900 < int(r.stdout) < 2000 and b"No space left on device" in r.stderr, r
            with pytest.raises(LimitExceeded, match="2000 files and directories"):
                sb.write_file("/many/one-more", b"x")
            assert sb.exec(["rm", "-rf", "/many"]).exit_code == 0
            assert sb.exec(["touch", "/after"]).exit_code == 0
        finally:
            sb.destroy(force=True)
    finally:
        c.close()


def _shmem(sb) -> int:
    """The shmem pages charged to the sandbox's memory cgroup."""
    groups = sb.inspect()["cgroups"]
    d = groups.get("memory") or groups.get("unified")
    stat = dict(line.split() for line in open(os.path.join(d, "memory.stat")).read().splitlines())
    return int(stat["shmem"])


def _templated_daemon(daemon_factory, busybox_rootfs):
    """(daemon, its client): VMs restored from the run's templates, busybox
    imported; skipped where the microvm backend is unavailable."""
    d = daemon_factory("[microvm]\nwatchdog_interval_s = 0\n", shared_vm_templates=True)
    c = d.client()
    try:
        skip_unless_microvm(c, close=False)
        c.import_image(busybox_rootfs, "busybox")
    except BaseException:
        c.close()
        raise
    return d, c


def test_a_vms_snapshot_bound_is_a_containers(daemon_factory, busybox_rootfs):
    """images.max_snapshot_bytes on a VM as on a container (test_attack_exhaust's
    sparse file): past it the snapshot is `limit`, and the paths it excludes,
    however spelt, count neither against the bound nor go in the layer."""
    d = daemon_factory('[images]\nmax_snapshot_bytes = "4M"\n[microvm]\nwatchdog_interval_s = 0\n',
                       shared_vm_templates=True)
    with d.client() as c:
        skip_unless_microvm(c, close=False)
        c.import_image(busybox_rootfs, "busybox")
        sb = _vm(c)
        try:
            r = sb.exec(["sh", "-c", "truncate -s 1073741824 /work/sparse && echo small > /work/keep"])
            assert r.exit_code == 0, r.stderr
            with pytest.raises(LimitExceeded, match="max_snapshot_bytes"):
                sb.snapshot("vm-sparse")
            sb.snapshot("vm-excluded", exclude=["//work/./sparse"])
            box = c.create("vm-excluded", memory="64M")
            try:
                assert box.exec(["sh", "-c", "cat /work/keep; ls /work"]).stdout == b"small\nkeep\n"
            finally:
                box.destroy()
        finally:
            sb.destroy()


def test_a_restored_vms_pause_is_not_charged_its_templates_pages(daemon_factory, busybox_rootfs):
    """A pause saves all of a restored VM's RAM, reading every page of its
    private mapping of the template's memfd: each read of a page the
    template never wrote (a hole) made the page in the memfd, charged to
    the first sandbox paused (~140 MiB for a 256M guest), which kept the
    charge (the LRU does not reclaim it without swap) after its resume, against its
    memory limit. The daemon makes those pages itself before the save."""
    _, c = _templated_daemon(daemon_factory, busybox_rootfs)
    try:
        sb = _vm(c)
        try:
            assert sb.inspect()["vm"]["ram"] == "private"
            out = sb.pause()
            assert _shmem(sb) < 16 << 20, (_shmem(sb), out)
            assert out["held_bytes"] < 16 << 20, out
            sb.resume()
            assert sb.exec(["true"]).exit_code == 0 and _shmem(sb) < 16 << 20, _shmem(sb)
        finally:
            sb.destroy(force=True)
        again = _vm(c)          # its template's pages, made once, serve the next VM of it
        try:
            assert again.exec(["echo", "up"]).stdout == b"up\n"
        finally:
            again.destroy(force=True)
    finally:
        c.close()


def _template_memfd(d: Daemon) -> str:
    """The /proc path of daemon `d`'s fd of its one loaded template's RAM."""
    fds = f"/proc/{d.proc.pid}/fd"
    for name in os.listdir(fds):
        with contextlib.suppress(OSError):
            if os.readlink(f"{fds}/{name}").startswith("/memfd:dsec-vm-template"):
                return f"{fds}/{name}"
    raise AssertionError(f"dsecd {d.proc.pid} holds no template memfd")


def test_info_says_what_each_loaded_template_holds(daemon_factory, busybox_rootfs):
    """A loaded template's memfd is memory of the daemon's, charged to no
    sandbox: the guest RAM its boot wrote, and its whole guest RAM from the
    first pause of a VM restored from it on. Nothing a user could ask said
    how much; `dsec info` lists each template and what it holds now.

    "Now" moves: the pages a pause's fill made are clean zeros, which host
    reclaim that reaches them (this host's DAMON pageout) frees without
    swap. Once the template's only VM is paused nothing makes pages in the
    memfd, so what it holds only falls: each figure is checked against the
    memfd's own size read just before and just after it."""
    d, c = _templated_daemon(daemon_factory, busybox_rootfs)
    try:
        sb = _vm(c)
        try:
            assert sb.inspect()["vm"]["ram"] == "private"       # restored from its template
            memfd = _template_memfd(d)

            def held_now() -> int:
                return os.stat(memfd).st_blocks * 512

            def loaded() -> tuple[dict, dict]:
                store = c.info()["backends"]["microvm"]["template_store"]
                rows = [t for t in store["templates"] if t["loaded"]]
                assert len(rows) == 1, store
                return store, rows[0]

            store, row = loaded()
            before_pause = row["held_bytes"]
            assert 0 < before_pause < row["memory"], row
            assert store["held_bytes"] == before_pause, store
            sb.pause()
            most = held_now()
            store, row = loaded()
            least = held_now()
            assert least <= row["held_bytes"] <= most and store["held_bytes"] == row["held_bytes"], (least, most, store)
            assert row["held_bytes"] > before_pause, (before_pause, row)      # the pause made the holes' pages
            most = held_now()
            text = d.cli("info").stdout.decode()
            least = held_now()
            line = next((ln for ln in text.splitlines() if f"{row['key'][:16]}  guest RAM 256.0M" in ln), None)
            assert line is not None, text
            said = float(line.split("holds ")[1].split("M")[0]) * (1 << 20)
            assert least - (1 << 20) / 10 <= said <= most + (1 << 20) / 10, (least, most, line)
            if least >= row["memory"]:
                assert line.endswith("(all of its guest RAM)"), line
            elif most < row["memory"]:
                assert not line.endswith("(all of its guest RAM)"), line
        finally:
            sb.destroy(force=True)
    finally:
        c.close()


def test_what_the_file_api_makes_in_a_vm_belongs_to_the_owner_named(vm_client, tmp_path):
    from test_file_api import check_owners

    sb = _vm(vm_client)
    try:
        check_owners(sb, tmp_path / "tree")
    finally:
        sb.destroy(force=True)
