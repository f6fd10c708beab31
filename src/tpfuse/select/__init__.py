"""Which calls the fused kernels take: the one place that decides the fusion limit.

Every backend, the op's dispatcher and the compiler pass ask :func:`max_token_num`; nothing else
computes a token limit.
"""

from __future__ import annotations

import torch

#: dtypes the Triton kernels accept (16-bit floats: the sentinel protocol works on 16-bit words).
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
#: The kernels keep a whole row in one program's registers.
MAX_KERNEL_HIDDEN = 16384
HIDDEN_MULTIPLE = 8

# Bytes one rank may send per call through the one-shot algorithm before it stops paying off: a
# one-shot moves (W - 1) copies of every rank's data, so the bound shrinks with the world size.
# Conservative defaults until `tune` (a later issue) measures the crossovers on the user's machine.
_ONESHOT_MAX_BYTES_PER_RANK = {2: 8 << 20, 3: 6 << 20, 4: 4 << 20, 8: 2 << 20}
_ONESHOT_MAX_BYTES_FALLBACK = 1 << 20


def kernel_supports(hidden: int, dtype: torch.dtype) -> bool:
    """Whether the kernels can take rows of ``hidden`` elements of ``dtype`` at all."""
    return dtype in KERNEL_DTYPES and 0 < hidden <= MAX_KERNEL_HIDDEN and hidden % HIDDEN_MULTIPLE == 0


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
        The device the call runs on; reserved for per-device tables.

    Returns
    -------
    int
        The limit: calls with at most this many tokens run fused, larger ones take the reference
        path (or, for the compiler pass, the unfused graph).
    """
    del device  # one table for every device until per-device tables are measured
    if world_size < 2 or workspace_bytes <= 0 or not kernel_supports(hidden, dtype):
        return 0
    row_bytes = hidden * torch.empty((), dtype=dtype).element_size()
    by_workspace = workspace_bytes // row_bytes
    by_algorithm = _ONESHOT_MAX_BYTES_PER_RANK.get(world_size, _ONESHOT_MAX_BYTES_FALLBACK) // row_bytes
    return int(min(by_workspace, by_algorithm))

