"""Lecture 10: one device used well: the measured roofline, MFU and HFU, par's fast path timed beside a nanoGPT-style reference."""
