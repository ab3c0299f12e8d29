"""Files every pytest-xdist worker of a run shares (checkpoints, converted weights)."""

from pathlib import Path

from filelock import FileLock


def made_once(path: Path, make) -> Path:
    """`path`, made by `make(path)` unless it exists: by the first worker to ask, while the
    others wait for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            make(path)
    return path
