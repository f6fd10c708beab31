"""Which calls the fused kernels take, and which algorithm each one runs.

The one place that decides the fusion limit: every backend, the op's dispatcher and the compiler
pass ask :func:`max_token_num`; per call, :func:`choose_algorithm` picks one-shot, two-shot or the
reference path from an :class:`AlgorithmTable`.

Tables are JSON files named ``<device>-w<world size>.json`` (``nvidia-h200-w2.json``). They are
looked up, first found wins, in:

1. the file named by ``$TPFUSE_TUNE_TABLE``;
2. ``$TPFUSE_TABLE_DIR`` or, when that is unset, ``~/.cache/tpfuse/tables`` (where
   ``python -m tpfuse tune`` writes);
3. the tables shipped in ``tpfuse/select/tables`` (measured by us);
4. conservative defaults (:data:`DEFAULT_ONESHOT_MAX_BYTES`, :data:`DEFAULT_FUSED_MAX_BYTES`; on ROCm
   the smaller :data:`ROCM_ONESHOT_MAX_BYTES`, :data:`ROCM_FUSED_MAX_BYTES`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

ONESHOT, TWOSHOT, REFERENCE = "oneshot", "twoshot", "reference"
ALGORITHMS = (ONESHOT, TWOSHOT, REFERENCE)
#: Where a call goes (``tpfuse.ops.route``): the block end alone (a group of one rank), one fused call of
#: either kernel, fused calls of the workspace's rows (a call larger than it), or the reference path.
LOCAL, CHUNKED = "local", "chunked"
ROUTES = (LOCAL, ONESHOT, TWOSHOT, CHUNKED, REFERENCE)

#: dtypes the Triton kernels accept (16-bit floats: the sentinel protocol works on 16-bit words).
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
#: The kernels keep a whole row in one program's registers.
MAX_KERNEL_HIDDEN = 16384
HIDDEN_MULTIPLE = 8
ELEMENT_BYTES = 2

# Defaults for devices and world sizes nobody measured, in bytes of x per rank. A one-shot moves W-1
# copies of every rank's data and a two-shot about two, so the one-shot's share shrinks with W.
DEFAULT_ONESHOT_MAX_BYTES = {2: 1 << 20, 3: 512 << 10, 4: 512 << 10, 8: 256 << 10}
DEFAULT_ONESHOT_MAX_BYTES_OTHER = 256 << 10
DEFAULT_FUSED_MAX_BYTES = 8 << 20
# ROCm (AMD Instinct, MI300X / MI355X): nothing has been measured on AMD hardware yet, so smaller limits
# than NVIDIA's defaults (no H200 numbers): a pair of MI300X GPUs is joined by one xGMI link, a fraction
# of NVLink's bandwidth, which favours the two-shot and the group's all-reduce sooner. ``tune`` replaces
# them with measured ones.
ROCM_ONESHOT_MAX_BYTES = {2: 512 << 10, 3: 256 << 10, 4: 256 << 10, 8: 128 << 10}
ROCM_ONESHOT_MAX_BYTES_OTHER = 128 << 10
ROCM_FUSED_MAX_BYTES = 2 << 20

SHIPPED_TABLES = Path(__file__).parent / "tables"


def kernel_supports(hidden: int, dtype: torch.dtype) -> bool:
    """Whether the kernels can take rows of ``hidden`` elements of ``dtype`` at all."""
    return dtype in KERNEL_DTYPES and 0 < hidden <= MAX_KERNEL_HIDDEN and hidden % HIDDEN_MULTIPLE == 0


@dataclass(frozen=True)
class AlgorithmTable:
    """Where each algorithm wins on one kind of device and world size.

    ``limits[hidden] = (oneshot_max_tokens, fused_max_tokens)``: the one-shot serves calls of up to
    the first count, the two-shot those up to the second, the reference path the rest. A hidden size
    the table lacks takes the nearest listed one's limits, scaled to the same bytes per rank. A table
    without limits takes the defaults: NVIDIA's, or the smaller ROCm ones (``rocm``).
    """

    device: str
    world_size: int
    limits: dict[int, tuple[int, int]] = field(default_factory=dict)
    source: str = "defaults"
    rocm: bool = False

    def token_limits(self, hidden: int) -> tuple[int, int]:
        """(oneshot_max_tokens, fused_max_tokens) for rows of ``hidden`` 16-bit elements."""
        if hidden in self.limits:
            return self.limits[hidden]
        if not self.limits:
            if self.rocm:
                oneshot = ROCM_ONESHOT_MAX_BYTES.get(self.world_size, ROCM_ONESHOT_MAX_BYTES_OTHER)
                fused = ROCM_FUSED_MAX_BYTES
            else:
                oneshot = DEFAULT_ONESHOT_MAX_BYTES.get(self.world_size, DEFAULT_ONESHOT_MAX_BYTES_OTHER)
                fused = DEFAULT_FUSED_MAX_BYTES
            row = hidden * ELEMENT_BYTES
            return oneshot // row, fused // row
        nearest = min(self.limits, key=lambda h: abs(math.log(h / hidden)))
        return tuple(t * nearest // hidden for t in self.limits[nearest])

    def choose(self, n_tokens: int, hidden: int) -> str:
        """The algorithm this table gives a call, before the workspace's own limit.

        Fewer tokens than ranks always take the one-shot: the two-shot needs a row for every rank.
        """
        oneshot_max, fused_max = self.token_limits(hidden)
        if n_tokens <= oneshot_max or n_tokens < self.world_size:
            return ONESHOT
        return TWOSHOT if n_tokens <= fused_max else REFERENCE

    def to_json(self, **extra) -> dict:
        return {"device": self.device, "world_size": self.world_size,
                "hidden": {str(h): {"oneshot_max_tokens": a, "fused_max_tokens": b}
                           for h, (a, b) in sorted(self.limits.items())}, **extra}

    @classmethod
    def from_json(cls, data: dict, source: str) -> AlgorithmTable:
        limits = {int(h): (int(v["oneshot_max_tokens"]), int(v["fused_max_tokens"]))
                  for h, v in data["hidden"].items()}
        for hidden, (oneshot, fused) in limits.items():
            if not 0 <= oneshot <= fused:
                raise ValueError(
                    f"{source}: hidden {hidden}: need 0 <= oneshot_max_tokens <= fused_max_tokens")
        return cls(data["device"], int(data["world_size"]), limits, source)


def device_slug(device: torch.device | str | None) -> str:
    """The name tables are filed under: ``nvidia-h200`` for an NVIDIA H200, ``cpu`` for the CPU."""
    device = torch.device(device or "cpu")
    if device.type != "cuda":
        return device.type
    return _cuda_slug(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_slug(index: int) -> str:
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(index).lower()).strip("-")


def user_table_dir() -> Path:
    """Where ``tune`` writes tables and where they are found first."""
    return Path(os.environ.get("TPFUSE_TABLE_DIR") or Path.home() / ".cache" / "tpfuse" / "tables")


def table_filename(slug: str, world_size: int) -> str:
    return f"{slug}-w{world_size}.json"


@functools.cache
def _load_table(slug: str, world_size: int, override: str | None, environment: tuple,
                rocm: bool = False) -> AlgorithmTable:
    # ``environment`` holds what user_table_dir() reads, so the cache notices when it changes.
    name = table_filename(slug, world_size)
    for path in ([Path(override)] if override else []) + [user_table_dir() / name, SHIPPED_TABLES / name]:
        if path.is_file():
            table = AlgorithmTable.from_json(json.loads(path.read_text()), str(path))
            if table.world_size != world_size:
                raise ValueError(f"{path} is a table for {table.world_size} ranks, not {world_size}")
            return table
    if rocm:
        return AlgorithmTable(slug, world_size, source="ROCm defaults (not measured on AMD hardware; run "
                              "python -m tpfuse tune)", rocm=True)
    return AlgorithmTable(slug, world_size)


def algorithm_table(world_size: int, device: torch.device | str | None = None) -> AlgorithmTable:
    """The table in force for ``world_size`` ranks on ``device`` (see the module docstring for the search).

    Called for every fused call, so it only reads the environment; the search runs once per setting.
    """
    environment = (os.environ.get("TPFUSE_TABLE_DIR"), os.environ.get("HOME"))
    rocm = torch.version.hip is not None and torch.device(device or "cpu").type == "cuda"
    override = os.environ.get("TPFUSE_TUNE_TABLE")
    return _load_table(device_slug(device), world_size, override, environment, rocm)


#: Incremented by :func:`reload_tables`: communicators keep their per-call decisions until it changes.
tables_generation = 0


def reload_tables() -> None:
    """Forget loaded tables, so that a newly written one (or a changed ``$TPFUSE_TUNE_TABLE``) is used,
    also by communicators that already exist."""
    global tables_generation
    _load_table.cache_clear()
    tables_generation += 1


def max_token_num(
    hidden: int,
    dtype: torch.dtype,
    world_size: int,
    workspace_bytes: int,
    device: torch.device | str | None = None,
) -> int:
    """Largest token count a fused call can take; 0 when none can.

    Parameters
    ----------
    hidden : int
        Row length (the model's hidden size).
    dtype : torch.dtype
        Element type of the rows.
    world_size : int
        Ranks in the group.
    workspace_bytes : int
        Bytes of the communicator's per-rank region (what one rank can send in one call), as
        reported by :attr:`tpfuse.comm.Communicator.workspace_bytes`; 0 for no workspace.
    device : torch.device or str, optional
        The device the call runs on: it picks the algorithm table.

    Returns
    -------
    int
        The limit: calls with at most this many tokens run fused, larger ones take the reference
        path (or, for the compiler pass, the unfused graph).
    """
    return _limit_and_table(hidden, dtype, world_size, workspace_bytes, device)[0]


def _limit_and_table(hidden, dtype, world_size, workspace_bytes, device) -> tuple[int, AlgorithmTable | None]:
    """The fusion limit and the table it came from (None when nothing can be fused): one table lookup."""
    if world_size < 2 or workspace_bytes <= 0 or not kernel_supports(hidden, dtype):
        return 0, None
    table = algorithm_table(world_size, device)
    _, fused_max = table.token_limits(hidden)
    return int(min(workspace_bytes // (hidden * ELEMENT_BYTES), fused_max)), table


def choose_algorithm(
    n_tokens: int,
    hidden: int,
    dtype: torch.dtype,
    world_size: int,
    workspace_bytes: int,
    device: torch.device | str | None = None,
) -> str:
    """:data:`ONESHOT`, :data:`TWOSHOT` or :data:`REFERENCE` for a call.

    Same arguments as :func:`max_token_num`; calls over it take the reference path, the rest what the
    table gives (:meth:`AlgorithmTable.choose`).
    """
    limit, table = _limit_and_table(hidden, dtype, world_size, workspace_bytes, device)
    if table is None or n_tokens > limit:
        return REFERENCE
    return table.choose(n_tokens, hidden)
