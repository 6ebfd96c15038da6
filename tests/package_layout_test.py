"""The package's shape: no module imports another that imports it back, directly or through
others (every import counts: lazy, in functions, for type checkers). import-linter (run by CI)
checks that no module imports from a layer above its own."""

import ast
import configparser
import os
import re
import sys

import tensorflow as tf

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tfpar")
TESTS = os.path.dirname(os.path.abspath(__file__))

# The test files that test across modules, by what they test; every other test file is the
# tests of the module (or package) of its path (tfpar/data/loading.py: data/loading_test.py).
# end_to_end/ and upstream/ test across modules by their folder's purpose (DEVELOPERS.md).
ACROSS_MODULES = {
    "callbacks/crash_states_test.py": "every save's crash states (checkpointing, the "
                                      "BackupAndRestore fix, the worker contract's records)",
    "cluster/cluster_test.py": "multi-worker strategies over a TF_CONFIG cluster (cluster.spec, "
                               "cluster.peers, strategies.multi_worker)",
    "cluster/launcher_notices_test.py": "the launcher's notices to and from workers (launcher, "
                                        "preemption, worker_group)",
    "cluster/multi_worker_exactness_test.py": "multi-worker entries against one process",
    "cluster/multi_worker_invariance_test.py": "virtual_replicas across workers and elastic "
                                               "sizes",
    "cluster/strategy_test.py": "the multi-worker strategies as the registry builds them",
    "compat/gates_test.py": "every workaround's version gate and the class patch helper",
    "models/models_test.py": "the model registry (tfpar.models)",
    "package_layout_test.py": "the package's shape (imports, layers, names)",
}


def _module_paths() -> dict[str, str]:
    """Module name -> its file."""
    modules = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].split(os.sep)
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_imports() -> dict[str, set[str]]:
    """Module name -> the tfpar modules it imports."""
    modules = _module_paths()
    imports = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            found |= {n for n in names if n in modules and n != module}
        imports[module] = found
    return imports


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    sys.setrecursionlimit(10000)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


class PackageLayoutTest(tf.test.TestCase):

    def test_every_test_file_is_of_its_module_or_says_what_it_tests(self):
        stray = []
        for folder, _, files in os.walk(TESTS):
            for name in files:
                if not name.endswith("_test.py"):
                    continue
                relative = os.path.relpath(os.path.join(folder, name), TESTS)
                if relative.split(os.sep)[0] in ("end_to_end", "upstream"):
                    continue
                module = os.path.join(PACKAGE, relative[:-len("_test.py")])
                if not (os.path.exists(module + ".py") or os.path.isdir(module)
                        or relative.replace(os.sep, "/") in ACROSS_MODULES):
                    stray.append(relative)
        self.assertEqual(stray, [], "a test file of no module of its path: rename it after "
                                    "its module, or list it in ACROSS_MODULES")

    def test_no_import_circle(self):
        graph = module_imports()
        self.assertGreater(len(graph), 50)
        # A package's __init__ re-exporting its modules is not a circle of concepts.
        graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in graph.items()}
        self.assertEqual(cycles(graph), [])

    def test_no_word_users_never_learned(self):
        # "The seeds" was the developers' name for the chapters tfpar comes from; docstrings
        # and --help texts are read by users.
        found = []
        for folder, _, files in os.walk(PACKAGE):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(folder, name), encoding="utf-8") as f:
                        if re.search(r"\b[Tt]he seeds\b|\bseeds'", f.read()):
                            found.append(os.path.join(folder, name))
        self.assertEqual(found, [])

    def test_every_file_a_docstring_or_page_names_exists(self):
        # A docstring that points a reader to "the test that fails without it" must point to
        # one that is there.
        root = os.path.dirname(PACKAGE)
        texts = [os.path.join(folder, name) for top in ("tfpar", "docs", "scripts")
                 for folder, _, files in os.walk(os.path.join(root, top)) for name in files
                 if name.endswith((".py", ".md"))]
        texts += [os.path.join(root, name) for name in ("README.md", "DEVELOPERS.md")]
        named = set()
        for path in texts:
            with open(path, encoding="utf-8") as f:
                named |= {(m, path) for m in re.findall(r"\b(?:tests|tfpar|scripts|benchmarks)/"
                                                        r"[a-z0-9_/]+\.py\b", f.read())}
        self.assertGreater(len(named), 10)
        missing = sorted((m, os.path.relpath(p, root)) for m, p in named
                         if not os.path.exists(os.path.join(root, m)))
        self.assertEqual(missing, [])

    def test_the_developers_layer_list_is_the_import_contract(self):
        root = os.path.dirname(PACKAGE)
        parser = configparser.ConfigParser()
        parser.read(os.path.join(root, "setup.cfg"))
        contract = [sorted(m.strip().removeprefix("tfpar.") for m in line.split("|"))
                    for line in parser["importlinter:contract:layers"]["layers"].splitlines()
                    if line.strip() and not line.strip().startswith("#")]
        with open(os.path.join(root, "DEVELOPERS.md"), encoding="utf-8") as f:
            section = f.read().split("## Layers\n", 1)[1].split("\n## ", 1)[0]
        listed = [sorted(re.findall(r"`([\w.]+)`", item.split(" — ", 1)[0]))
                  for item in re.findall(r"^\d+\. (.*)$", section, re.MULTILINE)]
        self.assertGreater(len(contract), 5)
        self.assertEqual(listed, contract)

    def test_imports_by_name_are_only_the_listed_kinds(self):
        # An import by name (importlib.import_module, __import__) is an edge the circle test
        # and import-linter cannot see; each kind left is listed here with why it is harmless.
        allowed = {
            # A package's own submodules on first use (no edge to another module).
            "tfpar.lazy_exports": {"f'{package}.{names[name]}'", "f'{package}.{name}'"},
            "tfpar.models": {"f'{__name__}.{name}'"},
            # The program whose flags are listed, named on its command line.
            "tfpar.cli.flag_reference": {"argv[1]"},
        }
        found: dict[str, set[str]] = {}
        for module, path in _module_paths().items():
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and node.args
                        and ast.unparse(node.func) in ("importlib.import_module", "__import__")):
                    target = ast.unparse(node.args[0])
                    # Keras's and TensorFlow's private modules, behind compat's version gates.
                    if module.startswith("tfpar.compat.") and not target.startswith(
                            ("'tfpar", '"tfpar', "f")):
                        continue
                    found.setdefault(module, set()).add(target)
        self.assertEqual(found, allowed)

    def test_the_cycle_finder_finds_one(self):
        self.assertEqual(cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}),
                         [["a", "b", "c"]])


if __name__ == "__main__":
    tf.test.main()
