"""``tensorswap delta send`` and ``tensorswap delta listen`` end to end over loopback."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cli import main
from tensorswap.delta import (
    DweBus,
    DweConfig,
    DweFragment,
    DweListener,
    FleetKeys,
    apply_fragment,
    encode_frame,
    extract_delta_fragment,
    split_fragment,
)


def _states(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "encoder.weight": rng.standard_normal((64, 40)).astype(np.float32),
        "encoder.bias": rng.standard_normal(40).astype(np.float32),
    }


async def _run_send(
    listener_config: DweConfig,
    state: dict[str, np.ndarray],
    expected: int,
    base: Path,
    new: Path,
    *extra: str,
):
    applied: list[DweFragment] = []
    done = asyncio.Event()

    def apply(fragment: DweFragment) -> None:
        apply_fragment(state, fragment)
        applied.append(fragment)
        if len(applied) == expected:
            done.set()

    async with DweListener(apply, config=listener_config) as listener:
        argv = ["delta", "send", "--to", str(listener.endpoint), str(base), str(new), *extra]
        code = await asyncio.to_thread(main, argv)
        async with asyncio.timeout(10):  # the CLI returns once written; wait for the apply
            await done.wait()
    return code, state, applied


async def test_send_npz_applies_the_delta(tmp_path: Path, capsys) -> None:
    base, new = tmp_path / "base.npz", tmp_path / "new.npz"
    np.savez(base, **_states(0))
    np.savez(new, **_states(1))
    code, state, applied = await _run_send(
        DweConfig(), _states(0), 1, base, new, "--session-id", "cli", "--sequence", "5"
    )
    assert code == 0
    assert [(f.session_id, f.sequence) for f in applied] == [("cli", 5)]
    for name, value in _states(1).items():
        np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-6)
    out = capsys.readouterr()
    assert "sent 1 fragment(s)" in out.out and "layer 0: encoder.weight" in out.err


async def test_send_safetensors_split_and_signed(tmp_path: Path, capsys) -> None:
    from safetensors.numpy import save_file

    base, new = tmp_path / "base.safetensors", tmp_path / "new.safetensors"
    save_file(_states(0), str(base))
    save_file(_states(1), str(new))
    keys = FleetKeys(b"fleet")
    receiver = dict(sorted(_states(0).items()))  # safetensors lists names sorted
    whole = extract_delta_fragment("tensorswap", 0, dict(sorted(_states(1).items())), receiver)
    expected = len(split_fragment(whole, max_bytes=4096))
    assert expected > 2
    code, state, applied = await _run_send(
        DweConfig(keys=keys), receiver, expected, base, new, "--max-bytes", "4096", "--key", "fleet"
    )
    assert code == 0
    assert all(f.hmac for f in applied)
    for name, value in _states(1).items():  # safetensors order is by name: bias is layer 0
        np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-6)
    assert f"sent {len(applied)} fragment(s)" in capsys.readouterr().out


def test_bad_peer_address_is_a_clean_error(tmp_path: Path, capsys) -> None:
    base = tmp_path / "s.npz"
    np.savez(base, w=np.zeros(2))
    assert main(["delta", "send", "--to", "nowhere", str(base), str(base)]) == 2
    assert "error: invalid DWE endpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "content"),
    [("bad.npz", b"PK\x03\x04 not a zip"), ("bad.safetensors", b"\x10" + bytes(7) + b"{}")],
)
def test_damaged_state_file_is_a_clean_error(tmp_path: Path, capsys, name, content) -> None:
    good, bad = tmp_path / "good.npz", tmp_path / name
    np.savez(good, w=np.zeros(2))
    bad.write_bytes(content)
    assert main(["delta", "send", "--to", "127.0.0.1:1", str(bad), str(good)]) == 2
    err = capsys.readouterr().err
    assert "not a readable" in err and name in err and len(err.splitlines()) == 1


def test_unreachable_peer_reports_what_was_not_sent(tmp_path: Path, capsys) -> None:
    base = tmp_path / "s.npz"
    np.savez(base, w=np.zeros(2))
    argv = ["delta", "send", "--to", "127.0.0.1:1", str(base), str(base), "--timeout", "2"]
    assert main(argv) == 2
    assert "sent 0 of 1 fragments" in capsys.readouterr().err


async def test_listen_prints_each_verdict() -> None:
    script = "import sys; from tensorswap.cli import main; sys.exit(main())"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        "delta",
        "listen",
        "127.0.0.1:0",
        "--count",
        "2",
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(60):
            line = (await proc.stderr.readline()).decode()
            assert line.startswith("listening on "), line
            endpoint = line.split()[-1]
            good = extract_delta_fragment("cli", 1, [np.ones(3)], [np.zeros(3)])
            async with DweBus([endpoint]) as bus:
                bus.broadcast(good)
                await bus.flush()
            _, writer = await asyncio.open_connection(*endpoint.rsplit(":", 1))
            bad = encode_frame(good)
            bad[-2] ^= 1  # a wrong state hash
            writer.write(bad)
            await writer.drain()
            out, err = await proc.communicate()
            writer.close()
            await writer.wait_closed()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    first, second = (json.loads(x) for x in out.decode().splitlines())
    assert first["verdict"] == "accepted" and first["session_id"] == "cli"
    assert second["verdict"] == "rejected" and second["reason"] == "state_hash"


def test_group_help_lists_both_commands(capsys) -> None:
    assert main(["delta", "--help"]) == 0
    text = capsys.readouterr().out
    assert "listen" in text and "send" in text
