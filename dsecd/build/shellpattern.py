"""The shell patterns of a Dockerfile's ${NAME#pattern}, ${NAME%pattern} and
${NAME/pattern/text}, matched without backtracking.

A pattern is a list of tokens: a one-character string (that character),
ANY (`?`: any one character) or STAR (`*`: any text, the empty one too).
Matching runs the pattern as a set of positions over the text (a Thompson
NFA), so a question costs at most len(text) x len(pattern) steps whatever
the pattern. A backtracking regex would take exponential time on
`*a*a*a*a*b` against "aaa...a", and a Dockerfile is a client's input: the
planner runs in a worker, but a regex match holds the interpreter lock and
would stall the daemon with it.
"""

from __future__ import annotations

ANY = "<any>"           # multi-character strings: never a literal token
STAR = "<star>"

# Steps one question may take: a value and pattern past this is refused.
MAX_STEPS = 4_000_000


class PatternError(ValueError):
    """A pattern and a value too large to match within MAX_STEPS."""


def tokens_of(text: str) -> list[str]:
    """`text` read as pattern characters: * and ? are wildcards, the rest literal."""
    return [STAR if c == "*" else ANY if c == "?" else c for c in text]


def cut_prefix(tokens: list[str], value: str, longest: bool) -> str:
    """${NAME#pattern} (shortest) and ${NAME##pattern} (longest)."""
    ends = _match_ends(tokens, value)
    return value[(ends[-1] if longest else ends[0]):] if ends else value


def cut_suffix(tokens: list[str], value: str, longest: bool) -> str:
    """${NAME%pattern} and ${NAME%%pattern}: the prefix question on the reversed value."""
    ends = _match_ends(tokens[::-1], value[::-1])
    return value[:len(value) - (ends[-1] if longest else ends[0])] if ends else value


def replace(tokens: list[str], value: str, text: str, every: bool) -> str:
    """${NAME/pattern/text} (the leftmost, longest match) and ${NAME//pattern/text} (each)."""
    steps = [0]
    out, pos, last = [], 0, -1              # last: where the previous match ended
    while pos <= len(value):
        found = _leftmost_longest(tokens, value, pos, steps)
        if found is None:
            break
        start, end = found
        if start == end == last:            # an empty match abutting the previous one is no match
            if start == len(value):         # (Go's ReplaceAll, bash): `${V//*/X}` on "ab" is "X"
                break
            out.append(value[pos:start + 1])
            pos = start + 1
            continue
        out += [value[pos:start], text]
        last = end
        if end == start:                    # an empty match: keep the next character, go on past it
            out.append(value[start:start + 1])
            end += 1
        pos = end
        if not every:
            break
    out.append(value[pos:])
    return "".join(out)


def _budget(tokens: list[str], value: str) -> None:
    if (len(value) + 1) * (len(tokens) + 1) > MAX_STEPS:
        raise PatternError(f"a pattern of {len(tokens)} characters on a value of {len(value)} is too large "
                           "to match here")


def _closure(tokens: list[str], states: set[int]) -> set[int]:
    """`states` and every position a STAR at one of them lets through empty."""
    out, todo = set(states), list(states)
    while todo:
        j = todo.pop()
        if j < len(tokens) and tokens[j] is STAR and j + 1 not in out:
            out.add(j + 1)
            todo.append(j + 1)
    return out


def _next(tokens: list[str], j: int, ch: str) -> int | None:
    """Where position j goes on `ch`: STAR stays, ANY or the same character moves on."""
    tok = tokens[j]
    if tok is STAR:
        return j
    return j + 1 if tok is ANY or tok == ch else None


def _match_ends(tokens: list[str], value: str) -> list[int]:
    """Every k (ascending) for which the whole pattern matches value[:k]."""
    _budget(tokens, value)
    final = len(tokens)
    states = _closure(tokens, {0})
    ends = [0] if final in states else []
    for k, ch in enumerate(value, 1):
        states = _closure(tokens, {n for j in states if j < final and (n := _next(tokens, j, ch)) is not None})
        if not states:
            break
        if final in states:
            ends.append(k)
    return ends


def _leftmost_longest(tokens: list[str], value: str, pos: int, steps: list[int]) -> tuple[int, int] | None:
    """(start, end) of the leftmost match at or after `pos`, the longest from
    that start; None if there is none. Each position keeps the earliest start
    that reached it: a later start there can only lose. `steps` counts the
    work of every search of one replace against MAX_STEPS."""
    final = len(tokens)
    best: tuple[int, int] | None = None
    states: dict[int, int] = {}
    for p in range(pos, len(value) + 1):
        steps[0] += len(states) + 1
        if steps[0] > MAX_STEPS:
            raise PatternError(f"a pattern of {len(tokens)} characters on a value of {len(value)} takes too "
                               "long to match here")
        if best is None:                    # a match may still start here
            for j in _closure(tokens, {0}):
                states.setdefault(j, p)
        if final in states:
            s = states[final]
            if best is None or s < best[0] or (s == best[0] and p > best[1]):
                best = (s, p)
        if best is not None:
            states = {j: s for j, s in states.items() if s <= best[0]}
        if not states or p == len(value):
            break
        moved: dict[int, int] = {}
        for j, s in states.items():
            if j < final and (n := _next(tokens, j, value[p])) is not None:
                for t in _closure(tokens, {n}):
                    if t not in moved or s < moved[t]:
                        moved[t] = s
        states = moved
    return best
