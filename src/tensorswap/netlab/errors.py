"""The network lab's errors, under ``NetlabError``.

::

    NetlabError
    ├── NamespacesUnavailable   (also RuntimeError) no namespaces here: not root, no `ip`
    ├── LabCommandFailed        an `ip` / `tc` command failed (its argv, exit code, stderr)
    └── LabProcessFailed        a process started in a host (a relay, a server) did not
                                start listening
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorswap.errors import NetlabError

__all__ = ["LabCommandFailed", "LabProcessFailed", "NamespacesUnavailable", "NetlabError"]


class NamespacesUnavailable(NetlabError, RuntimeError):
    """Network namespaces cannot be made here; ``reason`` says why (tests skip with it)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"network namespaces unavailable: {reason}")


class LabCommandFailed(NetlabError):
    """A command that builds or changes the lab exited non-zero."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(
            f"`{' '.join(self.argv)}` failed (exit {returncode}): {self.stderr or 'no output'}"
        )


class LabProcessFailed(NetlabError):
    """A process started in a lab host (a relay, a server) did not start listening."""

    def __init__(self, name: str, detail: str) -> None:
        self.name = name
        self.detail = detail
        super().__init__(f"{name}: {detail}")
