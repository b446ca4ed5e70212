"""Every module imports on its own, in an interpreter where no module of the package is loaded
yet: no import circle, no hidden order."""

from __future__ import annotations

import importlib.util
import json
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
OPTIONAL = {"hybridkv_cli.lmms_eval_model": "lmms_eval", "hybridkv_cli.serve.app": "fastapi"}

# One interpreter loads the heavy libraries once, then forks a child per module that imports only
# that module: each child starts with none of the package loaded, as a fresh interpreter would,
# without paying torch's import a hundred times.
_FORKED_IMPORTS = """
import importlib, json, os, sys, traceback
ours = ("hybridkv_cli", "hybridkv_kernels")
read, write = os.pipe()
if os.fork() == 0:  # which libraries the whole package loads ...
    for name in json.loads(sys.argv[1]):
        try:
            importlib.import_module(name)
        except BaseException:  # reported by the module's own child below
            pass
    os.write(write, json.dumps([m for m in sys.modules if m.split(".")[0] not in ours]).encode())
    os._exit(0)
os.close(write)
with os.fdopen(read, "rb") as pipe:
    libraries = json.loads(pipe.read())
for name in libraries:  # ... loaded here once, in their own order
    try:
        importlib.import_module(name)
    except Exception:
        pass
errors = {}
for name in json.loads(sys.argv[1]):
    assert not any(m.split(".")[0] in ours for m in sys.modules)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            message = ""
        except BaseException:
            message = traceback.format_exc()
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        errors[name] = pipe.read().decode()
    os.waitpid(pid, 0)
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def import_errors() -> dict[str, str]:
    wanted = [m for m in _modules() if m not in OPTIONAL or importlib.util.find_spec(OPTIONAL[m]) is not None]
    done = subprocess.run([sys.executable, "-c", _FORKED_IMPORTS, json.dumps(wanted)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", _modules())
def test_module_imports_alone(module, import_errors):
    if module in OPTIONAL and importlib.util.find_spec(OPTIONAL[module]) is None:
        pytest.skip(f"needs the optional package {OPTIONAL[module]}")
    assert import_errors[module] == "", import_errors[module]


def test_no_module_over_350_lines_and_a_thin_cli():
    package = ROOT / "hybridkv_cli"
    sizes = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in package.rglob("*.py")}
    assert max(sizes.values()) <= 350, max(sizes, key=sizes.get)
    assert sizes[package / "cli.py"] < 250


# Each layer imports only the layers below it (the diagram of docs/design.md): io at the bottom,
# then the step model, compression and media, models, the engine, the runs, the server and the commands, and the
# entry points on top.
LAYERS = {"io": 0, "costs": 1, "compression": 1, "media": 1, "models": 2, "engine": 3, "runs": 4, "serve": 5, "commands": 5}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] == "hybridkv_kernels":
        return 1
    if parts[0] != "hybridkv_cli" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1], 6)  # the entry points: cli, api, library, lmms_eval_model


def test_every_layer_imports_only_the_layers_below_it():
    import ast

    package = ROOT / "hybridkv_cli"
    upward = []
    for path in package.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        own = _layer(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for name in names:
                theirs = _layer(name)
                if theirs is not None and own is not None and theirs > own:
                    upward.append(f"{module} imports {name}")
    assert not upward, upward
