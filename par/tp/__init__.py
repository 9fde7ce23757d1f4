"""Lecture 04: Megatron tensor parallelism (the f/g operators, the layers) and sequence parallelism on top; its job and benchmark."""
