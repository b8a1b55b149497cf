"""Imports go one way: plan and schedule (data) <- planner (numpy) and runtime (torch only) <-
megatron (the glue).

Every import counts, function-level ones included."""

from __future__ import annotations

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "megatron_terapipe")


def imported_modules(folder: str) -> dict[str, set[str]]:
    """Absolute names of the modules each file under `folder` imports (relative ones resolved;
    `from . import x` counts as importing the module x too)."""
    out = {}
    for name in sorted(os.listdir(os.path.join(PACKAGE, folder))):
        if not name.endswith(".py"):
            continue
        package = ["megatron_terapipe"] + ([folder] if folder else [])
        tree = ast.parse(open(os.path.join(PACKAGE, folder, name)).read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                found.add(module)
                found |= {f"{module}.{alias.name}" for alias in node.names}
        out[f"{folder}/{name}".lstrip("/")] = found
    return out


def test_runtime_is_torch_only():
    for path, modules in imported_modules("runtime").items():
        megatron = {m for m in modules
                    if m.split(".")[0] == "megatron" or m.startswith("megatron_terapipe.megatron")}
        assert not megatron, f"{path} imports {megatron}"


def test_the_schedule_is_data():
    for path, modules in imported_modules("schedule").items():
        outside = {m for m in modules if m.split(".")[0] in ("torch", "megatron", "numpy")
                   or m.startswith(("megatron_terapipe.runtime", "megatron_terapipe.megatron",
                                    "megatron_terapipe.planner"))}
        assert not outside, f"{path} imports {outside}"


def test_the_planner_is_numpy_only():
    for path, modules in imported_modules("planner").items():
        outside = {m for m in modules if m.split(".")[0] in ("torch", "megatron")
                   or m.startswith(("megatron_terapipe.runtime", "megatron_terapipe.megatron"))}
        assert not outside, f"{path} imports {outside}"


def test_no_import_circles():
    graph = {}
    for folder in ("", "schedule", "planner", "runtime", "megatron"):
        for path, modules in imported_modules(folder).items():
            name = "megatron_terapipe." + path[:-len(".py")].replace("/", ".")
            graph[name.removesuffix(".__init__")] = modules
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, "import circle: " + " -> ".join(path + [module])
        if module in done or module not in graph:
            return
        for imported in graph[module]:
            visit(imported, path + [module])
        done.add(module)

    for module in graph:
        visit(module, [])


def test_files_and_functions_stay_small():
    """The brief's shape: files under 400 lines and functions under 60, everywhere we ship code."""
    root = os.path.dirname(PACKAGE)
    too_long = []
    for folder in ("megatron_terapipe", "examples", "benchmarks", "tests"):
        for dirpath, _, names in os.walk(os.path.join(root, folder)):
            for name in (n for n in names if n.endswith(".py")):
                path = os.path.join(dirpath, name)
                source = open(path).read()
                where = os.path.relpath(path, root)
                if source.count("\n") >= 400:
                    too_long.append(f"{where}: {source.count(chr(10))} lines")
                for node in ast.walk(ast.parse(source)):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        lines = node.end_lineno - node.lineno + 1
                        if lines > 60:
                            too_long.append(f"{where}: {node.name} is {lines} lines")
    assert not too_long, "\n".join(too_long)
