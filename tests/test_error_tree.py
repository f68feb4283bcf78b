"""One error tree in fact: every exception class tensorswap defines descends from
TensorSwapError, and no two of them share a name.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections import defaultdict
from types import ModuleType

import pytest

import tensorswap
from tensorswap.errors import TensorSwapError

# Modules that need an optional extra; skipped (not failed) where it is not installed.
OPTIONAL = {"torch", "matplotlib", "sklearn", "cryptography", "dp_accounting", "flwr"}


def _modules() -> list[ModuleType]:
    modules = [tensorswap]
    for info in pkgutil.walk_packages(tensorswap.__path__, "tensorswap."):
        try:
            modules.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:
            if (exc.name or "").partition(".")[0] not in OPTIONAL:
                raise
    return modules


def _subclasses(root: type) -> set[type]:
    found: set[type] = set()
    todo = [root]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def _tensorswap_exceptions() -> set[type[BaseException]]:
    """Every exception class defined in a tensorswap module: the module-level ones found by
    walking each module's names, and any other (a class defined in a function) found as a
    subclass of BaseException once its module is imported.
    """
    classes: set[type[BaseException]] = set()
    for module in _modules():
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseException):
                classes.add(obj)
    classes |= _subclasses(BaseException)
    return {c for c in classes if c.__module__.partition(".")[0] == "tensorswap"}


def test_the_walk_finds_the_package_errors() -> None:
    names = {c.__name__ for c in _tensorswap_exceptions()}
    # One leaf of each layer: a walk that found nothing would pass the tests below.
    assert {"ChecksumMismatch", "RoundNotFound", "MalformedFragment", "FramingError"} <= names
    assert len(names) > 80


def test_every_error_descends_from_the_root() -> None:
    outside = sorted(
        f"{c.__module__}.{c.__qualname__}"
        for c in _tensorswap_exceptions()
        if not issubclass(c, TensorSwapError)
    )
    assert outside == []


def test_error_names_are_unique_across_the_package() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for c in _tensorswap_exceptions():
        by_name[c.__name__].append(f"{c.__module__}.{c.__qualname__}")
    assert {name: sorted(where) for name, where in by_name.items() if len(where) > 1} == {}


@pytest.mark.parametrize(
    ("module", "name", "builtin"),
    [
        ("tensorswap._netaddr", "HostPortError", ValueError),
        ("tensorswap.demo.driver", "DemoError", RuntimeError),
    ],
)
def test_misuse_errors_keep_their_builtin_base(module: str, name: str, builtin: type) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, TensorSwapError) and issubclass(cls, builtin)


def test_the_whole_tree_is_reachable_from_tensorswap_errors() -> None:
    """``tensorswap.errors.NAME`` is every error class of the package (issue 24): the root's
    branches and the rounds, runs, privacy, secagg and region leaves defined there, the
    others through ``errors._index`` at the module that defines them."""
    import tensorswap.errors as errors
    from tensorswap.errors._index import ELSEWHERE

    for cls in _tensorswap_exceptions():
        if cls.__name__.startswith("_") or "<locals>" in cls.__qualname__:
            continue
        assert getattr(errors, cls.__name__, None) is cls, f"{cls.__module__}.{cls.__name__}"
    for name, where in ELSEWHERE.items():
        assert getattr(importlib.import_module(where), name).__module__ == where, name
    with pytest.raises(AttributeError):
        errors.NoSuchError  # noqa: B018
