"""The documentation as users meet it: every public name documented, docs/api.md generated from the current
docstrings, every link of the README and docs/ pointing at a file (and heading) the repository has."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _api_module():
    spec = importlib.util.spec_from_file_location("docs_api", ROOT / "docs" / "api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


API = _api_module()
PUBLIC = API.public_names()


def test_the_public_names_are_found():
    names = {f"{module}.{name}" for module, name, _ in PUBLIC}
    assert {"flashtile.flash_attn_func", "flashtile.scaled_dot_product_attention", "flashtile.flash_attn_with_kvcache",
            "flashtile.distributed.ring_flash_attn_func"} <= names  # fmt: skip


@pytest.mark.parametrize("module, name, obj", PUBLIC, ids=[f"{m}.{n}" for m, n, _ in PUBLIC])
def test_every_public_name_has_a_docstring(module, name, obj):
    doc = inspect.getdoc(obj)
    assert doc and len(doc.split()) >= 10, f"{module}.{name} has no docstring worth the name: {doc!r}"


def _undocumented_arguments(obj) -> list[str]:
    """Arguments a docstring does not name, unless it hands them to another function ('the rest: as ``f``')
    whose docstring names them."""
    doc = inspect.getdoc(obj) or ""
    params = [p for p in inspect.signature(obj).parameters if p not in ("args", "kwargs")]
    missing = [p for p in params if not re.search(rf"\b{re.escape(p)}\b", doc)]
    for other in re.findall(r"as ``(\w+)``", doc):
        target = getattr(inspect.getmodule(obj), other, None)
        target_doc = inspect.getdoc(target) or ""
        missing = [p for p in missing if not re.search(rf"\b{re.escape(p)}\b", target_doc)]
    return missing


FUNCTIONS = [entry for entry in PUBLIC if inspect.isfunction(inspect.unwrap(entry[2]))]


@pytest.mark.parametrize("module, name, obj", FUNCTIONS, ids=[f"{m}.{n}" for m, n, _ in FUNCTIONS])
def test_every_argument_is_documented(module, name, obj):
    assert not _undocumented_arguments(obj), f"{module}.{name}: {_undocumented_arguments(obj)} not in the docstring"


RAISE_NOTHING = {
    "check_values": "takes any value (its truth) and checks nothing itself",
    "mask": "transformers calls it with arguments its own code built; a pattern it cannot read goes to sdpa_mask",
    "noop_mask": "a mask_mod: it returns True for any arguments",
    "profile": "takes no argument; errors of the calls inside its block propagate unchanged",
}
"""Public functions that raise no error of their own, so their docstrings have no Raises section."""


@pytest.mark.parametrize("module, name, obj", FUNCTIONS, ids=[f"{m}.{n}" for m, n, _ in FUNCTIONS])
def test_every_function_names_its_errors(module, name, obj):
    doc = inspect.getdoc(obj) or ""
    if name in RAISE_NOTHING:
        assert "Raises:" not in doc, f"{module}.{name} documents errors: take it out of RAISE_NOTHING"
    else:
        assert re.search(r"^Raises:\n\s+\S", doc, re.M), f"{module}.{name}: no Raises section in its docstring"


def test_api_page_is_current():
    """docs/api.md is generated: after a docstring changes, run `PYTHONPATH=src python3 docs/api.py`."""
    assert API.main(["--check"]) == 0


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file (lower case, punctuation dropped, '-' for spaces,
    '-1', '-2' after repeats)."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in path.read_text().splitlines():
        heading = re.match(r"^#{1,6} (.*)", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            n = counts.get(anchor, 0)
            counts[anchor] = n + 1
            found.add(anchor if n == 0 else f"{anchor}-{n}")
    return found


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_into_the_repository(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to what the repository does not have: {broken}"


PROCESS_WORDS = re.compile(r"\b(session|device budget|device call|helper|the lead)\b|\bcall \d|\bissue \d", re.I)


@pytest.mark.parametrize(
    "path",
    [*MARKDOWN, *sorted((ROOT / "benchmarks").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.sh"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_documents_speak_of_the_product(path):
    """No words of the way the work was organised, only of what flashtile does (function calls and
    C helpers are fine: the words are matched as the work's, not the code's)."""
    hits = [line.strip() for line in path.read_text().splitlines() if PROCESS_WORDS.search(line)]
    allowed = ("per call", "a call", "irst call", "helper toggles", "gluon.jit helper", "host helper")
    hits = [h for h in hits if not any(a in h for a in allowed)]
    assert not hits, hits[:5]
