"""Attention kernels: the problem (``spec``) and its generators.

sm_90a (``flash_sm90``), sm_80 (``flash_sm80``), split-KV decode, CUDA-core fallback, CPU.
"""
