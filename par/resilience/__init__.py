"""Lecture 11: when things break: the checkpoint interval (Young/Daly) and resuming on another layout."""
