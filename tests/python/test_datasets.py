"""trisparse.datasets.planetoid: the real Cora and CiteSeer, and clear errors."""

import pathlib

import pytest
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
