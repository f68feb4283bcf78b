"""`tensorswap serve --upstream`: its options refuse bad input in one error line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorswap.cli import main


def run_bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.lower().startswith("error")]
    assert (rc, len(errors)) == (2, 1), err
    return errors[0]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--region", "eu"], "--upstream"),
        (["--upstream", "127.0.0.1:0"], "'--upstream'"),
        (["--upstream", "nohost"], "'--upstream'"),
        (["--upstream", "127.0.0.1:1", "--upstream-patience", "nan"], "'--upstream-patience'"),
        (["--upstream", "127.0.0.1:1", "--region", ""], "'--region'"),
        (["--upstream", "127.0.0.1:1", "--region", "r" * 257], "'--region'"),
    ],
)
def test_bad_regional_options_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    serve = ["serve", "--listen", "127.0.0.1:0", "--data", str(tmp_path / "d")]
    assert says in run_bad(capsys, *serve, *extra)
    assert not (tmp_path / "d").exists()  # refused before anything was opened
