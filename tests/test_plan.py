"""Launch plans call a kernel's compiled binary directly after its first launch (on a GPU).

The direct path needs a CUDA binary, so here Triton's kernel, binary and driver are stand-ins
that record what they are given: the test checks the arguments the launcher receives and when
the plan falls back to Triton's own launch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import coda
from coda.ops import epilogues as E
from coda.runtime import launch
from coda.runtime import plan as plan_mod
from conftest import DEVICE


class FakeBinary:
    packed_metadata = "packed"
    function = "function"

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    @property
    def run(self):
        return lambda *args: self.launches.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream)


class FakeKernel:
    """Stands in for the JIT function: `kernel[grid](**args)` records and returns the binary."""

    def __init__(self, arg_names: list[str]) -> None:
        self.arg_names = arg_names
        self.binary = FakeBinary()
        self.calls: list[dict] = []

    def __getitem__(self, grid):
        def launch(**kwargs):
            self.calls.append(kwargs)
            return self.binary
        return launch


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    device = SimpleNamespace(index=0)
    active = SimpleNamespace(get_current_device=lambda: device.index, get_current_stream=lambda i: f"stream{i}")
    monkeypatch.setattr(plan_mod, "driver", SimpleNamespace(active=active))
    launch._plans.clear()
    yield device
    launch._plans.clear()


def _planned(x: torch.Tensor, w: torch.Tensor, ops: dict) -> plan_mod.Plan:
    coda.gemm(x, w.T, E.row_scale, **ops)  # builds the plan (and runs it for real)
    (plan,) = launch._plans.values()
    return plan


def test_second_call_launches_the_first_calls_binary_with_arguments_in_parameter_order(fake_device) -> None:
    x, w = torch.randn(8, 16, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    ops = {"rstd": torch.ones(8, device=DEVICE)}
    plan = _planned(x, w, ops)
    names = list(plan.kernel.arg_names)
    fake = plan.kernel = FakeKernel(names)
    plan.direct = None
    coda.gemm(x, w.T, E.row_scale, **ops)
    assert len(fake.calls) == 1 and not fake.binary.launches  # first launch: through Triton
    first = fake.calls[0]
    assert "num_warps" in first  # launch options go to Triton's launch, not to the launcher
    y = torch.randn(8, 16, device=DEVICE)
    coda.gemm(y, w.T, E.row_scale, **ops)
    assert len(fake.calls) == 1 and len(fake.binary.launches) == 1
    (grid0, grid1, grid2, stream, function, packed, meta, enter, exit_, *args) = fake.binary.launches[0]
    assert (grid0, grid1, grid2) == (plan.grid[0], 1, 1)
    assert (stream, function, packed, meta) == ("stream0", "function", "packed", ("meta", plan.grid, "stream0"))
    assert enter is plan_mod.knobs.runtime.launch_enter_hook and exit_ is plan_mod.knobs.runtime.launch_exit_hook
    assert len(args) == len(names) == len(first) - 2  # every parameter in order; no launch options
    for name, value in zip(names, args):
        if name == "a_src":
            assert getattr(value, "base", value) is y  # this call's tensor (or its TMA descriptor)
        elif name == "in_rstd_ptr":
            assert value is ops["rstd"]
        elif isinstance(first[name], (int, float, bool)):
            assert value == first[name]  # sizes, strides, constexprs


def test_another_current_device_launches_through_triton(fake_device) -> None:
    x, w = torch.randn(8, 16, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    ops = {"rstd": torch.ones(8, device=DEVICE)}
    plan = _planned(x, w, ops)
    fake = plan.kernel = FakeKernel(list(plan.kernel.arg_names))
    plan.direct = None
    coda.gemm(x, w.T, E.row_scale, **ops)
    fake_device.index = 1
    coda.gemm(x, w.T, E.row_scale, **ops)
    assert len(fake.calls) == 2 and not fake.binary.launches
    fake_device.index = 0
    coda.gemm(x, w.T, E.row_scale, **ops)
    assert len(fake.calls) == 2 and len(fake.binary.launches) == 1
