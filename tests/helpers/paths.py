"""Where the repository is, for tests that run its scripts or read its files."""

import shutil
import subprocess
from pathlib import Path

#: the repository root (the folder holding README.md)
REPO = Path(__file__).resolve().parents[2]


def bash_lines(path: Path) -> list[str]:
    """The lines of the ```bash blocks of a markdown file."""
    lines, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
        elif inside:
            lines.append(line)
    return lines


def tracked_copy(folder: Path) -> Path:
    """The repository's tracked files, copied into ``folder`` (what a fresh clone holds); returns it."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    return folder
