"""What a newcomer reads stays the product's own: bench/RESULTS.md is one current table per
capability (at most 400 lines, every row's command key listed under it), bench/ holds at most
two shell scripts (the device runner and its environment), and no text speaks of how the
project was made (ordinal "... session", "helper-N", "issue N")."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
TEXT_FOLDERS = ("docs", "bench", "layersplit", "runtime", "shards", "ipc", "draft", "launch",
                "configs")
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|"
            "twentieth|last|previous|next|this|earlier|later")
WORKBENCH = re.compile(rf"\b({ORDINALS}) session\b|\bhelper-\d+\b|\bissue #?\d+\b",
                       re.IGNORECASE)


def test_results_is_short_and_every_row_has_its_command():
    text = RESULTS.read_text()
    assert len(text.splitlines()) <= 400
    keys = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 7 and re.fullmatch(r"[A-Z]\d+", cells[-1]):
            keys.add(cells[-1])
    assert len(keys) > 20
    listed = " ".join(line for line in text.splitlines() if not line.startswith("|"))
    missing = sorted(k for k in keys if not re.search(
        rf"\b{k}\b|\b{k[0]}(\d+)[–-]{k[0]}?(\d+)\b", listed))
    # (a range such as "V4–V6" lists each key inside it)
    ranges = [(m.group(1), int(m.group(2)), int(m.group(3)))
              for m in re.finditer(r"\b([A-Z])(\d+)[–-][A-Z]?(\d+)\b", listed)]
    missing = [k for k in missing
               if not any(k[0] == c and lo <= int(k[1:]) <= hi for c, lo, hi in ranges)]
    assert not missing, f"rows whose command key has no command listed: {missing}"


def test_bench_holds_at_most_two_shell_scripts():
    assert len(list((ROOT / "bench").glob("*.sh"))) <= 2


def test_no_words_about_how_the_project_was_made():
    files = [ROOT / "README.md"] + [p for folder in TEXT_FOLDERS
                                   for p in (ROOT / folder).rglob("*")
                                   if p.suffix in (".md", ".py", ".sh", ".toml", ".txt")]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files
             for m in WORKBENCH.finditer(p.read_text(errors="replace"))]
    assert not found, found
