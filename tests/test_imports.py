"""Every module imports on its own, in a fresh interpreter: no import circle, no hidden order."""

from __future__ import annotations

import importlib.util
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import hybridkv_cli

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> list[str]:
    names = ["hybridkv_cli", "hybridkv_kernels"]
    names += [m.name for m in pkgutil.walk_packages(hybridkv_cli.__path__, "hybridkv_cli.")]
    return sorted(names)


# Modules of optional extras, and the package each needs (installed by the extra).
OPTIONAL = {"hybridkv_cli.lmms_eval_model": "lmms_eval"}


@pytest.mark.slow
@pytest.mark.parametrize("module", _modules())
def test_module_imports_alone(module):
    if module in OPTIONAL and importlib.util.find_spec(OPTIONAL[module]) is None:
        pytest.skip(f"needs the optional package {OPTIONAL[module]}")
    done = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr


def test_the_application_layer_has_no_module_over_400_lines():
    package = ROOT / "hybridkv_cli"
    sizes = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in package.rglob("*.py")
             if "compression" not in path.relative_to(package).parts}  # compression/: the methods' own layer
    assert max(sizes.values()) <= 400, max(sizes, key=sizes.get)
