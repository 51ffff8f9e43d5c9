"""Sinks: consumers that leave Kafka (online trainer feed, SFT store, replay and export)."""
