"""The docs cannot rot: the matrix page is the data, every message the guide quotes still exists, links resolve."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from autoshard.backends.matrix import MATRIX_BEGIN, MATRIX_END, matrix_markdown

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "autoshard"
REGENERATE = "python -m autoshard.explain --write-matrix docs/matrix.md"
ELIDED = "…"  # in a quoted message, stands for a value filled in at run time (a name, a number)
# Pages other engineers write; a link to one is checked once it exists.
MY_PAGES = ("guide.md", "matrix.md", "benchmarks.md", "index.md")


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def quoted_messages(text: str) -> list[str]:
    """Inline code spans written as a double-quoted string: the guide's convention for a message autoshard prints."""
    spans = re.findall(r"`([^`\n]+)`", _without_fences(text))
    return [s[1:-1] for s in spans if len(s) > 2 and s.startswith('"') and s.endswith('"')]


def source_templates() -> Iterator[str]:
    """Every string literal in src/autoshard, with its run-time parts ({...} and f-string fields) as NUL."""
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                yield "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                yield re.sub(r"\{[^{}]*\}", "\0", node.value)


def found_in(message: str, template: str) -> bool:
    """The message's literal fragments appear in one template, in order, none straddling a run-time part."""
    position = 0
    for fragment in (f for f in message.split(ELIDED) if f):
        at = template.find(fragment, position)
        if at < 0:
            return False
        position = at + len(fragment)
    return True


@pytest.fixture(scope="module")
def templates() -> list[str]:
    return list(source_templates())


@pytest.fixture(scope="module")
def guide() -> str:
    return (DOCS / "guide.md").read_text()


def test_matrix_page_is_the_capability_data() -> None:
    page = (DOCS / "matrix.md").read_text()
    assert MATRIX_BEGIN in page and MATRIX_END in page, f"docs/matrix.md lost its generated block; regenerate: {REGENERATE}"
    block = MATRIX_BEGIN + page.split(MATRIX_BEGIN, 1)[1].split(MATRIX_END, 1)[0] + MATRIX_END
    assert block == matrix_markdown(), f"docs/matrix.md disagrees with autoshard.capability; regenerate it: {REGENERATE}"


def test_every_message_the_guide_quotes_still_exists_in_src(guide: str, templates: list[str]) -> None:
    messages = quoted_messages(guide)
    assert len(messages) >= 20, messages
    missing = [m for m in messages if not any(found_in(m, t) for t in templates)]
    assert not missing, "docs/guide.md quotes messages that src/autoshard no longer prints (update the guide, or the message):\n" + "\n".join(
        f"  {m!r}" for m in missing
    )


def test_the_checker_catches_a_stale_quote(templates: list[str]) -> None:
    assert any(found_in("SLURM started … task(s) per node but Trainer(devices=…)", t) for t in templates)
    assert not any(found_in("no parameter-owning child modules were found", t) for t in templates)
    assert not any(found_in("SLURM started 8 task(s)", t) for t in templates)  # a fragment may not straddle a value


@pytest.mark.parametrize(
    "message",
    [
        "==== autoshard: FSDP2 plan ====",
        "no parameter-owning child modules found to shard",
        "FSDP1 (strategy='fsdp' / FSDPStrategy) is refused by autoshard: …",
        "autoshard cannot run this on …",
        "a DeepSpeed engine wraps exactly one optimizer",
        "ZeRO-3 replaces every parameter outside a forward with an empty partitioned placeholder",
        "Trainer(strategy='…', precision='…') is not supported: …",
    ],
)
def test_guide_quotes_the_signals_users_look_for(guide: str, message: str) -> None:
    assert message in quoted_messages(guide)


@pytest.mark.parametrize(
    "topic",
    [
        "## Quick start",
        "```yaml",
        "```python",
        "torchrun",
        "srun",
        "SLURM_NTASKS",
        "## Debugging",
        "## What gets sharded",
        "OnlineProbe",
        "## Teacher/student",
        "## Mixed precision",
        "MixedPrecisionPolicy",
        "parallelize_fn",
        "(module, device_mesh) -> None",
        "## Checkpoints",
        "checkpoints.md",
        "## DeepSpeed",
        "deepspeed.md",
        "## FSDP1",
        "experimental upstream",
        "autoshard explain",
        "empty_init=True",
    ],
)
def test_guide_covers_the_fsdp2_page_users_know_and_more(guide: str, topic: str) -> None:
    assert topic in guide


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _links(page: Path) -> list[tuple[str, str]]:
    targets = re.findall(r"\]\(([^)\s]+)\)", _without_fences(page.read_text()))
    return [(t.split("#")[0], t.split("#")[1] if "#" in t else "") for t in targets if "://" not in t]


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", _without_fences(page.read_text()), flags=re.M)}


@pytest.mark.parametrize("name", MY_PAGES)
def test_links_and_anchors_resolve(name: str) -> None:
    page = DOCS / name
    broken = []
    for target, anchor in _links(page):
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}#{anchor} (no such heading)")
    assert not broken, f"docs/{name}: " + ", ".join(broken)


def test_index_links_every_page() -> None:
    linked = {target for target, _ in _links(DOCS / "index.md")}
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    assert pages <= linked, f"docs/index.md does not link {sorted(pages - linked)}"
    assert set(MY_PAGES) - {"index.md"} <= linked


def test_code_blocks_in_the_guide_parse(guide: str) -> None:
    yaml = pytest.importorskip("yaml")
    blocks = re.findall(r"^```(\w+)\n(.*?)^```", guide, flags=re.M | re.S)
    assert {"yaml", "python"} <= {lang for lang, _ in blocks}
    for lang, body in blocks:
        if lang == "yaml":
            yaml.safe_load(body)
        elif lang == "python":
            ast.parse(body)


def test_class_paths_in_the_docs_import() -> None:
    import importlib

    text = "".join((DOCS / name).read_text() for name in MY_PAGES)
    for path in sorted(set(re.findall(r"class_path: ([\w.]+)", text))):
        module, _, attr = path.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), path


def test_benchmarks_page_says_how_and_where_it_was_measured() -> None:
    page = (DOCS / "benchmarks.md").read_text()
    for needed in ("python benchmarks/run.py", "2 CPU cores", "gloo", "torch 2.13.0"):
        assert needed in page, needed
