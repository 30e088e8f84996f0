"""The Dockerfile: hadolint-clean, every version a guarded build argument, the Python pins equal pyproject.toml's.
No Docker engine runs here, so the image itself is not built (README says so)."""
import re
import shutil
import subprocess
import tomllib

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
    assert "pip install -e ." in text
    assert "nccl-tests" in text and "libaio-dev" in text and "zlib1g-dev" in text and "build-essential" in text
