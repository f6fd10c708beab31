"""Why an all-reduce site of a compiled graph stays unfused: every reason's code, in one place.

The pass, the backend's site planning and vLLM's site finder each say why a site stays unfused in a
sentence that names the site's own values (its dtype, sizes, group). Each such sentence is a
:class:`Reason`: the text the logs and ``SiteReport.reason`` show, with one of the :data:`CODES`
below, which tools, dashboards and tests compare instead of the wording (``SiteReport.code``).
"""

from __future__ import annotations

#: Every code a reason can have, with what it means.
CODES: dict[str, str] = {
    "reduce-op": "the all-reduce is not a sum",
    "dtype": "the kernels do not take the all-reduced dtype",
    "hidden": "the hidden size (last dimension) is dynamic or not one the kernels take",
    "no-communicator": "the group has no tpfuse communicator that fuses the call, or none the pass knows",
    "tokens": "the graph may run the site with more tokens than the fusion limit, or with no known bound",
    "no-pattern": "nothing a pattern fuses follows the all-reduce (no norm, or one the patterns lack)",
    "graph-break": "the all-reduce's result leaves the graph before its block end",
    "operands": "a tensor of the block end is not as the op takes it (dtype, shape, broadcast, eps)",
    "outside-users": "a value inside the site is also read outside it",
    "sizes": "an output's size cannot be derived from the graph's inputs",
    "vllm-form": "a vLLM op's arguments that the fused op does not reproduce",
}


class Reason(str):
    """A reason a site stays unfused: its sentence (a ``str``) with its :data:`CODES` entry in ``code``."""

    code: str

    def __new__(cls, code: str, text: str) -> Reason:
        if code not in CODES:
            raise ValueError(f"tpfuse: unknown reason code {code!r} (reasons.CODES)")
        reason = super().__new__(cls, text)
        reason.code = code
        return reason

    def __reduce__(self):  # pickled with its code (reports cross process boundaries in tests)
        return Reason, (self.code, str(self))


def no_communicator(group_name: str, hidden: int, dtype) -> Reason:
    """The group's communicator is missing (or was destroyed, or takes no call of this size)."""
    return Reason("no-communicator",
                  f"group {group_name!r} has no tpfuse communicator that can fuse {hidden} x "
                                     f"{dtype} (call tpfuse.get_communicator before compiling)")


DYNAMIC_HIDDEN = Reason("hidden", "the hidden size (last dimension) is dynamic")
