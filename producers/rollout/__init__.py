"""The rollout server (TaskRequest API → sessions on Kafka, status, callbacks), `rollwire submit`, and the
main job's live display (the job itself composes the whole stack: deploy/job.py)."""
