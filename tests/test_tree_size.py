"""The tracked tree stays small: a GPU call carries the working tree, at most 64 MiB, so what git
tracks stays under 30 MB. Per-run figures and report.html files under results/reference/ are not
tracked (.gitignore; docs/results.md says how to draw them again)."""
import subprocess

import pytest

from tests.helpers import ROOT

LIMIT_BYTES = 30_000_000


def tracked_sizes() -> dict[str, int]:
    """Each tracked file's size on disk (a file deleted from the working tree counts 0)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    paths = [p for p in listed.stdout.decode().split("\0") if p]
    return {p: (ROOT / p).lstat().st_size if (ROOT / p).is_symlink() or (ROOT / p).exists() else 0 for p in paths}


def test_tracked_tree_is_under_30_mb():
    sizes = tracked_sizes()
    total = sum(sizes.values())
    biggest = sorted(sizes.items(), key=lambda item: -item[1])[:10]
    assert total < LIMIT_BYTES, (f"the tracked tree is {total / 1e6:.1f} MB, over {LIMIT_BYTES / 1e6:.0f} MB; "
                                 "the 10 biggest tracked files:\n"
                                 + "\n".join(f"{size / 1e6:8.2f} MB  {path}" for path, size in biggest))
