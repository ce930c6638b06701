"""Tuned-config tables: format, the shared key function, lookup and profile directories."""

from moe_tune.profiles.dirs import ENV_PROFILE_DIR, search_dirs, table_path, use_profiles, write_dir
from moe_tune.profiles.key import entry_key, key_fields, key_from_fields
from moe_tune.profiles.lookup import LookupResult, lookup
from moe_tune.profiles.table import SCHEMA_VERSION, read_table, write_entries

__all__ = [
    "ENV_PROFILE_DIR", "LookupResult", "SCHEMA_VERSION", "entry_key", "key_fields", "key_from_fields",
    "lookup", "read_table", "search_dirs", "table_path", "use_profiles", "write_dir", "write_entries",
]
