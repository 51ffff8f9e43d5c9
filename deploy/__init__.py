"""Deployment: the local Apache Kafka and model engine launchers, the `rollwire` CLI, and the compose file."""
