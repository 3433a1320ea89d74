"""Where a model or tokenizer named in `LLM(...)` lives on disk: a local folder, or a Hugging Face repo
fetched into (or found in) the Hugging Face cache, as transformers resolves names."""
import os

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

# Config, weights, tokenizer (tokenizer.json, vocab.json, merges.txt, tokenizer.model, chat_template.jinja),
# generation_config.json, and code for trust_remote_code.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model", "*.py"]
TOKENIZER_FILES = [pattern for pattern in MODEL_FILES if pattern != "*.safetensors"]


def resolve_model_path(name: str, what: str = "model", revision: str | None = None, cache_dir: str | None = None,
                       token: bool | str | None = None, allow_patterns: list[str] = MODEL_FILES) -> str:
    """The local folder of `name`: the folder itself (`~` expanded) when it exists, else the snapshot of the
    Hugging Face repo `name` at `revision`, downloaded unless it is cached (HF_HUB_OFFLINE=1: cache only).

    A name that cannot be a repo id (an absolute or `~` path, `./x`, `a/b/c`) and is no folder raises
    ValueError "<what> folder ... does not exist"; so does a repo that cannot be found or fetched."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return path
    if not is_repo_id(name):
        raise ValueError(f"{what} folder {name!r} does not exist")
    return download(name, what, revision, cache_dir, token, allow_patterns)


def is_repo_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def download(repo_id: str, what: str, revision: str | None, cache_dir: str | None, token: bool | str | None,
             allow_patterns: list[str]) -> str:
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, token=token,
                                 allow_patterns=allow_patterns)
    except LocalEntryNotFoundError as error:  # offline or the Hub unreachable, and not (fully) in the cache
        why = "offline: HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "and the Hub is unreachable"
        raise ValueError(f"{what} {repo_id!r}{at(revision)} is neither a local folder nor found in the Hugging Face "
                         f"cache {cache_dir or constants.HF_HUB_CACHE} ({why})") from error
    except HfHubHTTPError as error:  # no such repo or revision, a gated repo, a bad token
        raise ValueError(f"{what} {repo_id!r}{at(revision)} is not a local folder, and the Hugging Face Hub "
                         f"refused it: {str(error).splitlines()[0]}") from error


def at(revision: str | None) -> str:
    return "" if revision is None else f" (revision {revision!r})"
