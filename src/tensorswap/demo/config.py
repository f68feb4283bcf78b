"""The options of `tensorswap demo` (`DemoConfig`), their cross-checks, and `DemoError`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tensorswap.errors import TensorSwapError

__all__ = ["DEFAULT_INNER_STEPS", "DemoConfig", "DemoError", "check_config", "config_json"]

DEFAULT_INNER_STEPS = 20
"""``--topology diloco``'s inner steps: 4 peers reach 0.95 test accuracy in 10 outer steps."""


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
    # A federated run (`tensorswap run`) instead of independent rounds: any of these.
    mode: str | None = None  # "sync" or "async" (None: "sync" when another run option is set)
    server_opt: str | None = None  # the run's server optimizer (None: fedavg)
    sample: int | None = None  # peers sampled per round (sync), None: all
    slow_peer: int | None = None  # this peer's training takes slow_factor times as long
    slow_factor: float = 5.0
    buffer: int | None = None  # async: contributions per version (None: half the peers)
    max_staleness: int = 8
    # Differential privacy (a sync run): the clipping norm C (None: no DP), noise multiplier z
    dp_clip: float | None = None
    dp_noise: float = 1.0
    dp_delta: float = 1e-5
    dp_max_epsilon: float | None = None
    # Secure aggregation (SecAgg+, a sync run): the coordinator learns only the round's sum
    secagg: bool = False
    secagg_threshold: int | None = None
    # --netlab: every process on a host of its own (network namespaces), over shaped links
    netlab: bool = False
    link_mbit: float = 20.0
    rtt_ms: float = 40.0
    # --swarm: peers fetch each round's aggregate through the swarm (peers serve it on)
    swarm: bool = False
    # --topology diloco: minibatch steps per outer step (None: DEFAULT_INNER_STEPS); --rounds
    # is then the number of outer steps
    inner_steps: int | None = None

    @property
    def federated(self) -> bool:
        """Whether the demo runs as a federated run on the coordinator (`demo.run_driver`)."""
        return (
            self.mode is not None
            or self.server_opt is not None
            or self.sample is not None
            or self.slow_peer is not None
            or self.dp_clip is not None
            or self.secagg
        )

    @property
    def diloco_inner_steps(self) -> int:
        """DiLoCo's minibatch steps per outer step: ``--inner-steps``, else the default."""
        return self.inner_steps if self.inner_steps is not None else DEFAULT_INNER_STEPS

    @property
    def run_mode(self) -> str:
        return self.mode or "sync"

    def run_buffer(self) -> int:
        """Async: contributions per version: ``--buffer``, else half the peers (at least 1),
        so the fast peers make versions without waiting for a slow one."""
        return self.buffer if self.buffer is not None else max(1, self.peers // 2)

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
    if cfg.netlab and cfg.topology != "star":
        raise DemoError("--netlab runs the star topology (peers dial the coordinator)")
    if cfg.netlab and not (cfg.link_mbit > 0 and cfg.rtt_ms >= 0):
        raise DemoError("--link-mbit must be > 0 and --rtt-ms >= 0")
    if cfg.swarm and (cfg.topology != "star" or cfg.federated):
        raise DemoError("--swarm applies to the per-round star demo (peers fetch aggregates)")
    if cfg.secagg_threshold is not None and not cfg.secagg:
        raise DemoError("--secagg-threshold needs --secagg")
    if cfg.inner_steps is not None and cfg.topology != "diloco":
        raise DemoError("--inner-steps applies to the diloco topology")
    if cfg.topology == "diloco":
        _check_diloco(cfg)
    if cfg.federated:
        _check_run_options(cfg)


def _check_diloco(cfg: DemoConfig) -> None:
    if cfg.inner_steps is not None and cfg.inner_steps < 1:
        raise DemoError(f"--inner-steps {cfg.inner_steps} must be at least 1")
    if cfg.compression == "topk":
        raise DemoError(
            "--compression topk does not apply to diloco: the all-reduce sends none, f16 or int8"
        )
    if cfg.kill_peer is not None:
        raise DemoError("--kill-peer applies to the star and p2p topologies, not diloco")
    if cfg.aggregator != "fedavg":
        raise DemoError(
            "--aggregator applies to the star and p2p topologies: diloco all-reduces the mean"
        )
    if cfg.freeze_first_layer:
        raise DemoError("--freeze-first-layer applies to the star and p2p topologies")
    defaults = DemoConfig()
    if cfg.local_epochs != defaults.local_epochs:
        raise DemoError("--local-epochs applies to the star and p2p topologies: diloco's local "
                        "work per outer step is --inner-steps")  # fmt: skip
    if cfg.deadline_s != defaults.deadline_s or cfg.quorum is not None:
        raise DemoError("--deadline and --quorum apply to rounds: diloco's all-reduce has no "
                        "deadline (a dead peer is dropped when found)")  # fmt: skip


def _check_run_options(cfg: DemoConfig) -> None:
    if cfg.topology != "star":
        raise DemoError(
            "--mode, --server-opt, --sample, --slow-peer, --dp-* and --secagg run on the star "
            "topology"
        )
    if cfg.compression != "none":
        raise DemoError("--compression applies to the per-round demo, not to a federated run")
    if cfg.freeze_first_layer:
        raise DemoError("--freeze-first-layer applies to the per-round demo")
    if cfg.sample is not None and not 1 <= cfg.sample <= cfg.peers:
        raise DemoError(f"--sample {cfg.sample} must be in [1, --peers {cfg.peers}]")
    if cfg.slow_peer is not None and not 0 <= cfg.slow_peer < cfg.peers:
        raise DemoError(f"--slow-peer {cfg.slow_peer} must be a peer index in [0, {cfg.peers})")
    if cfg.dp_clip is not None and cfg.run_mode == "async":
        raise DemoError("--dp-clip applies to --mode sync (DP-FedAvg rounds)")
    if cfg.secagg:
        sampled = cfg.sample or cfg.peers
        if cfg.run_mode == "async":
            raise DemoError("--secagg applies to --mode sync (sampled rounds)")
        if sampled < 3:
            raise DemoError(
                "--secagg needs at least 3 peers a round (a sum is never unmasked over fewer: "
                "with 2, each would learn the other's delta)"
            )
        if cfg.secagg_threshold is not None and not 2 <= cfg.secagg_threshold <= sampled:
            raise DemoError(
                f"--secagg-threshold {cfg.secagg_threshold} must be in [2, {sampled}] "
                "(the peers sampled per round)"
            )
        if cfg.kill_peer is not None and sampled < 4:
            raise DemoError(
                "--kill-peer with --secagg needs at least 4 peers a round (3 survivors at least)"
            )
    if cfg.run_mode == "async":
        if cfg.sample is not None:
            raise DemoError("--sample applies to --mode sync (an async run takes any peer)")
        if cfg.kill_peer is not None:
            raise DemoError("--kill-peer applies to --mode sync (async has no round barrier)")
        if cfg.aggregator not in ("fedavg", "mean"):
            raise DemoError("an async run folds deltas as they come: --aggregator fedavg or mean")


def config_json(cfg: DemoConfig) -> dict[str, Any]:
    """The options as JSON values (paths as strings), as ``summary.json`` records them."""
    data = asdict(cfg)
    data["out"] = str(cfg.out)
    data["data"] = None if cfg.data is None else str(cfg.data)
    return data
