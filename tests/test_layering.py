"""The package's layering, by folder: every module imports only its own layer and the
ones below (imports under ``if TYPE_CHECKING:`` count too: a type names what a module
knows), no module
imports one that (through others) imports it back, the codec's kernels read its layout,
never the codec object, and hhook-profile's dispatcher sits above its subcommands, which
sit above what they share."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "src" / "hhook"


def _graph() -> dict:
    """module -> the hhook modules it imports (relative or absolute, inside functions and
    under ``if TYPE_CHECKING:`` too), leaving out its own ancestor packages (Python
    initialises them before it, whatever it imports)."""
    graph = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                elif (node.module or "").split(".")[0] == "hhook":
                    target = node.module
                else:
                    continue
                deps.add(target)
                deps.update(f"{target}.{a.name}" for a in node.names)  # kept only where a module
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "hhook")
        graph[name] = deps
    return {name: {d for d in deps if d in graph and not (name + ".").startswith(d + ".")}
            for name, deps in graph.items()}


def _cycles(graph: dict) -> list[list[str]]:
    cycles = []

    def visit(node, stack, done):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in done:
            return
        done.add(node)
        for dep in sorted(graph.get(node, ())):
            visit(dep, stack + [node], done)

    done: set = set()
    for name in sorted(graph):
        visit(name, [], done)
    return cycles


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_type_checking_imports_count():
    """A module that names another only in its annotations still depends on it: the
    decision's prober names THCState and Decision that way; the schedule names no state."""
    graph = _graph()
    assert {"hhook.state", "hhook.decision.decision"} <= graph["hhook.decision.prober"], graph["hhook.decision.prober"]
    for module in ("hhook.schedule.flat", "hhook.schedule.allreduce", "hhook.schedule.two_level"):
        assert not {d for d in graph[module] if d.startswith("hhook.state")}, (module, graph[module])


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_kernels_depend_on_the_layout_not_the_codec():
    graph = _graph()
    kernels = {m for m in graph if m.startswith("hhook.codec.kernels.")}
    assert {"hhook.codec.kernels.cpu", "hhook.codec.kernels.cuda"} <= kernels
    for module in kernels:
        assert "hhook.codec.codec" not in graph[module], (module, graph[module])
    for module in ("hhook.codec.kernels.cpu", "hhook.codec.kernels.cuda"):
        assert "hhook.codec.layout" in graph[module], graph[module]


def test_profile_layers():
    """cli -> commands.* -> shared profile modules: only the package entry points import the
    dispatcher, only the dispatcher imports the subcommands, no subcommand imports another."""
    graph = _graph()
    profile = {m: deps for m, deps in graph.items() if m.startswith("hhook.profile")}
    commands = {m for m in profile if m.startswith("hhook.profile.commands.")}
    assert {"hhook.profile.commands.link", "hhook.profile.commands.train"} <= commands
    for module, deps in profile.items():
        if module not in ("hhook.profile", "hhook.profile.__main__"):
            assert "hhook.profile.cli" not in deps, module
        if module not in ("hhook.profile.cli", "hhook.profile.commands"):
            assert not deps & (commands | {"hhook.profile.commands"}), (module, deps & commands)
    assert not _cycles(profile)


#: docs/design.md, bottom to top: a module imports only its own layer and the ones below.
#: A layer is a folder of hhook/ (a sub-folder belongs to its folder's layer), or, for the
#: base and the integrations, modules at the top. Every module of the package is placed.
LAYERS = (
    ("base", {"errors", "launch", "stats"}),  # what every layer raises, reads from the launcher, counts
    ("codec", {"codec"}),
    ("scales", {"scales"}),
    ("schedule", {"schedule"}),
    ("state", {"state"}),
    ("decision", {"decision"}),
    # "": the package's front, src/hhook/__init__.py; adapters + lightning, accelerate, transformers: the framework
    # adapters, over the DDP hook; diloco: the outer synchronization across sites, over thc_allreduce_async;
    # torchft: THC as torchft's fault-tolerant exchange, over thc_allreduce_async and a Membership per quorum
    ("integrations", {"ddp_hook", "horovod", "fsdp", "diloco", "", "adapters", "lightning", "accelerate",
                      "transformers", "torchft"}),
    ("benchmarks", {"simulation", "baselines", "profile"}),
)
#: Layers that are folders of hhook/ (the others are modules at its top).
FOLDERS = {"codec", "scales", "schedule", "state", "decision"}
INTEGRATIONS = {"hhook.ddp_hook", "hhook.horovod", "hhook.fsdp", "hhook.diloco", "hhook.torchft"}
#: One module per framework, each over hhook.adapters and the DDP hook, none over another.
FRAMEWORK_ADAPTERS = {"hhook.lightning", "hhook.accelerate", "hhook.transformers"}


def _layer(module: str) -> int:
    name = module[len("hhook."):] if module != "hhook" else ""
    top = name.split(".")[0]
    for i, (_, members) in enumerate(LAYERS):
        if name in members or top in members:
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layering.py's LAYERS (place it there and in docs/design.md)")


def test_every_import_points_down_the_layers():
    graph = _graph()
    upward = [(m, d) for m, deps in graph.items() for d in deps if _layer(d) > _layer(m)]
    assert not upward, [f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})" for m, d in upward]


def test_integrations_do_not_import_each_other():
    graph = _graph()
    for module in INTEGRATIONS:
        assert not graph[module] & (INTEGRATIONS - {module}), (module, graph[module] & INTEGRATIONS)


def test_layers_are_folders():
    for name, members in LAYERS:
        for member in members:
            if member in FOLDERS:
                assert (ROOT / member / "__init__.py").is_file(), f"layer {name}: hhook/{member}/ is not a package"
            elif member:
                assert (ROOT / f"{member}.py").is_file() or (ROOT / member / "__init__.py").is_file(), member
    top = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    placed = {m for _, members in LAYERS for m in members} | {"__init__"}
    assert top <= placed, top - placed


def test_the_layer_check_finds_an_upward_import():
    assert _layer("hhook.codec.rng") < _layer("hhook.scales.message") < _layer("hhook.schedule.flat") < _layer("hhook.fsdp")
    assert _layer("hhook.codec.kernels.cpu") == _layer("hhook.codec")
    assert _layer("hhook.profile.commands.train") == _layer("hhook.baselines.sbc") == len(LAYERS) - 1


def test_framework_adapters_stand_alone_and_the_core_does_not_import_them():
    import subprocess
    import sys

    graph = _graph()
    for module in FRAMEWORK_ADAPTERS:
        assert not graph[module] & (FRAMEWORK_ADAPTERS | INTEGRATIONS - {"hhook.ddp_hook"}), (module, graph[module])
    assert not graph["hhook"] & FRAMEWORK_ADAPTERS
    # `import hhook` loads no framework (torch and numpy only)
    code = ("import sys, hhook; print(sorted(m for m in ('lightning', 'pytorch_lightning', 'accelerate', "
            "'transformers', 'ray', 'torchft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(ROOT.parent), env={**__import__("os").environ, "PYTHONPATH": str(ROOT.parent)})
    assert out.stdout.strip() == "[]", out
