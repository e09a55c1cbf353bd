"""The planner's forecast of the next interval's load: Holt's linear trend (double exponential
smoothing), one series per quantity (a pool's request rate, its tokens per request).

    level_t = alpha * x_t + (1 - alpha) * (level_{t-1} + trend_{t-1})
    trend_t = beta * (level_t - level_{t-1}) + (1 - beta) * trend_{t-1}
    forecast of x_{t+h} = level_t + h * trend_t            (never below 0)

The first value sets the level, with no trend. Why Holt: load that ramps (a morning, a launch) is
what a reactive policy is late for, and a level-only EWMA lags a ramp by (1 - alpha) / alpha
steps forever, while Holt's trend catches up with it; it needs two floats of state per series (kept
in Serve's policy_state) and no history or fitting, unlike ARIMA or Prophet (which Dynamo's planner
also offers). Its weakness is the end of a burst: the trend overshoots for a few steps, which the
planner's hysteresis absorbs (it scales up on the forecast, down only after a delay). beta = 0 is
plain EWMA.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Holt"]


@dataclass(frozen=True)
class Holt:
    level: float | None = None  # None: no value yet
    trend: float = 0.0

    def update(self, value: float, alpha: float, beta: float) -> Holt:
        if self.level is None:
            return Holt(value, 0.0)
        level = alpha * value + (1 - alpha) * (self.level + self.trend)
        return Holt(level, beta * (level - self.level) + (1 - beta) * self.trend)

    def forecast(self, steps: float = 1.0) -> float:
        assert self.level is not None, "forecast before any value"
        return max(0.0, self.level + steps * self.trend)
