"""Reading a model's config and tokenizer without transformers.generation, where transformers imports it on the
way: transformers before 5.21 import GenerationMixin at the top of the auto classes' auto_factory, which a config
class's docstring (through modeling_auto) and AutoTokenizer's module reach; 5.17 to 5.20 import torch._dynamo,
sympy, scipy, pandas and sklearn with it, seconds of a new process's start. Neither needs GenerationMixin.
(A config module may import heavy modules of its own: Llama's imports sympy through torch.distributed.tensor on
every version.)
"""
import functools
import sys
from contextlib import contextmanager

from packaging.version import Version

AUTO_FACTORY, MODELING_AUTO = "transformers.models.auto.auto_factory", "transformers.models.auto.modeling_auto"


@functools.cache
def auto_factory_imports_generation() -> bool:
    """Whether this transformers' auto_factory imports GenerationMixin at its top (before 5.21)."""
    import transformers
    return Version(transformers.__version__).release < (5, 21)


@contextmanager
def without_generation():
    """Within it, transformers.generation's GenerationMixin is a stand-in for the modules imported, where
    auto_factory would import the real one and is not imported yet. An auto_factory that took the stand-in is
    forgotten on leaving, with the modeling_auto built on it, so that whatever imports them later gets them whole;
    AutoTokenizer's module keeps only auto_factory's _LazyAutoMapping, which does not use it. Not thread-safe:
    another thread importing a model's module meanwhile would build its class on the stand-in (the engine reads
    its config and tokenizer in the caller's thread)."""
    import transformers.generation as generation
    if not auto_factory_imports_generation() or AUTO_FACTORY in sys.modules or "GenerationMixin" in vars(generation):
        yield
        return
    stand_in = type("GenerationMixin", (), {})
    generation.GenerationMixin = stand_in
    try:
        yield
    finally:
        del generation.GenerationMixin
        if getattr(sys.modules.get(AUTO_FACTORY), "GenerationMixin", None) is stand_in:
            forget_modules(AUTO_FACTORY, MODELING_AUTO)


def import_config_class(values: dict):
    """Import the module of the config class of config.json's model type (`values`), where transformers has one
    (a model type it does not know is left to AutoConfig, remote code included)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    model_type = values.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        CONFIG_MAPPING[model_type]  # noqa: B018  (imports the class's module)


def forget_modules(*names: str):
    """Remove the modules from sys.modules and from their package, so that their next import runs them again."""
    for name in names:
        package, _, attribute = name.rpartition(".")
        sys.modules.pop(name, None)
        vars(sys.modules[package]).pop(attribute, None)
