"""Every script under benchmarks/ imports on a CPU, so a name renamed or taken out of nanovllm fails here and
not first on a GPU (the GPU benchmarks run only on the device machine)."""
import importlib
from pathlib import Path

import pytest

BENCHMARKS = sorted(path.stem for path in (Path(__file__).parent.parent / "benchmarks").glob("*.py")
                    if path.stem != "__init__")


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_script_imports(name):
    pytest.importorskip("triton")  # the kernel benchmarks import the kernels' modules
    importlib.import_module(f"benchmarks.{name}")
