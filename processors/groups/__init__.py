"""GRPO groups: a task's samples joined with their rewards, with advantages (a Faust worker, app.py)."""
