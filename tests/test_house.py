"""The house's size limits, measured with ``ast`` over hhook/: no module over 450 lines,
no class over 250, no function over 80 outside src/hhook/profile/ (whose command bodies
are exempt, as examples are); ``THCState``, the user's options and checkpoint, under 150
lines and without methods that only hand ``self`` to another module's function."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1] / "src" / "hhook"
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


# -- THCState's own methods, and what the schedule's functions take ------------------------
def _state_classes():
    """THCState and its bases in src/hhook/state/ (its checkpoint and its reports)."""
    found = {}
    for path in (ROOT / "state").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name in ("THCState", "Checkpointed", "Reporting"):
                found[node.name] = node
    return found


def _borrowed(cls: ast.ClassDef) -> list[str]:
    """Class-level names that are not the class's own code: a lambda (``bits =
    property(lambda self: self.options.bits)``), a function of another module bound as a
    method (``state_dict = checkpoint.state_dict``), or a property built of them."""
    own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    out = []
    for node in cls.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        names = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
        value = node.value
        if any(isinstance(n, ast.Lambda) for n in ast.walk(value)):
            out += [f"{name} (a lambda)" for name in names]
        elif isinstance(value, ast.Attribute) or (isinstance(value, ast.Name) and value.id not in own):
            out += [f"{name} = {ast.unparse(value)}" for name in names]
        elif isinstance(value, ast.Call) and ast.unparse(value.func) in ("property", "staticmethod", "classmethod"):
            out += [f"{name} = {ast.unparse(value)}" for name in names]
    return out


def test_the_borrowing_check_finds_lambdas_and_bound_functions():
    source = ("class C:\n    bits = property(lambda self: self.options.bits)\n    state_dict = checkpoint.state_dict\n"
              "    stats = report_stats\n    def own(self):\n        return 1\n    alias = own\n    __slots__ = ('a',)\n")
    assert _borrowed(ast.parse(source).body[0]) == [
        "bits (a lambda)", "state_dict = checkpoint.state_dict", "stats = report_stats"]


def test_thc_state_has_no_bound_module_functions_and_no_lambdas():
    classes = _state_classes()
    assert set(classes) == {"THCState", "Checkpointed", "Reporting"}
    assert {name: _borrowed(cls) for name, cls in classes.items()} == dict.fromkeys(classes, [])
    methods = [n for cls in classes.values() for n in cls.body if isinstance(n, ast.FunctionDef)]
    assert [m.name for m in methods if _forwards(m)] == []


MAX_SCHEDULE_PARAMETERS = 6


def test_no_function_of_the_schedule_takes_more_than_6_parameters():
    """The schedule takes plain data (a CallContext), not long argument lists."""
    wide = []
    for path in sorted((ROOT / "schedule").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                if len(names) > MAX_SCHEDULE_PARAMETERS:
                    wide.append((path.name, node.name, len(names)))
    assert wide == []


# -- one definition each: the options handshake, the dense fallback, the status word ------
def _sources(skip=("profile/",)):
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(skip):
            yield rel, path.read_text()


def test_one_options_handshake():
    """src/hhook/schedule/handshake.py is the one options handshake of every path (DDP,
    two-level, thc_allreduce, FSDP2's reduce-scatter and all-gather): nothing else
    defines one, keeps a record of one, or runs the MAX of a fingerprint that it is made of
    (the decision's own check of its state, decision/prober.py, uses the same primitive)."""
    defining = re.compile(r"def \w*(handshake|check_options|ensure_checked|agree_without|verify_options)\w*\(")
    records = re.compile(r"_verified\b|\.verified\.add|\.checked\.add|\.checked\b")
    seconds = [(rel, m.group(0)) for rel, text in _sources() if rel != "schedule/handshake.py"
               for m in defining.finditer(text)]
    kept = [(rel, m.group(0)) for rel, text in _sources() for m in records.finditer(text)]
    maxes = sorted(rel for rel, text in _sources() if re.search(r"\bagrees\(", text) and "def agrees(" not in text)
    assert seconds == [] and kept == [] and maxes == ["decision/prober.py", "schedule/handshake.py"]


def test_one_dense_fallback():
    """One byte count for what THC does not compress: every dense exchange of the schedule,
    of FSDP2's reduce-scatter and HSDP's replica all-reduce, and of DiLoCo's fp32 outer
    exchange is counted by src/hhook/schedule/dense.py's ``count``. The
    others that say "dense_calls": the counters' fields, the report that reads them,
    Horovod's warm-up step (a message of its own kind) and the parameter all-gather
    (counted in its own dtype, docs/fsdp.md)."""
    saying = sorted(rel for rel, text in _sources() if '"dense_calls"' in text)
    assert saying == ["fsdp/all_gather.py", "horovod.py", "schedule/dense.py", "state/report.py", "stats.py"]
    counting = sorted(rel for rel, text in _sources() if re.search(r"\bcount\([\w.]*counters", text))
    assert counting == ["diloco/sync.py", "fsdp/hsdp.py", "fsdp/reduce_scatter.py", "schedule/dense.py",
                        "schedule/two_level.py"]


def test_one_failure_status_word():
    """The message status word (inf/NaN, a rank that failed) is defined once, in
    src/hhook/codec/layout.py beside the prefix the CUDA kernels write (src/hhook/scales/message.py
    re-exports it and spreads it over FSDP2's chunks), for every exchange: nothing else
    names its value or its place, or keeps status bits of its own."""
    own = re.compile(r"RANK_FAILED|1 << 20|\b(NONFINITE|FAILED)\s*=|\[:, *1\]\s*=|def (status_word|any_failed|"
                     r"any_nonfinite|failed_ranks|share_status)\(")
    assert [(rel, m.group(0)) for rel, text in _sources(("profile/", "codec/layout.py", "scales/message.py", "simulation.py"))
            for m in own.finditer(text)] == []
    defined = sorted(rel for rel, text in _sources()
                     for _ in re.finditer(r"def (status_word|any_failed|any_nonfinite|failed_ranks)\(|RANK_FAILED = ", text))
    assert defined == ["codec/layout.py"] * 5
    users = sorted(rel for rel, text in _sources() if re.search(r"message\.(status_word|any_failed|share_status)", text))
    assert users == ["fsdp/all_gather.py", "schedule/reduce_scatter.py", "schedule/two_level.py"]
