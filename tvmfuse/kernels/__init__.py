"""Kernel generators, one folder per op: a problem/config spec and the code that builds its PrimFunc."""
