"""The package's layering: no module imports one that (through others) imports it back,
and the codec's backends read the layout, never the codec."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "hhook"


def _graph() -> dict:
    graph = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):  # imports inside functions count too
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                deps.update([target] if node.module else [f"{target}.{a.name}" for a in node.names])
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _graph()
    cycles = []

    def visit(node, stack, done):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in done:
            return
        done.add(node)
        for dep in graph.get(node, ()):
            if dep in graph:
                visit(dep, stack + [node], done)

    done: set = set()
    for name in graph:
        visit(name, [], done)
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_backends_depend_on_the_layout_not_the_codec():
    graph = _graph()
    for backend in ("hhook.cpu_kernels", "hhook.cuda_kernels"):
        assert "hhook.codec" not in graph[backend] and "hhook.layout" in graph[backend], graph[backend]
