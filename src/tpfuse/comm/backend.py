"""What a communicator asks of the place its fused calls run: the one backend interface.

A :class:`tpfuse.comm.Communicator` holds at most one :class:`FusedBackend` (none: every call takes
the reference path, the group's own all-reduce). The communicator decides which calls fuse and with
which algorithm (``tpfuse.select``); a backend only runs them, says how many bytes a rank may send,
and reports a failed call. Implementations: :class:`tpfuse.comm.triton_backend.TritonBackend` (our
kernels) and :class:`tpfuse.comm.flashinfer.FlashInferBackend` (FlashInfer's, optional).
"""

from __future__ import annotations

import abc
import functools
from typing import Callable

from tpfuse.blockend.call import FusedCall
from tpfuse.blockend.epilogue import Epilogue


class FusedBackend(abc.ABC):
    """A group's fused all-reduce + residual add + RMSNorm kernels and the buffers they own."""

    #: The name calls are counted under in ``tpfuse.stats()``: ``"<name>.<algorithm>"``.
    name: str
    #: Whether the kernels check that every rank's call is the same one; otherwise debug mode compares
    #: calls on the host first.
    compares_calls: bool = False
    #: Whether the kernels take sharded calls (sequence parallel: ``FusedCall.sharded``).
    shards_rows: bool = False

    @property
    @abc.abstractmethod
    def region_bytes(self) -> int:
        """Bytes one rank may send in a call: the input of ``select.max_token_num``."""

    def takes(self, n_tokens: int, epilogue: Epilogue) -> bool:
        """Whether this backend runs a call of ``n_tokens`` rows with this block end at all (else it takes
        the reference path)."""
        return True

    @abc.abstractmethod
    def run(self, algorithm: str, call: FusedCall) -> None:
        """Run one call with ``algorithm`` (``select.ONESHOT`` or ``select.TWOSHOT``); writes its outputs."""

    def launcher(self, algorithm: str, call: FusedCall) -> Callable[[FusedCall], None]:
        """``launch(c)``: what :meth:`run` does for calls ``c`` of ``call``'s kind (rows, dtypes, hidden size,
        residual, block end) with ``algorithm``, with what it can decide for the kind decided now. The
        communicator keeps it in its plan of the kind (``CallPlan.launch``)."""
        return functools.partial(self.run, algorithm)

    def set_wait_timeout(self, seconds: float) -> None:
        """The bound of every wait for a peer, for launches from now on (where the kernels have one)."""

    def failure(self, wait_timeout_s: float, waited_s: float | None) -> str | None:
        """What went wrong in a failed call, read from the device (it synchronises), or None."""
        return None

    @abc.abstractmethod
    def release(self) -> None:
        """Free the buffers (not collective). Idempotent."""
