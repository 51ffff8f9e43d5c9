"""Support code the tests share: the stand-in engine (a test double of vLLM's server built from its recorded
replies) and the helpers more than one test module uses."""
