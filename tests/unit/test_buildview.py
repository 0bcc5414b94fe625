"""What `dsec image build -f` draws on a terminal (dsecd/buildview.py)."""

from __future__ import annotations

import io

from rich.console import Console

from dsecd.buildview import BuildView


def test_steps_output_and_warnings_are_shown():
    out = io.StringIO()
    view = BuildView(Console(file=out, width=100, force_terminal=False, color_system=None))
    events = [{"event": "step", "step": 1, "of": 3, "line": 1, "instruction": "FROM busybox"},
              {"event": "step_done", "step": 1, "of": 3, "cached": True, "seconds": 0.0, "layer": None},
              {"event": "step", "step": 2, "of": 3, "line": 2, "instruction": "RUN make"},
              {"event": "output", "step": 2, "fd": 1, "data": b"compiling a\ncompil"},
              {"event": "output", "step": 2, "fd": 2, "data": b"ing b\n"},
              {"event": "output", "step": 2, "fd": 1, "data": b"no newline at the end"},
              {"event": "step_done", "step": 2, "of": 3, "cached": False, "seconds": 1.25, "layer": "sha256:x"},
              {"event": "warning", "message": "build arguments no ARG declares: X"}]
    for event in events:
        view(event)
    view.close()
    text = out.getvalue()
    assert "[1/3] FROM busybox  CACHED" in text
    assert "  compiling a\n" in text and "  ing b\n" in text and "  compil\n" not in text
    assert "  compilno newline at the end\n" in text       # a stream's pieces join into lines
    assert "[2/3] RUN make  1.25s" in text
    assert "warning: build arguments no ARG declares: X" in text


def test_a_line_a_carriage_return_rewrote_shows_as_a_terminal_would():
    """Progress a RUN redraws with \\r (a download, a counter) shows its last
    state, not every state run together on one line."""
    out = io.StringIO()
    view = BuildView(Console(file=out, width=100, force_terminal=False, color_system=None))
    view({"event": "step", "step": 1, "of": 1, "line": 2, "instruction": "RUN fetch"})
    view({"event": "output", "step": 1, "fd": 1, "data": b"10%\r50%\r"})
    view({"event": "output", "step": 1, "fd": 1, "data": b"100%\r\ndone\r\n"})
    view({"event": "step_done", "step": 1, "of": 1, "cached": False, "seconds": 1.0, "layer": None})
    view.close()
    text = out.getvalue()
    assert "  100%\n" in text and "  done\n" in text, text
    assert "10%" not in text and "50%" not in text, text
