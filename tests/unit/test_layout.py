"""The tree reads as the compiler: autopar's top level holds only the cross-stage modules, and
docs/architecture.md names every package and module that exists (and no module that does not)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "autopar"
TOP_LEVEL = {"__init__.py", "api.py", "cli.py", "cluster.py", "graph.py", "mesh.py", "errors.py", "validation.py"}


def tree_text() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    return text.split("## The tree", 1)[1].split("\n## ", 1)[0]


def test_only_cross_stage_modules_at_the_top_level():
    assert {path.name for path in PACKAGE.glob("*.py")} == TOP_LEVEL


def test_the_architecture_page_names_every_module():
    tree = tree_text()
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", tree))
    missing = []
    for package in sorted(path for path in PACKAGE.iterdir() if (path / "__init__.py").exists()):
        if f"{package.name}/" not in tree:
            missing.append(f"{package.name}/")
        missing += [f"{package.name}/{module.name}" for module in sorted(package.glob("*.py"))
                    if module.stem != "__init__" and module.stem not in words]
    for module in sorted(TOP_LEVEL - {"__init__.py"}):
        if module not in tree and module.removesuffix(".py") not in words:
            missing.append(module)
    assert not missing, f"docs/architecture.md's tree does not name: {', '.join(missing)}"
