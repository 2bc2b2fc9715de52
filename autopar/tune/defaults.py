"""Defaults of the measured path that the CLI names without importing torch."""

DEFAULT_CALIBRATION_MODELS = ("gpt:layers=4,hidden=320,heads=4,seq=128,vocab=512,dropout=0.0",)
"""The small built-in model `autopar profile` calibrates on unless told otherwise (--calibrate
MODEL, repeatable for one fit over several; --no-calibrate): every mesh of 2, 4 or 8 processes
divides its 4 layers and 4 heads (pp, tp up to 4), and a step takes under a second on a CPU, so
the fixed set of configurations (calibrate.calibration_configs) runs in about two minutes
on 2 cores.

Wide enough that its tensor-parallel configurations shard. At hidden 128 (the default until
2026-12-06) the planner's choice between sharding and replicating its tp=2 configurations was a
near tie under the profile's own prices, and flipped from one profile to the next: in some, every
tensor-parallel configuration ran fully replicated, so no point had an op on DTensors and the fit
left `framework.dtensor_dispatch` anywhere from 0 to 1.2 ms per op. Held-out tensor-parallel rows
moved with it (benchmarks/real_ranking.py, the 8-layer Llama's dp=2 tp=2 from -35% to +29%). At
hidden 320 every profile's tp configurations shard; a calibration that exercises no configuration
of a term says so in its notes (calibrate.py).

One model, not two sizes of it: fitting the same measurements with the model at sequence 256
added (its messages and compute doubled at the same counts of calls and ops) ranked the held-out
4-layer GPT of hidden 256 worse, not better (benchmarks/real_ranking.py --one-size, 2026-12-05),
so the default keeps the cheaper single fit."""
