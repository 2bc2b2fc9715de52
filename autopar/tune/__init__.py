"""Measured, not only predicted: trial runs of candidate plans, and whole-step calibration.

    trials.py     run the k best predicted plans for a few steps in the job, keep the fastest
    calibrate.py  `autopar profile --calibrate`: a fixed set of configurations, measured, fitted
    fit.py        non-negative least squares of the calibrated terms, leave-one-out errors
    launch.py     spawn N gloo processes on this machine (calibration and benchmarks)
"""
