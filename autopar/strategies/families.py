"""Imports every op-family module so that each registers its targets."""

from autopar.strategies import (  # noqa: F401
    attention,
    conv,
    embedding,
    grouped_mm,
    loss,
    matmul,
    norm,
    pointwise,
    reduction,
    views,
)
