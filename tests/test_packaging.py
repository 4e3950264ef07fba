"""The package installs as megatron_lite with kernels/ as megatron_lite.kernels and never as a global
`kernels` module (an unrelated PyPI package owns that name and transformers probes for it)."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kernels_importable_under_package_only(tmp_path):
    import megatron_lite.kernels

    assert pathlib.Path(megatron_lite.kernels.__file__).resolve().parent == ROOT / "kernels"
    # Outside the checkout (where the folder itself is not on sys.path) the install provides no `kernels`.
    probe = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert not out.stdout.strip().startswith(str(ROOT)), out.stdout


def test_from_the_checkout_root_kernels_is_the_installed_package(tmp_path):
    """`python -c` (or a notebook) started in the checkout puts its root first on sys.path, where kernels/ was
    found as the top-level `kernels`: transformers, which imports the Hugging Face `kernels` package when it is
    installed, failed (`cannot import name 'CUDAProperties' from 'kernels'`). The folder hands the name over to
    the installed package; with none, `kernels` stays ours (transformers then finds no viable version)."""
    other = tmp_path / "site"
    (other / "kernels").mkdir(parents=True)
    (other / "kernels" / "__init__.py").write_text("MARK = 'installed'\n")
    (other / "kernels" / "sub.py").write_text("X = 1\n")
    probe = "import kernels, kernels.sub; print(kernels.MARK, kernels.sub.X)"
    env = {**os.environ, "PYTHONPATH": str(other)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["installed", "1"], out.stderr[-2000:]
    probe = "import kernels; print(kernels.rms_norm.__module__)"  # (none installed elsewhere: ours, as before)
    try:
        installed = bool(importlib.metadata.version("kernels"))  # (the Hugging Face package's distribution)
    except importlib.metadata.PackageNotFoundError:
        installed = False
    if not installed:
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "megatron_lite.kernels.norms", out.stdout
    else:  # (the Hugging Face package is installed here: transformers imports it from the checkout's root)
        probe = "from transformers import LlamaForCausalLM; import kernels; print(kernels.__file__)"
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0 and not out.stdout.strip().startswith(str(ROOT)), out.stderr[-2000:]


def test_dependencies():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = meta["dependencies"]
    names = [d.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower() for d in deps]
    assert "apex" not in names and not any("apex" in n for n in names)
    assert {"torch", "triton", "einops", "wandb", "numpy", "safetensors", "tokenizers"} <= set(names)
    triton = next(d for d in deps if d.startswith("triton"))
    assert "platform_system" in triton and "Linux" in triton
    test = [d.split(">")[0].split("=")[0].strip().lower() for d in meta["optional-dependencies"]["test"]]
    assert {"pytest", "transformers", "peft"} <= set(test)


@pytest.mark.slow
def test_wheel_maps_kernels_into_the_package(tmp_path):
    # Build from a copy: setuptools writes build/ and *.egg-info into the source tree.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "wandb", ".pytest_cache")
    shutil.copytree(ROOT, src, ignore=skip)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*cmd, "-w", str(tmp_path), str(src)], check=True)
    wheel = next(tmp_path.glob("megatron_lite-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "megatron_lite/kernels/__init__.py" in names
    assert not any(n.startswith("kernels/") for n in names), [n for n in names if n.startswith("kernels/")]


def test_ci_runs_the_readme_test_command():
    import re

    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    test_cmd = next(b.strip() for b in blocks if "pytest" in b)
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_every_subpackage_is_listed_for_installation():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        "megatron_lite." + str(p.parent.relative_to(ROOT / "megatron_lite")).replace("/", ".")
        for p in (ROOT / "megatron_lite").glob("*/__init__.py")
    }
    assert found | {"megatron_lite", "megatron_lite.kernels"} == listed


def _readme_core() -> float:
    """The README's "Using the core" example, run as written on this rank; its loss."""
    import re

    text = (ROOT / "README.md").read_text().split("## Using the core", 1)[1]
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md (Using the core)", "exec"), scope)
    return float(scope["loss"])


def test_the_readmes_core_example_runs_on_two_ranks(dist):
    """(From a docs audit: it stopped at its last line, a call that had gained a required argument.)"""
    import math

    losses = dist(2, _readme_core)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
