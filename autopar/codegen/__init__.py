"""Codegen: a Plan and the model become a module that trains on real process groups."""
