"""Output files readable as the user's umask says, whatever wrote them.

safetensors (0.8) writes its files owner-only (0600), `save_file` and transformers'
`save_pretrained` alike, while every other file a step writes follows the umask (0644 under
the usual 022). A vLLM or SGLang server running as another user, or in a container, could then
read an exported draft's config but not its weights. Each step that writes safetensors files
for others to read opens them up here, to what the umask would have given any new file.
"""

from __future__ import annotations

import os
from pathlib import Path


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (os.umask can only
    be read by setting it, which a thread creating a file at that instant would see)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def as_umask(path: str | Path) -> None:
    """Give `path` (a file, or every file under a folder) that is owner-only (0600, as
    safetensors writes it) the mode the umask gives a new file (0644 under 022)."""
    mode = 0o666 & ~_umask()
    path = Path(path)
    for file in (path.rglob("*") if path.is_dir() else [path]):
        if file.is_file() and not file.is_symlink() and file.stat().st_mode & 0o777 == 0o600:
            file.chmod(mode)
