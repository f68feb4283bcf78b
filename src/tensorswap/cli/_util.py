"""Small helpers shared by CLI commands: reading files without copies, the boundary where a
damaged file's parser failure becomes one typed error, host:port parsing, shared keys and TLS
contexts whose bad files are one error line.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import ssl
import stat
import tokenize
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from tensorswap._netaddr import HostPortError, split_host_port
from tensorswap.errors import CodecError, TensorSwapError


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses NaN and infinities (NaN passes every comparison)."""

    name = "float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number.", param, ctx)
        return rv


SECONDS = FiniteFloatRange(min=0, min_open=True)
"""A timeout option's type: a finite number of seconds > 0."""

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ByteSize(click.ParamType):
    """A byte count >= 1: ``1073741824``, or with a binary unit: ``512MiB``, ``1G``, ``64k``."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int):
            number = value
        else:
            text = str(value).strip().lower().removesuffix("b").removesuffix("i")
            digits = text.rstrip("kmgt")
            unit = text[len(digits) :]
            if not digits.strip().isdigit() or unit not in _UNITS:
                self.fail(
                    f"{value!r} is not a byte size (like 1073741824, 512MiB or 1GiB)", param, ctx
                )
            number = int(digits) * _UNITS[unit]
        if number < 1:
            self.fail(f"{value!r} is below 1 byte", param, ctx)
        return number


BYTES = ByteSize()


@contextlib.contextmanager
def mapped(path: str | Path) -> Iterator[memoryview]:
    """The file's bytes as a read-only memoryview over an mmap (empty files give b'').

    A pipe or other non-regular file (``/dev/stdin``, ``<(cmd)``) is read to its end instead:
    its size is not known up front and it cannot be mapped.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, after the mapping
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror or str(exc)) from exc
    with f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            try:
                content = f.read()
            except OSError as exc:
                raise click.FileError(str(path), hint=exc.strerror or str(exc)) from exc
            yield memoryview(content)
            return
        size = info.st_size
        if size == 0:
            yield memoryview(b"")
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(mm)
        try:
            yield view
        finally:
            # A derived buffer still alive (say, held by a traceback) keeps the mapping open;
            # the garbage collector closes it then.
            with contextlib.suppress(BufferError):
                view.release()
                mm.close()


@contextlib.contextmanager
def reading(kind: str, path: str | Path | None = None) -> Iterator[None]:
    """The CLI's boundary for parsing a user's file as ``kind``: whatever the parser raises
    (numpy's header parser alone raises tokenize.TokenError, SyntaxError, ValueError,
    TypeError, ...; others struct.error, RecursionError, MemoryError for a header that asks
    for more than there is) becomes one CodecError, "PATH: not a readable KIND file: REASON",
    which the command prints as one line with exit code 2.

    tensorswap's own errors (already typed, with their facts) and click's pass unchanged.
    """
    try:
        yield
    except (TensorSwapError, click.ClickException):
        raise
    except Exception as exc:  # a parser of untrusted bytes may raise anything
        where = f"{path}: " if path is not None else ""
        raise CodecError(f"{where}not a readable {kind} file: {_parse_failure(exc)}") from exc


def _parse_failure(exc: Exception) -> str:
    if isinstance(exc, SyntaxError):  # Python-literal headers (.npy) that do not parse
        return f"its header does not parse ({exc.msg})"
    if isinstance(exc, tokenize.TokenError):
        return f"its header does not parse ({exc.args[0]})"
    return str(exc) or type(exc).__name__


def parse_host_port(text: str, *, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:PORT`` for IPv6, ``:PORT`` for the default host).

    The rules are :func:`tensorswap._netaddr.split_host_port`'s; errors are click.BadParameter.
    """
    try:
        return split_host_port(text, default_host=default_host)
    except HostPortError as exc:
        raise click.BadParameter(str(exc)) from None


def read_key(key_file: str | None) -> bytes | None:
    """:func:`tensorswap.wire.auth.load_key`, an empty or unreadable key a click.BadParameter."""
    from tensorswap.wire.auth import KEY_ENV, load_key  # here: `cid` and `inspect` need no wire

    try:
        return load_key(key_file)
    except (ValueError, OSError) as exc:
        hint = "'--key-file'" if key_file is not None else f"${KEY_ENV}"
        raise click.BadParameter(_reason(exc), param_hint=hint) from None


def client_tls(cafile: str | None) -> ssl.SSLContext:
    """A client TLS context trusting ``cafile`` (system roots when None); a bad file is a
    click.BadParameter naming --tls-ca.
    """
    from tensorswap.wire.auth import client_ssl_context

    try:
        return client_ssl_context(cafile)
    except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError
        raise click.BadParameter(
            f"cannot load {cafile}: {_reason(exc)}", param_hint="'--tls-ca'"
        ) from None


def server_tls(certfile: str, keyfile: str | None) -> ssl.SSLContext:
    """A server TLS context from a certificate (and key) file; a bad file is a
    click.BadParameter naming --tls-cert / --tls-key.
    """
    from tensorswap.wire.auth import server_ssl_context

    try:
        return server_ssl_context(certfile, keyfile)
    except (ValueError, OSError) as exc:
        files = certfile if keyfile is None else f"{certfile} / {keyfile}"
        hint = ["--tls-cert"] if keyfile is None else ["--tls-cert", "--tls-key"]
        raise click.BadParameter(
            f"cannot load a certificate and private key from {files}: {_reason(exc)}",
            param_hint=hint,
        ) from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, ssl.SSLError):
        return exc.strerror
    return str(exc) or type(exc).__name__


def parse_options(params: Sequence[str]) -> dict[str, float | int | str]:
    """``k=v`` pairs; numbers become numbers."""
    out: dict[str, float | int | str] = {}
    for item in params:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"expected NAME=VALUE, got {item!r}")
        for kind in (int, float):
            try:
                out[name] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[name] = value
    return out


def parse_numbers(params: Sequence[str]) -> dict[str, float]:
    """``k=v`` pairs whose values must be numbers (server optimizer hyper-parameters)."""
    out = {}
    for name, value in parse_options(params).items():
        if isinstance(value, str):
            raise click.BadParameter(f"{name}={value!r}: a number is expected", param_hint="--opt")
        out[name] = float(value)
    return out


F = TypeVar("F", bound=Callable[..., Any])

_POLICY_OPTIONS = (
    click.option(
        "--strategy",
        default="fedavg",
        show_default=True,
        help="How a round aggregates: fedavg, mean, median, trimmed_mean, krum, multi_krum.",
    ),
    click.option(
        "--param",
        "params",
        multiple=True,
        metavar="NAME=VALUE",
        help="A strategy option (repeatable), e.g. trim_fraction=0.2.",
    ),
    click.option(
        "--deterministic",
        is_flag=True,
        help="Fold each round's contributions in canonical order (by peer name) when it"
        " closes: the same inputs give the same bits whatever order they arrive in, and"
        " regions relay each one (docs/rounds.md, Guarantees).",
    ),
    click.option(
        "--optimizer",
        default="fedavg",
        show_default=True,
        help="The server optimizer: fedavg, fedavgm, fedadam, fedyogi, fedadagrad, nesterov.",
    ),
    click.option(
        "--opt",
        "opts",
        multiple=True,
        metavar="NAME=VALUE",
        help="A server optimizer hyper-parameter (repeatable), e.g. eta=0.01.",
    ),
)


def policy_params(o: dict[str, Any]) -> dict[str, float | int | str]:
    """The strategy params ``--param`` and ``--deterministic`` give (``policy_options``)."""
    params = parse_options(o["params"])
    if o.get("deterministic"):
        params["deterministic"] = 1  # rounds.core.DETERMINISTIC
    return params


def policy_options(command: F) -> F:
    """``--strategy``/``--param``/``--deterministic`` and ``--optimizer``/``--opt`` (a run's
    aggregation and server optimizer; parse with ``policy_params`` / ``parse_numbers``), as
    ``run create`` and ``simulate`` take them."""
    for option in reversed(_POLICY_OPTIONS):
        command = option(command)
    return command


def option_group(*options: Callable[[Any], Any]) -> Callable[[F], F]:
    """One decorator that applies ``options`` in the order given, as if each were written
    above the command in that order (so ``--help`` lists them so)."""

    def apply(command: F) -> F:
        for option in reversed(options):
            command = option(command)
        return command

    return apply
