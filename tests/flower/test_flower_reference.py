"""The thinnest slice: an ArrayRecord turned into a reference, its arrays pushed to a block
service on 127.0.0.1:0, resolved back to equal arrays; references checked before any fetch."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402

from tensorswap.flower import (  # noqa: E402
    ArrayRef,
    BadReference,
    BlockLink,
    BlockService,
    ReferenceMismatch,
)
from tensorswap.flower.records import StoredArray, swap_in, swap_out  # noqa: E402


@pytest.fixture
def service() -> Iterator[BlockService]:
    with BlockService() as running:
        yield running


def record_of_numpy(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(values) for name, values in arrays.items()})


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((256, 300)).astype(np.float32),
        "b": rng.standard_normal(300).astype(np.float64),
        "steps": np.arange(7, dtype=np.int64),
    }


def test_an_array_record_goes_by_reference_and_comes_back_equal(service: BlockService) -> None:
    arrays = model()
    content = RecordDict({"arrays": record_of_numpy(arrays), "metrics": MetricRecord({"n": 3})})
    with BlockLink(service.address) as sender, BlockLink(service.address) as receiver:
        sent = swap_out(content, sender.push)
        ref = sent["arrays"]
        assert isinstance(ref, ConfigRecord)
        assert sent["metrics"] is content["metrics"]
        carried = ref.count_bytes()
        assert carried < 0.01 * sum(a.nbytes for a in arrays.values())
        back = swap_in(sent, lambda r: receiver.fetch(r.root))
    record = back["arrays"]
    assert isinstance(record, ArrayRecord) and list(record) == ["w", "b", "steps"]
    for name, values in arrays.items():
        got = record[name].numpy()
        assert isinstance(record[name], StoredArray)
        assert got.dtype == values.dtype and got.flags.writeable
        np.testing.assert_array_equal(got, values)
    # Flower's own serialization of the resolved record still works (an inline send).
    np.testing.assert_array_equal(ArrayRecord(record.to_numpy_ndarrays())["0"].numpy(), arrays["w"])
    assert record["b"].data == Array(arrays["b"]).data


def test_a_reference_that_lies_about_shapes_is_refused(service: BlockService) -> None:
    arrays = model()
    with BlockLink(service.address) as link:
        root = link.push(arrays)
        lie = ArrayRef(root, ("w", "b", "steps"), ((300, 256), (300,), (7,)), ("float32",) * 3)
        with pytest.raises(ReferenceMismatch):
            lie.check(link.fetch(root))


@pytest.mark.parametrize(
    "change",
    [
        {"root": "not-a-cid"},
        {"names": ["a"] * 70_000},
        {"shapes": ["1,2,x", "3", "7"]},
        {"shapes": [",".join(["1"] * 40), "3", "7"]},
        {"dtypes": ["object", "float32", "int64"]},
        {"names": ["w", "w", "b"]},
        {"extra": 1},
    ],
)
def test_a_malformed_reference_is_refused_before_any_fetch(change: dict[str, object]) -> None:
    from tensorswap.cid import Cid, Multicodec

    root = Cid.of(b"x", codec=Multicodec.TENSORSWAP_MANIFEST)
    fields = ArrayRef.of(root, model()).fields() | change
    with pytest.raises(BadReference):
        ArrayRef.parse("arrays", fields)
