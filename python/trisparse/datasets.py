"""Loaders for the training data the examples use: the Planetoid citation graphs (features, labels
and the standard splits) from their raw files, through PyG's own reader, with no download; and
graphs from edge-list (plain, .gz, .xz) and .npz files, as an edge_index or a Pattern."""

from __future__ import annotations

import gzip
import lzma
import os
import pathlib
import re
import tempfile

import numpy as np
import torch

__all__ = ["load_pattern", "ogbg", "planetoid", "read_graph"]

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


_OGBG = ("bace", "bbbp", "esol", "freesolv")


def ogbg(name: str, root: str | os.PathLike | None = None):
    """An OGB molecule set (ogbg-molbace, -molbbbp, -molesol or -molfreesolv) from OGB's raw files
    in ``root/ogbg_mol<name>/`` (default ``$TRISPARSE_OGBG``, else ``../shared/datasets/ogbg``),
    as OGB's PyG loader gives it: a list of ``torch_geometric.data.Data`` (x: int64 [n, 9] atom
    features, edge_index with both directions of each bond, edge_attr: int64 [2 b, 3] bond
    features, y: [1, tasks] float, NaN where a label is missing) and the scaffold split as a dict
    of graph indices ("train", "valid", "test").

    Raises ValueError for an unknown name and FileNotFoundError naming a missing file."""
    key = name.lower().removeprefix("ogbg-").removeprefix("ogbg_").removeprefix("mol")
    if key not in _OGBG:
        raise ValueError(f"name must be one of {['ogbg-mol' + n for n in _OGBG]}, got {name!r}")
    env = os.environ.get("TRISPARSE_OGBG")
    base = (
        pathlib.Path(root)
        if root is not None
        else pathlib.Path(env if env else os.path.join("..", "shared", "datasets", "ogbg"))
    )
    folder = base / f"ogbg_mol{key}"

    def table(*parts: str, dtype=np.int64) -> np.ndarray:
        path = folder.joinpath(*parts)
        if not path.is_file():
            raise FileNotFoundError(
                f"ogbg-mol{key}: missing {path} (pass root= or set TRISPARSE_OGBG)"
            )
        with gzip.open(path, "rt") as f:
            if dtype == np.int64:
                return np.loadtxt(f, dtype=np.int64, delimiter=",", ndmin=2)
            return np.genfromtxt(f, dtype=dtype, delimiter=",", ndmin=2)  # empty: NaN

    from torch_geometric.data import Data

    nodes = table("raw", "num-node-list.csv.gz")[:, 0]
    edges = table("raw", "num-edge-list.csv.gz")[:, 0]
    x = torch.from_numpy(table("raw", "node-feat.csv.gz"))
    bonds = torch.from_numpy(table("raw", "edge.csv.gz"))
    bond_feat = torch.from_numpy(table("raw", "edge-feat.csv.gz"))
    y = torch.from_numpy(table("raw", "graph-label.csv.gz", dtype=np.float32))
    graphs, n0, e0 = [], 0, 0
    for g, (n, e) in enumerate(zip(nodes.tolist(), edges.tolist())):
        b = bonds[e0 : e0 + e].t()
        graphs.append(
            Data(
                x=x[n0 : n0 + n],
                edge_index=torch.cat([b, b.flip(0)], dim=1),
                edge_attr=bond_feat[e0 : e0 + e].repeat(2, 1),
                y=y[g : g + 1],
                num_nodes=n,
            )
        )
        n0, e0 = n0 + n, e0 + e
    split = {
        part: torch.from_numpy(table("split", "scaffold", f"{part}.csv.gz")[:, 0])
        for part in ("train", "valid", "test")
    }
    return graphs, split


def _open_text(path: pathlib.Path):
    if path.suffix == ".xz":
        return lzma.open(path, "rt")
    if path.suffix == ".gz":
        return gzip.open(path, "rt")
    return open(path)


def _edges_from_text(path: pathlib.Path) -> tuple[np.ndarray, int | None, bool]:
    """(pairs [E, 2], the header's node count or None, whether the header says undirected)."""
    nodes, undirected, rows = None, False, []
    with _open_text(path) as f:
        for number, line in enumerate(f, 1):
            text = line.strip()
            if not text:
                continue
            if text[0] in "#%":
                header = re.search(r"nodes:\s*(\d+)", text.lower())
                if header:
                    nodes = int(header.group(1))
                    undirected = "directed: no" in text.lower()
                continue
            fields = text.replace(",", " ").split()
            try:
                src, dst = int(fields[0]), int(fields[1])
            except (IndexError, ValueError):
                raise ValueError(
                    f"{path}:{number}: expected two integer node ids, got {text[:60]!r}"
                ) from None
            if src < 0 or dst < 0:
                raise ValueError(f"{path}:{number}: negative node id in {text[:60]!r}")
            rows.append((src, dst))
    return np.array(rows, dtype=np.int64).reshape(-1, 2), nodes, undirected


def _edges_from_npz(path: pathlib.Path) -> tuple[np.ndarray, int | None, bool]:
    with np.load(path) as z:
        keys = set(z.files)
        if {"indptr", "indices", "shape"} <= keys:  # scipy.sparse.save_npz (CSR)
            indptr, indices = z["indptr"].astype(np.int64), z["indices"].astype(np.int64)
            src = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
            pairs, nodes = np.stack([src, indices], 1), int(max(z["shape"]))
        elif {"row", "col"} <= keys:
            pairs = np.stack([z["row"].astype(np.int64), z["col"].astype(np.int64)], 1)
            nodes = int(z["num_nodes"]) if "num_nodes" in keys else None
        else:
            raise ValueError(
                f"{path}: an .npz graph holds indptr/indices/shape (scipy.sparse) or row/col "
                f"(optionally num_nodes), not {sorted(keys)}"
            )
    if pairs.size and pairs.min() < 0:
        raise ValueError(f"{path}: negative node id")
    return pairs, nodes, False


def read_graph(path: str | os.PathLike, undirected: bool | None = None):
    """(edge_index [2, E] int64, num_nodes) of a graph file, in PyG's convention, duplicates merged
    and sorted by target. A line ``i j`` (or CSR row i holding j) is read as the library's C++
    reader reads it, row i attending j: in PyG's terms the edge j -> i (edge_index[:, e] = (j, i)).
    Edge lists: plain, .gz or .xz text, one pair a line (commas allowed, '#' or '%' comments; a
    header ``# nodes: N ... directed: no`` gives the node count and adds each pair's reverse).
    .npz: scipy.sparse CSR or row/col arrays. ``undirected`` overrides the header.

    Raises FileNotFoundError for a missing file and ValueError naming the file (and line) for
    malformed content or an edge past the header's node count."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"graph file not found: {p}")
    pairs, nodes, header_undirected = (
        _edges_from_npz(p) if p.suffix == ".npz" else _edges_from_text(p)
    )
    top = int(pairs.max()) + 1 if pairs.size else 0
    if nodes is not None and top > nodes:
        raise ValueError(f"{p}: node id {top - 1} but the file declares {nodes} nodes")
    n = nodes if nodes is not None else top
    if header_undirected if undirected is None else undirected:
        pairs = np.concatenate([pairs, pairs[:, ::-1]])
    key = np.unique(pairs[:, 0] * max(n, 1) + pairs[:, 1])  # by target, then source
    edge_index = torch.from_numpy(np.stack([key % max(n, 1), key // max(n, 1)]))
    return edge_index, n


def load_pattern(path: str | os.PathLike, undirected: bool | None = None, add_self_loops=False):
    """The :class:`trisparse.Pattern` of a graph file (``read_graph``): each node attends its
    in-neighbours (its incoming edges, PyG's convention)."""
    from .pattern import Pattern

    edge_index, n = read_graph(path, undirected)
    return Pattern.from_edge_index(edge_index, size=(n, n), add_self_loops=add_self_loops)
