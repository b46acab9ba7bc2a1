"""Training: the loop, the jitted step, state init, evaluation through the serving engine, pipeline parallelism."""
