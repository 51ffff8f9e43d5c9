"""Bridges from rollwire's rows to the training frameworks people use (TRL in ``trl.py``; one module per
framework). Each imports its framework lazily, inside the functions that need it, so rollwire itself never
depends on one: ``pip install 'rollwire[trl]'`` brings TRL. docs/training.md is the way to train."""
