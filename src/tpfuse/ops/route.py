"""Where a group's calls go: one :class:`Route` a process group, made once and dropped by one rule.

A route holds what every call of its group needs and what does not change while the group and its
communicator stay: the group's name and size, its communicator (or None) and, for a group of one
rank, the kernel that does the block end alone. :meth:`Route.run` sends a checked call the way it
goes (``select.ROUTES``): the local kernel, one fused call (one-shot or two-shot, as the communicator
plans it and keeps the plan), fused calls of the workspace's rows (a call larger than it), or the
reference path (the group's own all-reduce in fp32, then the block end in torch). In batch-invariant
mode (``ops.determinism``) every call that tpfuse's kernels do not run takes the gathered path instead
(and so does every sharded call, sequence parallel's, that they do not run):
every rank's part all-gathered and summed in ascending rank order in fp32, then the kernels' block end
(the local kernel where the kernels run, else torch), so a row's bits never depend on the path.

The one eviction rule: a group's route is rebuilt at its next call when the communicator registered
for the group is not the one the route holds (one was created or destroyed since), or when the name
comes back with a new group object (torch numbers groups again once the default group is destroyed).
A destroyed communicator's route is dropped at once, and group objects are held weakly: tpfuse keeps no
group alive once the user has destroyed it and its communicator.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref

import torch
import torch.distributed as dist

from tpfuse import _stats, select
from tpfuse.comm import agreement
from tpfuse.comm.communicator import (
    CallPlan,
    Communicator,
    default_wait_timeout_s,
    group_device,
    lookup_communicator,
    on_destroy,
    resolve_group,
)
from tpfuse.blockend.call import FusedCall
from tpfuse.blockend.epilogue import Epilogue
from tpfuse.blockend.reference import add_rmsnorm_reference, rank_part, unquantised
from tpfuse.kernels import kernels_usable
from tpfuse.ops.determinism import batch_invariant

log = logging.getLogger(__name__)
_LOCAL, _REFERENCE = CallPlan(select.LOCAL), CallPlan(select.REFERENCE)
#: The reference route in batch-invariant mode (``Route._run_gathered``): a plan of its own, so that the
#: mode is decided once a call.
_GATHERED = CallPlan(select.REFERENCE, chunk_rows=-1)


class Route:
    """A process group's way to run calls (see the module's docstring); :func:`route_of` gives it.

    Attributes
    ----------
    group_name : str
    world_size : int
    comm : Communicator or None
        The group's communicator when the route was made (None: no fused calls).
    """

    def __init__(self, group_name: str, comm: Communicator | None):
        self.group_name = group_name
        self.comm = comm
        self.world_size = comm.world_size if comm is not None else dist.get_world_size(group_by_name(group_name))
        self._local: dict[torch.device, object] = {}  # device -> the local kernel there, or None
        # The communicator's device as Tensor.get_device() gives it (-1 for the CPU): the cheapest test a call.
        self._comm_device = None if comm is None else -1 if comm.device.type == "cpu" else comm.device.index
        # Debug mode (read when the route is made, at the group's first call).
        self._debug = os.environ.get("TPFUSE_DEBUG") == "1"
        # Whether the communicator's fused calls are batch-invariant: tpfuse's kernels, exact (not
        # FlashInfer's, whose norm changes with the token count, nor the lossy fp8 wire).
        self._invariant_fused = comm is not None and comm.backend == "triton" and comm.compress is None

    def plan(self, call: FusedCall) -> CallPlan:
        """How ``call`` runs (``CallPlan.route``, one of ``select.ROUTES``): the communicator's plan where
        it serves the call's device (kept by it), else the local kernel or the reference path."""
        comm, x = self.comm, call.x
        if x.get_device() == self._comm_device:
            comm.check_usable()
            plan = comm.plan(call)
            # (a sharded call never takes the fp8 wire: our kernels' sharded calls are always invariant)
            invariant = self._invariant_fused or (call.sharded and comm.backend == "triton")
            if plan.route != select.REFERENCE and (invariant or not batch_invariant()):
                return plan
            if plan.route != select.REFERENCE:
                _say_once(f"tpfuse: group {self.group_name!r}: batch-invariant mode: the communicator's "
                          f"{comm.backend} backend{' with the fp8 wire' if comm.compress else ''} is not "
                          "batch-invariant; its calls take the gathered path (docs/determinism.md)")
        if x.dtype is not torch.float32 and self.local_kernel(x.device) is not None:
            return _LOCAL
        return _GATHERED if self.world_size > 1 and batch_invariant() else _REFERENCE

    def local_kernel(self, device: torch.device):
        """``kernels.local.local_add_rmsnorm`` where the group has one rank and the kernels run on
        ``device``, else None (decided once a device; Triton imported only where it is used)."""
        local = self._local.get(device, False)
        if local is False:
            local = None
            if self.world_size == 1 and kernels_usable(device):
                from tpfuse.kernels.local import local_add_rmsnorm as local
            self._local[device] = local
        return local

    def run(self, call: FusedCall) -> None:
        """Run a checked call as :meth:`plan` says; record it in ``tpfuse.stats()``."""
        if call.sharded and self.world_size == 1:  # one rank owns every row
            call = call._replace(sharded=False)
        plan = self.plan(call)
        route = plan.route
        if plan.launch is not None:  # one fused call: the common route first
            self._run_fused(call, plan, self._checking(call.x))
        elif route == select.LOCAL:
            self._local[call.x.device](call)
            _stats.record("triton.local")
        elif plan is _GATHERED or (call.sharded and route == select.REFERENCE):
            self._run_gathered(call)
        elif route == select.REFERENCE:
            self._run_reference(call)
        else:
            self._run_chunked(call, plan.chunk_rows)

    def _run_fused(self, call: FusedCall, plan: CallPlan, checking: bool) -> None:
        """One fused call on the communicator's backend; on the CPU (or in debug mode) checked for
        errors after it."""
        comm = self.comm
        if checking and not comm.fused_backend.compares_calls:
            comm.check_call_matches(call.describe(), plan.route)
        if not checking:
            _stats.record(comm.run_fused(call, plan))
            return
        started = time.monotonic()
        _stats.record(comm.run_fused(call, plan))
        comm.check_errors(waited_s=time.monotonic() - started)

    def _run_chunked(self, call: FusedCall, chunk_rows: int) -> None:
        """A call over the workspace as fused calls of ``chunk_rows`` rows each (rows are independent), so
        the ranks' calls stay compared and every wait bounded (docs/reliability.md)."""
        checking = self._checking(call.x)
        try:
            if call.sharded:  # parts of whole rows of every rank's shard (``chunk_rows`` a rank)
                for start in range(0, call.own_rows, chunk_rows):
                    stop = min(start + chunk_rows, call.own_rows)
                    part = call.shard_part(start, stop, self.world_size)
                    self._run_fused(part, self.comm.plan(part), checking)
                    call.place_shard_part(part, start, stop, self.world_size)
                return
            for start in range(0, call.n_tokens, chunk_rows):
                part = call.rows(start, min(start + chunk_rows, call.n_tokens))
                self._run_fused(part, self.comm.plan(part), checking)
                if part.scales is not None and not call.epilogue.output.scales_by_rows:
                    call.epilogue.output.place_scale_rows(call.scales, start, part.scales, part.n_tokens)
        except RuntimeError:
            for out in call.outputs():  # a failed call returns none of its rows, not even those of chunks
                # that went through: NaN, or every bit set (codes and packed exponents)
                out.fill_(float("nan") if out.is_floating_point() else 0xFF if out.dtype == torch.uint8 else -1)
            raise

    def _run_reference(self, call: FusedCall) -> None:
        """The group's own all-reduce in fp32 (none at world size 1), then the block end in torch."""
        x, epilogue, comm = call.x, call.epilogue, self.comm
        group = group_by_name(self.group_name)
        checking = self.world_size > 1 and self._checking(x)
        timeout = comm.wait_timeout_s if comm is not None else default_wait_timeout_s()
        if checking:  # the kernels' comparison of calls does not cover the group's all-reduce: compare here
            agreement.check_reference_call(group, group_device(group), call.describe(), timeout)
        if call.n_tokens == 0:
            return
        reduced = rank_part(x, epilogue).to(torch.float32, copy=True)
        if self.world_size > 1:
            agreement.all_reduce(reduced, group, timeout if checking else None, "a reference-path all-reduce")
        _block_end_in_torch(call, reduced)
        _stats.record("reference")

    def _run_gathered(self, call: FusedCall) -> None:
        """The reference path in batch-invariant mode: the kernels' bits without the kernels' workspace.

        Each rank's part (x, or its MoE finalize, rounded to x's dtype as the kernels send it) is
        all-gathered, never all-reduced (the group's all-reduce sums in an order that follows the
        message size), and summed in ascending rank order in fp32 as every kernel does; the rest of the
        block end (bias, post-norm, + residual, one rounding of h, the norm of that rounded h, any
        quantisation) is the local kernel's where the kernels run, else torch's.
        """
        x, comm = call.x, self.comm
        group = group_by_name(self.group_name)
        checking = self._checking(x)
        timeout = comm.wait_timeout_s if comm is not None else default_wait_timeout_s()
        if checking:
            agreement.check_reference_call(group, group_device(group), call.describe(), timeout)
        if call.n_tokens == 0:
            return
        part = part_as_sent(call)
        parts = agreement.all_gather(part.contiguous().view(torch.uint8), group,
                                     timeout if checking else None, "a batch-invariant all-gather")
        parts = [p.view(x.dtype) for p in parts]
        if call.sharded:
            _block_end_of_shards(call, parts, group, timeout if checking else None)
        else:
            block_end_of_parts(call, parts)
        _stats.record("gathered")

    def _checking(self, x: torch.Tensor) -> bool:
        """Whether a call of ``x`` is checked for errors after it runs, waiting for the host: always on the
        CPU, on a GPU only in debug mode (``TPFUSE_DEBUG=1``: it synchronises), never while a CUDA graph
        is captured."""
        return x.is_cpu or (self._debug and not torch.cuda.is_current_stream_capturing())


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning(message)


def part_as_sent(call: FusedCall) -> torch.Tensor:
    """This rank's part of the sum as the kernels send it: ``x``, or its MoE finalize rounded to x's dtype
    (by the local kernel where the kernels run: their fp32 order and contractions; else in torch)."""
    x, epilogue = call.x, call.epilogue
    if not (epilogue.experts or epilogue.shared_expert is not None):
        return x
    kernel = _local_kernel_for(x)
    if kernel is None or x.dtype is torch.float32:
        return rank_part(x, epilogue)
    part = torch.empty(x.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
    kernel(FusedCall(x, None, call.weight, call.eps, part, part, _finalize_only(epilogue)))
    return part


def block_end_of_parts(call: FusedCall, parts: list[torch.Tensor]) -> None:
    """``call``'s outputs from every rank's part (:func:`part_as_sent`, in rank order): the fp32 sum in
    ascending rank order, one add a rank, as every kernel sums; then the rest of the block end by the
    local kernel where the kernels run (the same code as theirs), else in torch."""
    x, epilogue = call.x, call.epilogue
    if epilogue.experts or epilogue.shared_expert is not None:
        epilogue = _without_finalize(epilogue)
    total = sum_in_rank_order(parts)
    kernel = _local_kernel_for(x)
    if kernel is not None and x.dtype is not torch.float32:
        kernel(call._replace(x=total, epilogue=epilogue))
    else:
        _block_end_in_torch(call._replace(epilogue=epilogue), total)


def _block_end_of_shards(call: FusedCall, parts: list[torch.Tensor], group: dist.ProcessGroup,
                         timeout: float | None) -> None:
    """A sharded call's outputs from every rank's part: the ranks' h-side rows (the residual, the norm
    backward's inputs) gathered too, the whole call's block end as :func:`block_end_of_parts` makes it,
    this rank's rows of h kept."""
    def every_ranks_rows(t):
        if t is None:
            return None
        rows = agreement.all_gather(t.contiguous().view(torch.uint8), group, timeout, "a sharded call's rows")
        return torch.cat([r.view(t.dtype) for r in rows])

    epilogue = call.epilogue
    h_side = {name: every_ranks_rows(getattr(epilogue, name)) for stage in epilogue.stages
              if stage is not None and stage.on_own_rows for name in stage.per_row}
    h = torch.empty_like(parts[0])
    whole = call._replace(residual=every_ranks_rows(call.residual), h=h, sharded=False,
                          epilogue=dataclasses.replace(epilogue, **h_side) if h_side else epilogue)
    block_end_of_parts(whole, parts)
    rank = dist.get_rank(group)
    call.h.copy_(h[rank * call.own_rows:(rank + 1) * call.own_rows])


def sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 sum of every rank's part (``parts`` in rank order), one add a rank in ascending order, as
    every kernel sums: a row's sum never depends on the message's size, as the group's all-reduce's does."""
    total = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for part in parts:
        total += part.float()
    return total


def _block_end_in_torch(call: FusedCall, reduced: torch.Tensor) -> None:
    """The block end of the fp32 sum ``reduced`` in torch (``add_rmsnorm_reference``), into ``call``'s
    outputs."""
    x, epilogue = call.x, call.epilogue
    y, h, scales = add_rmsnorm_reference(reduced, call.residual, call.weight, call.eps, x.dtype, epilogue)
    call.y.copy_(y)
    call.h.copy_(h)
    if scales is not None:
        call.scales.copy_(scales)
    if call.normed is not None:
        call.normed.copy_(add_rmsnorm_reference(reduced, call.residual, call.weight, call.eps, x.dtype,
                                                unquantised(epilogue))[0])


def _local_kernel_for(x: torch.Tensor):
    """``kernels.local.local_add_rmsnorm`` where the kernels run on ``x``'s device, else None."""
    if not kernels_usable(x.device):
        return None
    from tpfuse.kernels.local import local_add_rmsnorm

    return local_add_rmsnorm


def _without_finalize(epilogue: Epilogue) -> Epilogue:
    """``epilogue`` after the sum: its MoE finalize already applied to each rank's part."""
    return dataclasses.replace(epilogue, experts=0, topk_weights=None, shared_expert=None)


def _finalize_only(epilogue: Epilogue) -> Epilogue:
    """The MoE finalize of ``epilogue`` alone: h is the rank's part, rounded to x's dtype."""
    return Epilogue(experts=epilogue.experts, topk_weights=epilogue.topk_weights,
                    shared_expert=epilogue.shared_expert, normed=False)


_routes: dict[str, Route] = {}
# id(group object) -> (the object, held weakly so that this cache never keeps a destroyed group alive;
# its name), once its membership was checked.
_names: dict[int, tuple[weakref.ref, str]] = {}
# A destroyed communicator's route goes at once (route_of makes the group's next one).
on_destroy(lambda comm: _routes.pop(comm.group_name, None))


def route_of(group_name: str) -> Route:
    """The route of the group named ``group_name`` (made at its first call, and again after the group's
    communicator changed)."""
    route = _routes.get(group_name)
    comm = lookup_communicator(group_name)
    if route is None or route.comm is not comm:
        route = _routes[group_name] = Route(group_name, comm)
    return route


def group_name_of(group: dist.ProcessGroup | None) -> str:
    """``resolve_group(group).group_name``, checked once a group object (a call's host time counts)."""
    key = dist.GroupMember.WORLD if group is None else group
    known = _names.get(id(key))
    if known is not None and known[0]() is key:
        return known[1]
    name = resolve_group(group).group_name
    _names[id(key)] = (weakref.ref(key), name)
    # torch names groups by a counter that starts again when the default group is destroyed: the
    # route kept for an earlier group of this name is not this group's.
    _routes.pop(name, None)
    return name


def group_by_name(group_name: str) -> dist.ProcessGroup:
    """The process group of a name tpfuse's ops take; ValueError naming an unknown one."""
    try:
        return dist.distributed_c10d._resolve_process_group(group_name)
    except Exception as exc:  # the private resolver raises several types across torch versions
        raise ValueError(f"tpfuse: unknown process group {group_name!r}") from exc


