""".hkv files are data, never code: a crafted file (checksum recomputed, as anyone can) names no
class, function or dtype that gets built, reaches no index outside its tensors, and fails as one
line naming the file, exit 1, touching no other file; a damaged cache is not kept by ``--resume``;
a killed save's temporary file is cleaned by the next save."""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridkv_cli import cli
from hybridkv_cli.engine import hkv
from hybridkv_cli.engine.state_kinds import KINDS

sys.path.insert(0, str(Path(__file__).parent))
from demo_fixtures import cached_demo, demo, video  # noqa: E402,F401 - fixtures
from media_fixtures import make_video  # noqa: E402
from test_hkv import FAST, make_prefix, tokens  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory, demo, video):
    """A hybridkv cache with every kind of layer state (dynamic heads, refresh), its header and tensors."""
    from safetensors.torch import load_file

    path = tmp_path_factory.mktemp("saved") / "good.hkv"
    hkv.save(path, make_prefix(demo, video, "hybridkv", theta=0.5), demo)
    return path, hkv.read_header(path), load_file(str(path))


def write(path: Path, header: dict, tensors: dict) -> Path:
    """A cache file with ``header`` (its checksum recomputed) and ``tensors``."""
    from safetensors.torch import save_file

    header = {**header, "sha256": hkv._digest(tensors, header)}
    save_file(tensors, str(path), metadata={"hybridkv": json.dumps(header)})
    return path


def ask(path: Path, capsys) -> tuple[int, str]:
    code = cli.run(["ask", str(path), "What?", "--model", "demo", "--dtype", "float32", *FAST])
    return code, capsys.readouterr().err


def one_line_error(err: str, path: Path) -> bool:
    lines = [line for line in err.splitlines() if not line.startswith("done:")]
    return len(lines) == 1 and lines[0].startswith(f"error: {path}: ") and "Traceback" not in err


def nodes(tree):
    """Every object node of a tree."""
    if isinstance(tree, dict):
        if "O" in tree:
            yield tree
        for v in tree.values():
            yield from nodes(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from nodes(v)


def test_the_reported_attack_builds_nothing(saved, tmp_path, capsys):
    """A kind that walks from a compression module to ``io.FileIO`` (the reported attack, as a
    NamedTuple-style node and as an object node) creates no file and is one line."""
    path, header, tensors = saved
    marker = tmp_path / "marker"
    for name in ("hybridkv_cli.compression.base:torch.serialization.io.FileIO",
                 "hybridkv_cli.compression.store:torch.io.FileIO", "FileIO", "io:FileIO"):
        for node in ({"O": name, "id": 0, "items": [str(marker), "w"]},
                     {"O": name, "id": 0, "s": {"name": str(marker), "mode": "w"}}):
            bad = write(tmp_path / "attack.hkv", {**header, "tree": {"U": [node, {"U": [], "id": 1}], "id": 2}},
                        tensors)
            code, err = ask(bad, capsys)
            assert code == 1 and one_line_error(err, bad), err
            assert "unknown kind of state" in err and not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attack.hkv"]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # reading a deprecated alias warns
def test_no_class_the_package_imports_is_a_kind(saved, tmp_path, demo):
    """Swap each object of a valid tree for a class of any module loaded now (the package's, torch's,
    the standard library's), by every spelling: none is built."""
    path, header, tensors = saved
    names = set()
    for module_name, module in list(sys.modules.items()):
        for attr, value in list(vars(module).items())[:200] if module else []:
            if isinstance(value, type) and value not in {cls for cls, _ in KINDS.values()}:
                names.update({f"{module_name}:{attr}", f"{module_name}.{attr}", attr})
    names -= set(KINDS)
    target = next(nodes(header["tree"]))
    sample = random.Random(0).sample(sorted(names), 200)
    for name in sample:
        bad = copy.deepcopy(header)
        next(nodes(bad["tree"]))["O"] = name
        with pytest.raises(hkv.CacheFileError, match="unknown kind of state"):
            hkv.load(write(tmp_path / "k.hkv", bad, tensors), demo)
    assert target["O"] in KINDS


@pytest.mark.parametrize("dtype", ["Tensor", "load", "float32.__class__", "FloatStorage", "", "qint8", "device"])
def test_a_dtype_that_is_not_a_saved_dtype_is_refused(saved, tmp_path, demo, dtype):
    path, header, tensors = saved
    bad = copy.deepcopy(header)
    spec = json.dumps(bad["tree"])
    first = spec.index('"dtype": "') + len('"dtype": "')
    end = spec.index('"', first)
    bad["tree"] = json.loads(spec[:first] + dtype + spec[end:])
    with pytest.raises(hkv.CacheFileError, match="unknown dtype"):
        hkv.load(write(tmp_path / "d.hkv", bad, tensors), demo)
    bad = copy.deepcopy(header)
    bad["prefix_dtypes"]["input_ids"] = dtype
    with pytest.raises(hkv.CacheFileError, match="unknown dtype"):
        hkv.load(write(tmp_path / "p.hkv", bad, tensors), demo)


def test_an_undeclared_attribute_or_a_wrong_type_is_refused(saved, tmp_path, demo):
    path, header, tensors = saved
    bad = copy.deepcopy(header)
    next(nodes(bad["tree"]))["s"]["__class__"] = 1
    with pytest.raises(hkv.CacheFileError, match="without exactly its attributes"):
        hkv.load(write(tmp_path / "a.hkv", bad, tensors), demo)
    bad = copy.deepcopy(header)
    store = next(n for n in nodes(bad["tree"]) if n["O"] == "RaggedStore")
    store["s"]["n_gen"] = "3"
    with pytest.raises(hkv.CacheFileError, match="RaggedStore's n_gen is not a int"):
        hkv.load(write(tmp_path / "t.hkv", bad, tensors), demo)


def test_indices_outside_their_tensors_are_refused(saved, tmp_path, demo):
    """Offsets, slots and resident chunks are what kernels follow: a crafted value past the end of
    its tensor is refused at load (on a GPU it would read or write out of bounds)."""
    path, header, tensors = saved
    cases = 0
    for kind, field, value in [("RaggedStore", "offsets", 10**6), ("RaggedStore", "lengths", 10**6),
                               ("DynamicHeads", "resident", 10**6), ("DynamicHeads", "slot_base", 10**6),
                               ("DynamicHeads", "heads", 99), ("Refresher", "resident", 10**6),
                               ("Refresher", "fixed", -5)]:
        node = next((n for n in nodes(header["tree"]) if n["O"] == kind), None)
        if node is None:
            continue
        spec = node["s"][field]["T"]
        if 0 in spec["shape"]:
            continue
        bad = dict(tensors)
        data = bad[spec["s"]].clone().view(torch.int64)
        data[spec["off"]] = value
        bad[spec["s"]] = data.view(torch.uint8)
        try:
            hkv.load(write(tmp_path / "i.hkv", header, bad), demo)
        except hkv.CacheFileError as e:
            assert "out of range" in str(e) or "outside" in str(e) or "repeats" in str(e), e
        else:
            pytest.fail(f"a {kind} with {field} = {value} was loaded")
        cases += 1
    assert cases >= 6  # the sample state has every kind named above (a refresher may fix no entry)


def test_deep_or_huge_headers_are_one_line_and_the_list_goes_on(saved, tmp_path, capsys):
    """A header nested past Python's recursion limit, or past the tree's depth, and huge numbers:
    each is one line, and a good cache asked with them still answers."""
    from safetensors.torch import save_file

    path, header, tensors = saved
    deep = tmp_path / "deep.hkv"
    nested = '{"a":' * 100_000 + "1" + "}" * 100_000
    save_file(tensors, str(deep), metadata={"hybridkv": nested})
    tree = {"L": [], "id": 0}
    for i in range(1, 60):
        tree = {"L": [tree], "id": i}
    deeper = write(tmp_path / "deeper.hkv", {**header, "tree": tree}, tensors)
    huge = write(tmp_path / "huge.hkv", {**header, "seen": 10**40, "prefill_s": 1e308}, tensors)
    code = cli.run(["ask", str(deep), str(path), str(deeper), str(huge), "What?", "--jsonl", "--quiet", *FAST])
    out, err = capsys.readouterr()
    assert code == 1
    records = [json.loads(line) for line in out.splitlines()]
    assert [("error" in r) for r in records] == [True, False, True, True]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert [e.split(": ")[1] for e in errors] == [str(deep), str(deeper), str(huge)], err
    assert "Traceback" not in err


def test_a_fifo_named_like_a_cache_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "x.hkv"
    os.mkfifo(fifo)
    run = subprocess.run([sys.executable, "-m", "hybridkv_cli.cli", "ask", str(fifo), "What?", "--model", "demo"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert f"error: {fifo}: not a regular file" in run.stderr and "Traceback" not in run.stderr


# --- the fuzz: random edits of a valid header ---------------------------------------------------------
def _slots(tree, path=()):
    """(container, key) of every value in a JSON tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield tree, k
            yield from _slots(v)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield tree, i
            yield from _slots(v)


def _mutant(header: dict, rng: random.Random) -> dict:
    bad = copy.deepcopy(header)
    for _ in range(rng.randint(1, 3)):
        container, key = rng.choice(list(_slots(bad)))
        choice = rng.randrange(12)
        if choice == 0 and isinstance(container, dict):
            del container[key]
            continue
        value = [10**30, -(10**18), -1, 0, 2**63, 1e308, -0.0, "", "x" * 5000, "os:system", None, True, [],
                 {}, [[[[[[[]]]]]]], {"O": "RaggedStore", "id": 10**9, "s": {}}, {"ref": 10**6},
                 {"T": {"s": "s0", "dtype": "float32", "shape": [2**40], "stride": [1], "off": 0}}][rng.randrange(18)]
        container[key] = value
    return bad


def test_fuzzed_headers_fail_as_one_cache_error_or_answer(saved, tmp_path, demo):
    """300 headers with 1-3 random edits each (deletions, huge and negative numbers, wrong types,
    deep nesting, references to nothing, tensors past their storage), checksums recomputed: each
    loads and answers, or is refused as a :class:`CacheFileError` naming the file; no other
    exception, and no file is created beside it."""
    path, header, tensors = saved
    rng = random.Random(1234)
    refused = 0
    target = tmp_path / "fuzz.hkv"
    for i in range(300):
        write(target, _mutant(header, rng), tensors)
        try:
            prefix = hkv.load(target, demo)
        except hkv.CacheFileError as e:
            assert e.source == str(target) and "\n" not in str(e), e
            refused += 1
            continue
        assert len(tokens(demo, prefix, "What?")) > 0, i
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fuzz.hkv"]
    assert refused >= 150  # most edits break the file; the rest are values nothing checks (timings, labels)


def test_fuzzed_headers_through_the_cli(saved, tmp_path, capsys):
    """The same edits through ``hybridkv ask``: exit 0 with an answer or exit 1 with one line naming
    the file, never a traceback."""
    path, header, tensors = saved
    rng = random.Random(99)
    for i in range(12):
        bad = write(tmp_path / f"f{i}.hkv", _mutant(header, rng), tensors)
        code, err = ask(bad, capsys)
        assert code in (0, 1) and "Traceback" not in err, err
        if code == 1:
            assert one_line_error(err, bad), err


# --- resume and temporary files --------------------------------------------------------------------
def test_resume_rewrites_a_damaged_cache(tmp_path, capsys):
    (tmp_path / "media").mkdir()
    make_video(tmp_path / "media" / "a.mp4", n=6)
    out = tmp_path / "caches"
    argv = ["compress", str(tmp_path / "media"), "--each", "-o", str(out), "--model", "demo", *FAST[:4]]
    assert cli.run(argv) == 0
    target = out / "a.mp4.hkv"
    data = bytearray(target.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # the second half zeroed, the header intact
    target.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.run([*argv, "--resume"]) == 0
    assert "done: 1 compressed" in capsys.readouterr().err
    assert hkv.intact(target)
    assert cli.run(["ask", str(target), "What?", "--quiet", "--max-new-tokens", "2"]) == 0


def test_a_killed_save_leaves_no_temporary_file_behind(demo, video, tmp_path):
    """A save killed mid-write leaves ``.NAME.PID.*.tmp``; the next save to that target removes it
    (a live process's temporary file is left alone)."""
    prefix = make_prefix(demo, video, "snapkv")
    target = tmp_path / "x.hkv"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        (tmp_path / f".x.hkv.{dead.pid}.abc123.tmp").write_bytes(b"\0" * 1000)
        (tmp_path / f".x.hkv.{child.pid}.def456.tmp").write_bytes(b"\0" * 10)
        hkv.save(target, prefix, demo)
        assert sorted(p.name for p in tmp_path.iterdir()) == [f".x.hkv.{child.pid}.def456.tmp", "x.hkv"]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()



def test_the_schema_is_pinned_to_the_format_version():
    """Renaming, adding or retyping a saved attribute changes the schema digest: a new file format.
    Bump ``hkv.FORMAT_VERSION`` and this pin together."""
    from hybridkv_cli.engine.state_kinds import schema_digest

    assert (hkv.FORMAT_VERSION, schema_digest()) == (5, "f40fcee42d888551")
