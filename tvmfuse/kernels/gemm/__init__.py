"""Hopper (sm_90a) kernels written in TIRx: TMA, mbarriers, wgmma."""
