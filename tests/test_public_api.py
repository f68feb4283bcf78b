"""The public names import, are sorted, and the README's example runs."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tensorswap


def test_every_public_name_imports() -> None:
    for name in tensorswap.__all__:
        assert hasattr(tensorswap, name), name


def test_all_is_sorted() -> None:
    assert list(tensorswap.__all__) == sorted(tensorswap.__all__)


def test_all_holds_no_future_feature() -> None:
    """``from __future__ import annotations`` binds a name; ``__all__`` must not export it."""
    import __future__

    leaked = [
        n for n in tensorswap.__all__ if getattr(__future__, n, None) is getattr(tensorswap, n)
    ]
    assert leaked == []


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


def test_the_top_level_is_user_sized() -> None:
    """What a user starts with, not every name of every room (issue 24): at most 90 names,
    at most 15 of them exceptions; the whole error tree is in ``tensorswap.errors``."""
    errors = [
        n
        for n in tensorswap.__all__
        if isinstance(c := getattr(tensorswap, n), type) and issubclass(c, BaseException)
    ]
    assert len(tensorswap.__all__) <= 90, len(tensorswap.__all__)
    assert len(errors) <= 15, errors
    for name in ("RunClient", "RunSpec", "RoundClient", "BlockingRoundClient", "put_update"):
        assert name in tensorswap.__all__, name
    for name in ("DweBus", "GarwBlock", "encode_ipfrs_gradient", "ChecksumMismatch"):
        assert name not in tensorswap.__all__, name  # one level down


def test_the_errors_users_catch_import_from_tensorswap_errors() -> None:
    from tensorswap.errors import (  # noqa: F401 - the import is the test
        AuthenticationFailed,
        BlockHashMismatch,
        ChecksumMismatch,
        ConnectionFailed,
        DuplicateContribution,
        InvalidUpdate,
        MalformedFragment,
        PeerTimeout,
        ProtocolViolation,
        RemoteError,
        RoundFailed,
        RoundNotFound,
        RoundTimeout,
        StateMismatch,
        UnknownUpdate,
        UpdateMismatch,
    )


def test_the_readme_imports_from_the_top_or_one_level_down() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for module in re.findall(r"from (tensorswap[\w.]*) import", readme):
        assert module.count(".") <= 1, module
        importlib.import_module(module)
    for names in re.findall(r"from tensorswap import ([\w, ]+)", readme):
        for name in names.split(","):
            assert hasattr(tensorswap, name.strip()), name


def test_subpackages_are_not_shadowed_by_reexports() -> None:
    import types

    for name in ("aggregate", "codec", "store", "delta", "cid", "errors", "wire", "rounds", "flow"):
        module = importlib.import_module(f"tensorswap.{name}")
        assert isinstance(getattr(tensorswap, name), types.ModuleType), name
        assert getattr(tensorswap, name) is module


# Names that moved out of a module into a sibling: still importable from where they were.
_MOVED = (
    ("tensorswap.demo.driver", "tensorswap.demo.config", "DemoConfig"),
    ("tensorswap.demo.driver", "tensorswap.demo.config", "DemoError"),
    ("tensorswap.demo.driver", "tensorswap.demo.report", "DemoReport"),
    ("tensorswap.demo.driver", "tensorswap.demo.report", "RoundReport"),
    ("tensorswap.demo.driver", "tensorswap.demo.output", "plot_report"),
    ("tensorswap.demo.driver", "tensorswap.demo.fleet", "Fleet"),
    ("tensorswap.demo.driver", "tensorswap.demo.fleet", "Peer"),
    ("tensorswap.demo.driver", "tensorswap.demo.fleet", "READY_TIMEOUT_S"),
    ("tensorswap.demo.driver", "tensorswap.demo.fleet", "STOP_TIMEOUT_S"),
    ("tensorswap.demo.peer", "tensorswap.demo.inbox", "DeltaInbox"),
    ("tensorswap.demo.peer", "tensorswap.demo.inbox", "SEQ_STRIDE"),
    ("tensorswap.demo.peer", "tensorswap.demo.local", "PeerState"),
    ("tensorswap.demo.peer", "tensorswap.demo.local", "emit"),
    ("tensorswap.demo.peer", "tensorswap.demo.local", "fail"),
    ("tensorswap.demo.peer", "tensorswap.demo.peer_rounds", "star_round"),
    ("tensorswap.demo.peer", "tensorswap.demo.peer_rounds", "p2p_round"),
)


@pytest.mark.parametrize(("old", "new", "name"), _MOVED)
def test_a_moved_name_is_the_same_object_where_it_was(old: str, new: str, name: str) -> None:
    moved = getattr(importlib.import_module(new), name)
    assert getattr(importlib.import_module(old), name) is moved


def test_the_top_level_names_load_on_first_use() -> None:
    """``import tensorswap.wire`` (the send/recv commands, every peer process) loads the wire
    and what it needs, not the coordinator, the runs or the aggregators; a top-level name
    loads its home module when first asked for."""
    code = (
        "import sys, tensorswap.cli.send_cmd, tensorswap.cli.recv_cmd\n"
        "heavy = ('tensorswap.rounds', 'tensorswap.runs', 'tensorswap.aggregate')\n"
        "assert not [m for m in heavy if m in sys.modules], sorted(sys.modules)\n"
        "import tensorswap\n"
        "assert tensorswap.RoundServer.__module__.startswith('tensorswap.rounds')\n"
        "assert 'tensorswap.rounds' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_top_level_name_is_an_attribute_error() -> None:
    assert set(tensorswap.__all__) <= set(dir(tensorswap))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tensorswap.nope  # noqa: B018
