"""Micro-benchmarks of the protocol hot path (pytest-benchmark).

    .venv/bin/pytest bench/test_codec_bench.py --benchmark-only
"""

from dsecd import protocol

EXEC = {"id": 12345, "op": "exec", "args": {"sandbox": "0123456789ab", "argv": ["sh", "-c", "true"],
                                            "env": {"A": "1"}, "timeout": 10.0, "stream": False}}
CHUNK = {"id": 12345, "stream": {"fd": 1, "data": b"x" * 65536}}


def test_encode_request(benchmark):
    benchmark(protocol.encode_frame, EXEC)


def test_decode_and_parse_request(benchmark):
    payload = protocol.encode_frame(EXEC)[4:]
    benchmark(lambda: protocol.parse_request(protocol.decode_payload(payload)))


def test_encode_64k_output_chunk(benchmark):
    benchmark(protocol.encode_frame, CHUNK)


def test_incremental_decoder_100_frames(benchmark):
    data = protocol.encode_frame(EXEC) * 100
    benchmark(lambda: protocol.FrameDecoder(1 << 20).feed(data))
