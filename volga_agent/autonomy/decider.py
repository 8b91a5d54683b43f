"""One decision per window: the node's state and the actions that follow, as a pure function of what it is given.

No clock, no I/O: the caller hands a `window.Window` and the models' `ModelView`s (contract, awake or not), and
gets a `Decision`. The one state carried between windows is the hysteresis, each model's last arrival rates and
violation, and the caps and sheds in force, so that the same sequence of windows always gives the same
decisions.

The candidate state of a window, first match wins:

    EMERGENCY   memory >= autonomy_emergency_above_pct, or a model has violated its SLO for longer than its
                recoveryDeadlineMs
    OPTIMIZE    memory >= autonomy_optimize_above_pct, or a model violates its SLO in this window
    PRELOAD     memory < autonomy_preload_below_pct
    ACCEPT      otherwise

The state follows the candidate once `autonomy_hysteresis_windows` consecutive windows agree on it. A model
violates when its window p99 exceeds baseline x (1 + tolerance / 100): the baseline of the largest measured batch
size within its batch cap, the tolerance at the load of the node's other models (the node's utilisation times
the other models' share of the completed requests; `api.Slo.tolerance_pct`).

Actions by state:

    PRELOAD     Preload each model not awake whose arrival rate is at least autonomy_preload_min_rate and rises
                faster than in the window before (positive slope and acceleration of its arrivals over three windows)
    OPTIMIZE    for each violating model (least tolerant first), halve the batch cap of the most tolerant awake
                co-runner that is not violating itself; Demote idle models other than the least tolerant
    EMERGENCY   Shed and Demote the most tolerant model with traffic not shed yet, one per window; the least
                tolerant models are never shed
    leaving EMERGENCY: Unshed every shed model; reaching PRELOAD or ACCEPT: RestoreBatchCap every capped model
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

from volga_agent import policy
from volga_agent.autonomy import window as windows
from volga_operator import api


class State(enum.StrEnum):
    PRELOAD = "PRELOAD"
    ACCEPT = "ACCEPT"
    OPTIMIZE = "OPTIMIZE"
    EMERGENCY = "EMERGENCY"


@dataclasses.dataclass(frozen=True, slots=True)
class Preload:
    model: str


@dataclasses.dataclass(frozen=True, slots=True)
class LowerBatchCap:
    model: str
    cap: int


@dataclasses.dataclass(frozen=True, slots=True)
class Demote:
    model: str
    tier: api.Tier


@dataclasses.dataclass(frozen=True, slots=True)
class Shed:
    model: str
    retry_after_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class Unshed:
    model: str


@dataclasses.dataclass(frozen=True, slots=True)
class RestoreBatchCap:
    model: str


Action = Preload | LowerBatchCap | Demote | Shed | Unshed | RestoreBatchCap


@dataclasses.dataclass(frozen=True)
class ModelView:
    """What the decider knows of one model on the node besides its load."""

    model: str
    slo: api.Slo
    baselines: tuple[tuple[int, float], ...]  # (batch size, p99 ms), ascending; () when none hold
    awake: bool = False
    gpu: bool = False
    max_batch: int = 256
    # The tolerance as (below this other load, pct) steps, the last one unbounded: read on every window.
    steps: tuple[tuple[float, float], ...] = dataclasses.field(init=False, repr=False, compare=False)
    uncapped: float = dataclasses.field(init=False, repr=False, compare=False)  # the baseline without a cap

    def __post_init__(self) -> None:
        steps = tuple((math.inf if step.below_load_pct is None else step.below_load_pct, step.pct)
                      for step in self.slo.interference_tolerance or ())
        object.__setattr__(self, "steps", steps or ((math.inf, self.slo.interference_tolerance_pct),))
        object.__setattr__(self, "uncapped", baseline(self.baselines, self.max_batch) if self.baselines else 0.0)

    @classmethod
    def of(cls, spec: api.ModelSpecSpec, awake: bool, gpu: bool) -> ModelView:
        """The view of a ModelSpec: only baselines measured for its version and input hash count."""
        valid = spec.slo.baselines_for(spec.version, spec.input_hash())
        return cls(spec.model_id, spec.slo, tuple(sorted(valid.items())), awake, gpu, spec.runtime.max_batch_size)


@dataclasses.dataclass(frozen=True, slots=True)
class Violation:
    model: str
    p99_ms: float
    limit_ms: float
    other_load_pct: float
    windows: int  # consecutive violating windows, this one included
    violating_ms: float  # since the first of them started
    past_deadline: bool  # longer than the model's recoveryDeadlineMs


@dataclasses.dataclass(frozen=True)
class Decision:
    state: State
    candidate: State
    changed: bool
    actions: tuple[Action, ...]
    violations: tuple[Violation, ...]
    path: tuple[str, ...] = ()  # why, step by step; filled only when asked (`explain`)


class _Track:
    """Per model, between windows."""

    __slots__ = ("arrivals1", "arrivals2", "idle", "seen", "violating", "violation_start")

    def __init__(self) -> None:
        self.arrivals1 = self.arrivals2 = 0  # arrivals in the window before last, and in the last
        self.seen = 0  # windows seen, up to 2
        self.idle = 0
        self.violating = 0
        self.violation_start = 0.0


def baseline(steps: Sequence[tuple[int, float]], cap: int) -> float:
    """The baseline of the largest measured batch size within `cap` (the smallest when none is)."""
    chosen = steps[0][1]
    for size, ms in steps:
        if size > cap:
            break
        chosen = ms
    return chosen


class Decider:
    def __init__(self, settings: policy.Settings | None = None) -> None:
        self.settings = settings or policy.Settings()
        self.state = State.ACCEPT
        self._pending: State | None = None
        self._agree = 0
        self.caps: dict[str, int] = {}
        self.shed: set[str] = set()
        self._tracks: dict[str, _Track] = {}

    def decide(self, window: windows.Window, views: Mapping[str, ModelView], explain: bool = False) -> Decision:
        s = self.settings
        path: list[str] | None = [] if explain else None
        seconds = window.seconds if window.seconds > 0 else s.autonomy_sample_ms * s.autonomy_window_samples / 1e3
        loads = window.models
        total_completed = sum(w.completed for w in loads.values())
        tracks = self._tracks
        for gone in [m for m in tracks if m not in views]:
            del tracks[gone]

        tolerance: dict[str, float] = {}
        violations: list[Violation] = []
        accelerating: list[str] = []
        active: list[str] = []  # awake, or with traffic
        idle: list[str] = []
        past_deadline = False
        util = window.util_pct
        idle_after = s.autonomy_idle_windows
        min_rate = s.autonomy_preload_min_rate
        caps = self.caps
        for model, view in views.items():
            track = tracks.get(model)
            if track is None:
                track = tracks[model] = _Track()
            load = loads.get(model)
            if load is None:
                arrivals, p99, other = 0, None, util
                track.idle += 1
            else:
                arrivals, p99 = load.arrivals, load.p99_ms
                other = util * (1.0 - load.completed / total_completed) if total_completed else util
                if arrivals or load.queue_depth:
                    track.idle = 0
                else:
                    track.idle += 1
            pct = view.steps[-1][1]
            for below, step_pct in view.steps:
                if other < below:
                    pct = step_pct
                    break
            tolerance[model] = pct
            if view.awake:
                active.append(model)
                if track.idle >= idle_after:
                    idle.append(model)
            else:
                if arrivals:
                    active.append(model)
                rate = arrivals / seconds
                # Slope and acceleration in arrivals per window (windows are of one length but for jitter, which
                # would make a flat rate look like it wobbles up and down).
                if (track.seen == 2 and rate >= min_rate and arrivals > track.arrivals2
                        and arrivals - track.arrivals2 > track.arrivals2 - track.arrivals1):
                    accelerating.append(model)
            track.arrivals1, track.arrivals2 = track.arrivals2, arrivals
            if track.seen < 2:
                track.seen += 1
            if p99 is None or not view.baselines:
                track.violating = 0
                continue
            cap = caps.get(model) if caps else None
            limit = (view.uncapped if cap is None else baseline(view.baselines, cap)) * (1.0 + pct / 100.0)
            if p99 <= limit:
                track.violating = 0
                continue
            if track.violating == 0:
                track.violation_start = window.start
            track.violating += 1
            violating_ms = (window.end - track.violation_start) * 1e3
            late = violating_ms > view.slo.recovery_deadline_ms
            past_deadline = past_deadline or late
            violations.append(Violation(model, p99, limit, other, track.violating, violating_ms, late))
            if path is not None:
                path.append(f"{model}: p99 {p99:.3f} ms > {limit:.3f} ms (tolerance {pct:g}% at other load "
                            f"{other:.1f}%), {track.violating} windows, {violating_ms:.0f} ms"
                            + (" past its recovery deadline" if late else ""))

        memory = window.memory_pct
        if memory >= s.autonomy_emergency_above_pct or past_deadline:
            candidate = State.EMERGENCY
        elif memory >= s.autonomy_optimize_above_pct or violations:
            candidate = State.OPTIMIZE
        elif memory < s.autonomy_preload_below_pct:
            candidate = State.PRELOAD
        else:
            candidate = State.ACCEPT
        if path is not None:
            path.append(f"memory {memory:.1f}% (preload < {s.autonomy_preload_below_pct:g}, optimize >= "
                        f"{s.autonomy_optimize_above_pct:g}, emergency >= {s.autonomy_emergency_above_pct:g}), "
                        f"{len(violations)} violating, past deadline: {past_deadline} -> candidate {candidate}")

        previous = self.state
        if candidate == previous:
            self._pending, self._agree = None, 0
        elif candidate == self._pending:
            self._agree += 1
        else:
            self._pending, self._agree = candidate, 1
        if self._pending is not None and self._agree >= s.autonomy_hysteresis_windows:
            self.state, self._pending, self._agree = candidate, None, 0
        state = self.state
        if path is not None:
            path.append(f"state {previous} -> {state}" if state != previous else
                        f"state stays {state}" + (f" ({self._agree}/{s.autonomy_hysteresis_windows} windows for "
                                                   f"{self._pending})" if self._pending else ""))

        actions: list[Action] = []
        if previous == State.EMERGENCY and state != State.EMERGENCY and self.shed:
            actions += [Unshed(m) for m in sorted(self.shed)]
            self.shed.clear()
        if state in (State.PRELOAD, State.ACCEPT) and self.caps:
            actions += [RestoreBatchCap(m) for m in sorted(self.caps)]
            self.caps.clear()
        if state == State.PRELOAD:
            actions += [Preload(m) for m in accelerating]
        elif state == State.OPTIMIZE:
            self._optimize(views, tolerance, violations, idle, actions)
        elif state == State.EMERGENCY:
            self._emergency(views, tolerance, active, actions)
        if path is not None:
            path.append(f"actions: {actions or 'none'}")
        return Decision(state, candidate, state != previous, tuple(actions), tuple(violations),
                        tuple(path) if path is not None else ())

    def _optimize(self, views: Mapping[str, ModelView], tolerance: Mapping[str, float],
                  violations: Sequence[Violation], idle: Sequence[str], actions: list[Action]) -> None:
        caps = self.caps
        if violations:
            violating = {v.model for v in violations}
            # Co-runners that may give way, the most tolerant first; each gives way once per window.
            donors = sorted((m for m, v in views.items() if v.awake and m not in violating
                             and caps.get(m, v.max_batch) > 1), key=lambda m: (-tolerance[m], m))
            for victim in sorted(violating, key=lambda m: (tolerance[m], m)):
                if not donors or tolerance[donors[0]] < tolerance[victim]:
                    continue
                best = donors.pop(0)
                cap = caps[best] = max(1, caps.get(best, views[best].max_batch) // 2)
                actions.append(LowerBatchCap(best, cap))
        if idle:
            least = min(tolerance[m] for m, v in views.items() if v.awake)
            for model in sorted(idle, key=lambda m: (-tolerance[m], m)):
                if tolerance[model] > least:
                    actions.append(Demote(model, _rest(views[model])))

    def _emergency(self, views: Mapping[str, ModelView], tolerance: Mapping[str, float], active: Sequence[str],
                   actions: list[Action]) -> None:
        if not active:
            return
        least = min(tolerance[m] for m in active)
        candidates = [m for m in active if m not in self.shed and tolerance[m] > least]
        if not candidates:
            return
        model = min(candidates, key=lambda m: (-tolerance[m], m))
        self.shed.add(model)
        actions.append(Shed(model, self.settings.autonomy_shed_retry_after_ms))
        if views[model].awake:
            actions.append(Demote(model, _rest(views[model])))


def _rest(view: ModelView) -> api.Tier:
    """Where a demoted model goes: WARM keeps a GPU model a host-to-device copy away; a CPU model freezes."""
    return api.Tier.WARM if view.gpu else api.Tier.FROZEN
