"""The `tensorswap` command: one click group, subcommands loaded lazily from sibling modules."""

from __future__ import annotations

import importlib
import sys

import click

from tensorswap.errors import TensorSwapError

# name -> (module, attribute, one-line help). Modules are imported only when their command runs,
# so `tensorswap --help` stays fast and a missing optional extra only breaks its own command.
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "cid": ("tensorswap.cli.cid_cmd", "cid", "Print the CIDv1 of a file's bytes."),
    "inspect": (
        "tensorswap.cli.inspect_cmd",
        "inspect",
        "Describe a tensor file as JSON.",
    ),
    "demo": ("tensorswap.cli.demo_cmd", "demo", "Run the built-in end-to-end job."),
    "bench": ("tensorswap.cli.bench_cmd", "bench", "Run the benchmarks: one table of ratios."),
    "flow": ("tensorswap.cli.flow_cmd", "flow", "Typed training messages over ZeroMQ."),
    "delta": ("tensorswap.cli.delta_cmd", "delta", "Weight-delta fragments over TCP (axiom DWE)."),
    "send": ("tensorswap.cli.send_cmd", "send", "Send a tensor file to a receiver."),
    "recv": ("tensorswap.cli.recv_cmd", "recv", "Receive tensors into a directory store."),
    "run": ("tensorswap.cli.run_cmd", "run", "Create and show federated runs on a coordinator."),
    "serve": ("tensorswap.cli.serve_cmd", "serve", "Run the round coordinator and block service."),
    "simulate": (
        "tensorswap.cli.simulate_cmd",
        "simulate",
        "Simulate many clients against a real coordinator (local or Ray).",
    ),
    "status": ("tensorswap.cli.status_cmd", "status", "Show a coordinator's rounds and counters."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _COMMANDS:
            module, attr, _ = _COMMANDS[cmd_name]
            command = getattr(importlib.import_module(module), attr)
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, _COMMANDS[name][2]) for name in sorted(_COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tensorswap")
def cli() -> None:
    """tensorswap: move gradients and weight deltas between training peers and aggregate them.

    Every tensor is content-addressed (CIDv1), every frame checksummed.
    """


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; library errors become one line and exit code 2."""
    try:
        rv = cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.FileError as exc:  # a missing or unreadable file is bad input too
        exc.show()
        return 2
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except TensorSwapError as exc:
        click.echo(f"error: {exc}", err=True)
        return 2
    except KeyboardInterrupt:
        return 130
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
