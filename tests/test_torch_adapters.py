"""PyTorch adapters: views of state, checked loading, deltas, gradients."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorswap.errors import ShapeMismatch  # noqa: E402
from tensorswap.torch import (  # noqa: E402
    TensorNamesMismatch,
    delta_of,
    gradients_of,
    load_tensors,
    tensors_of,
)


def model() -> object:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_tensors_of_shares_memory_with_the_module() -> None:
    m = model()
    tensors = tensors_of(m)
    assert list(tensors) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    with torch.no_grad():
        m[0].weight.fill_(7.0)
    assert (tensors["0.weight"] == 7.0).all()


def test_load_tensors_round_trip() -> None:
    a, b = model(), model()
    new = {k: v + 1 for k, v in tensors_of(a).items()}
    load_tensors(b, new)
    for name, values in tensors_of(b).items():
        np.testing.assert_array_equal(values, new[name])


def test_load_tensors_checks_everything_before_writing() -> None:
    m = model()
    before = {k: v.copy() for k, v in tensors_of(m).items()}
    bad = {k: v + 1 for k, v in before.items()}
    bad["2.bias"] = np.zeros(5, np.float32)
    with pytest.raises(ShapeMismatch, match=r"2\.bias"):
        load_tensors(m, bad)
    for name, values in tensors_of(m).items():
        np.testing.assert_array_equal(values, before[name])


def test_load_tensors_names_missing_and_unexpected() -> None:
    m = model()
    tensors = tensors_of(m)
    tensors.pop("0.bias")
    tensors["extra"] = np.zeros(1, np.float32)
    with pytest.raises(TensorNamesMismatch) as info:
        load_tensors(m, tensors)
    assert info.value.missing == ["0.bias"] and info.value.unexpected == ["extra"]


def test_delta_and_gradients() -> None:
    m = model()
    base = {k: v.copy() for k, v in tensors_of(m).items()}
    loss = m(torch.ones(1, 4)).sum()
    loss.backward()
    grads = gradients_of(m)
    assert set(grads) == set(base)
    with torch.no_grad():
        for p in m.parameters():
            p -= 0.5 * p.grad
    delta = delta_of(tensors_of(m), base)
    for name in base:
        assert delta[name].dtype == np.float32
        np.testing.assert_allclose(delta[name], -0.5 * grads[name], rtol=1e-5, atol=1e-6)


def test_bfloat16_state_stays_16_bit() -> None:
    m = model().to(torch.bfloat16)
    tensors = tensors_of(m)
    assert str(tensors["0.weight"].dtype) == "bfloat16"


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float32])
def test_load_tensors_takes_bfloat16_values(target: object) -> None:
    source = model().to(torch.bfloat16)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    m = model().to(target)
    load_tensors(m, tensors_of(source))
    wants = source.state_dict()
    for name, got in m.state_dict().items():
        want = wants[name]
        assert got.dtype == target, name
        assert torch.equal(got, want.to(target)), name


def test_load_tensors_takes_read_only_arrays() -> None:
    a, b = model(), model()
    new = {k: v + 1 for k, v in tensors_of(a).items()}
    for values in new.values():
        values.flags.writeable = False
    load_tensors(b, new)
    for name, values in tensors_of(b).items():
        np.testing.assert_array_equal(values, new[name])


def test_load_tensors_takes_views_with_negative_strides() -> None:
    m = torch.nn.Linear(5, 1, bias=False)
    load_tensors(m, {"weight": np.arange(5, dtype=np.float32)[::-1].reshape(1, 5)})
    assert m.weight.tolist() == [[4.0, 3.0, 2.0, 1.0, 0.0]]
