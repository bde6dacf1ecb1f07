"""trisparse.datasets: the real Cora and CiteSeer (planetoid), graph files as an edge_index or a
Pattern (read_graph, load_pattern), and clear errors."""

import pathlib

import numpy as np
import pytest
import torch
import trisparse
import trisparse.datasets
from conftest import datasets_dir


def planetoid_root():
    d = datasets_dir()
    if d is None or not (d / "planetoid" / "ind.cora.x").exists():
        pytest.skip("../shared/datasets/planetoid not found (set TRISPARSE_DATASETS): skipping")
    pytest.importorskip("scipy")
    pytest.importorskip("torch_geometric")
    return d / "planetoid"


@pytest.mark.parametrize(
    ("name", "nodes", "features", "classes", "split"),
    [("cora", 2708, 1433, 7, (140, 500, 1000)), ("citeseer", 3327, 3703, 6, (120, 500, 1000))],
)
def test_loads_the_real_splits(name, nodes, features, classes, split):
    data = trisparse.datasets.planetoid(name, planetoid_root())
    assert data.x.shape == (nodes, features)
    assert int(data.y.max()) + 1 == classes
    assert tuple(int(m.sum()) for m in (data.train_mask, data.val_mask, data.test_mask)) == split
    pattern = trisparse.Pattern.of(data.edge_index, num_nodes=nodes)
    assert pattern.duplicates == 0 and pattern.nnz == data.edge_index.shape[1]


def test_errors_name_what_is_wrong(tmp_path: pathlib.Path):
    with pytest.raises(ValueError, match="name must be one of"):
        trisparse.datasets.planetoid("pubmed", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"ind\.cora\.x"):
        trisparse.datasets.planetoid("cora", tmp_path)
    pytest.importorskip("scipy")
    pytest.importorskip("torch_geometric")
    for part in ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index"):
        (tmp_path / f"ind.cora.{part}").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="cannot read the files"):
        trisparse.datasets.planetoid("cora", tmp_path)


def test_read_graph_matches_the_shared_file_and_the_pattern():
    from conftest import load_shared_graph

    ei, n = load_shared_graph("cora")  # skips without the datasets
    got, m = trisparse.datasets.read_graph(datasets_dir() / "cora.el.xz")

    def keys(e):
        return torch.sort(e[1] * n + e[0]).values

    assert m == n and torch.equal(keys(got), keys(ei))
    pattern = trisparse.datasets.load_pattern(datasets_dir() / "cora.el.xz")
    assert pattern.nnz == got.shape[1] and pattern.num_rows == n


def test_read_graph_formats_and_errors(tmp_path: pathlib.Path):
    (tmp_path / "g.el").write_text("# nodes: 5 edges: 3 directed: no\n0 1\n1,2\n% note\n4 4\n0 1\n")
    ei, n = trisparse.datasets.read_graph(tmp_path / "g.el")
    assert n == 5
    assert ei.tolist() == [[1, 0, 2, 1, 4], [0, 1, 1, 2, 4]]  # row i attends j: (j, i)
    directed, _ = trisparse.datasets.read_graph(tmp_path / "g.el", undirected=False)
    assert directed.tolist() == [[1, 2, 4], [0, 1, 4]]
    np.savez(tmp_path / "g.npz", row=np.array([2, 0]), col=np.array([1, 2]), num_nodes=4)
    ei, n = trisparse.datasets.read_graph(tmp_path / "g.npz")
    assert n == 4 and ei.tolist() == [[2, 1], [0, 2]]
    with pytest.raises(FileNotFoundError, match="not found"):
        trisparse.datasets.read_graph(tmp_path / "missing.el")
    (tmp_path / "bad.el").write_text("0 1\n2 x\n")
    with pytest.raises(ValueError, match=r"bad.el:2"):
        trisparse.datasets.read_graph(tmp_path / "bad.el")
    (tmp_path / "big.el").write_text("# nodes: 2\n0 5\n")
    with pytest.raises(ValueError, match="declares 2 nodes"):
        trisparse.datasets.read_graph(tmp_path / "big.el")
    np.savez(tmp_path / "odd.npz", a=np.zeros(2))
    with pytest.raises(ValueError, match="indptr"):
        trisparse.datasets.read_graph(tmp_path / "odd.npz")
