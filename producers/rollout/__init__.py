"""The rollout server (TaskRequest API → sessions on Kafka, status, callbacks), `rollwire submit`, and
the main job `rollwire rollout` that brings up the stack, runs a tasks file and summarizes it."""
