r"""Fused backends of the codec: the CPU stages in C (:mod:`~hhook.codec.kernels.cpu`,
``csrc/thc_cpu.c``) and the CUDA kernels (:mod:`~hhook.codec.kernels.cuda`,
``csrc/thc_kernels.cu``), each with the signatures of :class:`hhook.codec.THCCodec`'s
stages and tested bit for bit against them. They read the codec's formats
(:mod:`hhook.codec.layout`, :mod:`hhook.codec.rng`), never the codec object, which
dispatches to them."""
