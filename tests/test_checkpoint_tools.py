"""How the checkpoint tools are laid out, read from src/: DeepSpeed's file names are spelled in one module
(``autoshard.checkpoint.deepspeed_layout``), and no module imports another's underscore name (what is shared is public)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "autoshard"
# Spellings of DeepSpeed's files: a code string holding one outside deepspeed_layout is a second copy of the layout.
DEEPSPEED_SPELLINGS = ("model_states.pt", "optim_states.pt", "zero_pp_rank_(", "zero_pp_rank_{", "mp_rank_*", "zero_to_fp32.py", "offloaded_tensors")
DEEPSPEED_NAMES = ("latest", "_forward_module.", "bf16_")


def _module(path: Path, root: Path) -> list[str]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _code_strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants that are not docstrings (f-string pieces included: an error text naming a file is code)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def deepspeed_spellings(root: Path) -> list[str]:
    found = []
    for f in sorted(root.rglob("*.py")):
        if f.name == "deepspeed_layout.py":
            continue
        for node in sorted(_code_strings(ast.parse(f.read_text())), key=lambda n: n.lineno):
            text = node.value
            if any(s in text for s in DEEPSPEED_SPELLINGS) or text in DEEPSPEED_NAMES:
                found.append(f"{f.relative_to(root)}:{node.lineno}: {text!r}")
    return found


def test_deepspeed_files_are_spelled_in_one_module() -> None:
    found = deepspeed_spellings(PACKAGE)
    assert not found, f"use autoshard.checkpoint.deepspeed_layout instead of spelling DeepSpeed's files: {found}"


def test_the_spelling_scan_finds_a_second_copy(tmp_path: Path) -> None:
    (tmp_path / "copy.py").write_text(
        '"""doc: zero_pp_rank_0_mp_rank_00_model_states.pt"""\nNAME = f"zero_pp_rank_{3}_mp_rank_00_optim_states.pt"\nTAG = "latest"\n'
    )
    assert [line.split(":")[1] for line in deepspeed_spellings(tmp_path)] == ["2", "3"]


def private_imports(root: Path) -> list[str]:
    """``from autoshard.x import _y``, ``from . import _y``, and ``x._y`` on an imported autoshard module, across
    modules (a module's own names are its business)."""
    found = []
    for f in sorted(root.rglob("*.py")):
        tree, here = ast.parse(f.read_text()), _module(f, root)
        package = here if f.name == "__init__.py" else here[:-1]
        modules: dict[str, str] = {}  # local name -> imported autoshard module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                if base.split(".")[0] != "autoshard":
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{f.relative_to(root)}:{node.lineno}: from {base} import {alias.name}")
                    target = f"{base}.{alias.name}"
                    if (root / Path(*target.split("."))).is_dir() or (root / Path(*target.split("."))).with_suffix(".py").is_file():
                        modules[alias.asname or alias.name] = target
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "autoshard" and alias.asname:
                        modules[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                if node.attr.startswith("_") and not node.attr.startswith("__") and modules[node.value.id] != ".".join(here):
                    found.append(f"{f.relative_to(root)}:{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_imports_another_modules_underscore_name() -> None:
    found = private_imports(SRC)
    assert not found, f"make these public in the module that owns them (or move them to a lower layer): {found}"


def test_the_private_import_scan_finds_each_form(tmp_path: Path) -> None:
    pkg = tmp_path / "autoshard"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("_hidden = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text(
        "from autoshard.low import _hidden\nfrom ..low import _hidden as h\nfrom autoshard import low\nimport autoshard.low as lo\nx = low._hidden + lo._hidden\n"
    )
    assert len(private_imports(tmp_path)) == 4
