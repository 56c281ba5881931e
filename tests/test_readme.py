"""README.md against the tree: what a user copies from it or looks up through it exists.

- Each Python block of README.md parses, its imports run, and every name it uses is imported
  or bound in it, or is one of the placeholders the prose leaves to the user's script (the
  model, the data, the optimizer).
- Every `dptc.NAME` it names (the API table among them) resolves, as attribute or submodule.
- Every file it names exists, and every [Note: ...] it sends the reader to is in the file it
  names; its Layout section names every C source and every module of dptc/.

Layer: text and imports in this process, no ranks."""

import ast
import builtins
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# Names the snippets leave to the user's script.
PLACEHOLDERS = {"MyModel", "model", "loader", "accum", "opt", "batch", "out", "shard", "Block",
                "steps", "every", "train_step"}
# Where README's bare file names live (it names `engine.c` in a list under `csrc/`).
FOLDERS = ("", "csrc", "dptc", "dptc/fsdp", "benchmarks", "examples", "notes", "tests", "tools")


def _blocks():
    return re.findall(r"```python\n(.*?)```", README, re.S)


def _free_names(tree):
    loaded, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return loaded - bound - set(dir(builtins))


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_snippet_imports_what_it_uses(index):
    """The snippets used functools, transformer_auto_wrap_policy, StateDictType,
    FullStateDictConfig, init_device_mesh and torch without importing them."""
    code = _blocks()[index]
    tree = ast.parse(code)
    assert sorted(_free_names(tree) - PLACEHOLDERS) == [], code
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports, type_ignores=[]), "README.md", "exec"), {})


def test_dptc_names_resolve():
    names = sorted(set(re.findall(r"`dptc\.([A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_])", README)))
    assert len(names) >= 10, names
    missing = []
    for name in names:
        obj = importlib.import_module("dptc")
        try:
            for part in name.split("."):
                try:
                    obj = getattr(obj, part)
                except AttributeError:
                    obj = importlib.import_module(f"{obj.__name__}.{part}")
        except (AttributeError, ImportError):
            missing.append(name)
    assert missing == []


def _exists(name):
    return any((ROOT / folder / name).exists() for folder in FOLDERS)


def test_named_files_exist():
    """Paths under the tree's folders anywhere (commands included), and bare file names in
    backticks (the Layout section's lists)."""
    names = set(re.findall(r"(?<![\w/.])((?:\.ci|csrc|dptc|tests|tools|examples|benchmarks|notes)"
                           r"/(?:[\w./-]*[\w/])?)", README))
    names |= set(re.findall(r"`([\w.][\w./-]*\.(?:py|c|h|md|sh))`", README))
    assert {"csrc/", "tests/_launch.py", "notes/FSDP.md", "examples/train_gpt.py",
            "tools/sanitize.sh", "tools/tsan.sh", ".ci/run", "engine.c"} <= names
    assert sorted(n for n in names if not _exists(n)) == []


def test_notes_are_where_they_are_said_to_be():
    references = re.findall(r"`?(\[Note: [^\]]+\])`? in `([^`]+)`", README)
    assert len(references) >= 5, references
    missing = [(note, name) for note, name in references
               if not any(note in path.read_text() for folder in FOLDERS
                          for path in [ROOT / folder / name] if path.is_file())]
    assert missing == []


def test_layout_names_every_source_file():
    """The Layout section left out csrc/common.c, csrc/cudalib_module.c, dptc/join.py,
    _compile.py, _dcp.py, _sparse.py and _dtypes.py."""
    layout = README[README.index("## Layout"):README.index("## Sanitizers")]
    sources = [p.name for p in [*ROOT.glob("csrc/*.c"), *ROOT.glob("dptc/*.py")]
               if p.name != "__init__.py"]
    assert len(sources) >= 20, sources
    assert sorted(n for n in sources if f"`{n}`" not in layout) == []
