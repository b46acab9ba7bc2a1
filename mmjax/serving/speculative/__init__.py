"""Speculative decoding: proposers guess the next tokens of decoding requests (`proposers.py`), the model
verifies them in its one ragged step and keeps what the target distribution allows (`verify.py`)."""
