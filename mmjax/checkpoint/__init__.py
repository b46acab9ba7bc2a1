"""Checkpoints: Orbax train-state save/restore/reshard and Hugging Face conversion both ways.

Imported by training and serving; imports neither."""
