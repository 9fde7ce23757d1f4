"""Lecture 01: where the bytes of training go (model states, activations), predicted and measured; its job."""
