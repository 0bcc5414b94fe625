"""The Dockerfile parser: text -> instructions, and the word expansion
($VAR, ${VAR:-default}, quotes, escapes) Docker applies to their arguments.

Parsing follows Docker's reference: parser directives at the top
(`# escape=` is honoured; `# syntax=` and `# check=` are read and ignored,
as this is the one frontend), comment lines, blank lines, and line
continuations with the escape character (a trailing `\\`, or a backtick
under `# escape=``). Each instruction keeps the line it starts on: every
error raised here and by the builder names it.

Expansion is not done here for RUN, CMD and ENTRYPOINT (their shell does
it, with ARG and ENV values in its environment) and is done by the
planner (dsecd/build/plan.py) for the others, with the values in scope at
that point; this module gives it the lexer (`split_words`, `expand`).

Pure Python, no I/O: clients and tests import it freely.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from . import shellpattern

# Every instruction of Docker's reference: the builder runs the first group,
# refuses the second with a clear message (UNSUPPORTED), and anything else
# is not an instruction at all.
SUPPORTED = ("FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "ENTRYPOINT", "CMD",
             "LABEL", "EXPOSE", "SHELL", "MAINTAINER")
UNSUPPORTED = {
    "ONBUILD": "ONBUILD triggers run in builds FROM this image, which dsec does not do",
    "HEALTHCHECK": "dsec sandboxes have no health checks; run a probe with `dsec exec` instead",
    "VOLUME": "dsec sandboxes have no volumes; leave the directory in the image, or copy files "
              "in and out with `dsec cp`",
    "STOPSIGNAL": "dsec stops a sandbox by killing it; there is no stop signal to set",
}
# Instructions whose argument may be a JSON array (the exec form).
JSON_FORMS = {"RUN", "CMD", "ENTRYPOINT", "COPY", "ADD", "SHELL"}
# Instructions that take --flag=value options before their arguments, and which.
FLAGS = {"COPY": {"chown", "chmod", "link", "from", "parents", "exclude"},
         "ADD": {"chown", "chmod", "link", "checksum", "keep-git-dir", "exclude"},
         "RUN": {"mount", "network", "security"},
         "FROM": {"platform"}}

DIRECTIVE_RE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9_-]*)\s*=\s*(.*?)\s*$")
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What follows a $: a variable name, or a positional ($1, $10) or special
# parameter ($@ $* $# $? $- $$ $!): those are never set in a Dockerfile, so
# they expand to "", as BuildKit expands them.
PARAM_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-]")
HEREDOC_RE = re.compile(r"(^|\s)<<-?\s*['\"]?[A-Za-z_]")


class DockerfileError(Exception):
    """A Dockerfile problem at `line` (1-based). `code` is the protocol
    error code the daemon answers with: bad_request, or unsupported for an
    instruction or option dsec does not implement."""

    def __init__(self, line: int, message: str, code: str = "bad_request"):
        super().__init__(message)
        self.line = line
        self.message = message
        self.code = code

    def where(self, filename: str = "Dockerfile") -> str:
        return f"{filename}:{self.line}: {self.message}"

    def __str__(self) -> str:
        return self.where()


@dataclass(frozen=True)
class Instruction:
    """One instruction: `cmd` upper-case, `args` the text after the keyword
    and its flags (continuations joined), `form` the exec form's list when
    the argument is a JSON array of strings (else None: the shell form)."""

    line: int
    cmd: str
    args: str
    flags: dict[str, str] = field(default_factory=dict)
    form: list[str] | None = None
    original: str = ""

    def __str__(self) -> str:
        return self.original or f"{self.cmd} {self.args}"


@dataclass
class Dockerfile:
    instructions: list[Instruction]
    escape: str = "\\"
    directives: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- parsing

def parse(text: str) -> Dockerfile:
    """Parse a Dockerfile's text. Raises DockerfileError naming the line."""
    lines = text.removeprefix("\ufeff").splitlines()     # a UTF-8 byte-order mark is not text
    escape, directives, first = _directives(lines)
    out = []
    for start, logical in _logical_lines(lines, first, escape):
        out.append(_instruction(start, logical, escape))
    if not out:
        raise DockerfileError(1, "the Dockerfile has no instructions; it must start with FROM")
    return Dockerfile(out, escape, directives)


def _directives(lines: list[str]) -> tuple[str, dict[str, str], int]:
    """(escape character, directives, index of the first line past them).
    Directives are `# name=value` lines at the very top; the first line that
    is not one (a comment, a blank line, an instruction) ends them."""
    directives: dict[str, str] = {}
    i = 0
    for i, raw in enumerate(lines):
        m = DIRECTIVE_RE.match(raw.strip()) if raw.strip() else None
        if m is None:
            break
        name = m.group(1).lower()
        if name in directives:
            raise DockerfileError(i + 1, f"parser directive {name!r} is given twice")
        directives[name] = m.group(2)
    else:
        i = len(lines)
    escape = directives.get("escape", "\\")
    if escape not in ("\\", "`"):
        raise DockerfileError(1, f"parser directive escape={escape!r}: the escape character must be "
                              "\\ or `")
    return escape, directives, i


def _logical_lines(lines: list[str], first: int, escape: str):
    """(first line number, text) of each instruction: comment lines dropped
    (also inside a continuation, as Docker does), continuations joined."""
    i = first
    while i < len(lines):
        raw = lines[i]
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        start = i + 1
        parts = []
        while True:
            body = lines[i].rstrip()
            if body.endswith(escape):
                parts.append(body[:-1])
                i += 1
                # The next non-comment line continues it; blank lines are skipped
                # inside a continuation (Docker warns about them, and goes on).
                while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                    i += 1
                if i >= len(lines):
                    break           # a continuation on the last line: what came so far is the instruction
                continue
            parts.append(body)
            i += 1
            break
        yield start, "".join(parts).strip()


def _instruction(line: int, text: str, escape: str) -> Instruction:
    keyword, rest = re.match(r"(\S+)\s*(.*)", text, re.S).groups()
    cmd = keyword.upper()
    rest = rest.strip()
    if cmd in UNSUPPORTED:
        raise DockerfileError(line, f"{cmd} is not supported by dsec builds: {UNSUPPORTED[cmd]}",
                              "unsupported")
    if cmd not in SUPPORTED:
        raise DockerfileError(line, f"unknown instruction {keyword!r} (dsec builds know "
                              f"{', '.join(SUPPORTED)})")
    flags: dict[str, str] = {}
    if cmd in FLAGS:
        flags, rest = _flags(line, cmd, rest)
    form = None
    if cmd in JSON_FORMS and rest.startswith("["):
        form = _json_form(rest)
    if form is None and cmd in ("RUN", "COPY", "ADD") and HEREDOC_RE.search(rest):
        raise DockerfileError(line, f"{cmd} with a here-document (<<WORD) is not supported by dsec "
                              "builds; put the text in a file of the context and COPY it", "unsupported")
    if not rest:
        raise DockerfileError(line, f"{cmd} needs an argument")
    return Instruction(line, cmd, rest, flags, form, text)


def _flags(line: int, cmd: str, rest: str) -> tuple[dict[str, str], str]:
    """Leading `--name=value` (or `--name` for booleans) words."""
    flags: dict[str, str] = {}
    while rest.startswith("--"):
        word, _, after = rest.partition(" ")
        name, eq, value = word[2:].partition("=")
        if name not in FLAGS[cmd]:
            raise DockerfileError(line, f"{cmd} has no option --{name} (it takes "
                                  f"{', '.join('--' + f for f in sorted(FLAGS[cmd]))})")
        if name in flags:
            raise DockerfileError(line, f"{cmd} option --{name} is given twice")
        flags[name] = value if eq else "true"
        rest = after.lstrip()
    return flags, rest


def _json_form(rest: str) -> list[str] | None:
    """The exec form's list, or None when the text is not a JSON array of
    strings (Docker then takes it as the shell form, as written)."""
    try:
        value = json.loads(rest)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


# ---------------------------------------------------------------- words and expansion

def split_words(text: str, escape: str = "\\") -> list[str]:
    """Split on whitespace outside quotes and ${...}, keeping quotes and
    escapes in the words (each is then given to `expand`): how ENV, LABEL,
    ARG, COPY and EXPOSE separate their arguments before expanding each."""
    words, cur, quote, i, has, braces = [], [], "", 0, False, 0
    while i < len(text):
        ch = text[i]
        if ch == escape and quote != "'" and i + 1 < len(text):
            cur.append(text[i:i + 2])
            has = True
            i += 2
            continue
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif text.startswith("${", i):
            braces += 1
        elif ch == "}" and braces:
            braces -= 1
        elif ch.isspace() and not braces:
            if has:
                words.append("".join(cur))
                cur, has = [], False
            i += 1
            continue
        cur.append(ch)
        has = True
        i += 1
    if quote:
        raise ValueError(f"unmatched {quote} in {text!r}")
    if has:
        words.append("".join(cur))
    return words


class ExpansionError(ValueError):
    """A ${VAR?message} whose variable is unset, or a malformed ${...}."""


def expand(word: str, env: dict[str, str], escape: str = "\\") -> str:
    """One word with its variables substituted and its quotes and escapes
    removed, as BuildKit's ProcessWord: $NAME, ${NAME}, ${NAME:-default},
    ${NAME-default}, ${NAME:+alt}, ${NAME+alt}, ${NAME:?msg}, ${NAME#pattern}
    and ${NAME##pattern} (the shortest and the longest matching prefix
    removed), ${NAME%pattern} and ${NAME%%pattern} (suffix),
    ${NAME/pattern/text} and ${NAME//pattern/text} (the first and every
    match replaced); a pattern's * is any text, ? one character, the escape
    character makes either literal. An unset name gives ""; single quotes
    keep everything literal; inside double quotes the escape character
    escapes only ", $ and itself."""
    out, i, n = [], 0, len(word)
    while i < n:
        ch = word[i]
        if ch == escape:
            if i + 1 < n:
                out.append(word[i + 1])
                i += 2
            else:
                i += 1
            continue
        if ch == "'":
            end = word.find("'", i + 1)
            if end < 0:
                raise ExpansionError(f"unmatched ' in {word!r}")
            out.append(word[i + 1:end])
            i = end + 1
            continue
        if ch == '"':
            i = _double_quoted(word, i + 1, env, escape, out)
            continue
        if ch == "$":
            value, i = _dollar(word, i, env, escape)
            out.append(value)
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _double_quoted(word: str, i: int, env: dict[str, str], escape: str, out: list[str]) -> int:
    n = len(word)
    while i < n:
        ch = word[i]
        if ch == '"':
            return i + 1
        if ch == escape and i + 1 < n and word[i + 1] in ('"', "$", escape):
            out.append(word[i + 1])
            i += 2
            continue
        if ch == "$":
            value, i = _dollar(word, i, env, escape)
            out.append(value)
            continue
        out.append(ch)
        i += 1
    raise ExpansionError(f'unmatched " in {word!r}')


def _dollar(word: str, i: int, env: dict[str, str], escape: str) -> tuple[str, int]:
    """The value of the variable reference at word[i] ('$'), and where it ends."""
    if word.startswith("${", i):
        return _braced(word, i + 2, env, escape)
    m = PARAM_RE.match(word, i + 1)
    if m is None:
        return "$", i + 1       # a lone $ stays as it is
    return env.get(m.group(), ""), m.end()


def _braced(word: str, i: int, env: dict[str, str], escape: str) -> tuple[str, int]:
    m = PARAM_RE.match(word, i)
    if m is None:
        raise ExpansionError(f"bad substitution in {word!r}: ${{ must be followed by a variable name")
    name, i = m.group(), m.end()
    if i < len(word) and word[i] == "}":
        return env.get(name, ""), i + 1
    colon = i < len(word) and word[i] == ":"
    op_at = i + colon
    op = word[op_at] if op_at < len(word) else ""
    if op and op in "#%/" and not colon:
        return _pattern_op(word, name, op_at, env, escape)
    if not op or op not in "-+?":
        raise ExpansionError(f"bad substitution in {word!r}: after ${{{name} comes }}, :-, -, :+, +, :?, ?, "
                             "#, ##, %, %%, / or //")
    end = _closing_brace(word, op_at + 1, escape)
    arg = expand(word[op_at + 1:end], env, escape)
    value = env.get(name)
    is_set = value is not None and (value != "" or not colon)
    if op == "-":
        result = value if is_set else arg
    elif op == "+":
        result = arg if is_set else ""
    else:
        if not is_set:
            raise ExpansionError(f"{name}: {arg or 'is not set'}")
        result = value
    return result, end + 1


def _pattern_op(word: str, name: str, op_at: int, env: dict[str, str], escape: str) -> tuple[str, int]:
    """${NAME#pat}, ${NAME##pat}, ${NAME%pat}, ${NAME%%pat}, ${NAME/pat/text},
    ${NAME//pat/text} at word[op_at]: the value, and where the reference ends."""
    op = word[op_at]
    doubled = word.startswith(op, op_at + 1)
    start = op_at + 1 + doubled
    value = env.get(name, "")
    try:
        if op == "/":
            slash = _pattern_end(word, start, escape)
            end = _closing_brace(word, slash + 1, escape)
            text = expand(word[slash + 1:end], env, escape)
            return shellpattern.replace(_pattern(word[start:slash], env, escape), value, text, doubled), end + 1
        end = _closing_brace(word, start, escape)
        cut = shellpattern.cut_prefix if op == "#" else shellpattern.cut_suffix
        return cut(_pattern(word[start:end], env, escape), value, doubled), end + 1
    except shellpattern.PatternError as err:
        raise ExpansionError(f"${{{name}{op}...}} in {word[:80]!r}: {err}") from None


def _pattern(text: str, env: dict[str, str], escape: str) -> list[str]:
    """A substitution's pattern as shellpattern tokens, read as BuildKit reads
    it: quotes are removed, variables expanded, and * and ? are wildcards
    wherever they come from; only the escape character makes one literal."""
    out, i, n = [], 0, len(text)
    while i < n:
        ch = text[i]
        if ch == escape and i + 1 < n:
            out.append(text[i + 1])
            i += 2
        elif ch == "'":
            j = _quoted_end(text, i, escape)
            out += shellpattern.tokens_of(text[i + 1:j - 1])
            i = j
        elif ch == '"':
            j = _quoted_end(text, i, escape)
            out += _pattern(text[i + 1:j - 1], env, escape)
            i = j
        elif ch == "$":
            value, i = _dollar(text, i, env, escape)
            out += shellpattern.tokens_of(value)
        else:
            out += shellpattern.tokens_of(ch)
            i += 1
    return out


def _quoted_end(text: str, i: int, escape: str) -> int:
    """Where the quoted part that opens at text[i] ends (past its closing quote)."""
    quote, j = text[i], i + 1
    while j < len(text):
        if quote == '"' and text[j] == escape:
            j += 2
            continue
        if text[j] == quote:
            return j + 1
        j += 1
    raise ExpansionError(f"unmatched {quote} in {text!r}")


def _pattern_end(word: str, i: int, escape: str) -> int:
    """The / that ends the pattern of ${NAME/pattern/text} at or after word[i]."""
    end = _top_level(word, i, escape, "/}")
    if end is None or word[end] != "/":
        raise ExpansionError(f"bad substitution in {word!r}: ${{NAME/pattern/text}} is missing its second /")
    return end


def _closing_brace(word: str, i: int, escape: str) -> int:
    end = _top_level(word, i, escape, "}")
    if end is None:
        raise ExpansionError(f"missing }} in {word!r}")
    return end


def _top_level(word: str, i: int, escape: str, stops: str) -> int | None:
    """Where the first of `stops` stands at or after word[i], outside the
    ${...} nested there, quotes and escaped characters; None: nowhere."""
    depth = 0
    while i < len(word):
        ch = word[i]
        if ch == escape:
            i += 2
            continue
        if ch in "'\"":                 # quoted: nothing in it ends anything
            try:
                i = _quoted_end(word, i, escape)
            except ExpansionError:
                return None
            continue
        if word.startswith("${", i):
            depth += 1
            i += 2
            continue
        if depth and ch == "}":
            depth -= 1
        elif not depth and ch in stops:
            return i
        i += 1
    return None


def key_values(line: int, cmd: str, text: str, env: dict[str, str], escape: str) -> list[tuple[str, str]]:
    """The pairs of ENV and LABEL: `K=V K2="v 2"`, or the old form `K value
    with spaces` (one pair). Values are expanded with `env`, the values in
    scope before the instruction (so `ENV A=1 B=$A` takes the old A, as Docker)."""
    try:
        words = split_words(text, escape)
        if not words:
            raise DockerfileError(line, f"{cmd} needs a NAME=VALUE")
        if "=" not in words[0]:
            if len(words) == 1:    # Docker: "must have two arguments"
                raise DockerfileError(line, f"{cmd} {words[0]!r} has no value: write NAME=VALUE "
                                            f"(or NAME=\"\" for an empty one)")
            name = words[0]
            value = text[len(name):].strip()
            pairs = [(expand(name, env, escape), expand(value, env, escape))]
        else:
            pairs = []
            for w in words:
                if "=" not in w:
                    raise DockerfileError(line, f"{cmd} arguments must all be NAME=VALUE, not {w!r}")
                name, _, value = w.partition("=")
                pairs.append((expand(name, env, escape), expand(value, env, escape)))
    except ExpansionError as err:
        raise DockerfileError(line, f"{cmd}: {err}") from None
    except ValueError as err:
        raise DockerfileError(line, f"{cmd}: {err}") from None
    for name, _ in pairs:
        if not name:
            raise DockerfileError(line, f"{cmd} has an empty name")
        if cmd == "ENV" and ("\0" in name or "=" in name):
            raise DockerfileError(line, f"ENV name {name!r} is not a valid variable name")
    return pairs


def expanded_words(line: int, cmd: str, text: str, env: dict[str, str], escape: str) -> list[str]:
    """Words split as written, each expanded (COPY's sources and destination,
    EXPOSE's ports, FROM's image and stage name)."""
    try:
        return [expand(w, env, escape) for w in split_words(text, escape)]
    except ValueError as err:
        raise DockerfileError(line, f"{cmd}: {err}") from None


def expanded_word(line: int, cmd: str, text: str, env: dict[str, str], escape: str) -> str:
    """The whole argument as one expanded word (WORKDIR, USER)."""
    try:
        return expand(text, env, escape)
    except ValueError as err:
        raise DockerfileError(line, f"{cmd}: {err}") from None
