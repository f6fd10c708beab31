"""torch.compile integration: the fusion pass and the token-range-splitting backend.

    model = tpfuse.compile(model)                                        # or
    model = torch.compile(model, backend=tpfuse.compiler.TpfuseBackend())
    print(tpfuse.explain(model, *example_inputs))  # each all-reduce site: fused, or why not

The backend compiles each graph twice with Inductor: once with :class:`FusionPass` for token counts
up to the fusion limit (``tpfuse.select.max_token_num`` of every site's group, dtype and hidden
size) and once unchanged for larger ones, and picks by the token count of each call: the product of
all dims but the last of the all-reduced tensors (``[tokens, hidden]`` or ``[batch, seq, hidden]``).
"""

from __future__ import annotations

from tpfuse.compiler.backend import (
    CompiledFunction,
    CompiledModel,
    Explanation,
    TpfuseBackend,
    compile,
    compile_config,
    explain,
    inductor_options_for_mode,
)
from tpfuse.compiler.fusion_pass import FusionPass, SiteReport
from tpfuse.compiler.patterns import PATTERNS, FusionPattern, Match

__all__ = ["CompiledFunction", "CompiledModel", "Explanation", "FusionPass", "FusionPattern", "Match",
           "PATTERNS", "SiteReport",
           "TpfuseBackend", "compile", "compile_config", "explain", "inductor_options_for_mode"]
