"""Lecture 00: collectives written by hand (the ring), coalesced rings, the communication thread, the byte log; its job and benchmark."""
