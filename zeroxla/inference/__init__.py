"""Inference: generation from a trained model (the Hybrid Engine lives here)."""
