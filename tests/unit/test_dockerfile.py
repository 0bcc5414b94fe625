"""The Dockerfile parser and planner (dsecd/build/dockerfile.py, plan.py):
continuations, comments, directives, exec vs shell form, ARG/ENV
expansion and scopes, the image config after each step, and errors that
name their line."""

from __future__ import annotations

import pytest

from dsecd.build.dockerfile import DockerfileError, expand, parse, split_words
from dsecd.build.plan import COPY, META, RUN, WORKDIR, plan
from dsecd.imageconfig import DEFAULT_PATH


def steps_of(text: str, build_args: dict | None = None, base: dict | None = None):
    return plan(parse(text), build_args or {}, (lambda name: base or {}))


def error_of(text: str, build_args: dict | None = None) -> DockerfileError:
    with pytest.raises(DockerfileError) as info:
        steps_of(text, build_args)
    return info.value


# ---------------------------------------------------------------- lines

def test_continuations_comments_and_blank_lines_keep_the_first_line_number():
    df = parse("# a comment\n\nFROM base\nRUN echo a \\\n  # dropped inside a continuation\n\n    && echo b\n"
               "run echo lower-case keyword\n")
    assert [(i.line, i.cmd) for i in df.instructions] == [(3, "FROM"), (4, "RUN"), (8, "RUN")]
    assert df.instructions[1].args == "echo a     && echo b"
    assert df.instructions[2].args == "echo lower-case keyword"


def test_a_byte_order_mark_is_not_text():
    assert parse("\ufeffFROM base\n").instructions[0].cmd == "FROM"
    assert parse("\ufeff# escape=`\nFROM base\n").escape == "`"


def test_the_escape_directive_changes_the_continuation_character():
    df = parse("# escape=`\n# syntax=docker/dockerfile:1\nFROM base\nRUN echo C:\\path `\n  more\n")
    assert df.escape == "`" and df.directives == {"escape": "`", "syntax": "docker/dockerfile:1"}
    assert df.instructions[1].args == "echo C:\\path   more"


def test_a_directive_after_a_comment_is_a_comment():
    df = parse("# hello\n# escape=`\nFROM base\nRUN a \\\n b\n")
    assert df.escape == "\\" and df.instructions[1].args == "a  b"


def test_exec_form_and_shell_form():
    df = parse('FROM base\nRUN ["echo", "a b"]\nRUN echo "a b"\nCMD [not json\n')
    assert df.instructions[1].form == ["echo", "a b"]
    assert df.instructions[2].form is None
    assert df.instructions[3].form is None            # not JSON: the shell form, as Docker
    steps = steps_of('FROM base\nRUN ["echo", "$HOME"]\nRUN echo $HOME\nSHELL ["/bin/bash", "-ec"]\n'
                     'RUN echo x\nENTRYPOINT exec app\n')
    assert steps.steps[0].argv == ["echo", "$HOME"]                  # no expansion in the exec form
    assert steps.steps[1].argv == ["/bin/sh", "-c", "echo $HOME"]    # the shell expands it
    assert steps.steps[3].argv == ["/bin/bash", "-ec", "echo x"]
    assert steps.steps[4].config.entrypoint == ["/bin/bash", "-ec", "exec app"]


# ---------------------------------------------------------------- expansion

@pytest.mark.parametrize("word,want", [
    ("$A", "a"), ("${A}", "a"), ("${A}x", "ax"), ("$Ax", ""), ("${NOPE:-d}", "d"), ("${EMPTY:-d}", "d"),
    ("${EMPTY-d}", ""), ("${A:+alt}", "alt"), ("${NOPE:+alt}", ""), ("'$A'", "$A"), ('"$A b"', "a b"),
    ("\\$A", "$A"), ('"\\$A"', "$A"), ("$", "$"), ("a$1", "a"), ("costs $5", "costs "), ("$@x", "x"),
    ("$$", ""), ("${NOPE:-${A}}", "a"), ('"it\'s"', "it's"), ("x\\ y", "x y"),
])
def test_expansion(word, want):
    """Positional and special parameters ($1, $@, $$) are never set in a Dockerfile: "" (BuildKit)."""
    assert expand(word, {"A": "a", "EMPTY": ""}) == want


@pytest.mark.parametrize("word,want", [
    ("${VER%.*}", "3.11"), ("${VER%%.*}", "3"), ("${VER#*.}", "11.4"), ("${VER##*.}", "4"),
    ("${F##*/}", "c.txt"), ("${F%/*}", "/a/b"), ("${VER#3}", ".11.4"), ("${VER%x}", "3.11.4"),
    ("${VER%\\.*}", "3.11"), ("${VER#?.}", "11.4"), ('${F#"/a"}', "/b/c.txt"), ("${F#$D}", "/c.txt"),
    ("${VER//./_}", "3_11_4"), ("${VER/./_}", "3_11.4"), ("${VER/1*/x}", "3.x"), ("${VER/./${D}}", "3/a/b11.4"),
    ("${NOPE%.*}", ""), ("${STAR#\\*}", "x*"), ("${STAR%\\*}", "*x"),
])
def test_pattern_substitutions(word, want):
    """${NAME#pat} ## % %% / //, as BuildKit's lexer: * any text, ? one character."""
    env = {"VER": "3.11.4", "F": "/a/b/c.txt", "D": "/a/b", "STAR": "*x*"}
    assert expand(word, env) == want


@pytest.mark.parametrize("word,want", [
    ("${F#${P}/}", "a/b/c.txt"),          # a variable's * is a wildcard, as in BuildKit
    ('${F/"/"/_}', "_a/b/c.txt"), ('${F//"/"/_}', "_a_b_c.txt"), ("${F%'.txt'}", "/a/b/c"),
    ('${A:-"}"}', "}"), ("${F//?/.}", ".........."), ("${F/*/x}", "x"), ("${E//x/y}", ""),
    ("${F//*/x}", "x"), ("${F//**/x}", "x"), ("${S///x}", "xaxbx"),    # no empty match after a match (Go)
])
def test_patterns_take_variables_and_quotes_as_buildkit_does(word, want):
    assert expand(word, {"F": "/a/b/c.txt", "P": "*", "E": "", "S": "ab"}) == want


def test_a_pattern_never_backtracks():
    """`*a*a*a*a*a*a*b` on 5,000 a's is exponential for a backtracking regex
    (the suite's per-test timeout ends it); a pattern too large for the step
    budget is refused, not run."""
    assert expand("${V#*a*a*a*a*a*a*b}", {"V": "a" * 5000}) == "a" * 5000
    assert expand("${V//a*b/x}", {"V": "ab " * 20000}) == "x "
    with pytest.raises(ValueError, match="too large to match here"):
        expand("${V%%*.*.*.*}", {"V": "a." * 1_000_000})


def test_required_variable_and_bad_substitution():
    with pytest.raises(ValueError, match="B: must be set"):
        expand("${B:?must be set}", {})
    for bad in ("${A:%x}", "${A^x}", "${#A}"):
        with pytest.raises(ValueError, match="bad substitution"):
            expand(bad, {"A": "a"})
    with pytest.raises(ValueError, match="missing its second /"):
        expand("${A/x}", {"A": "a"})


def test_words_split_outside_quotes_and_braces():
    assert split_words('A=1 B="x y" C=${D:-p q} \'e f\'') == ["A=1", 'B="x y"', "C=${D:-p q}", "'e f'"]


# ---------------------------------------------------------------- ARG and ENV

def test_arg_scopes_and_build_args():
    p = steps_of("ARG TAG=1.0\nARG BASE=img\nFROM $BASE\nARG TAG\nARG MODE=dev\nRUN echo\n"
                 "ENV MODE=env-wins\nRUN echo\n", {"BASE": "other", "MODE": "prod", "UNUSED": "x"},
                 base={"env": {"PATH": "/bin"}})
    assert p.base == "other"
    first, second = p.steps[2], p.steps[4]
    assert first.kind == RUN and first.env == {"TAG": "1.0", "MODE": "prod", "PATH": "/bin"}
    assert second.env == {"TAG": "1.0", "MODE": "env-wins", "PATH": "/bin"}   # ENV over an ARG of the same name
    assert p.unused_build_args == ["UNUSED"]


def test_an_arg_before_from_is_not_in_scope_after_it():
    p = steps_of("ARG V=1\nFROM base\nRUN echo\nENV X=$V\n", base={"env": {"PATH": "/bin"}})
    assert p.steps[0].env == {"PATH": "/bin"}
    assert p.steps[1].config.env == {"PATH": "/bin", "X": ""}


def test_a_base_without_path_gets_the_default_one():
    """As BuildKit: `ENV PATH=/opt/bin:$PATH` on an imported base (no PATH)
    must not leave a PATH of "/opt/bin:" alone."""
    p = steps_of("FROM base\nENV PATH=/opt/bin:$PATH\n")
    assert p.steps[0].config.env == {"PATH": f"/opt/bin:{DEFAULT_PATH}"}


def test_env_forms_and_old_values():
    p = steps_of('FROM base\nENV A=1 B="two words" C=$A\nENV D old form value\nENV A=2 E=$A\n',
                 base={"env": {"PATH": "/bin"}})
    assert p.steps[-1].config.env == {"PATH": "/bin", "A": "2", "B": "two words", "C": "",
                                      "D": "old form value", "E": "1"}


def test_expansion_in_copy_workdir_user_label_expose():
    p = steps_of("FROM base\nARG DIR=app\nARG U=1000\nARG P=8080\nWORKDIR /$DIR\nWORKDIR sub\n"
                 'COPY --chown=$U:$U a ${DIR}.txt ./\nUSER $U\nLABEL v="$DIR"\nEXPOSE $P 53/udp 7000-7001\n')
    workdir, sub, copy = p.steps[3], p.steps[4], p.steps[5]
    assert workdir.kind == WORKDIR and workdir.dest == "/app" and sub.config.cwd == "/app/sub"
    assert copy.kind == COPY and copy.sources == ["a", "app.txt"] and copy.dest == "/app/sub/"
    assert copy.chown == "1000:1000"
    cfg = p.steps[-1].config
    assert cfg.user == "1000" and cfg.labels == {"v": "app"}
    assert cfg.exposed_ports == ["53/udp", "7000/tcp", "7001/tcp", "8080/tcp"]


def test_config_after_each_step_and_entrypoint_resets_an_inherited_cmd():
    base = {"env": {"PATH": "/bin"}, "cwd": "/", "user": 0, "entrypoint": [], "cmd": ["sh"]}
    p = steps_of('FROM base\nENTRYPOINT ["app"]\n', base=base)
    assert p.steps[0].config.cmd == [] and p.steps[0].config.user == "0"
    p = steps_of('FROM base\nCMD ["--help"]\nENTRYPOINT ["app"]\nMAINTAINER me\n', base=base)
    cfg = p.steps[-1].config.to_dict()
    assert cfg == {"env": {"PATH": "/bin"}, "cwd": "/", "user": "0", "entrypoint": ["app"],
                   "cmd": ["--help"], "exposed_ports": [], "labels": {"maintainer": "me"}}
    assert [s.kind for s in p.steps] == [META, META, META]


def test_copy_destination_rules():
    p = steps_of('FROM base\nWORKDIR /w\nCOPY ["a b", "c"]\nCOPY x .\nADD --chmod=640 y /abs\n')
    assert p.steps[1].sources == ["a b"] and p.steps[1].dest == "/w/c"
    assert p.steps[2].dest == "/w/"                 # "." is a directory
    assert p.steps[3].add and p.steps[3].chmod == 0o640 and p.steps[3].dest == "/abs"


# ---------------------------------------------------------------- errors name their line

@pytest.mark.parametrize("text,line,code,words", [
    ("", 1, "bad_request", "no instructions"),
    ("RUN x\n", 1, "bad_request", "first instruction must be FROM"),
    ("# c\nFROM a\n\nFROOM b\n", 4, "bad_request", "unknown instruction 'FROOM'"),
    ("FROM a\nONBUILD RUN x\n", 2, "unsupported", "ONBUILD is not supported"),
    ("FROM a\nHEALTHCHECK CMD true\n", 2, "unsupported", "HEALTHCHECK"),
    ("FROM a\nVOLUME /data\n", 2, "unsupported", "VOLUME"),
    ("FROM a\nSTOPSIGNAL TERM\n", 2, "unsupported", "STOPSIGNAL"),
    ("FROM a\nRUN x\nFROM b\n", 3, "unsupported", "multi-stage"),
    ("FROM a\nCOPY --from=b x y\n", 2, "unsupported", "multi-stage"),
    ("FROM a\nRUN --mount=type=cache,target=/x make\n", 2, "unsupported", "RUN --mount is not supported by dsec "
     "builds (drop it: a RUN sees only the image so far)"),
    ("FROM a\nRUN <<EOF\n", 2, "unsupported", "here-document"),
    ("FROM a\nCOPY only\n", 2, "bad_request", "at least one source"),
    ("FROM a\nCOPY --chmod=9z x y\n", 2, "bad_request", "octal"),
    ("FROM a\nCOPY --owner=1 x y\n", 2, "bad_request", "no option --owner"),
    ("FROM a\nEXPOSE 70000\n", 2, "bad_request", "1 to 65535"),
    ("FROM a\nEXPOSE 80/icmp\n", 2, "bad_request", "tcp, udp or sctp"),
    ("FROM a\nENV\n", 2, "bad_request", "needs an argument"),
    ("FROM a\nENV A=1 B\n", 2, "bad_request", "NAME=VALUE"),
    ('FROM a\nENV A="unclosed\n', 2, "bad_request", "unmatched"),
    ("FROM a\nLABEL lonely\n", 2, "bad_request", "has no value"),
    ("FROM a\nENV LONELY\n", 2, "bad_request", "'LONELY' has no value: write NAME=VALUE"),
    ("FROM a\nSHELL bash -c\n", 2, "bad_request", "exec form"),
    ("FROM a\nARG 1BAD=x\n", 2, "bad_request", "not a valid variable name"),
    ("FROM scratch\n", 1, "unsupported", "FROM scratch"),
    ("FROM --platform=linux/arm64 a\n", 1, "unsupported", "--platform"),
    ("ARG B\nFROM $B\n", 2, "bad_request", "names no image"),
    ("FROM a\nUSER :1\n", 2, "bad_request", "USER"),
    ("FROM a\nADD http://x/y.tgz /\n", 2, "unsupported", "remote sources"),
    ("FROM a\n# escape=`\nRUN x\n", None, None, None),      # a directive after an instruction: a comment
])
def test_errors_name_the_line(text, line, code, words):
    if line is None:
        steps_of(text)
        return
    err = error_of(text)
    assert (err.line, err.code) == (line, code), err
    assert words in err.message
    assert str(err).startswith(f"Dockerfile:{line}: ")
