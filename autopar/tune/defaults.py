"""Defaults of the measured path that the CLI names without importing torch."""

DEFAULT_CALIBRATION_MODEL = "gpt:layers=4,hidden=128,heads=4,seq=128,vocab=512,dropout=0.0"
"""The small built-in model `autopar profile` calibrates on unless told otherwise (--calibrate
MODEL, --no-calibrate): every mesh of 2, 4 or 8 processes divides its 4 layers and 4 heads
(pp, tp up to 4), and a step takes a fraction of a second on a CPU, so the fixed set of
configurations (calibrate.calibration_configs) runs in a few minutes."""
