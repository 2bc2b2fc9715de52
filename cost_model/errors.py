"""Errors raised by the cost model on bad input (a profile file, a non-physical figure)."""


class CostModelInputError(ValueError):
    """Input to the cost model is malformed; the message names the file and field."""
