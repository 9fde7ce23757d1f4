"""Lectures 07 and 07b: one loop that stacks DP/ZeRO, PP and TP from a DeepSpeed-style config, 3D parallelism, the planner, placement (07b); jobs and the suite."""
