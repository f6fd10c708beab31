"""What a block end means: the steps a fused call takes around the sum of its ranks' rows, in torch.

The Triton kernels (``tpfuse.kernels``) compute it, the ops check and route it, the compiler finds it in
graphs; this package says what it is, and needs no Triton. Its modules import one way, each only from
those above it in this list::

    bits        the numbers: keyword codes, kernel switch codes, the call descriptor's flags word
    codecs      fp8 / e2m1 / e8m0 codes and the orders their scales are placed in
    stages      the typed stages (Finalize, Bias, PostNorm, RmsNorm / LayerNorm / NoNorm / RmsNormBackward,
                NormedCopy)
    outputs     y's formats (Unquantised, StaticFp8, DynamicFp8, NvFp4, MxFp4): the last stage
    epilogue    Epilogue (the op's flat keywords), its Stages, the kernels' Switches and StepTensors
    call        FusedCall (one call as one value), its description and the descriptor in words
    reference   the torch reference of a call, and the float64 oracle of the tests
    gradient    the block end's backward in torch: what each input receives (docs/training.md)

The package itself imports none of them (``tpfuse.blockend.epilogue`` and the others are imported by
name), so importing one module never runs another that imports it.
"""
