"""The engine reads a folder's config and tokenizer as AutoConfig and AutoTokenizer do, without the imports that
transformers 5.17 to 5.20 make on the way (torch._dynamo, sympy, scipy, pandas, sklearn: seconds of a new
process's start). Each side loads in a fresh process, so that nothing an earlier test imported hides an import."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from nanovllm.utils.checkpoint import write_random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The modules a new process must not import to read a config and a tokenizer.
HEAVY = ("torch._dynamo", "sympy", "scipy", "pandas", "sklearn", "transformers.generation.utils")

PROBE = """
import json, sys
import torch  # the engine has it imported before it reads the config

mode, trust, folders = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
if mode == "engine":
    from nanovllm.utils.folder_checkpoint import folder_config, folder_tokenizer
    load = lambda folder: (folder_config(folder, trust), folder_tokenizer(folder, trust_remote_code=trust))
else:
    from transformers import AutoConfig, AutoTokenizer
    load = lambda folder: (AutoConfig.from_pretrained(folder, trust_remote_code=trust),
                           AutoTokenizer.from_pretrained(folder, trust_remote_code=trust))


def summary(config, tokenizer):
    text = "the quick brown fox <|im_start|>jumps\\n over  ü 你好<|im_end|>"
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]
    return dict(config_class=f"{type(config).__module__}.{type(config).__qualname__}", config=config.to_dict(),
                config_doc=type(config).__doc__,
                tokenizer_class=f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
                vocab=tokenizer.get_vocab(), length=len(tokenizer), special_tokens=tokenizer.special_tokens_map,
                added_tokens={i: str(token) for i, token in tokenizer.added_tokens_decoder.items()},
                special_ids=[tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
                chat_template=tokenizer.chat_template, encoded=tokenizer.encode(text),
                decoded=tokenizer.decode(tokenizer.encode(text)),
                chat=tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


loaded = {folder: summary(*load(folder)) for folder in folders}
print(json.dumps(dict(loaded=loaded, modules=sorted(sys.modules)), default=repr))
"""

# transformers 5.17 to 5.20's auto_factory, on any version: GenerationMixin imported at its top.
TOP_IMPORT = """
import importlib.machinery, importlib.util, sys


class TopImportLoader(importlib.machinery.SourceFileLoader):
    def exec_module(self, module):
        from transformers.generation import GenerationMixin
        module.GenerationMixin = GenerationMixin
        super().exec_module(module)


class TopImportFinder:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers.models.auto.auto_factory":
            origin = importlib.machinery.PathFinder.find_spec(name, path).origin
            return importlib.util.spec_from_file_location(name, origin, loader=TopImportLoader(name, origin))


sys.meta_path.insert(0, TopImportFinder())
import nanovllm.utils.lean_imports as lean_imports
lean_imports.auto_factory_imports_generation = lambda: True  # as before transformers 5.21
"""

AFTER_LOADING = """
import sys
import torch
from nanovllm.utils.folder_checkpoint import folder_config, folder_tokenizer

config, tokenizer = folder_config(sys.argv[1]), folder_tokenizer(sys.argv[1])
assert "transformers.generation.utils" not in sys.modules, "loading imported transformers.generation"
from transformers import AutoModelForCausalLM
from transformers.generation.utils import GenerationMixin

factory = sys.modules["transformers.models.auto.auto_factory"]
assert vars(factory).get("GenerationMixin", GenerationMixin) is GenerationMixin, "auto_factory kept the stand-in"
assert sys.modules["transformers.models.auto"].auto_factory is factory
stand_ins = [name for name, module in list(sys.modules.items()) if name.startswith("transformers") and any(
    isinstance(value, type) and value.__name__ == "GenerationMixin" and value is not GenerationMixin
    for value in list(vars(module).values()))]
assert not stand_ins, f"modules holding a stand-in GenerationMixin: {stand_ins}"
assert isinstance(AutoModelForCausalLM.from_config(config), GenerationMixin)
"""

REMOTE_CONFIG = """from transformers import Qwen3Config


class MyQwenConfig(Qwen3Config):
    model_type = "my_qwen"
"""


def probe(mode: str, *folders: str, trust_remote_code: bool = False) -> dict:
    """What a fresh process loads from each folder (mode "engine": folder_config and folder_tokenizer; else
    AutoConfig and AutoTokenizer), and which of HEAVY it imported on the way."""
    run = subprocess.run([sys.executable, "-c", PROBE, mode, "1" if trust_remote_code else "0", *folders],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    probed = json.loads(run.stdout.splitlines()[-1])
    return dict(loaded=probed["loaded"], imported=[name for name in HEAVY if name in probed["modules"]])


def edit_json(path: str, **values):
    with open(path) as f:
        content = json.load(f)
    with open(path, "w") as f:
        json.dump({**content, **values}, f)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Small checkpoints (config and tokenizer) that AutoTokenizer resolves in different ways: its own class named
    by tokenizer_config.json, Qwen2's registered class in place of the one named (transformers 5), Llama 3's
    PreTrainedTokenizerFast, Qwen3's Qwen2Tokenizer; and a config of remote code."""
    root = tmp_path_factory.mktemp("lean")
    made = {name: write_random_checkpoint(str(root / name), weights=False, architecture=architecture)
            for name, architecture in [("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                       ("llama", "LlamaForCausalLM")]}
    edit_json(os.path.join(made["llama"], "tokenizer_config.json"), tokenizer_class="PreTrainedTokenizerFast")
    made["qwen3_tokenizer"] = shutil.copytree(made["qwen3"], root / "qwen3_tokenizer")
    edit_json(os.path.join(made["qwen3_tokenizer"], "tokenizer_config.json"), tokenizer_class="Qwen2Tokenizer")
    made["remote"] = shutil.copytree(made["qwen3"], root / "remote")
    (root / "remote" / "configuration_my_qwen.py").write_text(REMOTE_CONFIG)
    edit_json(os.path.join(made["remote"], "config.json"), model_type="my_qwen",
              auto_map={"AutoConfig": "configuration_my_qwen.MyQwenConfig"})
    return {name: str(path) for name, path in made.items()}


def test_the_config_and_tokenizer_are_those_auto_classes_load(folders):
    engine, transformers = (probe(mode, *folders.values(), trust_remote_code=True) for mode in ("engine", "auto"))
    for name, folder in folders.items():
        for key, value in transformers["loaded"][folder].items():
            assert engine["loaded"][folder][key] == value, f"{name}: {key} differs"


def test_loading_imports_neither_torchs_compiler_nor_data_science_modules(folders):
    loaded = probe("engine", folders["qwen3"])
    assert loaded["imported"] == [], (f"imported {loaded['imported']}; AutoConfig and AutoTokenizer import "
                                      f"{probe('auto', folders['qwen3'])['imported']}")


@pytest.mark.parametrize("top_import", [False, True], ids=["as_installed", "auto_factory_importing_generation"])
def test_transformers_auto_classes_are_whole_after_loading(folders, top_import):
    """Loading imports no transformers.generation, even where auto_factory imports it at its top (emulated on
    versions that do not); what imports the auto classes afterwards gets them with the real GenerationMixin."""
    code = (TOP_IMPORT if top_import else "") + AFTER_LOADING
    run = subprocess.run([sys.executable, "-c", code, folders["qwen3"]], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
