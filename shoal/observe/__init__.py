"""Seeing what a job does: events and the timeline (events.py, timeline.py), the flight recorder for
hangs (flight.py), metrics as JSON lines (metrics.py), progress in a terminal or a log (progress.py),
and the tools that read traces after a run (`shoal trace ...`).

events.py and flight.py import nothing of shoal's: they are the hooks the communication layer reports
through, and sit below it; the rest consumes what they gather.
"""
