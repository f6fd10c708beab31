"""Launching a kernel with the least host work a call: decided once, kept, then the compiled launcher.

A fused call's launch depends on what changes per call (its tensors' addresses, eps, the wait bound) and
on what a whole kind of call shares (grid, compile-time switches, warps, the workspace: a
:class:`LaunchPlan`). The launchers build a plan once per kind of call and keep it in the group's
``LaunchContext``; a communicator's plan of a call holds it too, so its calls go straight here. On a GPU,
the first launch of a plan goes through Triton's JIT, which compiles the kernel and checks its
arguments; later ones call the compiled kernel's own launcher with the addresses as integers, which
skips the JIT's binding, specialisation and cache look-up (about 25 of a launch's microseconds:
docs/kernel-notes.md). The kernel the JIT chose is kept for the exact runtime scalars and pointer
alignment it was chosen for, so a call never runs code specialised for other arguments. In the CPU
interpreter every launch goes through the JIT.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Callable

import torch

from tpfuse.blockend.call import FusedCall
from tpfuse.blockend.epilogue import PLAIN
from tpfuse.kernels import interpreter_enabled


@dataclass
class LaunchPlan:
    """Everything a launch takes besides the call's own tensors, for one kind of call.

    Attributes
    ----------
    kernel : triton JITFunction
    grid : int
        Programs of the launch.
    scalars : callable
        ``scalars(call)``: the kernel's runtime scalars for a call of this kind, in its order.
    constexprs : dict
        The compile-time switches, by name, in the kernel's order.
    options : dict
        Launch options (``num_warps``, ``launch_pdl``).
    workspace : tuple of Tensor
        The pointer arguments after the call's (the workspace's), the same for every call of the plan.
    compiled : dict
        A launcher of the compiled kernel the JIT chose, for each (pointers not 16-byte aligned, runtime
        scalars) seen (GPU only).
    """

    kernel: object
    grid: int
    scalars: Callable[[FusedCall], tuple]
    constexprs: dict
    options: dict
    workspace: tuple = ()
    compiled: dict = field(default_factory=dict)
    #: Where its launches go, set by the first: (launch through the compiled kernel?, the GPU's index, the
    #: workspace's addresses).
    target: tuple | None = None

    def __post_init__(self):
        # The compiled launcher takes every parameter by position, the switches included.
        order = {name: i for i, name in enumerate(self.kernel.arg_names)}
        self.constexprs = dict(sorted(self.constexprs.items(), key=lambda item: order[item[0]]))


#: Plans kept per context before they are dropped and made again (token counts a server sees may be many).
MAX_PLANS = 1024


def kept_plan(plans: dict, key: tuple, make: Callable[..., LaunchPlan], *args) -> LaunchPlan:
    """``plans[key]``, made by ``make(*args)`` the first time: the one place a launch decision is made."""
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plan = plans[key] = make(*args)
    return plan


def launch(plan: LaunchPlan, call: FusedCall) -> None:
    """Launch ``plan.kernel`` for ``call``: its pointer arguments are the call's tensors
    (``FusedCall.kernel_tensors``) then ``plan.workspace``, its runtime scalars ``plan.scalars(call)``."""
    values = plan.scalars(call)
    if plan.target is None:  # a plan serves one device (its context's, or its key's) and one workspace
        device = call.x.device
        direct = device.type == "cuda" and not interpreter_enabled()
        plan.target = (direct, device.index, tuple(t.data_ptr() for t in plan.workspace) if direct else ())
    direct, index, workspace = plan.target
    if not direct:
        plan.kernel[(plan.grid,)](*call.kernel_tensors(), *plan.workspace, *values, **plan.constexprs,
                                  **plan.options)
        return
    addresses = call.kernel_addresses()
    # The JIT compiles apart for each pointer that is not 16-byte aligned and for integer values (1, a
    # multiple of 16, over 32 bits): the kernel it chose for these exact values and alignments is right
    # for every later launch with the same, and its launcher is kept with them bound. A plan sees the
    # same values call after call (the wait bound changes only when the user sets it) and aligned
    # pointers (the caching allocator's), so this stays a one-entry dict in practice, keyed on the
    # values alone; which pointers are misaligned is read only when one is. (The workspace's addresses
    # are the plan's own: their alignment never changes.)
    x, residual, weight, y, h, steps = addresses
    bits = x | residual | weight | y | h
    if call.epilogue is not PLAIN:  # (the common call's steps are all the weight's address: read already)
        bits = functools.reduce(operator.or_, steps, bits)
    key = (tuple(bool(a & 15) for a in _flat(addresses)), values) if bits & 15 else values
    run = plan.compiled.get(key)
    if run is None:
        compiled = plan.kernel[(plan.grid,)](*call.kernel_tensors(), *plan.workspace,
                                             *values, **plan.constexprs,
                                             **plan.options)
        plan.compiled[key] = _launcher(compiled, plan.grid, (*workspace, *values, *plan.constexprs.values()))
        return
    run(torch._C._cuda_getCurrentRawStream(index), addresses)


def _flat(addresses: list) -> list[int]:
    """The addresses with the steps' tuple opened, in the kernel's order."""
    return [b for a in addresses for b in ((a,) if a.__class__ is int else a)]


def _launcher(compiled, grid: int, tail: tuple):
    """A function ``(stream, addresses)`` that launches ``compiled`` on ``grid`` programs as Triton's JIT
    would, with the call's addresses and then ``tail``: the workspace's addresses, the runtime scalars
    and the compile-time switches, all fixed for the launches it serves.

    Triton's launcher object (``compiled.run``) wraps a C function (which takes the kernels' ``steps``
    as one tuple, as ``FusedCall.kernel_addresses`` gives them); where the kernel needs no scratch
    memory its Python wrapper only adds arguments fixed at compile time, so they are bound here once
    and the C function called directly (about 1.5 us a launch). Any other launcher: through ``run``.
    """
    run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    direct = getattr(run, "launch", None)
    fixed = ("launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size")
    if direct is None or not all(hasattr(run, name) for name in fixed) or run.global_scratch_size \
            or run.profile_scratch_size:
        return lambda stream, addresses: run(grid, 1, 1, stream, function, metadata,
                                             None, None, None, *addresses,
                                             *tail)
    cooperative, pdl = run.launch_cooperative_grid, run.launch_pdl
    return lambda stream, addresses: direct(grid, 1, 1, stream, function, cooperative,
                                            pdl, None, None, metadata,
                                            None, None, None, *addresses, *tail)
