"""Defaults of the measured path that the CLI names without importing torch."""

DEFAULT_CALIBRATION_MODELS = ("gpt:layers=4,hidden=128,heads=4,seq=128,vocab=512,dropout=0.0",)
"""The small built-in model `autopar profile` calibrates on unless told otherwise (--calibrate
MODEL, repeatable for one fit over several; --no-calibrate): every mesh of 2, 4 or 8 processes
divides its 4 layers and 4 heads (pp, tp up to 4), and a step takes a fraction of a second on a
CPU, so the fixed set of configurations (calibrate.calibration_configs) runs in about a minute.

One model, not two sizes of it: fitting the same measurements with the model at sequence 256
added (its messages and compute doubled at the same counts of calls and ops) ranked the held-out
4-layer GPT of hidden 256 worse, not better (benchmarks/real_ranking.py --one-size, 2026-12-05:
median 20-23% and rank 0.86-0.89 with both sizes, 16-19% and 0.93-0.96 with one; the Llama
alike within 3 points), so the default keeps the cheaper single fit."""
