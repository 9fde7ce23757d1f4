"""Lecture 06: ZeRO stages 0-3 (flat partitions, units, updaters), offload, ZeRO-R, sharded checkpoints, torch's ZeRO/FSDP2; jobs and benchmark."""
