"""What a run records and how it is looked at: each step's metrics line, the timeline of events and
the console's live view (steps.py), learning curves (curves.py) and the Gantt panels of a timeline
(gantt.py)."""
