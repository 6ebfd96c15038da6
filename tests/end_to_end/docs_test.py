"""Runs the code of README.md and of the guides in docs/ exactly as written.

Every ``python`` block is marked ``<!-- test: name -->`` and runs in a fresh process (a block
that defines a ``tf.test`` suite runs as a test file); every shell command of tfpar's scripts
is checked for flags that the script defines.
"""

import glob
import os
import re
import subprocess
import sys

import quoted_output
import tensorflow as tf
from absl.testing import parameterized

import tfpar
from tfpar import strategies
from tfpar.cli import common
from tfpar.cli import flag_reference
from tfpar.errors import SIGNALLED
from tfpar.errors import ExitStatus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "**",
                                                                         "*.md"),
                                                            recursive=True))]
MARKED = re.compile(r"<!-- test: (\w+) -->\n```python\n(.*?)```", re.DOTALL)
# A marked diff runs as its "after" side (its context and added lines).
MARKED_DIFF = re.compile(r"<!-- test: (\w+) -->\n```diff\n(.*?)```", re.DOTALL)
# The pages a user reads: the changelog keeps its history as it was.
USER_PAGES = [page for page in PAGES if os.path.basename(page) != "changelog.md"]
SCRIPTS = {script: module for script, module in flag_reference.PROGRAMS.items()
           if not script.startswith("tfpar-")}


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def marked_blocks() -> dict[str, str]:
    """Every marked python block of the pages, by name."""
    blocks = {}
    for page in PAGES:
        found = MARKED.findall(read(page)) + [
            (name, "".join(line[1:] + "\n" for line in diff.splitlines()
                           if line[:1] in (" ", "+")))
            for name, diff in MARKED_DIFF.findall(read(page))]
        for name, code in found:
            assert name not in blocks, f"two blocks are marked {name}"
            blocks[name] = code
    return blocks


def block(name: str) -> str:
    return marked_blocks()[name]


def run_python(code: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})


class DocsTest(tf.test.TestCase, parameterized.TestCase):

    def test_every_python_block_is_marked_and_so_run(self):
        for page in PAGES:
            text = read(page)
            self.assertEqual(text.count("```python"), len(MARKED.findall(text)),
                             f"{page} has a python block without <!-- test: name -->")

    def test_user_code_under_every_single_process_strategy(self):
        code = block("user_code")
        self.assertIn('"mirrored", devices=2', code)
        # One process runs the block once per strategy (one-device entries on one device).
        runs = []
        for name, entry in ((n, strategies.entry(n)) for n in strategies.available()):
            if entry.multi_process:
                continue
            devices = 1 if entry.max_devices == 1 else 2
            runs.append(code.replace('"mirrored", devices=2', f'"{name}", devices={devices}')
                        .replace("epochs=2", "epochs=1"))
        result = run_python("\n".join(runs), self.get_temp_dir())
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertLen(re.findall(r"'accuracy': ", result.stdout), len(runs))

    def run_test_block(self, name: str) -> str:
        """Runs the guide's test module ``name`` as a user would; returns what it printed."""
        path = os.path.join(self.get_temp_dir(), f"{name}_test.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(block(name))
        result = subprocess.run([sys.executable, path], capture_output=True, text=True,
                                timeout=300)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        return result.stderr

    def test_testing_example(self):
        self.assertRegex(self.run_test_block("testing_example"), r"OK \(skipped=\d+\)")

    def test_generated_models_example(self):
        self.assertRegex(self.run_test_block("generated_models_example"),
                         r"\[       OK \] MyLayersTest\.test_my_layers_under_allreduce")

    @parameterized.parameters("allreduce_options", "epoch_checkpoint", "own_steps",
                              "tutorial_one_device", "tutorial_two_devices")
    def test_guide_block(self, name):
        result = run_python(block(name), self.get_temp_dir())
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])

    def test_keras_distribution_blocks_train_on_every_device_with_the_options_named(self):
        result = run_python(block("keras_distribution_example"), self.get_temp_dir())
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertEqual(result.stdout.split()[-1], "2")
        result = run_python(block("keras_distribution_options"), self.get_temp_dir())
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("'virtual_replicas': 4", result.stdout)
        # The data-parallel section of keras.io's distribution guide, tfpar's lines added.
        result = run_python(block("keras_io_guide_data_parallel"), self.get_temp_dir())
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertEqual(result.stdout.split("\n")[:2], ["['cpu:0', 'cpu:1']", "2"])

    @classmethod
    def defined_flags(cls) -> dict[str, set[str]]:
        """Each script's flags, as its program defines them."""
        if not hasattr(cls, "_defined"):
            cls._defined = {}
            for script, module in SCRIPTS.items():
                listing = subprocess.run(
                    [sys.executable, "-c", f"import {module}; from absl import flags; "
                     "print(' '.join(flags.FLAGS))"], capture_output=True, text=True,
                    timeout=60)
                cls._defined[script] = set(listing.stdout.split())
        return cls._defined

    def test_shell_commands_use_flags_their_script_defines(self):
        commands = []
        program = r"(?:tfpar-|scripts/)(train|benchmark|launch)(?:\.py)?"
        for page in PAGES:
            text = read(page)
            for shell in re.findall(r"```(?:sh|console)?\n(.*?)```", text, re.DOTALL):
                joined = shell.replace("\\\n", " ")
                commands += re.findall(rf"{program}( [^\n]*|$)", joined, re.M)
            # Commands written inline in the prose, in backticks, over line breaks too.
            prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
            for span in re.findall(rf"`([^`]*{program}[^`]*)`", prose):
                commands += re.findall(rf"{program}([^`]*)", span[0].replace("\n", " "))
        self.assertGreater(len(commands), 5)
        defined = self.defined_flags()
        # The quickstart's table of the train command's flags.
        for row in re.findall(r"^\| (`--.*?) \|", read(os.path.join(ROOT, "docs", "guide",
                                                                   "quickstart.md")), re.M):
            commands.append(("train", row.replace("`", " ")))
        for script, arguments in commands:
            arguments = arguments.split(" -- ")[0]  # The launcher's command is checked alone.
            for flag in re.findall(r"--(\w+)", arguments):
                known = flag in defined[script] or (flag.startswith("no")
                                                    and flag[2:] in defined[script])
                self.assertTrue(known, f"tfpar-{script} has no --{flag}")

    def test_no_user_facing_text_names_a_checkouts_scripts(self):
        # pip users have tfpar-train, tfpar-launch, tfpar-benchmark and tfpar-env, not a
        # checkout's scripts/: no page, program help, message or docstring of the package
        # names them (the changelog keeps its history).
        found = [f"{os.path.relpath(page, ROOT)}: {line.strip()}" for page in USER_PAGES
                 for line in read(page).splitlines() if "scripts/" in line]
        for source in glob.glob(os.path.join(ROOT, "tfpar", "**", "*.py"), recursive=True):
            found += [f"{os.path.relpath(source, ROOT)}: {line.strip()}"
                      for line in read(source).splitlines() if "scripts/" in line]
        for program in ("train", "launch", "benchmark", "env"):
            result = subprocess.run([sys.executable, "-c", f"from tfpar.cli import {program}; "
                                     f"{program}.run()", "--help"], capture_output=True,
                                    text=True, timeout=120)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertIn("--", result.stdout)
            found += [f"tfpar-{program} --help: {line.strip()}"
                      for line in result.stdout.splitlines() if "scripts/" in line]
        self.assertEqual(found, [])

    def test_install_lines_work_without_a_checkout_or_say_they_need_one(self):
        # Every pip install line of the pages and the Kubernetes image: one that installs this
        # directory (-e, ".", ".[extra]") says it is for a checkout; none names tfpar from a
        # package index (none serves it yet); a wheel is the version built.
        wheel = f"tfpar-{tfpar.__version__}-py3-none-any.whl"
        needs_checkout = re.compile(r'(?:^|\s)(?:-e\s|"?\.(?:\[[\w,]+\])?"?(?:\s|$))')
        from_index = re.compile(r'(?:^|\s)"?tfpar(?:\[[\w,]+\])?(?:[=<>~!]=?[\w.${}]+)?"?'
                                r'(?:\s|$)')
        problems, lines = [], 0
        for page in [*USER_PAGES, os.path.join(ROOT, "examples", "kubernetes", "Dockerfile"),
                     *glob.glob(os.path.join(ROOT, "examples", "**", "*.py"), recursive=True)]:
            paragraphs = re.split(r"\n\s*\n", read(page))
            for k, paragraph in enumerate(paragraphs):
                # The paragraph, or the one before it (a code block's lead-in), says so.
                context = (paragraphs[k - 1] if k else "") + paragraph
                for line in re.findall(r"pip install ([^\n`]*)", paragraph):
                    lines += 1
                    where = f"{os.path.relpath(page, ROOT)}: pip install {line}"
                    if needs_checkout.search(line) and "checkout" not in context:
                        problems.append(f"{where} (needs a checkout, and does not say so)")
                    if from_index.search(line):
                        problems.append(f"{where} (no package index serves tfpar)")
                    for named in re.findall(r"tfpar-[\w.]+-py3-none-any\.whl", line):
                        if named != wheel and "$" not in line:
                            problems.append(f"{where} (the wheel built is {wheel})")
        self.assertGreater(lines, 10)
        self.assertEqual(problems, [])

    def test_guides_name_no_test_of_tfpars_own(self):
        # What tfpar's own tests run belongs in DEVELOPERS.md; the guides and the reference say
        # what holds, not which test file or marker shows it.
        found = []
        for page in glob.glob(os.path.join(ROOT, "docs", "guide", "*.md")) + glob.glob(
                os.path.join(ROOT, "docs", "reference", "*.md")):
            for line in read(page).splitlines():
                if re.search(r"\btests/|pytest -m|_test\.py", line):
                    found.append(f"{os.path.relpath(page, ROOT)}: {line.strip()}")
        self.assertEqual(found, [])

    def test_the_errors_page_lists_every_status_the_code_defines(self):
        page = read(os.path.join(ROOT, "docs", "reference", "errors.md"))
        listed = re.findall(r"^\| (\d+(?: \+ N)?) \|", page, re.M)
        expected = [str(int(status)) for status in ExitStatus] + [f"{SIGNALLED} + N"]
        self.assertEqual(listed, expected)
        # And every status the programs exit with is one of those (no bare numbers).
        for source in glob.glob(os.path.join(ROOT, "tfpar", "**", "*.py"), recursive=True):
            for status in re.findall(r"(?:sys\.exit\(|os\._exit\(|exit_status\s*=\s*)(\d+)\b",
                                     read(source)):
                self.assertIn(int(status), [int(s) for s in ExitStatus],
                              f"{os.path.relpath(source, ROOT)} exits with {status}")

    def test_every_install_command_keeps_the_tests_runnable(self):
        # An install offered "instead" of the README's must still install what the README's
        # test command needs.
        installs = [(page, extras) for page in PAGES
                    for extras in re.findall(r'pip install -e "\.\[([\w,]+)\]"', read(page))]
        self.assertNotEmpty(installs)
        for page, extras in installs:
            if "cuda" in extras.split(","):
                self.assertIn("test", extras.split(","), f"{page}: .[{extras}]")

    def test_flags_named_in_the_prose_exist(self):
        # Any `--flag` in the prose names a flag of one of tfpar's programs, or of the few
        # other tools the pages run.
        examples = set()
        for example in glob.glob(os.path.join(ROOT, "examples", "**", "*.py"), recursive=True):
            examples |= set(re.findall(r"flags\.DEFINE_\w+\(\s*\"(\w+)\"", read(example)))
        # The peers benchmark's own options (benchmarks/peers/compare.py).
        peers = set(re.findall(r"add_argument\(\"--(\w+)\"",
                               read(os.path.join(ROOT, "benchmarks", "peers", "compare.py"))))
        self.assertIn("onednn", peers)
        known = set().union(*self.defined_flags().values()) | examples | peers | {
            "json", "show_tensorflow_log", "help", "helpfull",  # tfpar-env, absl
            "requeue", "gpus_per_task", "signal", "cpus_per_task", "resv_ports", "gres",  # srun
            "no_deps",  # pip
            "shm_size",  # docker run
            "nnodes",  # torchrun
            "tfpar_devices",  # tfpar's pytest plugin
            "strict"}  # mkdocs build
        unknown = []
        for page in PAGES:
            prose = re.sub(r"```.*?```", "", read(page), flags=re.DOTALL)
            for flag in re.findall(r"`[^`]*?--([a-z][\w-]*)", prose):
                name = flag.replace("-", "_")
                if name not in known and not (name.startswith("no") and name[2:] in known):
                    unknown.append(f"{os.path.relpath(page, ROOT)}: --{flag}")
        self.assertEqual(unknown, [])

    def test_registry_tables_list_exactly_the_options_each_entry_takes(self):
        # The last column of the registry tables names every option the entry's factory
        # takes and no other ("none" for an entry without options); every built-in entry has
        # a row, so a new option or entry cannot leave the tables behind.
        for page in (os.path.join(ROOT, "README.md"),
                     os.path.join(ROOT, "docs", "guide", "strategies.md")):
            rows = {name: options for name, options in
                    re.findall(r"^\| `(\w+)` \| .* \| (none|`.*`.*) \|$", read(page), re.M)
                    if name in strategies.available()}
            self.assertEqual(sorted(rows), sorted(strategies.available()), page)
            for name, options in rows.items():
                # The option names lead the column; values stand inside parentheses.
                named = re.findall(r"`(\w+)`", re.sub(r"\(.*?\)", "", options))
                self.assertEqual(sorted(named), sorted(strategies.entry(name).options()),
                                 f"{os.path.relpath(page, ROOT)}: {name}")

    def test_the_strategy_listing_names_each_entrys_flags(self):
        listing = common.strategy_listing({"algorithm": "allreduce"}).splitlines()
        self.assertEqual(len(listing), len(strategies.available()))
        for line in listing:
            name, _, rest = line.partition(": ")
            flags = [f"--{'allreduce' if option == 'algorithm' else option}"
                     for option in strategies.entry(name).options()]
            self.assertTrue(rest.endswith(f"(flags: {', '.join(flags) or 'none'})"), line)
        self.assertIn("multi_worker_allreduce: ", "\n".join(listing))
        self.assertNotIn("--allreduce", next(line for line in listing
                                             if line.startswith("multi_worker_allreduce:")))

    def test_quoted_resume_lines_are_what_a_run_prints(self):
        from tfpar.training import run

        quoted = [(os.path.relpath(page, ROOT), line.split("] ", 1)[-1])
                  for page in USER_PAGES
                  for code in re.findall(r"```\w*\n(.*?)```", read(page), re.DOTALL)
                  for line in code.splitlines() if "Resuming from" in line]
        self.assertNotEqual(quoted, [])
        for page, line in quoted:
            found = re.fullmatch(r"Resuming from (\S+) \((the end of epoch \d+|epoch \d+ step "
                                 r"\d+)\)", line)
            self.assertIsNotNone(found, f"{page}: {line}")
            self.assertEqual(run.resuming_line(*found.groups()), line)

    def test_every_marked_output_block_is_held_to_a_run_by_a_test(self):
        # A block marked <!-- output: name --> is the command a test runs and the lines it
        # prints (tests/quoted_output.py): the test names the block.
        blocks = quoted_output.blocks()
        self.assertContainsSubset({"restart_after_a_kill", "world_size_invariance",
                                   "elastic_grow_back"}, blocks)
        sources = "".join(read(path) for path in glob.glob(os.path.join(ROOT, "tests", "**",
                                                                        "*_test.py"),
                                                           recursive=True))
        for name in blocks:
            self.assertIn(f'"{name}"', sources, f"no test runs the output block {name}")

    def test_lenets_gradient_size_on_the_benchmarks_page_is_its_parameters(self):
        with tf.device("CPU:0"):
            parameters = tfpar.models.lenet().count_params()
        text = read(os.path.join(ROOT, "docs", "benchmarks.md"))
        quoted = re.findall(r"LeNet's (\d+) KB of gradients \(([\d,]+) float32\)", text)
        self.assertEqual(quoted, [(str(round(parameters * 4 / 1000)), f"{parameters:,}")])
        for megabytes in re.findall(r"LeNet's (?:\(?)([\d.]+) MB", text):
            self.assertAlmostEqual(float(megabytes), parameters * 4 / 1e6,
                                   delta=0.05 if len(megabytes) <= 3 else 0.005)

    def test_repository_paths_the_pages_name_exist(self):
        missing = []
        for page in USER_PAGES:
            for path in set(re.findall(r"`((?:tfpar|tests|examples|benchmarks|scripts|docs|\.ci)"
                                       r"/[\w/.*-]+)`", read(page))):
                if not glob.glob(os.path.join(ROOT, path.rstrip("/"))):
                    missing.append(f"{os.path.relpath(page, ROOT)}: {path}")
        self.assertEqual(missing, [])

    def test_guides_hold_no_measurement_or_development_story(self):
        # Figures belong on the benchmarks page (per machine kind, with their command); the
        # guides say what to do and why. Example output in code blocks is not prose.
        story = re.compile(
            r"\b[Mm]easured (on|with|through|in|at|again)\b|\b\d+(\.\d+)?x\b|"
            r"\b\d+(\.\d+)? ?ms\b|\b\d[\d,.]* images/s\b|\bseeds? \d|\bfirst trace\b|"
            r"\b\d+ runs? in \d+\b|development machine|\bthe seeds\b")
        guides = [p for p in PAGES if os.sep + "docs" + os.sep in p
                  and os.path.basename(p) not in ("benchmarks.md", "changelog.md")]
        self.assertGreater(len(guides), 10)
        found = []
        for page in guides + [os.path.join(ROOT, "README.md")]:
            prose = re.sub(r"```.*?```", "", read(page), flags=re.DOTALL)
            found += [f"{os.path.relpath(page, ROOT)}: {m.group(0)!r}"
                      for m in story.finditer(prose)]
        self.assertEqual(found, [])

    def test_no_page_carries_lab_notes(self):
        # How a figure came about goes in commit messages and the changelog; the pages say what
        # is true and how to reproduce it.
        notes = re.compile(r"\bswung\b|\btook about \d+ (minutes|seconds|hours)\b|"
                           r"\brecent run\b|\bA test (kills|sends|runs)\b|^#+ What was run|"
                           r"\bseeds' means\b|\b(?:this|last) sess(?:ion)\b", re.M)
        found = [f"{os.path.relpath(page, ROOT)}: {m.group(0)!r}"
                 for page in PAGES if not page.endswith("changelog.md")
                 for m in notes.finditer(read(page))]
        self.assertEqual(found, [])

    def test_nav_titles_are_the_page_headings(self):
        import yaml

        with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
            nav = yaml.safe_load(f)["nav"]

        def pages(items):
            for item in items:
                for title, value in item.items():
                    yield from pages(value) if isinstance(value, list) else [(title, value)]

        differ = []
        for title, page in pages(nav):
            if page in ("index.md", "changelog.md"):
                continue
            heading = re.search(r"^# (.+)$", read(os.path.join(ROOT, "docs", page)), re.M)
            if heading is None or heading.group(1) != title:
                differ.append(f"{page}: {title!r} vs {heading and heading.group(1)!r}")
        self.assertEqual(differ, [])

    def test_every_results_table_is_rendered_from_its_results_files(self):
        # The tables of benchmark results the pages quote are generated from the files the
        # benchmarks wrote (benchmarks/results/): a figure changed by hand, or a results file
        # added without regenerating, fails here.
        result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "page.py"),
                                 "--check"], capture_output=True, text=True, timeout=120,
                                cwd=ROOT)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        page = read(os.path.join(ROOT, "docs", "benchmarks.md"))
        kinds = set(re.findall(r"<!-- results: (\w+) -->", page))
        self.assertEqual({kind for kind in kinds if not kind.startswith("history_")},
                         {"saving", "keras_distribution", "world_size_invariance", "processes"})
        # Every history file fills a block, and every block's file exists.
        self.assertEqual({kind for kind in kinds if kind.startswith("history_")},
                         {os.path.basename(path)[:-len(".json")] for path in glob.glob(
                             os.path.join(ROOT, "benchmarks", "results", "history_*.json"))})

    def test_no_figure_on_the_benchmarks_page_is_outside_a_results_block(self):
        # --check above also fails on one; here what counts as a figure.
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        try:
            import page as results_page
        finally:
            sys.path.pop(0)
        self.assertEqual(results_page.figures_outside_results(
            "## 2 vCPUs\n\nRuns `--steps=20` on 2 devices.\n<!-- results: saving -->\n1.5 ms\n"
            "<!-- /results -->\n"), [])
        self.assertEqual(results_page.figures_outside_results(
            "It took 1.5 ms, 3x faster, 7% of a step; 0.91 of it.\n"),
            ["'1.5 ms' in: It took 1.5 ms, 3x faster, 7% of a step; 0.91 of it.",
             "'3x' in: It took 1.5 ms, 3x faster, 7% of a step; 0.91 of it.",
             "'7%' in: It took 1.5 ms, 3x faster, 7% of a step; 0.91 of it.",
             "'0.91' in: It took 1.5 ms, 3x faster, 7% of a step; 0.91 of it."])

    def test_the_flag_reference_is_what_the_programs_define(self):
        # Generated from the flags, which come from the config classes: a flag added, renamed
        # or given another default or help changes the page (regenerate it as it says).
        result = subprocess.run([sys.executable, "-m", "tfpar.cli.flag_reference"],
                                capture_output=True, text=True, timeout=300, cwd=ROOT)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        self.assertEqual(read(os.path.join(ROOT, "docs", "flags.md")), result.stdout,
                         "docs/flags.md is stale: python -m tfpar.cli.flag_reference > "
                         "docs/flags.md")
        # Docstrings' markup (roles, double backquotes, literal-block colons) is not for users.
        self.assertNotRegex(result.stdout, r":[a-z]+:`|``|\w::")

    def test_help_is_plain_text(self):
        for script in SCRIPTS:
            result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts",
                                                                  f"{script}.py"), "--help"],
                                    capture_output=True, text=True, timeout=120, cwd=ROOT)
            self.assertEqual(result.returncode, 0, result.stderr[-2000:])
            self.assertIn("--", result.stdout)
            self.assertNotRegex(result.stdout, r":[a-z]+:`|``|\w::", script)


if __name__ == "__main__":
    tf.test.main()
