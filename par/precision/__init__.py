"""Lecture 05: floating-point formats, loss scaling, the eight steps of mixed precision; its job."""
