"""DType registry, numpy/torch input conversion and the TensorBlock model."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pyarrow as pa
import pytest

import tensorswap.codec as codec
from tensorswap.codec import DType, TensorBlock, as_numpy, is_torch_tensor, to_torch
from tensorswap.codec import lossy as codec_lossy
from tensorswap.errors import UnsupportedDtype


@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch")


def test_public_names_import() -> None:
    for name in codec.__all__:
        assert hasattr(codec, name), name
    assert codec.__all__ == sorted(codec.__all__)


@pytest.mark.parametrize(
    ("dtype", "numpy_dtype", "arrow_type"),
    [
        (DType.FLOAT32, np.float32, pa.float32()),
        (DType.FLOAT16, np.float16, pa.float16()),
        (DType.BFLOAT16, ml_dtypes.bfloat16, pa.uint16()),
        (DType.FLOAT64, np.float64, pa.float64()),
        (DType.INT8, np.int8, pa.int8()),
        (DType.UINT8, np.uint8, pa.uint8()),
        (DType.INT32, np.int32, pa.int32()),
        (DType.INT64, np.int64, pa.int64()),
    ],
)
def test_dtype_registry(dtype: DType, numpy_dtype: Any, arrow_type: pa.DataType) -> None:
    assert DType.of(numpy_dtype) is dtype
    assert DType.parse(dtype.value) is dtype
    assert dtype.numpy == np.dtype(numpy_dtype)
    assert dtype.arrow == arrow_type
    assert dtype.itemsize == np.dtype(numpy_dtype).itemsize


def test_bfloat16_is_16_bit() -> None:
    assert DType.BFLOAT16.itemsize == 2
    assert DType.BFLOAT16.is_float


@pytest.mark.parametrize("bad", [np.bool_, np.int16, np.uint32, np.complex64, "U3", object])
def test_other_numpy_dtypes_are_unsupported(bad: Any) -> None:
    with pytest.raises(UnsupportedDtype):
        DType.of(bad)


def test_unknown_dtype_name_is_unsupported() -> None:
    with pytest.raises(UnsupportedDtype, match="float8"):
        DType.parse("float8")


def test_as_numpy_keeps_numpy_arrays() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert as_numpy(a) is a


def test_as_numpy_converts_big_endian() -> None:
    a = np.arange(4, dtype=">i4")
    out = as_numpy(a)
    assert out.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(out, [0, 1, 2, 3])


def test_as_numpy_refuses_unsupported_input() -> None:
    with pytest.raises(UnsupportedDtype):
        as_numpy(np.array([True, False]))
    with pytest.raises(UnsupportedDtype):
        as_numpy(["a", "b"])


def test_as_numpy_shares_a_cpu_tensor(torch: Any) -> None:
    t = torch.arange(6, dtype=torch.float32)
    a = as_numpy(t)
    t[0] = 42.0
    assert a[0] == 42.0


def test_as_numpy_of_bfloat16_tensor_keeps_bits(torch: Any) -> None:
    t = torch.tensor([1.0, -2.5, 3.0e38], dtype=torch.bfloat16)
    a = as_numpy(t)
    assert a.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(a.view(np.int16), t.view(torch.int16).numpy())


def test_as_numpy_detaches_requires_grad(torch: Any) -> None:
    t = torch.ones(3, requires_grad=True) * 2
    assert as_numpy(t).tolist() == [2.0, 2.0, 2.0]


def test_as_numpy_of_non_contiguous_tensor(torch: Any) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).T
    block = TensorBlock("t", t)
    assert block.shape == (4, 3)
    np.testing.assert_array_equal(block.flat(), t.contiguous().reshape(-1).numpy())


def test_unsupported_tensor_dtype(torch: Any) -> None:
    with pytest.raises(UnsupportedDtype, match="int16"):
        as_numpy(torch.zeros(2, dtype=torch.int16))


def test_is_torch_tensor(torch: Any) -> None:
    assert is_torch_tensor(torch.zeros(1))
    assert not is_torch_tensor(np.zeros(1))


def test_is_torch_tensor_takes_subclasses_defined_outside_torch(torch: Any) -> None:
    class Tagged(torch.Tensor):  # type(...).__module__ is this test module, not torch
        pass

    tagged = torch.zeros(2).as_subclass(Tagged)
    assert is_torch_tensor(tagged)
    assert is_torch_tensor(torch.nn.Parameter(torch.zeros(1)))
    assert as_numpy(tagged).tolist() == [0.0, 0.0]

    class Lookalike:  # a module name starting with "torch" and a detach() are not enough
        __module__ = "torchlike"

        def detach(self) -> None:
            return None

    assert not is_torch_tensor(Lookalike())


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int64])
def test_to_torch_shares_writable_memory(torch: Any, dtype: Any) -> None:
    a = np.arange(4).astype(dtype)
    t = to_torch(a)
    a[0] = 9
    assert float(t[0]) == 9.0
    assert (
        str(t.dtype)
        == {
            np.dtype(np.float32): "torch.float32",
            np.dtype(np.float16): "torch.float16",
            np.dtype(ml_dtypes.bfloat16): "torch.bfloat16",
            np.dtype(np.int64): "torch.int64",
        }[np.dtype(dtype)]
    )


def test_to_torch_copies_read_only_memory(torch: Any) -> None:
    a = np.frombuffer(np.arange(4, dtype=np.float32).tobytes(), dtype=np.float32)
    t = to_torch(a)
    t[0] = 5.0
    assert a[0] == 0.0


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_to_torch_of_negative_strides(torch: Any, dtype: Any) -> None:
    a = np.arange(6).astype(dtype).reshape(2, 3)[::-1, ::-2]
    t = to_torch(a)
    assert t.shape == (2, 2)
    assert t.float().tolist() == a.astype(np.float32).tolist()


def test_to_torch_of_big_endian(torch: Any) -> None:
    assert to_torch(np.arange(3, dtype=">f8")).tolist() == [0.0, 1.0, 2.0]


def test_f16_cast_with_and_without_torch_agree(torch: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 100
    with_torch = codec_lossy.cast(x, np.dtype(np.float16))
    monkeypatch.setattr(codec_lossy, "_torch", lambda: None)
    without = codec_lossy.cast(x, np.dtype(np.float16))
    np.testing.assert_array_equal(with_torch.view(np.uint16), without.view(np.uint16))


# ── TensorBlock ──────────────────────────────────────────────────────────────
def test_block_holds_values_without_copy() -> None:
    a = np.zeros((2, 2), np.float32)
    assert TensorBlock("a", a).values is a


def test_block_properties() -> None:
    block = TensorBlock("w", np.zeros((2, 3), np.float16), 7, {"k": "v"})
    assert (block.dtype, block.shape, block.size, block.nbytes) == (DType.FLOAT16, (2, 3), 6, 12)
    assert TensorBlock("s", np.float32(1)).size == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": 3}, TypeError),
        ({"num_samples": -1}, ValueError),
        ({"num_samples": 2**64}, ValueError),
        ({"num_samples": 1.5}, TypeError),
        ({"num_samples": True}, TypeError),
        ({"metadata": {"a": 1}}, TypeError),
    ],
)
def test_block_validation(kwargs: dict[str, Any], error: type[Exception]) -> None:
    args: dict[str, Any] = {"name": "x", "values": np.zeros(1, np.float32)}
    args.update(kwargs)
    with pytest.raises(error):
        TensorBlock(**args)


def test_block_metadata_is_read_only() -> None:
    block = TensorBlock("m", np.zeros(1, np.float32), metadata={"a": "b"})
    with pytest.raises(TypeError):
        block.metadata["a"] = "c"  # type: ignore[index]


def test_block_equality_is_bitwise() -> None:
    nan1 = np.array([0x7FC00001], np.uint32).view(np.float32)
    nan2 = np.array([0x7FC00002], np.uint32).view(np.float32)
    assert TensorBlock("n", nan1) == TensorBlock("n", nan1.copy())
    assert TensorBlock("n", nan1) != TensorBlock("n", nan2)
    assert TensorBlock("z", np.array([0.0], np.float32)) != TensorBlock(
        "z", np.array([-0.0], np.float32)
    )
    assert TensorBlock("d", np.zeros(2, np.float32)) != TensorBlock("d", np.zeros(2, np.int32))
    assert TensorBlock("s", np.zeros(4, np.float32)) != TensorBlock(
        "s", np.zeros((2, 2), np.float32)
    )


def test_block_with_values_keeps_the_rest() -> None:
    block = TensorBlock("w", np.zeros(2, np.float32), 5, {"a": "b"})
    other = block.with_values(np.ones(3, np.int8))
    assert (other.name, other.num_samples, dict(other.metadata)) == ("w", 5, {"a": "b"})
    assert other.dtype is DType.INT8


def test_as_numpy_resolves_lazily_negated_torch_views() -> None:
    torch = pytest.importorskip("torch")
    # the imaginary part of a conjugate: a view with the negative bit set, not negated values
    zeros, values = torch.zeros(4), torch.arange(4, dtype=torch.float32)
    view = torch.complex(zeros, values).conj().imag
    assert view.is_neg()
    np.testing.assert_array_equal(as_numpy(view), -np.arange(4, dtype=np.float32))
    plain = torch.arange(4, dtype=torch.float32)
    assert np.shares_memory(as_numpy(plain), plain.numpy())  # no copy without the bit


def test_ml_dtypes_is_imported_only_for_bfloat16() -> None:
    """Importing ml_dtypes costs most of a second of CPU (its ufunc loops are registered one
    by one): a process that never meets bfloat16 never pays it, and one that does gets it
    on first use, from a name, a DType or the bytes of a stored tensor."""
    code = (
        "import sys\n"
        "import tensorswap, tensorswap.cli, tensorswap.rounds, tensorswap.runs\n"
        "assert 'ml_dtypes' not in sys.modules, 'imported at start'\n"
        "from tensorswap import MemoryStore, ModelUpdate, get_update, put_update\n"
        "from tensorswap.codec import DType\n"
        "import numpy as np\n"
        "assert DType.of('bfloat16') is DType.BFLOAT16\n"
        "bits = np.arange(6, dtype=np.uint16).view(DType.BFLOAT16.numpy)\n"
        "store = MemoryStore()\n"
        "back = get_update(store, put_update(store, ModelUpdate({'x': bits}))).tensors['x']\n"
        "assert back.dtype == DType.BFLOAT16.numpy and back.tobytes() == bits.tobytes()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
