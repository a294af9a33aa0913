"""cadence installs as one import name, `cadence`, from a wheel that carries everything it reads.

The layers keep their top-level folders in the repository (`model/`, `engine/`, ...) and install
as `cadence.model`, `cadence.engine`, ... (cadence/ links to each folder; the wheel carries the
files themselves). Two ways
that can break, each checked here: a module that still imports a layer by its bare folder name
(it works inside a checkout, where the folder is on the path, and fails installed), and a data
file the code reads that the wheel leaves out.
"""

from __future__ import annotations

import ast
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("model", "checkpoints", "engine", "scheduler", "server", "bench")
# Files the code opens at run time, beside the modules that open them.
DATA = ("cadence/model/cpu_kernels.cc", "cadence/server/openapi.json",
        *(f"cadence/model/csrc/{part.name}" for part in sorted((ROOT / "model" / "csrc").glob("*.h"))))


def _sources() -> list[Path]:
    return sorted(p for folder in (*LAYERS, "cadence", "tests") for p in (ROOT / folder).rglob("*.py")
                  if "results" not in p.relative_to(ROOT).parts)


def test_no_module_imports_a_layer_by_its_folder_name():
    bare = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            bare += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                     if name and name.split(".")[0] in LAYERS]
    assert not bare, "import these as cadence.<layer>:\n" + "\n".join(bare)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the working tree (setuptools' build folder stays out of
    the checkout, and a stale one cannot leak old files into it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "results"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--quiet", "--wheel-dir", str(tmp / "dist"), str(tree)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (path,) = (tmp / "dist").glob("cadence-*.whl")
    return path


def test_the_wheel_installs_one_top_level_package_with_its_modules_and_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"cadence"}, sorted(tops)
    (info,) = dist_info
    assert zipfile.ZipFile(wheel).read(f"{info}/top_level.txt").decode().split() == ["cadence"]
    # Every module of every layer, under its cadence. name, and nothing from tests/ or bench/results/.
    want = {f"cadence/{p.relative_to(ROOT)}" for p in _sources() if p.parts[len(ROOT.parts)] in LAYERS}
    want.add("cadence/__init__.py")
    modules = {n for n in names if n.endswith(".py")}
    assert modules == want, (sorted(want - modules), sorted(modules - want))
    for data in DATA:
        assert data in names
    scripts = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    for script in ("cadence-serve", "cadence-generate", "cadence-batch", "cadence-bench", "cadence-reference"):
        assert f"{script} = cadence." in scripts


@pytest.mark.slow
def test_the_installed_wheel_serves_from_another_folder(wheel, tiny_model_dir, tmp_path):
    """`pip install` of the wheel (not editable) into a fresh environment, then `cadence-serve`
    from a folder that is not the checkout: the API answers, its description ships, the CPU
    kernels build from the shipped source, and the layers are not top-level modules."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    done = subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # Its dependencies come from this environment's site-packages, put on the path; the editable
    # install of the checkout there stays out (PYTHONPATH entries run no .pth files).
    root, env = tiny_model_dir
    env = dict(env, PYTHONPATH=sysconfig.get_paths()["purelib"])
    away = tmp_path / "elsewhere"
    away.mkdir()

    def python(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([venv / "bin" / "python", "-c", code], cwd=away, env=env,
                              capture_output=True, text=True, timeout=60)

    where = python("import cadence.server.app as a; print(a.__file__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    for layer in LAYERS:
        assert python(f"import {layer}").returncode != 0, f"`import {layer}` works after install"

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([venv / "bin" / "cadence-serve", f"--model={root / 'model'}", f"--port={port}",
                                 "--num_slots=2", "--max_seq_len=128", "--prefill_chunk=32"],
                                cwd=away, env=env, stdout=subprocess.DEVNULL, stderr=err)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        spec = httpx.get(f"{base}/openapi.json", timeout=10)
        assert spec.status_code == 200 and "/v1/completions" in spec.json()["paths"]
        reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
            "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 5
    finally:
        proc.terminate()
        proc.wait(60)
    assert "weights in the CPU kernels' blocks" in log.read_text(), log.read_text()[-3000:]
