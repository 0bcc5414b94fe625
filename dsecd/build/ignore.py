""".dockerignore: which files of a build context COPY and ADD do not see.

The rules are Docker's (moby/patternmatcher): one pattern per line; lines
starting with `#` are comments; surrounding whitespace is dropped; a
leading `/` is dropped (patterns are relative to the context); `!` makes a
pattern an exception (it re-includes what an earlier pattern excluded).
`*` matches any run of characters but `/`, `?` one character but `/`,
`[...]` a class (`[!...]` or `[^...]` negated), `**` any number of
directories, none included (`**/*.pyc`, `build/**`), and `\\` escapes the
next character. A pattern matching a directory excludes everything below
it. The last pattern that matches a path decides.

Pure Python, no I/O.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Pattern:
    text: str
    exception: bool
    regex: re.Pattern


def compile_pattern(text: str) -> re.Pattern:
    """The regular expression of one pattern (already cleaned, no `!`)."""
    out = ["^"]
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "*":
            if i + 1 < n and text[i + 1] == "*":
                i += 2
                if i < n and text[i] == "/":
                    i += 1          # "**/" is "**": zero or more directories
                out.append(".*" if i >= n else "(.*/)?")
                continue
            out.append("[^/]*")
        elif ch == "?":
            out.append("[^/]")
        elif ch == "[":
            end = text.find("]", i + 2 if text[i + 1:i + 2] in ("!", "^") else i + 1)
            if end < 0:
                out.append(re.escape(ch))
            else:
                body = text[i + 1:end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        elif ch == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(text[i]))
        else:
            out.append(re.escape(ch))
        i += 1
    out.append("$")
    return re.compile("".join(out), re.S)


def clean(pattern: str) -> str:
    """filepath.Clean, then relative: "./a//b/" -> "a/b", "/a" -> "a"."""
    cleaned = posixpath.normpath(pattern)
    if cleaned.startswith("//"):
        cleaned = "/" + cleaned.lstrip("/")
    if len(cleaned) > 1 and cleaned.startswith("/"):
        cleaned = cleaned[1:]
    return cleaned


class IgnoreRules:
    """The patterns of one .dockerignore, in order."""

    def __init__(self, patterns: list[Pattern]):
        self.patterns = patterns
        self.has_exceptions = any(p.exception for p in patterns)

    @classmethod
    def parse(cls, text: str) -> IgnoreRules:
        patterns = []
        for raw in text.splitlines():
            line = raw.lstrip("\ufeff")
            if line.startswith("#"):
                continue
            line = line.strip()
            if not line:
                continue
            exception = line.startswith("!")
            if exception:
                line = line[1:].strip()
                if not line:
                    continue
            line = clean(line)
            patterns.append(Pattern(line, exception, compile_pattern(line)))
        return cls(patterns)

    def excluded(self, rel: str) -> bool:
        """Whether the context path `rel` ("a/b.txt", no leading /) is left out:
        the last pattern matching it, or one of its parent directories, decides."""
        parents = rel.split("/")[:-1]
        out = False
        for p in self.patterns:
            hit = p.regex.match(rel) is not None
            if not hit:
                for i in range(len(parents)):
                    if p.regex.match("/".join(parents[:i + 1])):
                        hit = True
                        break
            if hit:
                out = not p.exception
        return out

    def __bool__(self) -> bool:
        return bool(self.patterns)
