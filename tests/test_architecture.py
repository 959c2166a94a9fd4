"""The rooms' import rule (docs/architecture.md), read from every module's source: direct imports, lazy ones too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "chameleon"

# room (a package or module under chameleon/) → the module prefixes it may never import
RULES = {
    "config.py": ("chameleon.runtime",),
    "faults/spec.py": ("chameleon.runtime",),
    "decision": ("chameleon.runtime",),
    "layout": ("chameleon.runtime", "chameleon.decision"),
    "model": ("chameleon.runtime", "chameleon.decision"),
    "sim": ("chameleon.runtime",),
    "data": ("chameleon.runtime",),
    "runtime/protocol": ("chameleon.runtime.control", "chameleon.runtime.node", "chameleon.runtime.worker",
                         "torch.distributed", "socket"),
    "runtime/control": ("chameleon.runtime.worker", "torch.distributed", "socket"),
}


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _modules(room: str) -> list[Path]:
    path = PACKAGE / room
    return [path] if path.is_file() else sorted(path.rglob("*.py"))


@pytest.mark.parametrize("room", sorted(RULES))
def test_a_room_never_imports_what_its_rule_forbids(room):
    assert _modules(room), f"chameleon/{room} holds no module"
    broken = [
        f"chameleon/{module.relative_to(PACKAGE)} imports {name}"
        for module in _modules(room) for name in sorted(imports_of(module))
        if any(name == banned or name.startswith(banned + ".") for banned in RULES[room])
    ]
    assert not broken, "\n".join(broken)


def test_the_rule_reads_lazy_imports_and_names_imported_from_a_package(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from chameleon.runtime import node\n    import socket\n")
    assert {"chameleon.runtime.node", "socket"} <= imports_of(module)


def test_the_training_entry_point_reads_and_refuses_its_config_without_loading_torch():
    """A refusal or ``--help`` of ``chameleon.train`` answers in about a second: its module, the CLI and the config
    (every room's config and vocabulary) load no torch, which takes seconds to import."""
    probe = ("import sys, chameleon.train, chameleon.cli, chameleon.config\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
