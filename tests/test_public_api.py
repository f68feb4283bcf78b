"""The public names import, are sorted, and the README's example runs."""

from __future__ import annotations

import re
from pathlib import Path

import tensorswap


def test_every_public_name_imports() -> None:
    for name in tensorswap.__all__:
        assert hasattr(tensorswap, name), name


def test_all_is_sorted() -> None:
    assert list(tensorswap.__all__) == sorted(tensorswap.__all__)


def test_readme_python_example_runs(capsys: object) -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S)
    assert code is not None
    exec(compile(code.group(1), "README.md", "exec"), {})


def test_errors_share_one_root() -> None:
    for name in tensorswap.__all__:
        obj = getattr(tensorswap, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, tensorswap.TensorSwapError), name


def test_subpackages_are_not_shadowed_by_reexports() -> None:
    import importlib
    import types

    for name in ("aggregate", "codec", "store", "delta", "cid", "errors", "wire", "rounds", "flow"):
        module = importlib.import_module(f"tensorswap.{name}")
        assert isinstance(getattr(tensorswap, name), types.ModuleType), name
        assert getattr(tensorswap, name) is module
