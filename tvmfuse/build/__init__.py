"""Build and export: nvcc ahead of time, fatbin inside one .so with metadata."""

from .export import export_library
from .nvcc import compile_fatbin, find_nvcc

__all__ = ["compile_fatbin", "export_library", "find_nvcc"]
