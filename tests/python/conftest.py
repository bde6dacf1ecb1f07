"""Shared helpers: random graphs of awkward shapes, a dense float64 oracle, the shared datasets."""

import os
import pathlib

import pytest
import torch

# Every workspace the ops take is poisoned (NaN) before they run: see trisparse._tensors. Set
# before trisparse is imported.
os.environ.setdefault("TRISPARSE_POISON_WORKSPACE", "1")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device: skipping GPU tests")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def random_edge_index(num_src, num_dst, max_degree, seed, self_loops=False):
    """[2, E] in PyG's convention, unique edges; some targets get none (empty rows), some sources
    are never used (empty columns)."""
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, max_degree + 1, (num_dst,), generator=g)
    dst = torch.repeat_interleave(torch.arange(num_dst), deg)
    src = torch.randint(0, max(num_src, 1), (dst.numel(),), generator=g)
    if self_loops:
        n = min(num_src, num_dst)
        dst = torch.cat([dst, torch.arange(n)])
        src = torch.cat([src, torch.arange(n)])
    key = torch.unique(dst * max(num_src, 1) + src)
    return torch.stack([key % max(num_src, 1), key // max(num_src, 1)])


def dense_attention(q, k, v, edge_index, scale):
    """The oracle: masked dense softmax in float64 (rows without edges give zeros)."""
    return dense_attention_in(q.double(), k.double(), v.double(), edge_index, scale)


def dense_attention_in(q, k, v, edge_index, scale):
    """Masked dense softmax attention in q's precision (PyTorch's kernels, no upcast)."""
    mask = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    mask[edge_index[1], edge_index[0]] = True
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hij,jhd->ihd", p, v)


def datasets_dir():
    env = os.environ.get("TRISPARSE_DATASETS")
    d = (
        pathlib.Path(env)
        if env
        else pathlib.Path(__file__).resolve().parents[3] / "shared" / "datasets"
    )
    return d if (d / "MANIFEST.md").exists() else None


def shared_graph_names():
    """Names of the shared graphs (['cora'] when the datasets are absent: its test then skips)."""
    d = datasets_dir()
    return sorted(p.name[: -len(".el.xz")] for p in d.glob("*.el.xz")) if d else ["cora"]


def load_shared_graph(name):
    """edge_index of a shared graph in PyG's convention, made symmetric and unique (the package's
    reader); skips the test when ../shared/datasets is absent."""
    d = datasets_dir()
    if d is None or not (d / f"{name}.el.xz").exists():
        pytest.skip("../shared/datasets not found (set TRISPARSE_DATASETS): skipping")
    import trisparse.datasets

    return trisparse.datasets.read_graph(d / f"{name}.el.xz", undirected=True)
