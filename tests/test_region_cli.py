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
        (["--upstream-peer-key-file", "KEYS"], "--upstream"),
        (
            ["--upstream", "127.0.0.1:1", "--region", "eu", "--upstream-peer-key-file", "KEYS"],
            "no key for region 'eu'",
        ),
        (
            ["--upstream", "127.0.0.1:1", "--region", "eu", "--upstream-peer-key-file", "KEYS"],
            "keys:2: not a peer key line",
        ),
    ],
)
def test_bad_regional_options_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    serve = ["serve", "--listen", "127.0.0.1:0", "--data", str(tmp_path / "d")]
    keys = tmp_path / "keys"
    keys.write_text(
        "region-b 00ff\nbroken-line\n" if "peer key line" in says else "region-b 00ff\n"
    )
    extra = [str(keys) if arg == "KEYS" else arg for arg in extra]
    assert says in run_bad(capsys, *serve, *extra)
    assert not (tmp_path / "d").exists()  # refused before anything was opened
