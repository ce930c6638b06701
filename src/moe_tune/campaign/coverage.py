"""How well the tables cover a model: for every kernel call one layer runs (`models.layer_cases`, through
`plan.model_campaign_cases`) at the token counts and ep sizes asked, what lookup answers (its own source and
reason: exact, interval, robust, nearest or default), the entry's age and staleness, and what tuning the calls
that are not tuned for their own shape would cost (`estimate`, from the sweep times the tables recorded).

A call counts as covered when lookup answers `exact` or `interval` (a ladder sweep measured its count's
interval) from a fresh entry; `nearest`, `robust`, `default` and stale entries are to tune.

At ep x tp >= 2 (`tp` None: 1) the layer is the one across an ep x tp mesh (`models.sharded_runs`), `tokens` per
device of the expert axis: its kernel calls under each strategy, the strategy's own lookup (`moe_sharding`), and
beside the calls the collectives it runs (`models.collectives`, `Coverage.collectives`: rows of op `collective`
with the bytes one device hands each; no tuned kernels, never to tune).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moe_tune.campaign import estimate as costs
from moe_tune.campaign.request import PlannedSweep, model_campaign_cases
from moe_tune.core.errors import UsageError
from moe_tune.kernels import get_op
from moe_tune.profiles.entry import entry_key
from moe_tune.profiles.lookup import device_of_kind
from moe_tune.tuner.request import SweepSettings

COVERED = ("exact", "interval")
COLLECTIVE = "collective"  # the op and source of a collective's row


@dataclasses.dataclass(frozen=True)
class CallCoverage:
    """One kernel call of the layer and what lookup answers for it."""

    call: str  # `qwen3-30b-a3b gate/up fwd tokens=512 ep=8`
    op: str
    backend: str
    key: str
    source: str  # lookup's: exact | interval | robust | nearest | default
    reason: str  # lookup's why
    config: str
    tuned_at: str | None
    age_days: float | None
    stale: str  # what differs ("" when fresh or no entry)
    to_tune: bool
    estimate: str | None  # candidates and time to tune it (`estimate.Cost.text`); None when covered
    estimate_s: float | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Coverage:
    calls: tuple[CallCoverage, ...]
    notes: tuple[str, ...]
    device_kind: str
    distribution: str
    collectives: tuple[CallCoverage, ...] = ()  # the sharded layer's (ep > 1), after its kernel calls

    @property
    def to_tune(self) -> list[CallCoverage]:
        """The calls to tune, one per table key (two calls of one shape are one sweep)."""
        return list({c.key: c for c in self.calls if c.to_tune}.values())

    def total(self) -> str:
        """`3 of 10 kernel calls to tune (3 sweeps): ~2.5 min` (`time unknown` without recorded sweeps)."""
        todo = self.to_tune
        known = [c.estimate_s for c in todo if c.estimate_s is not None]
        when = ("nothing to tune" if not todo else f"~{costs.duration(sum(known))}" if len(known) == len(todo)
                else f"~{costs.duration(sum(known))} for {len(known)} of them, the others' time unknown")
        calls = sum(c.to_tune for c in self.calls)
        return f"{calls} of {len(self.calls)} kernel calls to tune ({len(todo)} sweeps): {when}"

    def to_json(self) -> dict[str, Any]:
        return {"device_kind": self.device_kind, "distribution": self.distribution, "calls": [c.to_json() for c in
                self.calls], "collectives": [c.to_json() for c in self.collectives], "notes": list(self.notes),
                "to_tune": len(self.to_tune), "summary": self.total()}


def _age_days(tuned_at: str | None, now: datetime.datetime) -> float | None:
    try:
        when = datetime.datetime.fromisoformat(str(tuned_at))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return (now - when).total_seconds() / 86400


def coverage(models: Sequence[str], tokens: Sequence[int], eps: Sequence[int], *, dtype: str,
             quant: Mapping[str, Any] | None = None, direction: str = "all", distribution: str | None = None,
             backend: str | None = None, device_kind: str | None = None, profile_dir: Path | None = None,
             settings: SweepSettings | None = None, tp: int | None = None) -> Coverage:
    """What lookup answers for each kernel call of one layer of each of `models` at each of `tokens` and
    `eps` (`direction`: `all` training, `fwd` serving), for `distribution` (None: as the runtime assumes),
    on `device_kind` (None: this machine's; another must be a known one, `profiles.lookup.device_of_kind`), with
    `backend` (None: each op's default on that device; applied to the ops that have it); and
    the estimated cost of tuning the calls not covered with `settings` (default: a grid sweep). At ep x tp >= 2
    (`tp` None: 1) the layer across an ep x tp mesh, `tokens` per device, its collectives beside its calls."""
    settings = settings or SweepSettings()
    device_kind = device_of_kind(device_kind).kind  # a known kind, never a path
    if profile_dir is not None and not Path(profile_dir).is_dir():
        raise UsageError(f"--profile-dir {profile_dir} is not a directory (coverage reads the sweep times recorded "
                         "there; lookups read every profile dir without it)")
    cases, notes = model_campaign_cases(models, tokens, eps, dtype=dtype, quant=quant, direction=direction, tp=tp)
    backends = _backend_per_op(backend, sorted({c.op for c in cases}), notes)
    history = costs.recorded(device_kind, sorted({c.op for c in cases}), profile_dir)
    now = datetime.datetime.now(datetime.timezone.utc)
    rows, asked = [], distribution
    for case in cases:
        kernel_op = get_op(case.op)
        found = kernel_op.lookup(case.problem, backend=backends[case.op], distribution=distribution,
                                 device_kind=device_kind)
        asked = found.key.rsplit("distribution=", 1)[-1]
        entry = found.entry if found.source != "default" else None
        to_tune = found.source not in COVERED or bool(found.stale)
        cost = None
        if to_tune:
            key = entry_key(case.op, case.problem, found.backend, asked)
            cost = costs.estimate(PlannedSweep(case.op, case.problem, found.backend, key, case.label), settings,
                                  history)
        tuned_at = entry.tuned_at if entry is not None else None
        rows.append(CallCoverage(
            call=case.label, op=case.op, backend=found.backend, key=found.key, source=found.source,
            reason=found.reason, config=found.config.label(), tuned_at=tuned_at,
            age_days=None if tuned_at is None else _age_days(tuned_at, now), stale=found.stale, to_tune=to_tune,
            estimate=None if cost is None else cost.text, estimate_s=None if cost is None else cost.seconds))
    return Coverage(tuple(rows), tuple(notes), device_kind, str(asked),
                    tuple(_collective_rows(models, tokens, eps, 1 if tp is None else tp, dtype=dtype)))


def _collective_rows(models: Sequence[str], tokens: Sequence[int], eps: Sequence[int], tp: int, *,
                     dtype: str) -> list[CallCoverage]:
    """A row per collective of the sharded layer (`models.collectives`) of each model at each ep that divides
    its experts with ep x tp >= 2, and each token count."""
    from moe_tune.layer.models import collectives, get_preset, presets

    rows = []
    for name in (list(presets()) if list(models) == ["all"] else models):
        preset = get_preset(name)
        for ep in eps:
            if ep * tp < 2 or preset.experts % ep:
                continue
            for count in tokens:
                for what, size in collectives(preset, count, ep=ep, tp=tp, dtype=dtype):
                    rows.append(CallCoverage(
                        call=f"{name} {what} tokens={count} ep={ep} tp={tp}", op=COLLECTIVE, backend="-", key="-",
                        source=COLLECTIVE, reason=f"{size} bytes per device (operand)", config="-", tuned_at=None,
                        age_days=None, stale="", to_tune=False, estimate=None, estimate_s=None))
    return rows


def _backend_per_op(backend: str | None, ops: Sequence[str], notes: list[str]) -> dict[str, str | None]:
    """`backend` for the ops that have it, None (the device's default) for the others, with a note naming
    those; UsageError when no op of the layer has it."""
    having = [op for op in ops if backend is None or backend in get_op(op).backends.names()]
    if not having:
        known = sorted({name for op in ops for name in get_op(op).backends.names()})
        raise UsageError(f"--backend {backend!r} is no backend of any op of the layer ({', '.join(ops)}); "
                         f"choose from {', '.join(known)}")
    others = [op for op in ops if op not in having]
    if others:
        notes.append(f"--backend {backend} applies to {', '.join(having)}; {', '.join(others)} "
                     f"ask{'s' if len(others) == 1 else ''} about {'its' if len(others) == 1 else 'their'} default "
                     "backend")
    return {op: backend if op in having else None for op in ops}


def age_text(days: float | None) -> str:
    """`3 h`, `12 d`, `-` (no entry, or no date recorded)."""
    if days is None:
        return "-"
    return f"{days * 24:.0f} h" if days < 2 else f"{days:.0f} d"
