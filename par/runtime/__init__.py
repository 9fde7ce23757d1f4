"""Processes: bootstrap, preflight checks, the launcher, the 3D grid, NCCL's rules emulated on gloo, a cluster on one machine."""
