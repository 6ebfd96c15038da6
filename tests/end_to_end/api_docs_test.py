"""The API reference (docs/api.md) against the package: every name a public package exports is
documented, and every ``tfpar.`` name the docs use exists and is public (not private, not a
deprecated alias)."""

import ast
import glob
import importlib
import os
import re

import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PUBLIC_PACKAGES = ("tfpar.strategies", "tfpar.data", "tfpar.models", "tfpar.training",
                   "tfpar.callbacks", "tfpar.testing", "tfpar.benchmark", "tfpar.allreduce")
# Public modules (not packages): every public function and class they define.
PUBLIC_MODULES = ("tfpar.devices", "tfpar.errors", "tfpar.ray", "tfpar.host.thread_layouts",
                  "tfpar.training.evaluation", "tfpar.training.schedules",
                  "tfpar.strategies.mirrored", "tfpar.strategies.central_storage",
                  "tfpar.strategies.one_device", "tfpar.strategies.allreduce",
                  "tfpar.strategies.multi_worker", "tfpar.strategies.multi_worker_options",
                  "tfpar.strategies.cross_device_ops", "tfpar.benchmark.config")
DEPRECATED = ("tfpar.callbacks.preemption", "tfpar.cluster.protocol")


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def documented() -> dict[str, set[str] | None]:
    """Module -> the members docs/api.md lists for it (``None``: all of them)."""
    text = read(os.path.join(ROOT, "docs", "api.md"))
    found: dict[str, set[str] | None] = {}
    for module, options in re.findall(r"^::: ([\w.]+)\n((?:    .*\n)*)", text, re.M):
        members = re.search(r"members: \[(.*?)\]", options, re.S)
        found[module] = set(re.split(r",\s*", members.group(1).strip())) if members else None
    return found


def exports(package: str) -> dict[str, str]:
    """A public package's exported names -> the module that defines each."""
    module = importlib.import_module(package)
    source = read(module.__file__)
    names = {}
    tree = ast.parse(source)
    # Imports inside functions load a module on first use; they export nothing.
    in_functions = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                    for inner in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in in_functions:
            continue
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "install" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Dict):
            for key, value in zip(node.args[1].keys, node.args[1].values):
                names[key.value] = f"{package}.{value.value}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            for alias in node.names:
                names[alias.asname or alias.name] = node.module
    for name in getattr(module, "__all__", ()):
        names.setdefault(name, package)  # Defined in the package's own __init__.
    return {name: where for name, where in names.items()
            if name in getattr(module, "__all__", names) and not name.startswith("_")}


def top_level_names(module_name: str) -> set[str]:
    """The public functions and classes a module's source defines at its top level (read, not
    imported: a module of an optional extra, such as ``tfpar.ray``, imports without it)."""
    with open(importlib.util.find_spec(module_name).origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")}


def defined_in(module_name: str) -> set[str]:
    return top_level_names(module_name)


class ApiDocsTest(tf.test.TestCase):

    def test_every_constant_of_a_referenced_module_has_a_docstring(self):
        # mkdocstrings shows a module constant with the string that follows it; without one
        # the reference lists the name and nothing about it.
        with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
            modules = re.findall(r"^::: ([\w.]+)", f.read(), re.M)
        self.assertGreater(len(modules), 20)
        bare = []
        for module in modules:
            with open(importlib.util.find_spec(module).origin, encoding="utf-8") as f:
                body = ast.parse(f.read()).body
            for node, after in zip(body, body[1:] + [None]):
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [node.target] if isinstance(node, ast.AnnAssign) else [])
                for target in targets:
                    if (isinstance(target, ast.Name) and target.id.isupper()
                            and not target.id.startswith("_")
                            and not (isinstance(after, ast.Expr)
                                     and isinstance(after.value, ast.Constant)
                                     and isinstance(after.value.value, str))):
                        bare.append(f"{module}.{target.id}")
        self.assertEqual(bare, [])

    def test_every_exported_name_is_in_the_reference(self):
        docs = documented()
        missing = []
        wanted = [(where, name) for package in PUBLIC_PACKAGES
                  for name, where in exports(package).items()]
        wanted += [(module, name) for module in PUBLIC_MODULES for name in defined_in(module)]
        self.assertGreater(len(wanted), 80)
        for where, name in wanted:
            if importlib.util.find_spec(where) is None:  # A name re-exported from a module.
                continue
            members = docs.get(where, set())
            if members is not None and name not in members:
                missing.append(f"{where}.{name}")
        self.assertEqual(sorted(missing), [])

    def test_every_member_the_reference_lists_exists(self):
        # mkdocstrings passes over a listed member that its module lacks, silently.
        missing, listed = [], 0
        for module, members in documented().items():
            for member in members or ():
                listed += 1
                if not self.exists(f"{module}.{member}"):
                    missing.append(f"{module}.{member}")
        self.assertGreater(listed, 80)
        self.assertEqual(sorted(missing), [])

    @staticmethod
    def exists(name: str) -> bool:
        """Whether ``name`` (``tfpar.a.b.C.d``) is a module or reaches an attribute of one."""
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # The longest module that exists.
            module = ".".join(parts[:cut])
            try:
                if importlib.util.find_spec(module) is not None:
                    break
            except ImportError:  # Not a module, or under a module that needs an extra.
                continue
        rest = parts[cut:]
        if not rest:
            return True
        try:
            value = importlib.import_module(module)
        except ImportError:  # An optional extra's module: read what it defines instead.
            return rest[0] in top_level_names(module) and len(rest) == 1
        try:
            for part in rest:
                value = getattr(value, part)
        except AttributeError:
            return False
        return True

    def test_the_names_the_docs_use_are_public(self):
        pages = [os.path.join(ROOT, "README.md"),
                 *glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)]
        bad = []
        for page in pages:
            if page.endswith("changelog.md"):
                continue
            for name in set(re.findall(r"\btfpar(?:\.\w+)+", read(page))):
                if any(name == d or name.startswith(d + ".") for d in DEPRECATED) or \
                        any(part.startswith("_") for part in name.split(".")):
                    bad.append(f"{os.path.relpath(page, ROOT)}: {name}")
                    continue
                if not self.exists(name):
                    bad.append(f"{os.path.relpath(page, ROOT)}: {name}")
        self.assertEqual(sorted(bad), [])


if __name__ == "__main__":
    tf.test.main()
