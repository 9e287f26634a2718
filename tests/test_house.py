"""The house's size limits, measured with ``ast`` over hhook/: no module over 450 lines,
no class over 250, no function over 80 outside hhook/profile/ (whose command bodies
are exempt, as examples are); ``THCState``, the user's options and checkpoint, under 150
lines and without methods that only hand ``self`` to another module's function."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "hhook"
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 450, 250, 80


def _sizes():
    """(path relative to hhook/, kind, name, lines) of every module, class and function."""
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        source = path.read_text()
        yield rel, "module", rel, len(source.splitlines())
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                yield rel, kind, node.name, node.end_lineno - node.lineno + 1


def test_sizes_are_measured():
    kinds = {kind for _, kind, _, _ in _sizes()}
    assert kinds == {"module", "class", "function"}


def test_no_module_over_450_lines():
    assert [(rel, n) for rel, kind, _, n in _sizes() if kind == "module" and n > MAX_MODULE] == []


def test_no_class_over_250_lines():
    assert [(rel, name, n) for rel, kind, name, n in _sizes() if kind == "class" and n > MAX_CLASS] == []


def test_no_function_over_80_lines_outside_profile():
    long = [(rel, name, n) for rel, kind, name, n in _sizes()
            if kind == "function" and n > MAX_FUNCTION and not rel.startswith("profile/")]
    assert long == []


def _thc_state():
    tree = ast.parse((ROOT / "state" / "thc_state.py").read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "THCState")


def test_thc_state_under_150_lines():
    node = _thc_state()
    assert node.end_lineno - node.lineno + 1 < 150


def _forwards(function) -> bool:
    """A method whose body (past its docstring) is one call that hands ``self`` on to
    another object's function: ``return runtime.handshake(self, device)``."""
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)):
        return False
    call = body[0].value
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and any(isinstance(a, ast.Name) and a.id == "self" for a in call.args))


def test_the_forwarder_check_finds_forwarders():
    forwarder = "def f(self, d):\n    'doc'\n    return runtime.handshake(self, d)\n"
    assert _forwards(ast.parse(forwarder).body[0])
    assert not _forwards(ast.parse("def g(self):\n    return self.options.bits + 1\n").body[0])


def test_thc_state_has_no_one_line_forwarders():
    methods = [n for n in _thc_state().body if isinstance(n, ast.FunctionDef)]
    assert methods and [m.name for m in methods if _forwards(m)] == []


def test_every_hhook_import_names_a_module_of_this_checkout():
    """An import of a module that moved would still run where another checkout of hhook is
    installed (an editable install finds what this one lacks): every ``from .x import`` and
    ``from hhook.x import`` must name a module or package here."""

    def exists(module: str) -> bool:
        path = ROOT.parent.joinpath(*module.split("."))
        return path.with_suffix(".py").exists() or (path / "__init__.py").exists()

    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hhook":
                target = node.module
            elif isinstance(node, ast.Import):
                missing += [(path.name, a.name) for a in node.names
                            if a.name.split(".")[0] == "hhook" and not exists(a.name)]
                continue
            else:
                continue
            if not exists(target):
                missing.append((str(path.relative_to(ROOT)), target))
    assert missing == []
