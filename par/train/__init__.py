"""Lecture 07: one loop that stacks DP/ZeRO, PP and TP from a DeepSpeed-style config, 3D parallelism, the planner, placement; jobs and the suite."""
