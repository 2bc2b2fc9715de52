"""Imports every op-family module so that each registers its targets."""

from autopar.strategies import matmul  # noqa: F401
