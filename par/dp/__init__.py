"""Lecture 02: data parallelism, naive and bucketed with overlap, compression, the batch identity, gossip; its job and benchmark."""
