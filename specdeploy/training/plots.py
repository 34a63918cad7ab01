"""What the training commands' plots (training.png) share: matplotlib when it is installed (the `report` extra), on
the file-only Agg backend. A training run without it still writes its weights and training.json."""

from __future__ import annotations


def optional_pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
