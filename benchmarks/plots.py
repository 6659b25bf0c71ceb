"""matplotlib for the benchmarks that draw (`--plot`): an optional dependency, looked for before minutes of
measuring rather than after, and drawn without a display."""

from __future__ import annotations

from typing import Any


def require_matplotlib() -> None:
    """Stop with how to install matplotlib where it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from None


def pyplot() -> Any:
    """matplotlib.pyplot on a backend that writes files only (a benchmark runs where no display is)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
