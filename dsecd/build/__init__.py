"""Dockerfile builds: what does not need a sandbox (docs/architecture.md).

dockerfile.py  the parser: directives, continuations, instructions, $VAR expansion
plan.py        a parsed Dockerfile -> steps: ARG/ENV scopes, image config after each step
ignore.py      .dockerignore patterns
context.py     the build context read in place: COPY/ADD sources, their content hash
copyin.py      COPY, ADD and WORKDIR written into a build sandbox from the host

The build itself, with sandboxes, the cache and progress, is the engine's
BuildService (dsecd/engine/builds.py).
"""
