"""A fast slice of the decoder fuzzing (the full run is `make fuzz`)."""

from __future__ import annotations

import fuzz_decoder


def test_decoder_raises_only_bad_request_or_limit():
    result = fuzz_decoder.fuzz_decoder(2000, seed=11)
    assert result["inputs"] >= 2000
    assert result["findings"] == []


def test_the_checker_catches_a_non_protocol_exception(monkeypatch):
    # The oracle must be able to fail: a parser that raises TypeError is caught.
    from dsecd import protocol

    def broken(frame):
        raise TypeError("boom")

    monkeypatch.setattr(protocol, "parse_request", broken)
    assert fuzz_decoder.check_payload(b"\x80") == "TypeError: boom"
