"""One decision per window: the node's state and the actions that follow, as a pure function of what it is given.

No clock, no I/O: the caller hands a `window.Window` and the models' `ModelView`s (contract, awake or not), and
gets a `Decision`. The one state carried between windows is the hysteresis, each model's last arrival rates and
violation, and the caps and sheds in force, so that the same sequence of windows always gives the same
decisions.

The candidate state of a window, first match wins:

    EMERGENCY   memory >= autonomy.emergency_above_pct, or a model has violated its SLO for longer than
                autonomy.deadline_share_pct of its recoveryDeadlineMs (by default all of it)
    OPTIMIZE    memory >= autonomy.optimize_above_pct, or a model violates its SLO in this window
    PRELOAD     memory < autonomy.preload_below_pct
    ACCEPT      otherwise

The state follows the candidate once `autonomy.hysteresis_windows` consecutive windows agree on it (into
EMERGENCY: autonomy.emergency_windows; out of it: autonomy.calm_windows, where set). A model
violates when its window p99 exceeds baseline x (1 + tolerance / 100): the baseline of the largest measured batch
size within its batch cap, the tolerance at the load of the node's other models (the node's utilisation times
the other models' share of the completed requests; `api.Slo.tolerance_pct`).

An ensemble (a chain served as one model) has a view of its own (`ModelView.members`): its end-to-end p99 is
judged against its head's baselines and tolerance, and its violations count as any model's (OPTIMIZE, EMERGENCY
past the deadline share), its models excepted from giving way to it; it is never preloaded, capped, demoted or
shed itself (its models are, on their own load, which counts each step of it), and its requests do not count
again in the node's completed requests.

Actions by state:

    PRELOAD     Preload each model not awake whose arrival rate is at least autonomy.preload_min_rate and rises
                faster than in the window before (positive slope and acceleration of its arrivals over three windows)
    OPTIMIZE    for each violating model (least tolerant first), halve the batch cap of the most tolerant awake
                co-runner that is not violating itself; Demote idle models other than the least tolerant
    EMERGENCY   Shed the most tolerant model with traffic not shed yet, one per window, and Demote it when memory is
                what the emergency is about (a checkpoint frees memory but costs the CPU and PCIe time a latency
                emergency needs for the protected models); the least tolerant models are never shed
    leaving EMERGENCY: Unshed every shed model; reaching PRELOAD or ACCEPT: RestoreBatchCap every capped model

With autonomy.yield_nice set, a CPU-bound co-runner also yields (LowerPriority): in any window where a model
violates, every awake model at least autonomy.yield_tolerance_ratio times as tolerant as it, and not violating
itself, has its worker run at that nice, at once (no hysteresis: it is cheap, undone as cheaply, and it is what
frees a shared CPU while the co-runner is serving, which caps and sheds in bursts do not); RestorePriority gives
it back once the state is PRELOAD or ACCEPT and autonomy.yield_calm_windows windows have passed without a
violation of a model it yields to. A yielding model's own violations are what it was made to pay: they neither
stop the yield nor hold it.

With autonomy.throttle_share set, the same models are also throttled (Throttle), entered and left with the yield
(Unthrottle): the agent stops their workers for that share of every autonomy.throttle_period_ms, capped by what the
model's own tolerance t (at the window's other load) allows, t / (100 + t): its work then takes at most
1 + t / 100 times as long, as its contract allows.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import typing
from collections.abc import Callable, Mapping, Sequence

from volga_agent.autonomy import window as windows
from volga_agent.node.settings import Settings
from volga_core import api


class State(enum.StrEnum):
    PRELOAD = "PRELOAD"
    ACCEPT = "ACCEPT"
    OPTIMIZE = "OPTIMIZE"
    EMERGENCY = "EMERGENCY"


_PRELOAD, _ACCEPT, _OPTIMIZE, _EMERGENCY = State.PRELOAD, State.ACCEPT, State.OPTIMIZE, State.EMERGENCY

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


@dataclasses.dataclass(frozen=True, slots=True)
class LowerPriority:
    """The model's workers run at `nice` (their threads, and their session's scheduling group)."""

    model: str
    nice: int


@dataclasses.dataclass(frozen=True, slots=True)
class RestorePriority:
    model: str


@dataclasses.dataclass(frozen=True, slots=True)
class Throttle:
    """The model's HOT workers are stopped for `share` of every throttle period."""

    model: str
    share: float


@dataclasses.dataclass(frozen=True, slots=True)
class Unthrottle:
    model: str


Action = (Preload | LowerBatchCap | Demote | Shed | Unshed | RestoreBatchCap | LowerPriority | RestorePriority
          | Throttle | Unthrottle)


@dataclasses.dataclass(frozen=True)
class ModelView:
    """What the decider knows of one model on the node besides its load."""

    model: str
    slo: api.Slo
    baselines: tuple[tuple[int, float], ...]  # (batch size, p99 ms), ascending; () when none hold
    awake: bool = False
    gpu: bool = False
    max_batch: int = 256
    members: tuple[str, ...] = ()  # an ensemble's: its models, in order (none for a model)
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


class Violation(typing.NamedTuple):
    """One model over its limit in one window (a named tuple: a loaded node makes many per window, and a frozen
    dataclass costs several times as much to make)."""

    model: str
    p99_ms: float
    limit_ms: float
    other_load_pct: float
    windows: int  # consecutive violating windows, this one included
    violating_ms: float  # since the first of them started
    past_deadline: bool  # longer than the model's recoveryDeadlineMs


# A Violation made without the Python-level __new__ a NamedTuple class has (many per window on a loaded node).
_violation = functools.partial(tuple.__new__, Violation)


class Decision(typing.NamedTuple):
    state: State
    candidate: State
    changed: bool
    actions: tuple[Action, ...]
    violations: tuple[Violation, ...]
    path: tuple[str, ...] = ()  # why, step by step; filled only when asked (`explain`)


_decision = functools.partial(tuple.__new__, Decision)  # as _violation: one per window


class _Track:
    """One model between windows: its arrivals, idleness and violation, and the constants of its current view
    (bound again only when the model set changes, so that a window reads them without working them out: a
    window's cost is this loop's, per model, and every attribute it need not touch counts at 64 models)."""

    __slots__ = ("arrivals1", "arrivals2", "awake", "baselines", "capped_at", "capped_base", "deadline_ms",
                 "first", "idle", "limit", "members", "model", "preloadable", "scalar", "share_ms", "steps",
                 "tolerance", "uncapped", "view", "violating", "violation_start")

    def __init__(self, model: str, first: int) -> None:
        self.model = model
        self.arrivals1 = self.arrivals2 = 0  # arrivals in the window before last, and in the last (this one, after)
        self.first = first  # the decider's count of windows when this model came
        self.idle = 0
        self.violating = 0
        self.violation_start = 0.0
        self.tolerance = 0.0  # at this window's other load

    def bind(self, view: ModelView, share: float) -> None:
        self.view = view
        self.awake = view.awake
        self.members = view.members
        self.preloadable = not view.awake and not view.members
        self.baselines = view.baselines
        self.deadline_ms = float(view.slo.recovery_deadline_ms)
        self.share_ms = self.deadline_ms * share  # a violation this long is urgent
        self.steps = view.steps
        # A scalar tolerance: it and the uncapped limit are constants. None: worked out per window.
        self.scalar: float | None = view.steps[0][1] if len(view.steps) == 1 else None
        self.tolerance = self.scalar if self.scalar is not None else 0.0
        # No baselines: nothing to violate.
        self.uncapped = view.uncapped if view.baselines else math.inf
        self.limit = self.uncapped * (1.0 + self.tolerance / 100.0)
        self.capped_at = 0  # the cap whose baseline capped_base holds
        self.capped_base = 0.0


def baseline(steps: Sequence[tuple[int, float]], cap: int) -> float:
    """The baseline of the largest measured batch size within `cap` (the smallest when none is)."""
    chosen = steps[0][1]
    for size, ms in steps:
        if size > cap:
            break
        chosen = ms
    return chosen


class Decider:
    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.state = _ACCEPT
        self._pending: State | None = None
        self._agree = 0
        self.caps: dict[str, int] = {}
        self.shed: set[str] = set()
        self.yielding: set[str] = set()  # models giving way: run at autonomy.yield_nice, or throttled, or both
        self.throttled: dict[str, float] = {}  # models throttled -> the share of each period they are stopped
        self._calm = 0  # windows since a violation of a model the yielding ones yield to
        self._tracks: dict[str, _Track] = {}
        self._bound: list[_Track] = []  # the tracks of the views last seen, in their order
        self._ensembles: list[_Track] = []  # those of ensembles
        self._windows = 0  # decided so far
        self._seen_values: list[ModelView] = []
        s = self.settings.autonomy
        self._window_s = s.sample_ms * s.window_samples / 1e3
        self._deadline_share = s.deadline_share_pct / 100.0
        self._windows_to = {_EMERGENCY: s.emergency_windows or s.hysteresis_windows}
        self._calm_windows = s.calm_windows or s.hysteresis_windows
        self._yield_nice = s.yield_nice
        self._throttle_share = s.throttle_share
        self._give_way = bool(self._yield_nice or self._throttle_share)

    def _bind(self, views: Mapping[str, ModelView]) -> list[_Track]:
        """The tracks of `views` in their order, bound to them; the same list while the views stay the same
        objects (what a window costs must not grow with the work of working out each model's constants). Views
        are keyed by their own model, so the views alone tell; the lists compare in C, each item by identity
        first (a view equal to the one bound has the same constants)."""
        values = list(views.values())
        if values == self._seen_values:
            return self._bound
        tracks = self._tracks
        for gone in [m for m in tracks if m not in views]:
            del tracks[gone]
        bound = []
        for model, view in views.items():
            track: _Track | None = tracks.get(model)
            if track is None:
                track = tracks[model] = _Track(model, self._windows)
            track.bind(view, self._deadline_share)
            bound.append(track)
        self._bound, self._seen_values = bound, values
        self._ensembles = [t for t in bound if t.members]
        return bound

    def decide(self, window: windows.Window, views: Mapping[str, ModelView], explain: bool = False) -> Decision:
        s = self.settings.autonomy
        path: list[str] | None = [] if explain else None
        seconds = window.end - window.start
        if seconds <= 0:
            seconds = self._window_s
        loads = window.models
        get = loads.get
        tracks = self._bind(views)
        total_completed = window.completed
        if total_completed < 0:  # a window not made by window.build
            total_completed = 0
            for w in loads.values():
                total_completed += w.completed
        for track in self._ensembles:  # its steps count in its models' completions
            if (own := get(track.model)) is not None:
                total_completed -= own.completed

        violations: list[Violation] = []
        accelerating: list[str] = []
        past_deadline = urgent = False
        util = window.util_pct
        min_arrivals = s.preload_min_rate * seconds
        caps = self.caps
        end = window.end
        mature = self._windows - 2  # models that came before this count have two windows of arrivals behind them
        self._windows += 1
        for track in tracks:
            model = track.model
            load = get(model)
            if load is None:
                arrivals = 0
                p99 = None
                track.idle += 1
            else:
                arrivals = load.arrivals
                p99 = load.p99_ms
                if arrivals or load.queue_depth:
                    track.idle = 0
                else:
                    track.idle += 1
            # Slope and acceleration in arrivals per window (windows are of one length but for jitter, which
            # would make a flat rate look like it wobbles up and down).
            before = track.arrivals2
            if (track.preloadable and arrivals > before and arrivals >= min_arrivals
                    and arrivals - before > before - track.arrivals1 and track.first <= mature):
                accelerating.append(model)
            track.arrivals1 = before
            track.arrivals2 = arrivals
            pct = track.scalar
            other = -1.0  # the other models' load, once worked out
            if pct is None:
                other = self._other(track, load, get, util, total_completed)
                steps = track.steps
                pct = steps[-1][1]
                for below, step_pct in steps:
                    if other < below:
                        pct = step_pct
                        break
                track.tolerance = pct
                limit = track.uncapped * (1.0 + pct / 100.0)
            else:
                limit = track.limit
            if p99 is None:
                track.violating = 0
                continue
            if caps and (cap := caps.get(model)) is not None and track.baselines:
                if cap != track.capped_at:
                    track.capped_base = baseline(track.baselines, cap)
                    track.capped_at = cap
                limit = track.capped_base * (1.0 + pct / 100.0)
            if p99 <= limit:
                track.violating = 0
                continue
            if other < 0.0:  # not worked out above (a scalar tolerance): only a violation needs it
                other = self._other(track, load, get, util, total_completed)
            if track.violating == 0:
                track.violation_start = window.start
            track.violating += 1
            violating_ms = (end - track.violation_start) * 1e3
            late = violating_ms > track.deadline_ms
            if late or violating_ms > track.share_ms:
                urgent = True
                past_deadline = past_deadline or late
            violations.append(_violation((model, p99, limit, other, track.violating, violating_ms, late)))
            if path is not None:
                path.append(f"{model}: p99 {p99:.3f} ms > {limit:.3f} ms (tolerance {pct:g}% at other load "
                            f"{other:.1f}%), {track.violating} windows, {violating_ms:.0f} ms"
                            + (" past its recovery deadline" if late else ""))

        memory = window.memory_pct
        if memory >= s.emergency_above_pct or urgent:
            candidate = _EMERGENCY
        elif memory >= s.optimize_above_pct or violations:
            candidate = _OPTIMIZE
        elif memory < s.preload_below_pct:
            candidate = _PRELOAD
        else:
            candidate = _ACCEPT
        if path is not None:
            path.append(f"memory {memory:.1f}% (preload < {s.preload_below_pct:g}, optimize >= "
                        f"{s.optimize_above_pct:g}, emergency >= {s.emergency_above_pct:g}), "
                        f"{len(violations)} violating, past deadline: {past_deadline} -> candidate {candidate}")

        previous = self.state
        if candidate == previous:
            self._pending, self._agree = None, 0
        elif candidate == self._pending:
            self._agree += 1
        else:
            self._pending, self._agree = candidate, 1
        needed = (self._calm_windows if previous == _EMERGENCY
                  else self._windows_to.get(candidate, s.hysteresis_windows))
        if self._pending is not None and self._agree >= needed:
            self.state, self._pending, self._agree = candidate, None, 0
        state = self.state
        if path is not None:
            path.append(f"state {previous} -> {state}" if state != previous else
                        f"state stays {state}" + (f" ({self._agree}/{needed} windows for "
                                                   f"{self._pending})" if self._pending else ""))

        actions: list[Action] = []
        if previous == _EMERGENCY and state != _EMERGENCY and self.shed:
            actions += [Unshed(m) for m in sorted(self.shed)]
            self.shed.clear()
        if state in (_PRELOAD, _ACCEPT) and self.caps:
            actions += [RestoreBatchCap(m) for m in sorted(self.caps)]
            self.caps.clear()
        if state == _PRELOAD:
            actions += [Preload(m) for m in accelerating]
        elif state == _OPTIMIZE:
            self._optimize(tracks, violations, actions)
        elif state == _EMERGENCY:
            self._emergency(tracks, actions, memory >= s.emergency_above_pct)
        if self._give_way and (violations or self.yielding):
            self._yield(tracks, violations, state, actions)
        if path is not None:
            path.append(f"actions: {actions or 'none'}")
        return _decision((state, candidate, state != previous, tuple(actions), tuple(violations),
                          tuple(path) if path is not None else ()))

    @staticmethod
    def _other(track: _Track, load: windows.ModelWindow | None, get: Callable[[str], windows.ModelWindow | None],
               util: float, total_completed: int) -> float:
        """The load of the node's other models: its utilisation times their share of the completed requests."""
        if not total_completed:
            return util
        if track.members:  # the chain's share of the node's work is its models'
            completed = 0
            for member in track.members:
                if (step := get(member)) is not None:
                    completed += step.completed
            completed = min(completed, total_completed)
        else:
            completed = load.completed if load is not None else 0
        return util * (1.0 - completed / total_completed)

    def _optimize(self, tracks: Sequence[_Track], violations: Sequence[Violation], actions: list[Action]) -> None:
        caps = self.caps
        if violations:
            violating = {v.model for v in violations}
            tolerance = {t.model: t.tolerance for t in tracks}
            # A violating ensemble's models are part of it, not co-runners.
            excepted = violating.union(*(t.members for t in self._ensembles if t.model in violating))
            # Co-runners that may give way, the most tolerant first; each gives way once per window.
            donors = sorted((t for t in tracks if t.awake and t.model not in excepted
                             and caps.get(t.model, t.view.max_batch) > 1), key=lambda t: (-t.tolerance, t.model))
            for victim in sorted(violating, key=lambda m: (tolerance[m], m)):
                if not donors or donors[0].tolerance < tolerance[victim]:
                    continue
                best = donors.pop(0)
                cap = caps[best.model] = max(1, caps.get(best.model, best.view.max_batch) // 2)
                actions.append(LowerBatchCap(best.model, cap))
        idle_after = self.settings.autonomy.idle_windows
        idle = [t for t in tracks if t.awake and t.idle >= idle_after]
        if idle:
            least = min(t.tolerance for t in tracks if t.awake)
            for track in sorted(idle, key=lambda t: (-t.tolerance, t.model)):
                if track.tolerance > least:
                    actions.append(Demote(track.model, _rest(track.view)))

    def _yield(self, tracks: Sequence[_Track], violations: Sequence[Violation], state: State,
               actions: list[Action]) -> None:
        yielding = self.yielding
        protected = {v.model for v in violations if v.model not in yielding}
        if protected:
            self._calm = 0
            # A violating ensemble's models are part of it, not co-runners.
            excepted = {v.model for v in violations}.union(*(t.members for t in self._ensembles
                                                             if t.model in protected))
            ratio = self.settings.autonomy.yield_tolerance_ratio
            floor = min(t.tolerance for t in tracks if t.model in protected) * ratio
            for track in tracks:
                if (track.awake and not track.members and track.tolerance >= floor and track.model not in excepted
                        and track.model not in yielding):
                    yielding.add(track.model)
                    if self._yield_nice:
                        actions.append(LowerPriority(track.model, self._yield_nice))
                    if self._throttle_share:
                        self._throttle(track, actions)
            return
        self._calm += 1
        if yielding and state in (_PRELOAD, _ACCEPT) and self._calm >= self.settings.autonomy.yield_calm_windows:
            if self._yield_nice:
                actions += [RestorePriority(m) for m in sorted(yielding)]
            actions += [Unthrottle(m) for m in sorted(self.throttled)]
            yielding.clear()
            self.throttled.clear()

    def _throttle(self, track: _Track, actions: list[Action]) -> None:
        """Throttle a model that gives way, by no more than its own tolerance allows."""
        tolerance = max(0.0, track.tolerance)
        share = min(self._throttle_share, tolerance / (100.0 + tolerance))
        if share > 0.0:
            self.throttled[track.model] = share
            actions.append(Throttle(track.model, share))

    def _emergency(self, tracks: Sequence[_Track], actions: list[Action], memory: bool) -> None:
        # One pass: the least tolerance of the models with a worker or traffic, and the most tolerant of them not
        # shed yet (by name among equals).
        shed = self.shed
        least = math.inf
        chosen: _Track | None = None
        for t in tracks:
            if t.members or not (t.awake or t.arrivals2):
                continue
            tolerance = t.tolerance
            if tolerance < least:
                least = tolerance
            if t.model not in shed and (chosen is None or tolerance > chosen.tolerance
                                        or (tolerance == chosen.tolerance and t.model < chosen.model)):
                chosen = t
        if chosen is None or chosen.tolerance <= least:
            return
        self.shed.add(chosen.model)
        actions.append(Shed(chosen.model, self.settings.autonomy.shed_retry_after_ms))
        if memory and chosen.awake:
            actions.append(Demote(chosen.model, _rest(chosen.view)))


def _rest(view: ModelView) -> api.Tier:
    """Where a demoted model goes: WARM keeps a GPU model a host-to-device copy away; a CPU model freezes."""
    return api.Tier.WARM if view.gpu else api.Tier.FROZEN
