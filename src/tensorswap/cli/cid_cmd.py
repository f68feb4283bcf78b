"""`tensorswap cid`: the raw-codec CIDv1 of a file's bytes."""

from __future__ import annotations

import click

from tensorswap.cid import Cid, HashFunction, Multicodec
from tensorswap.cli._util import mapped


@click.command("cid")
@click.option(
    "--hash",
    "hash_name",
    type=click.Choice(["blake3", "sha2-256"]),
    default="blake3",
    show_default=True,
    help="Multihash function. sha2-256 gives the CID IPFS would give a raw block.",
)
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=False))
def cid(hash_name: str, file: str) -> None:
    """Print the raw-codec CIDv1 (base32) of FILE's bytes.

    The file is memory-mapped and hashed in place, so large files cost no extra memory.
    """
    with mapped(file) as data:
        click.echo(str(Cid.of(data, codec=Multicodec.RAW, hash=HashFunction.parse(hash_name))))
