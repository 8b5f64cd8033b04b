"""The training process (`python -m worker.training.train`) and the analyzer it shares code with."""
