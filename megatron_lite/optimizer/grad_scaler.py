"""Loss scaling for fp16: a constant scale, or Megatron's dynamic scaler (halve after `hysteresis`
overflowing steps, double after `window` clean ones)."""

from __future__ import annotations


class ConstantGradScaler:
    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        """Nothing: --loss-scale given on resume is the scale (as Megatron's constant scaler does)."""


class DynamicGradScaler:
    def __init__(
        self,
        initial: float,
        minimum: float,
        window: int,
        hysteresis: int,
        growth: float = 2.0,
        backoff: float = 0.5,
    ) -> None:
        self.scale = float(initial)
        self.minimum = float(minimum)
        self.window = window
        self.hysteresis = hysteresis
        self.growth = growth
        self.backoff = backoff
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff, self.minimum)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.window:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        # (a constant scaler's checkpoint has no trackers: the dynamic one starts them afresh from its scale)
        self._growth_tracker = int(state.get("growth_tracker", 0))
        self._hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))
