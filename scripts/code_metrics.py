"""Structure metrics of the project's own packages, from their source alone (``ast``): what the
redesign of the core checkpointer is judged by.  Prints a table and (``--json``) writes it.

  import cycles                 strongly connected groups of modules that import each other
                                (module-level and function-level imports alike)
  private names across modules  ``module._name`` / ``from module import _name`` uses of another
                                project module's leading-underscore names
  core imports of integrations  imports of adacheck_ds / adacheck_megatron from adacheck/
  function-level imports        ``import`` statements inside functions, per package
  longest functions             the ten longest functions and methods (lines)
  largest modules, classes      the fifteen largest of each (lines, blank ones included)
  lines per package             non-blank lines of each package

    .venv/bin/python scripts/code_metrics.py [--json OUT]
"""
from __future__ import annotations

import argparse
import ast
import json
import os
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("adacheck", "adacheck_ds", "adacheck_megatron")


def modules():
    """module name -> (path, parsed tree) for every module of the packages and their subpackages."""
    out = {}
    for pkg in PACKAGES:
        top = os.path.join(ROOT, pkg)
        for folder, dirs, files in os.walk(top):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
            prefix = ".".join([pkg] + os.path.relpath(folder, top).split(os.sep)[1 if folder == top else 0:])
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    mod = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                    with open(path, encoding="utf-8") as f:
                        out[mod] = (path, ast.parse(f.read(), path))
    return out


def _is_package(mod: str) -> bool:
    return os.path.isfile(os.path.join(ROOT, *mod.split("."), "__init__.py"))


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    parent = base if _is_package(mod) else base[:-1]
    parent = parent[: len(parent) - (node.level - 1)]
    return ".".join(parent + ([node.module] if node.module else []))


def imports(mods):
    """module -> set of project modules it imports; and the private names it takes from them."""
    edges, private, aliases_of = defaultdict(set), [], {}
    for mod, (_, tree) in mods.items():
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, node)
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    targets.append((sub, None) if sub in mods else (src, a.name))
            for target, name in targets:
                if target in mods and target != mod:
                    edges[mod].add(target)
                    if name and name.startswith("_") and not name.startswith("__"):
                        private.append(f"{mod}: from {target} import {name}")
        aliases = {}
        for node in ast.walk(tree):      # module aliases: "from . import state as S", "import x.y as z"
            if isinstance(node, ast.ImportFrom):
                src = _resolve(mod, node)
                for a in node.names:
                    if f"{src}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{src}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods and a.asname:
                        aliases[a.asname] = a.name
        aliases_of[mod] = aliases
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                private.append(f"{mod}: {aliases[node.value.id]}.{node.attr}")
    # attributes of other objects (tap._key_of, ac._scaler_state()): private names that another
    # project module defines (a def, a class, a module global or a self._x) and this one does not
    defined = {mod: _private_defs(tree) for mod, (_, tree) in mods.items()}
    for mod, (_, tree) in mods.items():
        others = set().union(*(d for m, d in defined.items() if m != mod)) - defined[mod]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in others and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name)
                             and (node.value.id in ("self", "cls") or node.value.id in aliases_of[mod]))):
                owner = sorted(m for m, d in defined.items() if node.attr in d)
                private.append(f"{mod}: <object>.{node.attr} (defined in {', '.join(owner)})")
    return edges, sorted(set(private))


def _private_defs(tree) -> set:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
            out.add(node.attr)
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(t, ast.Name) and t.id.startswith("_"):
                    out.add(t.id)
    return {n for n in out if not n.startswith("__")}


def cycles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def functions(mods):
    out = []
    for mod, (_, tree) in mods.items():
        def walk(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((child.end_lineno - child.lineno + 1, f"{mod}.{prefix}{child.name}"))
                    walk(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")
        walk(tree, "")
    return sorted(out, reverse=True)


def largest(mods, n=15):
    """The n largest modules and the n largest classes, in lines as the file holds them."""
    files, classes = [], []
    for mod, (path, tree) in mods.items():
        with open(path, encoding="utf-8") as f:
            files.append((sum(1 for _ in f), mod))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{mod}.{node.name}"))
    return sorted(files, reverse=True)[:n], sorted(classes, reverse=True)[:n]


def function_imports(mods):
    per = defaultdict(int)
    for mod, (_, tree) in mods.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                per[mod.split(".")[0]] += sum(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(node)
                                              if n is not node and not isinstance(n, (ast.FunctionDef,)))
    return dict(per)


def lines(mods):
    per = defaultdict(int)
    for mod, (path, _) in mods.items():
        with open(path, encoding="utf-8") as f:
            per[mod.split(".")[0]] += sum(1 for line in f if line.strip())
    return dict(per)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    mods = modules()
    edges, private = imports(mods)
    core_to_integration = sorted(f"{m} -> {t}" for m, ts in edges.items() if m.split(".")[0] == "adacheck"
                                 for t in ts if t.split(".")[0] != "adacheck")
    result = {"import_cycles": cycles(edges), "private_names_across_modules": private,
              "core_imports_of_integrations": core_to_integration,
              "function_level_imports": function_imports(mods),
              "longest_functions": [[n, f] for n, f in functions(mods)[:10]], "lines": lines(mods)}
    big_modules, big_classes = largest(mods)
    result["largest_modules"] = [[n, m] for n, m in big_modules]
    result["largest_classes"] = [[n, c] for n, c in big_classes]
    print(f"import cycles: {len(result['import_cycles'])}")
    for c in result["import_cycles"]:
        print("  " + " <-> ".join(c))
    print(f"private names used across modules: {len(private)}")
    for p in private:
        print("  " + p)
    print(f"core imports of integrations: {len(core_to_integration)}")
    for c in core_to_integration:
        print("  " + c)
    print("function-level imports: " + ", ".join(f"{k} {v}" for k, v in sorted(result["function_level_imports"].items())))
    print("longest functions (lines):")
    for n, f in result["longest_functions"]:
        print(f"  {n:4d}  {f}")
    for title, rows in (("largest modules (lines)", big_modules), ("largest classes (lines)", big_classes)):
        print(title + ":")
        for n, name in rows:
            print(f"  {n:4d}  {name}")
    print("non-blank lines: " + ", ".join(f"{k} {v}" for k, v in sorted(result["lines"].items())))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
