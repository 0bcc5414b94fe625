"""image_list streamed: the listing in frames that each fit the frame limit."""

from dsecd import protocol
from dsecd.engine.images import LIST_FRAME_ENVELOPE, listing_frames


def _image(n: int, layers: int) -> dict:
    layer = {"digest": "sha256:" + "a" * 64, "size": 4096, "index": "sha256:" + "b" * 64}
    return {"name": f"img{n}", "manifest": "sha256:" + "c" * 64, "layers": [layer] * layers,
            "config": {"env": {}, "labels": {}}, "created": 1.0, "bytes": 4096 * layers}


def test_each_frame_fits_and_the_order_is_kept():
    images = [_image(n, 100) for n in range(300)]      # ~5 MiB of entries
    max_frame = 256 << 10
    frames = listing_frames(images, [{"name": "bad", "error": "gone"}], max_frame)
    assert len(frames) > 10
    for frame in frames:
        assert len(protocol.encode_frame({"id": 2**62, "stream": frame})) <= max_frame
    assert [i["name"] for f in frames for i in f["images"]] == [f"img{n}" for n in range(300)]
    assert [u["name"] for f in frames for u in f["unreadable"]] == ["bad"]


def test_an_entry_past_a_frame_is_unreadable_saying_so():
    big = _image(0, 2000)
    frames = listing_frames([_image(1, 1), big, _image(2, 1)], [], (64 << 10) + LIST_FRAME_ENVELOPE)
    assert [i["name"] for f in frames for i in f["images"]] == ["img1", "img2"]
    (entry,) = [u for f in frames for u in f["unreadable"]]
    assert entry["name"] == "img0" and "more than one frame holds" in entry["error"]


def test_nothing_to_list_is_one_empty_frame():
    assert listing_frames([], [], 64 << 10) == [{"images": [], "unreadable": []}]
