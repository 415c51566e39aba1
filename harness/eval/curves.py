"""Learning curves from evaluation histories, their plateau, and recovery against student scale.

    metric_series(history, metric)          -> (tokens, values) of one run (entries without the metric skipped)
    plateau_tokens(tokens, values, thr)     -> the token count after which the gain per 1e9 tokens stays < thr
    fit_power_law(params, recoveries)       -> the recovery gap 1 - r = a * N^-alpha fitted in log-log
    scale_points(histories, metric)         -> {mixer: [(params, recovery), ...]} from each run's last entry
    recovery_metric(histories)              -> the recovery to fit: normalised where the reports have it
    plot_against_tokens(histories, metric, path, plateau_threshold)   one line per run (mixer)
    plot_against_scale(points, path)        recovery and gap against parameters, one line per mixer, with alpha
    curves_report(histories, out_dir, threshold)   -> out_dir/curves.json and out_dir/curve_<metric>.png
    scale_report(points, out_dir)           -> out_dir/scaling.json and out_dir/scaling.png

A history is the list of entries of harness.eval.history.read_history; each entry carries the report of
harness.eval.report.build_report. Metrics are read from it as in METRICS: the recovery table's averages here, and
each registered evaluation task's scalars (harness.eval.tasks: EvalTask.curves, e.g. niah_overall, perplexity),
asked of the registry when read. Recovery comes in two kinds:
"average_recovery_norm", the chance-normalised average (harness.eval.recovery; the figure to fit), and
"average_recovery", the raw ratio student / teacher, still read from every report (reports written before the
normalised one existed have only this).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from harness.eval.tasks import Curve, tasks

PER = 1e9  # plateau thresholds are gains per billion tokens

RECOVERY_CURVES: dict[str, Curve] = {  # the recovery table's averages; the tasks add their own (EvalTask.curves)
    "average_recovery_norm": Curve(lambda r: (r.get("average") or {}).get("recovery_norm"),
                                   "average chance-normalised recovery (1.0 = teacher)", True, lambda r: 1.0),
    "average_recovery": Curve(lambda r: (r.get("average") or {}).get("recovery"),
                              "average teacher recovery (1.0 = teacher)", True, lambda r: 1.0),
    "average_score": Curve(lambda r: (r.get("average") or {}).get("student"), "average benchmark score", True,
                           lambda r: (r.get("average") or {}).get("teacher")),
}
POWER_LAW = "1 - r = a * N^(-alpha)"


def all_curves() -> dict[str, Curve]:
    """Every metric a history may be drawn in: the recovery averages, then each registered task's."""
    return {**RECOVERY_CURVES, **{name: c for task in tasks() for name, c in task.curves().items()}}


def default_metrics() -> tuple[str, ...]:
    """What `curves_report` draws by default: the recovery averages and each task's default curves."""
    return (*RECOVERY_CURVES, *(name for task in tasks() for name in task.default_curves()))


class _CurveView(Mapping):
    """A read-only {metric: pick(curve)} over `all_curves()`, asked of the registry at every read."""

    def __init__(self, pick: Callable[[Curve], Any]) -> None:
        self._pick = pick

    def __getitem__(self, metric: str) -> Any:
        return self._pick(all_curves()[metric])

    def __iter__(self):
        return iter(all_curves())

    def __len__(self) -> int:
        return len(all_curves())


METRICS: Mapping[str, tuple[Callable[[dict], Any], str, bool]] = _CurveView(
    lambda c: (c.value, c.label, c.higher_is_better))  # name: (value from a report, axis label, higher is better)
TEACHER: Mapping[str, Callable[[dict], Any]] = _CurveView(lambda c: c.teacher)  # the teacher's value: a reference


def _metric(metric: str) -> tuple[Callable[[dict], Any], str, bool]:
    if metric not in METRICS:
        raise ValueError(f"Unknown metric '{metric}'. Known: {', '.join(METRICS)}.")
    return METRICS[metric]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_series(history: Sequence[dict], metric: str) -> tuple[list[int], list[float]]:
    """(tokens, values) of `metric` over a history, ascending by tokens; entries lacking the metric skipped."""
    get = _metric(metric)[0]
    points = sorted(((e["tokens"], get(e.get("report") or {})) for e in history), key=lambda p: p[0])
    pairs = [(t, float(v)) for t, v in points if _finite(v)]
    return [t for t, _ in pairs], [v for _, v in pairs]


# --------------------------------------------------------------------------------------------- plateau


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]


def _check_curve(tokens: Sequence[int], values: Sequence[float]) -> None:
    if len(tokens) != len(values):
        raise ValueError(f"tokens and values differ in length: {len(tokens)} != {len(values)}.")
    for i, (t, v) in enumerate(zip(tokens, values)):
        if not _finite(t) or t < 0:
            raise ValueError(f"tokens[{i}] = {t!r} is not a non-negative number.")
        if not _finite(v):
            raise ValueError(f"values[{i}] = {v!r} is not a finite number.")
        if i and t <= tokens[i - 1]:
            raise ValueError(f"tokens must increase strictly: tokens[{i - 1}] = {tokens[i - 1]}, tokens[{i}] = {t}.")


def segment_gains(tokens: Sequence[int], values: Sequence[float], higher_is_better: bool = True) -> list[float]:
    """Gain per 1e9 tokens of each segment: sign * (v[i+1] - v[i]) / (t[i+1] - t[i]) * 1e9 (sign -1: lower is
    better, e.g. perplexity, so that a falling perplexity is a positive gain)."""
    _check_curve(tokens, values)
    sign = 1.0 if higher_is_better else -1.0
    return [sign * (values[i + 1] - values[i]) / (tokens[i + 1] - tokens[i]) * PER for i in range(len(tokens) - 1)]


def plateau_tokens(tokens: Sequence[int], values: Sequence[float], threshold_per_billion: float, *,
                   higher_is_better: bool = True, smooth: bool = False) -> Optional[int]:
    """The token count after which the curve gains less than `threshold_per_billion` per 1e9 tokens.

    Definition. With points (t_0, v_0), ..., (t_n, v_n) in increasing t, the gain of segment i is its secant
    slope g_i = (v_{i+1} - v_i) / (t_{i+1} - t_i) * 1e9 (negated when lower is better). The plateau is t_k
    for the smallest k such that g_j < threshold for every j >= k: the first evaluated point after which no
    measured segment gains as much as the threshold. None when the last segment still gains >= threshold
    (not yet on a plateau) or with fewer than two points (no segment to judge). A flat curve plateaus at
    t_0; a straight line with slope >= threshold never does.

    For a smooth concave curve sampled every h tokens, t_k lies within h of the point t* where the derivative
    equals the threshold (the secants around t_k bracket the derivative there). With `smooth`, values are
    first replaced by their isotonic (monotone in the better direction) least-squares fit, so that noise dips
    between evaluations do not read as gains; use it for noisy benchmark subsets.
    """
    if not _finite(threshold_per_billion) or threshold_per_billion <= 0:
        raise ValueError(f"threshold_per_billion must be a positive number, got {threshold_per_billion!r}.")
    _check_curve(tokens, values)
    if len(tokens) < 2:
        return None
    if smooth:
        values = isotonic(values) if higher_is_better else [-v for v in isotonic([-v for v in values])]
    gains = segment_gains(tokens, values, higher_is_better)
    k = len(gains)
    while k > 0 and gains[k - 1] < threshold_per_billion:
        k -= 1
    return None if k == len(gains) else int(tokens[k])


# --------------------------------------------------------------------------------------------- power law


def fit_power_law(params: Sequence[float], values: Sequence[float], ceiling: float = 1.0) -> dict:
    """Fit the recovery gap against student parameters: ceiling - r = a * N^(-alpha), by least squares in log-log.

    r is a recovery (1.0 = the teacher) and N the student's parameter count. The gap to full recovery is the
    quantity expected to shrink as a power of scale, so log(ceiling - r) = log(a) - alpha * log(N) is fitted by
    ordinary least squares; alpha > 0 means larger students close the gap. Points with r >= ceiling (no gap:
    its log is undefined) are left out and listed in "excluded". r2 is the coefficient of determination of the
    fit in log space (1.0 with exactly two points, which a line always fits).

    Returns {"form", "ceiling", "alpha", "a", "r2", "n_points", "excluded", "reason"}; alpha, a and r2 are
    None (and reason says why) with fewer than two usable points or a single distinct N.
    """
    if len(params) != len(values):
        raise ValueError(f"params and values differ in length: {len(params)} != {len(values)}.")
    for i, (n, r) in enumerate(zip(params, values)):
        if not _finite(n) or n <= 0:
            raise ValueError(f"params[{i}] = {n!r} is not a positive parameter count.")
        if not _finite(r):
            raise ValueError(f"values[{i}] = {r!r} is not a finite recovery.")
    usable = [(float(n), float(r)) for n, r in zip(params, values) if r < ceiling]
    excluded = [[n, r] for n, r in zip(params, values) if r >= ceiling]
    result: dict[str, Any] = {"form": POWER_LAW if ceiling == 1.0 else f"{ceiling:g} - r = a * N^(-alpha)",
                              "ceiling": ceiling, "alpha": None, "a": None, "r2": None, "n_points": len(usable),
                              "excluded": excluded, "reason": None}
    if len(usable) < 2 or len({n for n, _ in usable}) < 2:
        result["reason"] = (f"{len(usable)} point(s) with recovery < {ceiling:g} at {len({n for n, _ in usable})} "
                            f"distinct size(s); a fit needs two sizes" +
                            (f" ({len(excluded)} at or above {ceiling:g} left out: are recoveries fractions?)"
                             if excluded else "") + ".")
        return result
    x = [math.log(n) for n, _ in usable]
    y = [math.log(ceiling - r) for _, r in usable]
    slope, intercept, r2 = _least_squares(x, y)
    result.update(alpha=-slope, a=math.exp(intercept), r2=r2)
    return result


def _least_squares(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """Slope, intercept and R^2 of y ~ x (R^2 = 1 when y is constant and fitted exactly)."""
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx
    intercept = my - slope * mx
    ss_res = sum((b - intercept - slope * a) ** 2 for a, b in zip(x, y))
    ss_tot = sum((b - my) ** 2 for b in y)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res < 1e-24 else 0.0)
    return slope, intercept, r2


def power_law_value(fit: dict, n: float) -> Optional[float]:
    """The fitted recovery at n parameters: ceiling - a * n^-alpha (None when there is no fit)."""
    if fit.get("alpha") is None:
        return None
    return fit["ceiling"] - fit["a"] * n ** (-fit["alpha"])


def recovery_metric(histories: Mapping[str, Sequence[dict]]) -> str:
    """"average_recovery_norm" when some entry's report has the normalised average, else "average_recovery"
    (histories written before it: the raw ratio is all they have)."""
    get = _metric("average_recovery_norm")[0]
    has = any(_finite(get(e.get("report") or {})) for h in histories.values() for e in h)
    return "average_recovery_norm" if has else "average_recovery"


def scale_points(histories: Mapping[str, Sequence[dict]],
                 metric: str = "average_recovery_norm") -> dict[str, list[tuple[int, float]]]:
    """{mixer: [(params, value), ...] ascending by params}: each run's last entry that has the metric and params.

    A run is one point (its most trained evaluation); runs without "params" or "mixer" are left out.
    """
    points: dict[str, list[tuple[int, float]]] = {}
    get = _metric(metric)[0]
    for history in histories.values():
        last = [e for e in history if e.get("params") and _finite(get(e.get("report") or {}))]
        if not last:
            continue
        entry = max(last, key=lambda e: e["tokens"])
        mixer = entry.get("mixer") or (entry.get("report") or {}).get("mixer")
        if mixer:
            points.setdefault(mixer, []).append((int(entry["params"]), float(get(entry["report"]))))
    return {m: sorted(p) for m, p in sorted(points.items())}


# --------------------------------------------------------------------------------------------- plots


def _figure(width: float = 7.0, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def _token_unit(max_tokens: float) -> tuple[float, str]:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if max_tokens >= scale:
            return scale, unit
    return 1.0, ""


def _series_name(name: str, history: Sequence[dict]) -> str:
    mixers = [e.get("mixer") for e in history if e.get("mixer")]
    return f"{name} [{mixers[-1]}]" if mixers and mixers[-1] not in name else name


def _threshold_for(threshold: Optional[float | Mapping[str, float]], metric: str) -> Optional[float]:
    return threshold.get(metric) if isinstance(threshold, Mapping) else threshold


def plot_against_tokens(histories: Mapping[str, Sequence[dict]], metric: str, path: str | Path,
                        plateau_threshold: Optional[float] = None, *, smooth: bool = False) -> Path:
    """Lines: `metric` against tokens seen, one per run (named "run [mixer]"); the teacher's value dashed.

    With `plateau_threshold` (gain per 1e9 tokens, in the metric's units) each run's plateau
    (`plateau_tokens`) is marked with a star and a dotted vertical line. Raises ValueError if no run has
    the metric.
    """
    _, label, higher = _metric(metric)
    series = {name: metric_series(h, metric) for name, h in histories.items()}
    series = {name: s for name, s in series.items() if s[0]}
    if not series:
        raise ValueError(f"No run has a value of '{metric}' in its history: nothing to plot.")
    scale, unit = _token_unit(max(t for ts, _ in series.values() for t in ts))
    fig = _figure()
    ax = fig.add_subplot()
    for name, (ts, vs) in series.items():
        line, = ax.plot([t / scale for t in ts], vs, marker="o", markersize=3,
                        label=_series_name(name, histories[name]))
        if plateau_threshold is not None:
            at = plateau_tokens(ts, vs, plateau_threshold, higher_is_better=higher, smooth=smooth)
            if at is not None:
                ax.axvline(at / scale, color=line.get_color(), linestyle=":", linewidth=1)
                ax.plot([at / scale], [vs[ts.index(at)]], marker="*", markersize=12, color=line.get_color(),
                        linestyle="none", label=f"plateau {at / scale:.3g}{unit}")
    _teacher_lines(ax, histories, metric)
    if all_curves()[metric].log_scale:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
            axis(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel(f"tokens seen{f' ({unit})' if unit else ''}")
    ax.set_ylabel(label)
    title = f"{label} during stage 3"
    if plateau_threshold is not None:
        title += f"\n(plateau: gain < {plateau_threshold:g} per 1B tokens{', smoothed' if smooth else ''})"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


def _teacher_lines(ax: Any, histories: Mapping[str, Sequence[dict]], metric: str) -> None:
    """One dashed horizontal line per distinct teacher value (1.0 for recoveries and ratios)."""
    values = {TEACHER[metric](e.get("report") or {}) for h in histories.values() for e in h[-1:]}
    for value in sorted(v for v in values if _finite(v)):
        ax.axhline(value, color="gray", linestyle="--", linewidth=1)
    if any(_finite(v) for v in values):
        ax.plot([], [], color="gray", linestyle="--", linewidth=1, label="teacher")


def plot_against_scale(points: Mapping[str, Sequence[tuple[float, float]]], path: str | Path,
                       metric: str = "average_recovery_norm") -> Path:
    """Recovery (`metric`: normalised or raw) against student parameters (log x) and the gap 1 - r (log-log),
    one line per mixer.

    Each mixer's fitted power law (`fit_power_law`) is drawn dashed, with alpha in the legend.
    """
    if not any(points.values()):
        raise ValueError("No (params, recovery) points: nothing to plot.")
    fig = _figure(11.0, 4.0)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for mixer, pts in points.items():
        if not pts:
            continue
        pts = sorted(pts)
        ns, rs = [n for n, _ in pts], [r for _, r in pts]
        fit = fit_power_law(ns, rs)
        name = f"{mixer} (alpha={fit['alpha']:.3g}, R²={fit['r2']:.2f})" if fit["alpha"] is not None else mixer
        line, = left.plot(ns, [100 * r for r in rs], marker="o", label=name)
        gaps = [(n, 1 - r) for n, r in pts if r < 1]
        right.plot([n for n, _ in gaps], [g for _, g in gaps], marker="o", color=line.get_color(), label=mixer)
        if fit["alpha"] is not None:
            grid = [ns[0] * (ns[-1] / ns[0]) ** (i / 49) for i in range(50)]
            left.plot(grid, [100 * power_law_value(fit, n) for n in grid], linestyle="--", color=line.get_color())
            right.plot(grid, [fit["a"] * n ** (-fit["alpha"]) for n in grid], linestyle="--", color=line.get_color())
    left.axhline(100, color="gray", linestyle="--", linewidth=1)
    left.set_xscale("log")
    left.set_xlabel("student parameters")
    left.set_ylabel(("normalised " if metric == "average_recovery_norm" else "") + "teacher recovery (%)")
    left.set_title(f"Recovery against scale; dashed: fit {POWER_LAW}", fontsize=9)
    left.legend(fontsize=7)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("student parameters")
    right.set_ylabel("recovery gap 1 - r")
    right.set_title("Recovery gap (a power law is a straight line)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


# --------------------------------------------------------------------------------------------- reports


def curves_report(histories: Mapping[str, Sequence[dict]], out_dir: str | Path,
                  threshold: Optional[float | Mapping[str, float]] = None, *, smooth: bool = False,
                  metrics: Optional[Sequence[str]] = None) -> dict:
    """out_dir/curves.json and out_dir/curve_<metric>.png for every metric some run has; returns the json's dict.

    `metrics`: None draws `default_metrics()`. `threshold` is the plateau threshold, a gain per 1e9 tokens in
    each metric's units: one number for all metrics, a {metric: threshold} mapping, or None (no plateaus).
    curves.json:

        {"threshold_per_billion": {metric: thr|null}, "smooth": bool, "plateau_definition": str,
         "runs": {run: {"mixer": str|null, "metrics": {metric: {"tokens": [...], "values": [...],
                                                                "plateau": int|null}}}},
         "plots": {metric: "curve_<metric>.png"}}
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics = default_metrics() if metrics is None else tuple(metrics)
    thresholds = {m: _threshold_for(threshold, m) for m in metrics}
    runs: dict[str, dict] = {}
    for name, history in histories.items():
        mixers = [e.get("mixer") for e in history if e.get("mixer")]
        per_metric = {}
        for metric in metrics:
            ts, vs = metric_series(history, metric)
            if not ts:
                continue
            thr = thresholds[metric]
            plateau = None if thr is None else plateau_tokens(ts, vs, thr, higher_is_better=METRICS[metric][2],
                                                              smooth=smooth)
            per_metric[metric] = {"tokens": ts, "values": vs, "plateau": plateau}
        runs[name] = {"mixer": mixers[-1] if mixers else None, "metrics": per_metric}
    plots = {}
    for metric in metrics:
        if any(metric in r["metrics"] for r in runs.values()):
            plots[metric] = f"curve_{metric}.png"
            plot_against_tokens(histories, metric, out / plots[metric], thresholds[metric], smooth=smooth)
    result = {"threshold_per_billion": thresholds, "smooth": smooth,
              "plateau_definition": "first evaluated token count after which every segment's gain per 1e9 "
                                    "tokens is below the threshold (harness.eval.curves.plateau_tokens)",
              "runs": runs, "plots": plots}
    (out / "curves.json").write_text(json.dumps(result, indent=1))
    return result


def scale_report(points: Mapping[str, Sequence[tuple[float, float]]], out_dir: str | Path,
                 metric: str = "average_recovery_norm") -> dict:
    """out_dir/scaling.json and out_dir/scaling.png (if there are points); returns the json's dict:

        {"form": "1 - r = a * N^(-alpha)", "metric": the recovery the points hold (see METRICS),
         "mixers": {mixer: {"points": [[params, recovery], ...], "fit": fit_power_law(...)}}, "plot": str|null}
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mixers = {}
    for mixer, pts in points.items():
        pts = sorted(pts)
        mixers[mixer] = {"points": [list(p) for p in pts],
                         "fit": fit_power_law([n for n, _ in pts], [r for _, r in pts])}
    plot = None
    if any(points.values()):
        plot = "scaling.png"
        plot_against_scale(points, out / plot, metric)
    result = {"form": POWER_LAW, "metric": metric, "mixers": mixers, "plot": plot}
    (out / "scaling.json").write_text(json.dumps(result, indent=1))
    return result
