"""Lecture 09: mixture of experts (router, capacity, balancing loss) and expert parallelism (all-to-all dispatch); its job."""
