"""The accepted trial's forward pass, kept for the next linearisation (ForwardCarry).

On a batch seen again, a step evaluates the model once per attempt instead of once
more for its linearisation.  Every result must be bitwise the one without the kept
pass: the reference is the same network built as a subclass of ``nn.Sequential``,
which :func:`~secondorder.lm.carry.model_state` does not vouch for, so it never keeps
a pass and computes exactly what the optimizer computed before.  Between steps, each
thing the pass depends on is changed in both runs alike; the kept pass must then be
dropped (the step evaluates the model again) and the step must equal the reference's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from unchanged import same_state, state_of

import secondorder as so
from secondorder.lm.carry import _backend_flags, model_state


class _Reference(nn.Sequential):
    """Computes what nn.Sequential computes; not a plain module, so nothing is kept."""


class LinearCalls(TorchFunctionMode):
    """Counts ``F.linear`` calls: one per nn.Linear layer per forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if getattr(func, "__name__", "") == "linear":
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _net(cls: type[nn.Sequential], sizes: list[int], act: Callable[[], nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(act())
    return cls(*layers)


def _sinc() -> tuple[Tensor, Tensor]:
    x = torch.linspace(-1.0, 1.0, 300).unsqueeze(1)
    return x, torch.sinc(10.0 * x)


def _classes() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(24, 16, generator=gen), torch.randint(0, 10, (24,), generator=gen)


CASES: dict[str, tuple[list[int], Callable[[], tuple[Tensor, Tensor]], Any]] = {
    "primal": ([1, 16, 1], _sinc, so.residuals.mse),
    "dual": ([16, 32, 10], _classes, so.residuals.cross_entropy),
}


#: One counter for every step: the active torch function modes are part of what a
#: kept pass depends on, so a new mode object per step would drop every kept pass.
COUNTER = LinearCalls()


def _passes(opt: so.LevenbergMarquardt, x: Any, y: Any, layers: int) -> tuple[float, int, int]:
    """One step: its loss, its attempts and the forward passes it made."""
    COUNTER.calls = 0
    with COUNTER:
        info = opt.step(x, y)
    return info.loss, info.attempts, COUNTER.calls // layers


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _pair(
    residual: Any = so.residuals.mse, warm: int = 4
) -> tuple[nn.Module, nn.Module, list[so.LevenbergMarquardt], Tensor, Tensor]:
    """The network whose passes may be kept and its reference, after ``warm`` steps each."""
    x, y = _sinc()
    kept = _net(nn.Sequential, [1, 16, 1], nn.Tanh)
    plain = _net(_Reference, [1, 16, 1], nn.Tanh)
    opts = [so.LevenbergMarquardt(m, residual) for m in (kept, plain)]
    for _ in range(warm):
        for opt in opts:
            _passes(opt, x, y, 2)
    return kept, plain, opts, x, y


@pytest.mark.parametrize("case", list(CASES))
def test_a_repeated_batch_is_evaluated_once_per_attempt(case: str) -> None:
    sizes, data, residual = CASES[case]
    x, y = data()
    layers = len(sizes) - 1
    kept = _net(nn.Sequential, sizes, nn.Tanh)
    plain = _net(_Reference, sizes, nn.Tanh)
    opt_kept = so.LevenbergMarquardt(kept, residual)
    opt_plain = so.LevenbergMarquardt(plain, residual)
    carried = 0
    for step in range(8):
        loss_k, attempts_k, passes_k = _passes(opt_kept, x, y, layers)
        loss_p, attempts_p, passes_p = _passes(opt_plain, x, y, layers)
        assert (loss_k, attempts_k) == (loss_p, attempts_p)
        assert _same(kept, plain), f"step {step}"
        if step >= 2:
            # Its linearisation and one pass per attempt, against the attempts alone.
            assert passes_p == attempts_p + 1
            assert passes_k in (attempts_k, attempts_k + 1)
            carried += passes_k == attempts_k
    assert carried >= 4  # the steps after an accepted one


def _change_inputs_in_place(run: dict[str, Any], first: bool) -> None:
    run["x"].mul_(0.9)


def _new_inputs_same_values(run: dict[str, Any], first: bool) -> None:
    run["x"] = run["x"].clone()


def _write_through_data(run: dict[str, Any], first: bool) -> None:
    run["model"][0].weight.data[0, 0] += 0.01  # moves no version counter


def _write_through_numpy(run: dict[str, Any], first: bool) -> None:
    run["array"] *= 0.9  # the inputs share this memory; their version stays


def _move_a_parameter(run: dict[str, Any], first: bool) -> None:
    with torch.no_grad():
        run["model"][0].weight[0, 0] += 0.01


def _load_a_state_dict(run: dict[str, Any], first: bool) -> None:
    state = {k: v * 1.01 for k, v in run["model"].state_dict().items()}
    run["model"].load_state_dict(state)


def _change_a_setting(run: dict[str, Any], first: bool) -> None:
    run["model"][1].negative_slope = 0.3


def _swap_a_module(run: dict[str, Any], first: bool) -> None:
    run["model"][1] = nn.Tanh()


def _add_a_hook(run: dict[str, Any], first: bool) -> None:
    run["model"][1].register_forward_hook(lambda m, a, out: out * 2.0)


def _add_a_global_hook(run: dict[str, Any], first: bool) -> None:
    if first:  # one hook, seen by both runs
        run["handles"].append(
            nn.modules.module.register_module_forward_hook(
                lambda m, a, out: out * 1.5 if isinstance(m, nn.LeakyReLU) else out
            )
        )


def _eval_mode(run: dict[str, Any], first: bool) -> None:
    run["model"].eval()


def _resize_through_data(run: dict[str, Any], first: bool) -> None:
    run["x"].data = torch.linspace(-0.5, 0.5, 200).unsqueeze(1)  # same version
    run["y"] = torch.sinc(10.0 * run["x"])


def _backend_flag(run: dict[str, Any], first: bool) -> None:
    if first:  # a global switch, seen by both runs (restored by the test)
        torch.backends.mkldnn.enabled = not torch.backends.mkldnn.enabled


def _precision_switch(run: dict[str, Any], first: bool) -> None:
    # torch's newer precision API (2.9 on): float32 matmuls in bfloat16 from here on.
    # With it set, torch refuses to report the legacy matmul precision at all.
    if first:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"


CHANGES: dict[str, Callable[[dict[str, Any], bool], None]] = {
    "inputs changed in place": _change_inputs_in_place,
    "new input tensors, same values": _new_inputs_same_values,
    "a parameter moved": _move_a_parameter,
    "a parameter written through .data": _write_through_data,
    "inputs written through NumPy": _write_through_numpy,
    "load_state_dict": _load_a_state_dict,
    "an activation's setting": _change_a_setting,
    "a module swapped": _swap_a_module,
    "a forward hook": _add_a_hook,
    "a global forward hook": _add_a_global_hook,
    "eval mode": _eval_mode,
    "inputs resized through .data": _resize_through_data,
    "a backend flag": _backend_flag,
    "a newer precision switch": _precision_switch,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_between_steps_drops_the_kept_pass(change: str) -> None:
    x, y = _sinc()
    mkldnn = torch.backends.mkldnn.enabled
    precision = torch.backends.mkldnn.matmul.fp32_precision
    runs = []
    for cls in (nn.Sequential, _Reference):
        model = _net(cls, [1, 16, 1], lambda: nn.LeakyReLU(0.1))
        opt = so.LevenbergMarquardt(model, so.residuals.mse)
        array = x.numpy().copy()
        runs.append(
            {
                "model": model,
                "opt": opt,
                "x": torch.from_numpy(array),
                "y": y,
                "array": array,
                "handles": [],
            }
        )
    try:
        for run in runs:
            for _ in range(4):
                _, attempts, passes = _passes(run["opt"], run["x"], run["y"], 2)
            run["carried"] = passes == attempts
        assert _same(runs[0]["model"], runs[1]["model"])
        # The last step used a kept pass and kept one (accepted, on a repeated batch).
        assert runs[0]["carried"] and not runs[1]["carried"]
        assert runs[0]["opt"]._function.program.carry._kept is not None
        for i, run in enumerate(runs):
            CHANGES[change](run, i == 0)
        steps = []
        for run in runs:
            steps.append(_passes(run["opt"], run["x"], run["y"], 2))
        (loss_k, attempts_k, passes_k), (loss_p, attempts_p, passes_p) = steps
        assert (loss_k, attempts_k) == (loss_p, attempts_p)
        assert _same(runs[0]["model"], runs[1]["model"])
        assert passes_k == passes_p  # linearised anew, as the reference was
    finally:
        torch.backends.mkldnn.enabled = mkldnn
        torch.backends.mkldnn.matmul.fp32_precision = precision
        for run in runs:
            for handle in run["handles"]:
                handle.remove()


def test_new_targets_reuse_the_forward_pass_with_the_new_residuals() -> None:
    kept, plain, opts, x, y = _pair()
    y2 = y + 0.05 * torch.cos(5.0 * x)
    loss_k, attempts_k, passes_k = _passes(opts[0], x, y2, 2)
    loss_p, attempts_p, passes_p = _passes(opts[1], x, y2, 2)
    assert (loss_k, attempts_k) == (loss_p, attempts_p)
    assert _same(kept, plain)
    assert passes_p == attempts_p + 1
    assert passes_k == attempts_k  # the model's pass was kept; the residuals are new


def test_mini_batches_record_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 1, generator=gen), torch.randn(64, 1, generator=gen))]
    batches.append((torch.randn(64, 1, generator=gen), torch.randn(64, 1, generator=gen)))
    model = _net(nn.Sequential, [1, 8, 1], nn.Tanh)
    opt = so.LevenbergMarquardt(model, so.residuals.mse)
    for k in range(6):
        x, y = batches[k % 2]
        opt.step(x, y)
        carry = opt._function.program.carry
        assert carry is not None
        assert not carry.armed and carry._kept is None


def test_model_state_vouches_only_for_plain_modules() -> None:
    def state(model: nn.Module) -> tuple[Any, ...] | None:
        return model_state(model, frozenset(id(p) for p in model.parameters()))

    assert state(nn.Sequential(nn.Linear(2, 3), nn.GELU())) is not None
    assert state(_Reference(nn.Linear(2, 3))) is None

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.tensor(2.0)  # a tensor setting: not compared

        def forward(self, z: Tensor) -> Tensor:
            return z * self.scale

    assert state(nn.Sequential(nn.Linear(2, 3), Scaled())) is None
    act = nn.Tanh()
    act.forward = lambda z: z  # type: ignore[method-assign]
    assert state(nn.Sequential(act)) is None
    with torch.autocast("cpu"):
        assert state(nn.Sequential(nn.Linear(2, 3))) is None
    # A frozen parameter or a buffer could be written through .data unseen: refused.
    frozen = nn.Sequential(nn.Linear(2, 3))
    frozen[0].bias.requires_grad_(False)
    assert model_state(frozen, frozenset({id(frozen[0].weight)})) is None
    buffered = nn.Sequential(nn.Linear(2, 3))
    buffered[0].register_buffer("scale", torch.ones(3))
    assert model_state(buffered, frozenset(id(p) for p in buffered.parameters())) is None
    # A torch function mode entered or left changes the state.
    plain = nn.Sequential(nn.Linear(2, 3))
    everything = frozenset(id(p) for p in plain.parameters())
    before = model_state(plain, everything)
    with LinearCalls():
        assert model_state(plain, everything) != before
    assert model_state(plain, everything) == before


def test_an_interrupt_while_a_trial_is_recorded_leaves_no_trace() -> None:
    x, y = _sinc()
    calls = {"armed": False}

    def interrupting(out: Tensor, t: Tensor) -> Tensor:
        if calls["armed"] and not torch.is_grad_enabled():
            raise KeyboardInterrupt
        return out - t

    kept = _net(nn.Sequential, [1, 16, 1], nn.Tanh)
    plain = _net(_Reference, [1, 16, 1], nn.Tanh)
    opt_k = so.LevenbergMarquardt(kept, interrupting)
    opt_p = so.LevenbergMarquardt(plain, interrupting)
    for _ in range(4):
        opt_k.step(x, y)
        opt_p.step(x, y)
    state = state_of(opt_k)
    calls["armed"] = True
    with pytest.raises(KeyboardInterrupt):
        opt_k.step(x, y)  # raises in its first trial, which was being recorded
    calls["armed"] = False
    assert _same(kept, plain)
    assert same_state(state_of(opt_k), state)
    # The next step is the reference's.
    info_k, info_p = opt_k.step(x, y), opt_p.step(x, y)
    assert (info_k.loss, info_k.attempts) == (info_p.loss, info_p.attempts)
    assert _same(kept, plain)


def test_passes_that_go_unused_make_the_recording_rest() -> None:
    # Each step is undone (as a benchmark timing one step from a fixed point does), so
    # every kept pass goes unused: the recording backs off, then resumes once used.
    x, y = _sinc()
    model = _net(nn.Sequential, [1, 16, 1], nn.Tanh)
    opt = so.LevenbergMarquardt(model, so.residuals.mse)
    for _ in range(3):
        opt.step(x, y)
    carry = opt._function.program.carry
    assert carry is not None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    armed = []
    for _ in range(24):
        opt.step(x, y)
        armed.append(carry.armed)
        model.load_state_dict(state)
    assert 2 <= sum(armed) <= 6, armed
    carried = 0
    for _ in range(40):
        _, attempts, passes = _passes(opt, x, y, 2)
        carried += passes == attempts
    assert carried >= 20


def test_a_residual_function_writing_into_the_output_keeps_nothing() -> None:
    def in_place(out: Tensor, t: Tensor) -> Tensor:
        out -= t  # writes into the model's output
        return out

    kept, plain, (opt_k, opt_p), x, y = _pair(in_place, warm=0)
    for _ in range(6):
        loss_k, attempts_k, passes_k = _passes(opt_k, x, y, 2)
        loss_p, attempts_p, passes_p = _passes(opt_p, x, y, 2)
        assert (loss_k, attempts_k, passes_k) == (loss_p, attempts_p, passes_p)
        assert _same(kept, plain)


def test_a_function_mode_entered_between_steps_drops_the_kept_pass() -> None:
    class Scaled(TorchFunctionMode):
        def __torch_function__(
            self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
            kwargs: Any = None,
        ) -> Any:  # fmt: skip
            out = func(*args, **(kwargs or {}))
            return out * 1.25 if getattr(func, "__name__", "") == "linear" else out

    kept, plain, opts, x, y = _pair()
    infos = []
    with Scaled():
        for opt in opts:
            infos.append(opt.step(x, y))
    assert (infos[0].loss, infos[0].attempts) == (infos[1].loss, infos[1].attempts)
    assert _same(kept, plain)


def test_the_newer_precision_switches_are_part_of_the_state() -> None:
    # Once the newer API has set a precision, the legacy getters raise; the state
    # still tells one newer setting from another.
    before = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        as_bf16 = _backend_flags()
        torch.backends.mkldnn.matmul.fp32_precision = "tf32"
        assert _backend_flags() != as_bf16
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        assert _backend_flags() == as_bf16
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
