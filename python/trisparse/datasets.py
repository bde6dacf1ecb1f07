"""Loaders for the training data the examples use: the Planetoid citation graphs (features, labels
and the standard splits) from their raw files, through PyG's own reader, with no download."""

from __future__ import annotations

import os
import pathlib
import tempfile

__all__ = ["planetoid"]

_NAMES = {"cora": "Cora", "citeseer": "CiteSeer"}
_PARTS = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")


def _default_root() -> pathlib.Path:
    env = os.environ.get("TRISPARSE_PLANETOID")
    return pathlib.Path(env) if env else pathlib.Path("..", "shared", "datasets", "planetoid")


def planetoid(name: str, root: str | os.PathLike | None = None):
    """Cora or CiteSeer as a ``torch_geometric.data.Data`` (x, edge_index, y, train/val/test
    masks: PyG's ``Planetoid(root, name)``) read from the raw files ``ind.<name>.*`` in ``root``
    (default ``$TRISPARSE_PLANETOID``, else ``../shared/datasets/planetoid`` from the working
    folder, the repository's root).

    Raises ValueError for an unknown name, FileNotFoundError naming the missing files, and
    ValueError naming the folder when the files cannot be read."""
    key = name.lower()
    if key not in _NAMES:
        raise ValueError(f"name must be one of {sorted(_NAMES)}, got {name!r}")
    folder = pathlib.Path(root) if root is not None else _default_root()
    files = [folder / f"ind.{key}.{part}" for part in _PARTS]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(
            f"Planetoid {name}: missing {', '.join(missing)} (pass root= or set TRISPARSE_PLANETOID)"
        )
    try:
        import scipy  # noqa: F401  (the feature matrices are pickled SciPy sparse matrices)
        from torch_geometric.datasets import Planetoid
    except ImportError as e:
        raise ImportError("reading the Planetoid files needs torch_geometric and scipy") from e
    work = pathlib.Path(tempfile.mkdtemp(prefix="trisparse-planetoid-"))
    raw = work / _NAMES[key] / "raw"
    raw.mkdir(parents=True)
    for f in files:
        (raw / f.name).symlink_to(f.resolve())
    try:
        return Planetoid(str(work), _NAMES[key])[0]
    except Exception as e:  # PyG's reader: unpickling, shapes
        raise ValueError(f"Planetoid {name}: cannot read the files in {folder}: {e}") from e
