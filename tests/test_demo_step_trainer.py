"""The demo task's step-based trainer (DiLoCo's inner loop)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tensorswap.demo.task import StepTrainer, evaluate, load_dataset, make_model


def test_step_trainer_learns_and_is_deterministic() -> None:
    data = load_dataset(2, seed=0)
    accs = []
    for _ in range(2):
        model = make_model(seed=0)
        trainer = StepTrainer(model, data.shards[0], seed=0)
        trainer.run(30)
        trainer.run(30)  # state carries across calls, past the end of an epoch
        accs.append(evaluate(model, data.test_x, data.test_y))
    assert accs[0] == accs[1]
    assert accs[0] > 0.3


def test_step_trainer_zero_steps() -> None:
    data = load_dataset(2, seed=0)
    assert StepTrainer(make_model(), data.shards[1]).run(0) == 0.0
