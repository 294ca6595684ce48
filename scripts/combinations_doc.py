"""Write docs/combinations.md and the README's table of refused pairs from the one
declaration, graphcp/combinations.py (tests/test_combinations.py checks both are current).

    python scripts/combinations_doc.py
"""

from __future__ import annotations

from pathlib import Path

from graphcp.combinations import combinations_doc, readme_table

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- combinations: start -->\n", "\n<!-- combinations: end -->"


def main() -> None:
    (ROOT / "docs" / "combinations.md").write_text(combinations_doc())
    readme = ROOT / "README.md"
    text = readme.read_text()
    a, b = text.index(START) + len(START), text.index(END)
    readme.write_text(text[:a] + readme_table() + text[b:])


if __name__ == "__main__":
    main()
