"""The table entry: one typed record that the tuner writes and lookup, report, validate, merge and the CLI read.

An entry's JSON (one value of a table's `entries`, see `table.py`) is `Entry.to_json()`; reading goes through
`Entry.from_json()`, which accepts every entry a table of schema 1 (migrated) or 2 holds: fields a sweep of an
older moe-tune did not write are remembered as absent (and stay absent when written back), and keys this
version does not know are kept in `extra`, so `Entry.from_json(x).to_json() == x`.

The nested records (`timing`, `default`, `candidates`, `distribution`, `versions`, `search`) stay JSON objects
(plain dicts) because their content grows with the tuner; the properties below read the parts that readers
use, tolerating an entry that lacks them.

The key (`entry_key`) is the one key function: the tuner calls it when it writes an entry and the runtime when it
reads one; if the two ever disagreed, tuned entries would silently never be used.

What an entry was tuned with, and when it is stale:

Every entry records `versions`: the jax, jaxlib, moe-tune and tune-jax distributions installed when it was
tuned and `backend_revision`, the `Backend.revision` of the kernel it was tuned for (`entry_versions`).

An entry is *stale* when it was tuned with

- another revision of its kernel backend (a bumped revision means the kernel changed in a way that can change
  which config is fastest or whether a config is valid), or
- another JAX major.minor than the installed one (XLA and Pallas lowering change between minor releases).

An entry without `backend_revision` (schema 1, before revisions were recorded) counts as revision 1: every
backend started at revision 1 when revisions were introduced, so such an entry is stale exactly when its
backend has been bumped since. An entry whose JAX version is missing or unparseable is not stale on that
count (nothing to compare).

What lookup does with a stale entry is the *stale policy*: `use` (the default: use it, warn once per table and
difference), `skip` (ignore it, warn once: lookup goes on to the next profile dir's exact entry, then the
nearest fresh entry, then the heuristic default) or `error` (raise `StaleEntryError` naming the file, the key
and what differs). Set by, highest first: `lookup(..., stale_policy=...)`, `use_stale_policy(...)` blocks,
`$MOE_TUNE_STALE_POLICY`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from moe_tune.core import contexts, settings
from moe_tune.core.contexts import DEFAULT_STALE_POLICY, STALE_POLICIES, check_policy, use_stale_policy  # noqa: F401
from moe_tune.core.errors import TableError

JSON = dict[str, Any]


# The entry's JSON keys in the order a sweep writes them (`provenance` only after `moe-tune merge`).
_ORDER = ("key", "op", "fields", "config", "timing", "timing_fallback", "default", "speedup_over_default",
          "candidates", "failures", "results", "distribution", "flops", "versions", "hostname", "platform",
          "device_kind", "tuned_at", "within_noise_of_default", "verdict", "interrupted", "search", "sweep_wall_s",
          "provenance")
_REQUIRED = ("key", "fields", "config")


@dataclasses.dataclass(frozen=True, eq=True)
class Entry:
    """One tuned config and how it was found.

    key: `key.key_from_fields(op, fields)`; fields: the key's parts (problem fields, backend, distribution);
    config: the winning config as a JSON object; timing: the winner's `tuner.timing.Timing` as JSON (median_s,
    min_s, max_s, spread, samples, method, wall_median_s, samples_s); timing_fallback: why the wall clock timed
    the sweep, else None; default: {config, status, median_s, reason} of the heuristic default;
    speedup_over_default: default median / winner median (None when the default failed); candidates: {tried,
    ok, failed, wrong, compiles}; failures / results: one record per failed-or-wrong / correct candidate
    (a result's median_s and spread are of its sweep round; before `verdict` was recorded, a finalist's were
    of the final round);
    distribution: {name, seed, ...what the op records: group_sizes, ep, experts, valid_fraction, and for a
    quantized ragged_dot quantization_error}; flops: of
    the problem; versions: `versions.entry_versions` (jax, jaxlib, moe-tune, tune-jax, backend_revision);
    hostname, platform, device_kind, tuned_at (ISO 8601, UTC); within_noise_of_default: the default kept for
    being within noise; verdict: how the winner was chosen and the final round's timings (`verdict.py`;
    read it with `verdict.verdict_of`, which derives one for entries that lack it); interrupted: written
    from a Ctrl-C'd sweep; search: the strategy's record; sweep_wall_s; provenance: the entries `moe-tune merge`
    chose between (None when not merged).
    """

    key: str
    fields: Mapping[str, Any]
    config: Mapping[str, Any]
    op: str | None = None
    timing: Mapping[str, Any] | None = None
    timing_fallback: str | None = None
    default: Mapping[str, Any] | None = None
    speedup_over_default: float | None = None
    candidates: Mapping[str, Any] | None = None
    failures: list[JSON] = dataclasses.field(default_factory=list)
    results: list[JSON] = dataclasses.field(default_factory=list)
    distribution: Mapping[str, Any] | None = None
    flops: int | None = None
    versions: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hostname: str | None = None
    platform: str | None = None
    device_kind: str | None = None
    tuned_at: str | None = None
    within_noise_of_default: bool | None = None
    verdict: Mapping[str, Any] | None = None
    interrupted: bool | None = None
    search: Mapping[str, Any] | None = None
    sweep_wall_s: float | None = None
    provenance: list[JSON] | None = None
    # JSON keys this moe-tune does not know, kept so that a round trip loses nothing.
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Known keys the JSON lacked (an entry of an older moe-tune): to_json leaves them out again.
    absent: frozenset[str] = frozenset()

    @classmethod
    def from_json(cls, data: Mapping[str, Any], key: str | None = None) -> Entry:
        """The entry of a table's JSON (after schema migration). `key`: the key it is stored under, used when
        the JSON lacks its own (schema 1). Raises ValueError when `fields` or `config` is not an object."""
        if not isinstance(data, Mapping):
            raise ValueError(f"entry is {type(data).__name__}, not an object")
        for name in ("fields", "config"):
            if not isinstance(data.get(name), Mapping):
                raise ValueError(f"entry lacks a '{name}' object")
        known = {name: data[name] for name in _ORDER if name in data}
        if "key" not in known:
            if key is None:
                raise ValueError("entry lacks its 'key'")
            known["key"] = key  # written from now on: every schema-2 entry holds its key
        # provenance: written only when set, so it need not be remembered as absent
        absent = frozenset(name for name in _ORDER if name not in known and name != "provenance")
        extra = {name: value for name, value in data.items() if name not in _ORDER}
        return cls(**known, extra=extra, absent=absent)

    def to_json(self) -> JSON:
        """The entry as a table stores it: known keys in sweep order, then the unknown ones."""
        out: JSON = {}
        for name in _ORDER:
            value = getattr(self, name)
            if name in self.absent or (name == "provenance" and value is None):
                continue
            out[name] = value
        out.update(self.extra)
        return out

    def replace(self, **changes: Any) -> Entry:
        """A copy with `changes`; a changed field that was absent is written from now on."""
        return dataclasses.replace(self, absent=self.absent - changes.keys(), **changes)

    # -- what readers use --------------------------------------------------------------------------------------

    @property
    def backend(self) -> str | None:
        return self.fields.get("backend")

    @property
    def direction(self) -> str | None:
        return self.fields.get("direction")

    @property
    def median_s(self) -> float | None:
        """The winner's median time in seconds (None when the entry has no timing, or one that is not a
        positive number: `record_problems` names it)."""
        return seconds(_get(self.timing, "median_s"))

    @property
    def speedup(self) -> float | None:
        """`speedup_over_default` when it is a positive number, else None."""
        return seconds(self.speedup_over_default)

    @property
    def quantization_error(self) -> float | None:
        """For a quantized problem: the error of the dequantized operands' product against the unquantized
        one (`distribution.quantization_error`, relative to max |unquantized|), recorded, not gated on."""
        return _get(self.distribution, "quantization_error")

    @property
    def timing_method(self) -> str | None:
        return _get(self.timing, "method")

    @property
    def default_median_s(self) -> float | None:
        """The default config's median time in seconds (None when not recorded or not a positive number)."""
        return seconds(_get(self.default, "median_s"))

    @property
    def default_config(self) -> Mapping[str, Any] | None:
        return _get(self.default, "config")

    @property
    def backend_revision(self) -> Any:
        """The kernel revision it was tuned with as recorded (None: not recorded, i.e. schema 1)."""
        return _get(self.versions, "backend_revision")

    def count(self, name: str) -> int | None:
        """`candidates[name]` (tried, ok, failed, wrong, compiles), None when not recorded."""
        return _get(self.candidates, name)


def _get(record: Any, name: str) -> Any:
    return record.get(name) if isinstance(record, Mapping) else None


def seconds(value: Any) -> float | None:
    """`value` as a time in seconds: a finite positive number, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def record_problems(entry: Mapping[str, Any]) -> list[str]:
    """What is wrong with the records of a (structurally sound) entry's JSON that readers compute with: the
    kernel revision, the winner's and the default's times, the speedup, the provenance. Empty when nothing.
    `moe-tune validate` reports these as errors; `moe-tune report` skips such an entry with one warning."""
    found = []
    revision = _get(entry.get("versions"), "backend_revision")
    if revision is not None and (not isinstance(revision, int) or isinstance(revision, bool) or revision < 1):
        found.append(f"versions.backend_revision {revision!r} is not a positive integer")
    for where, value in (("timing.median_s", _get(entry.get("timing"), "median_s")),
                         ("default.median_s", _get(entry.get("default"), "median_s"))):
        if value is not None and seconds(value) is None:
            found.append(f"{where} {value!r} is not a positive number of seconds")
    speedup = entry.get("speedup_over_default")
    if speedup is not None and seconds(speedup) is None:
        found.append(f"speedup_over_default {speedup!r} is not a positive number")
    if any(not isinstance(record, Mapping) for record in entry.get("provenance") or []):
        found.append("'provenance' holds something other than objects")
    return found


def key_fields(problem: Any, backend: str, distribution: str) -> dict[str, Any]:
    """Everything a tuned config depends on: the problem's shape/dtype fields, the backend, the
    group-size distribution. Problems provide `key_fields()` (ordered)."""
    return {**problem.key_fields(), "backend": backend, "distribution": distribution}


def key_from_fields(op: str, fields: dict[str, Any]) -> str:
    """`ragged_dot|direction=fwd|m=4096|...|backend=tiled|distribution=balanced`."""
    return "|".join([op, *(f"{name}={value}" for name, value in fields.items())])


def entry_key(op: str, problem: Any, backend: str, distribution: str) -> str:
    return key_from_fields(op, key_fields(problem, backend, distribution))


ENV_STALE_POLICY = settings.STALE_POLICY
DISTRIBUTIONS = ("jax", "jaxlib", "moe-tune", "tune-jax")
UNRECORDED_REVISION = 1  # what an entry without `backend_revision` is taken to have been tuned with


class StaleEntryError(TableError):
    """A stale entry met under the `error` stale policy; the message names the file, the key and what differs."""


def installed_versions() -> dict[str, str]:
    """Installed version of each distribution an entry records ("unknown" when not installed)."""
    found = {}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "unknown"
    return found


def installed_jax() -> str:
    import jax

    return jax.__version__


def entry_versions(backend: Any) -> dict[str, Any]:
    """The `versions` record of an entry tuned now with `backend` (a Backend instance or class):
    `{"jax", "jaxlib", "moe-tune", "tune-jax", "backend_revision"}`."""
    return {**installed_versions(), "backend_revision": int(getattr(backend, "revision", UNRECORDED_REVISION))}


def stale_policy(explicit: str | None = None) -> str:
    """The policy in force: `explicit`, else the innermost `use_stale_policy` block, else the environment."""
    if explicit is not None:
        return check_policy(explicit)
    block = contexts.block_stale_policy()
    if block is not None:
        return block
    env = settings.stale_policy()
    if env is None:
        return DEFAULT_STALE_POLICY
    return check_policy(env, f"${ENV_STALE_POLICY}")


def _minor(version: Any) -> tuple[int, int] | None:
    match = re.match(r"^\s*(\d+)\.(\d+)", str(version)) if version is not None else None
    return (int(match.group(1)), int(match.group(2))) if match else None


def _versions_of(entry: Entry | Mapping[str, Any]) -> Mapping[str, Any]:
    """An entry's `versions` record (an `Entry` or its JSON); {} when it has none."""
    versions = entry.versions if isinstance(entry, Entry) else entry.get("versions")
    return versions if isinstance(versions, Mapping) else {}


def recorded_revision(entry: Entry | Mapping[str, Any]) -> int:
    """The backend revision an entry was tuned with (`UNRECORDED_REVISION` when it does not say)."""
    revision = _versions_of(entry).get("backend_revision")
    return revision if isinstance(revision, int) and not isinstance(revision, bool) else UNRECORDED_REVISION


def staleness(entry: Entry | Mapping[str, Any], backend: Any, jax_version: str | None = None) -> list[str]:
    """What differs between what `entry` was tuned with and what is installed; empty when it is fresh.

    Each item is one difference, free of anything entry-specific so that it can key a once-only warning:
    `"tiled revision 1 (installed: 2)"`, `"jax 0.9 (installed: 0.10)"`.
    """
    found = []
    versions = _versions_of(entry)
    current = int(getattr(backend, "revision", UNRECORDED_REVISION))
    tuned = recorded_revision(entry)
    if tuned != current:
        unrecorded = "" if "backend_revision" in versions else ", assumed: the entry predates recorded revisions"
        found.append(f"{backend.name} revision {tuned}{unrecorded} (installed: {current})")
    tuned_jax, installed = _minor(versions.get("jax")), _minor(jax_version or installed_jax())
    if tuned_jax is not None and installed is not None and tuned_jax != installed:
        found.append(f"jax {tuned_jax[0]}.{tuned_jax[1]} (installed: {installed[0]}.{installed[1]})")
    return found
