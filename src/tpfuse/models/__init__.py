"""Models written the way users write them: they never call tpfuse; the compiler pass finds the sites."""

from tpfuse.models.llama import PRESETS, ModelArgs, Transformer

__all__ = ["PRESETS", "ModelArgs", "Transformer"]
