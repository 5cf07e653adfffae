"""raytrain: raw post-training data to a trained Mistral model on one Ray cluster."""

__version__ = "0.1.0"
