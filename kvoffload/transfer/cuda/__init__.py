"""The GPU data plane: CUDA copy backends (``dma``, ``sm``, ``staged``) and their driver binding.

Importing this package is light; torch, Triton and the CUDA driver are loaded by the modules that
need them (``driver`` needs only ctypes and numpy). See ``docs/transfer.md``.
"""
