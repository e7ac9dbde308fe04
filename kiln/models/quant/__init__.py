"""Quantized linear weights: the FP8 scheme (online and from checkpoints) used by kiln/models/layers.py."""
