"""Where the lock of a file under a profile dir lives, and the file mode of what is written for sharing.

Locks sit in one hidden folder beside the files they guard, `<dir>/.locks/<name>.lock` (a table
`cpu/ragged_dot.json` is locked by `cpu/.locks/ragged_dot.json.lock`), so that a table directory a user
shares or copies holds only tables. Every writer of a file takes its lock through `lock_path`, so they all
agree on it: the one mapping is the guarantee that two writers exclude each other.
"""

from __future__ import annotations

import os
from pathlib import Path

LOCK_DIR = ".locks"


def lock_path(path: Path | str) -> Path:
    """The lock file of `path` (its folder is created): `<path's dir>/.locks/<path's name>.lock`."""
    path = Path(path)
    folder = path.parent / LOCK_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{path.name}.lock"


def shared_mode() -> int:
    """The mode a new file gets from `open()`: 0666 less the process umask (0644 under the usual 022).

    `tempfile.mkstemp`, which atomic writes use, creates files 0600 whatever the umask; a table written
    that way could not be read by the people it is shared with."""
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process umask, read from /proc where it can be (setting it to read it is not thread-safe)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask
