"""The `dsec` command's entry point (pyproject.toml, [project.scripts]).

It holds SIGINT before anything else (sigint.py): importing the CLI takes
most of dsec's start, and a ^C in it is said as `dsec CMD: interrupted
(SIGINT)`, exit 130, not as a traceback. That is why this module imports
nothing but sigint until main runs, and why the package's __init__ imports
nothing either.
"""

from . import sigint

sigint.hold()


def main() -> None:
    # Imported here, not above: this import is the part of the start a ^C must not break.
    from .cli import main as run

    run()
