"""The package's shape, read from its source: no import cycle, no import that runs back up the package's floors,
no module past 300 lines, a Config that is a plain record, and the process boundaries the architecture promises
(docs/architecture.md)."""
import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "nanovllm"
MAX_LINES = 300


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
# The package's floors, top to bottom: a module imports from its own floor and those below it, never above.
FLOORS = ["nanovllm.engine", "nanovllm.models", "nanovllm.layers", "nanovllm.kernels", "nanovllm.utils"]


def imported_modules(path: pathlib.Path) -> set[str]:
    """The package's modules that `path` imports, anywhere in it (a function's lazy import too), except under
    `if TYPE_CHECKING:`."""
    tree, names = ast.parse(path.read_text()), set()
    type_checking = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                     and getattr(block.test, "id", None) == "TYPE_CHECKING" for node in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name in MODULES} - {module_name(path)}


def test_no_import_cycle():
    graph = {name: imported_modules(path) for name, path in MODULES.items()}
    done, on_path = set(), []

    def visit(name):
        if name in on_path:
            raise AssertionError(f"import cycle: {' -> '.join(on_path[on_path.index(name):] + [name])}")
        if name not in done:
            on_path.append(name)
            for imported in sorted(graph[name]):
                visit(imported)
            on_path.pop()
            done.add(name)

    for name in sorted(graph):
        visit(name)


def floor(module: str) -> int | None:
    return next((i for i, prefix in enumerate(FLOORS) if module == prefix or module.startswith(prefix + ".")), None)


def test_no_import_runs_back_up():
    """engine -> models -> layers -> kernels -> utils: the layers import nothing of the engine or the model, the
    kernels nothing of the layers."""
    upward = [f"{name} -> {imported}" for name, path in MODULES.items() if floor(name) is not None
              for imported in sorted(imported_modules(path))
              if floor(imported) is not None and floor(imported) < floor(name)]
    assert not upward, upward


def test_config_is_a_plain_record():
    """Config imports nothing of the package (the model registry above all) and nothing that finds, downloads or
    reads a model: the code that builds the engine's Config does."""
    tree = ast.parse(MODULES["nanovllm.config"].read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] in ("nanovllm", "huggingface_hub", "os")}, imported


def test_no_module_passes_300_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def imports_in_a_fresh_process(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_ranks_process_loads_nothing_of_the_scheduler_or_the_output_side():
    imports_in_a_fresh_process(
        "import sys; import nanovllm.engine.worker\n"
        "engine_side = ['nanovllm.engine.' + m for m in ('scheduler', 'block_manager', 'sequence', 'llm_engine',\n"
        "               'input_processor', 'output_processor', 'input_builder')] + ['xxhash']\n"
        "assert not [m for m in engine_side if m in sys.modules], [m for m in engine_side if m in sys.modules]\n")


def test_the_scheduler_and_sampling_params_need_no_torch():
    imports_in_a_fresh_process("import sys; sys.modules['torch'] = None\nimport nanovllm.engine.scheduler\n"
                               "from nanovllm import SamplingParams\n")
