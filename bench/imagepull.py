"""The pull figures of `make bench-images` (bench/images.py --phases pull).

The image: a busybox base (gzip) and LAYERS synthetic layers of LAYER_MIB
each, generated from a seed: a few large random files and many small text
files per layer, gzip, zstd and plain layers in turn. It is pushed once to
Debian's docker-registry on loopback (tests/integration/registry_kit.py),
plain HTTP. One warm-up round of each side comes first, not counted: the
first pulls after start-up (the daemon's, the registry's, skopeo's) run
0.2-0.5 s slower on this host, for both. Each timed round, in alternating
order:

* skopeo: `skopeo copy docker://... oci:DIR:tag` of the same image into a
  fresh directory, timed: the registry client alone;
* ours: `image_pull` into a daemon whose store was emptied first (image rm
  + gc), timed from the request to the answer.

Figures (medians over the rounds):

* pull_speed_ratio: our pull's MiB/s / skopeo's, ours from the request to
  the answer: download and conversion to EROFS layers; target >= 0.9;
* pull_download_ratio: the same with our download alone (the request until
  the last layer's last byte came, total - pull_convert_s: the resolve, the
  claim and the fetch, each layer converting as its bytes arrive);
* pull_convert_s: conversion left after the download ended (each layer's
  metadata and storing, once its last byte is in);
* pull_to_first_exec_s: pull, create, first exec (`true`) of the image;
* base_stored_once: a second image on the same base pulled after the
  first: its base is neither downloaded again (registry log) nor stored
  twice (one blob, the same digest in both images).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness

from dsecd.client import Client

sys.path.insert(0, str(harness.REPO / "tests" / "integration"))
from image_kit import Layout, _file, _tar_bytes, compress, push, rootfs_layer, sha256  # noqa: E402
from registry_kit import Registry, missing_tools  # noqa: E402

MIB = 1 << 20
LAYERS = 6
LAYER_MIB = 40
SMALL_FILES = 1500             # per layer, 1-8 KiB of text each
KINDS = ("gzip", "zstd", "tar")
log = harness.log


def synth_layer(rng: random.Random, i: int, mib: int) -> bytes:
    small = [_file(f"pkg{i}/mod{j}.py", (f"# module {j} of layer {i}\n" * rng.randint(30, 250)).encode())
             for j in range(SMALL_FILES)]
    left = mib * MIB - sum(len(d) for _, d in small)
    big = []
    n = 0
    while left > 0:
        size = min(left, rng.randint(2, 12) * MIB)
        big.append(_file(f"data{i}/blob{n}.bin", rng.randbytes(size)))
        left -= size
        n += 1
    return _tar_bytes(small + big)


def make_images(tmp: Path, rootfs: str, seed: int, layers: int, layer_mib: int) -> tuple[Layout, int, str]:
    """The layout with `big` (base + synthetic layers) and `small` (base + one
    tiny layer); (layout, compressed bytes of big, the base blob's digest)."""
    rng = random.Random(seed)
    layout = Layout(tmp / "layout")
    base = rootfs_layer(rootfs)
    synth = [(synth_layer(rng, i, layer_mib), KINDS[i % len(KINDS)]) for i in range(layers)]
    big = layout.image([(base, "gzip"), *synth])
    layout.tag("big", big)
    layout.tag("small", layout.image([(base, "gzip"), (_tar_bytes([_file("small.txt", b"small\n")]), "zstd")]))
    size = sum(len(compress(t, k)[0]) for t, k in [(base, "gzip"), *synth])
    return layout, size, sha256(compress(base, "gzip")[0])


async def pull(sock: str, ref: str) -> dict:
    async with Client(sock) as c:
        return await c.pull_image(ref)


async def empty_store(sock: str) -> None:
    async with Client(sock) as c:
        for img in await c.list_images():
            await c.remove_image(img["name"])
        await c.image_gc()


async def pull_and_exec(sock: str, ref: str) -> float:
    async with Client(sock) as c:
        t = time.monotonic()
        img = await c.pull_image(ref)
        sb = await c.create(image=img["name"])
        r = await sb.exec(["true"])
        took = time.monotonic() - t
        await sb.destroy()
        if r.exit_code != 0:
            raise RuntimeError(f"first exec in {ref} exited {r.exit_code}")
        return took


def skopeo_copy(reg: Registry, ref: str, dest: Path) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    t = time.monotonic()
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-oci-accept-uncompressed-layers",
                    f"docker://{ref}", f"oci:{dest}:x"], check=True, capture_output=True, timeout=600)
    took = time.monotonic() - t
    shutil.rmtree(dest, ignore_errors=True)
    return took


def measure_pull(tmp: Path, rootfs: str, rounds: int, seed: int, parallel_layers: int | None = None,
                 layers: int = LAYERS, layer_mib: int = LAYER_MIB) -> dict:
    why = missing_tools()
    if why:
        log(f"pull figures skipped: {why}")
        return {"pull_skipped": why}
    log(f"pull: generating {layers} x {layer_mib} MiB layers (seed {seed})")
    layout, size, base_blob = make_images(tmp, rootfs, seed, layers, layer_mib)
    reg = Registry(tmp / "registry").start()
    (tmp / "pulld").mkdir()
    config = f'[images]\ninsecure_registries = ["{reg.host}"]\n'
    if parallel_layers is not None:
        config += f"pull_parallel_layers = {parallel_layers}\n"
    daemon = harness.BenchDaemon(tmp / "pulld", None, config, tag="-pull")
    try:
        for tag in ("big", "small"):
            push(layout, tag, f"{reg.host}/bench/app:{tag}")
        daemon.start()
        big = f"{reg.host}/bench/app:big"
        asyncio.run(pull(daemon.sock, big))
        warm = skopeo_copy(reg, big, tmp / "skopeo-out")
        log(f"warm-up: skopeo {warm:.2f} s (not counted)")
        skopeo_s, ours = [], []
        for r in range(rounds):
            asyncio.run(empty_store(daemon.sock))
            order = ("skopeo", "ours") if r % 2 == 0 else ("ours", "skopeo")
            for who in order:
                if who == "skopeo":
                    skopeo_s.append(skopeo_copy(reg, big, tmp / "skopeo-out"))
                else:
                    t = time.monotonic()
                    res = asyncio.run(pull(daemon.sock, big))
                    ours.append({"total": time.monotonic() - t, **res["pull"]})
            log(f"round {r + 1}: skopeo {skopeo_s[-1]:.2f} s, ours {ours[-1]['total']:.2f} s "
                f"(download {ours[-1]['download_s']:.2f} s, conversion after it {ours[-1]['convert_s']:.2f} s)")
        first_exec = []
        for _ in range(rounds):
            asyncio.run(empty_store(daemon.sock))
            first_exec.append(asyncio.run(pull_and_exec(daemon.sock, big)))
        # base_stored_once: big is stored now; small shares its base.
        gets_before = reg.blob_gets(base_blob)
        small = asyncio.run(pull(daemon.sock, f"{reg.host}/bench/app:small"))
        stored = asyncio.run(_images(daemon.sock))
        base_layers = {i["layers"][0]["digest"] for i in stored}
        blob_dir = Path(daemon.state) / "store" / "blobs" / "sha256"
        once = (small["pull"]["reused_layers"] == 1 and reg.blob_gets(base_blob) == gets_before
                and len(base_layers) == 1 and (blob_dir / next(iter(base_layers))[7:]).exists())
    finally:
        daemon.stop()
        reg.stop()
    sk = statistics.median(skopeo_s)
    download = statistics.median(o["total"] - o["convert_s"] for o in ours)
    total = statistics.median(o["total"] for o in ours)
    return {"pull_image_mib": round(size / MIB, 1), "pull_layers": layers + 1,
            "skopeo_copy_s": round(sk, 3), "skopeo_mib_s": round(size / MIB / sk, 1),
            "pull_download_s": round(download, 3), "pull_mib_s": round(size / MIB / total, 1),
            "pull_speed_ratio": round(sk / total, 3), "pull_total_s": round(total, 3),
            "pull_download_ratio": round(sk / download, 3),
            "pull_convert_s": round(statistics.median(o["convert_s"] for o in ours), 3),
            "pull_to_first_exec_s": round(statistics.median(first_exec), 3),
            "base_stored_once": bool(once), "pull_rounds": rounds,
            "pull_parallel_layers": parallel_layers if parallel_layers is not None else "default",
            "pull_skopeo_s_all": [round(x, 3) for x in skopeo_s],
            "pull_total_s_all": [round(o["total"], 3) for o in ours]}


async def _images(sock: str) -> list[dict]:
    async with Client(sock) as c:
        return await c.list_images()

