"""`tensorswap demo --netlab`: the demo's processes on hosts of their own, over shaped links.

Root only (network namespaces): skipped with the reason elsewhere; CI runs as root.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from tensorswap.demo.config import DemoConfig, DemoError, check_config
from tensorswap.netlab import NetlabError
from tensorswap.netlab._sys import check_available, run

pytestmark = pytest.mark.timeout(240)


def _lab_namespaces() -> list[str]:
    """This process's lab namespaces (``tsnl<pid>x<n>-...``): another process's lab, on a
    shared machine, comes and goes on its own."""
    listed = run("ip", "netns", "list").stdout.split()
    return [n for n in listed if n.startswith(f"tsnl{os.getpid()}x")]


@pytest.mark.slow
def test_the_demo_runs_across_hosts_and_tears_the_lab_down(tmp_path: Path) -> None:
    try:
        check_available()
    except NetlabError as exc:
        pytest.skip(str(exc))
    from tensorswap.demo.netlab import run_in_lab

    before = _lab_namespaces()
    buf = io.StringIO()
    cfg = DemoConfig(
        peers=2, rounds=2, local_epochs=1, netlab=True, link_mbit=50, rtt_ms=20, out=tmp_path
    )
    report = run_in_lab(cfg, Console(file=buf, width=200))
    text = buf.getvalue()
    assert [r.round for r in report.rounds] == [1, 2] and all(r.ok for r in report.rounds)
    assert report.final_accuracy > report.initial_accuracy + 0.2
    assert "network lab: coordinator on 198.18." in text and "20 ms RTT" in text
    assert "coordinator listening on 198.18." in text
    assert _lab_namespaces() == before  # every namespace of this lab is gone


def test_netlab_options_are_checked() -> None:
    with pytest.raises(DemoError, match="star topology"):
        check_config(DemoConfig(netlab=True, topology="p2p"))
    with pytest.raises(DemoError, match="--link-mbit"):
        check_config(DemoConfig(netlab=True, link_mbit=0))
