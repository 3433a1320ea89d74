import os
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig

from nanovllm.models.registry import check_architecture
from nanovllm.utils.gguf_checkpoint import gguf_config, is_gguf_file
from nanovllm.utils.model_path import MODEL_FILES, TOKENIZER_FILES, resolve_model_path

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# vLLM's dtype names: "half" is float16 and "float" float32.
DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
DEFAULT_MAX_MODEL_LEN = 4096
# vLLM's offline engine runs up to 1024 sequences at once on GPUs of 70 GiB and more, 256 elsewhere.
LARGE_GPU_BYTES, LARGE_GPU_MAX_NUM_SEQS, DEFAULT_MAX_NUM_SEQS = 70 * 2**30, 1024, 256


@dataclass(slots=True)
class Config:
    """Engine settings, with vLLM's names. `LLM(model, **kwargs)` takes any of these fields as keyword arguments,
    and the vLLM arguments of `VLLM_ARGS` at the values this engine runs as.

    `model` is a local folder (`~` expanded) or a Hugging Face repo id, fetched at `revision` into `download_dir`
    (default: the Hugging Face cache) unless it is cached there, as transformers does; `tokenizer` (default: the
    model's) likewise at `tokenizer_revision`. Once built, `model` and `tokenizer` are local folders.
    `max_model_len` defaults to 4096 capped at the model's `max_position_embeddings`; a larger explicit value is
    refused, as in vLLM. `seed` seeds the sampling of requests without a seed of their own, so a script samples
    the same each run (None: differently each run).

    On a CPU, `num_kvcache_blocks=-1` sizes the cache to `CPU_KVCACHE_BYTES` (1 GiB),
    and at least to one sequence of `max_model_len` tokens. On CUDA it takes what is left of
    `gpu_memory_utilization` x the GPU's memory after the model and a warm-up pass at
    `max_num_batched_tokens`; `dtype='auto'` turns a float32 checkpoint into bfloat16 there.
    """

    model: str
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    trust_remote_code: bool = False
    download_dir: str | None = None
    hf_token: bool | str | None = None
    seed: int | None = 0
    quantization: str | None = None
    max_num_batched_tokens: int = 16384
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    device: str = "auto"
    dtype: str | torch.dtype = "auto"
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    generation_config: str = "auto"
    profiler_config: dict | None = None
    hf_config: AutoConfig = field(init=False)
    torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self):
        self._check_engine_args()
        self._resolve_paths()
        self._check_load_format()
        self._check_generation_config()
        if is_gguf_file(self.model):
            self.hf_config = gguf_config(self.model)
        else:
            self._check_model_folder()
            self.hf_config = AutoConfig.from_pretrained(self.model, trust_remote_code=self.trust_remote_code)
        self._check_unquantized()
        self._resolve_device_and_dtype()
        self._resolve_max_model_len()
        check_architecture(self.hf_config, self.max_model_len)
        self._resolve_max_num_seqs()
        self._check_numbers()

    def _check_engine_args(self):
        if self.quantization is not None:
            raise ValueError(f"quantization={self.quantization!r} is not supported: this engine runs unquantized "
                             f"checkpoints only (bfloat16, float16 or float32 weights)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    def _resolve_paths(self):
        hub = dict(cache_dir=self.download_dir and os.path.expanduser(self.download_dir), token=self.hf_token)
        name = self.model
        if is_gguf_file(name):  # a GGUF file is its own checkpoint and, unless one is named, tokenizer
            self.model = os.path.abspath(os.path.expanduser(name))
            self.tokenizer = self.model if self.tokenizer is None else resolve_model_path(
                self.tokenizer, "tokenizer", self.tokenizer_revision, allow_patterns=TOKENIZER_FILES, **hub)
            return
        self.model = resolve_model_path(name, "model", self.revision, allow_patterns=MODEL_FILES, **hub)
        if self.tokenizer is None and self.tokenizer_revision is None:
            self.tokenizer = self.model
        else:
            self.tokenizer = resolve_model_path(self.tokenizer or name, "tokenizer", self.tokenizer_revision,
                                                allow_patterns=TOKENIZER_FILES, **hub)

    def _check_load_format(self):
        """vLLM's load formats this engine has: 'auto' (a GGUF file, else a folder's safetensors), 'safetensors',
        'gguf', and 'dummy' (random weights for the checkpoint's config: no weight file is read)."""
        gguf = is_gguf_file(self.model)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} is not supported; supported: {', '.join(LOAD_FORMATS)}")
        if (self.load_format, gguf) in (("safetensors", True), ("gguf", False)):
            wants, given = ("a folder", "a GGUF file") if gguf else ("a GGUF file", "a folder")
            raise ValueError(f"load_format={self.load_format!r} reads {wants}, and {self.model!r} is {given}: "
                             f"give load_format='auto'")

    def _check_generation_config(self):
        source = self.generation_config
        if source not in ("auto", "vllm"):
            if not os.path.isfile(os.path.join(os.path.expanduser(source), "generation_config.json")):
                raise ValueError(f"generation_config={source!r} is neither 'auto', 'vllm' nor a folder holding a "
                                 f"generation_config.json")
            self.generation_config = os.path.expanduser(source)

    def _check_model_folder(self):
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"model folder {self.model!r} has no config.json")
        if self.load_format != "dummy" and not any(name.endswith(".safetensors") for name in os.listdir(self.model)):
            raise ValueError(f"model folder {self.model!r} holds no *.safetensors weights")

    def _resolve_device_and_dtype(self):
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {self.device!r}")
        if self.dtype == "auto":
            self.torch_dtype = getattr(self.hf_config, "dtype", None) or torch.float32
            if isinstance(self.torch_dtype, str):
                self.torch_dtype = DTYPES[self.torch_dtype]
        elif self.dtype in DTYPES or self.dtype in DTYPES.values():
            self.torch_dtype = DTYPES.get(self.dtype, self.dtype)
        else:
            raise ValueError(f"dtype must be 'auto', one of {sorted(DTYPES)} or a torch dtype of those, "
                             f"got {self.dtype!r}")
        if self.device == "cuda" and self.torch_dtype == torch.float32:
            if self.dtype != "auto":
                raise ValueError(f"float32 (dtype={self.dtype!r}) is not supported on CUDA (flash-attn has no "
                                 f"float32 kernels): use 'bfloat16', or device='cpu'")
            self.torch_dtype = torch.bfloat16  # a float32 checkpoint runs in bfloat16, as in vLLM

    def _check_unquantized(self):
        if getattr(self.hf_config, "quantization_config", None):
            raise ValueError(f"model {self.model!r} is a quantized checkpoint (its config.json has a "
                             f"quantization_config): this engine runs unquantized checkpoints only")

    def _resolve_max_model_len(self):
        limit = self.hf_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = min(DEFAULT_MAX_MODEL_LEN, limit)
        elif self.max_model_len > limit:  # rotary positions past the limit do not exist
            raise ValueError(f"User-specified max_model_len ({self.max_model_len}) is greater than the derived "
                             f"max_model_len (max_position_embeddings={limit} in the model's config.json): "
                             f"give at most {limit}, or leave max_model_len out")

    def _resolve_max_num_seqs(self):
        if self.max_num_seqs is None:
            large = self.device == "cuda" and torch.cuda.get_device_properties(0).total_memory >= LARGE_GPU_BYTES
            self.max_num_seqs = LARGE_GPU_MAX_NUM_SEQS if large else DEFAULT_MAX_NUM_SEQS

    def _check_numbers(self):
        positive = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kvcache_block_size < 16 or self.kvcache_block_size % 16:
            raise ValueError(f"kvcache_block_size must be a positive multiple of 16, got {self.kvcache_block_size}")
        if self.device == "cuda" and self.kvcache_block_size % 256:
            raise ValueError(
                f"kvcache_block_size must be a multiple of 256 on CUDA (flash-attn's paged KV), "
                f"got {self.kvcache_block_size}"
            )
        if self.num_kvcache_blocks == 0 or self.num_kvcache_blocks < -1:
            raise ValueError(f"num_kvcache_blocks must be -1 (auto) or positive, got {self.num_kvcache_blocks}")
        self._check_tensor_parallel_size()

    def _check_tensor_parallel_size(self):
        tp = self.tensor_parallel_size
        for name in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(self.hf_config, name)
            if heads % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name}={heads}")
        if self.device == "cuda" and tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={tp} exceeds the {torch.cuda.device_count()} visible GPUs")


# vLLM engine arguments this engine takes only at the values it runs as (the first is vLLM's default); any other
# value raises ValueError with the hint. None in place of the values: any value runs the same (vLLM's knobs for
# machinery this engine does not have: CPU swap space, stat logging, custom all-reduce, graph-capture lengths).
VLLM_ARGS: dict[str, tuple[tuple | None, str]] = {
    "tokenizer_mode": (("auto",), "the tokenizer is loaded with transformers' AutoTokenizer"),
    "skip_tokenizer_init": ((False,), "the engine needs the tokenizer for text prompts, stop strings and output"),
    "kv_cache_dtype": (("auto",), "the KV cache is kept in the model's dtype"),
    "task": (("auto", "generate"), "this engine generates text only"),
    "pipeline_parallel_size": ((1,), "split the model across GPUs with tensor_parallel_size"),
    "data_parallel_size": ((1,), "start one engine per group of GPUs"),
    "distributed_executor_backend": ((None, "mp", "uni"), "tensor-parallel workers are local processes ('mp')"),
    "enable_lora": ((False,), "merge the LoRA adapter into the checkpoint's weights"),
    "cpu_offload_gb": ((0,), "the weights stay on the GPUs: raise tensor_parallel_size to fit a larger model"),
    "enable_chunked_prefill": ((None, True), "prompts longer than max_num_batched_tokens are always prefilled in "
                                             "chunks; raise max_num_batched_tokens to prefill each in one step"),
    "scheduling_policy": (("fcfs",), "requests are scheduled first come, first served"),
    "swap_space": (None, ""),
    "disable_log_stats": (None, ""),
    "max_seq_len_to_capture": (None, ""),
    "disable_custom_all_reduce": (None, ""),
    "disable_async_output_proc": (None, ""),
}
# vLLM's names for settings this engine spells differently.
VLLM_RENAMED_ARGS = {"block_size": "kvcache_block_size", "num_gpu_blocks_override": "num_kvcache_blocks"}


def make_config(model: str, kwargs: dict) -> Config:
    """Build a Config from `LLM`'s keyword arguments: Config fields, and vLLM's arguments of VLLM_ARGS (checked,
    then dropped). A vLLM name this engine spells differently raises ValueError, an unknown name TypeError."""
    names = {f.name for f in fields(Config) if f.init}
    for name, value in kwargs.items():
        if name not in names:
            check_vllm_arg(name, value, names)
    return Config(model, **{name: value for name, value in kwargs.items() if name in names})


def check_vllm_arg(name: str, value, names: set[str]):
    if name in VLLM_RENAMED_ARGS:
        raise ValueError(f"{name!r} is called {VLLM_RENAMED_ARGS[name]!r} in this engine: "
                         f"pass {VLLM_RENAMED_ARGS[name]}={value!r}")
    if name not in VLLM_ARGS:
        valid = ", ".join(sorted(names - {"model"} | VLLM_ARGS.keys()))
        raise TypeError(f"unknown engine argument {name!r}; valid arguments: {valid}")
    values, hint = VLLM_ARGS[name]
    if values is not None and value not in values:
        raise ValueError(f"{name}={value!r} is not supported ({' or '.join(map(repr, values))} only): {hint}")
