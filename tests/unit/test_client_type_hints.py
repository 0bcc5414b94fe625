"""The SDK's type hints resolve at run time (typing.get_type_hints), as
tools that read them need: a hint naming a class of a later module is
imported for type checkers only, and the package sets that name once
every module is loaded (dsecd/client/__init__.py)."""

from __future__ import annotations

import inspect
import typing

import pytest

import dsecd.client as sdk

CLASSES = [getattr(sdk, name) for name in sdk.__all__ if inspect.isclass(getattr(sdk, name))]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_every_hint_of_an_sdk_class_resolves(cls):
    for _, member in inspect.getmembers(cls, inspect.isfunction):
        typing.get_type_hints(member)          # NameError if a hinted class is not known to its module
