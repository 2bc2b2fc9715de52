"""`autopar compare`: which cluster trains this model fastest, and which cheapest.

The model is captured once and planned on every cluster. For each the table gives the plan's
step time and throughput and, with a price per device-hour (from the user: a flag or the
cluster TOML's `price_per_gpu_hour`; autopar knows no prices), the cost per million tokens; with
a token count, the time and cost to train on that many tokens:

    time_s = tokens / tokens_per_s        cost = num_devices x price_per_gpu_hour x time_s / 3600

Models without token ids count samples instead of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.plans.plan import Plan


@dataclass(frozen=True, kw_only=True)
class ClusterOption:
    cluster: str
    num_devices: int
    price_per_gpu_hour: float | None
    plan: Plan | None
    """None when the model does not fit (see `error`)."""
    error: str = ""

    @property
    def throughput_per_s(self) -> float:
        """Tokens per second (samples for models without token ids)."""
        if self.plan is None:
            return 0.0
        predicted = self.plan.predicted
        return predicted.tokens_per_s or self.plan.global_batch / predicted.step_time_s

    @property
    def price_per_hour(self) -> float | None:
        return None if self.price_per_gpu_hour is None else self.price_per_gpu_hour * self.num_devices

    def time_s(self, amount: float) -> float | None:
        return amount / self.throughput_per_s if self.throughput_per_s else None

    def cost(self, amount: float) -> float | None:
        seconds = self.time_s(amount)
        if seconds is None or self.price_per_hour is None:
            return None
        return self.price_per_hour * seconds / 3600


@dataclass(frozen=True, kw_only=True)
class Comparison:
    model: str
    global_batch: int
    unit: str
    """"tokens" or "samples"."""
    amount: float | None
    """Tokens (or samples) to train on, when given."""
    options: tuple[ClusterOption, ...]

    @property
    def fastest(self) -> ClusterOption | None:
        feasible = [option for option in self.options if option.plan is not None]
        return max(feasible, key=lambda option: option.throughput_per_s, default=None)

    @property
    def cheapest(self) -> ClusterOption | None:
        priced = [option for option in self.options if option.cost(1.0) is not None]
        return min(priced, key=lambda option: option.cost(1.0), default=None)


def compare_clusters(model, *, global_batch: int, clusters: list[str], prices: list[float] | None = None,
                     amount: float | None = None, precision: str = "bf16", verbose: bool = False) -> Comparison:
    """Plan `model` on each cluster; `prices` (per device-hour) override the clusters' own."""
    from autopar.plans import planning

    if not clusters:
        raise ConfigError("give at least one cluster to compare (--clusters SPEC1 SPEC2 ...)")
    if prices is not None and len(prices) != len(clusters):
        raise ConfigError(f"{len(prices)} prices for {len(clusters)} clusters: give one --price-per-gpu-hour per "
                          "cluster, in the same order (or put price_per_gpu_hour in each cluster's TOML)")
    if prices is not None and any(price <= 0 for price in prices):
        raise ConfigError(f"prices must be positive, got {prices}")
    if amount is not None and amount <= 0:
        raise ConfigError(f"the amount to train on must be positive, got {amount:g}")
    parsed = [Cluster.from_spec(spec) for spec in clusters]  # every spec is checked before planning
    graph = planning.capture_for_planning(model, precision=precision, verbose=verbose)
    options = []
    for index, (spec, cluster) in enumerate(zip(clusters, parsed)):
        price = prices[index] if prices is not None else cluster.price_per_gpu_hour
        try:
            plan = planning.plan(graph, cluster=cluster, global_batch=global_batch, precision=precision, verbose=verbose)
            options.append(ClusterOption(cluster=spec, num_devices=cluster.num_devices, price_per_gpu_hour=price,
                                         plan=plan))
        except (InfeasiblePlanError, ConfigError) as error:
            options.append(ClusterOption(cluster=spec, num_devices=cluster.num_devices, price_per_gpu_hour=price,
                                         plan=None, error=str(error)))
    unit = "tokens" if any(o.plan is not None and o.plan.predicted.tokens_per_s for o in options) else "samples"
    return Comparison(model=graph.model_name, global_batch=global_batch, unit=unit, amount=amount,
                      options=tuple(options))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for size, name in ((86400, "days"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:,.1f} {name}"
    return f"{seconds:.3g} s"


def _count(amount: float) -> str:
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if amount >= size:
            return f"{amount / size:.4g}{suffix}"
    return f"{amount:.4g}"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def comparison_text(comparison: Comparison) -> str:
    unit = comparison.unit
    per_million = 1e6
    header = ["cluster", "devices", "mesh (pp x dp x tp)", "step time", f"{unit}/s", "price/h",
              f"cost per 1M {unit}"]
    if comparison.amount:
        header += [f"time for {_count(comparison.amount)} {unit}", "cost"]
    rows = []
    for option in comparison.options:
        if option.plan is None:
            rows.append([option.cluster, str(option.num_devices), "does not fit"] + ["-"] * (len(header) - 3))
            continue
        mesh = option.plan.mesh
        row = [option.cluster, str(option.num_devices), f"{mesh['pp']} x {mesh['dp']} x {mesh['tp']}",
               f"{option.plan.predicted.step_time_s:.4g} s", f"{option.throughput_per_s:,.0f}",
               _money(option.price_per_hour), _money(option.cost(per_million))]
        if comparison.amount:
            row += [_duration(option.time_s(comparison.amount)), _money(option.cost(comparison.amount))]
        rows.append(row)
    widths = [max(len(line[i]) for line in [header] + rows) for i in range(len(header))]
    lines = [f"autopar compare: {comparison.model}, global batch {comparison.global_batch}"]
    lines += ["  " + "  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(line))
              for line in [header, ["-" * w for w in widths]] + rows]
    fastest, cheapest = comparison.fastest, comparison.cheapest
    if fastest is not None:
        lines.append(f"  fastest:  {fastest.cluster} ({fastest.throughput_per_s:,.0f} {unit}/s)")
    if cheapest is not None:
        lines.append(f"  cheapest: {cheapest.cluster} ({_money(cheapest.cost(per_million))} per 1M {unit})")
    elif fastest is not None:
        lines.append("  cheapest: no prices given (--price-per-gpu-hour P1 P2 ..., or price_per_gpu_hour in a "
                     "cluster TOML)")
    for option in comparison.options:
        if option.plan is None:
            lines.append(f"  {option.cluster}: {option.error}")
    return "\n".join(lines)


def comparison_dict(comparison: Comparison) -> dict:
    amount = comparison.amount
    return {
        "model": comparison.model, "global_batch": comparison.global_batch, "unit": comparison.unit, "amount": amount,
        "clusters": [{"cluster": o.cluster, "num_devices": o.num_devices, "fits": o.plan is not None,
                      "error": o.error, "mesh": o.plan.mesh if o.plan else None,
                      "step_time_s": o.plan.predicted.step_time_s if o.plan else None,
                      "throughput_per_s": o.throughput_per_s, "price_per_gpu_hour": o.price_per_gpu_hour,
                      "cost_per_million": o.cost(1e6), "time_s": o.time_s(amount) if amount else None,
                      "cost": o.cost(amount) if amount else None} for o in comparison.options],
        "fastest": comparison.fastest.cluster if comparison.fastest else None,
        "cheapest": comparison.cheapest.cluster if comparison.cheapest else None,
    }
