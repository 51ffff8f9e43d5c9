"""The proxy as a tier of processes: what they share through the log so that any can serve any call."""
