import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        skip = pytest.mark.skip(reason="needs CUDA (GPU checks run on a GPU machine: tests/gpu/run_checks.sh)")
        for item in items:
            if "tests/gpu/" in str(item.fspath):
                item.add_marker(skip)
