"""Tuned-config tables: the typed entry, format, the shared key function, lookup, profile directories,
versions and staleness, validation and merging. Nothing here imports the kernels package (kernels use
profiles, never the other way): lookup gets the backend object, validate the op objects, from the caller."""

from moe_tune.profiles.table import ENV_PROFILE_DIR, search_dirs, table_path, use_profiles, write_dir
from moe_tune.profiles.entry import Entry
from moe_tune.profiles.entry import entry_key, key_fields, key_from_fields
from moe_tune.profiles.lookup import LookupResult, lookup
from moe_tune.profiles.merge import MergeDecision, MergeReport, merge_tables
from moe_tune.profiles.table import SCHEMA_VERSION, migrate, read_table, write_entries
from moe_tune.profiles.validate import Problem, ValidationReport, validate_paths, validate_table
from moe_tune.profiles.entry import (ENV_STALE_POLICY, STALE_POLICIES, StaleEntryError, entry_versions, staleness,
                                        use_stale_policy)

__all__ = [
    "ENV_PROFILE_DIR", "ENV_STALE_POLICY", "Entry", "LookupResult", "MergeDecision", "MergeReport", "Problem",
    "SCHEMA_VERSION", "STALE_POLICIES", "StaleEntryError", "ValidationReport", "entry_key", "entry_versions",
    "key_fields", "key_from_fields", "lookup", "merge_tables", "migrate", "read_table", "search_dirs", "staleness",
    "table_path", "use_profiles", "use_stale_policy", "validate_paths", "validate_table", "write_dir",
    "write_entries",
]
