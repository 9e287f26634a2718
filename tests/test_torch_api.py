"""hhook calls only what torch 2.11 (the GPU machines' torch, the oldest hhook supports)
has in ``torch.distributed`` and FSDP2, or falls back where it does not: every name hhook
reads from those modules, statically (``dist.X``, ``torch.distributed.X.Y``, ``from ...
import X``; names reached through ``getattr(..., None)`` with a fallback are not attribute
reads and pass), and every ``FSDPModule.set_*`` it calls, must be in
``tests/data/torch-2.11-api.txt`` (read off torch 2.11.0 on a GPU machine). The suite
itself runs under torch 2.11 with ``bash ci/torch211.sh``."""

import ast
import importlib.util
import pathlib

import pytest

HHOOK = pathlib.Path(__file__).resolve().parents[1] / "src" / "hhook"
LISTING = pathlib.Path(__file__).resolve().parent / "data" / "torch-2.11-api.txt"


def _listing() -> tuple[set, set, set]:
    names, fsdp_module = set(), set()
    for line in LISTING.read_text().splitlines():
        if line.startswith("torch.distributed"):
            names.add(line.split()[0])
        elif line.startswith("FSDPModule."):
            fsdp_module.add(line.split()[0].split(".", 1)[1])
    modules = {n.rsplit(".", 1)[0] for n in names}
    return names, modules, fsdp_module


def _dotted(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def _reads(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, torch.distributed.dotted.name)`` that ``path`` reads."""
    tree = ast.parse(path.read_text())
    aliases = {"torch": "torch"}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch.distributed"):
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                full = ".".join([aliases[parts[0]]] + parts[1:])
                if full.startswith("torch.distributed."):
                    out.append((node.lineno, full))
    return out


def _is_submodule(name: str) -> bool:
    """Submodules are not in the listing (it lists modules' members); torch 2.11's run of
    the suite (ci/torch211.sh) imports the ones hhook uses."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _missing(full: str, names: set, modules: set) -> str | None:
    """The first prefix of ``full`` that 2.11 lacks, or None."""
    parts = full.split(".")
    for i in range(2, len(parts)):
        module, name = ".".join(parts[:i]), ".".join(parts[: i + 1])
        if module not in modules:
            return None  # not a listed module: an object's attribute, beyond the listing
        if name not in names and name not in modules and not _is_submodule(name):
            return name
    return None


def _set_parents(tree):
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node


def test_the_listing_is_torch_2_11():
    names, modules, fsdp_module = _listing()
    assert LISTING.read_text().splitlines()[1].startswith("torch 2.11")
    assert "torch.distributed.all_gather_into_tensor" in names and "torch.distributed.all_gather_single" not in names
    assert "set_custom_all_gather" in fsdp_module and "torch.distributed.fsdp" in modules


def test_hhook_reads_only_names_torch_2_11_has():
    names, modules, _ = _listing()
    missing = []
    for path in sorted(HHOOK.rglob("*.py")):
        tree = ast.parse(path.read_text())
        _set_parents(tree)
        for line, full in _reads(path):
            lacking = _missing(full, names, modules)
            if lacking:
                missing.append(f"{path.relative_to(HHOOK.parent)}:{line}: {lacking}")
    assert not missing, missing


def test_the_check_finds_a_name_2_11_lacks():
    names, modules, _ = _listing()
    assert _missing("torch.distributed.all_gather_single", names, modules) == "torch.distributed.all_gather_single"
    assert _missing("torch.distributed.all_gather_into_tensor", names, modules) is None
    assert _missing("torch.distributed.distributed_c10d._world.pg_map", names, modules) in (
        None, "torch.distributed.distributed_c10d._world")


def test_fsdp_module_setters_exist_in_2_11():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    _, _, fsdp_module = _listing()
    used = set()
    for path in (HHOOK / "fsdp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("set_") and hasattr(fsdp.FSDPModule, node.attr):
                used.add(node.attr)
    assert {"set_custom_reduce_scatter", "set_custom_all_gather"} <= used
    assert used <= fsdp_module, used - fsdp_module
