"""What a probe reports: whether a feature works here, and a sentence that
says what was found or why not. Every probe of the daemon returns one (the
C layer's probes return 0 or -errno, which dsecd/features.py turns into
one); a probe with more to say subclasses it (dsecd/mem/damon.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    available: bool
    detail: str = ""
