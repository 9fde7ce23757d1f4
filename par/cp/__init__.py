"""Lecture 08: context parallelism (ring attention); the lecture's job measures SP (par.tp.sequence) and CP beside the dense model."""
