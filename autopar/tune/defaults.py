"""Defaults of the measured path that the CLI names without importing torch."""

_CALIBRATION_GPT = "gpt:layers=4,hidden=128,heads=4,seq={seq},vocab=512,dropout=0.0"

DEFAULT_CALIBRATION_MODELS = (_CALIBRATION_GPT.format(seq=128), _CALIBRATION_GPT.format(seq=256))
"""The small built-in models `autopar profile` calibrates on unless told otherwise (--calibrate
MODEL, repeatable; --no-calibrate): every mesh of 2, 4 or 8 processes divides their 4 layers and
4 heads (pp, tp up to 4), and a step takes a fraction of a second on a CPU, so the fixed set of
configurations (calibrate.calibration_configs) runs in a few minutes.

Two sequence lengths, one fit: with one model every configuration moves messages of one size
per kind, so a multiplier on the collectives' predicted time (per byte) and a cost per call
are collinear and the fit may explain all of it with either; a model whose messages are larger
is then priced with whatever the fit chose. The second model doubles every activation message
(tensor-parallel collectives, pipeline sends) and the compute at the same counts of calls and
ops, which separates the per-byte from the per-call terms, and the compute multiplier from the
per-op dispatch."""
