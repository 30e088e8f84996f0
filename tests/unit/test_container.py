"""The Dockerfile: hadolint-clean, every version a guarded build argument, the Python pins equal pyproject.toml's.
No Docker engine runs here, so the image itself is not built (README says so)."""
import re
import shutil
import subprocess
import tomllib

import pytest

from tests.conftest import REPO

DOCKERFILE = REPO / "Dockerfile"
# Dockerfile build argument -> the distribution pinned in pyproject.toml
PINNED = {"TORCH_VERSION": "torch", "DEEPSPEED_VERSION": "deepspeed", "MEGATRON_CORE_VERSION": "megatron-core",
          "TRANSFORMERS_VERSION": "transformers", "ACCELERATE_VERSION": "accelerate",
          "TENSORBOARD_VERSION": "tensorboard", "MSGSPEC_VERSION": "msgspec"}


def build_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE))


def test_hadolint_passes():
    hadolint = shutil.which("hadolint")
    assert hadolint, 'hadolint comes with the test extras (pip install -e ".[test]")'
    p = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_python_pins_equal_pyproject():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = dict(re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", d.split("#")[0].strip()).groups()
                for d in deps if "==" in d)
    args = build_args()
    for arg, dist in PINNED.items():
        assert args[arg] == pins[dist], (arg, args[arg], dist, pins.get(dist))
    # The interpreter, too: pyproject allows 3.11 only.
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"] == ">=3.11,<3.12"
    assert args["PYTHON_VERSION"] == "3.11"


def test_every_build_argument_has_a_default_and_fails_the_build_when_empty():
    text = DOCKERFILE.read_text()
    declared = re.findall(r"^ARG (\w+)", text, re.MULTILINE)
    defaults = build_args()
    guard = re.search(r'^RUN : ((?:"\$\{\w+:\?\}"\s*\\?\s*)+)$', text, re.MULTILINE)
    assert guard, "no `RUN : \"${X:?}\" ...` guard"
    guarded = re.findall(r"\$\{(\w+):\?\}", guard.group(1))
    assert sorted(set(declared)) == sorted(defaults) == sorted(guarded)


def test_the_image_runs_as_a_user_and_installs_the_project():
    text = DOCKERFILE.read_text()
    assert re.search(r"^USER \$\{USER_UID\}$", text, re.MULTILINE)
    assert 'pip install -e ".[test]"' in text and re.search(r"^COPY tests \./tests$", text, re.MULTILINE)
    # nccl-tests link the NCCL torch loads, and the arch list reaches down to the T4 (7.5)
    assert 'NCCL_HOME="${NCCL_HOME}"' in text and "nvidia/nccl" in text
    assert re.search(r'TORCH_CUDA_ARCH_LIST="7\.5;[^"]*9\.0', text)
    assert "nccl-tests" in text and "libaio-dev" in text and "zlib1g-dev" in text and "build-essential" in text


PYPI = "https://pypi.org/simple"
# pip's --platform takes tags literally: every manylinux level a wheel of this set is tagged with, up to the base
# image's glibc (Ubuntu 22.04: 2.35; the newest wheels here are tagged manylinux_2_28)
PLATFORMS = [f"manylinux_2_{v}_x86_64" for v in range(35, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]


@pytest.mark.full  # pip resolves every pin against PyPI for the image's platform (~45 s): CI runs it
def test_the_images_python_install_resolves_for_its_platform(tmp_path):
    """pip's own resolver, as the image runs it, for the image's platform and Python, from PyPI, downloading metadata
    only: a pin that does not exist or does not resolve fails here, and torch's CUDA major is the base image's. DeepSpeed
    publishes only an sdist (its setup.py imports torch), so it is checked to exist on the index."""
    import json
    import os
    import sys
    import urllib.request

    args = build_args()
    pins = [f"{dist}=={args[arg]}" for arg, dist in PINNED.items() if dist != "deepspeed"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report), "--index-url", PYPI, "--only-binary=:all:", "--target", str(tmp_path / "t"),
           "--python-version", args["PYTHON_VERSION"], *[f"--platform={p}" for p in PLATFORMS], *pins]
    cert = os.environ.get("PIP_CERT")
    p = subprocess.run(cmd + (["--cert", cert] if cert else []), capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, "the image's pins do not resolve from PyPI:\n" + p.stderr[-3000:]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert got["torch"] == args["TORCH_VERSION"]
    cuda_major = re.search(r"nvidia/cuda:(\d+)\.", args["CUDA_IMAGE"]).group(1)
    assert got["nvidia-cuda-runtime"].split(".")[0] == cuda_major, (got["nvidia-cuda-runtime"], args["CUDA_IMAGE"])
    assert f"nvidia-nccl-cu{cuda_major}" in got  # the NCCL the Dockerfile links nccl-tests against (NCCL_HOME)
    with urllib.request.urlopen(f"{PYPI}/deepspeed/", timeout=60) as r:
        assert f"deepspeed-{args['DEEPSPEED_VERSION']}.tar.gz" in r.read().decode()
