"""The options of `tensorswap demo` (`DemoConfig`), their cross-checks, and `DemoError`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tensorswap.errors import TensorSwapError

__all__ = ["DemoConfig", "DemoError", "check_config", "config_json"]


class DemoError(TensorSwapError, RuntimeError):
    """The demo could not run (a process failed to start, a peer gave up, ...)."""


@dataclass(frozen=True)
class DemoConfig:
    """Every option of `tensorswap demo`."""

    peers: int = 4
    rounds: int = 10
    aggregator: str = "fedavg"
    compression: str = "none"
    topology: str = "star"
    kill_peer: int | None = None
    local_epochs: int = 2
    seed: int = 0
    out: Path = Path("tensorswap-out")
    data: Path | None = None
    deadline_s: float = 15.0
    quorum: int | None = None
    freeze_first_layer: bool = False
    max_fragment_bytes: int | None = None  # p2p: the DWE size cap (None: 8 MiB)

    def round_quorum(self, alive: int) -> int:
        """Contributions a round needs at its deadline: ``--quorum``, else all but one peer
        when a peer will be killed, else every peer."""
        if self.quorum is not None:
            return max(1, min(self.quorum, alive))
        return max(1, alive - 1) if self.kill_peer is not None else alive


def check_config(cfg: DemoConfig) -> None:
    """Raise DemoError for options that do not go together (before any process starts)."""
    if cfg.topology == "p2p" and cfg.compression != "none":
        raise DemoError("--compression applies to the star topology (DWE fragments are float32)")
    if cfg.topology != "p2p" and cfg.max_fragment_bytes is not None:
        raise DemoError("--max-fragment-bytes applies to the p2p topology (DWE fragments)")
    if cfg.aggregator in ("krum", "multi_krum") and cfg.peers < 3:
        raise DemoError(f"{cfg.aggregator} needs at least 3 peers")


def config_json(cfg: DemoConfig) -> dict[str, Any]:
    """The options as JSON values (paths as strings), as ``summary.json`` records them."""
    data = asdict(cfg)
    data["out"] = str(cfg.out)
    data["data"] = None if cfg.data is None else str(cfg.data)
    return data
