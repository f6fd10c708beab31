"""Ranks checking that they agree: on a communicator's set-up, and on each reference-path call.

A collective that one rank never joins hangs its peers until the process group's own timeout (30
minutes for gloo, 10 for NCCL) and a collective whose sizes differ between ranks can return garbage.
So before the set-up of a communicator and before each reference-path call (where the fused
kernels' in-kernel check does not apply) the ranks exchange a short record of what they are about to
do: one all-gather of a few integers, waited for with a bound. A record that differs is an error on
every rank, naming the field and each rank's value; a peer that does not come within the bound is an
error too. Records carry their kind and a per-group number, so an exchange never pairs with a stale
one of another kind or an earlier call without it being seen.

After such an error the ranks' collectives are out of step (the rank that gave up left its
all-gather pending in the process group): destroy the communicator, and the process group, on every
rank before going on.
"""

from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist

from tpfuse.blockend.call import CallDescription, explain_flags

#: Record kinds: the first field of every record.
SETUP, REFERENCE_CALL, FUSED_CALL = 1, 2, 3

_RECORDS = {SETUP: "communicator set-up", REFERENCE_CALL: "reference-path call", FUSED_CALL: "fused call"}
# How a field's values read in an error message.
_LABELS = {"record": _RECORDS.get, "flags": lambda flags: f"({explain_flags(flags)})"}

_reference_calls: dict[str, itertools.count] = {}


class Disagreement(RuntimeError):
    """The ranks of a group are not doing the same thing (or a peer never came): raised on every rank."""


def exchange(group: dist.ProcessGroup, device: torch.device, fields: dict[str, int], timeout_s: float | None,
             what: str) -> list[dict]:
    """All-gather every rank's ``fields`` (ints, on the group's ``device``); raise :class:`Disagreement`
    naming the first field whose values differ. ``timeout_s`` bounds the wait where the group's backend
    can (gloo; None: the process group's own timeout), and the error then says which exchange a peer
    never joined.
    Returns every rank's fields, in rank order."""
    world = dist.get_world_size(group)
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    _bounded(lambda async_op: dist.all_gather(gathered, mine, group=group, async_op=async_op), group,
             timeout_s, what)
    records = [dict(zip(fields, t.tolist())) for t in gathered]
    for name in fields:
        values = [r[name] for r in records]
        if len(set(values)) > 1:
            shown = _LABELS.get(name, lambda v: v)
            detail = ", ".join(f"rank {r}: {shown(v)}" for r, v in enumerate(values))
            raise Disagreement(f"tpfuse: group {group.group_name!r}: the ranks differ at {what}: {name} "
                               f"({detail})")
    return records


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup, timeout_s: float | None, what: str) -> list:
    """Every rank's ``tensor``, in rank order (``dist.all_gather`` with the wait bounded as in
    :func:`exchange`), for values that may differ between ranks."""
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    _bounded(lambda async_op: dist.all_gather(gathered, tensor, group=group, async_op=async_op), group,
             timeout_s, what)
    return gathered


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, timeout_s: float | None, what: str) -> None:
    """``dist.all_reduce`` (sum, in place) with the wait bounded as in :func:`exchange`."""
    _bounded(lambda async_op: dist.all_reduce(tensor, group=group, async_op=async_op), group, timeout_s, what)


def _bounded(collective, group: dist.ProcessGroup, timeout_s: float | None, what: str) -> None:
    """Run ``collective(async_op)`` and wait for it at most ``timeout_s`` on the CPU. A GPU wait with a
    bound would stall the host on every call, so there (and with None) it runs as a plain collective,
    bounded by the process group's own timeout (and capturable in a CUDA graph)."""
    if timeout_s is None or "nccl" in str(dist.get_backend(group)):
        collective(False)
        return
    try:
        collective(True).wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise Disagreement(
            f"tpfuse: group {group.group_name!r} rank {dist.get_rank(group)}: no answer from a peer within "
            f"{timeout_s:g} s at {what}: a rank stalled or died, or did something else (a fused call, "
            "another call of the group). The group's collectives are now out of step: destroy the "
            "communicator and the process group on every rank") from exc


def reset_numbers(group_name: str) -> None:
    """Start a group's reference-call numbers again (every rank does, at a communicator's set-up)."""
    _reference_calls.pop(group_name, None)


def check_reference_call(group: dist.ProcessGroup, device: torch.device, call: CallDescription,
                         timeout_s: float) -> None:
    """Before a reference-path call: every rank makes this call, the same one (a bounded exchange)."""
    number = next(_reference_calls.setdefault(group.group_name, itertools.count(1)))
    exchange(group, device, {"record": REFERENCE_CALL, "reference call number": number, **call.fields()},
             timeout_s, f"reference-path call #{number} ({call.tokens} x {call.hidden} "
                        f"{explain_flags(call.flags)})")
