"""Plans: the Plan data and its JSON (plan.py), the checks of a plan file (checks.py), building a
Plan from a search result (build.py), its text report (report.py), and planning a model end to
end: capture, search, build (planning.py)."""

from autopar.plans.plan import Plan, Prediction, StagePlan

__all__ = ["Plan", "Prediction", "StagePlan"]
