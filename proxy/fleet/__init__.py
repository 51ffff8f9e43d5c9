"""The engines behind the proxy: the pool, where each call goes, their health, and weights sent to all."""
