"""Imports go one way: plan <- schedule (data) <- planner (numpy) and runtime (torch only) <-
megatron (the glue: platform <- support <- model <- hooks <- measure <- args <- launch). Each folder's `__init__`
docstring names, on its `May import:` line, the folders its modules may import from; this file
holds every folder to its line.

Every import counts, function-level ones included."""

from __future__ import annotations

import ast
import os
import re

from harness.paths import PACKAGE, TESTS


def folders() -> list[str]:
    """Every package folder, relative to the package ('' is the package itself)."""
    out = []
    for dirpath, _, names in os.walk(PACKAGE):
        if "__init__.py" in names and "__pycache__" not in dirpath:
            out.append(os.path.relpath(dirpath, PACKAGE).replace(os.sep, "/").strip("."))
    return sorted(out)


def imported_modules(folder: str) -> dict[str, set[str]]:
    """Absolute names of the modules each file directly in `folder` imports (relative ones
    resolved; `from . import x` counts as importing the module x too)."""
    out = {}
    parts = folder.split("/") if folder else []
    for name in sorted(os.listdir(os.path.join(PACKAGE, folder))):
        if not name.endswith(".py"):
            continue
        package = ["megatron_terapipe"] + parts
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


def allowed_imports(folder: str) -> list[str]:
    """The folders (dotted, under megatron_terapipe) that `folder`'s `May import:` line names."""
    doc = ast.get_docstring(ast.parse(open(os.path.join(PACKAGE, folder, "__init__.py")).read()))
    match = re.search(r"^May import: (.+)$", doc or "", re.M)
    assert match, f"megatron_terapipe/{folder}/__init__.py: no 'May import:' line in its docstring"
    return [name.strip() for name in match.group(1).split(",")]


def test_every_folder_imports_only_what_its_docstring_allows():
    wrong = []
    for folder in folders():
        if not folder:
            continue  # the package itself: the public API, it may import everything
        allowed = allowed_imports(folder)
        for path, modules in imported_modules(folder).items():
            for module in modules:
                if not module.startswith("megatron_terapipe."):
                    continue
                inner = module.removeprefix("megatron_terapipe.")
                if not any(inner == a or inner.startswith(a + ".") for a in allowed):
                    wrong.append(f"{path} imports {module} (May import: {', '.join(allowed)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_directions_hold():
    """The rule lines themselves go one way: the data folders name nothing downstream."""
    assert allowed_imports("schedule") == ["plan", "schedule"]
    assert "megatron" not in " ".join(allowed_imports("runtime") + allowed_imports("planner"))
    assert "megatron.args" not in allowed_imports("megatron/hooks")
    assert "megatron.measure" not in allowed_imports("megatron/hooks")
    assert "megatron.args" not in allowed_imports("megatron/measure")
    assert allowed_imports("plan") == ["plan"]
    # platform/ is the glue's lowest floor; support/ (the rules) sits right above it
    assert allowed_imports("megatron/platform") == ["megatron.platform"]
    assert not {"megatron.model", "megatron.hooks", "megatron.measure", "megatron.args"} & set(
        allowed_imports("megatron/support"))
    assert not {"megatron.hooks", "megatron.measure", "megatron.args"} & set(
        allowed_imports("megatron/model"))
    for sub in ("runtime/wgrad", "runtime/graphs", "planner/evaluate"):
        parent = sub.split("/")[0]
        assert all(a.split(".")[0] in ("plan", "schedule", parent) for a in allowed_imports(sub))


def _third_party(folder_prefix: str) -> dict[str, set[str]]:
    return {path: modules for folder in folders() if folder == folder_prefix
            or folder.startswith(folder_prefix + "/") for path, modules in imported_modules(folder).items()}


def test_runtime_is_torch_only():
    for path, modules in _third_party("runtime").items():
        megatron = {m for m in modules
                    if m.split(".")[0] == "megatron" or m.startswith("megatron_terapipe.megatron")}
        assert not megatron, f"{path} imports {megatron}"


def test_the_schedule_is_data():
    for path, modules in _third_party("schedule").items():
        outside = {m for m in modules if m.split(".")[0] in ("torch", "megatron", "numpy")
                   or m.startswith(("megatron_terapipe.runtime", "megatron_terapipe.megatron",
                                    "megatron_terapipe.planner"))}
        assert not outside, f"{path} imports {outside}"


def test_the_planner_is_numpy_only():
    for path, modules in _third_party("planner").items():
        outside = {m for m in modules if m.split(".")[0] in ("torch", "megatron")
                   or m.startswith(("megatron_terapipe.runtime", "megatron_terapipe.megatron"))}
        assert not outside, f"{path} imports {outside}"


def test_no_import_circles():
    graph = {}
    for folder in folders():
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


def modules_in(folder: str, top: str = PACKAGE) -> list[str]:
    """The modules directly in `folder` of `top` (no __init__ or __main__), without .py."""
    return sorted(name[:-3] for name in os.listdir(os.path.join(top, folder))
                  if name.endswith(".py") and name not in ("__init__.py", "__main__.py"))


def harness_folders() -> list[str]:
    """The test harness's package folders, relative to tests/."""
    return sorted(os.path.relpath(dirpath, TESTS) for dirpath, _, names
                  in os.walk(os.path.join(TESTS, "harness"))
                  if "__init__.py" in names and "__pycache__" not in dirpath)


def test_at_most_ten_modules_side_by_side():
    crowded = {folder or ".": len(modules_in(folder)) for folder in folders()
               if len(modules_in(folder)) > 10}
    crowded |= {folder: len(modules_in(folder, TESTS)) for folder in harness_folders()
                if len(modules_in(folder, TESTS)) > 10}
    assert len(harness_folders()) >= 4  # harness/ and its runs/, measured/, inputs/
    assert not crowded, f"folders with more than 10 modules: {crowded}"


def _stem(name: str) -> str:
    """The name without an inflection on its last word (rules -> rule, lowered -> lower)."""
    return re.sub(r"(ing|ed|s)$", "", name)


def names_differing_by_a_suffix(names: list[str]) -> list[tuple[str, str]]:
    """Pairs where one name is the other's stem plus a suffix: lower / lowered, rules /
    rule_views, time_fit / time_fitting, compat / compat_check."""
    return sorted({tuple(sorted((a, b))) for a in names for b in names
                   if a != b and (b.startswith(a) or _stem(a) == _stem(b)
                                  or b.startswith(_stem(a) + "_"))})


def test_no_two_names_in_a_folder_differ_only_by_a_suffix():
    assert names_differing_by_a_suffix(["lower", "lowered", "routes"]) == [("lower", "lowered")]
    assert names_differing_by_a_suffix(["rules", "rule_views"]) == [("rule_views", "rules")]
    assert names_differing_by_a_suffix(["time_fit", "time_fitting"]) == [("time_fit",
                                                                          "time_fitting")]
    assert names_differing_by_a_suffix(["search", "edge_search", "slicer"]) == []
    pairs = {folder or ".": names_differing_by_a_suffix(modules_in(folder)) for folder in folders()}
    pairs |= {folder: names_differing_by_a_suffix(modules_in(folder, TESTS))
              for folder in harness_folders()}
    assert not {f: p for f, p in pairs.items() if p}, pairs

