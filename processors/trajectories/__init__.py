"""The trajectory worker (a Faust app, app.py): completions and session events in, one Trajectory per session out."""
