"""Deployment: the local Apache Kafka launcher, the `rollwire` CLI, and compose files for clusters."""
