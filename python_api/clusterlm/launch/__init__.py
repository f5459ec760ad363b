"""Processes: the launcher and its agent, rank start, the process group, failures, hangs and preemption."""
