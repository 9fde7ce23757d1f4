"""Lecture 03: pipeline schedules as data, their point-to-point plan, checker and simulator, the runtime, torch's pipelining; jobs and benchmark."""
