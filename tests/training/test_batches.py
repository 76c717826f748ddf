"""The batch helpers fit and the Lightning integration share."""

from __future__ import annotations

import pytest
import torch

import secondorder as so
from secondorder.training.data import batch_size, batches, is_single_batch, split_batch


def test_split_batch_shapes():
    x, y = torch.zeros(4, 2), torch.ones(4)
    assert split_batch(x, "batch") == (x, None)
    assert split_batch((x,), "batch") == (x, None)
    assert split_batch([x, y], "batch") == (x, y)
    with pytest.raises(
        TypeError, match=r"batch must be \(inputs, targets\) .* got dict of length 0"
    ):
        split_batch({}, "batch")


def test_single_batch_and_epochs():
    x, y = torch.zeros(4, 2), torch.ones(4)
    assert is_single_batch((x, y)) and is_single_batch((x, None))
    assert not is_single_batch([(x, y)]) and not is_single_batch((x, y, y))
    each = batches((x, y), "data")
    assert [list(each()) for _ in range(2)] == [[(x, y)], [(x, y)]]
    listed = batches([(x, y), [x, None]], "data")
    assert list(listed()) == [(x, y), (x, None)] == list(listed())
    once = batches(iter([(x, y)]), "data")
    assert list(once()) == [(x, y)]
    with pytest.raises(ValueError, match="data is a one-shot iterator and was used up"):
        once()


class DictModel(torch.nn.Module):
    """A model called with a dict of tensors, as Hugging Face-style models are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(3, 1).double()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.linear(batch["x"] * batch["scale"])


def dict_data() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, generator=g, dtype=torch.float64)
    scale = torch.rand(16, 1, generator=g, dtype=torch.float64) + 0.5
    return {"x": x, "scale": scale}, torch.randn(16, 1, generator=g, dtype=torch.float64)


def test_dict_inputs_are_one_batch_of_the_dicts_length():
    inputs, y = dict_data()
    assert is_single_batch((inputs, y))
    assert split_batch((inputs, y), "batch") == (inputs, y)
    assert batch_size(inputs, None) == 16


def test_fit_trains_a_dict_input_model_as_the_hand_loop_does():
    inputs, y = dict_data()
    loss_fn = torch.nn.functional.mse_loss
    by_hand, fitted = DictModel(), DictModel()
    opt = torch.optim.SGD(by_hand.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(by_hand(inputs), y).backward()
        opt.step()
    opt = torch.optim.SGD(fitted.parameters(), lr=0.1)
    so.fit(opt, [(inputs, y)], epochs=3, model=fitted, loss_fn=loss_fn, progress=False)
    for a, b in zip(by_hand.parameters(), fitted.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fit_trains_lm_on_dict_inputs_as_its_step_does():
    inputs, y = dict_data()
    stepped, fitted = DictModel(), DictModel()
    opt = so.LevenbergMarquardt(stepped)
    for _ in range(3):
        opt.step(inputs, y)
    so.fit(so.LevenbergMarquardt(fitted), (inputs, y), epochs=3, progress=False)
    for a, b in zip(stepped.parameters(), fitted.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_batch_of_three_items_is_refused_naming_what_to_do():
    x, y, w = torch.zeros(4, 2), torch.ones(4), torch.ones(4)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.nn.functional.mse_loss
    expected = r"has 3 items; fit takes \(inputs, targets\)\. Pass further per-sample tensors"
    with pytest.raises(TypeError, match=rf"data {expected}"):
        so.fit(opt, (x, y, w), epochs=1, model=model, loss_fn=loss_fn, progress=False)
    with pytest.raises(TypeError, match=rf"each batch of data {expected}"):
        so.fit(opt, [[x, y, w]], epochs=1, model=model, loss_fn=loss_fn, progress=False)
    with pytest.raises(TypeError, match=rf"data {expected}"):
        so.fit(so.LevenbergMarquardt(model), (x, y, w), epochs=1, progress=False)
