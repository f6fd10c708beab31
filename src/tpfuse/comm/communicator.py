"""One communicator per process group, kept by a process-wide registry."""

from __future__ import annotations

import atexit
import logging
import math
import numbers
import os
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from tpfuse import select
from tpfuse.blockend.call import CallDescription, FusedCall
from tpfuse.blockend.epilogue import PLAIN, Epilogue
from tpfuse.comm import agreement, topology
from tpfuse.comm.backend import FusedBackend
from tpfuse.kernels import kernels_usable

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 512
DEFAULT_HIDDEN = 8192
#: How long a kernel waits for a peer before it flags an error and returns (see docs/reliability.md).
DEFAULT_WAIT_TIMEOUT_S = 10.0
#: Where fused calls run: our Triton kernels, FlashInfer's kernels (optional), or always the group's
#: own all-reduce. ``$TPFUSE_BACKEND`` picks the default.
BACKENDS = ("triton", "flashinfer", "reference")
#: What the two-shot may send instead of 16-bit rows: None (exact) or "fp8" (``tpfuse.kernels.wire``).
COMPRESSIONS = (None, "fp8")

_registry: dict[str, Communicator] = {}
#: Fused backends whose workspace a captured CUDA graph may still use: kept, never freed, until exit.
_kept_for_graphs: list[FusedBackend] = []


def _capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being captured into a CUDA graph now (torch's own query without its
    Python wrapper: every eager fused call asks until one was captured)."""
    return device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()


@dataclass(frozen=True)
class CallPlan:
    """How a call runs (:meth:`Communicator.plan`, ``tpfuse.ops.route.Route.plan``).

    Attributes
    ----------
    route : str
        One of ``select.ROUTES``: ``ONESHOT`` or ``TWOSHOT``, one fused call of that kernel; ``CHUNKED``,
        fused calls of ``chunk_rows`` rows each (each planned as a call of its own); ``REFERENCE``, the
        group's own all-reduce and the torch block end; ``LOCAL``, the block end alone (one rank).
    chunk_rows : int
        The rows of a ``CHUNKED`` call's parts.
    launch : callable or None
        ``launch(call)`` for ``ONESHOT`` and ``TWOSHOT``: the backend's launch of that kernel for calls of
        the planned kind (``FusedBackend.launcher``), kept with the plan so a call goes straight to it.
    """

    route: str
    chunk_rows: int = 0
    launch: Callable[[FusedCall], None] | None = field(default=None, compare=False)

_registry_lock = threading.RLock()
# What other layers cache per communicator and drop when it is destroyed (see on_destroy).
_forgetters: list[Callable[[Communicator], None]] = []


def on_destroy(forget: Callable[[Communicator], None]) -> None:
    """Have ``forget(comm)`` called whenever a communicator is destroyed.

    A layer that keeps a communicator for its calls (the op's routes) registers here, so that nothing of
    tpfuse holds a destroyed communicator, and the process group inside it, any longer: the group is
    freed when the user destroys it, not during the interpreter's teardown, where freeing a gloo group's
    threads and its store can abort the process ("terminate called without an active exception").
    """
    _forgetters.append(forget)


def default_wait_timeout_s() -> float:
    """``$TPFUSE_WAIT_TIMEOUT_S``, else :data:`DEFAULT_WAIT_TIMEOUT_S`: the bound of waits for a peer."""
    return float(os.environ.get("TPFUSE_WAIT_TIMEOUT_S") or DEFAULT_WAIT_TIMEOUT_S)


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group ``group`` names (the default group for None), checked for membership."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first")
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER or not isinstance(group, dist.ProcessGroup):
        raise ValueError("this process is not a member of the given process group")
    if dist.get_rank(group) < 0:
        raise ValueError(f"this process is not a member of process group {group.group_name!r}")
    return group


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device a group's collectives run on: the current GPU for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Communicator:
    """The fused op's per-group state: which calls fuse, the backend that runs them, its error state.

    Obtain it with :func:`get_communicator`; never construct it directly. It is created once per
    process group, lives in a process-wide registry, and is destroyed by :meth:`destroy` or at
    interpreter exit. Create it (and size it) before any CUDA-graph capture: capture never allocates.

    Attributes
    ----------
    group : torch.distributed.ProcessGroup
    group_name : str
    rank, world_size : int
        This process's rank in ``group`` and the group's size.
    device : torch.device
    backend : str
        The name of the kernels fused calls run on (``fused_backend``'s kind): one of :data:`BACKENDS`.
    compress : str or None
        One of :data:`COMPRESSIONS`: ``"fp8"`` when the two-shot's calls travel on the fp8 wire.
    fused_backend : FusedBackend or None
        Where fused calls run (:mod:`tpfuse.comm.backend`); None: every call takes the reference path
        (the ``reference`` backend, one rank, no GPU and no Triton interpreter, or ranks that cannot
        map each other's memory: other hosts, GPUs without peer access, :mod:`tpfuse.comm.topology`).
    """

    def __init__(self, group: dist.ProcessGroup, max_tokens: int, hidden: int, backend: str,
                 wait_timeout_s: float | None = None, compress: str | None = None):
        self.group = group
        self.group_name = group.group_name
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = group_device(group)
        self.backend = backend
        self.compress = compress
        self.fused_backend: FusedBackend | None = None
        self.wait_timeout_s = float(wait_timeout_s or default_wait_timeout_s())
        self._destroyed = False
        self._busy = threading.Lock()  # held while a fused call runs: one thread at a time (see run_fused)
        self._error: str | None = None  # set once a fused call failed: the communicator is unusable
        # Set once a fused call was captured into a CUDA graph: the graph holds the workspace's
        # addresses, so a growth or destroy keeps that workspace alive (see _release).
        self._captured = False
        self._plans: dict[tuple, CallPlan] = {}  # kept decisions (plan): cleared when the workspace changes
        self._plans_generation = select.tables_generation
        self._labels: dict[str, str] = {}  # stats label per algorithm
        self._unreachable: str | None = None  # why the ranks cannot map each other's memory (topology)
        self._topology_checked = False
        self._agree(max_tokens, hidden, "set-up")
        agreement.reset_numbers(self.group_name)
        self._allocate(max_tokens, hidden)

    def _agree(self, max_tokens: int, hidden: int, what: str) -> None:
        """Check, once per set-up or growth, that every rank has what decides the path of a call.

        The same call must take the same path on every rank (a fused kernel, or the group's
        all-reduce): the backend, the workspace's size, whether the kernels can run here, and the
        algorithm table (a tuned table or ``$TPFUSE_TUNE_TABLE`` present on one node only would make
        ranks choose differently). Raises :class:`agreement.Disagreement` naming the value and each
        rank's, on every rank; also serves as the barrier before a workspace is (re)allocated.
        """
        if self.world_size < 2:
            return
        agreement.exchange(self.group, self.device, {
            "record": agreement.SETUP,
            "backend": BACKENDS.index(self.backend),
            "compress": COMPRESSIONS.index(self.compress),
            "max_tokens": max_tokens,
            "hidden": hidden,
            "kernels usable": int(kernels_usable(self.device)),
            "algorithm table": int(self._table_digest(), 16),
            "fused calls captured in CUDA graphs": int(self._captured),
        }, self.wait_timeout_s, f"the {what} of the communicator of group {self.group_name!r}")

    def _table_digest(self) -> str:
        import hashlib
        import json

        table = select.algorithm_table(self.world_size, self.device).to_json()
        return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:12]

    def _allocate(self, max_tokens: int, hidden: int) -> None:
        self._plans.clear()
        self._allocate_backend(max_tokens, hidden)
        if self.fused_backend is not None:
            self._labels = {a: f"{self.fused_backend.name}.{a}" for a in select.ALGORITHMS}

    def _allocate_backend(self, max_tokens: int, hidden: int) -> None:
        if self.world_size < 2 or self.backend == "reference":
            return  # every call takes the reference path
        if not self._topology_checked:  # once: a group's hosts and GPUs do not change
            self._unreachable = topology.unreachable_peers(self.group, self.device, self.wait_timeout_s)
            self._topology_checked = True
        if self._unreachable is not None:
            return  # ranks on other hosts, or GPUs without peer access: the reference path (logged once)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"tpfuse: cannot allocate the workspace of group {self.group_name!r} during CUDA "
                "graph capture; call tpfuse.get_communicator(...) before capturing"
            )
        if self.backend == "flashinfer":
            if self.device.type != "cuda":
                raise ValueError(f"tpfuse: the flashinfer backend needs CUDA; group {self.group_name!r} "
                                 f"runs on {self.device}")
            from tpfuse.comm.flashinfer import FlashInferBackend

            self.fused_backend = FlashInferBackend(self.group, max_tokens, hidden)
        elif kernels_usable(self.device):  # else no Triton kernel can run here: the reference path
            from tpfuse.comm.triton_backend import TritonBackend

            self.fused_backend = TritonBackend(self.group, self.device, max_tokens * hidden,
                                               self.wait_timeout_s,
                                       fp8_wire=self.compress == "fp8")

    @property
    def wait_timeout_s(self) -> float:
        """Seconds a kernel waits for a peer before it gives up; a new value applies to later launches."""
        return self._wait_timeout_s

    @wait_timeout_s.setter
    def wait_timeout_s(self, seconds: float) -> None:
        self._wait_timeout_s = float(seconds)
        if self.fused_backend is not None:
            self.fused_backend.set_wait_timeout(self._wait_timeout_s)

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    @property
    def workspace_bytes(self) -> int:
        """Bytes one rank may send per call (0 without a workspace): the input of ``max_token_num``."""
        return self.fused_backend.region_bytes if self.fused_backend is not None else 0

    def max_token_num(self, hidden: int, dtype: torch.dtype) -> int:
        """Largest token count a fused call of this group can take (:func:`tpfuse.select.max_token_num`)."""
        return select.max_token_num(hidden, dtype, self.world_size, self.workspace_bytes, self.device)

    def fusion_signature(self) -> str:
        """What decides which calls of this group can fuse: backend, world size, workspace, table."""
        return (f"{self.group_name}:{self.backend}:{self.compress}:{self.world_size}:{self.workspace_bytes}:"
                f"{self._table_digest()}")

    def choose_algorithm(self, n_tokens: int, hidden: int, dtype: torch.dtype,
                         epilogue: Epilogue = PLAIN) -> str:
        """The algorithm a call of this group runs (see :func:`tpfuse.select.choose_algorithm`)."""
        if self.fused_backend is not None and not self.fused_backend.takes(n_tokens, epilogue):
            return select.REFERENCE
        return select.choose_algorithm(n_tokens, hidden, dtype, self.world_size, self.workspace_bytes,
                                       self.device)

    def plan(self, call: FusedCall) -> CallPlan:
        """How ``call`` runs: one fused call, fused calls of a number of rows each, or the reference path.

        Decided once per kind of call (row count, dtypes, hidden size, residual, block end) and kept
        until the workspace changes. A call over the fusion limit that the kernels could take in parts
        runs as fused calls of ``max_token_num`` rows (``CallPlan.chunk_rows``), when the backend's
        kernels compare the ranks' calls (ours): no rank ever waits in the group's all-reduce, which is
        bounded only by the process group's timeout on GPUs, and the calls stay checked. Calls the
        kernels cannot take (float32, a hidden size they do not support) take the reference path.
        """
        if self._plans_generation != select.tables_generation:  # a table was (re)loaded: plan afresh
            self._plans.clear()
            self._plans_generation = select.tables_generation
        key = (call.n_tokens, call.kernel_key())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(call)
        return plan

    def _plan(self, call: FusedCall) -> CallPlan:
        hidden, dtype = call.hidden, call.x.dtype
        algorithm = self.choose_algorithm(call.n_tokens, hidden, dtype, call.epilogue)
        if call.sharded:
            return self._plan_sharded(call, algorithm)
        if algorithm != select.REFERENCE:
            return CallPlan(algorithm, launch=self.fused_backend.launcher(algorithm, call))
        if self.fused_backend is None or not self.fused_backend.compares_calls:
            return CallPlan(algorithm)
        limit = self.max_token_num(hidden, dtype)
        if 0 < limit < call.n_tokens and self.fused_backend.takes(limit, call.epilogue):
            return CallPlan(select.CHUNKED, chunk_rows=limit)
        return CallPlan(algorithm)

    def _plan_sharded(self, call: FusedCall, algorithm: str) -> CallPlan:
        """A sharded call (sequence parallel) runs on the two-shot, whose rows have owners, where the
        backend shards rows (``FusedBackend.shards_rows``); over the fusion limit as sharded parts of
        whole rows a rank, or the reference path (``ops.route``: gathered) where no part fits."""
        if self.fused_backend is None or not self.fused_backend.shards_rows:
            return CallPlan(select.REFERENCE)
        if algorithm != select.REFERENCE:
            return CallPlan(select.TWOSHOT, launch=self.fused_backend.launcher(select.TWOSHOT, call))
        limit = self.max_token_num(call.hidden, call.x.dtype) // self.world_size  # a part's rows a rank
        if 0 < limit and call.epilogue.output.scales_by_rows and self.choose_algorithm(
                limit * self.world_size, call.hidden, call.x.dtype, call.epilogue) != select.REFERENCE:
            return CallPlan(select.CHUNKED, chunk_rows=limit)
        return CallPlan(select.REFERENCE)

    def run_fused(self, call: FusedCall, plan: CallPlan) -> str:
        """Run a call with the fused kernel of its plan (:meth:`plan`'s, route ``select.ONESHOT`` or
        ``TWOSHOT``); return its stats label (``"<backend>.<algorithm>"``).

        One thread at a time: a call made while another thread's call of this communicator is running
        raises. Serialising them would not do: each rank would pair its calls with the peers' in
        whatever order its threads happened to run, and mismatched calls give garbage or time out.
        """
        if not self._captured and _capturing(self.device):
            self._captured = True
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"tpfuse: group {self.group_name!r} rank {self.rank}: a fused call came from a second thread "
                "while one was running; a communicator serves one thread at a time (give each thread its "
                "own process group and communicator)")
        try:
            plan.launch(call)
        finally:
            self._busy.release()
        return self._labels[plan.route]

    def check_usable(self) -> None:
        """Raise if this communicator was destroyed or a kernel of it timed out."""
        if self._destroyed:
            raise RuntimeError(f"tpfuse: the communicator of group {self.group_name!r} was destroyed")
        if self._error is not None:
            raise RuntimeError(self._error)

    def check_errors(self, waited_s: float | None = None) -> None:
        """Raise if a fused call of this group failed (reads the device's error entry).

        A fused call fails when a peer's call differs from ours (its shape, dtype, residual, fp8
        output, algorithm or workspace: every kernel compares the peers' call descriptors with its own)
        or when a wait for a peer ran out (a rank stalled or died, or made no fused call). Its rows of
        ``y`` and ``h`` are NaN, never plausible data. On a GPU this synchronises with the device, so
        call it where you synchronise anyway (after a decode step, say); on the CPU and with
        ``TPFUSE_DEBUG=1`` every call checks by itself (``waited_s``: how long that call took). After
        a failure the workspace holds data of an unfinished call: the communicator stays unusable
        (every later call raises) until it is destroyed and created again, on every rank.
        """
        self.check_usable()
        failure = self.fused_backend.failure(self.wait_timeout_s,
                                             waited_s) if self.fused_backend is not None else None
        if failure is not None:
            self._error = (f"tpfuse: group {self.group_name!r} rank {self.rank}: {failure}. Its outputs are "
                           "NaN. Destroy this communicator and create a new one, on every rank.")
            raise RuntimeError(self._error)

    def check_call_matches(self, call: CallDescription, algorithm: str) -> None:
        """Compare this call with every rank's (a bounded exchange); raise naming any difference.

        For backends whose kernels do not compare calls themselves (``FusedBackend.compares_calls``),
        in debug mode.
        """
        agreement.exchange(self.group, self.device, {
            "record": agreement.FUSED_CALL, **call.fields(), "algorithm": select.ALGORITHMS.index(algorithm),
        }, self.wait_timeout_s, f"a fused call ({call.tokens} x {call.hidden})")

    def ensure_capacity(self, max_tokens: int, hidden: int) -> None:
        """Grow the workspace to hold ``max_tokens`` rows of ``hidden`` (collective when it grows)."""
        self.check_usable()
        if self.workspace_bytes == 0 or max_tokens * hidden * 2 <= self.workspace_bytes:
            return
        if self.device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"tpfuse: cannot grow the workspace of group {self.group_name!r} during CUDA graph "
                    "capture; size it with tpfuse.get_communicator(max_tokens=..., hidden=...) first"
                )
            torch.cuda.synchronize(self.device)
        # Also the barrier: no peer may still be pushing into the old buffers.
        self._agree(max_tokens, hidden, "growth")
        self._release()
        self._allocate(max_tokens, hidden)

    def _release(self) -> None:
        """Let go of the workspace: freed, or kept until exit where a captured CUDA graph may use it.

        A graph captured with fused calls replays them into the buffers, peer table and state it was
        captured with. Freed, that memory could go to other tensors, which a replay would then
        overwrite; kept, a replay still finds its own workspace (and its peers', kept the same way:
        every rank captures the same calls, which the growth's agreement checks) and computes right.
        """
        self._plans.clear()
        if self.fused_backend is not None:
            if self._captured:
                with _registry_lock:
                    _kept_for_graphs.append(self.fused_backend)
                log.info("tpfuse: group %s rank %d: its workspace is kept until exit (%d bytes a region): "
                         "CUDA graphs captured with its fused calls may replay into it", self.group_name,
                         self.rank, self.fused_backend.region_bytes)
            else:
                self.fused_backend.release()
        self.fused_backend = None

    def destroy(self) -> None:
        """Free the workspace and leave the registry. Idempotent; not collective, so safe at exit."""
        with _registry_lock:
            if self._destroyed:
                return
            self._destroyed = True
            if _registry.get(self.group_name) is self:
                del _registry[self.group_name]
        if self.device.type == "cuda" and self.workspace_bytes:
            torch.cuda.synchronize(self.device)  # our kernels may still use the buffers
        self._release()
        for forget in _forgetters:
            forget(self)

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else f"workspace_bytes={self.workspace_bytes}"
        return (f"Communicator(group={self.group_name!r}, rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device}, backend={self.backend!r}, compress={self.compress!r}, {state})")


def check_sizes(max_tokens: int | None, hidden: int | None, wait_timeout_s: float | None) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first bad size (before anything is allocated)."""
    for name, value in (("max_tokens", max_tokens), ("hidden", hidden)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"tpfuse: {name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"tpfuse: {name} must be >= 1, got {value}")
    if hidden is not None and hidden % select.HIDDEN_MULTIPLE:
        raise ValueError(f"tpfuse: hidden must be a multiple of {select.HIDDEN_MULTIPLE} (the kernels move "
                         f"rows 16 bytes at a time), got {hidden}")
    if wait_timeout_s is not None and not (isinstance(wait_timeout_s, numbers.Real) and
                                           math.isfinite(wait_timeout_s) and wait_timeout_s > 0):
        raise ValueError(f"tpfuse: wait_timeout_s must be a finite number of seconds > 0, "
                         f"got {wait_timeout_s!r}")


def get_communicator(
    group: dist.ProcessGroup | None = None,
    *,
    max_tokens: int | None = None,
    hidden: int | None = None,
    backend: str | None = None,
    wait_timeout_s: float | None = None,
    compress: str | None = None,
) -> Communicator:
    """Return the one communicator of ``group``, creating it on first use.

    Creating or growing is collective: every rank of the group must make the same call. A second
    call returns the same object; with a larger ``max_tokens * hidden`` than it holds, it grows the
    workspace first. Getting a communicator is thread-safe; its fused calls come from one thread at a
    time (a call from a second thread while one runs raises, see :meth:`Communicator.run_fused`).

    Parameters
    ----------
    group : ProcessGroup, optional
        The default group when None.
    max_tokens, hidden : int, optional
        Size the workspace for calls of up to ``max_tokens`` rows of ``hidden`` 16-bit elements
        (defaults 512 and 8192: 8 MiB a rank a slot). Positive ints; ``hidden`` a multiple of 8.
    backend : str, optional
        ``"triton"`` (default), ``"flashinfer"`` or ``"reference"``; ``$TPFUSE_BACKEND`` sets the
        default. Fixed when the communicator is created: asking for another one later raises.
    wait_timeout_s : float, optional
        How long a kernel waits for a peer before it gives up and flags an error (default 10 s, or
        ``$TPFUSE_WAIT_TIMEOUT_S``); see :meth:`Communicator.check_errors`.
    compress : str, optional
        ``"fp8"``: two-shot calls (the large ones) send x and the reduced sum as fp8 with a scale per
        128 elements, about half the bytes, within the error bound of :mod:`tpfuse.kernels.wire`;
        off (exact) by default. Triton backend only; hidden sizes that are not a multiple of 128, and
        one-shot calls, stay exact. Fixed when the communicator is created.
    """
    check_sizes(max_tokens, hidden, wait_timeout_s)
    max_tokens, hidden = (None if v is None else int(v) for v in (max_tokens, hidden))  # numpy ints too
    group = resolve_group(group)
    chosen = backend or os.environ.get("TPFUSE_BACKEND") or "triton"
    if chosen not in BACKENDS:
        raise ValueError(f"tpfuse: unknown backend {chosen!r}; choose one of {', '.join(BACKENDS)}")
    if compress not in COMPRESSIONS:
        raise ValueError(f"tpfuse: unknown compress {compress!r}; choose None or 'fp8'")
    if compress is not None and chosen != "triton":
        raise ValueError(f"tpfuse: compress={compress!r} needs the triton backend, not {chosen!r}")
    with _registry_lock:
        comm = _registry.get(group.group_name)
        if comm is None:
            comm = Communicator(group, max_tokens or DEFAULT_MAX_TOKENS, hidden or DEFAULT_HIDDEN, chosen,
                                wait_timeout_s, compress)
            _registry[group.group_name] = comm
            return comm
        if backend is not None and comm.backend != backend:
            raise ValueError(f"tpfuse: group {group.group_name!r} already has a communicator with backend "
                             f"{comm.backend!r}; destroy it before asking for {backend!r}")
        if compress is not None and comm.compress != compress:
            raise ValueError(f"tpfuse: group {group.group_name!r} already has a communicator with compress="
                             f"{comm.compress!r}; destroy it before asking for {compress!r}")
        if max_tokens is not None or hidden is not None:
            comm.ensure_capacity(max_tokens or DEFAULT_MAX_TOKENS, hidden or DEFAULT_HIDDEN)
        if wait_timeout_s is not None:  # applies to calls launched from now on (not to captured graphs)
            comm.wait_timeout_s = float(wait_timeout_s)
        return comm


def lookup_communicator(group_name: str) -> Communicator | None:
    """The registered communicator of a group, or None; never creates one (used by the op and pass)."""
    return _registry.get(group_name)  # one dict read is atomic; every write holds _registry_lock


def fusion_signature() -> str:
    """:meth:`Communicator.fusion_signature` of every registered communicator (the pass's cache key)."""
    with _registry_lock:
        comms = sorted(_registry.values(), key=lambda c: c.group_name)
    return ";".join(comm.fusion_signature() for comm in comms)


def check_errors() -> None:
    """:meth:`Communicator.check_errors` for every registered communicator."""
    with _registry_lock:
        comms = list(_registry.values())
    for comm in comms:
        comm.check_errors()


def destroy_all() -> None:
    """Destroy every registered communicator (also run at interpreter exit)."""
    with _registry_lock:
        comms = list(_registry.values())
    for comm in comms:
        comm.destroy()


def _release_kept_for_graphs() -> None:
    """At exit: no graph replays any more; free the workspaces kept for them."""
    with _registry_lock:
        kept = list(_kept_for_graphs)
        _kept_for_graphs.clear()
    for backend in kept:
        backend.release()


atexit.register(_release_kept_for_graphs)  # atexit runs last-registered first: after destroy_all
atexit.register(destroy_all)
