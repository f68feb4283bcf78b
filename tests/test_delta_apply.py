"""apply_fragment: range and shape checks, all layers or none, numpy and torch states."""

from __future__ import annotations

import numpy as np
import pytest

from tensorswap.delta import (
    SLICE_SCHEMA,
    ApplyError,
    DweLayerDelta,
    LayerLayoutError,
    LayerOutOfRange,
    StateMismatch,
    apply_fragment,
    extract_delta_fragment,
    make_fragment,
)


def _states() -> list[np.ndarray]:
    return [np.zeros((2, 2), np.float32), np.zeros(3, np.float32), np.zeros(1, np.float64)]


def _layer(index: int, shape: tuple[int, ...], fill: float = 1.0) -> DweLayerDelta:
    return DweLayerDelta(index, shape, np.full(int(np.prod(shape)), fill, np.float32))


def test_applies_every_layer_in_place() -> None:
    states = _states()
    fragment = make_fragment("s", 1, [_layer(0, (2, 2)), _layer(2, (1,), 0.5)])
    assert apply_fragment(states, fragment) == 2
    assert states[0].tolist() == [[1, 1], [1, 1]]
    assert states[1].tolist() == [0, 0, 0]
    assert states[2].tolist() == [0.5]


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (_layer(3, (1,)), LayerOutOfRange),
        (_layer(1, (2, 2)), StateMismatch),  # 4 values, state has shape (3,)
        (DweLayerDelta(1, (3,), np.ones(2, np.float32)), LayerLayoutError),
    ],
)
def test_a_bad_layer_in_the_middle_changes_nothing(bad, error) -> None:
    states = _states()
    before = [s.copy() for s in states]
    fragment = make_fragment("s", 1, [_layer(0, (2, 2)), bad, _layer(2, (1,))])
    with pytest.raises(error):
        apply_fragment(states, fragment)
    for state, original in zip(states, before, strict=True):
        assert np.array_equal(state, original)


def test_dict_states_by_position() -> None:
    states = {"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32)}
    apply_fragment(states, make_fragment("s", 1, [_layer(1, (1,), 2.0)]))
    assert states["b"].tolist() == [2.0] and states["w"].tolist() == [0.0, 0.0]


def test_read_only_and_integer_states_refused() -> None:
    frozen = np.zeros(2, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(StateMismatch, match="read-only"):
        apply_fragment([frozen], make_fragment("s", 1, [_layer(0, (2,))]))
    with pytest.raises(StateMismatch, match="floating"):
        apply_fragment([np.zeros(2, np.int32)], make_fragment("s", 1, [_layer(0, (2,))]))
    with pytest.raises(ApplyError, match="schema"):
        apply_fragment([np.zeros(2)], make_fragment("s", 1, [_layer(0, (2,))], schema="x"))


def test_slices_land_on_their_flat_range() -> None:
    state = np.zeros((2, 3), np.float32)
    piece = DweLayerDelta(0, (2, 3, 2), np.array([1, 2, 3], np.float32))
    apply_fragment([state], make_fragment("s", 1, [piece], schema=SLICE_SCHEMA))
    assert state.tolist() == [[0, 0, 1], [2, 3, 0]]
    with pytest.raises(StateMismatch, match="contiguous"):
        apply_fragment(
            [np.zeros((3, 2), np.float32).T], make_fragment("s", 1, [piece], schema=SLICE_SCHEMA)
        )


def test_a_delta_that_would_overflow_a_half_precision_state_is_refused() -> None:
    """Both the delta and the state are finite, but their float16 sum is not: applying it
    would poison the receiver, so nothing is applied."""
    first = np.zeros(2, np.float32)
    state = np.array([60000, 1], np.float16)
    fragment = make_fragment("s", 1, [_layer(0, (2,)), _layer(1, (2,), 60000.0)])
    with pytest.raises(StateMismatch, match="overflow the state's float16"):
        apply_fragment([first, state], fragment)
    assert not first.any() and state.tolist() == [60000, 1]
    apply_fragment([state], make_fragment("s", 2, [_layer(0, (2,), 5000.0)]))  # fits: applied
    assert state.tolist() == [64992, 5000]  # 65000 rounded to float16


def test_a_state_already_holding_inf_still_takes_deltas() -> None:
    state = np.array([np.inf, 1], np.float16)
    apply_fragment([state], make_fragment("s", 1, [_layer(0, (2,), 60000.0)]))
    assert np.isinf(state[0]) and state[1] == 60000


def test_torch_overflow_is_refused_too() -> None:
    torch = pytest.importorskip("torch")
    state = torch.tensor([60000.0, 0.0], dtype=torch.float16)
    with pytest.raises(StateMismatch, match="overflow"):
        apply_fragment([state], make_fragment("s", 1, [_layer(0, (2,), 60000.0)]))
    assert state.tolist() == [60000.0, 0.0]


def test_torch_states_including_leaves_that_require_grad() -> None:
    torch = pytest.importorskip("torch")
    weights = torch.zeros(2, 2, requires_grad=True)
    half = torch.zeros(3, dtype=torch.float16)
    fragment = extract_delta_fragment(
        "s", 1, [np.ones((2, 2)), np.full(3, 0.5)], [np.zeros((2, 2)), np.zeros(3)]
    )
    apply_fragment([weights, half], fragment)
    assert weights.detach().tolist() == [[1, 1], [1, 1]]
    assert half.tolist() == [0.5, 0.5, 0.5]
    with pytest.raises(StateMismatch, match="shape"):
        apply_fragment([torch.zeros(4), half], fragment)
    assert half.tolist() == [0.5, 0.5, 0.5]


def test_torch_tensor_subclasses_are_states_and_inputs() -> None:
    torch = pytest.importorskip("torch")

    class Tagged(torch.Tensor):  # defined outside torch: still a tensor
        pass

    base = torch.zeros(2, 2).as_subclass(Tagged)
    adapted = torch.ones(2, 2).as_subclass(Tagged)
    fragment = extract_delta_fragment("s", 1, [adapted], [base])
    state = torch.zeros(2, 2).as_subclass(Tagged)
    assert apply_fragment([state], fragment) == 1
    assert state.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_a_numpy_state_with_overlapping_memory_is_refused_before_any_change() -> None:
    first = np.zeros(3, np.float32)
    shared = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (4,), (0,), writeable=True)
    fragment = make_fragment("s", 1, [_layer(0, (3,)), _layer(1, (4,))])
    with pytest.raises(StateMismatch, match="overlapping memory"):
        apply_fragment([first, shared], fragment)
    assert not first.any()


@pytest.mark.parametrize("kind", ["inference", "expanded"])
def test_torch_states_that_cannot_take_an_in_place_add_are_refused_before_any_change(
    kind: str,
) -> None:
    torch = pytest.importorskip("torch")
    first = torch.zeros(3)
    if kind == "inference":
        with torch.inference_mode():
            second = torch.zeros(4)
    else:
        second = torch.zeros(1).expand(4)
    fragment = make_fragment("s", 1, [_layer(0, (3,)), _layer(1, (4,))])
    with pytest.raises(StateMismatch):
        apply_fragment([first, second], fragment)
    assert not first.any()
    if kind == "inference":  # inside inference mode the same state takes the delta
        with torch.inference_mode():
            apply_fragment([first, second], fragment)
        assert second.tolist() == [1.0] * 4


def test_a_torch_state_dict_with_integer_buffers_round_trips() -> None:
    """extract leaves integer buffers (num_batches_tracked) out, so the fragment applies to
    the same state_dict, which refuses to add to integer states."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    baseline = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model(torch.randn(4, 3)).sum().backward()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5)
    optimized = model.state_dict()
    assert optimized["1.num_batches_tracked"] != baseline["1.num_batches_tracked"]
    fragment = extract_delta_fragment("s", 1, optimized, baseline)
    names = list(optimized)
    assert all(
        not names[layer.layer_index].endswith("num_batches_tracked") for layer in fragment.layers
    )
    receiver = {k: v.clone() for k, v in baseline.items()}
    apply_fragment(receiver, fragment)
    for name, value in optimized.items():
        if value.is_floating_point():
            assert torch.allclose(receiver[name], value), name
