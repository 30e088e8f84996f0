"""CPU offload trains and matches the on-device losses (uses the cached DeepSpeedCPUAdam build)."""
import pytest

from tests.dist.conftest import DS_DP2, train

# -m full (CI): its first run builds DeepSpeed's CPU Adam (~100 s once per machine); the torch backend's offload layout stays in README's suite.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.full]


def test_offload_matches_device_losses(runs_root, shared_run):
    base = shared_run(*DS_DP2[3])  # the same layout without offload
    opt = train(runs_root / "off_opt", *DS_DP2[3], "parallel.offload_optimizer=cpu", timeout=900)
    both = train(runs_root / "off_all", *DS_DP2[3], "parallel.offload_optimizer=cpu", "parallel.offload_params=cpu",
                 timeout=900)
    assert "cpu_adam ready" in opt.proc.stdout  # the build (or its cache) ran before the ranks started
    resolved = (opt.root / "resolved.json").read_text()
    assert '"torch_adam": false' in resolved and '"device": "cpu"' in resolved
    for run in (opt, both):
        assert max(abs(a - b) for a, b in zip(run.losses(), base.losses())) <= 1e-5
