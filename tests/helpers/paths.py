"""Where the repository is, for tests that run its scripts or read its files."""

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
