"""What `pip install .` puts in a training environment: the wheel holds every module of the
source tree and the extension, and dptc imports from it alone, FSDP included, without numpy
(which pyproject does not ask for); the benchmarks run that installed dptc from an unbuilt
checkout; and the sdist holds the whole source tree.

The import runs under `python -S`, so no .pth file (an editable install of this checkout among
them) can supply a module the wheel lacks."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tracked():
    listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                             capture_output=True).stdout.decode()
    return [name for name in listing.split("\0") if name]


def _source_modules():
    return {name for name in _tracked() if name.startswith("dptc/") and name.endswith(".py")}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A copy of what git tracks, unbuilt: a fresh clone, or the checkout a user ran a plain
    `pip install .` from."""
    source = tmp_path_factory.mktemp("source")
    for name in _tracked():
        os.makedirs(source / os.path.dirname(name), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), source / name)
    return source


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory):
    # Built from the copy: a build/ folder left in the checkout would otherwise hand
    # setuptools the modules its configuration leaves out.
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(source)],
                   check=True, timeout=600, capture_output=True)
    (path,) = out.glob("dptc-*.whl")
    return path


def test_wheel_holds_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_modules() - names)
    assert missing == []
    assert any(n.startswith("dptc/_C.") and n.endswith(".so") for n in names)


def test_installed_wheel_imports_without_the_checkout(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path)
    torch_site = os.path.dirname(os.path.dirname(__import__("torch").__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), torch_site]))
    probe = ("import dptc, torch\n"
             "m = torch.nn.Linear(4, 4)\n"
             "dptc.fully_shard(m)\n"
             "m(torch.ones(2, 4)).sum().backward()\n"
             "print(dptc.__file__, type(m).__name__, type(dptc.FSDP).__name__)\n"
             "dptc.destroy_process_group()\n")
    result = subprocess.run([sys.executable, "-S", "-c", probe], cwd=str(tmp_path), env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    path, cls, fsdp1 = result.stdout.split()
    assert path == str(tmp_path / "dptc" / "__init__.py")
    assert cls == "FSDPLinear"
    assert fsdp1 == "type"


def test_sharding_needs_no_numpy():
    """pyproject asks for torch alone, and torch runs without numpy: so must fully_shard and
    FSDP1 (each shard used to be aliased through numpy).  The shard still starts its own
    storage, as dcp.async_save needs, and the gradients are the unsharded module's."""
    probe = ("import sys\n"
             "sys.modules['numpy'] = None\n"
             "import copy, torch, dptc\n"
             "torch.manual_seed(0)\n"
             "ref = torch.nn.Linear(4, 3)\n"
             "x = torch.randn(5, 4)\n"
             "ref(x).square().sum().backward()\n"
             "for wrap in (dptc.fully_shard, dptc.FSDP):\n"
             "    m = copy.deepcopy(ref)\n"
             "    m.zero_grad(set_to_none=True)\n"
             "    m = wrap(m) or m\n"
             "    m(x).square().sum().backward()\n"
             "    local = m.weight.to_local() if wrap is dptc.fully_shard else None\n"
             "    if local is not None:\n"
             "        assert local.untyped_storage().data_ptr() == local.data_ptr()\n"
             "    with torch.no_grad():\n"
             "        g = [p.grad.full_tensor() if hasattr(p.grad, 'full_tensor') else p.grad\n"
             "             for p in m.parameters()]\n"
             "    print(max((a - b.grad).abs().max().item()\n"
             "              for a, b in zip(g, ref.parameters())))\n"
             "dptc.destroy_process_group()\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert [float(line) for line in result.stdout.split()] == [0.0, 0.0]


def test_benchmark_from_unbuilt_checkout_runs_the_installed_dptc(source, wheel, tmp_path):
    """benchmarks/README.md: after a plain `pip install .` the scripts run the installed dptc.
    fsdp_step.py's launches put the checkout first on their ranks' PYTHONPATH, where its
    unbuilt dptc shadowed the installed one: every rank raised ImportError and the summary
    came back empty (or, beside an editable install of another checkout, ran that one's C
    core under this tree's Python).  The installed wheel is first on PYTHONPATH here, as
    site-packages would hold it."""
    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    env = dict(os.environ, PYTHONPATH=str(installed), OMP_NUM_THREADS="1")
    out = tmp_path / "result.json"
    command = [sys.executable, str(source / "benchmarks" / "fsdp_step.py"), "--vocab", "64",
               "--d-model", "32", "--layers", "1", "--n-head", "2", "--ctx", "8", "--batch", "1",
               "--warmup", "0", "--steps", "1", "--no-memory", "--impls", "dptc-fsdp,torch-fsdp",
               "--deadline", "120", "--json", str(out)]
    result = subprocess.run(command, cwd=str(tmp_path), env=env, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    timing = json.loads(out.read_text())["timing"]
    assert [r["rank"] for r in timing] == [0, 1]
    for r in timing:
        assert r["dptc"] == str(installed / "dptc")
        assert r["param_diff"]["dptc-fsdp vs torch-fsdp"] == 0.0, r["param_diff"]


def test_sdist_holds_the_source_tree(source, tmp_path):
    """The sdist (what `pip install dptc-*.tar.gz` builds from, and what unpacks into a tree
    to test) holds every tracked file but .gitignore: the C headers the build needs, and the
    test harness beside the tests.  Without MANIFEST.in it held the packages, csrc/ and the
    tests/test_*.py files alone, whose imports of tests._launch then failed, and none of
    examples/, benchmarks/, tools/, notes/."""
    tree = tmp_path / "tree"
    shutil.copytree(source, tree)
    out = tmp_path / "sdist"
    subprocess.run([sys.executable, "-c", "import sys\n"
                    "from setuptools import build_meta\n"
                    "build_meta.build_sdist(sys.argv[1])\n", str(out)],
                   cwd=str(tree), check=True, timeout=300, capture_output=True)
    (path,) = out.glob("dptc-*.tar.gz")
    with tarfile.open(path) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    missing = sorted(set(_tracked()) - {".gitignore"} - names)
    assert missing == []
    assert {"csrc/dptc.h", "csrc/transport.h", "tests/_launch.py", "tests/c/fake_cuda.c"} <= names
    assert [n for n in names if n.endswith((".so", ".pyc"))] == []


def test_tests_in_an_unbuilt_checkout_stop_with_the_remedy(source):
    """The tests run the checkout's dptc; after a plain `pip install .` (or none) its extension
    is not built, and every test failed alike with dptc's ImportError.  The session now stops
    before the first test, naming the remedy."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/test_group.py"], cwd=str(source), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert (f"dptc's C extension is not built in {source / 'dptc'}, and the tests run this "
            f"checkout's dptc, not an installed one: build it here with pip install "
            f"--no-build-isolation -e . (README's test command) or python setup.py build_ext "
            f"--inplace") in result.stdout + result.stderr
    assert " passed" not in result.stdout and " failed" not in result.stdout
