"""`python -m layersplit ...` is the `layersplit` command."""
from __future__ import annotations

from layersplit.launch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
